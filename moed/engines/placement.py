"""Where a layer's granted experts are made computable: the engine's placement seam.

What this module owns: the `Placement` interface the per-layer cycle
(moed.engines.streamer) calls once it holds a layer's grant; its CPU implementation,
`CpuPages`: the experts shown at their own addresses in llama.cpp's mapping of the model
(moed.engines.expert_pages); the lane layers' addresses are mapped by the layer holds
alone (moed.engines.holds: when they take a hit, or in the same call that hands them
Python's grant), so `show` leaves those layers to them; and the builder of the device
placement (`build_device`): the offloaded layers' experts computed on the GPU, by copied
slots (moed.engines.device_slots) or zero copy (moed.engines.device_host), both
moed.engines.device_placement's `DevicePlacement`. A layer's placement is chosen at
load, by where that layer's experts compute, and never changes.

Invariants (the cycle keeps them; each placement relies on them):
- At a routed stop the layer holds go first (a lane layer's hit, in C); when they
  leave the layer to Python, the cycle asks `to_acquire(layer, ids)` which experts to
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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from moed.engines.device_host import HostImportUnavailable, ZeroCopyPlacement
from moed.engines.device_placement import DevicePlacement
from moed.engines.device_probe import ModelTensors, probe
from moed.engines.device_slots import SlotPlacement
from moed.engines.devices import Offload
from moed.engines.expert_pages import ExpertPages, PartSpan
from moed.engines.ggml_tensor import WEIGHTS_PREFIX
from moed.engines.sources import ExpertSource, Grant
from moed.gguf.layouts import PLAIN

if TYPE_CHECKING:
    from moed.engines.device_lru import SlotLru
    from moed.engines.holds import LayerHolds


class Placement(Protocol):
    # When a layer's grant may go: True, once `show` returned (it copied what the layer's
    # matmuls read: the cycle releases the grant at once); False, at the next routed stop
    # (the matmuls read the granted slots in place, and have run by then).
    copies_grant: bool

    def lru(self, layer: int) -> SlotLru | None:
        """The layer's device LRU, whose full hits the layer holds take in C (None: none)."""

    def to_acquire(self, layer: int, ids: np.ndarray) -> list[int]:
        """The experts of the batch's `ids` ((n_tokens, k), as routed) to acquire from moed."""

    def show(self, grant: Grant | None, node: int | None, layer: int) -> None:
        """Make the layer's routed experts computable (`grant`: what `to_acquire` named, None when
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

    def rebind(self) -> None:
        """The daemon came back (the binding's `ensure_bound`), before the source drops the old
        segments; raises where this placement cannot go on over a new daemon."""

    def close(self) -> None:
        """Free what the placement allocated: after llama.cpp's model is freed, before the
        source's segments are unmapped. Idempotent."""


class CpuPages:
    """The CPU placement: each expert at its own address in the model's mapping.

    Zero-copy layers map the daemon's slot pages there, other layers copy; the lane
    layers (relaxed zero copy) are mapped by the layer holds alone and stay mapped to
    their last slot when released, so a repeated hit costs no syscall.
    """

    copies_grant = False  # the CPU's matmuls read the pages after the stop (copied or mapped)

    def __init__(self, pages: ExpertPages, parts: dict[int, list[PartSpan]], holds: LayerHolds | None = None):
        self.pages = pages
        self.parts = parts
        self.holds = holds
        self.holds_layers: set[int] = holds.layers if holds is not None else set()
        # Relaxed mode on all-zero-copy layers: hiding leaves them mapped (ExpertPages' rule).
        self.relaxed_layers = (
            set() if pages.strict else {layer for layer, ss in parts.items() if all(s.zero_copy for s in ss)}
        )

    def lru(self, layer: int) -> SlotLru | None:
        return None

    def to_acquire(self, layer: int, ids: np.ndarray) -> list[int]:
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
        if self.holds is not None:  # the lane layers read zeros now, PROT_NONE after: map them again
            self.holds.forget()

    def skip(self, layer: int, topk: int) -> None:
        """Every expert reads zeros already (failed): the ids index the model's own tensor."""

    def end_decode(self) -> None:
        self.pages.close_zeros()  # after a failure under an offload: every expert hidden again

    def rebind(self) -> None:
        """Nothing: the binding builds a new CpuPages over the new holds."""

    def close(self) -> None:
        """Nothing: the pages are the mapping's (moed.engines.mapping), the holds the binding's."""

    def stats(self) -> dict[str, Any]:
        out = {f"pages_{k}": v for k, v in vars(self.pages.stats).items()}
        if self.holds is not None:
            out["pages_maps"] += self.holds.stats().maps  # the holds map the lane layers
        return out


# ---------------------------------------------------------------------- the device placement, built


@dataclass(frozen=True)
class DeviceBuild:
    """What `build_device` built: the placement, the layers it computes and their stop
    nodes (layer L stops at `<stop>L`). The placement owns what it allocated until its
    `close()`, which must run after llama.cpp's model is freed and before the source's
    segments are unmapped: the streamer's `place_on` takes that over (its `close` at the
    streamer's, its `rebind` at a rebind); until then the builder's caller closes it."""

    placement: DevicePlacement
    layers: list[int]
    stop: bytes


def build_device(model: int, source: ExpertSource, offload: Offload | None, zero_copy: bool) -> DeviceBuild | None:
    """The device placement of a loaded model's offloaded layers, or None without one
    (no offload, or `offload.gpu_slots` 0: their experts stay the CPU's). Between
    llama.cpp's model and its context: the expert tensors are found by a probe context and
    switched now. `zero_copy`: moed's segments imported into the device
    (moed.engines.device_host), else copied slots (moed.engines.device_slots). What the
    source serves is checked against the model before anything is allocated."""
    if offload is None or not offload.gpu_slots:
        return None
    found = probe(model)
    n = offload.gpu_slots
    placement: DevicePlacement
    if zero_copy:
        _check_zero_copy(source, n)
        placement = ZeroCopyPlacement(found, source, n)
    else:
        _check_copies(found, source, n)
        placement = SlotPlacement(found, n)
    return DeviceBuild(placement, placement.layers, WEIGHTS_PREFIX)


def _check_zero_copy(source: ExpertSource, n: int) -> None:
    if source.expert_layout != PLAIN:
        raise HostImportUnavailable(
            f"gpu_zero_copy: moed serves this model's experts in the {source.expert_layout} layout; the device "
            "reads the plain one in place"
        )
    if n < source.n_expert_used:
        raise ValueError(f"gpu_slots={n}: one token routes to {source.n_expert_used} experts a layer")


def _check_copies(found: ModelTensors, source: ExpertSource, n: int) -> None:
    """Each slot layer's parts are the bytes moed serves, and its slots hold a token's experts."""
    for layer in found.device_layers():
        served = {e.part: e.bytes_per_expert for e in source.extents(layer)}
        if found.part_bytes(layer) != served:
            raise RuntimeError(f"layer {layer}: device slot parts {found.part_bytes(layer)} but moed serves {served}")
        slots = min(n, found.n_expert(layer))
        if slots < source.n_expert_used:
            raise ValueError(
                f"gpu_slots={n}: layer {layer} has {slots} slots, one token routes to {source.n_expert_used} experts"
            )


__all__ = ["CpuPages", "DeviceBuild", "Placement", "build_device"]
