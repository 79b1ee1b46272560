"""Miss throughput: cold acquires of distinct experts through moed, against raw O_DIRECT reads.

Run: .venv/bin/python bench/miss_throughput.py [MODEL.gguf] [--clients 4] [--threads 8]

Without MODEL, a 1.7 GiB page-aligned Q4_0 model (8 layers x 64 experts,
3.4 MiB per expert) is generated once under /tmp/moed-bench/.

Paired on disjoint parts of the same file, so no run reads what another read
(the host may cache the virtual disk): raw (layers 0-1), moed (layers 2-5),
raw again (layers 6-7). Raw is a loop of `--threads` threads doing O_DIRECT
preads of the daemon's chunk size (256 KiB) over the same expert extents: the
same request size and depth as the daemon's reader pool. moed is a real
daemon with `--threads` readers and a budget of one layer's experts, filled
by a warm-up layer first, so every measured miss evicts (steady state: pages
are reused, as on a box whose tier has been full for a while; a cold fill
also pays the kernel's shmem page allocation, about 5 µs a page here).
`--clients` client threads each acquire the top-k experts of one layer at a
time (8 experts = 27 MiB in flight per client).
Prints GB/s of each and moed / mean(raw).
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHUNK = 256 << 10


def default_model() -> str:
    from moed.modelgen.makemodel import make_model

    path = "/tmp/moed-bench/big-q4_0-aligned.gguf"
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        print(f"generating {path} (once, about 2 minutes)", flush=True)
        make_model(path, layers=8, experts=64, used=8, embd=2048, ff=1024, quant="q4_0", align=4096)
    return path


def extents(cat, layers):
    out = []
    for layer in layers:
        for e in range(cat.n_experts):
            for part in cat.parts:
                out.append(cat.extent(layer, e, part))
    return out


def raw(cat, layers, threads: int) -> float:
    chunks = [(p, off + pos, min(CHUNK, n - pos)) for p, off, n in extents(cat, layers) for pos in range(0, n, CHUNK)]
    fds = {p: os.open(p, os.O_RDONLY | os.O_DIRECT) for p in cat.files}
    lock = threading.Lock()
    it = iter(chunks)
    total = [0]

    def work():
        buf = mmap.mmap(-1, CHUNK + 8192)
        while True:
            with lock:
                c = next(it, None)
            if c is None:
                return
            p, off, n = c
            start = off - off % 4096
            end = -(-(off + n) // 4096) * 4096
            got = os.preadv(fds[p], [memoryview(buf)[: end - start]], start)
            with lock:
                total[0] += min(got, n)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    return total[0] / dt / 1e9


def through_moed(model: str, cat, layers, clients: int, threads: int) -> float:
    """Steady state: the tier is full after the first layer, so every miss evicts."""
    from moed.gguf.budget import slot_bytes
    from moed.testing import DaemonProcess

    warm, layers = layers[:1], layers[1:]
    one_layer = cat.n_experts * slot_bytes(cat.layers[warm[0]])
    d = DaemonProcess(str(one_layer), "--reader-threads", str(threads))
    try:
        conns = [d.client(f"c{i}") for i in range(clients)]
        handles = [c.open_model(model) for c in conns]
        k = cat.n_expert_used
        for i in range(0, cat.n_experts, k):
            handles[0].acquire(warm[0], list(range(i, i + k))).release()
        work = [(layer, list(range(i, i + k))) for layer in layers for i in range(0, cat.n_experts, k)]
        lock = threading.Lock()
        it = iter(work)

        def client(h):
            while True:
                with lock:
                    w = next(it, None)
                if w is None:
                    return
                h.acquire(w[0], w[1]).release()

        s0 = conns[0].stats()
        before = s0["bytes_read"]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(client, handles))
        dt = time.perf_counter() - t0
        s = conns[0].stats()
        assert s["misses"] - s0["misses"] == len(work) * k, s["misses"]
        assert s["evictions"] - s0["evictions"] >= len(work) * k - k
        for c in conns:
            c.close()
        return (s["bytes_read"] - before) / dt / 1e9
    finally:
        d.stop()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--threads", type=int, default=8)
    args = ap.parse_args()
    from moed.gguf.catalog import Catalog

    model = args.model or default_model()
    cat = Catalog.open(model)
    L = sorted(cat.moe_layers)
    q = max(1, len(L) // 4)
    r1 = raw(cat, L[:q], args.threads)
    mo = through_moed(model, cat, L[q : 3 * q], args.clients, args.threads)
    r2 = raw(cat, L[3 * q :], args.threads)
    print(f"model {model}: {cat.n_experts} experts/layer, {cat.expert_bytes(L[0]) / 2**20:.1f} MiB/expert")
    print(f"raw O_DIRECT ({args.threads} threads, 256 KiB): {r1:.2f} GB/s, then {r2:.2f} GB/s")
    print(
        f"moed misses, steady state ({args.clients} clients x top-{cat.n_expert_used}, {args.threads} readers): {mo:.2f} GB/s"
    )
    print(f"ratio moed / mean(raw) = {mo / ((r1 + r2) / 2):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
