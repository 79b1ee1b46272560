"""Tenant floors and ceilings in the pure store."""

from __future__ import annotations

import pytest

from moed.cache.eviction import LRU, DecayingLFU
from moed.cache.store import ExpertKey, Store, Want

SLOT = 4096


class Owner:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name


def make(budget_slots: int, policy=None) -> Store:
    st = Store(budget_slots * SLOT, policy or LRU())
    st.add_class(1, SLOT, 64)
    return st


def want(e: int, layer: int = 0) -> Want:
    return Want(ExpertKey(1, layer, e), 1)


def use(st: Store, owner, *experts, layer: int = 0) -> bool:
    """Acquire, load and release; True if it fitted."""
    plan = st.acquire([want(e, layer) for e in experts], owner)
    if plan is None:
        return False
    for s in plan.to_load:
        st.loaded(s)
    for s, g in zip(plan.slots, plan.generations):
        st.release(s, g)
    return True


def resident(st: Store, owner) -> set[int]:
    return {k.expert for k, s in st.table.items() if s.owner is owner}


@pytest.mark.parametrize("policy", [LRU, DecayingLFU])
def test_floor_holds_under_another_tenants_pressure(policy):
    st = make(8, policy())
    a, b = Owner("a"), Owner("b")
    st.set_quota(a, floor_bytes=3 * SLOT)
    for e in range(5):
        assert use(st, a, e)
    for e in range(100, 140):  # b streams 40 experts through
        assert use(st, b, e)
    assert len(resident(st, a)) == 3  # a kept its floor...
    assert st.owned_bytes[a] == 3 * SLOT
    assert resident(st, a) == {2, 3, 4}  # ...its most recently used ones
    assert st.used_bytes <= st.budget_bytes
    assert st.owned_bytes[b] == 5 * SLOT


def test_without_quotas_one_lru_evicts_everyone():
    st = make(8)
    a, b = Owner("a"), Owner("b")
    for e in range(5):
        use(st, a, e)
    for e in range(100, 140):
        use(st, b, e)
    assert resident(st, a) == set()
    assert a not in st.owned_bytes


def test_tenant_may_evict_its_own_slots_below_its_floor():
    st = make(4)
    a = Owner("a")
    st.set_quota(a, floor_bytes=4 * SLOT)
    for e in range(10):
        assert use(st, a, e)
    assert resident(st, a) == {6, 7, 8, 9}


def test_other_tenant_waits_when_only_protected_slots_are_left():
    st = make(4)
    a, b = Owner("a"), Owner("b")
    st.set_quota(a, floor_bytes=4 * SLOT)
    for e in range(4):
        use(st, a, e)
    assert st.acquire([want(50)], b) is None  # nothing b may evict: it waits
    assert st.used_bytes == 4 * SLOT and resident(st, a) == {0, 1, 2, 3}


def test_ceiling_makes_a_tenant_evict_its_own_first():
    st = make(8)
    a, b = Owner("a"), Owner("b")
    st.set_quota(a, ceiling_bytes=2 * SLOT)
    use(st, b, 100)  # b's slot is the LRU one
    for e in range(6):
        assert use(st, a, e)
    assert st.owned_bytes[a] == 2 * SLOT
    assert resident(st, a) == {4, 5}
    assert resident(st, b) == {100}  # not evicted although it is older


def test_ceiling_with_everything_held_waits_and_too_large_raises():
    st = make(8)
    a = Owner("a")
    st.set_quota(a, ceiling_bytes=2 * SLOT)
    plan = st.acquire([want(0), want(1)], a)
    for s in plan.to_load:
        st.loaded(s)
    assert st.acquire([want(2)], a) is None  # its two slots are leased
    with pytest.raises(ValueError, match="ceiling"):
        st.acquire([want(3), want(4), want(5)], a)


def test_floor_and_ceiling_together_and_accounting_returns_to_zero():
    st = make(6)
    a, b = Owner("a"), Owner("b")
    st.set_quota(a, floor_bytes=2 * SLOT, ceiling_bytes=3 * SLOT)
    st.set_quota(b, floor_bytes=2 * SLOT)
    for r in range(30):
        use(st, a, r % 7)
        use(st, b, 100 + r % 9)
        assert st.owned_bytes[a] <= 3 * SLOT
        assert st.owned_bytes[a] >= 2 * SLOT or r < 2
        assert st.owned_bytes[b] >= 2 * SLOT or r < 2
        assert sum(st.owned_bytes.values()) == st.used_bytes
    st.shrink(0)  # the memory guard overrides floors
    assert st.used_bytes == 0 and st.owned_bytes == {a: 0, b: 0}


def test_prefetch_respects_floors():
    st = make(2)
    a, b = Owner("a"), Owner("b")
    st.set_quota(a, floor_bytes=2 * SLOT)
    use(st, a, 0)
    use(st, a, 1)
    assert st.prefetch(want(9), b) is None
    assert resident(st, a) == {0, 1}


# ---- the pinned partition ---------------------------------------------------


def pinned_store(budget_slots: int, pin_slots: int) -> Store:
    st = Store(budget_slots * SLOT, LRU(), pin_budget_bytes=pin_slots * SLOT)
    st.add_class(1, SLOT, budget_slots + pin_slots)
    return st


