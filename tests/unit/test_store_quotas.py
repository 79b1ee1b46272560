"""Tenant floors and ceilings in the pure store."""

from __future__ import annotations

import pytest

from moed.daemon.policy import DecayingLFU, LRU
from moed.daemon.store import ExpertKey, Store, Want

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
    for e in range(100, 140):                  # b streams 40 experts through
        assert use(st, b, e)
    assert len(resident(st, a)) == 3           # a kept its floor...
    assert st.owned_bytes[a] == 3 * SLOT
    assert resident(st, a) == {2, 3, 4}        # ...its most recently used ones
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
    assert st.acquire([want(50)], b) is None   # nothing b may evict: it waits
    assert st.used_bytes == 4 * SLOT and resident(st, a) == {0, 1, 2, 3}


def test_ceiling_makes_a_tenant_evict_its_own_first():
    st = make(8)
    a, b = Owner("a"), Owner("b")
    st.set_quota(a, ceiling_bytes=2 * SLOT)
    use(st, b, 100)                            # b's slot is the LRU one
    for e in range(6):
        assert use(st, a, e)
    assert st.owned_bytes[a] == 2 * SLOT
    assert resident(st, a) == {4, 5}
    assert resident(st, b) == {100}            # not evicted although it is older


def test_ceiling_with_everything_held_waits_and_too_large_raises():
    st = make(8)
    a = Owner("a")
    st.set_quota(a, ceiling_bytes=2 * SLOT)
    plan = st.acquire([want(0), want(1)], a)
    for s in plan.to_load:
        st.loaded(s)
    assert st.acquire([want(2)], a) is None    # its two slots are leased
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
    st.shrink(0)                               # the memory guard overrides floors
    assert st.used_bytes == 0 and st.owned_bytes == {a: 0, b: 0}


def test_prefetch_respects_floors():
    st = make(2)
    a, b = Owner("a"), Owner("b")
    st.set_quota(a, floor_bytes=2 * SLOT)
    use(st, a, 0)
    use(st, a, 1)
    assert st.prefetch(want(9), b) is None
    assert resident(st, a) == {0, 1}
