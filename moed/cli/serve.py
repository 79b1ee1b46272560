"""moectl serve: llama-cpp-python's OpenAI-compatible server on models streamed by moed.

What this module owns: the command line. The server is llama-cpp-python's own
(`llama_cpp.server`, the `[server]` extra) with `StreamedLlama` as its model class
(moed.engines.server). One model from the arguments, or several from the server's
own config file (`--config F`: JSON or YAML, `{"host": ..., "port": ..., "models":
[{"model": PATH, "model_alias": NAME, "n_ctx": N, ...}]}`); `--host`/`--port`
override the file's. `--prefetch` and `--prefetch-width` apply to every model.
Several `moectl serve` processes can share one daemon.
"""

from __future__ import annotations

import argparse
import os
import sys

from moed.cli import fail


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (llama-cpp-python's) on moed")
    p.add_argument("model", nargs="?", help="GGUF model (or give --config)")
    p.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="listen port (default 8000)")
    p.add_argument("--config", help="llama_cpp.server config file (JSON or YAML) naming one or more models")
    p.add_argument("--alias", default=None, help="the model's name in the API (default: its path)")
    p.add_argument("--ctx", type=int, default=2048, help="context length (default 2048)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: the server's)")
    p.add_argument("--chat-format", default=None, help="chat template name (default: the model's own)")
    p.add_argument("--api-key", default=None, help="require this bearer token")
    p.add_argument(
        "--interrupt-requests",
        action="store_true",
        default=None,
        help="a new request cuts the running stream (which ends with finish_reason 'interrupted'); "
        "default: requests queue",
    )
    p.add_argument(
        "--prefetch",
        choices=("gate", "gate2", "off"),
        default="gate",
        help="gate-ahead prefetch: one layer ahead (gate, default), also two (gate2), or off",
    )
    p.add_argument("--prefetch-width", type=int, default=None, help="experts per token to prefetch")
    p.add_argument("--skeleton-dir", default=None, help="load llama.cpp from a skeleton of each model kept here")
    p.add_argument(
        "--acquire-timeout",
        type=float,
        default=None,
        help="seconds an acquire may wait for budget (default: the daemon's)",
    )
    p.add_argument("--verbose", action="store_true", help="llama.cpp's load log and uvicorn's access log")
    p.set_defaults(func=cmd_serve)


def _settings(args: argparse.Namespace):
    """(server settings, model settings) from the arguments or the config file."""
    from llama_cpp.server.settings import ConfigFileSettings, ModelSettings, ServerSettings

    if args.config:
        with open(args.config, "rb") as f:
            text = f.read()
        if args.config.endswith((".yaml", ".yml")):
            import json

            import yaml

            text = json.dumps(yaml.safe_load(text)).encode()
        file_settings = ConfigFileSettings.model_validate_json(text)
        server = ServerSettings.model_validate(file_settings.model_dump(exclude={"models"}))
        if "interrupt_requests" not in file_settings.model_fields_set:
            # llama_cpp.server's default cuts a running stream for every new request.
            server = server.model_copy(update={"interrupt_requests": False})
        models = file_settings.models
        if not models:
            raise ValueError(f"{args.config}: no models")
    else:
        server = ServerSettings(host="127.0.0.1", port=8000, interrupt_requests=False)
        given = {"n_threads": args.threads, "chat_format": args.chat_format, "model_alias": args.alias}
        models = [
            ModelSettings(
                model=args.model,
                n_ctx=args.ctx,
                verbose=args.verbose,
                **{k: v for k, v in given.items() if v is not None},
            )
        ]
    updates = {
        "host": args.host,
        "port": args.port,
        "api_key": args.api_key,
        "interrupt_requests": args.interrupt_requests,
    }
    server = server.model_copy(update={k: v for k, v in updates.items() if v is not None})
    return server, models


def cmd_serve(args: argparse.Namespace) -> int:
    if bool(args.model) == bool(args.config):
        return fail("serve needs a MODEL or --config F (not both)")
    for path in [args.model, args.config]:
        if path and not os.path.exists(path):
            return fail(f"no such file: {path}")
    try:
        import uvicorn

        from moed.engines.server import EngineOptions, create_app
    except ImportError as exc:
        return fail(f"moectl serve needs llama-cpp-python's server: pip install 'moed[server]' ({exc})")
    try:
        server, models = _settings(args)
    except (ValueError, OSError) as exc:  # pydantic's ValidationError is a ValueError
        return fail(f"bad server settings: {exc}")
    for m in models:
        if not os.path.exists(m.model):
            return fail(f"no such model file: {m.model}")
    options = EngineOptions(
        socket_path=args.socket,
        prefetch=args.prefetch,
        prefetch_width=args.prefetch_width,
        skeleton_dir=args.skeleton_dir,
        acquire_timeout_s=args.acquire_timeout,
    )
    app = create_app(options, server_settings=server, model_settings=models)
    names = ", ".join(m.model_alias or m.model for m in models)
    print(
        f"moectl serve: {names} on http://{server.host}:{server.port}/v1 (moed at {args.socket})",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(
        app,
        host=server.host,
        port=server.port,
        ssl_keyfile=server.ssl_keyfile,
        ssl_certfile=server.ssl_certfile,
        log_level="info" if args.verbose else "warning",
    )
    return 0
