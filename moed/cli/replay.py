"""moectl verbs that measure: replay (a trace through moed), bench-drive, plan.

`replay` is a client of a running daemon (`--socket`); with `--budget` it starts
a private daemon with that budget for the run instead, so the numbers are the
replay's alone. Bad input is a one-line error and exit 2.
"""

from __future__ import annotations

import json
import sys

from moed.protocol.errors import MoedError


def register(sub) -> None:
    p = sub.add_parser("replay", help="replay a routing trace through moed with real reads")
    p.add_argument("model", metavar="MODEL.gguf")
    p.add_argument("trace", metavar="TRACE")
    p.add_argument("--budget", default=None, metavar="SIZE|PCT",
                   help="start a private daemon with this RAM budget (e.g. 512MiB, or 50%% of the "
                        "model's experts); default: use the running daemon and its budget")
    p.add_argument("--compute-ms", type=float, default=12.0, help="simulated compute per token")
    p.add_argument("--attn-frac", type=float, default=0.5,
                   help="share of a layer's compute before its experts are needed")
    p.add_argument("--prefetch", default="none", choices=["none", "gate", "gate2", "oracle"])
    p.add_argument("--warm", type=int, default=64, help="warm-up tokens (last prompt tokens)")
    p.add_argument("--tokens", type=int, default=None, help="decode tokens to count (default: all)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_replay)

    _register_bench_drive(sub)
    _register_plan(sub)


def _fail(msg: str) -> int:
    print(f"moectl: {msg}", file=sys.stderr)
    return 2


def cmd_replay(args) -> int:
    from moed.lab import replay as rp
    from moed.lab.traces import Trace
    try:
        trace = Trace.load(args.trace)
        opts = rp.ReplayOptions(args.compute_ms, args.attn_frac, args.prefetch, args.warm, args.tokens)
        budget = None if args.budget is None else rp.parse_budget(args.budget, args.model)
    except MoedError as exc:
        return _fail(f"replay: {exc}")
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
        self.bar = None
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
    pass


def _register_plan(sub) -> None:
    pass
