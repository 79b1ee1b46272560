"""A model's experts in RAM-tier bytes, and budgets given in those terms.

What this module owns: how many bytes one expert of a catalog layer takes in the
daemon's RAM tier (its parts page-rounded, `moed.protocol.layout.slot_bytes`), per
layer and for every routed expert of a model, and the budget specs the tools take
(`50%` of every expert's slot bytes, or a size such as `512MiB`). Its users: the
engine verbs and `moectl replay` (a private daemon's budget), the lab (plan, fleet,
drive bench, replay) and the benches.

Invariant: a share is never less than one page (`PAGE`), however small the model.
"""

from __future__ import annotations

import os

from moed.badinput import BadInput
from moed.protocol import layout
from moed.protocol.layout import PAGE
from moed.protocol.sizes import parse_size


def slot_bytes(entry) -> int:
    """Bytes one expert of a catalog `LayerEntry` takes in the RAM tier (parts page-rounded)."""
    return layout.slot_bytes(p.bytes_per_expert for p in entry.parts.values())


def slot_bytes_by_layer(model_path: str | os.PathLike) -> dict[int, int]:
    """`slot_bytes` per MoE layer of the model."""
    from moed.gguf.catalog import Catalog

    return {l: slot_bytes(e) for l, e in Catalog.open(model_path).layers.items()}


def all_experts_bytes(model_path: str | os.PathLike) -> int:
    """The RAM tier bytes that would hold every routed expert of the model."""
    from moed.gguf.catalog import Catalog

    cat = Catalog.open(model_path)
    return cat.n_experts * sum(slot_bytes(e) for e in cat.layers.values())


def parse_budget(spec: str, model_path: str | os.PathLike) -> int:
    """`50%` of every expert's slot bytes, or a size (`512MiB`, plain bytes)."""
    spec = str(spec).strip()
    if spec.endswith("%"):
        try:
            frac = float(spec[:-1]) / 100
        except ValueError:
            raise BadInput(f"not a budget: {spec!r} (use e.g. 50% or 512MiB)") from None
        if not 0 < frac <= 1:
            raise BadInput(f"a budget share must be in (0%, 100%], not {spec}")
        return max(PAGE, int(frac * all_experts_bytes(model_path)))
    try:
        return parse_size(spec)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
