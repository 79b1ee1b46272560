"""The front's own request rules (moed.serve.request_check): OpenAI's ranges, refused with a 400."""

from __future__ import annotations

import json

import pytest

from moed.serve.request_check import CHAT, COMPLETIONS, check


def body(**fields) -> bytes:
    return json.dumps({"prompt": "hi", **fields}).encode()


@pytest.mark.parametrize(
    "path, raw, param",
    [
        (COMPLETIONS, b"{not json", None),
        (COMPLETIONS, b"[1, 2]", None),
        (COMPLETIONS, body(temperature=-1), "temperature"),
        (COMPLETIONS, body(temperature=2.5), "temperature"),
        (COMPLETIONS, body(temperature="hot"), "temperature"),
        (COMPLETIONS, body(n=1000), "n"),
        (COMPLETIONS, body(n=0), "n"),
        (COMPLETIONS, body(logprobs=1000), "logprobs"),
        (COMPLETIONS, body(logprobs=True), "logprobs"),
        (CHAT, body(logprobs=3), "logprobs"),
        (CHAT, body(top_logprobs=21), "top_logprobs"),
    ],
)
def test_out_of_range_fields_are_refused_naming_the_field(path, raw, param):
    refusal = check(path, raw)
    assert refusal is not None and refusal.param == param
    if param:
        assert refusal.message.startswith(f"{param} must be")


@pytest.mark.parametrize(
    "path, raw",
    [
        (COMPLETIONS, body()),
        (COMPLETIONS, body(temperature=0, n=1, logprobs=5)),
        (COMPLETIONS, body(temperature=2.0, logprobs=None)),
        (CHAT, body(logprobs=True, top_logprobs=20, temperature=0.7)),
        ("/v1/models", b"{not json"),  # not a completion: not this check's
    ],
)
def test_valid_requests_pass(path, raw):
    assert check(path, raw) is None
