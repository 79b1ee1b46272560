"""Everything fits: several engines in one process, decoding in turn token by token.

Run: .venv/bin/python bench/engines_interleaved.py [--engines resident,moed-fit-off,stock,moed-fit,moed-fit-stops]
     [--tokens 96] [--routes model]

Why: on a shared VM one engine's decode speed drifts by 15-20% from one minute to
the next (bench/RESULTS.md), so engines timed one after another, as
bench/engine_vs_mmap.py does, compare drift as much as engines. Here every engine
is loaded at once and each timed round decodes one token on each, in a rotating
order; the figure is the median over rounds of the per-round time ratio, so drift
slower than a round (about half a second) cancels. A token streams about 0.8 GB
of weights, far beyond any cache, so one engine's token leaves nothing warm for
the next.

Engines (all one llama.cpp thread, the trace's routes forced unless `--routes model`, nothing evicted):
- `resident`: UnpackedLlama on anonymous memory (use_mmap=False), the plain kernels;
- `moed-fit-off`: StreamedLlama(repack="off") on the plain file, the same kernels,
  every expert pinned in one daemon: the cost of moed's address-space mapping is
  this against `resident`;
- `stock`: llama_cpp.Llama as stock loads it (use_mmap=False, its repacked kernels);
- `moed-fit`: StreamedLlama(repack="auto") on the `moectl align --repack` copy,
  the same kernels as stock: what a user compares. With `--routes model` it takes
  whole steps (every expert pinned: no per-layer stop, docs/design.md);
- `moed-fit-stops`: the same with whole steps off (MOED_WHOLE_STEPS=0): it stops
  at every routed layer, as moed-fit did before whole steps.

The model is bench/engine_vs_mmap.py's (written there if missing), and so are the
trace and the skeletons. Prints per engine the median ms a token and, per timed
token, the thread's user and system CPU and minor page faults (getrusage of the one
thread llama.cpp computes on); then the median per-round ratios of the pairs above.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import numpy as np
from engine_vs_mmap import DEFAULT_MODEL, ensure_model, load_engine
from trace_routes import DEFAULT_TRACE, TraceRoutes

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PAIRS = [
    ("moed-fit-off", "resident"),
    ("moed-fit", "stock"),
    ("moed-fit-stops", "stock"),
    ("moed-fit", "moed-fit-stops"),
    ("stock", "resident"),
    ("moed-fit", "moed-fit-off"),
]


ENGINES = ("resident", "moed-fit-off", "stock", "moed-fit", "moed-fit-stops")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--engines", default="resident,moed-fit-off,stock,moed-fit")
    ap.add_argument("--tokens", type=int, default=96, help="timed rounds (one token on each engine)")
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument(
        "--routes",
        choices=("trace", "model"),
        default="trace",
        help="trace: the trace's routes forced by a Python route hook on every engine; model: the model's "
        "own router and no hook, every engine as users run it (moed's lane then takes a layer without Python)",
    )
    ap.add_argument("--prefetch", default="off", help="the moed engines' prefetch mode (off, gate, gate2)")
    args = ap.parse_args()
    kinds = args.engines.split(",")
    if unknown := [k for k in kinds if k not in ENGINES]:
        raise SystemExit(f"unknown engine(s) {unknown}: choose from {','.join(ENGINES)}")

    from moed.testing import DaemonProcess

    ensure_model(args.model)
    size = os.path.getsize(args.model)
    n_ctx = args.warmup + args.tokens + 8
    # Everything fits: the daemon pins every expert (both files' experts when both run).
    budget = str(int(size * 2.2))
    with DaemonProcess(budget, "--pin-budget", budget) as daemon:
        routes = {k: TraceRoutes(args.trace) if args.routes == "trace" else None for k in kinds}
        kw = dict(n_ctx=n_ctx, n_batch=32, n_ubatch=32, n_threads=1, n_threads_batch=1, verbose=False)
        engines = {k: _load(k, args.model, daemon.socket, routes[k], args.prefetch, kw) for k in kinds}
        try:
            for llm in engines.values():
                if hasattr(llm, "warm"):  # every expert read and mapped, as the resident engines load
                    llm.warm(everything=True)
                llm.eval([llm.token_bos()])
            times: dict[str, list[float]] = {k: [] for k in kinds}
            cpu: dict[str, list[float]] = {k: [0.0, 0.0, 0] for k in kinds}  # user s, system s, minor faults
            for i in range(args.warmup + args.tokens):
                order = kinds[i % len(kinds) :] + kinds[: i % len(kinds)]  # who goes first rotates
                for k in order:
                    llm = engines[k]
                    route = routes[k]
                    if route is not None:
                        route.start(i)
                    r0, t = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter()
                    llm.eval([llm.token_bos()])
                    if i >= args.warmup:
                        times[k].append(time.perf_counter() - t)
                        r1 = resource.getrusage(resource.RUSAGE_THREAD)  # one llama.cpp thread: this one
                        cpu[k][0] += r1.ru_utime - r0.ru_utime
                        cpu[k][1] += r1.ru_stime - r0.ru_stime
                        cpu[k][2] += r1.ru_minflt - r0.ru_minflt
            lanes = {
                k: (st["lane_layers"], st["layers"], st["whole_decodes"], st["decodes"])
                for k, st in ((k, e.stream_stats()) for k, e in engines.items() if hasattr(e, "stream_stats"))
            }
        finally:
            for llm in engines.values():
                llm.close()
    print(
        f"model {args.model}; {args.tokens} rounds after {args.warmup}; one thread each; "
        f"routes: {args.routes}; moed prefetch {args.prefetch}"
    )
    for k in kinds:
        user, system, faults = (x / args.tokens for x in cpu[k])
        print(
            f"  {k:>13}: median {1e3 * float(np.median(times[k])):7.1f} ms/token, "
            f"{1 / float(np.median(times[k])):6.3f} tok/s; a token: {1e3 * user:.1f} ms user, "
            f"{1e3 * system:.1f} ms system, {faults:.0f} minor faults"
        )
    for k, (n, of, whole, decodes) in lanes.items():
        print(f"  {k}: the lane took {n} of {of} routed layers (local hits, in C); {whole} of {decodes} decodes whole")
    for a, b in PAIRS:
        if a in times and b in times:
            ratio = np.asarray(times[b]) / np.asarray(times[a])  # speed of a over speed of b, per round
            q1, med, q3 = np.percentile(ratio, [25, 50, 75])
            print(f"  {a} vs {b}: {med:.3f}x speed (median of per-round ratios; quartiles {q1:.3f}-{q3:.3f})")


def _load(kind: str, model: str, socket: str, routes, prefetch: str, kw: dict):
    """load_engine's engine; `moed-fit-stops` is moed-fit with whole steps off."""
    if kind != "moed-fit-stops":
        return load_engine(kind, model, socket, routes, prefetch=prefetch, **kw)
    os.environ["MOED_WHOLE_STEPS"] = "0"  # read when the engine's streamer is built
    try:
        return load_engine("moed-fit", model, socket, routes, prefetch=prefetch, **kw)
    finally:
        del os.environ["MOED_WHOLE_STEPS"]


if __name__ == "__main__":
    main()
