"""The daemon's residency tables without a daemon: publish, claim, retire (moed.daemon.residency)."""

from __future__ import annotations

import mmap
import os

import pytest

from moed import _holds
from moed.cache.store import ExpertKey, Slot, SlotState
from moed.daemon.residency import Residency
from moed.protocol import residency_words as rz


def ready_slot(model_id: int, layer: int, expert: int, index: int = 3, generation: int = 5) -> Slot:
    slot = Slot(class_id=1, index=index, slot_bytes=4096)
    slot.key, slot.state, slot.generation = ExpertKey(model_id, layer, expert), SlotState.READY, generation
    return slot


def one_published() -> tuple[Residency, Slot]:
    """A residency with model 7's expert (0, 2) published in slot 3 at generation 5."""
    res = Residency()
    res.add_class(1, capacity=8)
    res.add_model(7, layers=[0], n_experts=4)
    slot = ready_slot(7, 0, 2)
    res.publish(slot)
    return res, slot


def client_region(res: Residency, session) -> mmap.mmap:
    """`session`'s hold region, mapped as its client maps it."""
    fd = res.open_region(session)
    region = mmap.mmap(fd, rz.REGION_WORDS * 8)
    os.close(fd)
    return region


def test_publish_claim_unclaim_round_trip():
    res = Residency()
    res.add_class(1, capacity=8)
    res.add_model(7, layers=[0, 2], n_experts=4)
    slot = ready_slot(7, 2, 1)
    res.publish(slot)
    word = 1 * 4 + 1  # layer 2 is the model's second MoE layer
    assert _holds.load(res.tables[7].map, word) == rz.entry(5, 3)
    assert _holds.load(res.states[1].map, 3) == rz.state(5, rz.READY)
    assert res.claim(slot)  # nobody holds it
    assert _holds.load(res.tables[7].map, word) == 0
    assert _holds.load(res.states[1].map, 3) == rz.state(5, rz.EVICTING)
    res.unclaim(slot)  # kept after all: visible again
    assert _holds.load(res.tables[7].map, word) == rz.entry(5, 3)
    res.close()


def test_a_held_slot_is_refused_and_put_back():
    res, slot = one_published()
    session = object()
    region = client_region(res, session)
    _holds.store(region, rz.HOLD_BASE + 10, rz.hold(1, 3, 5))
    assert not res.claim(slot) and res.claims_refused == 1
    assert _holds.load(res.states[1].map, 3) == rz.state(5, rz.READY)
    _holds.store(region, rz.HOLD_BASE + 10, 0)
    assert res.claim(slot)
    region.close()
    res.close_region(session)
    res.close()


def test_a_read_finishing_after_its_model_retired_is_not_published():
    res = Residency()
    res.add_class(1, capacity=8)
    res.add_model(7, layers=[0], n_experts=4)
    res.retire_model(7)
    res.publish(ready_slot(7, 0, 1))
    assert _holds.load(res.tables[7].map, 1) == 0
    assert _holds.load(res.states[1].map, 3) == 0
    res.close()


def test_a_revoked_region_counts_until_its_holds_clear_or_the_grace_ends():
    from moed.daemon.bounds import REVOKE_GRACE_S

    res, slot = one_published()
    sessions = [object(), object()]
    regions = [client_region(res, s) for s in sessions]
    for region in regions:
        _holds.store(region, rz.HOLD_BASE, rz.hold(1, 3, 5))
    res.revoke(sessions[0], now_s=100.0)
    res.revoke(sessions[1], now_s=100.0)
    assert _holds.load(regions[0], rz.W_CLOSED) == 1 and set(res.revoked) == set(sessions)
    assert not res.claim(slot)  # still held: the revoked client may be reading it
    assert res.holders(1, 3, 5) == []  # closed already: nobody to close again
    _holds.clear(regions[0], [rz.HOLD_BASE])  # the first releases
    assert res.sweep_revoked(100.5) == [] and list(res.revoked) == [sessions[1]]
    assert not res.claim(slot)
    assert res.sweep_revoked(100.0 + REVOKE_GRACE_S) == [(sessions[1], 1)]  # hung: it stops counting
    assert res.revoked == {} and res.claim(slot)
    for r in regions:
        r.close()
    res.close()


