"""The one-pass LRU miss-ratio curve equals separate g-lru replays at every size."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moed.lab import mrc
from moed.lab.policies import accesses, replay
from moed.traces import Trace, TraceWriter

NVMOE_SMOKE = Path(__file__).resolve().parents[1] / "data/olmoe-smoke.jsonl"  # MIT, from nvmoe


def brute_distances(keys):
    out = []
    for i, k in enumerate(keys):
        prev = [j for j in range(i) if keys[j] == k]
        out.append(mrc.COLD if not prev else len(set(keys[prev[-1] + 1 : i])))
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 12), max_size=80))
def test_stack_distances_match_brute_force(keys):
    assert mrc.stack_distances(np.array(keys, dtype=np.int64)).tolist() == brute_distances(keys)


def random_trace(seed, tokens=40, layers=3, experts=8, k=2, prompt=5):
    rng = np.random.default_rng(seed)
    w = TraceWriter(layers, experts, k)
    w.append_step("P", rng.integers(0, experts, (layers, prompt, k)))
    for _ in range(tokens):
        w.append_step("D", rng.integers(0, experts, (layers, k)))
    return w.finish()


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("warm", [0, 7])
def test_curve_equals_g_lru_at_every_size(seed, warm):
    acc = accesses(random_trace(seed), warm)
    curve = mrc.lru_curve(acc)
    assert curve.max_slots == 3 * 8
    for slots in range(curve.max_slots + 1):
        r = replay(acc, "g-lru", slots=slots)
        assert curve.hits[slots] == r.hits, slots
        assert curve.hit_rate(slots) == pytest.approx(r.hit_rate)


def test_curve_on_a_real_trace():
    t = Trace.load(NVMOE_SMOKE)
    acc = accesses(t, warm=8)
    curve = mrc.lru_curve(acc)
    for slots in range(0, curve.max_slots + 1, 7):
        assert curve.hits[slots] == replay(acc, "g-lru", slots=slots).hits
    assert np.all(np.diff(curve.hits) >= 0)  # LRU is a stack algorithm: no Belady anomaly
