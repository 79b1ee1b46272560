"""The layer holds: the one owner of what a streamed model's routed layers hold (in C).

What this module owns: the Python face of one streamer's layer holds
(moed/engines/_layer_holds.c, whose module comment has the whole cycle). The holds hold at
most one thing at a time: their own hit grant (a lane layer's hit, taken in C inside the
eval callback), a Python grant (the stop function's answer), or, for a whole step, the
region's pin hold. They know each routed layer's stop node (its top-k, or for a device
layer the routing weights: `stop_at_weights`, `device_layer`), choose each routed stop's
path and let go of what they held; Python is called once a stop, and only when it has
something to do:

    C at the stop: ids final?  try the layer's hit
       lane layer:   hp_hit on the daemon's slots, the earlier hit grant released, mapped
       device layer: every routed expert in a device slot? bump the LRU, write slot ids
       a hit, nothing for Python this step   -> done in C (lane_hit, device_hit)
       otherwise: on_stop(topk, layer, status, grant, ids) one call C -> Python, none back
         status > 0     a hit taken in C: Python scores and prefetches, lets `grant` go
         LANE_MISSED    Python asks the daemon (source.acquire)
         DEVICE_MISSED  Python acquires what no slot holds (source.hit first), uploads,
                        writes the slot ids (and lets that grant go: its bytes are copies)
         NOT_TRIED      Python tries source.hit, then source.acquire on a miss
       `ids`: the top-k's ids as C read them (None: not read), so no node is read twice;
       Python answers (goes on, grant | None[, experts, slots]): the holds own that grant
       from the return, and map a lane layer's experts at their slots then.

Lane layers are the relaxed zero-copy layers whose experts compute on the CPU: their
expert addresses are mapped by the holds alone (a hit, an answer's grant, `place` for warm). Device
layers are device slots' (moed.engines.device_slots), whose LRU arrays C reads and bumps.
A node in a device's memory (an offloaded layer's top-k) is read and written through
ggml's backend functions, which the holds are given at construction.

The device LRU's arrays are moed.engines.device_lru's `SlotLru` (the policy's own, one a
device layer; C keeps their buffers while the holds live): `slot_of_expert`,
`expert_of_slot`, `last_use` and `clock` ([0] the clock, [1] the hits). A device hit in C
is `device_lru.full_hit` step for step (the clock ticked, `last_use` stamped and the hits
counted, in ascending expert order); the policy alone fills and evicts.

Why in C: between two layers' callbacks the matmuls stream tens of MB of weights,
so the callback runs with cold caches, and a fit-mode layer's Python acquire and
show cost 115 us where a warm loop says 22 (bench/RESULTS.md, issue 22). A hit in
the holds is a few microseconds.

Invariants:
- at most one of the hit grant, a Python grant and the pin hold is held; a whole
  step runs only between a `whole_begin` that said True and its `whole_end`, with
  nothing else held;
- the holds take a lane hit only when every expert is a plain hit (the same steps as
  `ModelHandle.acquire`'s local path: moed/_hitproto.h) and the region is live, and a
  device hit only when every routed expert is in a slot both LRU maps agree on;
  otherwise nothing is changed;
- a grant has one owner at every instant: the holds hand a Python grant over (to the
  route function, `end`, `close`) and take one back only in the stop function's answer,
  so no call leaves it unowned; their own hit grant and pin hold are released by one C
  function (`let_go`), before Python asks for the next layer, at a device hit and after
  every decode (`end`), and a Python grant by Python (moed.engines.grants) at the next
  stop or after the decode, so an idle engine holds nothing;
- every routed stop is counted under exactly one outcome (`crossings`, OUTCOMES);
- the connection closing disables the lane hits first (`HoldRegion.on_close`), so no
  hit is taken on a region the daemon no longer counts; after a daemon restart the
  streamer frees these holds and builds new ones over the new connection
  (`ExpertStreamer.ensure_bound`): one holds object never spans two connections.

`MOED_LANE=0` gives the holds no lane layers: every CPU layer goes through Python.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moed.engines import ggml_api
from moed.engines.expert_pages import PartSpan
from moed.engines.sources import Grant, LaneSource
from moed.protocol import errors

if TYPE_CHECKING:
    from moed.engines.device_lru import SlotLru

# A routed stop's status (route_fn's third argument); > 0: a hit of that many experts taken in C.
# moed.engines._layer_holds' own constants (a unit test checks): kept here so that importing the
# engine does not need the extension built.
NOT_TRIED = -1  # not tried (ids not final, odd ids, neither a lane nor a device layer): Python tries source.hit
LOST = -2  # a hit grant of the holds was lost (its region revoked past the grace)
MAP_FAILED = -3  # a hit was taken, but mapping its slots failed
LANE_MISSED = -4  # a lane layer's hit was tried and missed: Python asks the daemon without trying again
DEVICE_MISSED = -5  # a device layer's expert is in no slot: Python acquires what no slot holds

# The stop function (the cycle's `on_stop`; the C calls it `route_fn`):
# on_stop(topk, layer, status, grant, ids) -> whether the graph goes on, or (goes on, grant | None
# [, experts, slots]): the grant the holds hold from the return (a lane layer's mapped at slots).
StopFn = Callable[[int, int, int, Any, bytes | None], bool | tuple[Any, ...]]

# ggml's functions the holds call for a node in a device's memory, in `backend`'s order.
BACKEND = ("ggml_backend_tensor_get_2d", "ggml_backend_tensor_set_2d", "ggml_backend_buffer_is_host")

# Every routed stop is counted under exactly one of these (C's own list: a unit test checks).
OUTCOMES = (
    "lane_hit",  # a lane layer's hit: the whole layer in C, no Python
    "lane_hit_python",  # a lane layer's hit taken in C, then Python called (to score, or let a grant go)
    "lane_miss",  # a lane layer's hit tried and missed: Python asked the daemon
    "device_hit",  # every routed expert in a device slot: the whole layer in C, no Python
    "device_hit_python",  # the same, then Python called
    "device_miss",  # a device layer's expert in no slot: Python acquired and uploaded
    "not_tried",  # nothing tried in C: Python's path
    "failed",  # LOST or MAP_FAILED
)


@dataclass
class HoldStats:
    layers: int = 0  # layers taken by a hit in C
    experts: int = 0
    acquire_s: float = 0.0
    show_s: float = 0.0
    maps: int = 0
    misses: int = 0  # hits tried in C that missed (each then went to the daemon)
    whole_decodes: int = 0  # whole steps: decodes with no per-layer stop (every expert pinned)
    device_layers: int = 0  # device layers whose every routed expert was in a slot (hits taken in C)
    device_experts: int = 0  # (layer, expert) device-slot hits taken in C
    device_s: float = 0.0


@dataclass
class Crossings:
    """Routed stops of one outcome, and the calls across C and Python they made."""

    stops: int = 0
    to_python: int = 0  # calls C -> Python (the stop function)
    from_python: int = 0  # calls Python -> the holds while a stop was under way
    most_from_python: int = 0  # the most at one stop
    ns: int = 0  # host time in these stops (the callback's work, Python's part included)

    def __add__(self, other: Crossings) -> Crossings:
        return Crossings(
            self.stops + other.stops,
            self.to_python + other.to_python,
            self.from_python + other.from_python,
            max(self.most_from_python, other.most_from_python),
            self.ns + other.ns,
        )

    def row(self) -> dict[str, int | float]:
        """As stream_stats()["crossings"] gives it."""
        return {
            "stops": self.stops,
            "to_python": self.to_python,
            "from_python": self.from_python,
            "host_s": self.ns / 1e9,
        }


class LayerHolds:
    def __init__(
        self,
        on_stop: StopFn,
        n_experts: int,
        source: LaneSource | None,
        parts: dict[int, list[PartSpan]],
        device_nodes: bool = False,
    ):
        """`source`: the lane's hits and segments (None: no lane layers); `parts`: the lane
        layers' expert spans (relaxed zero copy), mapped by the holds alone; `device_nodes`:
        a node may sit in a device's memory (an offload), so the holds are given ggml's backend
        functions to read and write one (else every node is read as host memory)."""
        from moed.engines import _layer_holds

        self._lib = _layer_holds
        hits = source.local_hits() if source is not None and parts else None
        # Two hit grants' worth of hold indexes (the one held, the next); none left: no hits.
        self.holds: list[int] = (hits.region.take(2 * n_experts) or []) if hits is not None else []
        if not self.holds:
            hits = None
        self._hits = hits
        counter = hits.counter_word if hits is not None else None
        self._c = _layer_holds.new(
            on_stop,
            hits.region.map if hits is not None else None,
            hits.table.map if hits is not None else None,
            n_experts,
            self.holds,
            -1 if counter is None else counter,
            ggml_api.HOLDS_LAYOUT,
        )
        if device_nodes:
            _layer_holds.backend(self._c, *(ggml_api.address(name) for name in BACKEND))
        for layer, spans in parts.items():
            assert source is not None, "lane layers come with their source"
            class_id, seg = source.layer_segment(layer)
            row, states = 0, None
            if hits is not None:
                row, states = hits.rows[layer], hits.states[class_id].map
            args = [(s.addr, s.bytes_per_expert, seg.part_offset(0, s.part), seg.part_stride(s.part)) for s in spans]
            _layer_holds.lane_layer(self._c, layer, row, class_id, states, seg.fd, args)
        if hits is not None:
            hits.region.on_close(self.disable)
            if hits.pin_word is not None:
                _layer_holds.pins(self._c, hits.model_id, hits.pin_word)
        self.layers = set(parts)  # the lane layers
        self.device_layers: set[int] = set()

    @property
    def handle(self):
        return self._c

    def stop_at_weights(self, layer: int) -> None:
        """`layer` stops at its routing weights, `ffn_moe_weights-<layer>` (a device layer: its ids
        are rewritten after the weights were gathered by them), not at its top-k."""
        self._lib.stop_at(self._c, layer, True)

    def device_layer(self, layer: int, lru: SlotLru) -> None:
        """`layer`'s device LRU (its arrays, kept by the holds while they live): its full hits
        are taken in C, and it stops at its routing weights."""
        self._lib.device_layer(self._c, layer, lru.slot_of_expert, lru.expert_of_slot, lru.last_use, lru.clock)
        self.device_layers.add(layer)

    def begin(self, try_hits: bool, alone: bool, log: bool) -> None:
        """A decode's path choice: `try_hits`, the ids are final at the stop (no hook or
        substitution), so the layer's hit is tried in C first; `alone`, nothing for Python at a
        stop either; `log`, list the layers done alone (`take_log`)."""
        self._lib.begin(self._c, try_hits, alone, log)

    def place(self, layer: int, expert: int, slot: int, populate: bool = False) -> None:
        """Map `slot` at a lane layer's expert addresses outside a decode, unless they show it
        already (`populate`: map it again with its page-table entries made now)."""
        self._lib.place(self._c, layer, expert, slot, populate)

    def forget(self) -> None:
        """The lane layers' addresses were remapped behind the holds (zeros after a failed decode
        under an offload, then PROT_NONE): each expert is mapped again at its next use."""
        self._lib.forget(self._c)

    def fail(self) -> None:
        """The decode failed: no hit and no grant for Python until `end`."""
        self._lib.fail(self._c)

    def end(self) -> tuple[Grant | None, bool]:
        """After a decode: the hit grant let go, and the Python grant still held given back for
        the caller to let go; False when the hit grant was lost (the caller raises `lost()`)."""
        return self._lib.end(self._c)

    def held(self) -> tuple[str, Any] | None:
        """What is held now: None, ("hit", n): a hit grant of n experts, ("grant", grant): a
        Python grant, or ("pin", model_id): the pin hold of a whole step."""
        return self._lib.held(self._c)

    def take_log(self) -> list[tuple[int, list[int]]]:
        """The (layer, experts) done alone since the last call (a full log keeps its first
        1,024 layers: enough for one decode of any model moed serves)."""
        taken, _full = self._lib.take_log(self._c)
        return taken

    def whole_begin(self) -> bool:
        """Take the region's pin hold for a whole step: True when every expert of the model is
        pinned and READY, and now mapped at its slot; False (nothing held) otherwise."""
        return self._lib.whole_begin(self._c)

    def whole_end(self, uses: int) -> None:
        """After the whole step's llama_decode: let the pin hold go; `uses` expert uses are
        counted as the model's local hits."""
        self._lib.whole_end(self._c, uses)

    @property
    def has_pin_word(self) -> bool:
        """A region with a pin word: whole steps can be taken (when every layer is a lane layer)."""
        return self._hits is not None and self._hits.pin_word is not None

    def disable(self) -> None:
        self._lib.disable(self._c)

    def map_error(self) -> OSError:
        """The error of the mapping that failed at a stop (MAP_FAILED)."""
        import os

        err = self._lib.stats(self._c)["map_errno"]
        return OSError(err, os.strerror(err))

    def stats(self) -> HoldStats:
        d = self._lib.stats(self._c)
        return HoldStats(
            d["layers"],
            d["experts"],
            d["acquire_ns"] / 1e9,
            d["show_ns"] / 1e9,
            d["maps"],
            d["misses"],
            d["whole_decodes"],
            d["device_layers"],
            d["device_experts"],
            d["device_ns"] / 1e9,
        )

    def crossings(self) -> dict[str, Crossings]:
        """Routed stops by outcome (OUTCOMES: each stop under exactly one) and their calls
        across C and Python, counted by the holds."""
        return {k: Crossings(*v) for k, v in self._lib.crossings(self._c).items()}

    def layer_acquire_s(self, layer: int) -> float:
        return self._lib.layer_ns(self._c, layer) / 1e9

    def close(self) -> Grant | None:
        """Let the hit grant and the pin hold go, free the buffers and give the hold indexes back;
        a Python grant still held is returned, for the caller to let go."""
        grant = self._lib.free(self._c)
        holds, self.holds = self.holds, []
        if holds and self._hits is not None:
            self._hits.region.give(holds)
        return grant


def lost() -> errors.LeaseLost:
    return errors.LeaseLost(
        "a slot of the engine's hit grant was refilled before its release (the daemon closed "
        "this connection and its holds outlived the grace); what was read from it may be wrong"
    )
