"""The server's error table (moed.serve.http_errors) and ServedLlama's mapping of moed's failures.

Pure: exceptions in, (status, OpenAI error) out. The same table answers real
requests in tests/e2e/test_serve_requests.py.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("llama_cpp.server.app")  # the [server] extra

from fastapi.exceptions import RequestValidationError  # noqa: E402

from moed.protocol import errors  # noqa: E402
from moed.serve import app as serving  # noqa: E402
from moed.serve.http_errors import ExpertReadFailed, ModelNotFound, error_response, parse_body  # noqa: E402


def test_a_read_error_is_a_502_naming_the_expert():
    exc = errors.ReadError("reading layer 1 expert 5 part down of /m/bad.gguf failed: [Errno 5] EIO (3 attempts)")
    with pytest.raises(ExpertReadFailed) as mapped:
        with serving._served_errors(None):  # type: ignore[arg-type]
            raise exc
    status, body = error_response(mapped.value)
    assert status == 502 and body["code"] == "moed_read_error" and body["type"] == "server_error"
    assert body["message"].startswith("moed could not read an expert: ")
    assert "layer 1 expert 5 part down" in body["message"]


def test_a_lost_daemon_is_a_503():
    with pytest.raises(serving.MoedUnavailable) as mapped:
        with serving._served_errors(None):  # type: ignore[arg-type]
            raise errors.DaemonUnavailable("cannot connect to moed at /run/moed.sock")
    status, body = error_response(mapped.value)
    assert status == 503 and body["message"].startswith("moed unavailable: cannot connect")


def test_validation_errors_are_400s_naming_the_field():
    exc = RequestValidationError(
        [{"type": "greater_than_equal", "loc": ("body", "max_tokens"), "msg": "Input should be >= 0", "input": -1}]
    )
    status, body = error_response(exc)
    assert status == 400 and body["param"] == "max_tokens"
    assert body["message"] == "max_tokens: Input should be >= 0 (got -1)"


def test_unknown_model_is_a_404_listing_what_is_served():
    status, body = error_response(ModelNotFound("gpt-4", ["m", "n"]))
    assert status == 404 and body["code"] == "model_not_found"
    assert body["message"] == "The model `gpt-4` does not exist; this server serves m, n"


def test_the_servers_own_context_formatter_still_answers():
    body = parse_body(json.dumps({"prompt": "x", "max_tokens": 1000}).encode())
    status, error = error_response(ValueError("Requested tokens (30) exceed context window of 128"), body)
    assert status == 400 and error["code"] == "context_length_exceeded"
    assert "maximum context length is 128 tokens, however you requested 1030 tokens" in error["message"]


def test_an_unexpected_error_is_a_500_without_a_traceback(capsys):
    status, body = error_response(RuntimeError("boom"))
    assert status == 500 and body["message"] == "internal error: boom"
    assert "RuntimeError: boom" in capsys.readouterr().err  # the log has it (with its traceback when raised)


def test_a_read_error_with_its_facts_names_them_first():
    exc = errors.ReadError("[Errno 5] EIO (3 attempts)", model="/m/bad.gguf", layer=1, expert=5, part="down", errno=5)
    with pytest.raises(ExpertReadFailed) as mapped:
        with serving._served_errors(None):  # type: ignore[arg-type]
            raise exc
    assert (
        str(mapped.value) == "moed could not read expert 5 of layer 1 (down) of /m/bad.gguf: [Errno 5] EIO (3 attempts)"
    )
