"""Pure pieces of the engine's look-ahead: the predictor's math, the prefetch counts, the governor."""

from __future__ import annotations

import numpy as np
import pytest

from moed.engines.governor import PrefetchGovernor
from moed.engines.lookahead import Lookahead
from moed.engines.predictor import (
    GATING_SIGMOID,
    GATING_SOFTMAX_WEIGHT,
    GatePredictor,
    Router,
    gate,
    router_input,
    tensor_f32,
    top,
)
from moed.engines.sources import ExpertSource

E, D, LAYERS = 16, 32, [1, 2, 3, 4]


def routers(seed: int = 0, bias: bool = False) -> dict[int, Router]:
    rng = np.random.default_rng(seed)
    return {
        l: Router(
            rng.standard_normal((E, D)).astype(np.float32),
            (1 + 0.3 * rng.standard_normal(D)).astype(np.float32),
            rng.standard_normal(E).astype(np.float32) if bias else None,
        )
        for l in LAYERS
    }


def assert_reordered_dot(actual: np.ndarray, x: np.ndarray, w: np.ndarray, offset=0.0) -> None:
    """`actual` equals `x @ w.T + offset` up to the order of each dot product's sum.

    The predictor multiplies by a folded, contiguous copy of the router while the
    oracle multiplies by a transposed view, and BLAS picks its kernel (and so the
    summation order) by layout and CPU: AVX-512 hosts differ by up to 2.4e-6 here.
    A float32 sum of n terms reordered stays within n * eps * sum|x_i w_i| of any
    other order (the classic bound for recursive summation), so that is the tolerance;
    anything beyond it is a different computation, not rounding.
    """
    expected = x @ w.T + offset
    eps = np.finfo(np.float32).eps
    # ... plus one rounding of the offset's addition on each side.
    bound = x.shape[1] * eps * (np.abs(x) @ np.abs(w).T) + 2 * eps * np.abs(expected)
    assert np.all(np.abs(actual - expected) <= bound), np.max(np.abs(actual - expected) - bound)


def test_zero_lead_scores_are_the_router_logits():
    rs = routers()
    p = GatePredictor(rs, LAYERS)
    x = np.random.default_rng(1).standard_normal((5, D)).astype(np.float32)
    assert_reordered_dot(p.scores(x, 2, 2), x, rs[2].weight)


def test_folding_applies_the_norm_ratio():
    rs = routers()
    p = GatePredictor(rs, LAYERS)
    h = np.random.default_rng(2).standard_normal((3, D)).astype(np.float32)
    rms = h / np.sqrt((h * h).mean(axis=1, keepdims=True))
    x1 = rms * rs[1].norm  # what ffn_norm-1 holds
    want = (rms * rs[3].norm) @ rs[3].weight.T  # layer 3's logits on the same stream
    np.testing.assert_allclose(p.logits(x1, 1, 3), want, rtol=1e-4, atol=1e-4)


def test_a_zero_norm_weight_folds_to_zero_not_inf():
    rs = routers()
    rs[1].norm[0] = 0.0
    f = GatePredictor(rs, LAYERS).folded(1, 2)
    assert np.isfinite(f).all() and not f[0].any()


def test_selection_bias_sorts_gated_scores_plus_bias():
    rs = routers(bias=True)
    p = GatePredictor(rs, LAYERS, gating=GATING_SIGMOID)
    x = np.random.default_rng(3).standard_normal((4, D)).astype(np.float32)
    want = 1 / (1 + np.exp(-(x @ rs[2].weight.T))) + rs[2].bias
    np.testing.assert_allclose(p.scores(x, 2, 2), want, rtol=1e-6)
    soft = gate(np.array([[0.0, np.log(3.0)]]), 1)
    np.testing.assert_allclose(soft, [[0.25, 0.75]])


def test_a_router_bias_is_part_of_the_logits_and_softmax_weight_selects_on_them():
    """gpt-oss: scores are W x + c (llama.cpp's ffn_moe_logits_biased), sorted as they are."""
    rs = routers()
    c = np.random.default_rng(5).standard_normal(E).astype(np.float32)
    rs = {l: Router(r.weight, r.norm, None, c) for l, r in rs.items()}
    p = GatePredictor(rs, LAYERS, gating=GATING_SOFTMAX_WEIGHT)
    x = np.random.default_rng(6).standard_normal((4, D)).astype(np.float32)
    assert_reordered_dot(p.scores(x, 2, 2), x, rs[2].weight, c)
    assert not np.array_equal(top(p.scores(x, 2, 2), 2), top(x @ rs[2].weight.T, 2))  # the bias changes choices
    logits = x @ rs[2].weight.T
    np.testing.assert_array_equal(gate(logits, GATING_SOFTMAX_WEIGHT), logits)
    assert (
        router_input("gpt-oss").prefix == b"attn_post_norm-" and router_input("gpt-oss").norm == "post_attention_norm"
    )
    assert router_input("qwen3moe").prefix == b"ffn_norm-"


