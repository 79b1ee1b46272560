"""The binding: what the routed layers are bound to, over the source's live connection.

What this module owns: the layer holds (moed.engines.holds) and the CPU placement
built over the source's connection as it is now, rebuilt when the daemon comes back
(`Binding.ensure_bound`); each routed layer's placement (moed.engines.placement,
chosen at load by `place_on` and fixed) and its stop node (the holds carry it: its top-k,
or a device placement's routing weights); the lifetime of each placement `place_on` was
handed (`placed`: its `rebind` at a rebind, its `close` at `close_placed`); the counters of
holds let go (`HoldLedger`). `Bound` is what the
others read: the cycle, the decode steps and the report; only the Binding writes it.

Invariants:
- Every decode starts bound to the source's live connection (`ensure_bound`, first in
  every decode and in warm). When the connection was lost (the daemon died;
  `ExpertSource.connected`) or replaced (`generation`), nothing of the old one is read
  or mapped again: the holds are let go (their hit grant released into its own, old,
  region; the C lane's pointers to the old tables and segments freed with them), every
  expert address is PROT_NONE again (ExpertPages.reset: the old segments' pages
  unmapped, the "which slot is behind which address" memory cleared), then the source
  reconnects (bounded: DaemonUnavailable when the daemon does not come back, and the
  engine stays unbound until a later decode succeeds) and the holds and the CPU
  placement are built again before anything is read. One holds object never spans two
  connections; llama.cpp's model and context (the KV cache) are kept.
- A device placement that copied its experts keeps them (the bytes are the file's); one
  that imported the old daemon's segments (zero copy) is not imported again into a
  running context: its `rebind` raises before the old segments are dropped, and every later
  decode raises the same (`dead`: the engine must be built again).
- A layer's placement is chosen at load and never changes, except the CPU placement
  itself, rebuilt over each new holds object for the layers it had.
- Each layer stops at its own node: a device placement's layers at their routing
  weights, every other layer at its top-k, so the CPU layers of a partial offload keep
  the lane (the holds read an offloaded layer's top-k through ggml's backend). A device
  placement's layers are no lane layers: `place_on` binds the holds again without them,
  giving them each such layer's device LRU (`Placement.lru`) so its full hits are C's.
- The counters of holds let go at a rebind are kept, so the engine's totals run on.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moed.engines import ggml_tensor
from moed.engines.holds import OUTCOMES, Crossings, HoldStats, LayerHolds, StopFn
from moed.engines.placement import CpuPages, Placement
from moed.engines.sources import ExpertSource, Grant

if TYPE_CHECKING:
    from moed.engines.mapping import ModelMapping


class Bound:
    """What the routed layers are bound to now: the layer holds (None while unbound), each
    layer's placement, and the layers that stop at their routing weights (the others stop
    at their top-k). Written by the Binding alone."""

    def __init__(self) -> None:
        self.holds: LayerHolds | None = None
        self.by_layer: dict[int, Placement] = {}
        self.weights_stops: set[int] = set()  # a device placement's layers

    def placement(self, layer: int) -> Placement:
        return self.by_layer[layer]

    def placements(self) -> list[Placement]:
        """Every placement the model's layers use, each once."""
        return list({id(p): p for p in self.by_layer.values()}.values())

    def held(self) -> tuple[str, Any] | None:
        """What the layer holds hold now: None (an idle engine holds nothing), ("hit", n),
        ("grant", grant) or ("pin", model_id)."""
        return self.holds.held() if self.holds is not None else None


class HoldLedger:
    """The counters of the layer holds let go (at a rebind, or at close), added to the live
    holds' own."""

    def __init__(self) -> None:
        self.past = HoldStats()
        self.layer_s: dict[int, float] = {}  # each lane layer's own stall, summed
        self.past_crossings: dict[str, Crossings] = {}

    def retire(self, holds: LayerHolds) -> None:
        self.past = self.stats(holds)
        self.past_crossings = self.crossings(holds)
        for layer in holds.layers:
            self.layer_s[layer] = self.layer_s.get(layer, 0.0) + holds.layer_acquire_s(layer)

    def crossings(self, holds: LayerHolds | None) -> dict[str, Crossings]:
        """Every routed stop by outcome (moed.engines.holds.OUTCOMES), the holds let go included."""
        now = holds.crossings() if holds is not None else {}
        return {k: self.past_crossings.get(k, Crossings()) + now.get(k, Crossings()) for k in OUTCOMES}

    def stats(self, holds: LayerHolds | None) -> HoldStats:
        now = holds.stats() if holds is not None else HoldStats()
        return HoldStats(*(a + b for a, b in zip(vars(self.past).values(), vars(now).values())))


@dataclass
class BindCounts:
    rebinds: int = 0  # times bound again to a daemon that came back


