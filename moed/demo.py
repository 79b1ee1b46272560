"""The main job on an embedded default: `scripts/demo [MODEL.gguf]`.

Without MODEL it runs the committed tiny trained MoE (`moed.data.TINY_MOE`:
qwen3moe, byte-level, trained on the Python standard library's source by
scripts/train-tiny-moe), so the engines write Python-looking text; `--random`
generates a random-weight model instead (cached in the user's cache directory,
`cache_dir()`). It starts
moed with a RAM budget smaller than the model's routed experts, runs two engine
processes at once whose experts are served by the daemon (run as
root, the second runs as user `nobody`, so stats show two tenants), prints
`moectl stats`, and stops everything cleanly (the daemon exits 0).

Engines are `StreamedLlama` (llama.cpp through llama-cpp-python) generating
text; where llama-cpp-python is not installed, two plain clients stand in and
replay random routes, checking every byte against the file.

`scripts/demo --serve`: moed (with its Prometheus endpoint) and one OpenAI-compatible
server (`moectl serve`) on the model; the official `openai` client sends a chat
request and a streamed completion, the answers and the metrics line for hits are
printed, and everything stops cleanly.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """Where the demo keeps what it generates: $XDG_CACHE_HOME/moed/demo, or
    ~/.cache/moed/demo when that is unset or not absolute (the XDG rule); never
    next to the package, which may be installed read-only."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "moed" / "demo"


def trained_model() -> Path:
    from moed.data import tiny_moe

    return tiny_moe(verify=True)


def random_model() -> Path:
    from moed.modelgen.makemodel import make_model

    path = cache_dir() / "demo-qwen3moe.gguf"
    if not path.exists():
        print(f"demo: generating a small qwen3moe model at {path}", flush=True)
        tmp = path.with_suffix(".tmp.gguf")
        make_model(tmp, layers=8, experts=32, used=4, embd=256, ff=256, quant="q8_0", align=4096, seed=7)
        tmp.rename(path)
    return path


def routed_bytes(model: Path) -> int:
    from moed.gguf.catalog import Catalog

    cat = Catalog.open(model)
    return sum(cat.expert_bytes(layer) * cat.n_experts for layer in cat.moe_layers)


def start_daemon(budget: int, shared: bool, *extra: str):
    from moed.protocol.errors import DaemonUnavailable
    from moed.spawn import DaemonProcess

    # The demo's second tenant is another user: let it reach the socket.
    config = {"socket_mode": 0o666} if shared else None
    try:
        daemon = DaemonProcess(budget, "--log-level", "warning", *extra, config=config)
    except DaemonUnavailable as exc:
        raise SystemExit(f"demo: {exc}") from None
    if shared:
        os.chmod(daemon.dir, 0o755)
    return daemon


NOBODY = 65534