@pytest.mark.parametrize("n, width", [(16, 4), (256, 8), (8, 8)])
def test_top_is_best_first_either_way(n, width):
    s = np.random.default_rng(4).standard_normal((6, n))
    got = top(s, width)
    want = np.argsort(-s, axis=1)[:, :width]
    np.testing.assert_array_equal(got, want)


def test_tensor_f32_reads_f32_and_f16_bytes():
    from gguf import GGMLQuantizationType as T

    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(tensor_f32(a.tobytes(), T.F32, (4, 3)), a)
    h = a.astype(np.float16)
    np.testing.assert_array_equal(tensor_f32(h.tobytes(), T.F16, (4, 3)), a)


class Drive(ExpertSource):
    """A source with a fixed capacity that records the prefetches it was sent (no daemon needed);
    the rest is ExpertSource's defaults (layers of one capacity share their slots)."""

    moe_layers = LAYERS
    n_expert_used = 2

    def __init__(self, capacity: int | None = None):
        self.cap = capacity
        self.sent: list[tuple[int, list[int]]] = []

    def capacity(self, layer: int) -> int | None:
        return self.cap

    def prefetch(self, layer: int, experts: list[int]) -> None:
        self.sent.append((layer, experts))


def run_step(la: Lookahead, x: np.ndarray, routes: dict[int, np.ndarray], stop_after: int | None = None) -> None:
    la.begin_decode(x.shape[0])
    for layer in LAYERS:
        la.observe(layer, x)
        la.routed(layer, routes[layer], granted=len(np.unique(routes[layer])), stall_s=0.001)
        if layer == stop_after:
            break
    la.end_decode()


def counts_add_up(t: dict) -> bool:
    per = t["per_layer"].values()
    return t["prefetch_issued"] == t["prefetch_hits"] + t["prefetch_wasted"] + t["prefetch_pending"] and all(
        p["issued"] == p["hits"] + p["wasted"] + p["pending"] for p in per
    )


@pytest.mark.parametrize("mode", ["gate", "gate2"])
def test_counts_add_up_and_prefetches_follow_the_prediction(mode):
    rng = np.random.default_rng(5)
    p, drive = GatePredictor(routers(), LAYERS), Drive()
    la = Lookahead(p, drive, mode, width=2, adapt=False)
    for _ in range(6):
        x = rng.standard_normal((1, D)).astype(np.float32)
        routes = {l: top(p.scores(x, l, l), 2) for l in LAYERS}
        run_step(la, x, routes)
    t = la.totals()
    assert counts_add_up(t) and t["prefetch_pending"] == 0
    assert t["per_layer"][1]["issued"] == 0
    assert {layer for layer, _ in drive.sent} == {2, 3, 4}
    assert all(len(e) <= 2 for _, e in drive.sent)
    assert t["prefetch_hits"] > 0 and 0 < t["prediction_recall"] <= 1
    if mode == "gate2":
        assert t["prediction_recall2"] is not None


def test_a_stopped_graph_leaves_nothing_pending():
    p, drive = GatePredictor(routers(), LAYERS), Drive()
    la = Lookahead(p, drive, "gate2", width=2, adapt=False)
    x = np.ones((1, D), np.float32)
    run_step(la, x, {l: np.array([[0, 1]]) for l in LAYERS}, stop_after=2)  # layers 3, 4 never route
    t = la.totals()
    assert counts_add_up(t) and t["prefetch_pending"] == 0
    assert (
        t["per_layer"][3]["wasted"] + t["per_layer"][4]["wasted"]
        == (t["per_layer"][3]["issued"] + t["per_layer"][4]["issued"])
        > 0
    )


def test_a_batch_touching_most_experts_prefetches_the_whole_layer_within_capacity():
    rng = np.random.default_rng(6)
    p = GatePredictor(routers(), LAYERS)
    x = rng.standard_normal((64, D)).astype(np.float32)
    routes = {l: top(p.scores(x, l, l), 2) for l in LAYERS}
    wide = Drive()
    run_step(Lookahead(p, wide, "gate", width=2, adapt=False), x, routes)
    assert any(len(e) == E for _, e in wide.sent)
    tight = Drive(capacity=E + 5)  # the current layer holds all E: 5 slots of room
    run_step(Lookahead(p, tight, "gate", width=2, adapt=False), x, routes)
    assert all(len(np.unique(routes[l])) == E for l in LAYERS)
    assert tight.sent and all(len(e) == 5 for _, e in tight.sent)


