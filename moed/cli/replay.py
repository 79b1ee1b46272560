"""moectl verbs that measure: replay (a trace through moed), bench-drive, plan.

`replay` is a client of a running daemon (`--socket`); with `--budget` it starts
a private daemon with that budget for the run instead, so the numbers are the
replay's alone. Bad input is a one-line error and exit 2.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from moed.badinput import BadInput


def register(sub) -> None:
    p = sub.add_parser("replay", help="replay a routing trace through moed with real reads")
    p.add_argument("model", metavar="MODEL.gguf")
    p.add_argument("trace", metavar="TRACE")
    p.add_argument(
        "--budget",
        default=None,
        metavar="SIZE|PCT",
        help="start a private daemon with this RAM budget (e.g. 512MiB, or 50%% of the "
        "model's experts); default: use the running daemon and its budget",
    )
    p.add_argument("--compute-ms", type=float, default=12.0, help="simulated compute per token")
    p.add_argument(
        "--attn-frac", type=float, default=0.5, help="share of a layer's compute before its experts are needed"
    )
    p.add_argument("--prefetch", default="none", choices=["none", "gate", "gate2", "oracle"])
    p.add_argument(
        "--prefetch-width",
        type=int,
        default=None,
        help="gate/gate2: prefetch the first N of each token's predictions (default: top-k)",
    )
    p.add_argument("--warm", type=int, default=64, help="warm-up tokens (last prompt tokens)")
    p.add_argument("--tokens", type=int, default=None, help="decode tokens to count (default: all)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_replay)

    _register_bench_drive(sub)
    _register_plan(sub)


def cmd_replay(args) -> int:
    from moed.gguf.budget import parse_budget
    from moed.lab import live_replay as rp
    from moed.traces import Trace

    trace = Trace.load(args.trace)
    opts = rp.ReplayOptions(
        args.compute_ms, args.attn_frac, args.prefetch, args.warm, args.tokens, prefetch_width=args.prefetch_width
    )
    budget = None if args.budget is None else parse_budget(args.budget, args.model)
    with _progress(enabled=not args.json and sys.stderr.isatty()) as progress:
        if budget is not None:
            result = rp.replay_private(args.model, trace, budget, opts, progress)
        else:
            from moed.client import Client

            with Client(args.socket, "moectl-replay") as c:
                result = rp.replay(c, args.model, trace, opts, progress)
    if args.json:
        print(json.dumps(result.to_json(), sort_keys=True))
    else:
        for line in rp.describe(result):
            print(line)
    return 0


class _progress:
    """A rich progress bar over counted tokens (a no-op when disabled)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bar: Any = None  # a rich Progress once entered
        self.task = None

    def __enter__(self):
        if not self.enabled:
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

        self.bar = Progress("replay", BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), transient=True)
        self.bar.start()
        self.task = self.bar.add_task("replay", total=None)
        return self.update

    def update(self, done: int, total: int) -> None:
        if done % 8 == 0 or done == total:
            self.bar.update(self.task, completed=done, total=total)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()


