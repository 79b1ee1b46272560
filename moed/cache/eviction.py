"""Eviction policies over the evictable slots of the shared budget.

A policy sees only slots that may be evicted right now: READY, unreferenced and
not pinned. The store adds a slot when it becomes evictable (its last lease is
released, or a prefetch completes) and removes it when it is referenced again,
so `victim()` never returns a slot someone holds. Policies are pure: no I/O,
no clocks (time is the store's access counter).

These are the classes the daemon runs (`eviction_policy` in its config) and the
lab replays (`moed.lab.policies`: g-lru and lru are `LRU` itself), so a policy
studied in the lab is the one the daemon would serve. `LRU` orders any hashable
member; `DecayingLFU` scores members by their `.key` (a slot's expert).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from typing import Protocol


class EvictionPolicy(Protocol):
    name: str
    wants_touch: bool  # False: the store may skip touch() (LRU orders by release)

    def add(self, slot) -> None: ...
    def remove(self, slot) -> None: ...
    def victim(self): ...
    def candidates(self): ...  # every member, best victim first (quotas walk it)
    def touch(self, slot) -> None: ...
    def __contains__(self, slot) -> bool: ...
    def __len__(self) -> int: ...


class LRU:
    """One least-recently-used order over every evictable slot of every model.

    An OrderedDict keeps insertion order, so the first key is the least
    recently released slot; add/remove/victim are O(1). (A plain dict's first
    key is found by scanning past every entry deleted since its last resize:
    139 us a victim at 100,000 slots, against 0.3 us here.)
    """

    name = "lru"
    wants_touch = False

    def __init__(self):
        self._order: OrderedDict = OrderedDict()

    def add(self, slot) -> None:
        self._order[slot] = None

    def remove(self, slot) -> None:
        self._order.pop(slot, None)

    def touch(self, slot) -> None:
        """Called on every access (hit or load); LRU needs only add/remove order."""

    def victim(self):
        return next(iter(self._order), None)

    def candidates(self):
        """Members in eviction order; the caller must not change the policy while iterating."""
        return iter(self._order)

    def __contains__(self, slot) -> bool:
        return slot in self._order

    def __len__(self) -> int:
        return len(self._order)


class DecayingLFU:
    """Least-frequently-used with counts halved every `half_life` accesses.

    Scores are kept in the log domain with time folded in,
    `log2(count at t) + t / half_life`, so scores taken at different times
    compare correctly and never need rescaling. Victim lookup is a lazy heap;
    an entry is stale once its slot was touched again or left the policy.
    """

    name = "lfu"
    wants_touch = True

    def __init__(self, half_life: int = 64 * 8):
        self._half_life = half_life
        self._clock = 0
        self._score: dict = {}  # key -> log-domain score
        self._heap: list = []
        self._members: set = set()
        self._seq = 0
        self._prune_at = self.PRUNE_MIN

    # A key untouched for this many half-lives has a count below 2**-FORGET:
    # it is forgotten, so the table does not grow with every expert ever seen.
    FORGET_HALF_LIVES = 20
    PRUNE_MIN = 4096

    def touch(self, slot) -> None:
        self._clock += 1
        now = self._clock / self._half_life
        old = self._score.get(slot.key)
        decayed = 0.0 if old is None else 2.0 ** (old - now)
        self._score[slot.key] = math.log2(decayed + 1.0) + now
        if len(self._score) > self._prune_at:
            self._prune(now)

    def _prune(self, now: float) -> None:
        keep = {s.key for s in self._members}
        cutoff = now - self.FORGET_HALF_LIVES
        self._score = {k: v for k, v in self._score.items() if v >= cutoff or k in keep}
        self._prune_at = max(self.PRUNE_MIN, 2 * len(self._score))

    def add(self, slot) -> None:
        self._members.add(slot)
        self._seq += 1
        heapq.heappush(self._heap, (self._score.get(slot.key, 0.0), self._seq, slot))
        if len(self._heap) > 2 * len(self._members) + 64:
            self._compact()

    def _compact(self) -> None:
        """Keep one current entry per member.

        Only `victim` pops stale entries, so while every acquire hits (no
        evictions) each release would otherwise grow the heap for good.
        """
        members, score = self._members, self._score
        best: dict = {}
        for entry in self._heap:
            s = entry[2]
            if s in members and entry[0] == score.get(s.key, 0.0) and (s not in best or entry[1] < best[s][1]):
                best[s] = entry
        for s in [s for s in members if s not in best]:  # touched since pushed
            self._seq += 1
            best[s] = (score.get(s.key, 0.0), self._seq, s)
        self._heap = list(best.values())
        heapq.heapify(self._heap)

    def remove(self, slot) -> None:
        self._members.discard(slot)

    def victim(self):
        heap = self._heap
        while heap:
            score, _, slot = heap[0]
            if slot in self._members and score == self._score.get(slot.key, 0.0):
                return slot
            heapq.heappop(heap)
            if slot in self._members:  # touched since it was pushed
                self._seq += 1
                heapq.heappush(heap, (self._score.get(slot.key, 0.0), self._seq, slot))
        return None

    def candidates(self):
        """Members in eviction order (sorted now: O(n log n), only walked under quotas)."""
        return iter(sorted(self._members, key=lambda s: self._score.get(s.key, 0.0)))

    def __contains__(self, slot) -> bool:
        return slot in self._members

    def __len__(self) -> int:
        return len(self._members)


POLICIES = {"lru": LRU, "lfu": DecayingLFU}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose from {sorted(POLICIES)}") from None
