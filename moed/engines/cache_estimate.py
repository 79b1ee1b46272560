"""Which experts are probably in the daemon's cache already: this engine's own LRU estimate of it.

What this module owns: an estimate, per size class, of the (layer, expert) keys
the daemon still holds, made from nothing but what this engine acquired and
prefetched. The look-ahead sends a prefetch only for the predicted experts the
estimate says are gone, so an engine whose experts all fit sends almost nothing
once warm, and a wrong prediction of a resident expert costs no message.

How: the daemon's default policy is one LRU over a size class's slots, so for a
single engine a key is resident exactly when fewer than the class's capacity of
distinct keys were touched since its last touch. The estimate is that LRU (the
daemon's own class, `moed.cache.eviction.LRU`), replayed on this engine's own
touches.

Invariants: the estimate only ever suppresses a prefetch; it never changes what
is acquired, so an error costs a demand read, never a wrong byte. It is wrong
when other engines share the budget (they evict what this engine still counts
resident) or the policy is not LRU; then prefetch falls back to demand reads for
those experts, no worse than prefetch off.
"""

from __future__ import annotations

from moed.cache.eviction import LRU


class CacheEstimate:
    def __init__(self, capacity_of, class_of):
        """`capacity_of(layer)`: slots of the layer's class (None: unknown); `class_of(layer)`: its class key."""
        self._capacity_of = capacity_of
        self._class_of = class_of
        self._lru: dict[object, LRU] = {}
        self._cap: dict[object, int | None] = {}

    def _class(self, layer: int) -> tuple[LRU, int | None]:
        key = self._class_of(layer)
        lru = self._lru.get(key)
        if lru is None:
            lru = self._lru[key] = LRU()
            self._cap[key] = self._capacity_of(layer)
        return lru, self._cap[key]

    def touch(self, layer: int, experts) -> None:
        """The daemon now holds `experts` of `layer` at its most recent end (acquired or prefetched)."""
        lru, cap = self._class(layer)
        if cap is None:
            return
        for e in experts:
            k = (layer, int(e))
            lru.remove(k)  # acquired (a no-op for a key it does not hold), then released
            lru.add(k)
        while len(lru) > cap:
            lru.remove(lru.victim())

    def missing(self, layer: int, experts):
        """The experts of `layer` (in their order) that the estimate does not hold."""
        lru, cap = self._class(layer)
        if cap is None:
            return experts
        return [e for e in experts if (layer, int(e)) not in lru]
