"""Cache policies against hand-worked traces (eviction order spelled out), the
access/counting rules on whole traces, and Belady as an upper bound."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moed.badinput import BadInput
from moed.lab import policies
from moed.lab.policies import PER_LAYER, POLICIES, accesses, replay, simulate
from moed.traces import TraceWriter

A, B, C, D, E, F = range(6)


def hits(policy, keys, cap, **kw):
    return [int(h) for h in simulate(policy, keys, cap, **kw)]


# ---- hand-worked single caches ---------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "g-lru"])
def test_lru(policy):
    # cap 2: a[a] b[a b] a+[b a] c-> evicts b [a c] b-> evicts a [c b] a-> evicts c [b a]
    assert hits(policy, [A, B, A, C, B, A], 2) == [0, 0, 1, 0, 0, 0]


def test_lfu_counts_survive_eviction_and_ties_go_to_oldest_use():
    # a(1) a(2)+ b(1) | c: evict b (count 1) | b: count 2 now; evict c (1) | a hit
    assert hits("lfu", [A, A, B, C, B, A], 2) == [0, 1, 0, 0, 0, 1]
    # a b tie at 1: c evicts a (older); a (count 2) evicts b (tie with c, older); c hits
    assert hits("lfu", [A, B, C, A, C], 2) == [0, 0, 0, 0, 1]


def test_slru_promotion_and_demotion():
    # cap 5 = probation 1 + protected 4. Doubles promote a..d; e e fills protected past 4,
    # so a falls back to probation; a hits there (promoted again, b demoted); f pushes b out.
    seq = [A, A, B, B, C, C, D, D, E, E, A, F, B]
    assert hits("slru", seq, 5) == [0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 1, 0, 0]
    # probation of 1: the second new expert evicts the first
    assert hits("slru", [A, B, A], 5) == [0, 0, 0]


@pytest.mark.parametrize("policy", ["opt", "g-opt"])
def test_belady_bypasses_the_expert_needed_last(policy):
    # cap 2: c's next use (5) is after a's (3) and b's (4): c is not inserted
    assert hits(policy, [A, B, C, A, B, C], 2) == [0, 0, 0, 1, 1, 0]
    assert hits("lru", [A, B, C, A, B, C], 2) == [0] * 6


def test_belady_ignores_uncounted_next_uses():
    # cap 1, prompt a b a, decode b. Plain MIN keeps a (needed at 2) and misses b at 3;
    # a's next use is not counted, so keeping it wins nothing: keep b, hit at 3.
    assert hits("opt", [A, B, A, B], 1, counted=[0, 0, 0, 1]) == [0, 0, 0, 1]


def test_g_lfu_halves_every_64_tokens():
    # tokens:            0  1  127 128 129 130
    seq, tok = [A, A, C, B, C, A], [0, 1, 127, 128, 129, 130]
    # at 128: a = 2/4 = 0.5, c = 1/2 = 0.5: tie -> older last use (a) goes; c hits;
    # at 130: a = 0.5 + 1, c = 1.5, b = 1 -> b goes
    assert hits("g-lfu", seq, 2, token=tok) == [0, 1, 0, 0, 1, 0]
    # undecayed counts would have kept a (2) over c (1) at 128
    assert hits("lfu", seq, 2) == [0, 1, 0, 0, 0, 1]


def test_g_hot_decays_per_token_and_breaks_ties_by_recency():
    # a used at tokens 0,1,2 (hotness ~0.53 at token 41), b at 40 (~0.96): c evicts a
    seq, tok = [A, A, A, B, C, A], [0, 1, 2, 40, 41, 42]
    assert hits("g-hot", seq, 2, token=tok) == [0, 1, 1, 0, 0, 0]
    # a and b equally hot (same token): c evicts a, the least recently used
    assert hits("g-hot", [A, B, C, B, A], 2, token=[0, 0, 1, 2, 3]) == [0, 0, 0, 1, 0]


def test_g_arc_adapts_with_ghost_lists():
    # c=2. 3: a T1->T2. 4: c, b -> B1. 5: b ghost hit: p=1, a -> B2, b -> T2.
    # 6: a ghost hit in B2: p=0, c -> B1, a -> T2. 7: c ghost hit: p=1, b -> B2. 8: a hits.
    assert hits("g-arc", [A, B, A, C, B, A, C, A], 2) == [0, 0, 1, 0, 0, 0, 0, 1]


def test_g_lru2_evicts_oldest_second_to_last_use():
    # a a: (penult 0). b once. c: once-used go first -> b. b again: penult 2; c (once) goes.
    # d: a's penult 0 < b's 2 -> a goes. a: d (once) goes.
    assert hits("g-lru2", [A, A, B, C, B, D, A], 2) == [0, 1, 0, 0, 0, 0, 0]


def test_g_tlfu_admits_only_the_more_frequent():
    # cap 4, 10% window -> window 1, main 3 (protected 2). See the steps in the docstring.
    seq = [A, B, C, D, E, A, D, E, D, B]
    # 5: d (f1) vs victim a (f1): rejected. 6: a hits in probation, promoted.
    # 7: e (f1) vs b (f1) rejected. 8: d (f2) vs b (f1) admitted. 9: d hits. 10: e (f2) beats c.
    assert hits("g-tlfu10", seq, 4) == [0, 0, 0, 0, 0, 1, 0, 0, 1, 0]


@pytest.mark.parametrize("policy", POLICIES)
def test_zero_slots_never_hit_and_one_key_always_hits(policy):
    assert hits(policy, [A, A, A], 0) == [0, 0, 0]
    assert hits(policy, [A, A, A], 3) == [0, 1, 1]


# ---- whole traces: the access and counting rules ---------------------------------


def small_trace():
    """2 layers x 4 experts, top-2. A prompt step of 2 tokens, then 3 decode tokens."""
    w = TraceWriter(moe_layers=2, n_experts=4, top_k=2)
    w.append_step("P", [[[0, 1], [1, 1]], [[2, 3], [2, 0]]])  # token 1 lists expert 1 twice
    w.append_step("D", [[0, 1], [3, 2]])
    w.append_step("D", [[0, 2], [3, 2]])
    w.append_step("D", [[0, 1], [0, 1]])
    return w.finish()


def test_access_stream_order_dedupe_and_counting():
    acc = accesses(small_trace())
    # keys = layer * 4 + expert; token-major, then layer, then router order; a repeated
    # id in one row is one access
    assert acc.keys.tolist() == [0, 1, 6, 7, 1, 6, 4, 0, 1, 7, 6, 0, 2, 7, 6, 0, 1, 4, 5]
    assert acc.token.tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4]
    assert acc.counted.tolist() == [False] * 7 + [True] * 12
    assert acc.n_counted_tokens == 3
    warm = accesses(small_trace(), warm=2)
    assert warm.counted.tolist() == [False] * 15 + [True] * 4
    assert warm.n_counted_tokens == 1


def test_replay_counts_decode_hits_only():
    r = replay(small_trace(), "g-lru", slots=8)  # everything fits: every re-use hits
    # decode accesses: 0 1 7 6 | 0 2 7 6 | 0 1 4 5 -> misses: 2 (first use), 5 (first use)
    assert (r.accesses, r.hits) == (12, 10)
    assert r.to_json() == {"policy": "g-lru", "size": None, "slots": 8, "accesses": 12, "hits": 10, "hit_rate": 10 / 12}


def test_sizes_and_slots():
    t = small_trace()
    assert replay(t, "lru", size=0.5).slots == 4  # 2 per layer x 2 layers
    assert replay(t, "g-lru", size=0.5).slots == 4  # 0.5 x 4 experts x 2 layers
    assert replay(t, "lru", slots=5).slots == 4  # per layer: 5 // 2 = 2 each
    assert replay(t, "g-lru", slots=5).slots == 5
    with pytest.raises(BadInput):
        replay(t, "g-lru", size=1.5)
    with pytest.raises(BadInput):
        replay(t, "g-lru")
    with pytest.raises(BadInput):
        replay(t, "nope", size=0.5)


def test_per_layer_caches_are_independent():
    # layer 0 cycles over 3 experts (thrashes 2 slots), layer 1 reuses one expert
    w = TraceWriter(2, 4, 1)
    for e in [0, 1, 2, 0, 1, 2]:
        w.append_step("D", [[e], [3]])
    r = replay(w.finish(), "lru", slots=4)
    assert r.hits == 5  # only layer 1 hits (5 of its 6), layer 0 never


# ---- Belady is an upper bound -----------------------------------------------------


@st.composite
def traces(draw):
    layers = draw(st.integers(1, 3))
    experts = draw(st.integers(2, 6))
    k = draw(st.integers(1, min(3, experts)))
    w = TraceWriter(layers, experts, k)
    for _ in range(draw(st.integers(1, 25))):
        kind = draw(st.sampled_from("PDD"))
        n = draw(st.integers(1, 3)) if kind == "P" else 1
        ids = draw(
            st.lists(
                st.lists(st.lists(st.integers(0, experts - 1), min_size=k, max_size=k), min_size=n, max_size=n),
                min_size=layers,
                max_size=layers,
            )
        )
        w.append_step(kind, ids)
    return w.finish()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces(), cap=st.integers(0, 6), warm=st.integers(0, 3))
def test_opt_is_never_below_any_policy(trace, cap, warm):
    acc = accesses(trace, warm)
    got = {p: replay(acc, p, slots=cap * trace.moe_layers).hits for p in POLICIES}
    for p in POLICIES:
        assert got["g-opt"] >= got[p], (p, got)
    for p in PER_LAYER:
        assert got["opt"] >= got[p], (p, got)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), cap=st.integers(0, 3))
def test_opt_matches_brute_force_on_tiny_streams(data, cap):
    keys = data.draw(st.lists(st.integers(0, 5), max_size=12))
    counted = data.draw(st.lists(st.booleans(), min_size=len(keys), max_size=len(keys)))
    got = simulate("opt", keys, cap, counted=counted)
    assert sum(h and c for h, c in zip(got, counted)) == _brute_opt(keys, cap, counted)


def _brute_opt(keys, cap, counted):
    """Exhaustive search over every keep/evict/bypass choice (tiny inputs only)."""

    @functools.cache
    def best(i, cache):
        if i == len(keys):
            return 0
        k = keys[i]
        if k in cache:
            return counted[i] + best(i + 1, cache)
        options = [best(i + 1, cache)]  # bypass
        if cap > 0:
            if len(cache) < cap:
                options.append(best(i + 1, cache | {k}))
            else:
                options += [best(i + 1, (cache - {v}) | {k}) for v in cache]
        return max(options)

    return best(0, frozenset())


def test_replay_is_deterministic():
    t = small_trace()
    assert [replay(t, p, size=0.5) for p in POLICIES] == [replay(t, p, size=0.5) for p in POLICIES]


def test_replay_many_shares_one_stream():
    rs = policies.replay_many(small_trace(), ["g-lru", "lru"], sizes=[0.25, 0.5])
    assert [(r.policy, r.size) for r in rs] == [("g-lru", 0.25), ("lru", 0.25), ("g-lru", 0.5), ("lru", 0.5)]
    assert np.all([0 <= r.hit_rate <= 1 for r in rs])
