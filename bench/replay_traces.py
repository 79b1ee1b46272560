"""Replay every shipped trace through moed at 25/50/75% budgets, without and with oracle prefetch.

Run: .venv/bin/python bench/replay_traces.py [--traces GLOB] [--embd 512 --ff 256]
        [--compute-ms 12] [--warm 64] [--tokens N] [--json OUT]

For each trace a model with its geometry is generated once (`make_model` with
the trace's layers, experts and top-k, q8_0, page-aligned, small embd/ff to fit
this disk and time) into --workdir. Each point starts a private daemon with the
budget (a share of every expert's RAM-tier bytes) and replays the trace through
it (`moed.lab.live_replay`: real O_DIRECT reads, simulated compute). Baselines from
the same run: the compute-alone rate (every expert resident), and the pure
policy replay's g-lru hit rate at the same slots (what the daemon's one LRU
should reproduce when nothing is prefetched). `--budgets 100` adds the
all-resident point: its stall is the acquire round trips alone.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moed.gguf.budget import all_experts_bytes  # noqa: E402
from moed.lab import live_replay as rp  # noqa: E402
from moed.lab import policies  # noqa: E402
from moed.modelgen.makemodel import make_model  # noqa: E402
from moed.traces import Trace  # noqa: E402


def model_for(trace: Trace, name: str, workdir: str, embd: int, ff: int) -> str:
    path = os.path.join(workdir, f"{name}-e{embd}-f{ff}.gguf")
    if not os.path.exists(path):
        t0 = time.time()
        make_model(path + ".tmp.gguf", **rp.like_trace(trace), embd=embd, ff=ff, align=4096)
        os.replace(path + ".tmp.gguf", path)
        print(f"# made {path} ({os.path.getsize(path) / 1e6:.0f} MB) in {time.time() - t0:.0f} s", flush=True)
    return path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", default="/work/shared/traces/nvmoe/*.jsonl")
    ap.add_argument("--workdir", default="/tmp/moed-bench-replay")
    ap.add_argument("--embd", type=int, default=512)
    ap.add_argument("--ff", type=int, default=256)
    ap.add_argument("--budgets", default="25,50,75")
    ap.add_argument("--modes", default="none,oracle")
    ap.add_argument("--compute-ms", type=float, default=12.0)
    ap.add_argument("--warm", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--json", default=None, help="write every result here")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    rows = []
    print(
        "| trace | budget | prefetch | tok/s | compute tok/s | ratio | stall ms/tok | hit % | g-lru replay hit % "
        "| prefetch hit % | demand miss % | wasted % | MB/tok |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for path in sorted(glob.glob(args.traces)):
        name = os.path.basename(path).split(".")[0]
        trace = Trace.load(path)
        model = model_for(trace, name, args.workdir, args.embd, args.ff)
        warm = min(args.warm, trace.n_decode_tokens // 4)  # a short trace keeps most tokens counted
        all_bytes = all_experts_bytes(model)
        for pct in (int(x) for x in args.budgets.split(",")):
            budget = int(pct / 100 * all_bytes)
            ref = policies.replay(trace, "g-lru", size=pct / 100, warm=warm)
            for mode in args.modes.split(","):
                opts = rp.ReplayOptions(args.compute_ms, 0.5, mode, warm, args.tokens)
                r = rp.replay_private(model, trace, budget, opts)
                rows.append({"trace": name, "budget_pct": pct, "g_lru_hit_rate": ref.hit_rate, **r.to_json()})
                print(
                    f"| {name} | {pct}% | {mode} | {r.tok_s:.1f} | {r.compute_tok_s:.1f} | "
                    f"{r.tok_s / r.compute_tok_s:.2f} | {r.stall_ms_per_token:.2f} | {100 * r.hit_rate:.1f} | "
                    f"{100 * ref.hit_rate:.1f} | {100 * r.prefetch_hit_rate:.1f} | "
                    f"{100 * r.demand_miss_rate:.1f} | {100 * r.wasted_prefetch_rate:.1f} | "
                    f"{r.mb_per_token:.2f} |",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
