"""Start a private moed subprocess and wait until it answers.

Owns the one way the project starts a daemon of its own: the demo, `moectl
replay --budget`, `moectl bench-drive --paired`, the benchmarks and the tests
all use `DaemonProcess`. Invariant: once the constructor returns, the daemon
answers a ping on `socket`; if it does not within `start_timeout_s`, it has been
killed and `DaemonUnavailable` carries the end of its log.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from moed.protocol.errors import DaemonUnavailable


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _die_with_starter() -> None:
    """A private daemon is killed when the thread that started it exits, so a crashed test
    worker, a test body's fork or a killed bench leaves no daemon behind (issue 30: eleven
    were still running an hour after a crashing test file)."""
    from moed import libc

    libc.die_with_parent(signal.SIGKILL)


class DaemonProcess:
    """`moed --socket DIR/s --ram-budget BUDGET *extra` in a short temporary directory.

    `config` (a dict) is written as a TOML file and passed with --config;
    `env` adds environment variables. The log goes to DIR/moed.log.
    """

    def __init__(
        self,
        budget: str | int = "64MiB",
        *extra: str,
        socket_dir: str | None = None,
        env: dict | None = None,
        config: dict[str, Any] | None = None,
        start_timeout_s: float = 20.0,
    ):
        self.dir = Path(socket_dir or tempfile.mkdtemp(prefix="moed-", dir="/tmp"))
        self._own_dir = socket_dir is None  # made here: `close` removes it with the log
        self.socket = str(self.dir / "s")
        self.log_path = self.dir / "moed.log"
        cmd = [sys.executable, "-m", "moed.daemon.main", "--socket", self.socket, "--ram-budget", str(budget), *extra]
        if config:
            cfg = self.dir / "moed.toml"
            cfg.write_text("".join(f"{k} = {_toml(v)}\n" for k, v in config.items()))
            cmd += ["--config", str(cfg)]
        self._log = open(self.log_path, "wb")
        self._owner = os.getpid()  # the process that can wait for it (see running)
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            # The repack cache goes in this daemon's directory (as systemd's CacheDirectory= would
            # name one), so tests and benches never share one by accident; a restart given the same
            # `socket_dir` finds it again.
            env={**os.environ, "CACHE_DIRECTORY": str(self.dir / "cache"), **(env or {})},
            preexec_fn=_die_with_starter,
        )
        deadline = time.monotonic() + start_timeout_s
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise DaemonUnavailable(f"moed did not start (exit {self.proc.returncode}):\n{self.log()[-2000:]}")
            time.sleep(0.02)

    def _answers(self) -> bool:
        from moed.client import Client

        try:
            with Client(self.socket, timeout_s=2) as c:
                c.ping()
            return True
        except DaemonUnavailable:
            return False

    def client(self, name: str = "", **kw):
        from moed.client import Client

        return Client(self.socket, name, **kw)

    def running(self) -> bool:
        """Whether the daemon is alive, asked from any process. A fork of the process that
        started it (an e2e test body, tests/forked.py) is not its parent: there Popen.poll
        cannot wait for it and reads a live daemon as exited 0, so /proc is read instead
        (an exited daemon its parent has not reaped yet is a zombie: not running)."""
        if os.getpid() == self._owner:
            return self.proc.poll() is None
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        return state not in ("Z", "X")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, wait; the exit code (a daemon that hangs is killed and reported)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError(f"moed did not stop within {timeout_s}s:\n{self.log()[-2000:]}") from None
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def close(self) -> None:
        """Kill it (if running) and remove the directory this object made (socket and log):
        a suite of hundreds of daemons must not leave hundreds of directories in /tmp."""
        self.kill()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            if self._own_dir:
                shutil.rmtree(self.dir, ignore_errors=True)
