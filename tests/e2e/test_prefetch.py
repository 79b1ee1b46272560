"""The engine sees ahead: the predictor against llama.cpp's own top-k, and prefetch that changes no logit."""

from __future__ import annotations

import numpy as np
import pytest

from moed.engines.lookahead import AheadObserver
from tests.e2e.conftest import LLAMA_KW, PROMPT, assert_bit_equal, greedy_logits

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")  # e2e needs the real llama.cpp (pyproject extra "llama")

NEAR_TIE = 1e-4


class ZeroLead(AheadObserver):
    """Applies layer L's own router at ffn_norm-L and compares with llama.cpp's ffn_moe_topk-L."""

    def __init__(self, predictor):
        self.predictor = predictor
        self.hidden_rows: dict[int, np.ndarray] = {}
        self.equal = self.differ = self.near_ties = 0
        self.layers_checked: set[int] = set()

    def hidden(self, layer: int, x: np.ndarray) -> None:
        self.hidden_rows[layer] = x.copy()

    def route(self, layer: int, ids: np.ndarray) -> None:
        from moed.engines.predictor import top

        if layer in self.predictor.hashed:  # deepseek4: chosen by token id (tests/e2e/test_deepseek4.py)
            self.hidden_rows.pop(layer)
            return
        scores = self.predictor.scores(self.hidden_rows.pop(layer), layer, layer)
        k = ids.shape[1]
        ranked = -np.sort(-scores, axis=1)
        mine = top(scores, k)
        for row in range(ids.shape[0]):
            if ranked[row, k - 1] - ranked[row, k] < NEAR_TIE:
                self.near_ties += 1  # rounding may flip a near-tie: not a test of the math
                continue
            same = set(mine[row].tolist()) == set(ids[row].tolist())
            self.equal += same
            self.differ += not same
        self.layers_checked.add(layer)

    def decoded(self) -> None:
        pass


def engine(daemon, path, budget=None, **kw):
    from moed.engines.llama_cpp import StreamedLlama

    client = daemon.client("e2e")
    return StreamedLlama(str(path), client=client, **{**LLAMA_KW, **kw}), client


@pytest.mark.parametrize(
    "model",
    [
        "tiny_model",
        "aligned_model",
        "split_model",
        "mixed_model",
        "trained_model",
        "olmoe_model",
        "qwen2moe_model",
        "deepseek2_model",
        "mixtral_model",
        "gpt_oss_model",  # router bias on the logits, SOFTMAX_WEIGHT, input at attn_post_norm-L
        "glm4moe_model",  # sigmoid gating with exp_probs_b, input at post_attn_norm-L
        "qwen35moe_model",  # DeltaNet and attention layers, all MoE; input at attn_post_norm-L
        "qwen3next_model",  # the same layout, fused ssm_ba
        "gemma4_model",  # router on rms_norm(attn_out) * ffn_gate_inp.scale, rebuilt from ffn_norm_2-L
        "glm_dsa_model",  # sigmoid with exp_probs_b at ffn_norm-L after MLA + sparse (indexer) attention
        "qwen4exp_model",  # router on the FFN hyper-connection mix, computed from hc_combine-L
        "deepseek4_model",  # sqrtsoftplus with exp_probs_b at ffn_norm-L; layer 0 hash-routed: not predicted
        "llama4_model",  # top-k on the logits; input rebuilt as rms_norm(ffn_inp-L) * ffn_norm
        "dots1_model",  # sigmoid with exp_probs_b at ffn_norm-L, a leading dense layer
        "ernie4_5_moe_model",  # softmax (fixed by the graph) with exp_probs_b, a leading dense layer
        "hunyuan_moe_model",  # softmax fixed by the graph, a shared MLP in every layer
        "bailingmoe2_model",  # sigmoid with exp_probs_b, a leading dense layer, fused attn_qkv
        "minimax_m2_model",  # sigmoid with exp_probs_b, no shared expert
        "kimi_k3_model",  # sigmoid with exp_probs_b at ffn_norm-L (full width); experts in the latent space
        "minimax_m3_model",  # sigmoid with exp_probs_b at ffn_norm-L, a leading dense layer, MSA attention
    ],
)
def test_predictor_at_zero_lead_is_llama_cpps_top_k(request, start_daemon, model):
    path = request.getfixturevalue(model)
    llm, client = engine(start_daemon(), path, prefetch="off")
    try:
        check = ZeroLead(llm.streamer.lookahead.predictor)
        llm.streamer.observers.append(check)
        llm.streamer.record_predictions(check, llm.streamer.source.n_expert_used)
        greedy_logits(llm, llm.tokenize(PROMPT), steps=12)
        moe_layers = llm.streamer.source.moe_layers
    finally:
        llm.close()
        client.close()
    assert check.differ == 0, f"{check.differ} token-layers differ from llama.cpp's top-k"
    assert check.layers_checked == set(moe_layers) - check.predictor.hashed
    assert check.equal >= 0.95 * (check.equal + check.near_ties) and check.equal > 50


