"""llama-cpp-python's OpenAI-compatible server with `StreamedLlama` as its model class.

What this module owns: the seam into `llama_cpp.server` (docs/design.md, "Serving")
and what the server does when moed is down. Nothing of the server is copied: its
app, routes, settings, config-file format and multi-model switching are its own.

The seam: `create_app` installs its models with `set_llama_proxy`, which builds
the module-level `llama_cpp.server.app.LlamaProxy`; `install()` puts
`MoedLlamaProxy` there. The proxy's `load_llama_from_model_settings` runs the
server's own loader with `llama_cpp.Llama` swapped (under a lock, for the length
of that call) for a factory that builds a `ServedLlama`, so every setting the
server maps (chat format, cache, draft model, kv overrides...) keeps its meaning.
Settings moed cannot honour get a RuntimeWarning and are ignored: n_gpu_layers
and use_mlock (when set explicitly: StreamedLlama's own warnings), use_mmap=false,
lora, rpc servers; a Hugging Face repo is refused (moed streams local files).

When moed is down:
- a POST is answered 503 with the reason before the server starts on it
  (`MoedAvailable`, an ASGI middleware probing the daemon on its own connection),
  so a streamed request never gets a 200 it cannot keep;
- a request that loses the daemon while it runs fails with 503 and the reason
  (`ServedLlama` raises `MoedUnavailable`, whose message the server's own error
  table maps to 503), never a hang (the client's timeout bounds every wait);
- the engine layer reconnects: before each request the proxy pings the current
  model's connection; if it is gone the model is closed and loaded again on a
  fresh connection (leases, model ids and segments of the old one are void), and
  if that fails the request gets 503. A stream that loses moed mid-way ends early:
  its 200 was already sent.

Invariant: the model is only closed or rebuilt inside the proxy's `__call__`,
which the server runs under its inner lock, so never under a request using it.
"""

from __future__ import annotations

import functools
import re
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import llama_cpp
import llama_cpp.server.app as server_app
from fastapi import HTTPException
from llama_cpp.server.errors import ErrorResponse, RouteErrorHandler
from llama_cpp.server.model import LlamaProxy
from llama_cpp.server.settings import ModelSettings
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse

from moed.engines.llama_cpp import StreamedLlama
from moed.protocol import errors

UNAVAILABLE_PREFIX = "moed unavailable: "
_LOAD_LOCK = threading.Lock()


class MoedUnavailable(RuntimeError):
    """moed went away under a request; the message starts with UNAVAILABLE_PREFIX."""


@dataclass(frozen=True)
class EngineOptions:
    """What `moectl serve` sets for every model the server loads."""

    socket_path: str | None = None
    prefetch: str = "gate"
    prefetch_width: int | None = None
    skeleton_dir: str | None = None
    acquire_timeout_s: float | None = None
    client_timeout_s: float = 30.0


def unavailable_body(reason: str) -> dict:
    """An OpenAI-style error object (the official client shows `message`)."""
    return {
        "error": ErrorResponse(
            message=UNAVAILABLE_PREFIX + reason, type="service_unavailable", param=None, code="moed_unavailable"
        )
    }


def _unavailable_formatter(_body, match: re.Match) -> tuple[int, ErrorResponse]:
    return 503, unavailable_body(match.group(1))["error"]


class ServedLlama(StreamedLlama):
    """A StreamedLlama whose completions turn a lost daemon into `MoedUnavailable`."""

    def create_completion(self, *args, **kwargs):
        try:
            result = super().create_completion(*args, **kwargs)
        except errors.DaemonUnavailable as exc:
            raise MoedUnavailable(f"{UNAVAILABLE_PREFIX}{exc}") from exc
        if isinstance(result, Iterator):
            return _guarded(result)
        return result


def _guarded(chunks: Iterator) -> Iterator:
    try:
        yield from chunks
    except errors.DaemonUnavailable as exc:
        raise MoedUnavailable(f"{UNAVAILABLE_PREFIX}{exc}") from exc


def _connection_alive(llm: Any) -> bool:
    client = getattr(llm, "moed_client", None)
    if client is None:
        return False
    try:
        client.ping()
        return True
    except errors.DaemonUnavailable:
        return False


