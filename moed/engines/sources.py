"""Where an engine's routed experts come from: the `ExpertSource` interface and moed's.

What this module owns: the narrow interface the llama.cpp adapter needs from a
provider of expert bytes, `ExpertSource` (extents per layer; one verb per step of a
layer: `acquire` with the earlier grant's release piggybacked, `release`, and `hit`,
the hit with no round trip, where the source has one; for every granted expert either
a (segment, fd, offset) to map or an address to copy from; the look-ahead's
`prefetch`, `capacity` and `size_class`; substitution's `resident`), with a default
for every optional step, and its implementation over the moed client.

Invariants:
- A `Grant` is valid from the `acquire` (or the `hit`) that returned it until it is
  released (by `release`, or by being passed as `release=` to the next acquire or
  hit); its bytes do not change while it is held, and the engine reads them only in
  that window.
- A grant, segment or hit state belongs to one `generation` of the source's
  connection; once it changes (the daemon died and the client reconnected) the engine
  reads none of them again, and releasing an old grant sends nothing to the new daemon.
- `hit` changes nothing when it returns None: `release` is still held, for the
  acquire that follows.
- The moed source never opens the model file for expert bytes: everything comes
  from the daemon's read-only segments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np

from moed.gguf.layouts import PLAIN
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


class ExpertSource:
    """Where a streamed engine's routed experts come from: one verb per step of a layer.

    A source says what it serves (`files`, `moe_layers`, `n_experts`, `n_expert_used`,
    `extents`) and holds experts for the engine: `acquire` (ask the provider, the
    earlier grant released in the same step), `release`, and, where the source has
    hits with no round trip, `hit` (the hit only: a grant, or None and nothing changed).
    A subclass implements `extents`, `acquire` and `release`; every other method has a
    default here that says what an engine does without it, so the engine never asks
    whether a source has a method.
    """

    files: list[str]
    moe_layers: list[int]
    n_experts: int
    n_expert_used: int
    # The layout of the experts' bytes the source serves (moed.gguf.layouts): the file's own.
    expert_layout: str = PLAIN
    # Whether `resident` reads what the source holds now (substitution needs that).
    tells_residency: bool = False

    def extents(self, layer: int) -> list[PartExtent]:
        """Where each part of `layer`'s experts lives in the model's files."""
        raise NotImplementedError

    def acquire(self, layer: int, experts: Sequence[int], release: Grant | None = None) -> Grant:
        """Hold `experts` of `layer`, asking the provider (no hit tried here: `hit` is that
        step); `release`, the earlier grant, is released in the same step."""
        raise NotImplementedError

    def release(self, grant: Grant) -> None:
        """Let `grant` go: the engine reads none of its bytes any more."""
        raise NotImplementedError

    def hit(self, layer: int, experts: Sequence[int], release: Grant | None = None) -> Grant | None:
        """Hold `experts` of `layer` with no round trip when every one is resident (releasing
        `release`), else None with nothing changed. Default: no such hits."""
        return None

    def capacity(self, layer: int) -> int | None:
        """Most experts of `layer` one acquire can ever hold (default None: unknown)."""
        return None

    def size_class(self, layer: int) -> object:
        """Which layers share their slots (the look-ahead's cache estimate keeps one LRU a
        class). Default: layers of one capacity share them."""
        return self.capacity(layer)

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        """Read `experts` of `layer` ahead; never waits. Default: a hint dropped."""

    def resident(self, layer: int, experts: Sequence[int]) -> np.ndarray:
        """Which of `experts` of `layer` are resident now, with no round trip. Default: none
        known (`tells_residency` False)."""
        return np.zeros(len(experts), dtype=bool)

    def lane(self) -> LaneSource | None:
        """The source's hits for the lane layers (moed.engines.holds), or None (default): no
        lane layers, every layer goes through `hit` and `acquire`."""
        return None

    def report_device(self, counters: dict) -> None:
        """Tell the provider what the engine's device slots did (DeviceReport's fields: slots,
        layers, hits, uploads, upload_bytes, evictions, zero_copy; totals since the engine
        started); never waits, never errors back. Default: nobody to tell."""

    def generation(self) -> int:
        """Which connection to the provider the grants, segments and hit state come through
        now: the engine binds again when it changes (ExpertStreamer.ensure_bound). Default 0:
        one, forever."""
        return 0

    def connected(self) -> bool:
        """Whether that connection is up as far as can be told without a round trip (checked
        before every decode, so it must cost next to nothing). Default True."""
        return True

    def reconnect(self) -> None:
        """Make the connection live again if it was lost (bounded: DaemonUnavailable when the
        provider does not come back), every grant of the old one void. Default: nothing."""


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


class MoedSource(ExpertSource):
    """Experts served by a moed daemon through `moed.client`."""

    tells_residency = True  # the connection's residency table

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
        self.expert_layout = self.model.expert_layout
        self._layers = {l: self.model.layer(l) for l in self.moe_layers}
        # The connection the engine is bound to: grants come from it or not at all (a lost one is
        # reconnected between decodes, by `reconnect`, never inside one).
        self._gen = client.generation

    def extents(self, layer: int) -> list[PartExtent]:
        """Where each part of the layer's experts lives: the wire's extents, as the daemon sent them."""
        return list(self._layers[layer].parts)

    def acquire(self, layer: int, experts: Sequence[int], release: Grant | None = None) -> MoedGrant:
        lease = self.model.acquire(
            layer,
            list(experts),
            timeout_s=self.timeout_s,
            release=self._prior(release),
            local=False,
            generation=self._gen,
        )
        return self._grant(lease)

    def hit(self, layer: int, experts: Sequence[int], release: Grant | None = None) -> MoedGrant | None:
        lease = self.model.hit(layer, list(experts), release=self._prior(release), generation=self._gen)
        return self._grant(lease) if lease is not None else None

    @staticmethod
    def _prior(release: Grant | None) -> list:
        # Every grant a source is handed back is one it issued: a MoedGrant.
        return [cast(MoedGrant, release).lease] if release is not None else []

    def _grant(self, lease) -> MoedGrant:
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

    def report_device(self, counters: dict) -> None:
        self.model.report_device(**counters)

    def generation(self) -> int:
        return self.client.generation

    def connected(self) -> bool:
        return self._gen == self.client.generation and self.client.alive()

    def reconnect(self) -> None:
        """The client reconnects within its `reconnect_s` and re-opens the model (module
        moed.client.client); the layers' size classes are read again (they may differ)."""
        self.client.ensure_connected()
        self._layers = {l: self.model.layer(l) for l in self.moe_layers}
        self._gen = self.client.generation

    def local_hits(self) -> LocalHits | None:
        return self.model.local_hits()

    def layer_segment(self, layer: int) -> tuple[int, Segment]:
        class_id = self._layers[layer].class_id
        return class_id, self.model.segment(class_id)
