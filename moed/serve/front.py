"""Front: the one listening socket of `moectl serve`, spreading requests over engine workers.

What this module owns: the ASGI app the front's uvicorn runs. Each request is
sent whole to one worker of its model (moed.serve.pool decides which, or makes it
wait), over that worker's Unix socket, and the worker's answer is relayed back as
it comes (a stream chunk by chunk). The front answers itself only what needs no
engine: GET /v1/models (every model's alias), GET /moed/workers (dispatch state,
JSON), 401 for a missing API key, 404 `model_not_found`, 413 for a body over
MAX_BODY_BYTES, and 503 with Retry-After when the model's queue is full.

Why a front and not N processes accepting on one shared socket: the kernel hands a
connection to whichever process accepts it, busy or not, and a keep-alive
connection stays with it, so a request would wait behind a busy worker while
another is idle, and there would be no place to bound the wait. The front's hop
costs one Unix-socket round trip a request and a copy of each chunk.

Invariants:
- a response is started once and always completed: a worker that dies before its
  headers gives a 502 naming it; one that dies mid-stream ends the stream with an
  OpenAI error event (the openai client raises it); never a silent short stream;
- a client that goes away closes the worker's response, so the worker's server
  stops generating for it and the worker is free again;
- the request a dead worker held is never sent again elsewhere (it may have run);
  one that could not even be connected to it (the worker died a moment before,
  and its supervisor has not yet seen the exit) is, up to UNDELIVERED_TRIES.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from typing import Any

import httpx2 as httpx

from moed.serve import request_check
from moed.serve.envelope import error_body
from moed.serve.metrics import ServeMetrics
from moed.serve.pool import NoWorker, QueueFull, WorkerPool, WorkerSlot

RETRY_AFTER_S = 1
UNDELIVERED_TRIES, UNDELIVERED_PAUSE_S = 3, 0.1  # a worker that died a moment ago is not yet out of dispatch
MAX_BODY_BYTES = 16 << 20  # a request is read whole before a worker is chosen: bounded
_HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade", b"host", b"content-length"}
_TOKEN_CHUNK = re.compile(rb'"finish_reason": null')
_ROLE_CHUNK = re.compile(rb'"delta": \{"role": "assistant"\}')


def _error(message: str, kind: str, code: str | None = None, param: str | None = None) -> bytes:
    return error_body(message, kind, param, code)


async def _answer(send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class BodyTooLarge(Exception):
    pass


class _Undelivered(Exception):
    """The worker could not be connected to: the request never reached it, so another may serve it."""


async def _read_body(receive) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionResetError("the client left before its request arrived")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BodyTooLarge(f"the request body is over {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _model_of(body: bytes) -> str | None:
    """The `model` a JSON request names (None: not JSON, or names none)."""
    with contextlib.suppress(ValueError):
        data = json.loads(body or b"null")
        if isinstance(data, dict) and isinstance(data.get("model"), str):
            return data["model"]
    return None


class _Relay:
    """One request's answer on its way from a worker to the client."""

    def __init__(self, send, metrics: ServeMetrics, model: str, arrived: float):
        self.send, self.metrics, self.model, self.arrived = send, metrics, model, arrived
        self.status = 0
        self.started = self.completed = self.streaming = self.first_event = False
        self.tokens = 0
        self.json_tail = bytearray()  # a plain answer's body, for its usage

    async def start(self, response: httpx.Response) -> None:
        self.status = response.status_code
        self.streaming = response.headers.get("content-type", "").startswith("text/event-stream")
        headers = [(k, v) for k, v in response.headers.raw if k.lower() not in _HOP_BY_HOP]
        await self.send({"type": "http.response.start", "status": self.status, "headers": headers})
        self.started = True

    async def body(self, chunk: bytes) -> None:
        if self.streaming:
            if not self.first_event and chunk.startswith(b"data: {"):
                self.first_event = True  # the worker's guard sends nothing before the first token
                self.metrics.ttft.labels(self.model).observe(time.monotonic() - self.arrived)
            self.tokens += len(_TOKEN_CHUNK.findall(chunk)) - len(_ROLE_CHUNK.findall(chunk))
        elif len(self.json_tail) < 1 << 20:
            self.json_tail.extend(chunk)
        await self.send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def finish(self) -> None:
        if not self.streaming:
            with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):  # an error body: none
                self.tokens = int(json.loads(self.json_tail)["usage"]["completion_tokens"])
        self.completed = True
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def fail(self, status: int, message: str, code: str) -> None:
        """The worker failed this request: an error answer, or the end of a started stream."""
        if not self.started:
            self.status = status
            self.started = self.completed = True
            await _answer(self.send, status, _error(message, "server_error", code))
            return
        if not self.completed:
            self.completed = True
            event = b"data: " + _error(message, "server_error", code) + b"\n\n"
            await self.send({"type": "http.response.body", "body": event, "more_body": True})
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    def count(self) -> None:
        self.metrics.requests.labels(self.model, str(self.status)).inc()
        self.metrics.duration.labels(self.model).observe(time.monotonic() - self.arrived)
        if self.tokens > 0:
            self.metrics.tokens.labels(self.model).inc(self.tokens)


