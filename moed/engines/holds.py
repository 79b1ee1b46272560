"""The layer holds: the one owner of what a streamed model's routed layers hold (in C).

What this module owns: the Python face of one streamer's layer holds
(moed/_evalcb.c, whose module comment has the whole cycle). The holds hold at most
one thing at a time: their own hit grant (a lane layer's hit, taken in C inside the
eval callback), a Python grant they were handed (`hold`), or, for a whole step, the
region's pin hold. They choose each routed stop's path and let go of what they held;
Python is called once a stop, and only when it has something to do:

    C at the stop: ids final and a lane layer? try the hit.
       hit, nothing for Python this step      -> done in C (no Python at all)
       otherwise: route(tensor, layer, status, grant)   one call C -> Python
         status HIT (> 0)  Python scores and prefetches, lets `grant` go
         MISSED            Python asks the daemon (source.acquire), then `hold(grant)`
         NOT_TRIED         Python tries source.hit, then source.acquire on a miss,
                           then `hold(grant)`
                           (one call Python -> C, which maps a lane layer's slots)

Lane layers are the relaxed zero-copy layers: their expert addresses are mapped by
the holds alone (a hit, `hold`, `place` for warm). Under a GPU offload there are
none and no region: every stop is NOT_TRIED and Python reads the top-k through
ggml's backend API (the top-k may be in device memory; C reads raw pointers).

Why in C: between two layers' callbacks the matmuls stream tens of MB of weights,
so the callback runs with cold caches, and a fit-mode layer's Python acquire and
show cost 115 us where a warm loop says 22 (bench/RESULTS.md, issue 22). A hit in
the holds is a few microseconds.

Invariants:
- at most one of the hit grant, a Python grant and the pin hold is held; a whole
  step runs only between a `whole_begin` that said True and its `whole_end`, with
  nothing else held;
- the holds take a hit only when every expert is a plain hit (the same steps as
  `ModelHandle.acquire`'s local path: moed/_hitproto.h) and the region is live;
  otherwise nothing is changed;
- their hit grant is released before Python asks for the next layer and after every
  decode (`end`), and a Python grant is let go by Python at the next stop or after
  the decode (`end` gives it back), so an idle engine holds nothing;
- the connection closing disables the hits first (`HoldRegion.on_close`), so no
  hit is taken on a region the daemon no longer counts; after a daemon restart the
  streamer frees these holds and builds new ones over the new connection
  (`ExpertStreamer.ensure_bound`): one holds object never spans two connections.

`MOED_LANE=0` gives the holds no lane layers: every layer goes through Python.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moed.engines import ggml_tensor
from moed.engines.expert_pages import PartSpan
from moed.engines.sources import Grant, LaneSource
from moed.protocol import errors

# A routed stop's status (route_fn's third argument); > 0: a hit of that many experts.
# moed._evalcb's own constants (a unit test checks): kept here so that importing the
# engine does not need the extension built.
NOT_TRIED = -1  # not tried (not a lane layer, ids not final, odd ids): Python tries source.hit
LOST = -2  # a hit grant of the holds was lost (its region revoked past the grace)
MAP_FAILED = -3  # a hit was taken, but mapping its slots failed
MISSED = -4  # the hit was tried and missed: Python asks the daemon without trying again

# route(tensor, layer, status, grant | None) -> whether the graph goes on.
RouteFn = Callable[[int, int, int, Any], bool]

OUTCOMES = ("alone", "hit", "missed", "not_tried", "failed")


@dataclass
class HoldStats:
    layers: int = 0  # layers taken by a hit in C
    experts: int = 0
    acquire_s: float = 0.0
    show_s: float = 0.0
    maps: int = 0
    misses: int = 0  # hits tried in C that missed (each then went to the daemon)
    whole_decodes: int = 0  # whole steps: decodes with no per-layer stop (every expert pinned)


@dataclass
class Crossings:
    """Routed stops of one outcome, and the calls across C and Python they made."""

    stops: int = 0
    to_python: int = 0  # calls C -> Python (the route function)
    from_python: int = 0  # calls Python -> the holds while a stop was under way
    most_from_python: int = 0  # the most at one stop


class LayerHolds:
    def __init__(self, route: RouteFn, n_experts: int, source: LaneSource | None, parts: dict[int, list[PartSpan]]):
        """`source`: the lane's hits and segments (None: no lane layers); `parts`: the lane
        layers' expert spans (relaxed zero copy), mapped by the holds alone."""
        from moed import _evalcb

        self._evalcb = _evalcb
        hits = source.local_hits() if source is not None and parts else None
        # Two hit grants' worth of hold indexes (the one held, the next); none left: no hits.
        self.holds: list[int] = (hits.region.take(2 * n_experts) or []) if hits is not None else []
        if not self.holds:
            hits = None
        self._hits = hits
        counter = hits.counter_word if hits is not None else None
        self._c = _evalcb.holds_new(
            route,
            hits.region.map if hits is not None else None,
            hits.table.map if hits is not None else None,
            n_experts,
            self.holds,
            -1 if counter is None else counter,
            ggml_tensor.LANE_LAYOUT,
        )
        for layer, spans in parts.items():
            assert source is not None, "lane layers come with their source"
            class_id, seg = source.layer_segment(layer)
            row, states = 0, None
            if hits is not None:
                row, states = hits.rows[layer], hits.states[class_id].map
            args = [(s.addr, s.bytes_per_expert, seg.part_offset(0, s.part), seg.part_stride(s.part)) for s in spans]
            self._evalcb.holds_layer(self._c, layer, row, class_id, states, seg.fd, args)
        if hits is not None:
            hits.region.on_close(self.disable)
            if hits.pin_word is not None:
                self._evalcb.holds_pins(self._c, hits.model_id, hits.pin_word)
        self.layers = set(parts)  # the lane layers

    @property
    def handle(self):
        return self._c

    def begin(self, try_hits: bool, alone: bool, log: bool) -> None:
        """A decode's path choice: `try_hits`, the ids are final at the stop (no hook or
        substitution), so a lane layer's hit is tried in C first; `alone`, nothing for
        Python at a stop either; `log`, list the layers done alone (`take_log`)."""
        self._evalcb.holds_begin(self._c, try_hits, alone, log)

    def hold(self, grant: Grant, show: bool = True) -> None:
        """`grant` is held by the holds from now (Python's acquire of a layer); on a lane layer
        with `show`, its experts are mapped at their slots in the same call."""
        if show and grant.layer in self.layers:
            experts = list(grant.experts)
            self._evalcb.holds_hold(self._c, grant, grant.layer, experts, [grant.slot(e) for e in experts])
        else:
            self._evalcb.holds_hold(self._c, grant)

    def place(self, layer: int, expert: int, slot: int, populate: bool = False) -> None:
        """Map `slot` at a lane layer's expert addresses outside a decode, unless they show it
        already (`populate`: map it again with its page-table entries made now)."""
        self._evalcb.holds_place(self._c, layer, expert, slot, populate)

    def fail(self) -> None:
        """The decode failed: no hit and no grant for Python until `end`."""
        self._evalcb.holds_fail(self._c)

    def end(self) -> tuple[Grant | None, bool]:
        """After a decode: the hit grant let go, and the Python grant still held given back for
        the caller to let go; False when the hit grant was lost (the caller raises `lost()`)."""
        return self._evalcb.holds_end(self._c)

    def held(self) -> tuple[str, Any] | None:
        """What is held now: None, ("hit", n): a hit grant of n experts, ("grant", grant): a
        Python grant, or ("pin", model_id): the pin hold of a whole step."""
        return self._evalcb.holds_held(self._c)

    def take_log(self) -> list[tuple[int, list[int]]]:
        """The (layer, experts) done alone since the last call (a full log keeps its first
        1,024 layers: enough for one decode of any model moed serves)."""
        taken, _full = self._evalcb.holds_take_log(self._c)
        return taken

    def whole_begin(self) -> bool:
        """Take the region's pin hold for a whole step: True when every expert of the model is
        pinned and READY, and now mapped at its slot; False (nothing held) otherwise."""
        return self._evalcb.holds_whole_begin(self._c)

    def whole_end(self, uses: int) -> None:
        """After the whole step's llama_decode: let the pin hold go; `uses` expert uses are
        counted as the model's local hits."""
        self._evalcb.holds_whole_end(self._c, uses)

    @property
    def has_pin_word(self) -> bool:
        """A region with a pin word: whole steps can be taken (when every layer is a lane layer)."""
        return self._hits is not None and self._hits.pin_word is not None

    def disable(self) -> None:
        self._evalcb.holds_disable(self._c)

    def map_error(self) -> OSError:
        """The error of the mapping that failed at a stop (MAP_FAILED)."""
        import os

        err = self._evalcb.holds_stats(self._c)["map_errno"]
        return OSError(err, os.strerror(err))

    def stats(self) -> HoldStats:
        d = self._evalcb.holds_stats(self._c)
        return HoldStats(
            d["layers"],
            d["experts"],
            d["acquire_ns"] / 1e9,
            d["show_ns"] / 1e9,
            d["maps"],
            d["misses"],
            d["whole_decodes"],
        )

    def crossings(self) -> dict[str, Crossings]:
        """Routed stops by outcome (alone, hit, missed, not_tried, failed) and their calls
        across C and Python, counted by the holds."""
        return {k: Crossings(*v) for k, v in self._evalcb.holds_crossings(self._c).items()}

    def layer_acquire_s(self, layer: int) -> float:
        return self._evalcb.holds_layer_ns(self._c, layer) / 1e9

    def close(self) -> Grant | None:
        """Let the hit grant and the pin hold go, free the buffers and give the hold indexes back;
        a Python grant still held is returned, for the caller to let go."""
        grant = self._evalcb.holds_free(self._c)
        holds, self.holds = self.holds, []
        if holds and self._hits is not None:
            self._hits.region.give(holds)
        return grant


def lost() -> errors.LeaseLost:
    return errors.LeaseLost(
        "a slot of the engine's hit grant was refilled before its release (the daemon closed "
        "this connection and its holds outlived the grace); what was read from it may be wrong"
    )
