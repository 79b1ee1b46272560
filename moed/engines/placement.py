"""Where a layer's granted experts are made computable: the engine's placement seam.

What this module owns: the `Placement` interface the per-layer cycle
(moed.engines.streamer) calls once it holds a layer's grant, and its CPU
implementation, `CpuPages`: the experts shown at their own addresses in llama.cpp's
mapping of the model (moed.engines.expert_pages); the lane layers' addresses are mapped
by the layer holds alone (moed.engines.holds: when they take a hit, or in the same call
that hands them Python's grant), so `show` leaves those layers to them. Device expert slots
(moed.engines.device_slots) are the second implementation: a layer's placement is
chosen at load, by where that layer's experts compute, and never changes.

Invariants (the cycle keeps them; each placement relies on them):
- At a routed stop the layer holds go first (a lane layer's hit, in C); when they
  leave the layer to Python, the cycle asks `needs(layer, ids)` which experts to
  acquire (the CPU: every distinct expert; device slots: those no slot holds, none on
  a full hit), acquires exactly those (no acquire, and no grant, when none), hands the
  grant to the layer holds (which own it from then on and hand it back for its
  release), then calls `show(grant, node, layer)` before any expert matmul of that
  layer reads; `node` is the layer's top-k node.
- `hide(grant)` runs before the grant is released: once the daemon may reuse a slot,
  nothing computes from it.
- `failed()` runs once when a decode has failed while a device computes part of the
  graph: whatever expert matmul still runs before llama_decode returns must read
  mapped memory (no signal); `skip(layer, topk)` then runs at each later routed stop
  of that decode, so a placement that remaps ids keeps every id in range.
  `end_decode()` runs after every decode, failed or not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from moed.engines.expert_pages import ExpertPages, PartSpan
from moed.engines.sources import Grant

if TYPE_CHECKING:
    from moed.engines.holds import LayerHolds


class Placement(Protocol):
    def needs(self, layer: int, ids: np.ndarray) -> list[int]:
        """The experts of the batch's `ids` ((n_tokens, k), as routed) to acquire from moed."""

    def show(self, grant: Grant | None, node: int | None, layer: int) -> None:
        """Make the layer's routed experts computable (`grant`: what `needs` named, None when
        it named none; `node`: the layer's top-k node, or None outside a graph)."""

    def hide(self, grant: Grant) -> None:
        """Before `grant` is released: nothing may compute from its slots any more."""

    def failed(self) -> None:
        """The decode failed under an offload: later expert matmuls must read mapped memory."""

    def skip(self, layer: int, topk: int) -> None:
        """A routed stop after the decode failed: nothing acquired, ids must stay in range."""

    def end_decode(self) -> None:
        """After llama_decode returned (also when it failed)."""

    def stats(self) -> dict[str, Any]:
        """This placement's counters, for stream_stats."""


class CpuPages:
    """The CPU placement: each expert at its own address in the model's mapping.

    Zero-copy layers map the daemon's slot pages there, other layers copy; the lane
    layers (relaxed zero copy) are mapped by the layer holds alone and stay mapped to
    their last slot when released, so a repeated hit costs no syscall.
    """

    def __init__(self, pages: ExpertPages, parts: dict[int, list[PartSpan]], holds: LayerHolds | None = None):
        self.pages = pages
        self.parts = parts
        self.holds = holds
        self.holds_layers: set[int] = holds.layers if holds is not None else set()
        # Relaxed mode on all-zero-copy layers: hiding leaves them mapped (ExpertPages' rule).
        self.relaxed_layers = (
            set() if pages.strict else {layer for layer, ss in parts.items() if all(s.zero_copy for s in ss)}
        )

    def needs(self, layer: int, ids: np.ndarray) -> list[int]:
        return [int(e) for e in np.unique(ids) if e >= 0]

    def show(self, grant: Grant | None, node: int | None = None, layer: int = -1) -> None:
        if grant is None or grant.layer in self.holds_layers:
            return  # no grant: no expert routed; a lane layer: the holds mapped it as they took it
        pages = self.pages
        for span in self.parts[grant.layer]:
            for expert in grant.experts:
                if span.zero_copy:
                    key, fd, offset = grant.mapping(expert, span.part)
                    pages.show_mapped(span, expert, key, fd, offset)
                else:
                    pages.show_copied(span, expert, grant.address(expert, span.part))

    def hide(self, grant: Grant) -> None:
        if grant.layer in self.relaxed_layers:
            return  # relaxed mode leaves zero-copy experts mapped to their last slot
        for span in self.parts[grant.layer]:
            for expert in grant.experts:
                self.pages.hide(span, expert)

    def failed(self) -> None:
        self.pages.open_zeros()

    def skip(self, layer: int, topk: int) -> None:
        """Every expert reads zeros already (failed): the ids index the model's own tensor."""

    def end_decode(self) -> None:
        self.pages.close_zeros()  # after a failure under an offload: every expert hidden again

    def stats(self) -> dict[str, Any]:
        out = {f"pages_{k}": v for k, v in vars(self.pages.stats).items()}
        if self.holds is not None:
            out["pages_maps"] += self.holds.stats().maps  # the holds map the lane layers
        return out


__all__ = ["CpuPages", "Placement"]


class DevicePlacement:
    """The common part of the device placements (moed.engines.device_slots' slots and
    moed.engines.device_host's zero copy): the ids `needs` was given, kept for `show` of the
    same layer; `hide` and `failed` do nothing (a device layer's matmuls read memory that
    stays mapped whatever failed, and have run before the grant is released); `skip`
    keeps a failed decode's ids in range. A subclass says what a layer must acquire
    (`_needed`) and routes the ids (`_route`)."""

    what = "a device placement"  # names the placement in its errors

    def __init__(self, slots: Any):
        self.slots = slots
        self._ids: tuple[int, np.ndarray] | None = None  # (layer, ids) named by needs, for show

    def needs(self, layer: int, ids: np.ndarray) -> list[int]:
        """The experts of the batch's `ids` ((n_tokens, k), read at the stop) to acquire."""
        self._ids = (layer, ids)
        return self._needed(layer, ids)

    def show(self, grant: Grant | None, node: int | None, layer: int | None = None) -> None:
        layer = grant.layer if grant is not None else layer
        if layer is None or node is None:
            raise ValueError(f"{self.what} needs the layer's top-k node (and the layer, without a grant)")
        ids, self._ids = (self._ids[1] if self._ids is not None and self._ids[0] == layer else None), None
        self._route(layer, node, grant, ids)

    def hide(self, grant: Grant) -> None:
        """Nothing: the device has what it reads before the grant is released."""

    def failed(self) -> None:
        """Nothing: a device layer's matmuls read memory that stays mapped whatever failed."""

    def skip(self, layer: int, topk: int) -> None:
        self._ids = None
        self.slots.skip(layer, topk)

    def end_decode(self) -> None:
        self._ids = None

    def stats(self) -> dict[str, Any]:
        return {"gpu_slots": self.slots.totals()}

    def _needed(self, layer: int, ids: np.ndarray) -> list[int]:
        raise NotImplementedError

    def _route(self, layer: int, node: int, grant: Grant | None, ids: np.ndarray | None) -> None:
        raise NotImplementedError
