"""Eviction policies on their own: LRU order, decaying LFU on hand-worked counts,
random operation sequences against a reference model, bounded memory."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moed.cache.eviction import LRU, POLICIES, DecayingLFU, make_policy
from moed.cache.store import ExpertKey, Slot


def slots(n: int) -> list[Slot]:
    out = []
    for i in range(n):
        s = Slot(class_id=1, index=i, slot_bytes=100)
        s.key = ExpertKey(0, 0, i)
        out.append(s)
    return out


def eviction_order(policy) -> list[int]:
    """Evict everything, as the store does: victim, then remove it."""
    order = []
    while (v := policy.victim()) is not None:
        policy.remove(v)
        order.append(v.index)
    return order


# ---- LRU -------------------------------------------------------------------------


def test_lru_victim_is_the_least_recently_added():
    p = LRU()
    a, b, c = slots(3)
    assert p.victim() is None and len(p) == 0
    for s in (b, a, c):
        p.add(s)
    p.touch(b)  # LRU orders by release (add), not touch
    assert len(p) == 3
    p.remove(b)  # referenced again ...
    p.add(b)  # ... and released: now the most recent
    assert eviction_order(p) == [0, 2, 1]


def test_lru_remove_of_a_non_member_is_harmless():
    p = LRU()
    a, b = slots(2)
    p.add(a)
    p.remove(b)
    assert p.victim() is a and len(p) == 1


# ---- decaying LFU, hand-worked --------------------------------------------------


def test_lfu_decay_decides_between_frequent_and_recent():
    """A is touched at t=1 and t=2, B at t=3.

    half_life=1: counts halve every access. At t=3, A = 2^-2 + 2^-1 = 0.75 and
    B = 1, so A is evicted although it was used twice.
    half_life=64: A = 2^(-2/64) + 2^(-1/64) ~ 1.957 > B = 1, so B goes.
    """
    for half_life, expected in ((1, 0), (64, 1)):
        p = DecayingLFU(half_life=half_life)
        a, b = slots(2)
        for s in (a, a, b):
            p.touch(s)
        p.add(a)
        p.add(b)
        assert p.victim().index == expected, half_life


def test_lfu_evicts_in_decayed_count_order():
    """half_life=4; A at t=1,2,3, B at t=4, C at t=5,6. Counts at t=6:
    A = 2^(-5/4) + 2^(-4/4) + 2^(-3/4) = 0.420 + 0.500 + 0.595 = 1.515
    B = 2^(-2/4)                                                = 0.707
    C = 2^(-1/4) + 1                                            = 1.841
    so B goes first, then A, then C (and D, never touched, count 0, before all).
    """
    p = DecayingLFU(half_life=4)
    a, b, c, d = slots(4)
    for s in (a, a, a, b, c, c):
        p.touch(s)
    for s in (c, a, d, b):
        p.add(s)
    assert eviction_order(p) == [3, 1, 0, 2]


def test_lfu_equal_counts_evict_the_first_added():
    p = DecayingLFU()
    ss = slots(3)
    for s in (ss[2], ss[0], ss[1]):
        p.add(s)
    assert eviction_order(p) == [2, 0, 1]


def test_lfu_victim_is_never_a_removed_slot():
    p = DecayingLFU(half_life=2)
    a, b, c = slots(3)
    p.touch(b)
    p.touch(c)
    p.touch(c)
    for s in (a, b, c):
        p.add(s)
    p.remove(a)  # the lowest score leaves
    assert p.victim() is b
    p.remove(b)
    p.remove(c)
    assert p.victim() is None and len(p) == 0


def test_lfu_member_touched_in_place_is_reordered():
    p = DecayingLFU(half_life=1000)
    a, b = slots(2)
    p.touch(a)
    p.add(a)
    p.add(b)
    assert p.victim() is b
    p.touch(b)
    p.touch(b)  # b now counts ~2, a ~1
    assert p.victim() is a


def test_lfu_heap_stays_bounded_when_nothing_is_evicted():
    """All hits: slots are referenced and released forever, victim() never runs."""
    half_life = 16
    p = DecayingLFU(half_life=half_life)
    ss = slots(8)
    for s in ss:
        p.add(s)
    touched = {s.index: [] for s in ss}
    for r in range(20_000):
        s = ss[(r * 3) % 8 if r % 5 else 0]  # slot 0 is the hot one
        p.remove(s)
        p.touch(s)
        touched[s.index].append(r + 1)
        p.add(s)
    assert len(p) == 8
    assert len(p._heap) <= 2 * 8 + 65  # internals: the leak this guards against

    def count(i):
        return sum(2.0 ** (-(20_000 - t) / half_life) for t in touched[i])

    assert eviction_order(p) == sorted(range(8), key=count)


# ---- random sequences against a reference ------------------------------------------

N_SLOTS = 5
_touch = st.tuples(st.just("touch"), st.integers(0, N_SLOTS - 1))
_add = st.tuples(st.just("add"), st.integers(0, N_SLOTS - 1))
OPS = st.lists(
    st.one_of(  # a branch listed twice is drawn twice as often
        _touch,
        _touch,
        _touch,
        _add,
        _add,
        st.tuples(st.just("remove"), st.integers(0, N_SLOTS - 1)),
        st.tuples(st.just("rekey"), st.integers(0, N_SLOTS - 1), st.integers(0, 2 * N_SLOTS)),
        st.tuples(st.just("evict")),
    ),
    min_size=8,
    max_size=120,
)


def apply(policy, ss, members, op):
    """One operation as the store would issue it; returns the evicted slot, if any."""
    kind = op[0]
    if kind == "touch":
        policy.touch(ss[op[1]])
    elif kind == "add" and ss[op[1]] not in members:
        policy.add(ss[op[1]])
        members.append(ss[op[1]])
    elif kind == "remove" and ss[op[1]] in members:
        policy.remove(ss[op[1]])
        members.remove(ss[op[1]])
    elif kind == "rekey" and ss[op[1]] not in members:  # the slot is reused for another key
        ss[op[1]].key = ExpertKey(0, 1, op[2])
    elif kind == "evict":
        v = policy.victim()
        assert (v is None) == (not members)
        if v is not None:
            assert v in members
            policy.remove(v)
            members.remove(v)
        return v
    assert len(policy) == len(members)
    return None


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_lru_matches_reference(ops):
    p, ss, members = LRU(), slots(N_SLOTS), []
    for op in ops:
        oldest = members[0] if members else None
        v = apply(p, ss, members, op)
        if op[0] == "evict":
            assert v is oldest  # members is kept in add order


@settings(max_examples=150, deadline=None)
@given(OPS, st.sampled_from([1, 3, 64]))
def test_lfu_victim_has_the_least_decayed_count(ops, half_life):
    p, ss, members = DecayingLFU(half_life=half_life), slots(N_SLOTS), []
    touches: dict[ExpertKey, list[int]] = {}
    clock = 0

    def count(s):
        return sum(2.0 ** (-(clock - t) / half_life) for t in touches.get(s.key, []))

    for op in ops + [("add", i) for i in range(N_SLOTS)] + [("evict",)] * N_SLOTS:
        if op[0] == "evict" and members:
            least = min(count(s) for s in members)
            v = apply(p, ss, members, op)
            assert count(v) <= least * (1 + 1e-9) + 1e-12
            continue
        apply(p, ss, members, op)
        if op[0] == "touch":
            clock += 1
            touches.setdefault(ss[op[1]].key, []).append(clock)
    assert not members and p.victim() is None


# ---- factory ---------------------------------------------------------------------


def test_make_policy_by_name():
    assert isinstance(make_policy("lru"), LRU)
    assert isinstance(make_policy("lfu"), DecayingLFU)
    for name, cls in POLICIES.items():
        assert cls.name == name
    with pytest.raises(ValueError, match="lru"):
        make_policy("fifo")


def test_lfu_forgets_keys_untouched_for_many_half_lives():
    from types import SimpleNamespace

    from moed.cache.eviction import DecayingLFU

    lfu = DecayingLFU(half_life=8)
    for i in range(50_000):  # every access a new expert: nothing is ever hot
        lfu.touch(SimpleNamespace(key=(1, 0, i)))
    assert len(lfu._score) <= 2 * DecayingLFU.PRUNE_MIN
    assert (1, 0, 49_999) in lfu._score  # the recent ones are kept
