"""Support shared by the tests and the benchmarks: predicates with deadlines, file bytes, /proc.

Shipped with the package (as numpy.testing is) so that benchmarks need nothing
from `tests/`. `moed.testing.frames` holds the hostile-frame strategies, which
need hypothesis (the `dev` extra).
"""

from __future__ import annotations

import time

from moed.spawn import DaemonProcess  # re-exported: tests and benches start daemons through it

__all__ = ["DaemonProcess", "file_bytes", "proc_status_bytes", "wait_for"]


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
