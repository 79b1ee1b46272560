"""bench/tenants.py's pure parts: the trace cut into per-engine routing streams, the idle
engines' phases, and which way each goal points (loaded from its file: bench/ is no package)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "tenants.py"


@pytest.fixture(scope="module")
def tenants():
    spec = importlib.util.spec_from_file_location("bench_tenants", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("n_tokens,n", [(897, 2), (897, 4), (1396, 4), (4, 4)])
def test_segments_cover_the_trace_in_equal_parts(tenants, n_tokens, n):
    starts = tenants.segment_starts(n_tokens, n)
    ends = starts[1:] + [n_tokens]
    assert starts[0] == 0 and starts == sorted(set(starts))
    assert {e - s for s, e in zip(starts, ends)} <= {n_tokens // n, n_tokens // n + 1}


def test_a_trace_shorter_than_the_engines_is_refused(tenants):
    with pytest.raises(ValueError):
        tenants.segment_starts(3, 4)


def test_idle_engines_spread_over_one_gap(tenants):
    assert tenants.idle_phases(2) == [0.0, 0.0]
    phases = tenants.idle_phases(4)[1:]
    assert phases == sorted(phases) and len(set(phases)) == 3 and all(0 <= p < 1 for p in phases)


def test_goals_point_the_right_way(tenants):
    fast = {"aggregate_tok_s": 13.0, "busy_tok_s": 13.0, "idle_ms_median": 90.0, "hit_rate": 0.5, "bytes_read": 1}
    slow = {"aggregate_tok_s": 10.0, "busy_tok_s": 10.0, "idle_ms_median": 100.0, "hit_rate": 0.4, "bytes_read": 2}
    busy, idle, *_ = tenants.ratios(fast, slow, "unequal")
    assert busy[1] == 1.3 and busy[2].endswith("met") and idle[2].endswith("met")
    busy, idle, *_ = tenants.ratios(slow, fast, "unequal")
    assert busy[2].endswith("MISSED") and idle[2].endswith("MISSED")
    (agg, *_) = tenants.ratios(fast, slow, "equal")
    assert agg[1] == 1.3 and agg[2].endswith("met")


def test_an_engine_replays_its_own_segment_and_wraps_within_it(tenants):
    starts = tenants.segment_starts(10, 2)  # [0, 5]
    assert [tenants.trace_token(starts[1], 5, k) for k in range(7)] == [5, 6, 7, 8, 9, 5, 6]
