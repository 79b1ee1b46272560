"""The pure store: eviction order, references, all-or-nothing acquires, shared and
failed loads, prefetch, size classes, shrinking, and a random-operation
state machine that checks the invariants of store.py's docstring after every step.

Sizes are small integers: class 1 holds 100-byte slots, class 2 250-byte slots.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from moed.cache.eviction import LRU, DecayingLFU
from moed.cache.store import ExpertKey, Plan, SlotState, Store, Want

SMALL, BIG = 1, 2  # class ids
CLASS_BYTES = {SMALL: 100, BIG: 250}


def make_store(budget_bytes: int = 1000, policy=None, pin_budget_bytes: int = 0) -> Store:
    store = Store(budget_bytes, policy, pin_budget_bytes)
    for class_id, slot_bytes in CLASS_BYTES.items():
        # As the RAM tier sizes them: as many slots as budget and pins could ever hold.
        store.add_class(class_id, slot_bytes, max(1, (budget_bytes + pin_budget_bytes) // slot_bytes))
    return store


def key(expert: int, layer: int = 0, model: int = 0) -> ExpertKey:
    return ExpertKey(model, layer, expert)


def want(expert: int, class_id: int = SMALL, layer: int = 0, model: int = 0) -> Want:
    return Want(key(expert, layer, model), class_id)


def all_slots(store: Store):
    return [s for cls in store.classes.values() for s in cls.slots.values()]


def policy_members(policy) -> set:
    """The slots a policy holds (peeks at internals: the invariant is about them)."""
    if isinstance(policy, LRU):
        return set(policy._order)
    return set(policy._members)


def check_invariants(store: Store) -> None:
    live = [s for s in all_slots(store) if s.state != SlotState.EMPTY]
    assert store.used_bytes == sum(s.slot_bytes for s in live if not s.pinned)
    assert store.used_bytes <= store.budget_bytes
    assert store.pinned_bytes == sum(s.slot_bytes for s in live if s.pinned)
    assert store.pinned_bytes <= store.pin_budget_bytes
    owned: dict = {}
    for s in live:
        if not s.pinned:
            owned[s.owner] = owned.get(s.owner, 0) + s.slot_bytes
    assert {o: b for o, b in store.owned_bytes.items() if b} == owned
    assert {id(s) for s in live} == {id(s) for s in store.table.values()}
    for k, s in store.table.items():
        assert s.key == k
    for s in all_slots(store):
        assert s.refs >= 0
        if s.state == SlotState.EMPTY:
            assert s.key is None and s.refs == 0 and not s.pinned
    for cls in store.classes.values():
        assert sorted(cls.free) == sorted(s.index for s in cls.slots.values() if s.state == SlotState.EMPTY)
    evictable = {s for s in live if s.state == SlotState.READY and s.refs == 0 and not s.pinned}
    assert policy_members(store.policy) == evictable
    assert len(store.policy) == len(evictable)
    assert store.evictable_bytes == sum(s.slot_bytes for s in evictable)
    victim = store.policy.victim()
    assert (victim is None) == (not evictable)
    assert victim is None or victim in evictable


def load(store: Store, wants: list[Want]) -> Plan:
    """Acquire and complete every read this acquire started."""
    plan = store.acquire(wants)
    assert plan is not None
    for slot in plan.to_load:
        store.loaded(slot)
    return plan


def release(store: Store, plan: Plan) -> None:
    for slot, gen in zip(plan.slots, plan.generations):
        store.release(slot, gen)


def resident(store: Store) -> set[ExpertKey]:
    return set(store.table)


# ---- eviction order ---------------------------------------------------------


def test_lru_evicts_least_recently_released_across_models_and_classes():
    store = make_store(budget_bytes=600)
    a = load(store, [want(0, model=0)])  # 100
    b = load(store, [want(1, BIG, layer=1, model=1)])  # 250
    c = load(store, [want(2, model=1)])  # 100
    d = load(store, [want(3, model=0)])  # 100: 550 used, 50 free
    for plan in (c, a, d, b):  # LRU order: c, a, d, b
        release(store, plan)
    check_invariants(store)

    load(store, [want(4, model=2)])  # needs 100: evicts c only
    assert key(2, model=1) not in resident(store)
    assert {key(0), key(3), key(1, 1, 1)} <= resident(store)

    load(store, [want(5, BIG, layer=1)])  # needs 250 with 50 free: evicts a, then d
    assert key(0) not in resident(store) and key(3) not in resident(store)
    assert key(1, 1, 1) in resident(store)
    assert store.evictions == 3
    check_invariants(store)


def test_hit_moves_a_slot_to_the_back_of_the_lru_order():
    store = make_store(budget_bytes=300)
    plans = [load(store, [want(e)]) for e in range(3)]
    for plan in plans:
        release(store, plan)
    release(store, load(store, [want(0)]))  # hit: 0 is now the most recent
    load(store, [want(9)])
    assert resident(store) == {key(0), key(2), key(9)}


def test_eviction_order_follows_release_not_acquire_order():
    store = make_store(budget_bytes=200)
    first, second = load(store, [want(0)]), load(store, [want(1)])
    release(store, second)
    release(store, first)
    load(store, [want(2)])
    assert resident(store) == {key(0), key(2)}


# ---- references and all-or-nothing -----------------------------------------


def test_held_slot_is_never_evicted_and_acquire_waits_instead():
    store = make_store(budget_bytes=300)
    held = load(store, [want(0), want(1), want(2)])
    before = (store.used_bytes, dict(store.table), store.evictions)
    assert store.acquire([want(3)]) is None
    assert (store.used_bytes, dict(store.table), store.evictions) == before
    for s in held.slots:
        assert s.state == SlotState.READY and s.refs == 1
    release(store, held)
    assert store.acquire([want(3)]) is not None
    check_invariants(store)


def test_acquire_is_all_or_nothing():
    store = make_store(budget_bytes=400)
    held = load(store, [want(0), want(1)])
    idle = load(store, [want(2)])
    release(store, idle)
    # 3 misses need 300 bytes; only 100 free + 100 evictable: nothing may change,
    # not even the reference on the resident key 2 or the eviction of key 2.
    assert store.acquire([want(2), want(3), want(4), want(5)]) is None
    assert store.table[key(2)].refs == 0
    assert store.evictable_bytes == 100 and store.evictions == 0
    check_invariants(store)
    release(store, held)
    plan = store.acquire([want(2), want(3), want(4), want(5)])
    assert plan is not None and plan.hits == 1 and plan.misses == 3
    check_invariants(store)


def test_resident_keys_of_a_request_are_not_counted_as_room():
    store = make_store(budget_bytes=300)
    release(store, load(store, [want(0), want(1)]))  # 200 evictable, 100 free
    # 0 and 1 will be referenced by this very acquire, so only 100 bytes are
    # free for the two misses.
    assert store.acquire([want(0), want(1), want(2)]) is not None
    assert store.acquire([want(3), want(4)]) is None


def test_request_larger_than_the_budget_raises():
    store = make_store(budget_bytes=300)
    with pytest.raises(ValueError):
        store.acquire([want(e) for e in range(4)])
    with pytest.raises(ValueError):
        store.acquire([want(0, BIG), want(1, BIG)])
    check_invariants(store)
    assert store.used_bytes == 0


def test_request_larger_than_the_budget_raises_even_when_partly_resident():
    """Hits and misses must all be resident at once: more than the budget never fits."""
    store = make_store(budget_bytes=300)
    held = load(store, [want(0), want(1)])
    with pytest.raises(ValueError):
        store.acquire([want(0), want(1), want(2), want(3)])
    assert [s.refs for s in held.slots] == [1, 1]
    check_invariants(store)


def test_refs_count_every_lease_and_release_is_idempotent_per_lease():
    store = make_store()
    a = load(store, [want(0)])
    b = store.acquire([want(0)])
    assert b.hits == 1 and b.misses == 0 and not b.to_load
    slot = a.slots[0]
    assert b.slots[0] is slot and slot.refs == 2
    release(store, a)
    assert slot.refs == 1 and len(store.policy) == 0
    release(store, b)
    assert slot.refs == 0 and len(store.policy) == 1
    release(store, b)  # a release beyond the refs does nothing
    assert slot.refs == 0 and store.evictable_bytes == 100
    check_invariants(store)


# ---- shared and failed loads -----------------------------------------------


def test_second_acquire_of_a_loading_key_joins_the_read():
    store = make_store()
    first = store.acquire([want(0)])
    assert first.to_load == first.slots and first.misses == 1 and not first.loading
    used = store.used_bytes
    second = store.acquire([want(0), want(1)])
    assert second.loading == [first.slots[0]]
    assert second.to_load == [second.slots[1]]
    assert second.hits == 0 and second.misses == 1
    assert second.slots[0] is first.slots[0] and first.slots[0].refs == 2
    assert store.used_bytes == used + 100  # only key 1 got a new slot
    store.loaded(first.slots[0])
    assert first.slots[0].state == SlotState.READY and len(store.policy) == 0
    check_invariants(store)


def test_failed_load_kills_every_reference_and_stale_releases_are_ignored():
    store = make_store(budget_bytes=200)
    first = store.acquire([want(0)])
    joined = store.acquire([want(0)])
    slot = first.slots[0]
    store.failed(slot)
    assert slot.state == SlotState.EMPTY and slot.refs == 0 and key(0) not in store.table
    assert store.used_bytes == 0
    assert store.take_dropped() == [slot]
    check_invariants(store)

    again = store.acquire([want(0)])  # a fresh residency, maybe in the same slot
    store.loaded(again.slots[0])
    release(store, first)  # stale generations: ignored
    release(store, joined)
    assert again.slots[0].refs == 1
    check_invariants(store)
    store.failed(again.slots[0])  # not LOADING any more: ignored
    assert again.slots[0].state == SlotState.READY


def test_release_of_a_loading_slot_makes_it_evictable_only_once_ready():
    store = make_store()
    plan = store.acquire([want(0)])
    release(store, plan)
    assert plan.slots[0].refs == 0 and len(store.policy) == 0
    check_invariants(store)
    store.loaded(plan.slots[0])
    assert len(store.policy) == 1 and store.evictable_bytes == 100
    check_invariants(store)


# ---- prefetch -----------------------------------------------------------------


def test_prefetch_takes_no_reference_and_is_evictable_once_ready():
    store = make_store(budget_bytes=200)
    slot = store.prefetch(want(0))
    assert slot is not None and slot.state == SlotState.LOADING and slot.refs == 0 and slot.prefetched
    assert store.prefetch(want(0)) is None  # in flight already
    check_invariants(store)
    store.loaded(slot)
    assert store.prefetch(want(0)) is None  # resident
    assert store.policy.victim() is slot
    check_invariants(store)

    plan = store.acquire([want(0)])
    assert plan.hits == 1 and plan.slots[0] is slot
    assert store.use_prefetched(slot) is True
    assert store.use_prefetched(slot) is False  # counted once
    release(store, plan)
    check_invariants(store)


def test_prefetch_never_evicts_a_held_slot():
    store = make_store(budget_bytes=200)
    held = load(store, [want(0), want(1)])
    assert store.prefetch(want(2)) is None
    assert store.prefetch(want(2, BIG)) is None
    release(store, held)
    slot = store.prefetch(want(2))
    assert slot is not None and key(0) not in store.table  # the LRU one went
    check_invariants(store)


def test_acquire_joins_an_in_flight_prefetch():
    store = make_store()
    slot = store.prefetch(want(0))
    plan = store.acquire([want(0)])
    assert plan.loading == [slot] and not plan.to_load and slot.refs == 1
    store.loaded(slot)
    assert len(store.policy) == 0
    release(store, plan)
    assert store.policy.victim() is slot
    check_invariants(store)


def test_failed_prefetch_frees_its_slot():
    store = make_store()
    slot = store.prefetch(want(0))
    store.failed(slot)
    assert store.used_bytes == 0 and store.take_dropped() == [slot]
    check_invariants(store)


def test_reused_slot_is_no_longer_marked_prefetched():
    store = make_store(budget_bytes=100)
    slot = store.prefetch(want(0))
    store.loaded(slot)
    plan = load(store, [want(1)])  # evicts the prefetch, same class
    assert plan.slots[0] is slot and not store.use_prefetched(slot)


# ---- size classes ---------------------------------------------------------------


def test_same_class_eviction_reuses_the_slot_and_keeps_its_pages():
    store = make_store(budget_bytes=200)
    old = load(store, [want(0), want(1)])
    release(store, old)
    gen = old.slots[0].generation
    new = store.acquire([want(2)])
    assert new.slots[0] is old.slots[0]
    assert new.slots[0].generation == gen + 1
    assert store.take_dropped() == []
    assert store.used_bytes == 200
    check_invariants(store)


def test_cross_class_eviction_drops_the_victims_pages():
    store = make_store(budget_bytes=300)
    small = load(store, [want(0), want(1), want(2)])
    release(store, small)
    big = store.acquire([want(9, BIG)])  # 250: evicts three small slots
    assert big is not None
    dropped = store.take_dropped()
    assert sorted(s.index for s in dropped) == [0, 1, 2]
    assert all(s.class_id == SMALL and s.state == SlotState.EMPTY for s in dropped)
    assert store.take_dropped() == []
    assert store.used_bytes == 250 and store.evictions == 3
    check_invariants(store)


def test_slot_capacity_per_class_is_never_exceeded():
    store = make_store(budget_bytes=1000)
    plan = load(store, [want(e, BIG) for e in range(4)])
    assert sorted(s.index for s in plan.slots) == [0, 1, 2, 3]
    assert store.acquire([want(9, BIG)]) is None


def test_add_class_twice_is_refused():
    store = make_store()
    with pytest.raises(ValueError):
        store.add_class(SMALL, 100, 1)


# ---- shrink and drop_model ---------------------------------------------------------


def test_shrink_evicts_unreferenced_slots_in_lru_order():
    store = make_store(budget_bytes=500)
    held = load(store, [want(0)])
    for e in (1, 2, 3):
        release(store, load(store, [want(e)]))
    freed = store.shrink(250)
    assert freed == 200 and store.used_bytes == 200
    assert resident(store) == {key(0), key(3)}
    assert len(store.take_dropped()) == 2
    assert store.shrink(0) == 100  # the held slot stays
    assert resident(store) == {key(0)} and held.slots[0].refs == 1
    check_invariants(store)


def test_drop_model_forgets_only_unreferenced_slots_of_that_model():
    store = make_store()
    held = load(store, [want(0, model=1)])
    release(store, load(store, [want(1, model=1), want(2, BIG, model=1)]))
    release(store, load(store, [want(1, model=2)]))
    loading = store.prefetch(want(5, model=1))
    store.drop_model(1)
    assert resident(store) == {key(0, model=1), key(1, model=2), key(5, model=1)}
    assert held.slots[0].refs == 1 and loading.state == SlotState.LOADING
    assert len(store.take_dropped()) == 2
    check_invariants(store)


def test_failed_pinned_read_leaves_owner_accounting_alone():
    """A pinned slot is charged to nobody, so its failed read uncharges nobody."""
    store = make_store(budget_bytes=300, pin_budget_bytes=200)
    release(store, load(store, [want(0)]))  # owner None: owned_bytes[None] == 100
    slot, newly, must_read = store.pin(want(1))
    assert newly and must_read
    store.failed(slot)
    assert store.owned_bytes == {None: 100} and store.pinned_bytes == 0
    check_invariants(store)


# ---- random operation sequences ---------------------------------------------------

KEYS = st.builds(ExpertKey, st.integers(0, 2), st.integers(0, 3), st.integers(0, 3))


class Tenant:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


TENANTS = (None, Tenant("a"), Tenant("b"))
WHO = st.sampled_from(TENANTS)


def class_of(k: ExpertKey) -> int:
    return BIG if k.layer >= 2 else SMALL


class StoreMachine(RuleBasedStateMachine):
    """Drives the store the way the daemon does, with a model of who holds what.

    `leases` are granted acquires: (slot, generation) per key. The model's
    exact reference count for a slot is the number of live leases naming its
    current generation; `inflight` are reads started and not yet finished.
    Without quotas the outcome of every acquire and prefetch is predicted
    exactly; with quotas (`QuotaMachine`) floors and ceilings are checked.
    """

    policy_factory = LRU

    def __init__(self):
        super().__init__()
        self.store = make_store(budget_bytes=700, policy=self.policy_factory(), pin_budget_bytes=300)
        self.leases: list[list[tuple]] = []
        self.inflight: list[tuple] = []
        self.floors: dict = {}
        self.ceilings: dict = {}

    def locally_held(self) -> set:
        """Slots engines hold without the store knowing (LocalHoldMachine); none here."""
        return set()

    def settle(self):
        # The daemon gives dropped pages back before any read starts; a slot
        # dropped here is EMPTY or was just reserved again (LOADING).
        for s in self.store.take_dropped():
            event("pages dropped")
            assert s.state != SlotState.READY

    def owned(self) -> dict:
        out: dict = {}
        for s in all_slots(self.store):
            if s.state != SlotState.EMPTY and not s.pinned:
                out[s.owner] = out.get(s.owner, 0) + s.slot_bytes
        return out

    def check_quotas(self, who, before: dict) -> None:
        after = self.owned()
        for t, floor in self.floors.items():
            if t is not who:  # others are not pushed below their floor
                assert after.get(t, 0) >= min(before.get(t, 0), floor)
        for t, ceiling in self.ceilings.items():
            assert after.get(t, 0) <= max(ceiling, before.get(t, 0))

    @rule(keys=st.lists(KEYS, min_size=1, max_size=4, unique=True), who=WHO)
    def acquire(self, keys, who):
        store = self.store
        wants = [Want(k, class_of(k)) for k in keys]
        present = {k: store.table[k] for k in keys if k in store.table}
        missing = [k for k in keys if k not in present]
        need = sum(CLASS_BYTES[class_of(k)] for k in missing)
        whole = need + sum(s.slot_bytes for s in present.values() if not s.pinned)
        held = self.locally_held()
        spare = sum(
            s.slot_bytes
            for s in all_slots(store)
            if s.state == SlotState.READY and s.refs == 0 and not s.pinned and s.key not in present and s not in held
        )
        room = store.effective_budget_bytes - store.used_bytes + spare
        used_before, owned_before = store.used_bytes, self.owned()
        before = {k: (id(s), s.refs, s.generation) for k, s in store.table.items()}
        if missing and whole > store.budget_bytes:
            with pytest.raises(ValueError):
                store.acquire(wants, who)
            event("acquire: too large")
            return
        evictions, adopted_before = store.evictions, set(store.adopted)
        try:
            plan = store.acquire(wants, who)
        except ValueError:
            assert missing and need > self.ceilings.get(who, need)  # over its ceiling
            return
        if plan is None:
            event("acquire: waits")
            assert missing and (store.quotas or need > room)
            # nothing changed, but for slots found held locally: the store adopted them
            newly = store.adopted - adopted_before
            after = {k: (id(s), s.refs - (s in newly), s.generation) for k, s in store.table.items()}
            assert after == before
            return
        assert store.quotas or not missing or need <= room
        event("acquire: evicted" if store.evictions > evictions else "acquire: granted")
        assert [s.key for s in plan.slots] == keys
        # New slots only fit under the effective budget (the memory guard's limit).
        assert store.used_bytes <= max(used_before, store.effective_budget_bytes)
        assert plan.hits + len(plan.loading) + plan.misses == len(keys)
        assert {id(s) for s in plan.to_load} == {id(store.table[k]) for k in missing}
        assert all(s.owner is who for s in plan.to_load)
        for k, s in present.items():  # resident keys kept their slot
            assert store.table[k] is s and before[k][2] == s.generation
        self.check_quotas(who, owned_before)
        self.settle()
        self.leases.append(list(zip(plan.slots, plan.generations)))
        self.inflight += [(s, s.generation) for s in plan.to_load]

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data):
        lease = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))
        for slot, gen in lease:
            self.store.release(slot, gen)
        self.settle()  # a pending unpin may drop

    @precondition(lambda self: self.leases)
    @rule()
    def release_oldest(self):
        # Engines release in the order they acquired (layer after layer);
        # a second release rule also keeps the budget from filling with leases.
        for slot, gen in self.leases.pop(0):
            self.store.release(slot, gen)
        self.settle()

    @precondition(lambda self: self.inflight)
    @rule()
    def finish_every_read(self):
        for slot, gen in self.inflight:
            assert slot.generation == gen and slot.state == SlotState.LOADING
            self.store.loaded(slot)
        self.inflight = []
        self.settle()

    @precondition(lambda self: self.inflight)
    @rule(data=st.data(), ok=st.booleans())
    def finish_read(self, data, ok):
        slot, gen = self.inflight.pop(data.draw(st.integers(0, len(self.inflight) - 1)))
        # A LOADING slot is never evicted or reused under its reader.
        assert slot.generation == gen and slot.state == SlotState.LOADING
        if ok:
            self.store.loaded(slot)
        else:
            self.store.failed(slot)
        self.settle()

    @rule(k=KEYS, who=WHO)
    def prefetch(self, k, who):
        store = self.store
        held = sum(
            s.slot_bytes for s in self.locally_held() if s.refs == 0 and s.state == SlotState.READY and not s.pinned
        )
        fits = (
            k not in store.table
            and CLASS_BYTES[class_of(k)]
            <= store.effective_budget_bytes - store.used_bytes + store.evictable_bytes - held
        )
        owned_before = self.owned()
        slot = store.prefetch(Want(k, class_of(k)), who)
        if not store.quotas:
            assert (slot is not None) == fits
        self.check_quotas(who, owned_before)
        if slot is not None:
            assert slot.refs == 0 and slot.prefetched and store.table[k] is slot and slot.owner is who
            self.settle()
            self.inflight.append((slot, slot.generation))

    @precondition(lambda self: any(s.prefetched and s.refs == 0 for s, _ in self.inflight))
    @rule(data=st.data())
    def cancel_prefetch(self, data):
        unused = [i for i, (s, _) in enumerate(self.inflight) if s.prefetched and s.refs == 0]
        slot, gen = self.inflight.pop(data.draw(st.sampled_from(unused)))
        used, pinned = self.store.used_bytes, self.store.pinned_bytes
        self.store.cancel_prefetch(slot)
        assert slot.state == SlotState.EMPTY
        assert self.store.used_bytes + self.store.pinned_bytes == used + pinned - slot.slot_bytes
        self.settle()

    def some_key(self, data, among) -> ExpertKey:
        """Half the time a key from `among` (so pins meet resident keys), else any key."""
        among = sorted(among)
        if among and data.draw(st.booleans()):
            return data.draw(st.sampled_from(among))
        return data.draw(KEYS)

    @rule(data=st.data())
    def pin(self, data):
        store = self.store
        k = self.some_key(data, store.table)
        size = CLASS_BYTES[class_of(k)]
        resident = store.table.get(k)
        was_pinned = resident is not None and resident.pinned
        used, keys_before, evictions = store.used_bytes, set(store.table), store.evictions
        out = store.pin(Want(k, class_of(k)))
        if was_pinned:
            assert out == (resident, False, False)
        elif store.pinned_bytes - (size if out else 0) + size > store.pin_budget_bytes:
            assert out is None
        elif resident is not None:
            event("pin: resident")
            assert out == (resident, True, False) and store.used_bytes == used - size
        elif out is not None:
            event("pin: read")
            slot, newly, must_read = out
            assert newly and must_read and slot.state == SlotState.LOADING and slot.refs == 0
            self.inflight.append((slot, slot.generation))
        if out is not None:
            assert out[0].pinned and store.table[k] is out[0]
        assert set(store.table) - {k} == keys_before - {k}  # pinning evicts nobody
        assert store.evictions == evictions

    @rule(data=st.data())
    def unpin(self, data):
        store = self.store
        k = self.some_key(data, [k for k, s in store.table.items() if s.pinned])
        slot = store.table.get(k)
        was_pinned = slot is not None and slot.pinned
        free_now = was_pinned and slot.refs == 0 and slot.state == SlotState.READY
        assert store.unpin(k) == was_pinned
        if free_now and slot in self.locally_held():  # rejoins the budget, or is adopted until let go
            assert store.table.get(k) is slot
            assert not slot.pinned or (slot.unpin_pending and slot.adopted)
        elif free_now:  # rejoins the shared budget, or goes
            event("unpin: now")
            assert not slot.pinned
            assert store.table.get(k) is slot or slot.state == SlotState.EMPTY
        elif was_pinned:
            assert slot.pinned and slot.unpin_pending
        self.settle()

    @rule(limit_bytes=st.integers(200, 800))
    def set_effective_budget(self, limit_bytes):
        self.store.set_effective_budget(limit_bytes)
        assert self.store.effective_budget_bytes == min(limit_bytes, self.store.budget_bytes)

    @rule(target_bytes=st.integers(0, 700))
    def shrink(self, target_bytes):
        before = self.store.used_bytes
        freed = self.store.shrink(target_bytes)
        assert self.store.used_bytes == before - freed
        assert self.store.used_bytes <= target_bytes or self.store.evictable_bytes == 0
        self.settle()

    @rule(model=st.integers(0, 2))
    def drop_model(self, model):
        self.store.drop_model(model)
        for k, s in self.store.table.items():
            assert k.model_id != model or s.refs > 0 or s.state != SlotState.READY or s.pinned
        self.settle()

    @invariant()
    def invariants_hold(self):
        check_invariants(self.store)

    @invariant()
    def refs_are_exactly_the_live_leases(self):
        counts: dict[int, int] = {}
        for lease in self.leases:
            for slot, gen in lease:
                if slot.generation == gen:
                    counts[id(slot)] = counts.get(id(slot), 0) + 1
                    assert slot.state != SlotState.EMPTY  # a held slot is never evicted
        for s in all_slots(self.store):
            assert s.refs == counts.get(id(s), 0) + s.adopted  # adoption is the store's one reference


class LFUStoreMachine(StoreMachine):
    policy_factory = staticmethod(lambda: DecayingLFU(half_life=4))


class QuotaMachine(StoreMachine):
    """The same operations with a tenant floor and a tenant ceiling configured."""

    @initialize(floor_bytes=st.sampled_from([100, 300, 500]), ceiling_bytes=st.sampled_from([250, 400]))
    def quotas(self, floor_bytes, ceiling_bytes):
        a, b = TENANTS[1], TENANTS[2]
        self.store.set_quota(a, floor_bytes=floor_bytes)
        self.store.set_quota(b, ceiling_bytes=ceiling_bytes)
        self.floors, self.ceilings = {a: floor_bytes}, {b: ceiling_bytes}


class LocalHoldMachine(StoreMachine):
    """Engines also hold READY slots locally (the residency table's no-round-trip hits).

    `claim` refuses exactly the slots someone holds locally at their current
    generation, as the daemon's hold scan does. Checked after every step: a
    locally held slot is never vacated or refilled, every refused slot was
    adopted (one reference) until its holders let go, and no slot stays
    claimed while still resident after an operation (claims are settled).
    """

    def __init__(self):
        super().__init__()
        self.local: list[tuple] = []  # (slot, generation) held locally
        self.claimed: dict = {}  # slot -> generation when claimed
        self.store.claim = self._claim
        self.store.unclaim = lambda slot: self.claimed.pop(slot, None)

    def locally_held(self) -> set:
        return {slot for slot, gen in self.local if slot.generation == gen}

    def _claim(self, slot) -> bool:
        if slot in self.locally_held():
            event("claim refused: held locally")
            return False
        self.claimed[slot] = slot.generation
        return True

    @precondition(lambda self: any(s.state == SlotState.READY for s in self.store.table.values()))
    @rule(data=st.data())
    def hold_locally(self, data):
        ready = sorted(
            (
                s
                for s in self.store.table.values()
                if s.state == SlotState.READY and self.claimed.get(s) != s.generation
            ),
            key=lambda s: (s.class_id, s.index),
        )
        if ready:
            slot = data.draw(st.sampled_from(ready))
            self.local.append((slot, slot.generation))

    @precondition(lambda self: self.local)
    @rule(data=st.data())
    def let_go_locally(self, data):
        slot, gen = self.local.pop(data.draw(st.integers(0, len(self.local) - 1)))
        if slot.adopted and slot not in self.locally_held():
            self.store.release_adopted(slot)
        self.settle()

    @invariant()
    def local_holds_are_never_vacated(self):
        for slot, gen in self.local:
            assert slot.generation == gen and slot.state == SlotState.READY and self.store.table[slot.key] is slot

    @invariant()
    def claims_are_settled(self):
        for slot, gen in self.claimed.items():
            assert not (slot.generation == gen and slot.state == SlotState.READY), "resident and still claimed"


# STORE_EXAMPLES=2000 hunts longer (minutes); the default keeps the suite fast.
_machine_settings = settings(
    max_examples=int(os.environ.get("STORE_EXAMPLES", 50)),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = _machine_settings
TestLFUStoreMachine = LFUStoreMachine.TestCase
TestLFUStoreMachine.settings = _machine_settings
TestQuotaMachine = QuotaMachine.TestCase
TestQuotaMachine.settings = _machine_settings
TestLocalHoldMachine = LocalHoldMachine.TestCase
TestLocalHoldMachine.settings = _machine_settings


class LocalHoldQuotaMachine(LocalHoldMachine, QuotaMachine):
    """Local holds with a floor and a ceiling configured."""


TestLocalHoldQuotaMachine = LocalHoldQuotaMachine.TestCase
TestLocalHoldQuotaMachine.settings = _machine_settings