def test_off_issues_nothing_and_does_not_observe():
    la = Lookahead(GatePredictor(routers(), LAYERS), Drive(), "off", width=2)
    assert not la.observing and la.governor is None


def drive_governor(g: PrefetchGovernor, on_s: float, off_s: float, steps: int, precision: float = 1.0) -> list[str]:
    modes = []
    for _ in range(steps):
        mode = g.begin(decode_step=True)
        modes.append(mode)
        if mode != "off":
            g.scored(round(100 * precision), 100)
        g.end(on_s if mode == "on" else off_s)
    return modes


@pytest.mark.parametrize("faster_on", [True, False])
def test_governor_runs_the_faster_arm_between_paired_probes(faster_on):
    g = PrefetchGovernor(probe=4, stint=8, stint_max=32, skip=2)
    win = "on" if faster_on else "off"
    modes = drive_governor(g, 0.010 if faster_on else 0.012, 0.012 if faster_on else 0.010, 400)
    assert modes[:2] == ["shadow", "shadow"]  # cold steps: predict, send nothing, not timed
    assert modes[2:6] == ["on", "off", "on", "off"]  # the probe pairs the arms step by step
    assert set(modes[6:14]) == {win}  # then runs the winner for `stint` steps
    assert modes[14:18] == ["on", "off", "on", "off"]
    assert set(modes[18:34]) == {win}  # the same winner: the stint doubles
    share_loser = sum(m != win for m in modes[200:]) / len(modes[200:])
    assert share_loser == pytest.approx(2 / 36, abs=0.02)  # half of each probe, once the stint is 32
    assert g.last_median_s["on"] == (0.010 if faster_on else 0.012)
    assert (g.state()["prefetch_on_vs_off"] < 1) == faster_on


def test_governor_below_the_precision_floor_stays_off_and_only_shadows():
    g = PrefetchGovernor(probe=4, stint=8, stint_max=32, skip=5, skip_shadow=2, shadow_probe=2)
    modes = drive_governor(g, 0.008, 0.012, 200, precision=0.6)  # faster on, but much of it wrong
    assert modes[:5] == ["shadow", "shadow", "off", "off", "off"]  # cold: measured, then known low
    assert "on" not in modes[5:]  # never issues again
    # a probe below the floor is 2 shadow steps (no timing to pair), then stints that double
    assert modes[5:7] == ["shadow", "shadow"] and set(modes[7:15]) == {"off"}
    assert modes[15:17] == ["shadow", "shadow"] and set(modes[17:33]) == {"off"}
    assert modes[33:35] == ["shadow", "shadow"] and set(modes[35:67]) == {"off"}
    assert g.steps["shadow"] == 2 + 2 * 7  # probes at steps 5, 15, 33, then every 34 (the stint at its 32)
    assert g.state()["prefetch_precision"] == pytest.approx(0.6)


def test_governor_without_a_precision_reads_nothing_ahead_and_probes_with_shadow_steps():
    """Steps that name nothing the cache lacks leave no precision (a prompt just read the
    predicted experts in): after its cold shadow steps the governor runs off, and its probes
    are single shadow steps until a precision is known (issue 49: the 16 shadow and 2 sent steps
    of a 64-token decode cost the gate 6% against off on the Qwen3-30B geometry)."""
    g = PrefetchGovernor(probe=4, stint=8, skip=5)
    modes = []
    for _ in range(30):
        modes.append(g.begin(decode_step=True))
        g.scored(0, 0)  # named nothing missing
        g.end(0.01)
    assert modes[:5] == ["shadow", "shadow", "off", "off", "off"]
    assert "on" not in modes and g.precision is None
    assert modes[5] == "shadow" and set(modes[6:14]) == {"off"} and modes[14] == "shadow"
    g.scored(90, 100)  # a step finally names missing experts, and well
    assert g.precision == 0.9
    later = [g.begin(decode_step=True) for _ in range(17)]
    assert "on" in later  # the next probe pairs the arms


def test_governor_cold_steps_after_the_shadow_ones_run_off_then_a_good_precision_probes():
    g = PrefetchGovernor(probe=4, stint=8, skip=5, skip_shadow=2)
    modes = drive_governor(g, 0.010, 0.012, 9, precision=0.9)
    assert modes[:5] == ["shadow", "shadow", "off", "off", "off"]  # measured cold, nothing sent
    assert modes[5:9] == ["on", "off", "on", "off"]