def _register_bench_drive(sub) -> None:
    from moed.protocol.sizes import parse_size

    p = sub.add_parser(
        "bench-drive",
        help="random O_DIRECT reads of a file: GB/s and latency; --paired: raw, moed's read path, raw again",
    )
    p.add_argument("path", metavar="PATH", help="any large file (--paired: a MoE GGUF)")
    p.add_argument("--size", type=parse_size, default=1 << 20, help="bytes per read (default 1MiB)")
    p.add_argument("--depth", type=int, default=8, help="reads in flight (threads)")
    p.add_argument("--seconds", type=float, default=10.0, help="per run")
    p.add_argument(
        "--paired", action="store_true", help="raw, then a private moed reading the same file, then raw again"
    )
    p.add_argument(
        "--create",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="first write a benchmark GGUF of about SIZE at PATH (replaces it)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_bench_drive)


def cmd_bench_drive(args) -> int:
    import os

    from moed.lab import drivebench as db

    if args.create is not None:
        db.write_bench_model(args.path, args.create, part_bytes=args.size)
    if not os.path.exists(args.path):
        raise BadInput(f"bench-drive: {args.path}: no such file")
    with _DriveProgress(args.seconds, enabled=not args.json and sys.stderr.isatty()) as bars:
        if args.paired:
            out = db.paired(args.path, args.size, args.depth, args.seconds, bars.tick_for)
        else:
            out = db.single(args.path, args.size, args.depth, args.seconds, bars.tick_for("raw"))
    if args.json:
        print(json.dumps(out, sort_keys=True))
        return 0
    from moed.protocol.sizes import format_size

    print(f"{args.path}: {format_size(args.size)} reads, {args.depth} in flight, {args.seconds:g} s per run")
    for r in out["runs"]:
        print(
            f"  {r['label']:<5} {r['gbps']:6.3f} GB/s  {r['ops']:6d} {'acquires' if r['label'] == 'moed' else 'reads'}"
            f"  latency p50 {r['p50_ms']:.2f} ms  p90 {r['p90_ms']:.2f}  p99 {r['p99_ms']:.2f}"
            f"  max {r['max_ms']:.2f}{'' if r['direct'] else '  (buffered: no O_DIRECT here)'}"
        )
    if args.paired:
        print(f"moed / raw = {out['ratio']:.3f}  (moed {out['moed_gbps']:.3f} GB/s, raw mean {out['raw_gbps']:.3f})")
    return 0


class _DriveProgress:
    """One rich progress bar per run, driven by elapsed time, showing the rate so far."""

    def __init__(self, seconds: float, enabled: bool):
        self.seconds, self.enabled, self.bar = seconds, enabled, None

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, Progress, TextColumn

            self.bar = Progress(TextColumn("{task.description:<9}"), BarColumn(), TextColumn("{task.fields[rate]}"))
            self.bar.start()
        return self

    def tick_for(self, label: str):
        if self.bar is None:
            return None
        task = self.bar.add_task(label, total=self.seconds, rate="")

        def tick(elapsed_s: float, done_bytes: int) -> None:
            rate = f"{done_bytes / elapsed_s / 1e9:.3f} GB/s" if elapsed_s > 0 else ""
            self.bar.update(task, completed=min(elapsed_s, self.seconds), rate=rate)

        return tick

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()


def _register_plan(sub) -> None:
    from moed.protocol.sizes import parse_size

    p = sub.add_parser("plan", help="recommend the RAM and pin budgets for a target decode rate")
    p.add_argument("model", metavar="MODEL.gguf", nargs="?", help="the model (not with --fleet)")
    p.add_argument("--trace", metavar="T", help="a routing trace of this model")
    p.add_argument(
        "--fleet",
        nargs="+",
        metavar="TRACE:MODEL.gguf[@RATE]",
        help="size one box for several engines instead (moed.cli.fleet)",
    )
    p.add_argument("--seed", type=int, default=0, help="--fleet: seed of the interleaving")
    p.add_argument(
        "--target-tok-s", type=float, default=None, help="decode rate to reach (default: the best the RAM allows)"
    )
    p.add_argument(
        "--drive-gbps", type=float, default=None, help="drive rate in GB/s (default: measure it on the model file)"
    )
    p.add_argument("--ram", type=parse_size, default=None, help="machine memory (default: this machine's)")
    p.add_argument(
        "--reserve",
        type=parse_size,
        default=None,
        help="RAM kept for everything else (default: 10%% of RAM, at least 1GiB)",
    )
    p.add_argument(
        "--compute-ms",
        type=float,
        default=0.0,
        help="compute per token with every expert resident (default 0: the drive ceiling)",
    )
    p.add_argument("--policy", default="g-lru", help="shared-budget cache policy (default g-lru, as moed)")
    p.add_argument("--warm", type=int, default=0, help="decode tokens that only warm the cache")
    p.add_argument("--measure-seconds", type=float, default=3.0, help="drive measurement length")
    p.add_argument(
        "--plot",
        nargs="?",
        const="-",
        default=None,
        metavar="PNG",
        help="draw the rate curve: bars in the terminal, or a PNG file",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args) -> int:
    from moed.lab import plan as pl
    from moed.traces import Trace

    if args.fleet:
        from moed.cli.fleet import cmd_plan_fleet

        return cmd_plan_fleet(args)
    if args.model is None or args.trace is None:
        raise BadInput("plan: give MODEL.gguf --trace T, or --fleet TRACE:MODEL.gguf[@RATE] ...")
    trace = Trace.load(args.trace)
    result = pl.make_plan(
        args.model,
        trace,
        target_tok_s=args.target_tok_s,
        drive_gbps=args.drive_gbps,
        ram_bytes=args.ram,
        reserve_bytes=args.reserve,
        compute_ms=args.compute_ms,
        policy=args.policy,
        warm=args.warm,
        measure_s=args.measure_seconds,
        trace_path=args.trace,
    )
    if args.plot not in (None, "-"):
        pl.plot(result, args.plot)
    if args.json:
        print(json.dumps(result.to_json(), sort_keys=True))
    else:
        for line in pl.describe(result, bars=args.plot == "-"):
            print(line)
        if args.plot not in (None, "-"):
            print(f"plot: {args.plot}")
    return 0
