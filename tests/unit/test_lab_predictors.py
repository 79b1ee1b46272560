"""Predictor coverage on hand-worked traces."""

from __future__ import annotations

import pytest

from moed.lab.coverage import coverage
from moed.traces import TraceWriter


def by_name(cov):
    return {c.predictor: c for c in cov}


def test_gate_ahead_and_trace_only_predictors():
    # 2 layers x 8 experts, top-1, 1 slot shared: every access whose expert is not the
    # previous access's misses.
    w = TraceWriter(2, 8, 1)
    w.append_step("D", [[0], [1]], ahead1=[[], [1, 2]])  # layer-1 miss (1) predicted by k
    w.append_step("D", [[0], [3]], ahead1=[[], [2, 3]])  # layer-1 miss (3) predicted by 2k only
    w.append_step("D", [[0], [3]], ahead1=[[], [4, 5]])  # miss (3): prev token and co-occurrence
    cov = by_name(coverage(w.finish(), size=1 / 16))
    assert cov["gate-ahead k"].misses == 6  # 1 slot: every access misses
    assert cov["gate-ahead k"].covered == 1
    assert cov["gate-ahead 2k"].covered == 2
    assert cov["previous token"].covered == 3  # layer 0 at t1, t2 and layer 1 at t2
    # co-occurrence of layer 0's expert 0: at t1 only 0->1 was seen (3 is missed);
    # at t2 both 0->1 and 0->3 were, so 3 is covered
    assert cov["co-occurrence"].covered == 1
    # useless (neither resident nor used): k sets {1} {2} {4} -> 0+1+1; 2k sets
    # {1,2} {2,3} {4,5} -> 1+1+2
    assert cov["gate-ahead k"].useless_reads_per_token == pytest.approx(2 / 3)
    assert cov["gate-ahead 2k"].useless_reads_per_token == pytest.approx(4 / 3)
    assert "two-ahead k" not in cov


def test_resident_predictions_cost_nothing():
    w = TraceWriter(1, 4, 1)
    for e in [0, 1, 0, 1]:
        w.append_step("D", [[e]])
    cov = by_name(coverage(w.finish(), size=0.5))  # 2 slots: 0 and 1 stay resident
    assert cov["previous token"].misses == 2
    assert cov["previous token"].useless_reads_per_token == 0
    assert set(cov) == {"previous token", "co-occurrence"}
