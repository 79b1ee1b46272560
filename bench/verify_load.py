"""Verify mode under load: 8 clients x 10,000 acquires with heavy churn, zero mismatches.

Run: .venv/bin/python bench/verify_load.py [--clients 8] [--acquires 10000]

A real daemon whose budget holds half of a model's experts; each client
process acquires random top-k experts of random layers (about half miss, so
slots are evicted and re-read all the time) and checks the bytes of every
`--check-every`-th lease against the file. Two runs in the same invocation:
`verify = true` and, as the baseline, `verify = false`.

Prints per run: acquires, wall time, acquires/s, misses, re-reads verified,
verify mismatches and byte-check failures, hits served locally (no round trip)
and the daemon's CPU time per acquire; then the throughput ratio
verify / baseline. `MOED_LOCAL_HITS=0` in the environment turns local hits off.
"""

from __future__ import annotations

import argparse
import atexit
import multiprocessing as mp
import os
import random
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moed.client import Client  # noqa: E402
from moed.gguf.budget import slot_bytes  # noqa: E402
from moed.gguf.catalog import Catalog  # noqa: E402
from moed.modelgen.makemodel import make_model  # noqa: E402
from moed.protocol import errors  # noqa: E402
from moed.testing import DaemonProcess  # noqa: E402


def client(sock: str, model: str, n: int, check_every: int, seed: int, out) -> None:
    cat = Catalog.open(model)
    fds = {p: os.open(p, os.O_RDONLY) for p in cat.files}
    rng = random.Random(seed)
    bad = refused = checked = 0
    with Client(sock, f"load{seed}") as c:
        h = c.open_model(model)
        for i in range(n):
            layer = rng.choice(h.moe_layers)
            experts = rng.sample(range(h.n_experts), h.n_expert_used)
            try:
                with h.acquire(layer, experts, timeout_s=30) as lease:
                    if i % check_every == 0:
                        for e in experts:
                            for part in h.parts:
                                path, off, length = cat.extent(layer, e, part)
                                checked += 1
                                bad += lease.view(e, part).tobytes() != os.pread(fds[path], length, off)
            except errors.VerifyMismatch:
                refused += 1
    out.put((bad, refused, checked))


def run(model: str, budget: int, verify: bool, args) -> dict:
    tmp = tempfile.mkdtemp(prefix="moed-verify-")
    conf = os.path.join(tmp, "moed.toml")
    with open(conf, "w") as f:
        f.write(f"verify = {'true' if verify else 'false'}\n")
    d = DaemonProcess(str(budget), "--config", conf)
    import psutil

    daemon_proc = psutil.Process(d.proc.pid)
    cpu0 = sum(daemon_proc.cpu_times()[:2])
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=client, args=(d.socket, model, args.acquires, args.check_every, i, q))
        for i in range(args.clients)
    ]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    results = [q.get(timeout=1800) for _ in procs]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join()
    cpu_s = sum(daemon_proc.cpu_times()[:2]) - cpu0
    with d.client() as c:
        s = c.stats()
    d.stop()
    total = args.clients * args.acquires
    return {
        "verify": verify,
        "acquires": total,
        "wall_s": wall,
        "rate": total / wall,
        "misses": s["misses"],
        "hits": s["hits"],
        "evictions": s["evictions"],
        "verified_reads": s.get("verified_reads", 0),
        "verify_mismatches": s.get("verify_mismatches", 0),
        "refused": sum(r[1] for r in results),
        "byte_failures": sum(r[0] for r in results),
        "checked_parts": sum(r[2] for r in results),
        "exit_codes": [p.exitcode for p in procs],
        "local_hits": s.get("local_hits", 0),
        "daemon_cpu_s": cpu_s,
        "daemon_cpu_us_per_acquire": cpu_s / total * 1e6,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--acquires", type=int, default=10_000)
    p.add_argument("--check-every", type=int, default=20)
    p.add_argument("--repeat", type=int, default=1, help="alternate on/off runs; the ratio uses the best of each")
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="moed-verify-model-")
    atexit.register(shutil.rmtree, tmp, True)
    model = str(make_model(os.path.join(tmp, "m.gguf"), layers=8, experts=32, used=4)[0])
    cat = Catalog.open(model)
    slot = slot_bytes(cat.layers[0])
    budget = slot * len(cat.layers) * cat.n_experts // 2
    runs = []
    for _ in range(args.repeat):
        runs += [run(model, budget, True, args), run(model, budget, False, args)]
    for r in runs:
        print(
            f"verify={r['verify']!s:5}: {r['acquires']} acquires by {args.clients} clients in {r['wall_s']:.1f} s "
            f"({r['rate']:,.0f}/s); hits/misses {r['hits']}/{r['misses']}, {r['evictions']} evictions; "
            f"re-reads verified {r['verified_reads']}, verify mismatches {r['verify_mismatches']}, "
            f"acquires refused {r['refused']}; byte checks {r['checked_parts']} parts, "
            f"failures {r['byte_failures']}; client exits {set(r['exit_codes'])}; "
            f"local hits {r['local_hits']}; daemon CPU {r['daemon_cpu_s']:.1f} s "
            f"({r['daemon_cpu_us_per_acquire']:.0f} µs an acquire)"
        )
    on = max((r for r in runs if r["verify"]), key=lambda r: r["rate"])
    off = max((r for r in runs if not r["verify"]), key=lambda r: r["rate"])
    print(f"ratio throughput verify/baseline (best of {args.repeat} each): {on['rate'] / off['rate']:.3f}")
    ok = all(r["verify_mismatches"] == 0 and r["byte_failures"] == 0 for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
