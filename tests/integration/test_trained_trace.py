"""The committed routing trace of the tiny trained MoE (scripts/record-tiny-trace): learned
routing through the lab's predictor coverage and through `moectl replay --prefetch gate`."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from moed.traces import Trace

TRACE = pathlib.Path(__file__).resolve().parent.parent / "data" / "tiny-stdlib-moe-trace.npz"
PROMPTS = 10
N_PREDICT = 64


def moectl(*args: str, timeout: float = 120) -> dict:
    out = subprocess.run([sys.executable, "-m", "moed.ctl", *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def trace() -> Trace:
    return Trace.load(TRACE)


def recall(trace: Trace, ahead: np.ndarray) -> float:
    """Routed (token, layer, expert) triples that the prediction's first top-k named."""
    k = trace.top_k
    has = ahead[:, :, 0] >= 0  # (tokens, layers): a prediction was made
    pred, ids = ahead[has][:, :k], trace.ids[has]
    hits = (pred[:, :, None] == ids[:, None, :]).any(axis=1) & (ids >= 0)
    return float(hits.sum() / (ids >= 0).sum())


def test_the_trace_is_the_trained_models_with_predictions(trace, trained_model):
    assert (trace.moe_layers, trace.n_experts, trace.top_k) == (6, 16, 2)
    assert trace.n_decode_tokens == PROMPTS * N_PREDICT
    assert trace.ahead1 is not None and trace.ahead2 is not None
    from moed.gguf.catalog import Catalog

    assert trace.bytes_per_expert == Catalog.open(trained_model).expert_bytes(0)
    # Learned routing is skewed but uses every expert of every layer.
    counts = np.stack([np.bincount(trace.ids[:, layer].ravel(), minlength=16) for layer in range(6)])
    assert (counts > 0).all()


def test_gate_ahead_recall_on_learned_routing_beats_chance(trace):
    chance = trace.top_k / trace.n_experts
    assert not (trace.ahead1[:, 0] >= 0).any() and not (trace.ahead2[:, :2] >= 0).any()
    one, two = recall(trace, trace.ahead1), recall(trace, trace.ahead2)
    assert one > 3 * chance and two > 2 * chance
    assert one > two


def test_predictor_coverage_ranks_gate_ahead_first(trace):
    info = moectl("trace-info", str(TRACE), "--json", "--predictors", "--size", "0.5", "--warm", "8")
    assert (info["moe_layers"], info["n_experts"], info["top_k"]) == (6, 16, 2)
    assert info["gate_ahead"] and info["two_ahead"]
    cov = {p["predictor"]: p for p in info["predictors"]}
    assert set(cov) == {
        "gate-ahead k",
        "gate-ahead 2k",
        "two-ahead k",
        "two-ahead 2k",
        "previous token",
        "co-occurrence",
    }
    assert all(p["misses"] > 0 and 0 <= p["coverage"] <= 1 for p in cov.values())
    assert cov["gate-ahead 2k"]["coverage"] >= cov["gate-ahead k"]["coverage"]
    assert cov["gate-ahead k"]["coverage"] > cov["previous token"]["coverage"]


def test_replay_with_gate_prefetch_on_the_trained_model(trained_model, trace):
    args = (
        "replay",
        str(trained_model),
        str(TRACE),
        "--budget",
        "50%",
        "--compute-ms",
        "2",
        "--warm",
        "16",
        "--tokens",
        "128",
        "--json",
    )
    none = moectl(*args, "--prefetch", "none")
    gate = moectl(*args, "--prefetch", "gate")
    assert none["tokens"] == gate["tokens"] == 128
    assert none["prefetches"] == 0 and gate["prefetches"] > 0
    assert 0 < gate["prefetch_hit_rate"] <= 1
    assert gate["demand_miss_rate"] < none["demand_miss_rate"]
