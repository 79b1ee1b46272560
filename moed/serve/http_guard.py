"""ResponseGuard: no request gets a 200 it cannot keep, and every response is completed.

What this module owns: one ASGI middleware around llama_cpp.server's app.

A streamed completion's response (sse_starlette) sends its 200 headers at once and
only then asks the model for tokens, so an error of the request (a prompt longer
than the context, an unknown model, moed unreachable) would arrive after the
200: the soak saw an empty 200 stream, and the next request on that keep-alive
connection fail. The guard holds the response start back until the first event
that carries data (SSE comments, the keep-alive pings, are dropped until then),
so everything that fails before the first token is answered with its own 4xx/5xx
by `http_errors.error_response`, on a connection that stays usable.

Invariants:
- a response is started at most once and, once started, always completed: an
  error after the first event ends the stream with an OpenAI error event
  (`data: {"error": ...}`, which the openai client raises as an APIError) and the
  final empty body, and an app that returns without completing (a stream cut by
  cancellation) gets the final body from the guard. uvicorn's "ASGI callable
  returned without completing response" cannot happen behind it;
- cancellation (the client went away, the server stops) is never swallowed.
"""

from __future__ import annotations

import json
from typing import Any

import anyio

from moed.serve.http_errors import error_response, parse_body


def _leaf(exc: BaseException) -> BaseException:
    """The error itself: out of one-member exception groups (anyio task groups wrap them),
    and out of starlette's "response already started" (our held start looks sent to it)."""
    while True:
        if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
            exc = exc.exceptions[0]
        elif isinstance(exc, RuntimeError) and exc.__cause__ is not None and "already started" in str(exc):
            exc = exc.__cause__
        else:
            return exc


class _Response:
    """One request's response as the guard has passed it on (see module)."""

    def __init__(self, send):
        self.send = send
        self.start: dict | None = None  # held until the first data
        self.held: list[dict] = []
        self.started = self.completed = False

    async def __call__(self, message: dict) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.start = message
            return
        if kind != "http.response.body" or self.started:
            if kind == "http.response.body" and not message.get("more_body", False):
                self.completed = True
            await self.send(message)
            return
        body = message.get("body", b"")
        if body.startswith(b":"):  # an SSE comment (ping) before any data: nothing to say yet
            return
        self.held.append(message)
        if body or not message.get("more_body", False):
            if message.get("more_body", False):  # data: the response is what the app says
                await self.flush()

    async def flush(self) -> None:
        """Pass on the held start and bodies (the app's response stands)."""
        if self.started or self.start is None:
            return
        self.started = True
        await self.send(self.start)
        for m in self.held:
            if not m.get("more_body", False):
                self.completed = True
            await self.send(m)
        self.held = []

    async def finish(self) -> None:
        """After the app returned: pass on what it held, and complete what it left open."""
        await self.flush()
        if self.started and not self.completed:
            self.completed = True
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def fail(self, exc: BaseException, request_body: bytes) -> None:
        status, error = error_response(exc, parse_body(request_body))
        if not self.started:
            self.started = self.completed = True
            payload = json.dumps({"error": error}).encode()
            await self.send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(payload)).encode()),
                    ],
                }
            )
            await self.send({"type": "http.response.body", "body": payload, "more_body": False})
        elif not self.completed:
            self.completed = True
            event = b"data: " + json.dumps({"error": error}).encode() + b"\n\n"
            await self.send({"type": "http.response.body", "body": event, "more_body": True})
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})


class ResponseGuard:
    """ASGI middleware (see module)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_body = bytearray()

        async def recording_receive() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                request_body.extend(message.get("body", b""))
            return message

        response = _Response(send)
        try:
            await self.app(scope, recording_receive, response)
        except BaseException as exc:  # noqa: BLE001 - mapped to a response; cancellation re-raised
            leaf = _leaf(exc)
            if isinstance(leaf, (anyio.get_cancelled_exc_class(), KeyboardInterrupt, SystemExit)):
                raise
            await response.fail(leaf, bytes(request_body))
            return
        await response.finish()


__all__ = ["ResponseGuard"]
