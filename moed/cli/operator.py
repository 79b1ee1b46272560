"""moectl operator verbs: `set mem-floor`, `pin`, `unpin`, `clear-errors` (root or the daemon's uid only).

`moectl clear-errors [MODEL]` ends the quarantine of experts whose reads failed
(of one model, or of all), so the next acquire reads them from the drive again:
after a drive was replaced or a file restored (docs/design.md, "When the drive
misbehaves").

`moectl pin MODEL` takes its hotness profile from one of: `--all`, `--from-stats`
(the daemon's own decayed access counts), `--trace FILE` (a routing trace in any
format `moed.traces` reads: experts ranked by how often the trace routed to
them) or `--experts L:E,L:E-F,...` (a list, hottest first). The daemon pins in
that order until the pin budget is full, and pins everything when the whole
model fits.
"""

from __future__ import annotations

import argparse
import collections
import re

from moed.client import Client
from moed.protocol import errors
from moed.protocol import messages as m
from moed.protocol.sizes import format_size, parse_size


def register(sub) -> None:
    p = sub.add_parser("set", help="change a daemon setting live (operator only)")
    p.add_argument("setting", choices=["mem-floor"])
    p.add_argument("value", help="a size, e.g. 2GiB (0 turns the memory guard off)")
    p.set_defaults(func=cmd_set)

    p = sub.add_parser("pin", help="pin a model's hot experts into the pinned partition")
    p.add_argument("model", help="the model's GGUF path (its first shard)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--all", action="store_true", help="every expert of the model")
    src.add_argument("--from-stats", action="store_true", help="the daemon's decayed access counts")
    src.add_argument("--trace", help="a routing trace file: rank experts by routing count")
    src.add_argument("--experts", type=parse_experts, help="L:E,L:E-F,... hottest first")
    p.set_defaults(func=cmd_pin)

    p = sub.add_parser("unpin", help="unpin experts of a model")
    p.add_argument("model")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--all", action="store_true")
    src.add_argument("--experts", type=parse_experts)
    p.set_defaults(func=cmd_unpin)

    p = sub.add_parser("clear-errors", help="read quarantined experts (failed reads) from the drive again")
    p.add_argument("model", nargs="?", help="the model's GGUF path (default: every model)")
    p.set_defaults(func=cmd_clear_errors)


_PAIR = re.compile(r"^(\d+):(\d+)(?:-(\d+))?$")


def parse_experts(text: str) -> list[tuple[int, int]]:
    """`1:0,1:3-5` -> [(1, 0), (1, 3), (1, 4), (1, 5)]."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        mt = _PAIR.match(item)
        if not mt:
            raise argparse.ArgumentTypeError(f"not LAYER:EXPERT or LAYER:FIRST-LAST: {item!r}")
        layer, first = int(mt.group(1)), int(mt.group(2))
        last = int(mt.group(3)) if mt.group(3) else first
        out += [(layer, e) for e in range(first, last + 1)]
    return out


def trace_profile(path: str, moe_layers: list[int]) -> list[tuple[int, int]]:
    """(layer, expert) ranked by how often the trace routed to it, hottest first.

    Trace layers are matched to the model's block numbers through the trace's
    `layer_ids` when they name MoE layers of this model, else by position.
    """
    import numpy as np

    from moed.traces import Trace

    trace = Trace.load(path)
    ids = trace.ids
    layer_ids = list(trace.geometry.layer_ids or range(trace.moe_layers))
    mapping = layer_ids if set(layer_ids) <= set(moe_layers) else moe_layers[: trace.moe_layers]
    counts: collections.Counter = collections.Counter()
    for pos, layer in enumerate(mapping):
        col = ids[:, pos, :].ravel()
        col = col[col >= 0]
        for e, n in zip(*np.unique(col, return_counts=True)):
            counts[(layer, int(e))] += int(n)
    return [k for k, _ in counts.most_common()]


def cmd_set(args) -> int:
    try:
        floor = parse_size(args.value)
    except ValueError as exc:
        raise errors.BadRequest(str(exc)) from None
    with Client(args.socket, "moectl") as c:
        r = c.request(m.SetMemFloor(floor))
    print(
        f"mem floor {format_size(r.floor_bytes)}: {format_size(r.mem_available_bytes)} available, "
        f"store limited to {format_size(r.effective_budget_bytes)}, "
        f"{format_size(r.given_back_bytes)} given back so far"
    )
    return 0


def cmd_pin(args) -> int:
    with Client(args.socket, "moectl") as c:
        model = c.open_model(args.model)
        experts = args.experts or []
        if args.trace:
            experts = trace_profile(args.trace, model.moe_layers)
        r = c.request(m.Pin(model.model_id, experts, all=args.all, from_stats=args.from_stats))
    print(
        f"pinned {r.pinned} experts ({r.skipped} skipped: pin budget full); "
        f"pinned partition {format_size(r.pinned_bytes)}"
    )
    return 0


def cmd_clear_errors(args) -> int:
    with Client(args.socket, "moectl") as c:
        model_id = c.open_model(args.model).model_id if args.model else 0
        r = c.request(m.ClearReadErrors(model_id))
    print(f"cleared {r.cleared} quarantined experts")
    return 0


def cmd_unpin(args) -> int:
    with Client(args.socket, "moectl") as c:
        model = c.open_model(args.model)
        r = c.request(m.Unpin(model.model_id, args.experts or [], all=args.all))
    print(f"unpinned {r.unpinned} experts; pinned partition {format_size(r.pinned_bytes)}")
    return 0