def test_a_probe_ends_off_as_soon_as_its_precision_falls_below_the_floor():
    """The first steps after a prompt name few experts and read high; the probe that begins on
    that figure stops sending at the first step that brings the ratio under the floor."""
    g = PrefetchGovernor(probe=16, stint=32, skip=3, skip_shadow=2, precision_min_named=512)
    modes = []
    for i in range(40):
        mode = g.begin(decode_step=True)
        modes.append(mode)
        if mode != "off":
            g.scored(*((18, 20) if i < 2 else (80, 172)))  # cold: 0.9 on 40 named; then 0.47
        g.end(0.01)
    assert modes[:3] == ["shadow", "shadow", "off"]
    assert modes[3] == "on" and modes.count("on") == 1  # one step sent, then the ratio is 0.46
    assert set(modes[4:36]) == {"off"} and g.precision < g.precision_floor


def test_governor_turns_off_at_once_when_precision_drops_during_a_stint():
    g = PrefetchGovernor(probe=4, stint=32, skip=2, precision_alpha=1.0)
    drive_governor(g, 0.010, 0.012, 10)  # on won the first probe, kept on
    assert g.mode == "on"
    g.scored(50, 100)  # the predictions went bad
    assert g.begin(decode_step=True) in ("shadow", "off")


def test_governor_weighs_several_probes_against_one_noisy_one():
    g = PrefetchGovernor(probe=2, stint=2, stint_max=2, skip=0, memory=4, precision=0.9)  # above the floor
    for _ in range(3):  # three probes: on 17% faster
        for _ in range(4):
            g.end(0.010 if g.begin(decode_step=True) == "on" else 0.012)
    for _ in range(2):  # one probe where on looks 5% slower
        g.end(0.0126 if g.begin(decode_step=True) == "on" else 0.012)
    assert g.begin(decode_step=True) == "on"  # the mean verdict still says on


def test_governor_ignores_an_outlier_step():
    g = PrefetchGovernor(probe=6, stint=8, skip=0, precision=0.9)
    for t in [0.010, 0.012, 0.5, 0.012, 0.010, 0.012]:  # one preempted 'on' step
        g.begin(decode_step=True)
        g.end(t)
    assert g.begin(decode_step=True) == "on"  # the median still says on is faster


def test_governor_runs_prompt_batches_on_their_own_precision_and_uncounted():
    g = PrefetchGovernor(probe=2, skip=0, batch_probe_every=8, trial_min_named=10)
    assert g.begin(decode_step=False) == "on"  # the trial: sent, scored as it goes
    assert not g.cut(2, 9)  # too little named to judge
    assert not g.cut(6, 10)  # 0.6: below the floor, not the trial's bar (first layers predict worse)
    assert g.cut(4, 10)  # 0.4 on enough: the rest of the batch only shadows
    assert not g.cut(4, 10)  # once
    g.scored(6, 10)  # 0.6: below the floor
    g.end(5.0)
    assert g.last_median_s == {"on": None, "off": None} and g.steps == {"on": 0, "off": 0, "shadow": 0}
    assert g.precision is None and g.batch_precision == 0.6  # the decode precision is untouched
    seen = []
    for _ in range(7):  # batches 2..8: off, and the 8th a shadow that may see it rise
        seen.append(g.begin(decode_step=False))
        g.scored(0, 0)
        g.end(1.0)
    assert seen == ["off"] * 6 + ["shadow"]
    g.scored(10, 10)  # the shadow batch's score (scored before end, as the look-ahead does)
    assert g.batch_precision == 0.8
    assert g.begin(decode_step=False) == "on"
    assert not g.cut(0, 100)  # not a trial: only the first batch is cut mid-way


def test_a_trial_batch_that_predicts_well_is_sent_whole():
    g = PrefetchGovernor(trial_min_named=10)
    assert g.begin(decode_step=False) == "on"
    assert not g.cut(9, 10) and not g.cut(90, 100)
    g.scored(90, 100)
    g.end(1.0)
    assert g.batch_precision == 0.9 and g.begin(decode_step=False) == "on"


def test_shadow_steps_name_prefetches_for_the_governor_but_send_nothing():
    rng = np.random.default_rng(7)
    p, drive = GatePredictor(routers(), LAYERS), Drive()
    la = Lookahead(p, drive, "gate", width=2)
    la.governor.skip, la.governor.precision = 0, 0.1  # below the floor: every probe is a shadow one
    for _ in range(8):
        x = rng.standard_normal((1, D)).astype(np.float32)
        run_step(la, x, {l: top(p.scores(x, l, l), 2) for l in LAYERS})
    t = la.totals()
    assert drive.sent == [] and t["prefetch_issued"] == 0
    assert t["prefetch_steps_shadow"] > 0
    assert t["prefetch_precision"] > 0.1  # the shadow steps measured it