def second_tenant_possible(model: Path) -> bool:
    """Root can run the second engine as `nobody`, if nobody can read the model and the venv."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        return False
    check = subprocess.run(
        [
            "setpriv",
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
            "--clear-groups",
            sys.executable,
            "-c",
            f"open({str(model)!r}, 'rb').close()",
        ],
        capture_output=True,
    )
    return check.returncode == 0


def nobody_dir(stack: contextlib.ExitStack) -> str:
    """A temporary directory `nobody` owns, removed when `stack` closes."""
    path = tempfile.mkdtemp(prefix="moed-demo-nobody-")
    stack.callback(shutil.rmtree, path, True)
    os.chown(path, NOBODY, NOBODY)
    return path


def engine_command(
    sock: str,
    model: Path,
    prompt: str,
    name: str,
    as_nobody: bool,
    n_predict: int = 48,
    sample: list[str] | None = None,
) -> list[str]:
    try:
        import llama_cpp  # noqa: F401

        from moed.engines import llama_cpp as _streamed  # noqa: F401

        cmd = [
            sys.executable,
            "-m",
            "moed.ctl",
            "--socket",
            sock,
            "generate",
            str(model),
            "--prompt",
            prompt,
            "-n",
            str(n_predict),
            *(sample or []),
        ]
    except ImportError:
        cmd = [sys.executable, "-m", "moed.demo_client", sock, str(model), name]
    if as_nobody:
        cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *cmd]
    return cmd


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_demo(model: Path, budget: int) -> int:
    """moed + one `moectl serve`; a chat request and a streamed completion through openai."""
    import time
    import urllib.request

    try:
        import llama_cpp.server.app  # noqa: F401
        import openai
    except ImportError as exc:
        print(
            f"demo --serve needs llama-cpp-python[server] and openai (scripts/setup-venv installs them): {exc}",
            file=sys.stderr,
        )
        return 1
    metrics_port, port = free_port(), free_port()
    daemon = start_daemon(budget, False, "--metrics-listen", f"127.0.0.1:{metrics_port}")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moed.ctl",
            "--socket",
            daemon.socket,
            "serve",
            str(model),
            "--port",
            str(port),
            "--alias",
            "demo",
            "--ctx",
            "1024",
        ]
    )
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    ok = False
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("demo: moectl serve did not come up") from None
                time.sleep(0.2)
        print(f"demo: OpenAI-compatible server on http://127.0.0.1:{port}/v1, experts from moed", flush=True)
        chat = client.chat.completions.create(
            model="demo", max_tokens=24, temperature=0, messages=[{"role": "user", "content": "Say hello."}]
        )
        print(f"demo: chat answer: {chat.choices[0].message.content!r}", flush=True)
        print("demo: streamed completion: ", end="", flush=True)
        for chunk in client.completions.create(
            model="demo", prompt="Once upon a time", max_tokens=48, temperature=0, stream=True
        ):
            print(repr(chunk.choices[0].text)[1:-1], end="", flush=True)
        print(flush=True)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        for line in metrics.splitlines():
            if line.startswith(("moed_hits_total", "moed_misses_total")):
                print(f"demo: metrics: {line}", flush=True)
        ok = True
    finally:
        server.terminate()
        server.wait(30)
        rc = daemon.stop(15)
    print(f"demo: server stopped, moed stopped (exit {rc})")
    return 0 if ok and rc == 0 else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/demo")
    ap.add_argument("model", nargs="?", help="a MoE GGUF (default: the committed tiny trained qwen3moe)")
    ap.add_argument("--random", action="store_true", help="a generated random-weight model instead (noise)")
    ap.add_argument(
        "--budget-fraction", type=float, default=0.5, help="RAM budget as a share of the model's routed expert bytes"
    )
    ap.add_argument(
        "--serve",
        action="store_true",
        help="moed and one OpenAI-compatible server instead; requests through the openai client",
    )
    args = ap.parse_args(argv)
    trained = not args.model and not args.random
    model = Path(args.model).resolve() if args.model else trained_model() if trained else random_model()
    if trained:
        from moed.data import TINY_MOE_SUMMARY

        print(f"demo: {TINY_MOE_SUMMARY}", flush=True)
    total = routed_bytes(model)
    budget = max(int(total * args.budget_fraction), 1 << 20)
    print(
        f"demo: model {model} ({total / 2**20:.1f} MiB of routed experts), moed budget {budget / 2**20:.1f} MiB",
        flush=True,
    )
    if args.serve:
        return serve_demo(model, budget)
    two_users = second_tenant_possible(model)
    daemon = start_daemon(budget, shared=two_users)
    sock = daemon.socket
    codes = []
    stack = contextlib.ExitStack()
    try:
        prompts = (
            [
                ("engine-a", "import os\n\n\ndef ", False),
                ("engine-b", "class Reader:\n    def __init__(self", two_users),
            ]
            if trained
            else [("engine-a", "The quick brown fox", False), ("engine-b", "Once upon a time", two_users)]
        )
        print(
            "demo: two engines generate at once"
            + (", the second as user nobody (a second tenant)" if two_users else " (one user, so one tenant)"),
            flush=True,
        )
        n = 96 if trained else 48  # byte tokens: the trained model's context is 128
        # Greedy decoding of a tiny byte model loops ("the string the string"): sample, seeded.
        sample = ["--temp", "0.6", "--seed", "1"] if trained else []
        # The second tenant's engine runs as nobody with root's $HOME: its skeleton (the
        # model file with holes for the experts, what llama.cpp loads) goes to a
        # directory of its own instead of root's ~/.cache, which it cannot write.
        nobody_env = {**os.environ, "MOED_SKELETON_DIR": nobody_dir(stack)} if two_users else None
        procs = [
            subprocess.Popen(
                engine_command(sock, model, p, name, other, n, sample),
                stdout=subprocess.PIPE,
                text=True,
                env=nobody_env if other else None,
            )
            for name, p, other in prompts
        ]
        outs = [p.communicate()[0] for p in procs]  # small: the pipes never fill
        codes = [p.returncode for p in procs]
        for (name, prompt, _), text in zip(prompts, outs):
            print(f"demo: {name}, prompt {prompt!r}, wrote (prompt included):", flush=True)
            print("    | " + (prompt + text).rstrip("\n").replace("\n", "\n    | "), flush=True)
        if any(codes):
            print(f"demo: an engine failed: exit codes {codes}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "moed.ctl", "--socket", sock, "stats"], check=False)
    finally:
        rc = daemon.stop(15)
        stack.close()
    print(f"demo: moed stopped (exit {rc})")
    if rc:
        print(daemon.log()[-2000:], file=sys.stderr)
    return 1 if rc or any(codes) else 0


if __name__ == "__main__":
    sys.exit(main())
