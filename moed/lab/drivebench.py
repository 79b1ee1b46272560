"""The drive benchmark: raw O_DIRECT random reads, and moed's read path on the same file.

`raw_reads(path, size, depth, seconds)`: `depth` threads, each with one
`size`-byte positioned read in flight at a random 4096-aligned offset of the
file, for `seconds`. O_DIRECT when the filesystem allows it (otherwise buffered,
and `direct` says so). Reports GB/s (10^9 bytes/s) and read latency percentiles.

`moed_reads(model, size, depth, seconds)`: the same drive through the daemon.
It starts a private moed on the file (a MoE GGUF) with `chunk_bytes = size`
and `reader_threads = depth`, so the daemon's reader pool issues the same read
size at the same depth as the raw run, and a RAM budget far below the model so
nearly every acquire misses. `depth` client threads, each on its own
connection, acquire one expert at a time (each thread walks its own shuffled
share of the experts, so no two threads want the same one and no expert is
reused before the LRU has evicted it) and release it at once. The rate is the
daemon's own `bytes_read` over the window: the full path (protocol, store,
reader pool, O_DIRECT into the locked RAM tier, completion) measured from the
outside, with latency per acquire.

`paired(...)`: raw, moed, raw again. A shared box's drive drifts, so only the
ratio of moed to the mean of the two raw runs around it means anything.

`write_bench_model(path, size_bytes)`: a GGUF holding only routed-expert
tensors (F16, arbitrary bytes, parts a multiple of the read size), enough for
the daemon's catalog; nothing can compute with it.
"""

from __future__ import annotations

import errno
import functools
import mmap
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from moed.badinput import BadInput

ALIGN = 4096
Tick = Callable[[float, int], None]  # (elapsed_s, bytes so far)


@dataclass
class DriveRun:
    label: str
    gbps: float
    bytes: int
    ops: int
    seconds: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    direct: bool = True

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _percentiles(lat_s: list[float]) -> dict[str, float]:
    if not lat_s:
        return {"p50_ms": 0.0, "p90_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
    a = np.asarray(lat_s) * 1e3
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"p50_ms": float(p50), "p90_ms": float(p90), "p99_ms": float(p99), "max_ms": float(a.max())}


def _check(size: int, depth: int, seconds: float) -> None:
    if size < ALIGN or size % ALIGN:
        raise BadInput(f"--size must be a positive multiple of {ALIGN} bytes, not {size}")
    if depth < 1 or seconds <= 0:
        raise BadInput("--depth must be >= 1 and --seconds > 0")


def _open(path: str) -> tuple[int, bool]:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC), True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise BadInput(f"cannot open {path}: {exc.strerror}") from None
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC), False


def _run_threads(
    workers: list[Callable[[], None]], seconds: float, progress_bytes: Callable[[], int], tick: Tick | None
) -> float:
    """Start the workers, tick progress until `seconds` pass, join; returns the wall time."""
    threads = [threading.Thread(target=w, daemon=True) for w in workers]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    while alive := [t for t in threads if t.is_alive()]:
        alive[0].join(timeout=0.1)
        if tick is not None:
            tick(time.perf_counter() - t0, progress_bytes())
    wall = time.perf_counter() - t0
    if tick is not None:
        tick(wall, progress_bytes())
    return wall