def test_cache_estimate_is_an_lru_per_class():
    from moed.engines.cache_estimate import CacheEstimate

    r = CacheEstimate(lambda layer: 3, lambda layer: layer % 2)  # odd and even layers: two classes
    r.touch(0, [1, 2])
    r.touch(2, [1])  # same class as layer 0
    assert r.missing(0, [1, 2, 3]) == [3]
    r.touch(2, [5])  # a fourth key evicts (0, 1)
    assert r.missing(0, [1, 2]) == [1]
    assert r.missing(1, [1]) == [1]  # the other class is separate
    unknown = CacheEstimate(lambda layer: None, lambda layer: 0)
    unknown.touch(0, [1])
    assert unknown.missing(0, [1, 2]) == [1, 2]  # no capacity: assume nothing


def test_an_engine_whose_experts_fit_stops_sending_once_warm():
    rng = np.random.default_rng(8)
    p, drive = GatePredictor(routers(), LAYERS), Drive(capacity=E * len(LAYERS))
    la = Lookahead(p, drive, "gate", width=2, adapt=False)
    xs = [rng.standard_normal((1, D)).astype(np.float32) for _ in range(40)]
    for x in xs * 2:  # the same 40 tokens twice
        run_step(la, x, {l: top(p.scores(x, l, l), 2) for l in LAYERS})
    sent_first = len(drive.sent)
    for x in xs:
        run_step(la, x, {l: top(p.scores(x, l, l), 2) for l in LAYERS})
    assert sent_first > 0 and len(drive.sent) == sent_first  # warm: everything it predicts is held
    assert la.totals()["prefetch_skipped_resident"] > 0


def test_the_last_layer_of_a_batch_is_prefetched_for_its_output_rows_once_seen():
    rng = np.random.default_rng(9)
    p, drive = GatePredictor(routers(), LAYERS), Drive()
    la = Lookahead(p, drive, "gate", width=2, adapt=False)
    x = rng.standard_normal((48, D)).astype(np.float32)
    routes = {l: top(p.scores(x, l, l), 2) for l in LAYERS}
    routes[LAYERS[-1]] = routes[LAYERS[-1]][-1:]  # only the output row, as llama.cpp does
    run_step(la, x, routes)
    first = [e for layer, e in drive.sent if layer == LAYERS[-1]]
    drive.sent.clear()
    run_step(la, x, routes)
    second = [e for layer, e in drive.sent if layer == LAYERS[-1]]
    assert len(first[0]) > 2  # the first batch predicted every row
    assert 0 < len(second[0]) <= 2  # then only the output row's top 2
    t = la.totals()
    assert counts_add_up(t)


def test_multi_token_prediction_layers_are_not_graph_layers():
    """GLM-4.5 / DeepSeek-V3 files carry nextn_predict_layers MTP blocks (experts
    included) that llama.cpp's graph never runs: nothing is predicted or prefetched for them."""
    from moed.engines.predictor import graph_moe_layers

    glm = {"general.architecture": "glm4moe", "glm4moe.block_count": 47, "glm4moe.nextn_predict_layers": 1}
    assert graph_moe_layers(glm, range(1, 47)) == list(range(1, 46))
    assert graph_moe_layers({**glm, "glm4moe.nextn_predict_layers": 0}, range(1, 47)) == list(range(1, 47))
    assert graph_moe_layers({"general.architecture": "qwen3moe"}, [0, 1, 2]) == [0, 1, 2]


def test_a_trial_batch_that_predicts_badly_stops_sending_mid_batch():
    """The first prompt batch sends before any batch precision is known; once what it named
    proves wrong, its later layers only name (a bad predictor wastes reads once, briefly)."""
    x = np.random.default_rng(11).standard_normal((8, D)).astype(np.float32)  # a batch: over DECODE_ROWS
    routes = {l: np.array([[0, 1]] * 8, dtype=np.int32) for l in LAYERS}  # whatever was predicted
    p, drive = GatePredictor(routers(), LAYERS), Drive()
    la = Lookahead(p, drive, "gate", width=2)
    la.governor.trial_min_named = 3
    run_step(la, x, routes)
    assert [layer for layer, _ in drive.sent] == [2]  # sent for layer 2; layer 2's score cut the rest
    assert la.governor.batch_precision is not None and la.governor.batch_precision < 0.8
    assert counts_add_up(la.totals())
