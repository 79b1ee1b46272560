"""The streamer's report: its counters as `StreamedLlama.stream_stats()` gives them.

What this module owns: the shape of the engine's counters (`StreamStats`) and how they
are gathered from the parts that keep them: Python's half of the cycle (layers,
experts, stalls), the decode steps (decodes, tokens), the install (dense locks,
dropped cache), the binding (rebinds), the layer holds, live and let go (what they
did in C), each placement's `stats()`, the look-ahead's and substituter's totals, the
kernels' and where the layers compute. It keeps no counter of its own and changes
nothing: each counter has one owner, which the report only reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moed.engines.cycle import CycleCounts

if TYPE_CHECKING:
    from moed.engines.binding import Bound, HoldLedger
    from moed.engines.mapping import ModelMapping
    from moed.engines.repack import LayoutPlan
    from moed.engines.substitute import Substituter


@dataclass
class StreamStats(CycleCounts):
    """Every part's counters in one: the cycle's (its fields first), then the decode steps',
    the install's and the binding's, as `counters()` gathers them by name."""

    decodes: int = 0
    whole_decodes: int = 0  # decodes with no per-layer stop (every expert pinned: the holds count them)
    tokens: int = 0  # tokens in all decodes (prompt and generated)
    dense_locked_bytes: int = 0
    dense_lock_error: str = ""
    dropped_expert_cache_bytes: int = 0
    rebinds: int = 0  # times the engine was bound again to a daemon that came back (ensure_bound)


class StreamReport:
    def __init__(
        self,
        counts: Sequence[object],
        bound: Bound,
        ledger: HoldLedger,
        model: ModelMapping,
        substituter: Substituter | None,
        layout: LayoutPlan | None,
    ):
        """`counts`: the parts' own counters, each a dataclass whose fields are StreamStats
        fields (read at every report); `ledger`: the counters of the holds let go."""
        self._counts, self._bound, self._ledger = counts, bound, ledger
        self._model, self._substituter, self._layout = model, substituter, layout

    def counters(self) -> StreamStats:
        """Python's counters: the routed stops it saw, not those the holds did in C."""
        return StreamStats(**{k: v for part in self._counts for k, v in vars(part).items()})

    def totals(self) -> StreamStats:
        """This engine's counters, the layers the holds took in C included."""
        out = self.counters()
        holds, ledger = self._bound.holds, self._ledger
        if holds is not None or ledger.past.layers:
            hs = ledger.stats(holds)
            out.layers += hs.layers
            out.experts += hs.experts
            out.acquire_s += hs.acquire_s
            out.show_s += hs.show_s
            out.whole_decodes = hs.whole_decodes
        return out

    def report(self) -> dict:
        """This engine's counters as `StreamedLlama.stream_stats()` gives them (its docstring
        says what each means)."""
        s = self.totals()
        out = dict(vars(s))
        out["stall_s"] = s.acquire_s
        out["stall_s_per_token"] = s.acquire_s / s.tokens if s.tokens else 0.0
        out.update(self.placement_stats())
        out["lane_layers"] = self._ledger.stats(self._bound.holds).layers
        out["crossings"] = {k: c.row() for k, c in self._ledger.crossings(self._bound.holds).items()}
        la = self._model.lookahead
        if la is not None:
            out.update(la.totals())
            self._add_lane_stalls(out["per_layer"], s.tokens)
        if self._substituter is not None:
            out.update(self._substituter.totals(s.tokens))
        out.update(self._kernels())
        off = self._layout.offload if self._layout else None
        out["devices"] = off.describe() if off is not None else {"gpu": "", "gpu_layers": [], "experts": "CPU"}
        return out

    def placement_stats(self) -> dict:
        """Every placement's counters (the CPU pages', the holds' mappings included)."""
        out: dict = {}
        for placement in self._bound.placements():
            out.update(placement.stats())
        if "gpu_slots" in out:  # the layers whose ids the holds rewrote in C (full hits) were shown too
            hs = self._ledger.stats(self._bound.holds)
            out["gpu_slots"]["cycles"] += hs.device_layers
            out["gpu_slots"]["cycle_s"] += hs.device_s
        if "pages_maps" in out:
            out["pages_maps"] += self._ledger.past.maps  # mapped by layer holds let go at a rebind
        return out

    def _add_lane_stalls(self, per_layer: dict, tokens: int) -> None:
        """The hits taken in C, per layer (their own stall), into the look-ahead's per-layer counts."""
        holds, past = self._bound.holds, self._ledger.layer_s
        if holds is None and not past:
            return
        for layer, d in per_layer.items():
            now = holds.layer_acquire_s(layer) if holds is not None else 0.0
            d["stall_s"] += now + past.get(layer, 0.0)
            d["stall_s_per_token"] = d["stall_s"] / tokens if tokens else 0.0

    def _kernels(self) -> dict:
        k = self._model.kernels
        return {
            "expert_layout": k.done.expert_layout if k else "plain",
            "dense_repacked_tensors": k.done.dense_tensors if k else 0,
            "dense_repacked_bytes": k.done.dense_bytes if k else 0,
            "dense_layouts": list(k.done.dense_layouts) if k else [],
        }