class Front:
    """The ASGI app (see module)."""

    def __init__(self, pools: dict[str, WorkerPool], metrics: ServeMetrics, api_key: str | None = None):
        self.pools, self.metrics, self.api_key = pools, metrics, api_key
        self.default = next(iter(pools))
        self._clients: dict[str, httpx.AsyncClient] = {}

    def _client(self, slot: WorkerSlot) -> httpx.AsyncClient:
        client = self._clients.get(slot.address)
        if client is None:
            transport = httpx.AsyncHTTPTransport(uds=slot.address)
            timeout = httpx.Timeout(connect=10, read=None, write=30, pool=10)
            client = self._clients[slot.address] = httpx.AsyncClient(transport=transport, timeout=timeout)
        return client

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()

    def workers_state(self) -> dict[str, Any]:
        return {
            name: {
                "queued": pool.queued,
                "queue_bound": pool.queue_bound,
                "workers": [
                    {
                        "index": s.index,
                        "pid": s.pid,
                        "ready": s.ready,
                        "in_flight": s.in_flight,
                        "served": s.served,
                        "restarts": s.restarts,
                        "last_exit": s.last_exit,
                    }
                    for s in pool.slots
                ],
            }
            for name, pool in self.pools.items()
        }

    def _authorized(self, scope) -> bool:
        if self.api_key is None:
            return True
        headers = dict(scope.get("headers", []))
        return headers.get(b"authorization", b"") == b"Bearer " + self.api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if not self._authorized(scope):
            await _answer(send, 401, _error("Invalid API key", "invalid_request_error", "invalid_api_key"))
            return
        if method == "GET" and path == "/v1/models":
            data = [{"id": name, "object": "model", "owned_by": "me", "permissions": []} for name in self.pools]
            await _answer(send, 200, json.dumps({"object": "list", "data": data}).encode())
            return
        if method == "GET" and path == "/moed/workers":
            await _answer(send, 200, json.dumps(self.workers_state()).encode())
            return
        try:
            body = await _read_body(receive)
        except ConnectionResetError:
            return
        except BodyTooLarge as exc:
            await _answer(send, 413, _error(str(exc), "invalid_request_error", "request_too_large"))
            return
        refusal = request_check.check(path, body) if method == "POST" else None
        if refusal is not None:  # before any worker or the daemon: the same 400 whatever their state
            await _answer(send, 400, _error(refusal.message, "invalid_request_error", None, refusal.param))
            self.metrics.requests.labels(_model_of(body) or self.default, "400").inc()
            return
        await self._dispatch(scope, receive, send, body)

    async def _dispatch(self, scope, receive, send, body: bytes) -> None:
        arrived = time.monotonic()
        name = _model_of(body) or self.default
        pool = self.pools.get(name)
        if pool is None:
            served = ", ".join(self.pools)
            message = f"The model `{name}` does not exist; this server serves {served}"
            await _answer(send, 404, _error(message, "invalid_request_error", "model_not_found"))
            self.metrics.requests.labels(name, "404").inc()
            return
        relay = _Relay(send, self.metrics, name, arrived)
        try:
            for attempt in range(UNDELIVERED_TRIES):
                try:
                    async with pool.worker() as slot:
                        await self._relay(slot, scope, receive, body, relay, last=attempt == UNDELIVERED_TRIES - 1)
                    break
                except _Undelivered:
                    await asyncio.sleep(UNDELIVERED_PAUSE_S)  # its supervisor sees the exit meanwhile
        except QueueFull as exc:
            relay.status = 503
            busy = _error(str(exc), "service_unavailable", "server_busy")
            await _answer(send, 503, busy, [(b"retry-after", str(RETRY_AFTER_S).encode())])
        except NoWorker as exc:
            relay.status = 503
            stopping = _error(str(exc), "service_unavailable", "server_stopping")
            await _answer(send, 503, stopping, [(b"retry-after", str(RETRY_AFTER_S).encode())])
        relay.count()

    async def _relay(self, slot: WorkerSlot, scope, receive, body: bytes, relay: _Relay, last: bool) -> None:
        """Send the request to `slot`'s worker and its answer to the client, until either side ends."""
        relaying = asyncio.create_task(self._forward(slot, scope, body, relay, last))
        leaving = asyncio.create_task(_disconnected(receive))
        await asyncio.wait({relaying, leaving}, return_when=asyncio.FIRST_COMPLETED)
        for task in (relaying, leaving):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await relaying  # a client that left: the worker's response is closed by the cancellation
        if relaying.done() and not relaying.cancelled() and relaying.exception() is not None:
            raise relaying.exception()  # type: ignore[misc]

    async def _forward(self, slot: WorkerSlot, scope, body: bytes, relay: _Relay, last: bool) -> None:
        client = self._client(slot)
        query = scope.get("query_string", b"").decode()
        url = "http://worker" + scope["path"] + (f"?{query}" if query else "")
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() not in _HOP_BY_HOP]
        request = client.build_request(scope["method"], url, headers=headers, content=body)
        who = f"worker {slot.index} of model {relay.model} (pid {slot.pid})"
        try:
            response = await client.send(request, stream=True)
        except httpx.ConnectError as exc:
            if not last:  # nothing reached the worker (it is gone): another may take the request
                raise _Undelivered from exc
            await relay.fail(502, f"{who} cannot be reached: {exc or type(exc).__name__}", "worker_failed")
            return
        except httpx.TransportError as exc:
            await relay.fail(502, f"{who} failed before answering: {exc or type(exc).__name__}", "worker_failed")
            return
        try:
            await relay.start(response)
            async for chunk in response.aiter_raw():
                await relay.body(chunk)
            await relay.finish()
        except httpx.TransportError as exc:
            await relay.fail(502, f"{who} ended during the request: {exc or type(exc).__name__}", "worker_failed")
        finally:
            await response.aclose()

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _disconnected(receive) -> None:
    """Return when the client goes away (the body was read: nothing else can arrive)."""
    while (await receive())["type"] != "http.disconnect":
        pass


__all__ = ["Front"]