@pytest.mark.parametrize("mode", ["gate", "gate2"])
@pytest.mark.parametrize(
    "model, budget",
    [
        ("aligned_model", "2MiB"),  # zero copy, ~10 slots of 32 experts: evicts between layers
        ("tiny_model", "256KiB"),  # copy path, ~10 slots of 32
        ("trained_model", "1MiB"),  # learned routing, copy path, ~17 slots of 96
        ("gpt_oss_model", "256KiB"),  # the look-ahead stops at attn_post_norm-L (no ffn_norm)
        ("qwen35moe_model", "256KiB"),  # hybrid: DeltaNet layers between the MoE FFNs predicted across
        ("gemma4_model", "256KiB"),  # the look-ahead stops at the residual attn_out-L; fused gate_up parts
        ("deepseek4_model", "256KiB"),  # a hash-routed first layer predicts the routed layers after it
        ("llama4_model", "256KiB"),  # the look-ahead stops at the residual ffn_inp-L and norms it
        ("kimi_k3_model", "256KiB"),  # KDA/MLA hybrid; the experts' parts are latent-wide (32 x 64), not embd
    ],
)
def test_logits_bit_exact_with_prefetch_at_an_evicting_budget(
    request, start_daemon, reference_logits, model, budget, mode
):
    path = request.getfixturevalue(model)
    _, want = reference_logits(path)
    llm, client = engine(start_daemon(budget), path, prefetch=mode, prefetch_adapt=False)
    try:
        got = greedy_logits(llm, llm.tokenize(PROMPT))
        st = llm.stream_stats()
        daemon_stats = client.stats()
    finally:
        llm.close()
        client.close()
    assert_bit_equal(got, want)
    assert daemon_stats["evictions"] > 0
    assert daemon_stats["prefetches"] > 0, "the engine's prefetches never reached the drive"
    assert st["prefetch_issued"] > 0 and st["prefetch_hits"] > 0
    assert st["prediction_recall"] is not None and 0 < st["prediction_recall"] <= 1
    if mode == "gate2":
        assert st["prediction_recall2"] is not None
    assert_counters_add_up(st)


def assert_counters_add_up(st: dict) -> None:
    assert st["prefetch_issued"] == st["prefetch_hits"] + st["prefetch_wasted"] + st["prefetch_pending"]
    assert st["prefetch_pending"] == 0  # every decode has ended: every prefetched layer routed
    per = st["per_layer"].values()
    for key in ("issued", "hits", "wasted"):
        assert sum(layer[key] for layer in per) == st[f"prefetch_{key}"]
    for layer in per:
        assert layer["issued"] == layer["hits"] + layer["wasted"] + layer["pending"]
    first = st["per_layer"][min(st["per_layer"])]
    # nothing precedes the first layer; only its token ids, where it is hash-routed (deepseek4):
    # then what was sent is exact
    assert first["recall"] is None and first["wasted"] == 0
    assert st["stall_s"] == pytest.approx(sum(layer["stall_s"] for layer in per))
    assert st["stall_s_per_token"] == pytest.approx(sum(layer["stall_s_per_token"] for layer in per))


def test_prefetch_on_and_off_engines_share_one_daemon(start_daemon, reference_logits, aligned_model):
    _, want = reference_logits(aligned_model)
    d = start_daemon("2MiB")
    on, c_on = engine(d, aligned_model, prefetch="gate", prefetch_adapt=False)
    off, c_off = engine(d, aligned_model, prefetch="off")
    try:
        tokens = on.tokenize(PROMPT)
        rows = {id(on): [], id(off): []}
        for llm in (on, off):
            llm.reset()
            llm.eval(tokens)
            rows[id(llm)].append(llm.scores[: llm.n_tokens].copy())
        for _ in range(32):  # one step each, in turn: they evict each other's slots
            for llm in (on, off):
                llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
                rows[id(llm)].append(llm.scores[llm.n_tokens - 1 : llm.n_tokens].copy())
        st_on, st_off = on.stream_stats(), off.stream_stats()
        stats = c_on.stats()
    finally:
        for llm, c in ((on, c_on), (off, c_off)):
            llm.close()
            c.close()
    assert_bit_equal(np.concatenate(rows[id(on)]), want)
    assert_bit_equal(np.concatenate(rows[id(off)]), want)
    assert len(stats["models"]) == 1 and stats["evictions"] > 0 and stats["prefetches"] > 0
    assert st_on["prefetch_issued"] > 0 and st_off["prefetch_issued"] == 0
    assert st_off["prediction_recall"] is None  # off does not even look
    assert_counters_add_up(st_on)


def test_adaptive_prefetch_measures_both_arms_and_stays_exact(start_daemon, reference_logits, tiny_model):
    _, want = reference_logits(tiny_model)
    llm, client = engine(start_daemon("256KiB"), tiny_model, prefetch="gate")  # adapt is the default
    try:
        got = greedy_logits(llm, llm.tokenize(PROMPT))
        st = llm.stream_stats()
    finally:
        llm.close()
        client.close()
    assert_bit_equal(got, want)
    assert st["prefetch_probes"] >= 1 and 0 < st["prefetch_precision"] <= 1
    assert st["prefetch_steps_shadow"] >= 2  # the cold steps (skip_shadow) measure the precision first
    if st["prefetch_on_vs_off"] is not None:  # a timed probe: both arms ran and were timed
        assert st["prefetch_steps_on"] > 0 and st["prefetch_steps_off"] > 0
        assert st["step_s_on"] > 0 and st["step_s_off"] > 0
    else:  # only shadow probes (below the floor): nothing sent after the cold steps
        assert st["prefetch_steps_off"] > 0
    assert_counters_add_up(st)
