"""Test support: the real `moed` as a subprocess (moed.spawn) and predicates.

`DaemonProcess` starts `python -m moed.daemon.main` on a short socket path in
its own temporary directory and waits (with a deadline) until it answers a ping.
"""

from __future__ import annotations

import time

from moed.spawn import DaemonProcess  # noqa: F401 - re-exported for tests and benches


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


def file_bytes(path: str, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def proc_status_bytes(pid: int, field: str) -> int:
    """A kB field of /proc/PID/status (VmRSS, RssShmem, ...) in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/{pid}/status")
