"""llama-cpp-python's OpenAI-compatible server with `StreamedLlama` as its model class.

What this module owns: the seam into `llama_cpp.server` (docs/design.md, "Serving")
and what the server does with requests it cannot serve. Nothing of the server is
copied: its app, routes, settings, config-file format and multi-model switching are
its own.

The seam: `create_app` installs its models with `set_llama_proxy`, which builds
the module-level `llama_cpp.server.app.LlamaProxy`; `install()` puts
`MoedLlamaProxy` there. The proxy's `load_llama_from_model_settings` runs the
server's own loader with `llama_cpp.Llama` swapped (under a lock, for the length
of that call) for a factory that builds a `ServedLlama`, so every setting the
server maps (chat format, cache, draft model, kv overrides...) keeps its meaning.
The server's settings that are engine options too (`n_gpu_layers`, `n_threads`,
`n_threads_batch`: `EngineOptions.llama_settings()`) are the options': the server
passes every one, its defaults included, so only a value set on the model's settings
(`model_fields_set`) is taken, as that model's option (checked by StreamedLlama like
every option); `moectl serve` puts a model's own values in its options instead.
`n_gpu_layers` is StreamedLlama's GPU hybrid (dense layers on the GPU, the experts on
the CPU from moed); thread counts left out are the daemon's to share among the workers
(moed.engines.turns). Settings moed cannot honour get a RuntimeWarning and are
ignored: use_mlock (when set explicitly: StreamedLlama's own warning), use_mmap=false,
lora, rpc servers; a Hugging Face repo is refused (moed streams local files).

Requests:
- they queue for the model (the server's own locks); the server's interruption
  (a new request cuts the running stream, which ends with no finish_reason) is
  always off, and `interrupt_requests` turns on ServedLlama's, whose cut stream
  ends with finish_reason "interrupted";
- a bad request (max_tokens below 0, prompt plus max_tokens past the context, an
  unknown model, a body that does not validate) is a 4xx through the error table
  (moed.serve.http_errors), also when streamed: the response guard
  (moed.serve.http_guard) holds a stream's 200 back until its first token;
- the context is exactly `n_ctx` (ServedLlama.n_ctx, whatever llama.cpp pads).

When moed is down:
- a POST is answered 503 with the reason before the server starts on it
  (`MoedAvailable`, an ASGI middleware probing the daemon on its own connection);
- a request that loses the daemon while it runs fails with 503 and the reason
  (`ServedLlama` raises `MoedUnavailable`), never a hang (the client's timeout
  bounds every wait); a failed expert read is a 502 naming the expert
  (`ExpertReadFailed`), and the next request is served as usual;
- the engine reconnects, with no model reload: before each request the proxy has
  the current model bind itself to a live daemon (`StreamedLlama.ensure_connected`:
  a peek when the connection is up; after a restart the client's bounded reconnect,
  the new RAM tier mapped, the KV cache kept), and if moed does not come back within
  the client's `reconnect_s` the request gets 503. Only an engine that cannot be
  bound again (`gpu_zero_copy`: its device imported the dead daemon's segments) is
  closed and loaded again. A stream that loses moed after its first token ends with
  an error event (its 200 was already sent).

Options: `EngineOptions` (moed.engines.options, the one declaration of a streamed
engine's options) is what `moectl serve` sets for the model a worker loads (one
`EngineOptions` per model); its `client_timeout_s` is the timeout of the connection the
factory opens per model.

Invariant: the model is only closed or rebuilt inside the proxy's `__call__`,
which the server runs under its inner lock, so never under a request using it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import re
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import llama_cpp
import llama_cpp.server.app as server_app
from llama_cpp.server.errors import ErrorResponse
from llama_cpp.server.model import LlamaProxy
from llama_cpp.server.settings import ModelSettings, ServerSettings
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse

from moed.engines.llama_cpp import StreamedLlama
from moed.engines.options import EngineOptions
from moed.protocol import errors
from moed.serve import http_errors
from moed.serve.http_errors import ExpertReadFailed, InvalidRequest, ModelNotFound, MoedUnavailable
from moed.serve.http_guard import ResponseGuard

UNAVAILABLE_PREFIX = "moed unavailable: "
INTERRUPTED = "interrupted"  # the finish_reason of a stream cut for a waiting request
_LOAD_LOCK = threading.Lock()
_COMPLETION_ARGS = inspect.signature(llama_cpp.Llama.create_completion)
_CONTEXT_EXCEEDED = re.compile(r"Requested tokens \((\d+)\) exceed context window of \d+")


def unavailable_body(reason: str) -> dict:
    """An OpenAI-style error object (the official client shows `message`)."""
    return {
        "error": ErrorResponse(
            message=UNAVAILABLE_PREFIX + reason, type="service_unavailable", param=None, code="moed_unavailable"
        )
    }


class ServedLlama(StreamedLlama):
    """A StreamedLlama as the server needs it: exactly the context asked for, requests
    checked before a token is made, moed's failures as the server's typed errors.

    - `n_ctx()` is the context asked for: llama.cpp pads its own to a multiple of
      256, and llama-cpp-python sizes its token arrays by the one asked for, so a
      completion past the asked context failed inside numpy ("could not broadcast").
    - max_tokens below 0, or prompt + max_tokens past the context, is a 400
      (llama-cpp-python would clip max_tokens silently, or run past its arrays).
    - `interrupt_when`: when set and true while a stream runs (another request
      waits for the model), the stream ends with finish_reason "interrupted".
    - daemon unreachable -> MoedUnavailable (503), a failed expert read ->
      ExpertReadFailed (502, naming the expert); the model stays usable.
    """

    interrupt_when: Callable[[], bool] | None = None
    _wanted_tokens = 0

    def n_ctx(self) -> int:
        asked = self.context_params.n_ctx
        return min(super().n_ctx(), asked) if asked > 0 else super().n_ctx()

    def create_completion(self, *args, **kwargs):
        bound = _COMPLETION_ARGS.bind(self, *args, **kwargs)
        bound.apply_defaults()
        max_tokens = bound.arguments["max_tokens"]
        if max_tokens is not None and max_tokens < 0:
            raise InvalidRequest(
                f"max_tokens must be at least 1, or 0 or null for up to the end of the context; got {max_tokens}",
                "max_tokens",
            )
        _check_logit_bias(bound.arguments.get("logit_bias"), self.n_vocab())
        self._wanted_tokens = max_tokens or 0  # checked against the prompt by generate(), which resets it
        with _served_errors(self):
            result = super().create_completion(*args, **kwargs)
        if isinstance(result, Iterator):
            return self._guarded(result)
        return result

    def generate(self, tokens, *args, **kwargs):
        """llama-cpp-python's generate; first, the prompt it is given fits with the tokens asked for."""
        wanted, self._wanted_tokens = self._wanted_tokens, 0
        if len(tokens) + wanted > self._n_ctx:
            raise ValueError(f"Requested tokens ({len(tokens)}) exceed context window of {self._n_ctx}")
        return super().generate(tokens, *args, **kwargs)

    def _guarded(self, chunks: Iterator) -> Iterator:
        with _served_errors(self):
            for chunk in chunks:
                yield chunk
                if chunk["choices"][0]["finish_reason"] is None and self.interrupt_when and self.interrupt_when():
                    chunks.close()  # type: ignore[attr-defined]
                    yield _interrupted(chunk)
                    return