class MoedLlamaProxy(LlamaProxy):
    """The server's model proxy, loading `ServedLlama`s and reconnecting them (see module)."""

    options: ClassVar[EngineOptions] = EngineOptions()

    def __init__(self, models: list[ModelSettings]) -> None:
        try:
            super().__init__(models)
        except errors.DaemonUnavailable as exc:
            # Serve anyway: every request gets 503 until moed answers, then loads.
            warnings.warn(f"moed is not reachable ({exc}); requests get 503 until it is", RuntimeWarning, stacklevel=2)
            self._current_model = None
            self._current_model_alias = None

    def __call__(self, model: str | None = None) -> llama_cpp.Llama:
        current = self._current_model
        if current is not None and not _connection_alive(current):
            current.close()
            self._current_model = None
        try:
            return super().__call__(model)
        except errors.DaemonUnavailable as exc:
            self._current_model = None
            raise HTTPException(status_code=503, detail=UNAVAILABLE_PREFIX + str(exc)) from exc

    def load_llama_from_model_settings(self, settings: ModelSettings) -> llama_cpp.Llama:  # type: ignore[override]
        """The server's own loader, building a ServedLlama where it builds a Llama."""
        if settings.hf_model_repo_id is not None:
            raise ValueError("moed serves local GGUF files; hf_model_repo_id is not supported")
        for name in ("lora_base", "lora_path", "rpc_servers"):
            if getattr(settings, name):
                warnings.warn(
                    f"moectl serve ignores {name}: moed streams the model file's own experts",
                    RuntimeWarning,
                    stacklevel=2,
                )
                setattr(settings, name, None)
        factory = functools.partial(_served_llama, self.options, settings.model_fields_set)
        with _LOAD_LOCK:
            saved = llama_cpp.Llama
            setattr(llama_cpp, "Llama", factory)  # noqa: B010 - the swap is the seam (see module)
            try:
                return LlamaProxy.load_llama_from_model_settings(settings)
            finally:
                setattr(llama_cpp, "Llama", saved)  # noqa: B010


def _served_llama(options: EngineOptions, explicit: set[str], **kwargs) -> ServedLlama:
    from moed.client import Client

    # The server passes every setting; only those the user set may warn.
    for name in ("use_mlock", "n_gpu_layers"):
        if name not in explicit:
            kwargs.pop(name, None)
    if kwargs.get("use_mmap") is False:
        warnings.warn(
            "moectl serve ignores use_mmap=false: the experts are mapped into llama.cpp's mapping",
            RuntimeWarning,
            stacklevel=2,
        )
        kwargs.pop("use_mmap")
    client = Client(options.socket_path, client_name="moectl serve", timeout_s=options.client_timeout_s)
    try:
        llm = ServedLlama(
            client=client,
            acquire_timeout_s=options.acquire_timeout_s,
            prefetch=options.prefetch,
            prefetch_width=options.prefetch_width,
            skeleton_dir=options.skeleton_dir,
            **kwargs,
        )
    except BaseException:
        client.close()
        raise
    llm._own_client = client  # closed with the model
    return llm


class DaemonProbe:
    """A connection of the server's own, only for asking whether moed answers."""

    def __init__(self, socket_path: str | None, timeout_s: float = 5.0):
        self.socket_path, self.timeout_s = socket_path, timeout_s
        self._client: Any = None
        self._lock = threading.Lock()

    def why_unavailable(self) -> str | None:
        """None if moed answers a ping (reconnecting once if the old connection died), else why not."""
        from moed.client import Client

        with self._lock:
            for _ in range(2):
                try:
                    if self._client is None:
                        self._client = Client(
                            self.socket_path, client_name="moectl serve probe", timeout_s=self.timeout_s
                        )
                    self._client.ping()
                    return None
                except errors.DaemonUnavailable as exc:
                    if self._client is not None:
                        self._client.close()
                    self._client = None
                    why = str(exc)
            return why


class MoedAvailable:
    """ASGI middleware: a POST while moed is down is answered 503 with the reason."""

    def __init__(self, app, probe: DaemonProbe):
        self.app, self.probe = app, probe

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST":
            why = await run_in_threadpool(self.probe.why_unavailable)
            if why is not None:
                response = JSONResponse(unavailable_body(why), status_code=503, headers={"Retry-After": "1"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def install(options: EngineOptions) -> None:
    """Make the server build MoedLlamaProxy (with `options`) and map MoedUnavailable to 503."""
    proxy = type("MoedLlamaProxy", (MoedLlamaProxy,), {"options": options})
    setattr(server_app, "LlamaProxy", proxy)  # noqa: B010 - read by set_llama_proxy
    RouteErrorHandler.pattern_and_formatters[re.compile("^" + re.escape(UNAVAILABLE_PREFIX) + "(.+)", re.S)] = (
        _unavailable_formatter
    )


def create_app(options: EngineOptions, **create_kwargs):
    """The server's app with moed's proxy and the availability middleware."""
    install(options)
    app = server_app.create_app(**create_kwargs)
    app.add_middleware(MoedAvailable, probe=DaemonProbe(options.socket_path))
    return app


__all__ = ["EngineOptions", "MoedLlamaProxy", "MoedUnavailable", "ServedLlama", "create_app", "install"]
