"""The substitution rule over plain arrays (moed.engines.substitute)."""

from __future__ import annotations

import numpy as np
import pytest

from moed.engines.substitute import Substituter


def router(n_tokens: int, n_experts: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n_tokens, n_experts))
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    ranked = np.argsort(-probs, axis=1, kind="stable").astype(np.int32)
    return ranked, probs.astype(np.float32)


def table(resident_set):
    def resident(layer, experts):
        return np.isin(np.asarray(experts), list(resident_set))

    return resident


def test_best_resident_stand_in_within_next_k_and_above_r():
    probs = np.array([[0.40, 0.30, 0.15, 0.10, 0.05]], dtype=np.float32)
    ranked = np.array([[0, 1, 2, 3, 4]], dtype=np.int32)
    ids = ranked[:, :2].copy()
    sub = Substituter(0.3, n_experts=5, k=2)
    # Expert 1 (0.30) missing; 2 (0.15) is resident and >= 0.3 * 0.30; 3 too but ranked lower.
    assert sub.rewrite(0, ids, ranked, probs, table({0, 2, 3})) == 1
    assert ids.tolist() == [[0, 2]]
    st = sub.totals(tokens=1)
    assert st["subst_reads_avoided"] == 1 and st["subst_reads_needed"] == 1
    assert st["subst_weight_share"] == pytest.approx(0.15 / 0.55)


def test_r_gates_and_window_is_the_next_k():
    probs = np.array([[0.40, 0.30, 0.15, 0.10, 0.05]], dtype=np.float32)
    ranked = np.array([[0, 1, 2, 3, 4]], dtype=np.int32)
    ids = ranked[:, :2].copy()
    # 2 is not resident; 3 (0.10) is, but 0.10 < 0.5 * 0.30; 4 is outside the next 2.
    assert Substituter(0.5, 5, 2).rewrite(0, ids, ranked, probs, table({0, 3, 4})) == 0
    assert ids.tolist() == [[0, 1]]
    assert Substituter(0.3, 5, 2).rewrite(0, ids, ranked, probs, table({0, 3, 4})) == 1
    assert ids.tolist() == [[0, 3]]


def test_r_above_one_never_substitutes():
    ranked, probs = router(64, 16)
    ids = ranked[:, :4].copy()
    sub = Substituter(1.0001, 16, 4)
    assert sub.rewrite(0, ids, ranked, probs, table(range(4, 16))) == 0
    assert np.array_equal(ids, ranked[:, :4])
    assert sub.stats.missing > 0


@pytest.mark.parametrize("rule", ["plain", "cooc"])
def test_no_expert_twice_and_every_stand_in_resident_and_in_the_window(rule):
    ranked, probs = router(200, 16, seed=3)
    resident = set(range(0, 16, 2))
    sub = Substituter(0.1, 16, 4, rule=rule)
    for layer in range(3):
        ids = ranked[:, :4].copy()
        done = sub.rewrite(layer, ids, ranked, probs, table(resident))
        assert done > 0
        for t in range(len(ids)):
            assert len(set(ids[t].tolist())) == 4
            for slot in range(4):
                if ids[t, slot] != ranked[t, slot]:
                    assert ids[t, slot] in resident and ranked[t, slot] not in resident
                    assert ids[t, slot] in ranked[t, 4:8]
                    assert probs[t, ids[t, slot]] >= 0.1 * probs[t, ranked[t, slot]]


def test_cooc_prefers_the_expert_routed_with_the_missing_one():
    # Learn: expert 1 always comes with 3, never with 2.
    n = 6
    sub = Substituter(0.01, n, k=2, window=3, rule="cooc")
    learn = np.array([[1, 3]] * 20 + [[0, 2]] * 20, dtype=np.int32)
    sub._learn(0, learn)
    probs = np.array([[0.4, 0.3, 0.14, 0.12, 0.04]], dtype=np.float32)
    probs = np.concatenate([probs, [[0.0]]], axis=1)
    ranked = np.array([[0, 1, 2, 3, 4, 5]], dtype=np.int32)
    ids = ranked[:, :2].copy()
    sub.rewrite(0, ids, ranked, probs, table({0, 2, 3}))
    assert ids.tolist() == [[0, 3]]  # plain would take 2 (ranked higher)
    ids = ranked[:, :2].copy()
    Substituter(0.01, n, 2, window=3).rewrite(0, ids, ranked, probs, table({0, 2, 3}))
    assert ids.tolist() == [[0, 2]]


def test_bad_arguments():
    with pytest.raises(ValueError):
        Substituter(0, 8, 2)
    with pytest.raises(ValueError):
        Substituter(0.5, 8, 2, rule="nearest")
