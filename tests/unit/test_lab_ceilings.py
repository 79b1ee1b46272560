"""Drive ceilings and MTP grouping."""

from __future__ import annotations

import numpy as np
import pytest

from moed.badinput import BadInput
from moed.lab import ceilings
from moed.lab.policies import ReplayResult, accesses, replay
from moed.traces import TraceWriter


def test_ceiling_arithmetic():
    # 100 counted tokens, 1000 accesses, 800 hits: 2 reads per token of 1 MB at 1 GB/s = 2 ms
    r = ReplayResult("g-lru", 0.5, 64, 1000, 800, 0.8)
    c = ceilings.ceiling(r, 100, 1e6, 1.0, 8.0)
    assert c.reads_per_token == 2.0 and c.io_ms == pytest.approx(2.0)
    assert c.serial_tok_s == pytest.approx(100.0)  # 1000 / (8 + 2)
    assert c.overlapped_tok_s == pytest.approx(125.0)  # 1000 / max(8, 2)
    slow = ceilings.ceiling(r, 100, 1e6, 0.1, 8.0)  # 20 ms of reads: the drive sets the pace
    assert slow.overlapped_tok_s == pytest.approx(50.0)
    with pytest.raises(BadInput):
        ceilings.ceiling(r, 100, 1e6, 0.0, 8.0)


def one_layer_trace(experts_per_token, prompt=None):
    w = TraceWriter(1, 16, 2)
    if prompt is not None:
        w.append_step("P", [prompt])
    for ids in experts_per_token:
        w.append_step("D", [ids])
    return w.finish()


def test_mtp_windows_union_and_advance():
    # 5 decode tokens, n=1 (windows of 2), accept 1.5: windows start at 0, 1 (1.5), 3, 4 (4.5)
    t = one_layer_trace([[0, 1], [1, 2], [3, 4], [4, 5], [6, 7]])
    grouped, steps = ceilings.mtp_accesses(t, 1, 1.5)
    assert steps == 4
    assert grouped.keys.tolist() == [0, 1, 2, 1, 2, 3, 4, 4, 5, 6, 7, 6, 7]
    assert grouped.counted.all() and grouped.n_counted_tokens == 5


def test_mtp_keeps_prompt_and_warm_up_tokens_plain():
    t = one_layer_trace([[0, 1], [1, 2], [2, 3]], prompt=[[5, 6], [6, 7]])
    grouped, steps = ceilings.mtp_accesses(t, 3, 4, warm=1)
    # prompt tokens one by one (5 6 | 6 7), the warm-up token (0 1), then one window of 2 tokens
    assert grouped.keys.tolist() == [5, 6, 6, 7, 0, 1, 1, 2, 3]
    assert grouped.counted.tolist() == [False] * 6 + [True] * 3
    assert steps == 1


def test_mtp_reads_equal_plain_when_every_expert_fits():
    rng = np.random.default_rng(3)
    t = one_layer_trace(rng.integers(0, 16, (30, 2)).tolist())
    m = ceilings.mtp_reads(t, "g-lru", 3, 2.0, slots=16)
    assert m.reads_per_token == m.reads_per_token_plain  # only first uses miss, either way
    plain = replay(accesses(t), "g-lru", slots=16)
    assert m.reads_per_token_plain == (plain.accesses - plain.hits) / 30


def test_mtp_rejects_bad_parameters():
    t = one_layer_trace([[0, 1]])
    with pytest.raises(BadInput):
        ceilings.mtp_accesses(t, 2, 0)
    with pytest.raises(BadInput):
        ceilings.mtp_accesses(t, 2, 4)
