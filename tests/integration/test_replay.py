"""`moectl replay` and the lab replay against a real private daemon and a generated model.

The trace is generated here (a prompt step, then decode tokens with some reuse,
and gate-ahead predictions that contain the real experts plus noise), the model
by `make-model --like` with the trace's geometry.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from moed.gguf.budget import slot_bytes_by_layer
from moed.gguf.catalog import Catalog
from moed.lab import live_replay as rp
from moed.traces import Trace, TraceWriter

LAYERS, EXPERTS, TOP_K = 4, 16, 2


def make_trace(path, decode_tokens: int = 24, prompt_tokens: int = 12, seed: int = 0) -> Trace:
    rng = np.random.default_rng(seed)
    w = TraceWriter(LAYERS, EXPERTS, TOP_K)

    def route(n):  # (layers, n, k): a hot half of the experts most of the time
        out = np.empty((LAYERS, n, TOP_K), np.int64)
        for l in range(LAYERS):
            for t in range(n):
                pool = np.arange(EXPERTS // 2) if rng.random() < 0.7 else np.arange(EXPERTS)
                out[l, t] = rng.choice(pool, TOP_K, replace=False)
        return out

    w.append_step("P", list(route(prompt_tokens)))
    for _ in range(decode_tokens):
        ids = route(1)[:, 0]
        noise = rng.integers(0, EXPERTS, (LAYERS, TOP_K))
        ahead = [np.concatenate([ids[l], noise[l]])[None] for l in range(LAYERS)]
        w.append_step("D", [r[None] for r in ids], ahead1=ahead, ahead2=ahead)
    trace = w.finish()
    trace.save(path)
    return trace


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("replay")
    trace = make_trace(d / "t.npz")
    model = d / "m.gguf"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "moed.ctl",
            "make-model",
            str(model),
            "--like",
            str(d / "t.npz"),
            "--embd",
            "256",
            "--ff",
            "256",
            "--align",
            "4096",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return model, trace, d / "t.npz"


def slot(model) -> int:
    return slot_bytes_by_layer(model)[0]


def test_make_model_like_has_the_trace_geometry(setup):
    model, trace, _ = setup
    cat = Catalog.open(model)
    assert (len(cat.moe_layers), cat.n_experts, cat.n_expert_used) == (LAYERS, EXPERTS, TOP_K)


@pytest.mark.parametrize("mode", ["none", "gate", "gate2", "oracle"])
def test_counters_add_up(setup, mode):
    model, trace, _ = setup
    opts = rp.ReplayOptions(compute_ms=1.0, prefetch=mode, warm=8)
    r = rp.replay_private(model, trace, 24 * slot(model), opts)
    assert r.tokens == 24 and r.warm_tokens == 8
    assert r.accesses == 24 * LAYERS * TOP_K
    assert r.hits + r.misses == r.accesses
    assert r.demand_misses <= r.misses and r.prefetch_hits <= r.accesses
    assert r.hit_rate + r.demand_miss_rate <= 1.0 + 1e-9
    assert r.warnings == []
    assert r.bytes_read > 0 and r.mb_per_token == pytest.approx(r.bytes_read / 1e6 / 24)
    if mode == "none":
        assert r.prefetches == 0 and r.prefetch_hits == 0 and r.demand_misses == r.misses
    else:
        assert r.prefetches > 0
        assert r.wasted_prefetches <= r.prefetches


def test_oracle_with_room_for_a_token_has_no_demand_misses(setup):
    """Room for this token's experts beside the last token's: the LRU victims of a
    token's prefetches are then always experts this token does not need. (With room
    for exactly one token, an expert a later layer needs can be the oldest and be
    evicted by an earlier layer's prefetch; its own prefetch then may find every
    slot in flight and be dropped, leaving a demand miss.)"""
    model, trace, _ = setup
    opts = rp.ReplayOptions(compute_ms=2.0, prefetch="oracle", warm=4)
    r = rp.replay_private(model, trace, 2 * LAYERS * TOP_K * slot(model), opts)
    assert r.budget_slots == 2 * LAYERS * TOP_K
    assert r.demand_misses == 0 and r.demand_miss_rate == 0.0
    assert r.hits + r.misses == r.accesses and r.misses > 0  # the drive still had work to do


def test_zero_headroom_is_reported_not_hung(setup):
    model, trace, _ = setup
    opts = rp.ReplayOptions(compute_ms=0.0, prefetch="oracle", warm=2, tokens=6)
    r = rp.replay_private(model, trace, TOP_K * slot(model), opts)  # one layer's experts, no more
    assert r.budget_slots == TOP_K and r.tokens == 6
    assert r.hits + r.misses == r.accesses
    assert any("zero headroom" in w for w in r.warnings)


def test_budget_below_one_layer_fails_at_once(setup):
    model, _, trace_path = setup
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "moed.ctl",
            "replay",
            str(model),
            str(trace_path),
            "--budget",
            str(slot(model)),
            "--compute-ms",
            "0",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "budget" in out.stderr and out.stdout == ""


def test_cli_json_keys(setup):
    model, _, trace_path = setup
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "moed.ctl",
            "replay",
            str(model),
            str(trace_path),
            "--budget",
            "50%",
            "--compute-ms",
            "1",
            "--prefetch",
            "gate",
            "--warm",
            "4",
            "--tokens",
            "10",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    for k in (
        "tok_s",
        "compute_tok_s",
        "stall_ms_per_token",
        "hit_rate",
        "prefetch_hit_rate",
        "demand_miss_rate",
        "prefetches",
        "wasted_prefetch_rate",
        "gb_read",
        "mb_per_token",
    ):
        assert k in r, k
    assert r["tokens"] == 10 and r["compute_tok_s"] == pytest.approx(1000.0)


def test_gate_prefetch_needs_predictions(setup, tmp_path):
    model, trace, _ = setup
    bare = tmp_path / "bare.jsonl"
    trace.save(bare)  # nvmoe JSONL keeps routes only
    out = subprocess.run(
        [sys.executable, "-m", "moed.ctl", "replay", str(model), str(bare), "--budget", "50%", "--prefetch", "gate"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "ahead1" in out.stderr


def test_replay_through_a_running_daemon(setup, start_daemon):
    model, trace, _ = setup
    d = start_daemon(str(32 * slot(model)))
    with d.client() as c:
        r = rp.replay(c, model, trace, rp.ReplayOptions(compute_ms=0.5, warm=4, tokens=8))
    assert r.budget_bytes == 32 * slot(model) and r.hits + r.misses == r.accesses == 8 * LAYERS * TOP_K


def test_plan_cli_matches_the_policy_replay(setup, tmp_path):
    from moed.lab import policies

    model, trace, trace_path = setup
    png = tmp_path / "plan.png"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "moed.ctl",
            "plan",
            str(model),
            "--trace",
            str(trace_path),
            "--drive-gbps",
            "1",
            "--ram",
            "1GiB",
            "--target-tok-s",
            "100",
            "--compute-ms",
            "5",
            "--plot",
            str(png),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    p = json.loads(out.stdout)
    assert png.stat().st_size > 0 and not p["drive_measured"]
    pol = subprocess.run(
        [
            sys.executable,
            "-m",
            "moed.ctl",
            "policy",
            str(trace_path),
            "--policies",
            "g-lru",
            "--sizes",
            "0.25,0.5,0.75",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert pol.returncode == 0, pol.stderr
    for ref in json.loads(pol.stdout):  # `moectl plan` agrees with `moectl policy`
        pt = next(pt for pt in p["curve"] if pt["size"] == ref["size"])
        assert (pt["slots"], pt["hit_rate"]) == (ref["slots"], pytest.approx(ref["hit_rate"]))
    assert pt["hit_rate"] == pytest.approx(policies.replay(trace, "g-lru", size=0.75).hit_rate)
    r = p["recommended"]
    assert r["meets_target"] and r["tok_s"] >= 100 and r["command"].startswith("moed --ram-budget ")


def test_plan_measures_the_drive_when_not_told(setup):
    model, _, trace_path = setup
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "moed.ctl",
            "plan",
            str(model),
            "--trace",
            str(trace_path),
            "--measure-seconds",
            "0.3",
            "--ram",
            "1GiB",
            "--plot",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "measured" in out.stdout and "#" in out.stdout and "moed --ram-budget" in out.stdout