def test_pinned_slots_are_never_evicted_and_sit_outside_the_budget():
    st = pinned_store(4, 2)
    for e in (0, 1):
        slot, new, read = st.pin(want(e))
        assert new and read
        st.loaded(slot)
    assert st.pin(want(2)) is None  # the pin budget is full
    assert st.pinned_bytes == 2 * SLOT and st.used_bytes == 0
    for e in range(10, 40):
        assert use(st, None, e)
    assert {0, 1} <= {k.expert for k in st.table}
    plan = st.acquire([want(0), want(1)])
    assert plan.hits == 2 and not plan.to_load
    st.shrink(0)  # nor by the memory guard
    assert st.pinned_bytes == 2 * SLOT and st.table[ExpertKey(1, 0, 0)].pinned


def test_pinning_a_resident_key_moves_it_out_of_the_shared_budget():
    st = pinned_store(4, 2)
    use(st, None, 5)
    assert st.used_bytes == SLOT and st.evictable_bytes == SLOT
    slot, new, read = st.pin(want(5))
    assert new and not read and slot.pinned
    assert st.used_bytes == 0 and st.evictable_bytes == 0 and st.pinned_bytes == SLOT
    assert st.pin(want(5)) == (slot, False, False)


def test_unpin_rejoins_the_lru_or_waits_for_the_lease():
    st = pinned_store(4, 2)
    slot, _, _ = st.pin(want(0))
    st.loaded(slot)
    plan = st.acquire([want(0)])
    assert st.unpin(want(0).key)
    assert slot.pinned and slot.unpin_pending  # held: stays until released
    st.release(plan.slots[0], plan.generations[0])
    assert not slot.pinned and st.pinned_bytes == 0
    assert st.used_bytes == SLOT and st.evictable_bytes == SLOT
    assert not st.unpin(want(0).key)


def test_unpin_without_room_drops_and_failed_pin_read_frees_the_partition():
    st = pinned_store(1, 2)
    use(st, None, 9)  # the shared budget is full
    slot, _, _ = st.pin(want(0))
    st.loaded(slot)
    plan = st.acquire([want(9)])  # and held
    st.unpin(want(0).key)
    assert want(0).key not in st.table and st.pinned_bytes == 0
    assert st.take_dropped() == [slot]
    slot2, _, read = st.pin(want(1))
    assert read
    st.failed(slot2)
    assert st.pinned_bytes == 0 and want(1).key not in st.table
    st.release(plan.slots[0], plan.generations[0])
    assert st.used_bytes == SLOT


# ---- random operations keep every quota invariant ------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

OPS = st.lists(
    st.tuples(
        st.sampled_from(["acquire", "release", "prefetch", "shrink", "pin", "unpin"]),
        st.integers(0, 2),
        st.lists(st.integers(0, 11), min_size=1, max_size=3, unique=True),
    ),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(ops=OPS, policy=st.sampled_from([LRU, DecayingLFU]))
def test_random_operations_keep_quota_invariants(ops, policy):
    st_ = Store(8 * SLOT, policy(), pin_budget_bytes=2 * SLOT)
    st_.add_class(1, SLOT, 10)
    owners = [Owner("a"), Owner("b"), Owner("c")]
    st_.set_quota(owners[0], floor_bytes=3 * SLOT)
    st_.set_quota(owners[1], floor_bytes=2 * SLOT, ceiling_bytes=4 * SLOT)
    held: list = []
    for op, who, experts in ops:
        owner = owners[who]
        before = dict(st_.owned_bytes)
        if op == "acquire":
            try:
                plan = st_.acquire([want(e) for e in experts], owner)
            except ValueError:
                plan = None
            if plan is not None:
                for s in plan.to_load:
                    st_.loaded(s)
                held.append(plan)
        elif op == "release" and held:
            plan = held.pop(who % len(held))
            for s, g in zip(plan.slots, plan.generations):
                st_.release(s, g)
        elif op == "prefetch":
            slot = st_.prefetch(want(experts[0]), owner)
            if slot is not None:
                st_.loaded(slot)
        elif op == "shrink":
            st_.shrink(st_.used_bytes - SLOT)
        elif op == "pin":
            got = st_.pin(want(experts[0]))
            if got is not None and got[2]:
                st_.loaded(got[0])
        elif op == "unpin":
            st_.unpin(want(experts[0]).key)
        st_.take_dropped()
        # invariants
        resident = [s for s in st_.table.values() if not s.pinned]
        assert st_.used_bytes == sum(s.slot_bytes for s in resident) <= st_.budget_bytes
        assert st_.pinned_bytes == sum(s.slot_bytes for s in st_.table.values() if s.pinned) <= 2 * SLOT
        assert sum(st_.owned_bytes.values()) == st_.used_bytes
        assert st_.evictable_bytes == sum(s.slot_bytes for s in resident if s.refs == 0 and s.state == 2)
        assert st_.owned_bytes.get(owners[1], 0) <= 4 * SLOT
        if op in ("acquire", "prefetch"):  # another tenant never pushes one below its floor
            for o, floor in ((owners[0], 3 * SLOT), (owners[1], 2 * SLOT)):
                if o is not owner:
                    assert st_.owned_bytes.get(o, 0) >= min(before.get(o, 0), floor)
