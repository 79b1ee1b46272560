"""The lab replays the daemon's cache model: a shipped trace through the lab's g-lru
hits exactly as often as the daemon's store given the same accesses."""

from __future__ import annotations

from pathlib import Path

import pytest

from moed.cache.store import ExpertKey, Store, Want
from moed.lab.policies import accesses, replay
from moed.traces import Trace

NVMOE_SMOKE = Path(__file__).resolve().parents[1] / "data/olmoe-smoke.jsonl"  # MIT, from nvmoe
SLOT_BYTES = 4096


def store_hits(acc, slots: int) -> int:
    """Counted hits of a store of `slots` slots, each access acquired, read and released
    before the next (the lab's rule: every access updates the cache, one at a time)."""
    store = Store(slots * SLOT_BYTES)
    store.add_class(0, SLOT_BYTES, slots)
    hits = 0
    for k, counted in zip(acc.keys.tolist(), acc.counted.tolist()):
        plan = store.acquire([Want(ExpertKey(0, k // acc.n_experts, k % acc.n_experts), 0)])
        assert plan is not None  # nothing is held between accesses, so there is always room
        for slot in plan.to_load:
            store.loaded(slot)
        for slot, generation in zip(plan.slots, plan.generations):
            store.release(slot, generation)
        hits += plan.hits if counted else 0
    return hits


@pytest.mark.parametrize("slots", [1, 128, 256, 512, 1024])
def test_lab_g_lru_hits_as_the_daemons_store(slots):
    acc = accesses(Trace.load(NVMOE_SMOKE), warm=8)
    lab = replay(acc, "g-lru", slots=slots)
    assert lab.hits == store_hits(acc, slots)
    assert 0 < lab.hits < lab.accesses or slots <= 128  # a token touches 128 experts
