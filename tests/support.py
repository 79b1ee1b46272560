"""Test support: run the real `moed` as a subprocess and wait on predicates.

`DaemonProcess` starts `python -m moed.daemon.main` on a short socket path in
its own temporary directory, waits (with a deadline) until it answers a ping,
and stops it with SIGTERM, asserting a clean exit unless told otherwise.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def wait_for(predicate, timeout_s: float = 10.0, interval_s: float = 0.01, what: str = "condition"):
    """Poll `predicate` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def moed_segments() -> set[str]:
    """Names in /dev/shm and memfd mappings that look like ours (for leak checks)."""
    return {n for n in os.listdir("/dev/shm") if "moed" in n}


class DaemonProcess:
    def __init__(self, budget: str = "64MiB", *args: str, socket_dir: str | None = None, env: dict | None = None):
        self.dir = Path(socket_dir or tempfile.mkdtemp(prefix="moed-", dir="/tmp"))
        self.socket = str(self.dir / "s")
        self.log_path = self.dir / "moed.log"
        cmd = [sys.executable, "-m", "moed.daemon.main", "--socket", self.socket, "--ram-budget", budget, *args]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        try:
            wait_for(self._ready, 20.0, what=f"moed to answer on {self.socket}")
        except TimeoutError:
            self.kill()
            raise RuntimeError(f"moed did not start:\n{self.log()}") from None

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"moed exited with {self.proc.returncode}:\n{self.log()}")
        from moed.client import Client
        from moed.protocol.errors import DaemonUnavailable
        try:
            with Client(self.socket, "probe", timeout_s=2) as c:
                c.ping()
            return True
        except DaemonUnavailable:
            return False

    def client(self, name: str = "test", **kw):
        from moed.client import Client
        return Client(self.socket, name, **kw)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"moed did not stop within {timeout_s}s:\n{self.log()}")
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()


def file_bytes(path: str, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)