class Binding:
    """Binds the routed layers to the source's connection, and again after a daemon restart."""

    def __init__(
        self,
        source: ExpertSource,
        model: ModelMapping,
        bound: Bound,
        on_stop: StopFn,
        callback: ggml_tensor.EvalCallback,
        release: Callable[[Grant], object],
        offloaded: bool,
    ):
        """`on_stop`: the cycle's half of a routed stop, called by the holds; `callback`: the eval
        callback whose routed stops go to the holds; `release`: how a grant the holds give back
        at their close is let go (moed.engines.grants); `offloaded`: a device computes part of
        the graph (a top-k may be in device memory: the holds read it through ggml's backend)."""
        self._source, self._model, self._bound = source, model, bound
        self._on_stop, self._callback, self._release = on_stop, callback, release
        self._offloaded = offloaded
        self._generation = 0  # the source's connection the holds are bound to
        self._cpu: CpuPages | None = None
        self.placed: list[Placement] = []  # handed to place_on: rebound and closed here
        self.dead: BaseException | None = None  # why the engine cannot be bound again (None: it can)
        self.counts = BindCounts()
        self.ledger = HoldLedger()

    def bind(self) -> None:
        """The layer holds and the CPU placement over the source's connection as it is now (at
        install, and again after the daemon came back). The lane layers are the CPU
        placement's relaxed zero-copy layers; MOED_LANE=0: none, every CPU layer through
        Python's path (to measure the lane, or to rule it out)."""
        model, src, bound = self._model, self._source, self._bound
        assert model.pages is not None, "install builds the pages first"
        self._generation = src.generation()
        lane = model.zero_copy_layers - bound.weights_stops if os.environ.get("MOED_LANE") != "0" else set()
        lane_source = src.lane() if lane else None
        lane_parts = {layer: model.parts[layer] for layer in lane} if lane_source is not None else {}
        holds = LayerHolds(self._on_stop, src.n_experts, lane_source, lane_parts, device_nodes=self._offloaded)
        for layer in sorted(bound.weights_stops):  # a device placement's: its full hits C's where it has an LRU
            lru = bound.by_layer[layer].lru(layer)
            if lru is not None:
                holds.device_layer(layer, lru)
            else:
                holds.stop_at_weights(layer)
        self._bound.holds = holds
        self._callback.set_holds(holds.handle)  # the path is chosen per decode (DecodeSteps.begin)
        old, self._cpu = self._cpu, CpuPages(model.pages, model.parts, holds)
        by_layer = self._bound.by_layer
        for layer in model.parts:  # a device placement keeps its layers (chosen at load)
            if by_layer.get(layer, old) is old:
                by_layer[layer] = self._cpu

    def ensure_bound(self) -> bool:
        """Bound to the source's live connection (the module's first invariant says how); True
        when it was bound again just now."""
        if self.dead is not None:
            raise self.dead
        src = self._source
        if self._bound.holds is not None and src.generation() == self._generation and src.connected():
            return False
        self.close_holds()
        if self._model.pages is not None:
            self._model.pages.reset()
        try:
            for placement in self.placed:
                placement.rebind()  # before the client drops the old segments: an import reads them
        except BaseException as exc:
            self.dead = exc
            raise
        src.reconnect()
        self.bind()
        self.counts.rebinds += 1
        return True

    def close_holds(self) -> None:
        """Give back what the layer holds hold, their buffers and hold indexes; their counters
        go to the ledger."""
        holds, self._bound.holds = self._bound.holds, None
        if holds is None:
            return
        self.ledger.retire(holds)
        self._callback.set_holds(None)
        grant = holds.close()
        if grant is not None:
            self._release(grant)

    def place_on(self, placement: Placement, layers: list[int], stop: bytes | None = None) -> None:
        """`layers`' experts are made computable by `placement` (at load, before any decode);
        `stop`: their routed stop becomes `<stop><n>` (ggml_tensor.WEIGHTS_PREFIX, the only
        other stop: a placement that rewrites the ids after the routing weights were gathered
        by them). The holds are bound again, without these layers among their lane layers.
        The binding owns `placement` from the call on, whatever it raises: its `rebind` runs
        at each rebind, its `close` at `close_placed`."""
        bound = self._bound
        if not any(p is placement for p in self.placed):
            self.placed.append(placement)
        if stop not in (None, ggml_tensor.WEIGHTS_PREFIX):
            raise ValueError(f"a routed layer stops at its top-k or at {ggml_tensor.WEIGHTS_PREFIX!r}, not {stop!r}")
        for layer in layers:
            if layer not in bound.by_layer:
                raise ValueError(f"layer {layer} has no routed experts")
            bound.by_layer[layer] = placement
            if stop is not None:
                bound.weights_stops.add(layer)
        if bound.holds is not None:
            self.close_holds()
            self.bind()

    def close_placed(self) -> None:
        """Close every placement `place_on` was handed, after llama.cpp's model is freed and
        before the source's segments are unmapped (an import reads them)."""
        while self.placed:
            self.placed.pop().close()
