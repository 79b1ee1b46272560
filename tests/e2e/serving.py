"""Real `moectl serve` processes for the serve tests, and the openai client that talks to them.

`ServeProcess` starts `moectl --socket S serve MODEL --alias m ...` (or `serve --config
F`) on a free port and is ready once /v1/models answers; its log is kept for the
test to read. Nothing here stands in for the server, the daemon or the engine.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import openai

from moed.testing import DaemonProcess, wait_for

PROMPT = "the expert model reads memory pages"
# Banned tokens: the generated vocabulary's </s> (id 2), so every completion runs
# to max_tokens, and its byte tokens <0x80>..<0xFF> (ids 131..258), since llama.cpp's
# streaming holds text back while it is not valid UTF-8 (a random model emitting
# stray high bytes would stream nothing until the end). Not min_tokens: this server
# drops the logit bias when both are given (list.extend returns None).
BANNED = {str(t): -100 for t in [2, *range(3 + 0x80, 3 + 0x100)]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`moectl --socket S serve MODEL --port P` (or `serve --config F`), ready once /v1/models answers."""

    def __init__(self, socket_path: str, model, *args: str, log_dir, config=None, new_session: bool = False):
        self.port = free_port()
        self.log_path = log_dir / f"serve-{self.port}.log"
        self._log = open(self.log_path, "wb")
        what = ["--config", str(config)] if config else [str(model), "--alias", "m", "--ctx", "1024", "--threads", "1"]
        cmd = [sys.executable, "-m", "moed.ctl", "--socket", socket_path, "serve", *what, "--port", str(self.port)]
        self.proc = subprocess.Popen(
            [*cmd, *args], stdout=self._log, stderr=subprocess.STDOUT, start_new_session=new_session
        )
        key = args[args.index("--api-key") + 1] if "--api-key" in args else "none"
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key, max_retries=0, timeout=60)
        wait_for(self._ready, timeout_s=60, interval_s=0.1, what=f"moectl serve on port {self.port}")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"moectl serve exited {self.proc.returncode}:\n{self.log()}")
        try:
            return bool(self.client.models.list().data)
        except openai.APIConnectionError:
            return False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def complete(server: ServeProcess, n: int = 16, **kw):
    """A greedy completion of exactly `n` tokens."""
    return server.client.completions.create(
        model="m", prompt=PROMPT, max_tokens=n, temperature=0, logit_bias=BANNED, **kw
    )


def served_experts(d: DaemonProcess) -> int:
    """Experts the daemon has granted so far (hits, local ones included, and misses)."""
    with d.client("test") as c:
        s = c.stats()
    return s["hits"] + s["misses"]