def test_a_revoked_region_holding_only_garbage_ends_at_once_and_an_owner_keeps_few():
    res, _ = one_published()
    maps = []

    def region_with(word: int):
        session = object()
        maps.append(client_region(res, session))
        _holds.store(maps[-1], rz.HOLD_BASE + 7, word)
        return session

    junk = region_with(0xDEAD)  # names no published residency: protects no read
    assert res.revoke(junk, 0.0, owner="t") == [] and res.revoked == {}
    live = [region_with(rz.hold(1, 3, 5)) for _ in range(3)]
    ended = [res.revoke(s, 0.0, owner="t", max_per_owner=2) for s in live]
    assert ended[:2] == [[], []] and ended[2] == [(live[0], 1)]  # the oldest past the bound ends, noted
    assert list(res.revoked) == live[1:]
    for m in maps:
        m.close()
    res.close()


def test_the_c_release_checks_the_held_generations():
    states, region = mmap.mmap(-1, 4096), mmap.mmap(-1, rz.REGION_WORDS * 8)
    slot, g = 5, (1 << 30) + 9
    _holds.store(states, slot, rz.state(g, rz.READY))
    for state, ok in ((rz.READY, True), (rz.EVICTING, True), (rz.READY, False)):
        gen = g if ok else g + 1  # a refill publishes a later generation
        _holds.store(states, slot, rz.state(gen, state))
        _holds.store(region, rz.HOLD_BASE, rz.hold(3, slot, g))
        assert _holds.release(states, region, [rz.HOLD_BASE]) is ok
        assert _holds.load(region, rz.HOLD_BASE) == 0  # cleared either way


def pinned_model(res: Residency):
    """A store over `res` with model 7 (one layer of 4 experts) pinned whole and published,
    and its pin word set as the holds room's refresh sets it."""
    from moed.cache.records import Want
    from moed.cache.store import Store

    store = Store(budget_bytes=4 * 4096, pin_budget_bytes=4 * 4096, holds=res)
    store.add_class(1, 4096, capacity=8)
    res.add_class(1, capacity=8)
    res.add_model(7, layers=[0], n_experts=4)
    slots = []
    for e in range(4):
        got = store.pin(Want(ExpertKey(7, 0, e), 1))
        assert got is not None
        slot, _, must_read = got
        if must_read:
            store.loaded(slot)
        res.publish(slot)
        slots.append(slot)
    assert res.pins_dirty == {7}
    res.set_whole(7, True)
    return store, slots


@pytest.fixture
def whole_step():
    """(residency, store, slots, session, region): model 7 pinned whole, and `session`'s
    region holding its pin hold, as an engine's does during a whole step."""
    res = Residency()
    store, slots = pinned_model(res)
    session = object()
    region = client_region(res, session)
    _holds.store(region, rz.W_PIN_HOLD, 7 + 1)
    yield res, store, slots, session, region
    region.close()
    res.close_region(session)  # a no-op once revoked and ended
    res.close()


def test_a_pin_hold_keeps_pinned_slots_until_it_is_let_go(whole_step):
    res, store, slots, _, region = whole_step
    assert res.whole(7) and _holds.load(res.tables[7].map, rz.pin_word(4)) == 1
    assert store.unpin(slots[0].key)
    assert not res.whole(7)  # the pin word dropped first: no new whole step
    assert slots[0].pinned and slots[0].unpin_pending and store.unpin_waiting == {slots[0]}
    assert store.retry_unpins() == [] and slots[0].pinned  # still held
    _holds.store(region, rz.W_PIN_HOLD, 9)  # another model's step: not this one's
    assert store.retry_unpins() == [slots[0]]
    assert not slots[0].pinned and store.unpin_waiting == set()
    assert store.pinned_bytes == 3 * 4096


def test_a_revoked_regions_pin_hold_counts_until_let_go(whole_step):
    res, store, slots, session, region = whole_step
    res.revoke(session, now_s=100.0)
    assert res.sweep_revoked(100.5) == [] and list(res.revoked) == [session]  # held: it counts on
    store.unpin(slots[1].key)
    assert slots[1].pinned and store.retry_unpins() == []
    _holds.store(region, rz.W_PIN_HOLD, 0)  # the step ends
    assert res.sweep_revoked(100.6) == [] and res.revoked == {}
    assert store.retry_unpins() == [slots[1]] and not slots[1].pinned


def test_a_re_pin_cancels_a_waiting_unpin(whole_step):
    from moed.cache.records import Want

    _, store, slots, _, region = whole_step
    store.unpin(slots[2].key)
    store.pin(Want(slots[2].key, 1))
    assert not slots[2].unpin_pending and store.unpin_waiting == set()
    _holds.store(region, rz.W_PIN_HOLD, 0)
    assert store.retry_unpins() == [] and slots[2].pinned
