"""The prefaulter on a real RAM tier and store, no daemon: what it makes, where, and what it gives back."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

from moed.cache.eviction import make_policy
from moed.cache.store import Store
from moed.daemon.memguard import MemGuard
from moed.daemon.prefault import Prefaulter
from moed.daemon.ramtier import RamTier

PAGE = 4096
PARTS = [3 * PAGE, 3 * PAGE, 2 * PAGE]  # 8 pages a slot


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def allocated(seg) -> int:
    return os.fstat(seg.fd).st_blocks * 512


@pytest.fixture
def tier():
    """A store of 64 slots' budget over one class, its RAM tier, and a model of 4 layers x 8 experts."""
    slot_bytes = sum(PARTS)
    store = Store(64 * slot_bytes, make_policy("lru"), 0)
    ramtier = RamTier(64 * slot_bytes)
    seg = ramtier.add_segment(1, ["gate", "up", "down"], PARTS)
    store.add_class(1, seg.slot_bytes, seg.capacity)
    model = SimpleNamespace(
        layers={i: SimpleNamespace(class_id=1) for i in range(4)}, catalog=SimpleNamespace(n_experts=8)
    )
    yield store, ramtier, seg, model
    ramtier.close()


@pytest.mark.parametrize("how", ["madvise", "fallocate"])
def test_a_models_first_slots_are_made_before_any_fill_and_hold_zeros(tier, how):
    store, ramtier, seg, model = tier
    pf = Prefaulter(store, ramtier, step_bytes=5 * seg.slot_bytes)
    if how == "fallocate":
        pf._populate = pf._fallocate  # the kernel without MADV_POPULATE_WRITE
    assert allocated(seg) == 0, "the segment starts sparse"
    try:
        pf.plan_model(model)
        # 32 experts of the model, its whole share of a 64-slot budget: 32 slots, in steps of 5
        wait_until(lambda: pf.stats()["prefaulted_bytes"] == 32 * seg.slot_bytes)
        assert allocated(seg) == 32 * seg.slot_bytes
        for k in range(3):  # every part of slots 0..31, nothing past them
            assert os.pread(seg.fd, PARTS[k], seg.part_off[k] + 31 * seg.part_stride[k]) == bytes(PARTS[k])
    finally:
        pf.close()


def test_never_more_than_the_budget_and_nothing_while_the_guard_holds_the_store(tier):
    store, ramtier, seg, model = tier
    model.catalog.n_experts = 100  # 400 experts: the budget's 64 slots at most
    store.set_effective_budget(store.budget_bytes // 2)  # the memory guard is holding the store
    pf = Prefaulter(store, ramtier, step_bytes=8 * seg.slot_bytes)
    try:
        pf.plan_model(model)
        with pf._lock:  # the thread steps only on what _next names, under this lock
            assert pf._next() is None
        assert pf.stats()["prefaulted_bytes"] == 0 and allocated(seg) == 0
        store.set_effective_budget(store.budget_bytes)
        pf.plan_model(model)  # the next plan resumes it
        wait_until(lambda: pf.stats()["prefaulted_bytes"] == 64 * seg.slot_bytes)
        assert allocated(seg) == 64 * seg.slot_bytes
    finally:
        pf.close()


def test_the_guard_trims_made_pages_no_slot_uses_before_it_evicts(tier):
    store, ramtier, seg, model = tier
    pf = Prefaulter(store, ramtier, step_bytes=32 * seg.slot_bytes)
    try:
        pf.plan_model(model)
        wait_until(lambda: pf.stats()["prefaulted_bytes"] == 32 * seg.slot_bytes)
        for _ in range(3):  # three slots made by the store (what fills would take): indices 0, 1, 2
            store.classes[1].take_free()
        reader = SimpleNamespace(available_bytes=lambda: 0, cgroups=[])
        guard = MemGuard(store, 1 << 30, 0.1, reader=reader, trim=pf.trim)
        freed = guard.step()  # far below the floor: give back
        assert freed >= 29 * seg.slot_bytes
        assert pf.stats()["prefaulted_bytes"] == 3 * seg.slot_bytes
        assert allocated(seg) == 3 * seg.slot_bytes, "the three made slots keep their pages"
        with pf._lock:
            assert pf._next() is None, "and nothing is made again while the guard holds the store"
    finally:
        pf.close()


def test_off_makes_nothing(tier):
    store, ramtier, seg, model = tier
    pf = Prefaulter(store, ramtier, enabled=False)
    pf.plan_model(model)
    assert pf._thread is None and allocated(seg) == 0
    pf.close()
