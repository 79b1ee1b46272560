"""moectl serve: llama-cpp-python's OpenAI-compatible server on models streamed by moed.

What this module owns: the command line, turned into one `ServePlan`
(moed.serve.lifecycle). The server is llama-cpp-python's own (`llama_cpp.server`,
the `[server]` extra) with `StreamedLlama` as its model class (moed.serve.app),
run in `--workers N` engine processes per model behind one port (moed.serve): every
worker maps the daemon's one copy of each expert, so a worker costs its KV cache and
its private memory, not another copy of the experts.

One model from the arguments, or several from the server's own config file
(`--config F`: JSON or YAML, `{"host": ..., "port": ..., "models": [{"model": PATH,
"model_alias": NAME, "n_ctx": N, "workers": W, ...}]}`; `workers` is moed's, the rest
the server's); `--host`/`--port` override the file's, `--workers` sets every model's
that the file leaves unset. Engine flags (`--prefetch`, `--n-gpu-layers`, `--threads`,
`--gpu-slots`, ...: moed.engines.options) apply to every model; a model of the file may
set any of them for itself by the option's name (`"n_gpu_layers": -1`, `"gpu_slots": 8`,
`"n_threads": 4`: `EngineOptions.per_model()`), which wins over the flag. Every model's
options are checked, against its file, before any worker starts: a bad value ends the
command with one line naming the option (and the model). Requests queue for a free worker (`--queue` of them a model, then 503 with
Retry-After); `--interrupt-requests` lets a new request cut the running stream instead.
"""

from __future__ import annotations

import argparse
import json
import os

from moed.badinput import BadInput
from moed.engines.options import SERVE, EngineOptions

DEFAULT_QUEUE = 16


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (llama-cpp-python's) on moed")
    p.add_argument("model", nargs="?", help="GGUF model (or give --config)")
    p.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="listen port (default 8000)")
    p.add_argument("--config", help="llama_cpp.server config file (JSON or YAML) naming one or more models")
    p.add_argument("--alias", default=None, help="the model's name in the API (default: its path)")
    p.add_argument("--ctx", type=int, default=2048, help="context length in tokens, exactly (default 2048)")
    p.add_argument("--chat-format", default=None, help="chat template name (default: the model's own)")
    p.add_argument("--api-key", default=None, help="require this bearer token")
    p.add_argument("--workers", type=int, default=None, help="engine processes per model (default 1)")
    p.add_argument(
        "--queue",
        type=int,
        default=DEFAULT_QUEUE,
        help=f"requests that may wait for a busy model's workers; more get 503 (default {DEFAULT_QUEUE})",
    )
    p.add_argument(
        "--queue-timeout",
        type=float,
        default=300.0,
        help="seconds a request may wait for a worker before a 503 (default 300)",
    )
    p.add_argument("--grace", type=float, default=10.0, help="seconds SIGTERM lets requests finish (default 10)")
    p.add_argument("--metrics-listen", default=None, metavar="HOST:PORT", help="serve Prometheus metrics here")
    p.add_argument(
        "--interrupt-requests",
        action="store_true",
        default=None,
        help="a new request cuts the running stream (which ends with finish_reason 'interrupted'); "
        "default: requests queue",
    )
    EngineOptions.add_flags(p, SERVE)  # StreamedLlama's options (--n-gpu-layers, --threads, ...), for every model
    p.add_argument("--verbose", action="store_true", help="llama.cpp's load log and uvicorn's access log")
    p.set_defaults(func=cmd_serve)


def _engine_options(base: EngineOptions, settings, own: dict) -> dict:
    """One model's EngineOptions (the command's, with the model's own from the config file), as
    the JSON its workers' spec carries; checked first, as StreamedLlama checks them, against
    the model file, so a bad value ends the command with one line before any worker starts
    (OptionError is a ValueError)."""
    import dataclasses

    from moed.engines.options import ModelFacts, OptionError

    options = dataclasses.replace(base, **own)
    try:
        options.check()
        if options.gpu_slots:
            options.for_model(ModelFacts.of(settings.model))
    except OptionError as exc:
        raise ValueError(f"model {settings.model_alias or settings.model}: {exc}") from None
    return dataclasses.asdict(options)


def _read_config(path: str) -> dict:
    with open(path, "rb") as f:
        text = f.read()
    if path.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a mapping")
    return data