def _check_logit_bias(bias: dict | None, n_vocab: int) -> None:
    """logit_bias keys are token ids of this model (llama-cpp-python would fail inside with a 500)."""
    for key in bias or {}:
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise InvalidRequest(f"logit_bias keys are token ids; got {key!r}", "logit_bias") from None
        if not 0 <= token < n_vocab:
            raise InvalidRequest(
                f"logit_bias token {token} is not in this model's vocabulary of {n_vocab}", "logit_bias"
            )


def _interrupted(last: dict) -> dict:
    """The closing chunk of a stream cut for a waiting request (same id and model as the stream's)."""
    return {
        **last,
        "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": INTERRUPTED}],
    }


def _read_error_message(exc: errors.ReadError) -> str:
    """'moed could not read expert 3 of layer 1 (down) of m.gguf: ...': which expert, when the error says."""
    where = [f"{name} {getattr(exc, name)}" for name in ("expert", "layer") if getattr(exc, name, None) is not None]
    part = getattr(exc, "part", None)
    model = getattr(exc, "model", None)
    what = " of ".join(where) or "an expert"
    what += f" ({part})" if part else ""
    what += f" of {model}" if model else ""
    return f"moed could not read {what}: {exc}"


@contextlib.contextmanager
def _served_errors(llm: ServedLlama):
    """moed's failures as the server's errors, and the context error with the context asked for."""
    try:
        yield
    except errors.DaemonUnavailable as exc:
        raise MoedUnavailable(f"{UNAVAILABLE_PREFIX}{exc}") from exc
    except errors.ReadError as exc:
        raise ExpertReadFailed(_read_error_message(exc)) from exc
    except ValueError as exc:
        match = _CONTEXT_EXCEEDED.search(str(exc))
        if match is None or isinstance(exc, InvalidRequest):
            raise
        raise ValueError(f"Requested tokens ({match.group(1)}) exceed context window of {llm.n_ctx()}") from exc


