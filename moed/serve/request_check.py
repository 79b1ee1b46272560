"""The front's check of a completion request before any worker or daemon sees it.

What this module owns: the OpenAI rules the front enforces itself on
`POST /v1/completions` and `POST /v1/chat/completions`, so that a bad request gets
the same 400 whatever the daemon's or the workers' state (a malformed body used to
get 503 while the daemon was down, because it reached a worker first). One rule per
field, each as OpenAI states it:
- the body is a JSON object;
- `temperature`: a number in [0, 2];
- `n`: 1 (OpenAI allows up to 128 choices; this server returns one choice a
  request, so asking for more is refused rather than silently answered with one);
- `logprobs` of a completion: an integer in [0, 5]; of a chat completion, a boolean;
- `top_logprobs` of a chat completion: an integer in [0, 20].
Absent or null fields are left to the server's defaults. Pure: no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused: OpenAI's `message` and the offending `param`."""

    message: str
    param: str | None = None


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check(path: str, body: bytes) -> Refusal | None:
    """The refusal for a completion request at `path`, or None (other paths: None)."""
    if path not in (COMPLETIONS, CHAT):
        return None
    try:
        data = json.loads(body or b"null")
    except ValueError as exc:
        return Refusal(f"the request body is not JSON: {exc}")
    if not isinstance(data, dict):
        return Refusal("the request body must be a JSON object")
    rules = [
        ("temperature", lambda v: _number(v) and 0 <= v <= 2, "a number between 0 and 2"),
        ("n", lambda v: v == 1 and _integer(v), "1: this server returns one choice a request"),
    ]
    if path == COMPLETIONS:
        rules.append(("logprobs", lambda v: _integer(v) and 0 <= v <= 5, "an integer between 0 and 5"))
    else:
        rules.append(("logprobs", lambda v: isinstance(v, bool), "a boolean"))
        rules.append(("top_logprobs", lambda v: _integer(v) and 0 <= v <= 20, "an integer between 0 and 20"))
    for field, ok, what in rules:
        value = data.get(field)
        if value is not None and not ok(value):
            return Refusal(f"{field} must be {what} (got {json.dumps(value)[:40]})", field)
    return None
