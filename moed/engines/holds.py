"""The lane: a routed layer whose experts are all local hits, taken in C inside the eval callback.

What this module owns: one streamer's C lane (moed/_evalcb.c) over the relaxed
zero-copy layers of its model: the lane's own hold indexes (taken from the
connection's hold region at build, given back at close), its lease, and the
mappings of those layers' expert addresses. The streamer's Python path maps
those addresses only through `place`, so they have one owner.

Why: between two layers' callbacks the matmuls stream tens of MB of weights, so
the callback runs with cold caches, and a fit-mode layer's Python acquire and show
cost 115 us where a warm loop says 22 (bench/RESULTS.md, issue 22). The lane does
the layer in a few microseconds of C.

Whole steps: when every expert of the model is pinned (the table's pin word), a
decode takes the region's pin hold instead of per-layer holds (`whole_begin` /
`whole_end`, moed.protocol.residency_words) and runs with no stop at all.

Invariants:
- a whole step runs only between a `whole_begin` that said True and its
  `whole_end`, with no lane lease and no Python grant held;
- the lane takes a layer only when every expert is a plain hit (the same steps as
  `ModelHandle.acquire`'s local path: moed/_hitproto.h), no Python grant is held,
  and its region is live; otherwise it declines and changes nothing;
- a lane lease is released before a Python acquire of the next layer and at the
  end of every decode (`release`), so an idle engine holds nothing;
- the connection closing disables the lane first (`HoldRegion.on_close`), so no hit
  is taken on a region the daemon no longer counts.

`MOED_LANE=0` builds no lane: every layer goes through Python's path.
"""

from __future__ import annotations

from dataclasses import dataclass

from moed.engines import ggml_tensor
from moed.engines.expert_pages import PartSpan
from moed.engines.sources import LaneSource
from moed.protocol import errors

DECLINED = -1  # not a lane step (no region, not a lane layer, odd ids): Python may try a hit
LOST = -2
MISSED = -4  # the hit was tried and missed: Python asks the daemon without trying again


@dataclass
class LaneStats:
    layers: int = 0
    experts: int = 0
    acquire_s: float = 0.0
    show_s: float = 0.0
    maps: int = 0
    declines: int = 0  # hits the lane tried and missed (each then went to the daemon)
    whole_steps: int = 0  # decodes taken with no per-layer stop (every expert pinned)


class ExpertLane:
    def __init__(self, source: LaneSource, parts: dict[int, list[PartSpan]]):
        from moed import _evalcb

        self._evalcb = _evalcb
        hits = source.local_hits()
        n = source.n_experts
        # Two leases' worth of hold indexes (the one held, the next); none left: no hits.
        self.holds: list[int] = (hits.region.take(2 * n) or []) if hits is not None else []
        if not self.holds:
            hits = None
        self._hits = hits
        counter = hits.counter_word if hits is not None else None
        self._c = _evalcb.lane_new(
            hits.region.map if hits is not None else None,
            hits.table.map if hits is not None else None,
            n,
            self.holds,
            -1 if counter is None else counter,
            ggml_tensor.LANE_LAYOUT,
        )
        for layer, spans in parts.items():
            class_id, seg = source.layer_segment(layer)
            row, states = 0, None
            if hits is not None:
                row, states = hits.rows[layer], hits.states[class_id].map
            args = [(s.addr, s.bytes_per_expert, seg.part_offset(0, s.part), seg.part_stride(s.part)) for s in spans]
            _evalcb.lane_layer(self._c, layer, row, class_id, states, seg.fd, args)
        if hits is not None:
            hits.region.on_close(self.disable)
            if hits.pin_word is not None:
                _evalcb.lane_pins(self._c, hits.model_id, hits.pin_word)
        self.layers = set(parts)

    @property
    def handle(self):
        return self._c

    def step(self, tensor: int) -> int:
        """The layer at `tensor` (a computed ffn_moe_topk) taken in C: experts held, DECLINED,
        or MISSED (the hit was tried, here or by the eval callback, and missed)."""
        n = self._evalcb.lane_step(self._c, tensor)
        if n == LOST:
            raise _lost()
        return n

    def place(self, layer: int, expert: int, slot: int, populate: bool = False) -> None:
        """Map `slot` at the expert's addresses, unless it is what they show already
        (`populate`: map it again with its page-table entries made now)."""
        self._evalcb.lane_place(self._c, layer, expert, slot, populate)

    def python_held(self, held: bool) -> None:
        self._evalcb.lane_python_held(self._c, held)

    def release(self) -> None:
        """Let the lane's lease go (if any)."""
        if not self._evalcb.lane_release(self._c):
            raise _lost()

    def log(self, on: bool) -> None:
        """Keep (or stop keeping) a log of the layers the lane takes, for `take_log`."""
        self._evalcb.lane_log(self._c, on)

    def take_log(self) -> list[tuple[int, list[int]]]:
        """The (layer, experts) the lane took since the last call (a full log keeps its
        first 1,024 layers: enough for one decode of any model moed serves)."""
        taken, _full = self._evalcb.lane_take_log(self._c)
        return taken

    def whole_begin(self) -> bool:
        """Take the region's pin hold for a whole step: True when every expert of the model is
        pinned and READY, and now mapped at its slot; False (nothing held) otherwise."""
        return self._evalcb.lane_whole_begin(self._c)

    def whole_end(self, uses: int) -> None:
        """After the whole step's llama_decode: let the pin hold go; `uses` expert uses are
        counted as the model's local hits."""
        self._evalcb.lane_whole_end(self._c, uses)

    def disable(self) -> None:
        self._evalcb.lane_disable(self._c)

    def stats(self) -> LaneStats:
        d = self._evalcb.lane_stats(self._c)
        return LaneStats(
            d["layers"],
            d["experts"],
            d["acquire_ns"] / 1e9,
            d["show_ns"] / 1e9,
            d["maps"],
            d["declines"],
            d["whole_steps"],
        )

    def layer_acquire_s(self, layer: int) -> float:
        return self._evalcb.lane_layer_ns(self._c, layer) / 1e9

    def close(self) -> None:
        """Release the lease and the lane's buffers, and give its hold indexes back."""
        self._evalcb.lane_free(self._c)
        holds, self.holds = self.holds, []
        if holds and self._hits is not None:
            self._hits.region.give(holds)


def _lost() -> errors.LeaseLost:
    return errors.LeaseLost(
        "a slot of the engine's local lease was refilled before its release (the daemon closed "
        "this connection and its holds outlived the grace); what was read from it may be wrong"
    )
