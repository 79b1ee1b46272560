"""Shared budget against a static split by model size, for the shipped traces in pairs.

    .venv/bin/python bench/fleet_shared_vs_static.py [TRACES_DIR] [--warm N] [--markdown]

TRACES_DIR (default: ../shared/traces next to the repository) is searched for
*.jsonl, *.tsv and *.npz traces with at least --min-tokens tokens (default 256:
the 47-token smoke trace is a slice of olmoe-all and would cut every pair it is
in to 47 tokens). Every pair is replayed as a fleet (`moed.lab.fleetsim`, the
replay `moectl fleet` runs: without models, every expert is one slot) at 25, 50
and 75% of both models' experts, at equal rates and at 1:4 each way, seed 0,
each engine's first --warm decode tokens (default 64) warming the cache.

Printed, per point: aggregate decode hit rate shared and static, their ratio
(shared / static) and the ratio of misses (shared / static), each model's hit
rate in both, and the exact `moectl fleet` command. Then the replay speed in
M accesses/s of CPU time for the shared, static and floors replays against the
cheapest Python loop over the same accesses (one dict store each), measured in
the same run.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import time
from pathlib import Path

from moed.lab import fleetsim
from moed.traces import Trace

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "shared" / "traces"
SHARES = (0.25, 0.5, 0.75)
RATES = ((1.0, 1.0), (1.0, 0.25), (0.25, 1.0))


def find_traces(root: Path, min_tokens: int) -> list[tuple[Path, Trace]]:
    found = sorted(p for ext in ("*.jsonl", "*.tsv", "*.npz") for p in root.rglob(ext) if p.is_file())
    out = []
    for p in found:
        t = Trace.load(p)
        if t.n_tokens >= min_tokens:
            out.append((p, t))
        else:
            print(f"skipped {p.name}: {t.n_tokens} tokens < --min-tokens {min_tokens}")
    return out


def command(paths: tuple[Path, Path], rates: tuple[float, float], share: float, warm: int) -> str:
    specs = " ".join(str(p) + ("" if r == 1 else f"@{r:g}") for p, r in zip(paths, rates))
    return f"moectl fleet {specs} --budget {100 * share:g}% --warm {warm}"


def point(members: list[fleetsim.Member], share: float, warm: int) -> fleetsim.FleetReport:
    budget = int(round(share * fleetsim.all_size(members)))
    return fleetsim.replay_fleet(members, budget, warm=warm, seed=0)


def baseline_rate(keys: list[int]) -> float:
    t0 = time.process_time()
    d: dict[int, int] = {}
    for i, k in enumerate(keys):
        d[k] = i
    return len(keys) / max(time.process_time() - t0, 1e-9)


def speed(members: list[fleetsim.Member], warm: int) -> dict[str, float]:
    """M accesses/s of CPU time of each replay at 25%, and the baseline loop."""
    stream = fleetsim.interleave(members, warm, 0)
    names = [m.name for m in members]
    budget = int(round(0.25 * fleetsim.all_size(members)))
    floors = [budget // (2 * len(members))] * len(members)
    runs = {
        "shared": lambda: fleetsim.shared(stream, names, budget),
        "static": lambda: fleetsim.static(stream, members, budget),
        "floors": lambda: fleetsim.floored(stream, names, budget, floors),
    }
    out = {}
    for name, run in runs.items():
        t0 = time.process_time()
        run()
        out[name] = stream.n / max(time.process_time() - t0, 1e-9) / 1e6
    out["baseline"] = baseline_rate(stream.keys.tolist()) / 1e6
    out["accesses"] = stream.n
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("traces", nargs="?", default=str(DEFAULT_DIR))
    ap.add_argument("--warm", type=int, default=64)
    ap.add_argument("--min-tokens", type=int, default=256)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    traces = find_traces(Path(args.traces), args.min_tokens)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
        f"Python {platform.python_version()}; load average {os.getloadavg()[0]:.1f}"
    )
    rows = []
    for (pa, ta), (pb, tb) in itertools.combinations(traces, 2):
        for rates in RATES:
            members = [
                fleetsim.Member(pa.name.split(".")[0], ta, rates[0]),
                fleetsim.Member(pb.name.split(".")[0], tb, rates[1]),
            ]
            for share in SHARES:
                r = point(members, share, args.warm)
                rows.append((members, rates, share, r, command((pa, pb), rates, share, args.warm)))
        print_speed((pa.name, pb.name), speed([fleetsim.Member("a", ta), fleetsim.Member("b", tb)], args.warm))
    print_rows(rows, args.markdown)


def print_rows(rows: list, markdown: bool) -> None:
    head = (
        "pair",
        "rates",
        "budget",
        "shared %",
        "static %",
        "shared / static",
        "misses shared / static",
        "per model shared / static %",
    )
    print("| " + " | ".join(head) + " |" if markdown else "\t".join(head))
    if markdown:
        print("|" + "---|" * len(head))
    for members, rates, share, r, _ in rows:
        s, st = r.shared, r.static
        miss = (s.accesses - s.hits) / max(1, st.accesses - st.hits)
        per = ", ".join(
            f"{a.name} {100 * a.hit_rate:.1f} / {100 * b.hit_rate:.1f}" for a, b in zip(s.per_model, st.per_model)
        )
        cells = (
            " + ".join(m.name for m in members),
            f"{rates[0]:g}:{rates[1]:g}",
            f"{100 * share:g}%",
            f"{100 * s.hit_rate:.1f}",
            f"{100 * st.hit_rate:.1f}",
            f"{s.hit_rate / st.hit_rate:.3f}",
            f"{miss:.3f}",
            per,
        )
        print("| " + " | ".join(cells) + " |" if markdown else "\t".join(cells))
    print("\ncommands:")
    for *_, cmd in rows:
        print(f"  {cmd}")


def print_speed(names: tuple[str, str], sp: dict[str, float]) -> None:
    print(
        f"{names[0]} + {names[1]}: {int(sp['accesses'])} accesses; M accesses/s of CPU time: shared "
        f"{sp['shared']:.2f}, static {sp['static']:.2f}, floors {sp['floors']:.2f}; baseline dict loop "
        f"{sp['baseline']:.2f} (shared / baseline {sp['shared'] / sp['baseline']:.2f}, floors / baseline "
        f"{sp['floors'] / sp['baseline']:.2f})"
    )


if __name__ == "__main__":
    main()
