"""The cache model's records: expert keys, slots, size classes, wants and plans.

Plain data, no behaviour beyond a size class handing out its EMPTY slots; the
store (moed.cache.store) owns every change of state and keeps the invariants
its docstring states. A `Slot` is one slot of one size class: its index and
bytes never change, its residency (`key`, `state`, `generation`, `refs`,
`owner`) is the store's to set.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple


class ExpertKey(NamedTuple):
    model_id: int
    layer: int
    expert: int


class SlotState(enum.IntEnum):
    EMPTY = 0
    LOADING = 1
    READY = 2


READY = SlotState.READY


@dataclass(eq=False, slots=True)
class Slot:
    class_id: int
    index: int
    slot_bytes: int
    state: SlotState = SlotState.EMPTY
    key: ExpertKey | None = None
    refs: int = 0
    pinned: bool = False
    unpin_pending: bool = False  # unpinned while held or loading: leaves the partition when free
    adopted: bool = False  # held locally when eviction was tried: one reference is the store's
    generation: int = 0
    prefetched: bool = False  # loaded by a prefetch, not yet used by a lease
    owner: object = None  # tenant charged for the residency (quotas, stats)


@dataclass(eq=False)
class SlotClass:
    class_id: int
    slot_bytes: int
    capacity: int
    # Slots are made on first use: a class's capacity is what the whole budget
    # could hold of it (millions for tiny experts), not what it ever holds.
    slots: dict[int, Slot] = field(default_factory=dict)
    free: list[int] = field(default_factory=list)  # indexes of made slots that are EMPTY

    def take_free(self) -> Slot | None:
        """An EMPTY slot (index 0 first), or None when every index is in use."""
        if self.free:
            return self.slots[self.free.pop()]
        if len(self.slots) >= self.capacity:
            return None
        slot = self.slots[len(self.slots)] = Slot(self.class_id, len(self.slots), self.slot_bytes)
        return slot


class Want(NamedTuple):
    key: ExpertKey
    class_id: int


@dataclass(slots=True)
class Plan:
    """The outcome of a successful acquire: one slot per wanted key, in order."""

    slots: list[Slot]
    generations: list[int]
    to_load: list[Slot]  # this acquire must start their reads
    loading: list[Slot]  # someone else's read is in flight; wait for it
    hits: int
    misses: int