class MoedLlamaProxy(LlamaProxy):
    """The server's model proxy, loading `ServedLlama`s and reconnecting them (see module)."""

    options: ClassVar[EngineOptions] = EngineOptions()
    interrupt_requests: ClassVar[bool] = False

    def __init__(self, models: list[ModelSettings]) -> None:
        try:
            super().__init__(models)
        except errors.DaemonUnavailable as exc:
            # Serve anyway: every request gets 503 until moed answers, then loads.
            warnings.warn(f"moed is not reachable ({exc}); requests get 503 until it is", RuntimeWarning, stacklevel=2)
            self._current_model = None
            self._current_model_alias = None

    def __call__(self, model: str | None = None) -> llama_cpp.Llama:
        if model == "copilot-codex" and model not in self._model_settings_dict:
            model = None  # the server's own /v1/engines/copilot-codex route names no model of ours
        if model is not None and model not in self._model_settings_dict:
            # llama-cpp-python answers with its default model; a client would believe another one answered.
            raise ModelNotFound(model, list(self._model_settings_dict))
        try:
            return self._bound(super().__call__(model), model)
        except errors.DaemonUnavailable as exc:
            raise MoedUnavailable(UNAVAILABLE_PREFIX + str(exc)) from exc

    def _bound(self, llm: llama_cpp.Llama, model: str | None) -> llama_cpp.Llama:
        """`llm` bound to a live daemon: after a restart the same engine, bound again; one that
        cannot be (its zero-copy device slots imported the dead daemon's tier) loaded again."""
        if not isinstance(llm, StreamedLlama):
            return llm
        try:
            llm.ensure_connected()
            return llm
        except errors.DaemonUnavailable:
            raise
        except Exception:
            if llm.streamer.dead is None:
                raise
        llm.close()
        self._current_model = None
        return super().__call__(model)

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
        interrupt_when = _request_waiting if self.interrupt_requests else None
        factory = functools.partial(_served_llama, self.options, interrupt_when, settings.model_fields_set)
        with _LOAD_LOCK:
            saved = llama_cpp.Llama
            setattr(llama_cpp, "Llama", factory)  # noqa: B010 - the swap is the seam (see module)
            try:
                return LlamaProxy.load_llama_from_model_settings(settings)
            finally:
                setattr(llama_cpp, "Llama", saved)  # noqa: B010


def _request_waiting() -> bool:
    """Whether a request waits for the model (the server's outer lock is held by exactly such a one)."""
    return server_app.llama_outer_lock.locked()


def _served_llama(
    options: EngineOptions, interrupt_when: Callable[[], bool] | None, explicit: set[str], **kwargs
) -> ServedLlama:
    from moed.client import Client

    # The server passes every setting, its defaults included. Those that are engine options
    # are the options' (one keyword each): a value set on the model's settings is this
    # model's option, the server's default is dropped (thread counts left out are the
    # daemon's to share among the workers). use_mlock warns only when the user set it.
    given = {name: kwargs.pop(name) for name in options.llama_settings() if name in kwargs}
    options = dataclasses.replace(options, **{k: v for k, v in given.items() if k in explicit})
    if "use_mlock" not in explicit:
        kwargs.pop("use_mlock", None)
    if kwargs.get("use_mmap") is False:
        warnings.warn(
            "moectl serve ignores use_mmap=false: the experts are mapped into llama.cpp's mapping",
            RuntimeWarning,
            stacklevel=2,
        )
        kwargs.pop("use_mmap")
    client = Client(options.socket_path, client_name="moectl serve", timeout_s=options.client_timeout_s)
    try:
        llm = ServedLlama(client=client, **options.streamed_kwargs(), **kwargs)
    except BaseException:
        client.close()
        raise
    llm.own_client(client)  # closed with the model
    llm.interrupt_when = interrupt_when
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
                        # reconnect_s=0: a probe answers at once; it makes a new client itself
                        self._client = Client(
                            self.socket_path, client_name="moectl serve probe", timeout_s=self.timeout_s, reconnect_s=0
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


def install(options: EngineOptions, interrupt_requests: bool = False) -> None:
    """Make the server build MoedLlamaProxy (with `options`) and answer errors through http_errors."""
    attrs = {"options": options, "interrupt_requests": interrupt_requests}
    proxy = type("MoedLlamaProxy", (MoedLlamaProxy,), attrs)
    setattr(server_app, "LlamaProxy", proxy)  # noqa: B010 - read by set_llama_proxy
    http_errors.install()


def create_app(options: EngineOptions, server_settings: ServerSettings, model_settings: list[ModelSettings]):
    """The server's app with moed's proxy, the response guard and the availability middleware.

    The server's own interruption stays off whatever the settings say: it cuts a
    stream after any chunk with no finish_reason. `server_settings.interrupt_requests`
    turns on ServedLlama's instead, which ends the cut stream with one.
    """
    install(options, interrupt_requests=server_settings.interrupt_requests)
    quiet = server_settings.model_copy(update={"interrupt_requests": False})
    app = server_app.create_app(server_settings=quiet, model_settings=model_settings)
    app.add_middleware(ResponseGuard)
    app.add_middleware(MoedAvailable, probe=DaemonProbe(options.socket_path))
    return app


__all__ = ["EngineOptions", "MoedLlamaProxy", "MoedUnavailable", "ServedLlama", "create_app", "install"]
