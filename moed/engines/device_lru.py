"""The device slots' policy: which expert each of a layer's S device slots holds, and which slot goes next.

What this module owns: one layer's least-recently-used table over its device slots
(`SlotLru`), the full hit (`full_hit`: the batch's ids turned into slot ids with no
upload), and the choice of slots for the experts a batch misses (`admit`). It moves no
byte: the transfer into the slots is the copying placement's (moed.engines.device_slots),
which commits each expert here once its bytes are on the device (`assign`).

The layout, one layer's state in four numpy arrays (so that C can take the full hit
over these very arrays, issue 48 item 4; `full_hit` is written to map one to one onto it):
- `slot_of_expert` int32[n_expert]: the slot holding expert e, -1 where none does;
- `expert_of_slot` int32[S]: the expert slot s holds, -1 where it is free;
- `last_use` int64[S]: the layer's clock at slot s's last use (0: never used);
- `clock` int64[2]: [0] the layer's clock, which ticks once for each distinct expert a
  batch uses, in ascending expert order, its hits first, then its uploads; [1] the hits
  (the distinct experts of a batch that were in a slot already), summed over batches.

Invariants:
- `slot_of_expert[e] == s >= 0` exactly when `expert_of_slot[s] == e`.
- A slot the batch in flight uses is never chosen for another expert (`admit` leaves
  the batch's hits out; they have the newest stamps anyway).
- An expert enters the table only once all its bytes are on the device (`assign`); a
  slot chosen and not filled is free (`admit` empties it, before the transfer).
- Free slots go first, then the least recently used: the same victims as an ordered
  dict of expert -> slot, oldest first, with the batch's hits moved last in ascending
  order and its uploads appended after them.
"""

from __future__ import annotations

import numpy as np


class SlotLru:
    """One layer's table of which expert each of its `n_slots` device slots holds."""

    def __init__(self, n_expert: int, n_slots: int):
        self.slot_of_expert = np.full(n_expert, -1, np.int32)
        self.expert_of_slot = np.full(n_slots, -1, np.int32)
        self.last_use = np.zeros(n_slots, np.int64)
        self.clock = np.zeros(2, np.int64)  # [0] the clock, [1] the hits

    @property
    def n_expert(self) -> int:
        return len(self.slot_of_expert)

    @property
    def n_slots(self) -> int:
        return len(self.expert_of_slot)

    @property
    def hits(self) -> int:
        return int(self.clock[1])

    def resident(self) -> list[int]:
        """The experts in the slots, least recently used first."""
        held = np.flatnonzero(self.expert_of_slot >= 0)
        return self.expert_of_slot[held[np.argsort(self.last_use[held], kind="stable")]].tolist()

    def touch(self, experts: np.ndarray) -> None:
        """`experts` (sorted, distinct, all in a slot) used by a batch: stamped, counted as hits."""
        self.stamp(self.slot_of_expert[experts])

    def stamp(self, slots: np.ndarray) -> None:
        """The slots of a batch's hits, in ascending expert order: a tick each, counted."""
        start, n = int(self.clock[0]), len(slots)
        self.last_use[slots] = np.arange(start + 1, start + 1 + n)
        self.clock[0] = start + n
        self.clock[1] += n

    def misses(self, want: np.ndarray) -> list[int]:
        """Which of `want` (sorted, distinct, in range) no slot holds."""
        return want[self.slot_of_expert[want] < 0].tolist()

    def admit(self, want: np.ndarray) -> tuple[list[int], list[int], int]:
        """A batch's experts `want` (sorted, distinct, in range, at most the slots): its hits
        stamped and counted, then a slot chosen for each miss and emptied now (the caller
        fills it and `assign`s it, or leaves it free). Returns the misses, their slots and
        how many of those slots held an expert (evictions)."""
        misses = self.misses(want)
        hits = np.setdiff1d(want, misses, assume_unique=True)
        self.touch(hits)  # first: the batch's own hits are the newest, never its victims
        slots, evicted = self._victims(len(misses), self.slot_of_expert[hits])
        return misses, slots, evicted

    def _victims(self, n: int, in_use: np.ndarray) -> tuple[list[int], int]:
        """`n` slots, none of `in_use`: free ones first, then the least recently used; emptied."""
        never = np.iinfo(np.int64).max
        key = np.where(self.expert_of_slot < 0, -1, self.last_use)
        key[in_use] = never
        slots = np.argsort(key, kind="stable")[:n]
        if len(slots) < n or (key[slots] == never).any():
            raise RuntimeError(f"{n} experts for {self.n_slots} slots, {len(in_use)} of them in use")
        old = self.expert_of_slot[slots]
        self.slot_of_expert[old[old >= 0]] = -1
        self.expert_of_slot[slots] = -1
        return slots.tolist(), int((old >= 0).sum())

    def assign(self, expert: int, slot: int) -> None:
        """`expert`'s bytes are all in `slot` now: it is the slot's, stamped as just used."""
        self.clock[0] += 1
        self.slot_of_expert[expert] = slot
        self.expert_of_slot[slot] = expert
        self.last_use[slot] = self.clock[0]


def full_hit(lru: SlotLru, ids: np.ndarray) -> np.ndarray | None:
    """The slot ids for a batch's `ids` ((n_rows, k) expert ids) when every expert they name
    is in a slot (stamped and counted as hits), else None with nothing changed: an id out of
    range or in no slot is a miss, for the caller's slow path (which raises on a bad id).

    The C to come (issue 48 item 4), over the same arrays: for each id, fail on one out of
    [0, n_expert) or with slot_of_expert[id] < 0, and mark it seen; then for e in 0..n_expert
    seen, ++clock[0], ++clock[1], last_use[slot_of_expert[e]] = clock[0]; then write
    slot_of_expert[id] for each id. (Python's set over the ids, not np.unique: a decode's
    few ids cost a third as much so; measured.)"""
    want = sorted(set(ids.ravel().tolist()))  # the distinct experts, ascending
    if want and (want[0] < 0 or want[-1] >= lru.n_expert):
        return None
    slots = lru.slot_of_expert[want]
    if want and slots.min() < 0:
        return None
    lru.stamp(slots)
    return lru.slot_of_expert[ids]


__all__ = ["SlotLru", "full_hit"]
