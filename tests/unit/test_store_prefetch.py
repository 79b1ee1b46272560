"""Prefetch in the pure store: wasted prefetches, cancellation, and a resident
key refreshed by a prefetch so it is not the next victim.

Slots are 100 bytes (one class); the budget says how many fit.
"""

from __future__ import annotations

import pytest

from moed.cache.store import ExpertKey, SlotState, Store, Want

SLOT = 100


def make_store(slots: int) -> Store:
    store = Store(slots * SLOT)
    store.add_class(1, SLOT, slots)
    return store


def want(expert: int) -> Want:
    return Want(ExpertKey(0, 0, expert), 1)


def load(store: Store, expert: int) -> None:
    """Acquire, finish the read, release: the expert is resident and evictable."""
    plan = store.acquire([want(expert)])
    for s in plan.to_load:
        store.loaded(s)
    for s, g in zip(plan.slots, plan.generations):
        store.release(s, g)


def test_a_prefetch_evicted_before_use_is_wasted_once():
    store = make_store(2)
    p = store.prefetch(want(0))
    store.loaded(p)
    load(store, 1)
    load(store, 2)  # evicts the unused prefetch (least recent)
    assert ExpertKey(0, 0, 0) not in store.table
    assert store.wasted_prefetches == 1
    load(store, 3)  # evicts expert 1, which was never prefetched
    assert store.wasted_prefetches == 1


def test_a_used_prefetch_is_not_wasted_when_evicted_later():
    store = make_store(1)
    p = store.prefetch(want(0))
    store.loaded(p)
    plan = store.acquire([want(0)])
    assert store.use_prefetched(plan.slots[0])
    store.release(plan.slots[0], plan.generations[0])
    load(store, 1)
    assert store.wasted_prefetches == 0


def test_cancel_returns_the_slot_and_counts_it_wasted():
    store = make_store(2)
    p = store.prefetch(want(0))
    store.cancel_prefetch(p)
    assert p.state == SlotState.EMPTY and store.used_bytes == 0
    assert store.take_dropped() == [p]
    assert store.wasted_prefetches == 1
    assert store.prefetch(want(0)) is not None  # can be asked for again


def test_only_an_unreferenced_loading_prefetch_can_be_cancelled():
    store = make_store(2)
    p = store.prefetch(want(0))
    plan = store.acquire([want(0)])  # a demand read joined it
    assert plan.loading == [p]
    with pytest.raises(ValueError):
        store.cancel_prefetch(p)
    store.loaded(p)
    with pytest.raises(ValueError):
        store.cancel_prefetch(p)


def test_prefetch_of_a_resident_key_makes_it_recent():
    store = make_store(2)
    load(store, 0)
    load(store, 1)  # LRU order: 0, 1
    assert store.prefetch(want(0)) is None
    load(store, 2)  # the victim is now 1, not the re-wanted 0
    assert ExpertKey(0, 0, 0) in store.table and ExpertKey(0, 0, 1) not in store.table
    assert store.wasted_prefetches == 0
