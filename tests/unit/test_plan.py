"""The sizing planner: consistent with the policy replay, minimal, inside the RAM, honest."""

from __future__ import annotations

import numpy as np
import pytest

from moed.badinput import BadInput
from moed.lab import policies
from moed.lab.plan import ModelCost, Planner, make_plan
from moed.traces import TraceWriter

LAYERS, EXPERTS, TOP_K = 4, 16, 2


@pytest.fixture(scope="module")
def trace():
    rng = np.random.default_rng(1)
    w = TraceWriter(LAYERS, EXPERTS, TOP_K)
    for _ in range(300):
        rows = []
        for _ in range(LAYERS):
            pool = 6 if rng.random() < 0.8 else EXPERTS  # a hot few, sometimes anything
            rows.append(rng.choice(pool, TOP_K, replace=False))
        w.append_step("D", rows)
    return w.finish()


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory(layers=LAYERS, experts=EXPERTS, used=TOP_K)


def test_curve_matches_the_policy_replay(model, trace):
    p = make_plan(model, trace, drive_gbps=2.0, ram_bytes=1 << 30, reserve_bytes=0, warm=10)
    for point in p.curve:
        ref = policies.replay(trace, "g-lru", size=point.size, warm=10)
        assert point.slots == ref.slots
        assert point.hit_rate == pytest.approx(ref.hit_rate)
    rates = [pt.hit_rate for pt in p.curve]
    assert rates == sorted(rates) and rates[-1] > 0.9


def test_bytes_and_rate_follow_the_misses(model, trace):
    cost = ModelCost.of(model)
    pl = Planner(cost, trace, drive_gbps=1.0, compute_ms=5.0)
    pt = pl.point(20)
    assert pt.mb_per_token == pytest.approx(pt.reads_per_token * cost.read_bytes[0] / 1e6)
    assert pt.io_ms == pytest.approx(pt.mb_per_token * 1e6 / 1e9 * 1e3)
    assert pt.tok_s == pytest.approx(1000 / (5.0 + pt.io_ms))
    assert pl.point(cost.all_slots).reads_per_token <= pt.reads_per_token


def test_recommendation_is_the_smallest_budget_reaching_the_target(model, trace):
    cost = ModelCost.of(model)
    p = make_plan(model, trace, target_tok_s=150, drive_gbps=0.01, compute_ms=5.0, ram_bytes=1 << 30, reserve_bytes=0)
    r = p.recommended
    assert r["meets_target"] and r["fits_ram"] and r["tok_s"] >= 150
    pl = Planner(cost, trace, drive_gbps=0.01, compute_ms=5.0)
    assert r["slots"] > 0 and pl.point(r["slots"]).tok_s >= 150 > pl.point(r["slots"] - 1).tok_s
    assert r["ram_budget_bytes"] + r["pin_budget_bytes"] == pytest.approx(r["total_bytes"], abs=2)


def test_pins_never_lose_to_no_pins(model, trace):
    pl = Planner(ModelCost.of(model), trace)
    for slots in (8, 16, 32):
        pins = pl.best_pins(slots)
        assert pl.point(slots, pins).hit_rate >= pl.point(slots).hit_rate
        assert pins <= slots // 2


def test_ram_limits_the_budget_and_an_unreachable_target_says_so(model, trace):
    cost = ModelCost.of(model)
    small = cost.dense_bytes + int(10 * cost.mean_slot_bytes)
    p = make_plan(model, trace, target_tok_s=1e6, drive_gbps=1.0, compute_ms=1.0, ram_bytes=small, reserve_bytes=0)
    r = p.recommended
    assert not r["meets_target"] and r["slots"] == 10 and r["fits_ram"]
    assert any("out of reach" in n for n in p.notes)
    best = make_plan(model, trace, drive_gbps=1.0, ram_bytes=small, reserve_bytes=0)
    assert best.recommended["slots"] == 10  # no target: all the RAM allows


def test_bad_input(model, trace):
    cost = ModelCost.of(model)
    other = TraceWriter(LAYERS + 1, EXPERTS, TOP_K)
    other.append_step("D", [[0, 1]] * (LAYERS + 1))
    with pytest.raises(BadInput):
        Planner(cost, other.finish())
    with pytest.raises(BadInput):
        Planner(cost, trace, policy="lru")
    with pytest.raises(BadInput):
        Planner(cost, trace, drive_gbps=0)
