"""moed's read path against the raw drive, paired: raw, moed, raw again, several times.

Run: .venv/bin/python bench/drive_paired.py [--file PATH] [--create 4GiB] [--size 1MiB]
        [--depth 8] [--seconds 10] [--pairs 3] [--json OUT]

The file is a benchmark GGUF (`moed.lab.drivebench.write_bench_model`: routed
expert tensors only, parts as large as one read, random bytes) of a few GB on
the ext4 disk, written once and dropped from the page cache. Each pair runs raw
O_DIRECT random reads (--size, --depth threads), then a private moed whose
reader pool uses the same read size and depth (chunk_bytes = size,
reader_threads = depth) serving --depth clients that acquire distinct experts
that always miss, then raw again; the ratio is moed over the mean of the two raw
runs around it. Prints each pair and the median ratio (goal: >= 0.95).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moed.lab import drivebench as db  # noqa: E402
from moed.protocol.sizes import format_size, parse_size  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", default="/tmp/moed-bench-drive/bench.gguf")
    ap.add_argument("--create", type=parse_size, default=parse_size("4GiB"))
    ap.add_argument("--size", type=parse_size, default=1 << 20)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not os.path.exists(args.file) or os.path.getsize(args.file) < args.create * 0.9:
        os.makedirs(os.path.dirname(args.file), exist_ok=True)
        db.write_bench_model(args.file, args.create, part_bytes=args.size)
    print(
        f"# {args.file}: {format_size(os.path.getsize(args.file))}, {format_size(args.size)} reads, "
        f"{args.depth} in flight, {args.seconds:g} s per run",
        flush=True,
    )
    print("| pair | raw GB/s | moed GB/s | raw again GB/s | ratio | raw p50/p99 ms | moed acquire p50/p99 ms |")
    print("|---|---|---|---|---|---|---|")
    results = []
    for i in range(args.pairs):
        r = db.paired(args.file, args.size, args.depth, args.seconds)
        raw1, moed, raw2 = r["runs"]
        results.append(r)
        print(
            f"| {i + 1} | {raw1['gbps']:.3f} | {moed['gbps']:.3f} | {raw2['gbps']:.3f} | {r['ratio']:.3f} | "
            f"{raw1['p50_ms']:.1f}/{raw1['p99_ms']:.1f} | {moed['p50_ms']:.1f}/{moed['p99_ms']:.1f} |",
            flush=True,
        )
    ratios = [r["ratio"] for r in results]
    print(f"median ratio moed/raw = {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
