"""Support shared by the tests and the benchmarks: predicates with deadlines, file bytes, /proc.

Shipped with the package (as numpy.testing is) so that benchmarks need nothing
from `tests/`. `moed.testing.frames` holds the hostile-frame strategies, which
need hypothesis (the `dev` extra).
"""

from __future__ import annotations

import time

from moed.spawn import DaemonProcess  # re-exported: tests and benches start daemons through it

__all__ = ["DaemonProcess", "file_bytes", "good_client", "proc_status_bytes", "wait_for"]


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


def good_client(socket_path: str, model: str, stop, result: dict, pace_s: float = 0.001) -> None:
    """A well-behaved engine for hostile benches: ping, acquire random top-k experts and
    check their bytes against the file, until `stop` is set.

    Fills `result`: acquires, worst_ping_s, and error (the first wrong byte or failure).
    """
    import random

    from moed.client import Client
    from moed.gguf.catalog import Catalog

    cat = Catalog.open(model)
    rng = random.Random(7)
    worst, n = 0.0, 0
    try:
        with Client(socket_path, "good", timeout_s=10) as c:
            h = c.open_model(model)
            part = h.parts[0]
            while not stop.is_set():
                t0 = time.monotonic()
                c.ping()
                worst = max(worst, time.monotonic() - t0)
                layer = rng.choice(h.moe_layers)
                experts = rng.sample(range(h.n_experts), h.n_expert_used)
                with h.acquire(layer, experts, timeout_s=10) as lease:
                    for e in experts:
                        path, off, length = cat.extent(layer, e, part)
                        if lease.view(e, part).tobytes() != file_bytes(path, off, length):
                            result["error"] = f"wrong bytes for layer {layer} expert {e}"
                            return
                n += 1
                time.sleep(pace_s)  # pace it: the hostile side needs the CPU more
    except Exception as exc:  # noqa: BLE001 - reported to the bench
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        result.update(acquires=n, worst_ping_s=worst)
