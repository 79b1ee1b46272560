"""Where an engine's routed experts come from: the `ExpertSource` interface and moed's.

What this module owns: the narrow interface the llama.cpp adapter needs from a
provider of expert bytes (extents per layer, acquire with piggybacked release,
release, and for every granted expert either a (segment, fd, offset) to map or an
address to copy from; prefetch and, optionally, `size_class(layer)` for the
look-ahead), and its implementation over the moed client.

Invariants:
- A `Grant` is valid from `acquire` until it is released (by `release` or by
  being passed as `release=` to the next acquire); its bytes do not change
  while it is held, and the engine reads them only in that window.
- The moed source never opens the model file for expert bytes: everything comes
  from the daemon's read-only segments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np

from moed.protocol.messages import PartExtent

if TYPE_CHECKING:
    from moed.client.local import LocalHits
    from moed.client.segments import Segment


class Grant(Protocol):
    layer: int
    experts: list[int]

    def mapping(self, expert: int, part: str) -> tuple[tuple[int, int], int, int]:
        """(segment key, fd, byte offset) of the expert's part, for a MAP_SHARED mapping."""

    def address(self, expert: int, part: str) -> int:
        """Address of the expert's part in this process's read-only view of it."""

    def slot(self, expert: int) -> int:
        """The daemon's slot holding the expert (every part at its part offset)."""


class ExpertSource(Protocol):
    files: list[str]
    moe_layers: list[int]
    n_experts: int
    n_expert_used: int

    def extents(self, layer: int) -> list[PartExtent]: ...

    def acquire(self, layer: int, experts: Sequence[int], release: Grant | None = None, local: bool = True) -> Grant:
        """Hold `experts` of `layer` (releasing `release`); `local=False`: the hit with no round
        trip was tried already for this layer and missed, so ask the daemon at once."""
        ...

    def release(self, grant: Grant) -> None: ...

    def capacity(self, layer: int) -> int | None:
        """Most experts of `layer` one acquire can ever hold (None: unknown)."""

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        """Read `experts` of `layer` ahead; never waits (needed only with prefetch on)."""

    def resident(self, layer: int, experts: Sequence[int]) -> np.ndarray:
        """Which of `experts` of `layer` are resident now, with no round trip (needed only
        with substitution on)."""

    def lane(self) -> LaneSource | None:
        """The source's hits for the lane layers (moed.engines.holds), or None: no lane
        layers, every layer goes through `acquire`."""


class LaneSource(Protocol):
    """What the layer holds take their hits through: the connection's local-hit state
    (region, residency table, slot states: moed/_hitproto.h) and each lane layer's slot
    segment. They ask the source for these and nothing else; never the client."""

    n_experts: int

    def local_hits(self) -> LocalHits | None:
        """The local-hit state, or None (local hits off: the holds map, the daemon grants)."""

    def layer_segment(self, layer: int) -> tuple[int, Segment]:
        """(size class, segment) of `layer`'s slots."""


class MoedGrant:
    """A moed `Lease` plus the segment its slots live in."""

    __slots__ = ("lease", "segment", "layer", "experts", "_seg_key")

    def __init__(self, lease, segment, seg_key: tuple[int, int]):
        self.lease = lease
        self.segment = segment
        self.layer = lease.layer
        self.experts = list(lease.experts)
        self._seg_key = seg_key

    def mapping(self, expert: int, part: str) -> tuple[tuple[int, int], int, int]:
        return self._seg_key, self.segment.fd, self.segment.part_offset(self.lease.slot(expert), part)

    def slot(self, expert: int) -> int:
        return self.lease.slot(expert)

    def address(self, expert: int, part: str) -> int:
        return self.segment.base + self.segment.part_offset(self.lease.slot(expert), part)


class MoedSource:
    """Experts served by a moed daemon through `moed.client`."""

    def __init__(
        self, client, model_path: str, timeout_s: float | None = None, expert_layout: str = "", compute: str = ""
    ):
        self.client = client
        self.model = client.open_model(model_path, expert_layout, compute)
        self.timeout_s = timeout_s
        self.files = list(self.model.files)
        self.moe_layers = list(self.model.moe_layers)
        self.n_experts = self.model.n_experts
        self.n_expert_used = self.model.n_expert_used
        self._layers = {l: self.model.layer(l) for l in self.moe_layers}

    def extents(self, layer: int) -> list[PartExtent]:
        """Where each part of the layer's experts lives: the wire's extents, as the daemon sent them."""
        return list(self._layers[layer].parts)

    def acquire(
        self, layer: int, experts: Sequence[int], release: Grant | None = None, local: bool = True
    ) -> MoedGrant:
        # Every grant a source is handed back is one it issued: a MoedGrant.
        prior = [cast(MoedGrant, release).lease] if release is not None else []
        lease = self.model.acquire(layer, list(experts), timeout_s=self.timeout_s, release=prior, local=local)
        return MoedGrant(lease, self.model.segment(lease.class_id), (self.model.model_id, lease.class_id))

    def release(self, grant: Grant) -> None:
        cast(MoedGrant, grant).lease.release()  # a grant this source issued

    def capacity(self, layer: int) -> int | None:
        return self.model.segment(self._layers[layer].class_id).info.capacity

    def size_class(self, layer: int) -> int:
        """The daemon's size class of the layer: layers of one class share its slots."""
        return self._layers[layer].class_id

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        self.model.prefetch(layer, list(experts))

    def resident(self, layer: int, experts: Sequence[int]) -> np.ndarray:
        return self.model.resident(layer, experts)

    def lane(self) -> MoedSource:
        return self  # a LaneSource: the client's local hits and segments

    def local_hits(self) -> LocalHits | None:
        return self.model.local_hits()

    def layer_segment(self, layer: int) -> tuple[int, Segment]:
        class_id = self._layers[layer].class_id
        return class_id, self.model.segment(class_id)
