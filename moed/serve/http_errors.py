"""The server's error table: every failure of a request as one HTTP status and one OpenAI error.

What this module owns: the typed errors `moectl serve` raises (`InvalidRequest`,
`ModelNotFound`, `ExpertReadFailed`) and `error_response`, the one function that
turns any exception a request raised into `(status, ErrorResponse)`. Both the
route handler of llama_cpp.server (its `RouteErrorHandler.error_message_wrapper`,
replaced by `install`) and the response guard (a streamed request's errors, which
the route never sees) answer through it, so a streamed and a plain request with
the same fault get the same status and message.

Invariants:
- a request's own fault is a 4xx (`invalid_request_error`), never a 500: the
  body's validation errors (FastAPI's 422) are 400s naming the field, as OpenAI
  answers them; a body that is not JSON is a 400;
- a message is one line of text, never a traceback (tracebacks go to the log,
  and only for the 500s nothing here expected);
- the server's own pattern table (context length, moed unavailable) keeps its
  formatters: they run for the errors this module has no type for.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any, cast

from fastapi import HTTPException
from fastapi.exceptions import RequestValidationError
from llama_cpp.server.errors import ErrorResponse, RouteErrorHandler
from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest

from moed.serve.envelope import error_fields


class ServeError(Exception):
    """An error with its own HTTP status and OpenAI error fields."""

    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param

    def response(self) -> tuple[int, ErrorResponse]:
        return self.status, cast(ErrorResponse, error_fields(str(self), self.type, self.param, self.code))


class InvalidRequest(ServeError, ValueError):
    """The request asks for something no model can do (400)."""

    status = 400
    type = "invalid_request_error"


class ModelNotFound(InvalidRequest):
    """The request names a model this server does not serve (404, as OpenAI answers it)."""

    status = 404
    code = "model_not_found"

    def __init__(self, name: str, served: list[str]):
        super().__init__(f"The model `{name}` does not exist; this server serves {', '.join(served)}", "model")


class MoedUnavailable(ServeError, RuntimeError):
    """moed does not answer (503): the message starts with "moed unavailable: " and says why."""

    status = 503
    type = "service_unavailable"
    code = "moed_unavailable"


class ExpertReadFailed(ServeError):
    """moed could not read an expert this request needed (502: the expert store failed, not the request)."""

    status = 502
    code = "moed_read_error"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """'max_tokens: Input should be greater than or equal to 0 (got -1)' for the first error."""
    errs = exc.errors()
    if not errs:
        return "invalid request body", None
    first = errs[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    field = ".".join(loc) or None
    got = f" (got {json.dumps(first['input'], default=str)[:80]})" if "input" in first and field else ""
    more = f"; and {len(errs) - 1} more" if len(errs) > 1 else ""
    return f"{field + ': ' if field else ''}{first.get('msg', 'invalid')}{got}{more}", field


def parse_body(raw: bytes) -> CreateCompletionRequest | CreateChatCompletionRequest | None:
    """The request model of a completion or chat body (what the server's formatters are given)."""
    try:
        data = json.loads(raw or b"null")
        if isinstance(data, dict) and "messages" in data:
            return CreateChatCompletionRequest(**data)
        if isinstance(data, dict) and "prompt" in data:
            return CreateCompletionRequest(**data)
    except (ValueError, TypeError):  # pydantic's ValidationError is a ValueError
        pass
    return None


def error_response(exc: BaseException, body: Any = None) -> tuple[int, ErrorResponse]:
    """(status, OpenAI error) for any exception a request raised (see module)."""
    if isinstance(exc, ServeError):
        return exc.response()
    if isinstance(exc, RequestValidationError):
        message, field = _validation_message(exc)
        return 400, ErrorResponse(message=message, type="invalid_request_error", param=field, code=None)
    if isinstance(exc, json.JSONDecodeError):
        return 400, ErrorResponse(
            message=f"the request body is not JSON: {exc}", type="invalid_request_error", param=None, code=None
        )
    if isinstance(exc, AssertionError) and isinstance(body, CreateCompletionRequest) and isinstance(body.prompt, list):
        # The server's route asserts one prompt a request.
        return 400, ErrorResponse(
            message=f"one prompt a request: {len(body.prompt)} were given",
            type="invalid_request_error",
            param="prompt",
            code=None,
        )
    if isinstance(exc, HTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return exc.status_code, ErrorResponse(message=str(exc.detail), type=kind, param=None, code=None)
    if body is not None:
        for pattern, formatter in RouteErrorHandler.pattern_and_formatters.items():
            match = pattern.search(str(exc))
            if match is not None:
                return formatter(body, match)
    print(f"moectl serve: unexpected {type(exc).__name__}: {exc}", file=sys.stderr)
    traceback.print_exception(exc, file=sys.stderr)
    return 500, ErrorResponse(message=f"internal error: {exc}", type="server_error", param=None, code=None)


def _route_error_message(self, error: Exception, body=None) -> tuple[int, ErrorResponse]:
    return error_response(error, body)


def install() -> None:
    """Make the server's routes answer through `error_response` (their handler calls this method)."""
    setattr(RouteErrorHandler, "error_message_wrapper", _route_error_message)  # noqa: B010 - the seam


__all__ = [
    "InvalidRequest",
    "ExpertReadFailed",
    "ModelNotFound",
    "MoedUnavailable",
    "ServeError",
    "error_response",
    "install",
    "parse_body",
]