def _settings(args: argparse.Namespace):
    """(server settings, [(model settings, workers, the model's own engine options)]) from the
    arguments or the config file."""
    from llama_cpp.server.settings import ConfigFileSettings, ModelSettings, ServerSettings

    if args.config:
        data = _read_config(args.config)
        models = data.get("models") or []
        # `workers` and the engine options are moed's, taken as written (the server's own
        # settings would refuse moed's options, and read "-1" or true as a number).
        entries = [m if isinstance(m, dict) else {} for m in models]
        counts = [m.pop("workers", None) for m in entries]
        own = [{name: m.pop(name) for name in EngineOptions.per_model() if name in m} for m in entries]
        file_settings = ConfigFileSettings.model_validate(data)
        server = ServerSettings.model_validate(file_settings.model_dump(exclude={"models"}))
        if "interrupt_requests" not in file_settings.model_fields_set:
            # llama_cpp.server's default cuts a running stream for every new request.
            server = server.model_copy(update={"interrupt_requests": False})
        if not file_settings.models:
            raise ValueError(f"{args.config}: no models")
        default = args.workers if args.workers is not None else 1
        models = [(m, n if n is not None else default, o) for m, n, o in zip(file_settings.models, counts, own)]
    else:
        server = ServerSettings(host="127.0.0.1", port=8000, interrupt_requests=False)
        given = {"chat_format": args.chat_format, "model_alias": args.alias}
        model = ModelSettings(
            model=args.model, n_ctx=args.ctx, verbose=args.verbose, **{k: v for k, v in given.items() if v is not None}
        )
        models = [(model, args.workers if args.workers is not None else 1, {})]
    updates = {
        "host": args.host,
        "port": args.port,
        "api_key": args.api_key,
        "interrupt_requests": args.interrupt_requests,
    }
    server = server.model_copy(update={k: v for k, v in updates.items() if v is not None})
    if args.queue < 0 or args.queue_timeout <= 0 or args.grace < 0:
        raise ValueError("--queue must be >= 0, --queue-timeout > 0 and --grace >= 0")
    for m, n, _ in models:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"model {m.model_alias or m.model}: workers must be a whole number >= 1, not {n!r}")
    return server, models


def _metrics_listen(value: str | None) -> tuple[str, int] | None:
    if not value:
        return None
    host, _, port = value.rpartition(":")
    return (host or "127.0.0.1", int(port))


def _plan(args: argparse.Namespace):
    from moed.serve.lifecycle import ServedModel, ServePlan

    server, entries = _settings(args)
    base = EngineOptions.from_args(args, SERVE, socket_path=args.socket)
    base.check()  # a flag's bad value names the option alone: it is every model's
    models = []
    for settings, workers, own in entries:
        if not os.path.exists(settings.model):
            raise FileNotFoundError(f"no such model file: {settings.model}")
        alias = settings.model_alias or settings.model
        # Only what was set: a worker tells the user's settings from the server's defaults by
        # what is set (moed.serve.app).
        data = settings.model_dump(mode="json", exclude_unset=True) | {"model_alias": alias}
        models.append(ServedModel(alias, data, workers, _engine_options(base, settings, own)))
    if len({m.alias for m in models}) != len(models):
        raise ValueError("two models have the same alias")
    # Workers listen only on their private sockets: the front checks the API key.
    worker_server = server.model_dump(mode="json") | {"api_key": None}
    return ServePlan(
        host=server.host,
        port=server.port,
        models=models,
        socket_path=base.socket_path,
        server=worker_server,
        queue_bound=args.queue,
        queue_timeout_s=args.queue_timeout,
        grace_s=args.grace,
        api_key=server.api_key,
        metrics_listen=_metrics_listen(args.metrics_listen),
        ssl_keyfile=server.ssl_keyfile,
        ssl_certfile=server.ssl_certfile,
        verbose=args.verbose,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    if bool(args.model) == bool(args.config):
        raise BadInput("serve needs a MODEL or --config F (not both)")
    for path in [args.model, args.config]:
        if path and not os.path.exists(path):
            raise BadInput(f"no such file: {path}")
    try:
        import llama_cpp.server.app  # noqa: F401 - the [server] extra

        from moed.serve import lifecycle
    except ImportError as exc:
        raise BadInput(f"moectl serve needs llama-cpp-python's server: pip install 'moed[server]' ({exc})") from None
    try:
        plan = _plan(args)
    except (ValueError, OSError) as exc:  # pydantic's ValidationError is a ValueError
        raise BadInput(f"bad server settings: {exc}") from None
    lifecycle.exec_front(plan)  # the front starts over without llama.cpp (same pid)
    return 0
