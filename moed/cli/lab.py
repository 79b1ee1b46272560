"""moectl verbs of the trace and policy lab: trace-info, policy, mrc.

They read any trace format (`moed.traces`), need no daemon, and print rich
tables by default or JSON with `--json`. Bad input (a missing or malformed trace,
an unknown policy, a size outside [0, 1]) is a `BadInput` (moed.badinput): moectl
prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from moed.badinput import BadInput

DEFAULT_MRC_POINTS = 16


def register(sub: Any) -> None:
    p = sub.add_parser("trace-info", help="summarise a routing trace (any format)")
    p.add_argument("trace")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument(
        "--predictors", action="store_true", help="also score prefetch predictors against the shared LRU's misses"
    )
    p.add_argument(
        "--size", type=float, default=0.5, help="cache size for --predictors, as a fraction of each layer's experts"
    )
    p.add_argument("--warm", type=int, default=0, help="decode tokens treated as warm-up")
    p.set_defaults(func=cmd_trace_info)

    p = sub.add_parser("policy", help="replay a trace through cache policies; decode hit rates")
    p.add_argument("trace")
    p.add_argument(
        "--policies",
        default="lru,lfu,slru,opt,g-lru,g-lfu,g-hot,g-arc,g-lru2,g-tlfu1,g-tlfu10,g-opt",
        help="comma-separated policies (default: all)",
    )
    group = p.add_mutually_exclusive_group()
    group.add_argument("--sizes", default=None, help="fractions of each layer's experts (default 0.25,0.5,0.75)")
    group.add_argument(
        "--slots",
        action="append",
        help="total slots, comma-separated or repeated (a per-layer policy gets N // layers in each layer)",
    )
    p.add_argument("--warm", type=int, default=0, help="first N decode tokens are warm-up, not counted")
    p.add_argument("--json", action="store_true", help="a JSON list of results")
    p.add_argument("--plot", metavar="OUT.png", help="draw hit rate against size per policy")
    p.add_argument("--drive-gbps", type=float, help="drive read rate, GB/s (10^9 bytes/s): print ceilings")
    p.add_argument("--compute-ms", type=float, help="compute per decode token with every expert resident")
    p.add_argument("--expert-mib", type=float, help="MiB per expert (default: from the trace)")
    p.add_argument("--mtp", type=int, metavar="N", help="draft tokens per MTP verification step")
    p.add_argument("--accept", type=float, default=None, help="accepted tokens per MTP step")
    p.set_defaults(func=cmd_policy)

    p = sub.add_parser("mrc", help="shared-LRU miss-ratio curve at every size, with Belady points")
    p.add_argument("trace")
    p.add_argument("--warm", type=int, default=0)
    p.add_argument(
        "--points",
        type=int,
        default=DEFAULT_MRC_POINTS,
        help="sizes shown in the table and replayed with g-opt (evenly spaced)",
    )
    p.add_argument("--no-opt", action="store_true", help="skip the g-opt replays")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", metavar="OUT.png")
    p.set_defaults(func=cmd_mrc)


# ---- trace-info -----------------------------------------------------------------


def trace_info(trace: Any, warm: int = 0) -> dict[str, Any]:
    import numpy as np

    from moed.lab import policies

    acc = policies.accesses(trace, warm)
    layer = acc.layer
    distinct = np.array([len(np.unique(acc.keys[layer == l])) for l in range(trace.moe_layers)])
    g = trace.geometry
    return {
        "moe_layers": g.moe_layers,
        "n_experts": g.n_experts,
        "top_k": g.top_k,
        "bytes_per_expert": g.bytes_per_expert,
        "layer_ids": list(g.layer_ids or ()),
        "steps": trace.n_steps,
        "prompt_steps": int((trace.step_kinds == ord("P")).sum()),
        "decode_steps": int((trace.step_kinds == ord("D")).sum()),
        "prompt_tokens": trace.n_prompt_tokens,
        "decode_tokens": trace.n_decode_tokens,
        "accesses": acc.n,
        "counted_accesses": acc.n_counted,
        "counted_tokens": acc.n_counted_tokens,
        "accesses_per_token": acc.n / trace.n_tokens,
        "experts_used_per_layer": {
            "min": int(distinct.min()),
            "mean": float(distinct.mean()),
            "max": int(distinct.max()),
        },
        "gate_ahead": trace.ahead1 is not None,
        "two_ahead": trace.ahead2 is not None,
        "meta": trace.meta,
    }


def cmd_trace_info(args: argparse.Namespace) -> int:
    from moed.lab import coverage
    from moed.traces import Trace

    trace = Trace.load(args.trace)
    info = trace_info(trace, args.warm)
    if args.predictors:
        _check_fraction(args.size)
        info["predictors"] = [c.to_json() for c in coverage.coverage(trace, args.size, args.warm)]
    if args.json:
        print(json.dumps(info, sort_keys=True))
        return 0
    _print_info(args.trace, info)
    return 0


def _print_info(path: str, info: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from moed.protocol.sizes import format_size

    t = Table(title=path, show_header=False)
    t.add_column(style="bold")
    t.add_column()
    bpe = info["bytes_per_expert"]
    used = info["experts_used_per_layer"]
    ids = info["layer_ids"]
    preds = [n for n, k in (("gate-ahead", "gate_ahead"), ("two-ahead", "two_ahead")) if info[k]]
    rows = [
        (
            "geometry",
            f"{info['moe_layers']} MoE layers (blocks {ids[0]}-{ids[-1]}) x {info['n_experts']} experts, "
            f"top-{info['top_k']}" + (f", {format_size(bpe)} per expert" if bpe else ""),
        ),
        ("steps", f"{info['steps']} ({info['prompt_steps']} prompt, {info['decode_steps']} decode)"),
        (
            "tokens",
            f"{info['prompt_tokens']} prompt + {info['decode_tokens']} decode ({info['counted_tokens']} counted)",
        ),
        (
            "accesses",
            f"{info['accesses']} ({info['accesses_per_token']:.1f} per token), {info['counted_accesses']} counted",
        ),
        ("experts used", f"per layer min {used['min']}, mean {used['mean']:.1f}, max {used['max']}"),
        ("predictions", ", ".join(preds) or "none"),
    ]
    rows += [(f"meta {k}", str(v)) for k, v in sorted(info["meta"].items())]
    for r in rows:
        t.add_row(*r)
    console = Console()
    console.print(t)
    if "predictors" in info:
        p = Table(title="predictor coverage of g-lru decode misses")
        for col in ("predictor", "size", "misses", "covered", "useless reads/token"):
            p.add_column(col, justify="left" if col == "predictor" else "right")
        for c in info["predictors"]:
            p.add_row(
                c["predictor"],
                f"{c['size']:.2f}",
                str(c["misses"]),
                f"{100 * c['coverage']:.1f}%",
                f"{c['useless_reads_per_token']:.1f}",
            )
        console.print(p)


# ---- policy ---------------------------------------------------------------------


def _check_fraction(x: float) -> float:
    if not (0 <= x <= 1) or math.isnan(x):
        raise BadInput(f"size must be a fraction in [0, 1], not {x}")
    return x


def parse_sizes(text: str | None) -> list[float]:
    from moed.lab.policies import DEFAULT_SIZES

    if text is None:
        return list(DEFAULT_SIZES)
    try:
        return [_check_fraction(float(x)) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise BadInput(f"--sizes takes comma-separated fractions like 0.25,0.5: {text!r}") from exc


def parse_slots(values: list[str] | None) -> list[int]:
    try:
        slots = [int(x) for v in values or () for x in v.split(",") if x.strip()]
    except ValueError as exc:
        raise BadInput(f"--slots takes whole numbers: {values}") from exc
    if any(n < 0 for n in slots):
        raise BadInput(f"--slots must be >= 0: {slots}")
    return slots


def cmd_policy(args: argparse.Namespace) -> int:
    from moed.lab import ceilings, policies
    from moed.traces import Trace

    names = policies.check_policies(args.policies.split(","))
    slots = parse_slots(args.slots)
    sizes = None if slots else parse_sizes(args.sizes)
    if (args.drive_gbps is None) != (args.compute_ms is None):
        raise BadInput("ceilings need both --drive-gbps and --compute-ms")
    if (args.mtp is None) != (args.accept is None):
        raise BadInput("MTP grouping needs both --mtp N and --accept A")
    trace = Trace.load(args.trace)
    acc = policies.accesses(trace, args.warm)
    points: list[tuple[float | None, int | None]] = (
        [(s, None) for s in sizes] if sizes is not None else [(None, n) for n in slots]
    )
    results = [policies.replay(acc, p, size, n) for size, n in points for p in names]
    rows = [r.to_json() for r in results]
    if args.drive_gbps is not None:
        bpe = _bytes_per_expert(trace, args.expert_mib)
        for row, r in zip(rows, results):
            c = ceilings.ceiling(r, acc.n_counted_tokens, bpe, args.drive_gbps, args.compute_ms)
            row.update(
                reads_per_token=c.reads_per_token,
                io_ms=c.io_ms,
                serial_tok_s=c.serial_tok_s,
                overlapped_tok_s=c.overlapped_tok_s,
            )
    if args.mtp is not None:
        grouped, steps = ceilings.mtp_accesses(trace, args.mtp, args.accept, args.warm)
        for row, (size, n) in zip(rows, [pt for pt in points for _ in names]):
            r = policies.replay(grouped, row["policy"], size, n)
            tokens = grouped.n_counted_tokens or 1
            row.update(
                mtp_reads_per_token=(r.accesses - r.hits) / tokens,
                mtp_reads_per_step=(r.accesses - r.hits) / max(steps, 1),
                plain_reads_per_token=(row["accesses"] - row["hits"]) / tokens,
            )
    if args.plot:
        plot_policies(rows, args.plot, args.trace)
    if args.json:
        print(json.dumps(rows))
    else:
        _print_policy(args, trace, acc, rows, names, points)
    return 0


def _bytes_per_expert(trace: Any, expert_mib: float | None) -> float:
    if expert_mib is not None:
        if expert_mib <= 0:
            raise BadInput("--expert-mib must be > 0")
        return expert_mib * (1 << 20)
    if not trace.bytes_per_expert:
        raise BadInput("the trace does not know its bytes per expert: give --expert-mib")
    return float(trace.bytes_per_expert)


def _print_policy(
    args: argparse.Namespace,
    trace: Any,
    acc: Any,
    rows: list[dict[str, Any]],
    names: list[str],
    points: list[tuple[float | None, int | None]],
) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    title = (
        f"{args.trace}: decode hit rate, {acc.n_counted} counted accesses over "
        f"{acc.n_counted_tokens} tokens ({trace.n_prompt_tokens} prompt"
        + (f" + {args.warm} warm-up" if args.warm else "")
        + " tokens warm the cache)"
    )
    t = Table(title=title)
    t.add_column("size")
    t.add_column("slots", justify="right")
    for n in names:
        t.add_column(n, justify="right")
    by_point = [rows[i * len(names) : (i + 1) * len(names)] for i in range(len(points))]
    for chunk in by_point:
        size = chunk[0]["size"]
        shared = [r["slots"] for r in chunk if r["policy"] not in ("lru", "lfu", "slru", "opt")]
        label = f"{100 * size:.0f}%" if size is not None else "-"
        t.add_row(
            label, str(shared[0] if shared else chunk[0]["slots"]), *(f"{100 * r['hit_rate']:.1f}%" for r in chunk)
        )
    console.print(t)
    if "serial_tok_s" in rows[0]:
        _print_extra(
            console,
            f"drive ceiling, tok/s serial / overlapped ({args.drive_gbps} GB/s, {args.compute_ms} ms compute)",
            names,
            by_point,
            lambda r: f"{r['serial_tok_s']:.1f} / {r['overlapped_tok_s']:.1f}",
        )
    if "mtp_reads_per_token" in rows[0]:
        _print_extra(
            console,
            f"expert reads per generated token, MTP n={args.mtp} accept={args.accept} (without MTP)",
            names,
            by_point,
            lambda r: f"{r['mtp_reads_per_token']:.1f} ({r['plain_reads_per_token']:.1f})",
        )


def _print_extra(console: Any, title: str, names: list[str], by_point: list[list[dict[str, Any]]], cell: Any) -> None:
    from rich.table import Table

    t = Table(title=title)
    t.add_column("size")
    for n in names:
        t.add_column(n, justify="right")
    for chunk in by_point:
        size = chunk[0]["size"]
        t.add_row(f"{100 * size:.0f}%" if size is not None else str(chunk[0]["slots"]), *(cell(r) for r in chunk))
    console.print(t)


def plot_policies(rows: list[dict[str, Any]], out: str, title: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["policy"] for r in rows):
        pts = [r for r in rows if r["policy"] == name]
        xs = [r["size"] if r["size"] is not None else r["slots"] for r in pts]
        ax.plot(xs, [100 * r["hit_rate"] for r in pts], marker="o", label=name)
    ax.set_xlabel("cache size (fraction of experts)" if rows[0]["size"] is not None else "slots")
    ax.set_ylabel("decode hit rate (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise BadInput("--plot needs matplotlib (pip install 'moed[lab]')") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ---- mrc ------------------------------------------------------------------------


def cmd_mrc(args: argparse.Namespace) -> int:
    from moed.lab import mrc, policies
    from moed.traces import Trace

    if args.points < 1:
        raise BadInput("--points must be >= 1")
    trace = Trace.load(args.trace)
    acc = policies.accesses(trace, args.warm)
    curve = mrc.lru_curve(acc)
    total = curve.max_slots
    marks = sorted({round(total * i / args.points) for i in range(args.points + 1)})
    opt = {} if args.no_opt else {s: policies.replay(acc, "g-opt", slots=s).hit_rate for s in marks}
    if args.plot:
        plot_mrc(curve, opt, args.plot, args.trace)
    if args.json:
        print(
            json.dumps(
                {
                    "accesses": curve.accesses,
                    "max_slots": total,
                    "lru_hits": curve.hits.tolist(),
                    "points": [
                        {"slots": s, "size": s / total, "g-lru": curve.hit_rate(s), "g-opt": opt.get(s)} for s in marks
                    ],
                }
            )
        )
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{args.trace}: shared-budget decode hit rate by size ({curve.accesses} counted accesses)")
    for col in ("size", "slots", "g-lru", "g-lru miss ratio", "g-opt"):
        t.add_column(col, justify="right")
    for s in marks:
        o = opt.get(s)
        t.add_row(
            f"{100 * s / total:.1f}%",
            str(s),
            f"{100 * curve.hit_rate(s):.1f}%",
            f"{curve.miss_ratio(s):.3f}",
            "-" if o is None else f"{100 * o:.1f}%",
        )
    Console().print(t)
    return 0


def plot_mrc(curve: Any, opt: dict[int, float], out: str, title: str) -> None:
    import numpy as np

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    total = curve.max_slots
    xs = np.arange(total + 1) / total
    ax.plot(xs, 100 * curve.hits / max(curve.accesses, 1), label="g-lru (every size)")
    if opt:
        ax.plot([s / total for s in opt], [100 * v for v in opt.values()], "o--", label="g-opt (Belady)")
    ax.set_xlabel("cache size (fraction of all experts)")
    ax.set_ylabel("decode hit rate (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
