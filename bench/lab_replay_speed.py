"""Replay speed of every lab policy, and the decode hit-rate table, on real traces.

    .venv/bin/python bench/lab_replay_speed.py [TRACES_DIR] [--warm N] [--repeat R] [--markdown]

TRACES_DIR (default: ../shared/traces next to the repository) is searched for
*.jsonl, *.tsv and *.npz traces. For each trace and policy it times a full
replay at 25/50/75% of each layer's experts (best of R, one core: the replay is
single-threaded Python) and prints accesses per second of CPU time (process
time, so other load on a shared box does not count against it), all accesses
(prompt and warm-up ones included, since every access updates the cache). The
rate is end to end: next-use computation, list conversion and hit counting
included; only the trace's flattening into accesses (shared by all policies) is
not. The baseline,
measured in the same run, is the cheapest possible Python loop over the same
accesses (one dict store each): a policy's ratio to it is its cost in "dict
operations". The goal is >= 2 M accesses/s for g-lru and g-opt.

Traces without prompt tokens are warmed with their first --warm decode tokens
(default 64, at most a quarter of the trace's decode tokens). --markdown prints the tables for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from moed.lab import mrc, policies
from moed.traces import Trace, TraceWriter

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "shared" / "traces"
SIZES = (0.25, 0.5, 0.75)
GOAL_PER_S = 2e6


def find_traces(root: Path) -> list[Path]:
    found = [p for ext in ("*.jsonl", "*.tsv", "*.npz") for p in root.rglob(ext)]
    return sorted(p for p in found if p.is_file())


def baseline_rate(keys: list[int], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        d: dict[int, int] = {}
        for i, k in enumerate(keys):
            d[k] = i
        best = min(best, time.process_time() - t0)
    return len(keys) / best


def timed_replay(acc: policies.Accesses, policy: str, size: float, repeat: int) -> tuple[float, policies.ReplayResult]:
    best, result = float("inf"), None
    for _ in range(repeat):
        t0 = time.process_time()
        result = policies.replay(acc, policy, size=size)
        best = min(best, time.process_time() - t0)
    return acc.n / best, result


def load_time_of_big_trace() -> tuple[float, int]:
    """Seconds to load a 30,000-token prompt over 48 layers x top-8 (plus 400 decode tokens)."""
    rng = np.random.default_rng(0)
    w = TraceWriter(48, 128, 8)
    for _ in range(30000 // 500):
        w.append_step("P", rng.integers(0, 128, (48, 500, 8)))
    for _ in range(400):
        w.append_step("D", rng.integers(0, 128, (48, 8)), ahead1=rng.integers(0, 128, (48, 16)))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "big.npz"
        w.finish().save(path)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            Trace.load(path)
            best = min(best, time.perf_counter() - t0)
        return best, path.stat().st_size


def synthetic_worst_case(repeat: int) -> str:
    """g-lru, g-opt and the curve on 1.87 M accesses of uniformly random routing
    (48 layers x 128 experts, top-8, 4,000 prompt + 1,000 decode tokens): no
    locality, big caches, the slow end for the heap-based bound."""
    rng = np.random.default_rng(0)
    w = TraceWriter(48, 128, 8)
    w.append_step("P", rng.integers(0, 128, (48, 4000, 8)))
    for _ in range(1000):
        w.append_step("D", rng.integers(0, 128, (48, 8)))
    acc = policies.accesses(w.finish())
    parts = []
    for p in ("g-lru", "g-opt"):
        rate, _ = timed_replay(acc, p, 0.5, repeat)
        parts.append(f"{p} {rate / 1e6:.2f} M/s")
    t0 = time.process_time()
    mrc.lru_curve(acc)
    parts.append(f"mrc {acc.n / (time.process_time() - t0) / 1e6:.2f} M/s")
    return f"synthetic worst case ({acc.n} accesses, size 50%): " + ", ".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="?", default=str(DEFAULT_DIR))
    ap.add_argument("--warm", type=int, default=64, help="warm-up decode tokens for traces without a prompt")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--policies", default=",".join(policies.POLICIES))
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    names = policies.check_policies(args.policies.split(","))
    paths = find_traces(Path(args.traces))
    if not paths:
        print(f"no traces under {args.traces}", file=sys.stderr)
        return 2
    print(
        f"# {platform.node()}: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
        f"Python {platform.python_version()}, numpy {np.__version__}; load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    secs, size = load_time_of_big_trace()
    print(
        f"load: 30,400-token trace (48 layers x top-8, 400 decode tokens with predictions), "
        f"{size / 1e6:.1f} MB native: {secs * 1e3:.0f} ms"
    )
    print(synthetic_worst_case(args.repeat))
    speed_rows, hit_rows = [], []
    for path in paths:
        t0 = time.perf_counter()
        trace = Trace.load(path)
        load_s = time.perf_counter() - t0
        warm = min(args.warm, trace.n_decode_tokens // 4) if trace.n_prompt_tokens == 0 else 0
        acc = policies.accesses(trace, warm)
        base = baseline_rate(acc.keys.tolist(), args.repeat)
        t0 = time.process_time()
        mrc.lru_curve(acc)
        mrc_s = time.process_time() - t0
        name = path.relative_to(args.traces)
        print(
            f"\n{name}: {trace}; {acc.n} accesses ({acc.n_counted} counted, warm {warm}); "
            f"load {load_s * 1e3:.0f} ms; baseline loop {base / 1e6:.2f} M/s; "
            f"mrc (every size) {acc.n / mrc_s / 1e6:.2f} M/s"
        )
        for p in names:
            rates, rates_hit = [], []
            for s in SIZES:
                rate, r = timed_replay(acc, p, s, args.repeat)
                rates.append(rate)
                rates_hit.append(r.hit_rate)
            slowest = min(rates)
            mark = "" if p not in ("g-lru", "g-opt") else ("  goal met" if slowest >= GOAL_PER_S else "  BELOW GOAL")
            print(
                f"  {p:9s} hit {' '.join(f'{100 * h:5.1f}%' for h in rates_hit)}   "
                f"{' '.join(f'{x / 1e6:5.2f}' for x in rates)} M/s  ({slowest / base:.2f}x baseline){mark}"
            )
            speed_rows.append((str(name), p, rates, base))
            hit_rows.append((str(name), p, rates_hit))
    if args.markdown:
        print_markdown(speed_rows, hit_rows, names)
    return 0


def print_markdown(speed_rows, hit_rows, names) -> None:
    traces = list(dict.fromkeys(r[0] for r in hit_rows))
    print("\n### Decode hit rate at 25 / 50 / 75% of each layer's experts\n")
    print("| policy | " + " | ".join(traces) + " |")
    print("|---|" + "---|" * len(traces))
    hits = {(t, p): h for t, p, h in hit_rows}
    for p in names:
        cells = [" / ".join(f"{100 * x:.1f}" for x in hits[(t, p)]) for t in traces]
        print(f"| {p} | " + " | ".join(cells) + " |")
    print("\n### Replay speed, M accesses/s (slowest of the three sizes; baseline = one dict store per access)\n")
    print("| policy | " + " | ".join(traces) + " |")
    print("|---|" + "---|" * len(traces))
    speed = {(t, p): (r, b) for t, p, r, b in speed_rows}
    for p in names:
        cells = [f"{min(speed[(t, p)][0]) / 1e6:.2f}" for t in traces]
        print(f"| {p} | " + " | ".join(cells) + " |")
    cells = [f"{speed[(t, names[0])][1] / 1e6:.2f}" for t in traces]
    print("| *baseline loop* | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
