"""The OpenAI error envelope, the one shape every error of `moectl serve` is answered in.

What this module owns: `error_fields` (the `error` object: message, type, param, code)
and `error_body` (the JSON bytes of `{"error": ...}`). The front (moed.serve.front)
answers its own errors with them before any worker runs; a worker's error table
(moed.serve.http_errors) builds its ErrorResponse from `error_fields`: one shape, two
processes. Standard library only, so the front stays free of llama_cpp and FastAPI.
"""

from __future__ import annotations

import json


def error_fields(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, str | None]:
    """The `error` object of an OpenAI error response."""
    return {"message": message, "type": kind, "param": param, "code": code}


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> bytes:
    """A whole error response body: `{"error": error_fields(...)}` as JSON bytes."""
    return json.dumps({"error": error_fields(message, kind, param, code)}).encode()