def raw_reads(
    path: str, size: int = 1 << 20, depth: int = 8, seconds: float = 10.0, tick: Tick | None = None, seed: int = 0
) -> DriveRun:
    _check(size, depth, seconds)
    fd, direct = _open(path)
    try:
        file_bytes = os.fstat(fd).st_size
        if file_bytes < size:
            raise BadInput(f"{path} is {file_bytes} bytes, smaller than one {size}-byte read")
        blocks = (file_bytes - size) // ALIGN
        stop_at = time.perf_counter() + seconds
        lat: list[list[float]] = [[] for _ in range(depth)]
        done = [0] * depth

        def worker(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            buf = mmap.mmap(-1, size)
            try:
                while time.perf_counter() < stop_at:
                    off = rng.randint(0, blocks) * ALIGN
                    t0 = time.perf_counter()
                    got = os.preadv(fd, [buf], off)
                    lat[i].append(time.perf_counter() - t0)
                    done[i] += got
            finally:
                buf.close()

        wall = _run_threads([functools.partial(worker, i) for i in range(depth)], seconds, lambda: sum(done), tick)
    finally:
        os.close(fd)
    total = sum(done)
    flat = [x for per in lat for x in per]
    return DriveRun("raw", total / wall / 1e9, total, len(flat), wall, direct=direct, **_percentiles(flat))


def moed_reads(
    model_path: str, size: int = 1 << 20, depth: int = 8, seconds: float = 10.0, tick: Tick | None = None, seed: int = 0
) -> DriveRun:
    from moed.client import Client
    from moed.gguf.budget import slot_bytes_by_layer
    from moed.gguf.catalog import Catalog
    from moed.spawn import DaemonProcess

    _check(size, depth, seconds)
    cat = Catalog.open(model_path)
    slot = max(slot_bytes_by_layer(model_path).values())
    keys = [(l, e) for l in cat.moe_layers for e in range(cat.n_experts)]
    budget = 2 * depth * slot  # every thread's lease, and as much again
    if len(keys) < 2 * (budget // slot):  # an expert comes back only after the LRU dropped it
        raise BadInput(
            f"{model_path} is too small for a drive benchmark: it holds {len(keys)} experts, "
            f"and {depth} readers need at least {2 * (budget // slot)} to keep missing"
        )
    random.Random(seed).shuffle(keys)
    shares = [keys[i::depth] for i in range(depth)]
    config = {"chunk_bytes": size, "reader_threads": depth}
    with DaemonProcess(budget, config=config) as d:
        clients = [Client(d.socket, f"bench-drive-{i}") for i in range(depth + 1)]
        try:
            models = [c.open_model(model_path) for c in clients[1:]]
            return _drive_daemon(clients[0], models, shares, seconds, tick)
        finally:
            for c in clients:
                c.close()


def _drive_daemon(probe, models, shares, seconds: float, tick: Tick | None) -> DriveRun:
    """Each model handle (its own connection) acquires its share of experts one by one."""
    stats0 = probe.stats()
    stop_at = time.perf_counter() + seconds
    lat: list[list[float]] = [[] for _ in shares]

    def worker(i: int) -> None:
        share, model, k = shares[i], models[i], 0
        while time.perf_counter() < stop_at:
            layer, expert = share[k % len(share)]
            k += 1
            t0 = time.perf_counter()
            lease = model.acquire(layer, [expert], timeout_s=60)
            lat[i].append(time.perf_counter() - t0)
            lease.release()

    def read_so_far() -> int:
        return probe.stats()["bytes_read"] - stats0["bytes_read"]

    wall = _run_threads(
        [functools.partial(worker, i) for i in range(len(shares))],
        seconds,
        read_so_far if tick is not None else (lambda: 0),
        tick,
    )
    stats1 = probe.stats()
    total = stats1["bytes_read"] - stats0["bytes_read"]
    flat = [x for per in lat for x in per]
    direct = bool(stats1.get("direct_io", True))
    return DriveRun("moed", total / wall / 1e9, total, len(flat), wall, direct=direct, **_percentiles(flat))


def paired(
    path: str,
    size: int = 1 << 20,
    depth: int = 8,
    seconds: float = 10.0,
    tick_for: Callable[[str], Tick | None] = lambda label: None,
) -> dict[str, Any]:
    """raw, moed, raw again; `ratio` is moed over the mean of the two raw runs."""
    raw1 = raw_reads(path, size, depth, seconds, tick_for("raw"), seed=1)
    moed = moed_reads(path, size, depth, seconds, tick_for("moed"), seed=2)
    raw2 = raw_reads(path, size, depth, seconds, tick_for("raw again"), seed=3)
    raw = (raw1.gbps + raw2.gbps) / 2
    return {
        "raw_gbps": raw,
        "moed_gbps": moed.gbps,
        "ratio": moed.gbps / raw if raw else 0.0,
        "size_bytes": size,
        "depth": depth,
        "seconds": seconds,
        "runs": [raw1.to_json(), moed.to_json(), raw2.to_json()],
    }


def single(
    path: str, size: int = 1 << 20, depth: int = 8, seconds: float = 10.0, tick: Tick | None = None
) -> dict[str, Any]:
    run = raw_reads(path, size, depth, seconds, tick)
    return {"raw_gbps": run.gbps, "size_bytes": size, "depth": depth, "seconds": seconds, "runs": [run.to_json()]}


# ---- a file to benchmark with --------------------------------------------------


def write_bench_model(
    path: str | os.PathLike, size_bytes: int, part_bytes: int = 1 << 20, experts: int = 64, seed: int = 0
) -> str:
    """A MoE GGUF of about `size_bytes` with only routed-expert tensors (F16, random bytes)."""
    from gguf import GGUFWriter

    if part_bytes % ALIGN or part_bytes < ALIGN:
        raise BadInput(f"part size must be a multiple of {ALIGN}")
    expert_bytes = 3 * part_bytes
    layers = max(1, round(size_bytes / (experts * expert_bytes)))
    ne0 = 1024
    ne1 = part_bytes // (2 * ne0)
    if ne1 * ne0 * 2 != part_bytes:
        raise BadInput(f"part size must be a multiple of {2 * ne0} bytes")
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    w = GGUFWriter(tmp, "qwen3moe")
    w.add_name("moed drive benchmark file (not a usable model)")
    w.add_uint32("qwen3moe.block_count", layers)
    w.add_uint32("qwen3moe.expert_count", experts)
    w.add_uint32("qwen3moe.expert_used_count", min(8, experts))
    w.add_custom_alignment(ALIGN)
    names = [f"blk.{l}.ffn_{p}_exps.weight" for l in range(layers) for p in ("gate", "up", "down")]
    tensor_bytes = experts * part_bytes
    for name in names:
        w.add_tensor_info(name, (experts, ne1, ne0), np.dtype(np.float16), tensor_bytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    assert w.fout is not None  # write_header_to_file opened the output file
    fout = w.fout[0]
    fout.write(b"\0" * (-fout.tell() % ALIGN))
    block = np.random.default_rng(seed).integers(0, 256, part_bytes, dtype=np.uint8).tobytes()
    for _ in range(len(names) * experts):
        fout.write(block)
    fout.flush()
    os.fsync(fout.fileno())
    w.close()
    os.replace(tmp, path)
    fd = os.open(path, os.O_RDONLY)
    try:  # drop it from the page cache: this is for the drive
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return path
