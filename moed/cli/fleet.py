"""moectl fleet: several engines' traces on one budget, shared against a static split and floors.

The replay is `moed.lab.fleetsim`'s; this module parses the member specs and the
budget, and prints a table (default), one JSON object (`--json`) or a plot of
aggregate hit rate against budget (`--plot`). `moectl plan --fleet` (the sizing
recommendation) is wired in `moed.cli.replay` next to `plan` and printed here.
Bad input is a `BadInput` (moed.badinput): one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from moed.badinput import BadInput

SPEC = "TRACE[:MODEL.gguf][@RATE]"


def register(sub: Any) -> None:
    p = sub.add_parser("fleet", help="several traces on one budget: shared LRU vs static split vs tenant floors")
    p.add_argument(
        "members",
        nargs="+",
        metavar=SPEC,
        help="one engine each: its trace, optionally its model (slots are then its real expert "
        "bytes), and its relative rate in tokens per second (default 1)",
    )
    p.add_argument(
        "--budget",
        required=True,
        help="a share of all the models' experts (25%%), a slot count (3000), or a size (4GiB)",
    )
    p.add_argument("--policy", default="g-lru", help="shared-budget policy (default g-lru, as moed)")
    p.add_argument(
        "--floors",
        default=None,
        help="one tenant floor per trace, comma-separated: a share of the budget (30%%), slots or a size",
    )
    p.add_argument("--warm", type=int, default=0, help="each engine's first N decode tokens warm the cache")
    p.add_argument("--seed", type=int, default=0, help="seed of the engines' phases (the interleaving)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--plot", metavar="OUT.png", help="aggregate hit rate against budget, shared and static")
    p.set_defaults(func=cmd_fleet)


def load(specs: list[str]) -> list[Any]:
    from moed.lab import fleetsim

    return fleetsim.unique_names([fleetsim.load_member(s) for s in specs])


def parse_floors(text: str | None, unit: str, budget: int, mean_slot: float) -> list[int] | None:
    """Floors: each a share of the budget, a slot count or a size."""
    from moed.lab.fleetsim import parse_amount

    if text is None:
        return None
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise BadInput("--floors needs one floor per trace, e.g. 30%,0")
    return [parse_amount(x, unit, budget, mean_slot, "--floors") for x in items]


def cmd_fleet(args: argparse.Namespace) -> int:
    from moed.lab import fleetsim

    members = load(args.members)
    unit = fleetsim.unit_of(members)
    whole, mean = fleetsim.all_size(members), fleetsim.mean_slot(members)
    budget = fleetsim.parse_amount(args.budget, unit, whole, mean)
    floors = parse_floors(args.floors, unit, budget, mean)
    curve = fleetsim.PLOT_FRACTIONS if args.plot else ()
    report = fleetsim.replay_fleet(
        members, budget, policy=args.policy, floors=floors, warm=args.warm, seed=args.seed, curve=curve
    )
    if args.plot:
        plot_fleet(report, args.plot)
    if args.json:
        print(json.dumps(report.to_json(), sort_keys=True))
    else:
        print_report(report)
    return 0


def amount(n: int, unit: str) -> str:
    from moed.protocol.sizes import format_size

    return format_size(n) if unit == "bytes" else f"{n} slots"


def print_report(report: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    modes = [o for o in (report.shared, report.static, report.floors) if o is not None]
    title = (
        f"fleet of {len(report.members)}, budget {amount(report.budget, report.unit)} "
        f"({100 * report.budget / max(report.all_size, 1):.1f}% of all experts), {report.policy}, "
        f"seed {report.seed}: decode hit rate"
    )
    t = Table(title=title)
    for col in ("model", "rate", "tokens", "experts"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for o in modes:
        t.add_column(o.mode, justify="right")
    for i, m in enumerate(report.members):
        cells = [_cell(o.per_model[i], report.unit) for o in modes]
        t.add_row(m["name"], f"{m['rate']:g}", str(m["tokens"]), amount(m["all_experts"], report.unit), *cells)
    t.add_row("all", "", "", amount(report.all_size, report.unit), *(f"{100 * o.hit_rate:.1f}%" for o in modes))
    console = Console()
    console.print(t)
    ratio = report.shared.hit_rate / report.static.hit_rate if report.static.hit_rate else float("inf")
    console.print(
        f"shared / static = {ratio:.3f}; misses shared / static = {_miss_ratio(report.shared, report.static):.3f}"
    )
    refused = [o for o in modes if o.refused]
    for o in refused:
        console.print(f"{o.mode}: {o.refused} accesses found no room (the daemon's acquire would wait)")


def _cell(m: Any, unit: str) -> str:
    share = "" if m.budget is None else f" ({amount(m.budget, unit)})"
    return f"{100 * m.hit_rate:.1f}%{share}"


def _miss_ratio(a: Any, b: Any) -> float:
    miss_b = b.accesses - b.hits
    return (a.accesses - a.hits) / miss_b if miss_b else float("inf")


def plot_fleet(report: Any, out: str) -> None:
    from moed.cli.lab import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [100 * p["share"] for p in report.curve]
    ax.plot(xs, [100 * p["shared"] for p in report.curve], marker="o", label=f"shared ({report.policy})")
    ax.plot(xs, [100 * p["static"] for p in report.curve], marker="s", label="static split by model size")
    ax.axvline(100 * report.budget / max(report.all_size, 1), color="tab:gray", linestyle=":", label="--budget")
    ax.set_xlabel("budget (% of all the models' experts)")
    ax.set_ylabel("aggregate decode hit rate (%)")
    names = ", ".join(f"{m['name']}@{m['rate']:g}" for m in report.members)
    ax.set_title(f"fleet: {names}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def cmd_plan_fleet(args: argparse.Namespace) -> int:
    """`moectl plan --fleet SPEC...`: one budget, pins and floors for the box."""
    from moed.lab import fleetplan

    if args.model is not None or args.trace is not None:
        raise BadInput("plan --fleet takes its models and traces as TRACE:MODEL.gguf[@RATE], not MODEL --trace")
    result = fleetplan.make_fleet_plan(
        load(args.fleet),
        target_tok_s=args.target_tok_s,
        drive_gbps=args.drive_gbps,
        ram_bytes=args.ram,
        reserve_bytes=args.reserve,
        compute_ms=args.compute_ms,
        warm=args.warm,
        seed=args.seed,
        measure_s=args.measure_seconds,
    )
    if args.json:
        print(json.dumps(result.to_json(), sort_keys=True))
    else:
        for line in fleetplan.describe(result):
            print(line)
    return 0
