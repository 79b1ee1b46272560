"""DeepSeek V4 (llama.cpp's `deepseek4`): compressed sparse attention under hyper-connections, hash-routed first layers.

What this module owns: the test-model plan `PLAN` of `deepseek4`, written as llama.cpp's
loader reads it (`src/models/deepseek4.cpp`, `load_arch_hparams` / `load_arch_tensors`),
and the sizes the tests rely on (`HASH_LAYERS`, `compress_ratio`).

Kept from the real model (DeepSeek-V4-Flash: 43 layers, 256 experts top-6, one shared
expert, 4 hyper-connection streams, the first 3 layers hash-routed):
- Hyper-connections: the residual is `hyper_connection.count` (4, which llama.cpp
  asserts) streams; before attention and before the FFN `hc_{attn,ffn}_fn` ([24, 4 x
  embd]: pre, post and 4 x 4 combine mixes of the RMS-normed streams), `_base` and the
  three `_scale`s make the pre weights that collapse the streams, the post weights and
  the Sinkhorn-normalized combine (`sinkhorn_iterations` 20, `epsilon`) that spread the
  block's output back; `output_hc_{fn,base,scale}` collapse them before `output_norm`.
  The router reads `ffn_norm-L`: rms_norm of the FFN's collapsed input times
  `ffn_norm`, a plain [embd, tokens] row per token, so the hyper-connections are
  upstream of the router and the predictor needs nothing of them.
- Attention: a q latent (`attn_q_a`, `attn_q_a_norm`, `attn_q_b`), one shared kv head
  (`attn_kv`, `attn_kv_a_norm`) of key_length = value_length, partial rope, one sink
  per head, a grouped low-rank output (`attn_output_a`, [groups x rank, heads x head /
  groups] in the file, which llama.cpp reshapes to 3-D, then `attn_output_b`); a
  sliding window on every layer, and per layer a compress ratio
  (`attention.compress_ratios`): 0 (window only), 4 (CSA: `attn_compressor_*` with two
  overlapping halves, plus the lightning indexer `indexer.proj`, `indexer.attn_q_b`,
  `indexer_compressor_*`) or 128 (HCA: `attn_compressor_*` alone).
- The FFN: routed experts with `sqrtsoftplus` gating (LLAMA_EXPERT_GATING_FUNC_TYPE_
  SQRT_SOFTPLUS, the only one the loader accepts), normalized top-k weights scaled by
  the routed scale, SwiGLU clamped at `swiglu_clamp_exp` (routed and shared), plus one
  ungated shared expert. The routed layers select on the probabilities plus
  `exp_probs_b`; the first `hash_layer_count` layers have no `exp_probs_b` and select
  by token id: `ffn_gate_tid2eid` ([vocab, top-k] I32, as the converter writes it)
  gives each token's experts, which llama.cpp gathers and names `ffn_moe_topk-L` as
  any top-k (the router still weights them).
- Quant types: MXFP4 routed experts (the converter repacks the checkpoint's FP4 experts
  to MXFP4), Q8_0 attention projections and shared expert (its FP8 weights), F32
  hyper-connection weights, sinks, compressor position biases and norms, I32 table.

Shrunk: 4 layers, of which 1 hash-routed; ratios 0, then 4 and 128 alternating (a
4-layer model: 0, 4, 128, 4); head size 128 with a rope width of 32 (the real 512 and
64); q latent embd; 2 output groups of rank embd / 2; 2 indexer heads of 64 picking
the top 4 compressed blocks; a window of 32 tokens (the real 128), so a test prompt
slides out of it, and the 128-token HCA blocks are never completed on a test prompt;
the compressor and indexer matrices F16 (BF16 in the real file, which the generator
does not write); the router F32.

Invariants: `attn_output_a` is [heads x head / groups] = 256 wide at the default 4
heads, so the q4_k_m recipe gives it Q4_K; llama.cpp loads it 3-D and stock does not
repack it, so it is not in `archs.DENSE_MATMUL_NAMES` (named there, llama.cpp's
scheduler aborts: checked by hand). `ffn_gate_tid2eid` is written with the model-level
tensors (its shape is the vocabulary's, which only they are given); every token's row
names `used` distinct experts, drawn from the file's random stream.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from gguf import GGMLQuantizationType

from moed.gguf.archs import GATING_SQRT_SOFTPLUS, TOKEN_EXPERTS, Arch
from moed.modelgen.plan import KV, ArchPlan, Geometry, Quants, Spec, routed, shared_expert

Q8_0 = GGMLQuantizationType.Q8_0
HC = 4  # hyper_connection.count: llama.cpp's graph asserts 4
HC_MIX = (2 + HC) * HC  # pre, post and the hc x hc combine
SINKHORN_ITERATIONS = 20
HC_EPS = 1e-6
HASH_LAYERS = 1  # hash_layer_count: the first layers route by token id
HEAD_DIM, ROPE_DIM = 128, 32  # heads x head / groups is 256: attn_output_a takes Q4_K in q4_k_m
O_GROUPS = 2
INDEXER_HEADS, INDEXER_HEAD_DIM, INDEXER_TOP_K = 2, 64, 4
SWA_WINDOW = 32
SWIGLU_LIMIT = 10.0  # the real swiglu_limit
ROUTED_SCALE = 1.5  # the real routed_scaling_factor
COMPRESS_ROPE_BASE = 160000.0  # the real compress_rope_theta


def compress_ratio(i: int) -> int:
    """Layer i's compress ratio: 0 on the hash layers, then 4 (CSA) and 128 (HCA) alternating."""
    if i < HASH_LAYERS:
        return 0
    return 4 if (i - HASH_LAYERS) % 2 == 0 else 128


def q_lora_rank(g: Geometry) -> int:
    return g.embd


def o_lora_rank(g: Geometry) -> int:
    return g.embd // O_GROUPS


def _q8(spec: Spec) -> Spec:
    return dataclasses.replace(spec, qtype=Q8_0)


def _attention(g: Geometry, i: int, p: str) -> list[Spec]:
    q, heads = q_lora_rank(g), g.heads
    return [
        Spec(p + "attn_norm.weight", (g.embd,), "norm"),
        Spec(p + "attn_sinks.weight", (heads,), "bias"),
        _q8(Spec(p + "attn_q_a.weight", (q, g.embd), "f16")),
        Spec(p + "attn_q_a_norm.weight", (q,), "norm"),
        _q8(Spec(p + "attn_q_b.weight", (heads * HEAD_DIM, q), "f16")),
        _q8(Spec(p + "attn_kv.weight", (HEAD_DIM, g.embd), "f16")),
        Spec(p + "attn_kv_a_norm.weight", (HEAD_DIM,), "norm"),
        # ggml [heads x head / groups, groups x rank] in the file; the loader reshapes it to 3-D
        _q8(Spec(p + "attn_output_a.weight", (O_GROUPS * o_lora_rank(g), heads * HEAD_DIM // O_GROUPS), "f16")),
        _q8(Spec(p + "attn_output_b.weight", (g.embd, O_GROUPS * o_lora_rank(g)), "f16")),
    ]


def _hc(g: Geometry, p: str) -> list[Spec]:
    """One hyper-connection mixer `p` (`blk.L.hc_attn_`, `blk.L.hc_ffn_`): F32, as the real file."""
    return [
        Spec(p + "fn.weight", (HC_MIX, HC * g.embd), "router"),  # strong: the gates and combines vary
        Spec(p + "base.weight", (HC_MIX,), "bias"),
        Spec(p + "scale.weight", (3,), "norm"),
    ]


def _compressor(g: Geometry, i: int, p: str) -> list[Spec]:
    ratio = compress_ratio(i)
    if ratio == 0:
        return []
    width = (2 if ratio == 4 else 1) * HEAD_DIM  # CSA's two overlapping halves
    specs = [
        Spec(p + "attn_compressor_kv.weight", (width, g.embd), "f16"),
        Spec(p + "attn_compressor_gate.weight", (width, g.embd), "f16"),
        Spec(p + "attn_compressor_ape.weight", (ratio, width), "bias"),
        Spec(p + "attn_compressor_norm.weight", (HEAD_DIM,), "norm"),
    ]
    if ratio == 4:  # the lightning indexer over the compressed blocks
        specs += [
            Spec(p + "indexer.proj.weight", (INDEXER_HEADS, g.embd), "f16"),
            Spec(p + "indexer.attn_q_b.weight", (INDEXER_HEADS * INDEXER_HEAD_DIM, q_lora_rank(g)), "f16"),
            Spec(p + "indexer_compressor_kv.weight", (2 * INDEXER_HEAD_DIM, g.embd), "f16"),
            Spec(p + "indexer_compressor_gate.weight", (2 * INDEXER_HEAD_DIM, g.embd), "f16"),
            Spec(p + "indexer_compressor_ape.weight", (ratio, 2 * INDEXER_HEAD_DIM), "bias"),
            Spec(p + "indexer_compressor_norm.weight", (INDEXER_HEAD_DIM,), "norm"),
        ]
    return specs


def _layer(g: Geometry, i: int, qt: Quants, facts: Arch) -> list[Spec]:
    p = f"blk.{i}."
    # routed(): ffn_norm, the router, exp_probs_b on the routed layers (the hash layers'
    # table is a model-level tensor), then the experts; the shared expert in Q8_0.
    ffn = routed(g, p, qt, facts, selection_bias=i >= HASH_LAYERS) + [_q8(s) for s in shared_expert(g, p, gated=False)]
    return [*_attention(g, i, p), *_hc(g, p + "hc_attn_"), *_hc(g, p + "hc_ffn_"), *_compressor(g, i, p), *ffn]


def _token_experts(vocab: int, experts: int, used: int):
    def values(rng: np.random.Generator) -> np.ndarray:
        return np.argsort(rng.random((vocab, experts)), axis=1)[:, :used].astype(np.int32)

    return values


def _model_tensors(g: Geometry, vocab: int) -> list[Spec]:
    table = [
        Spec(
            f"blk.{i}.{TOKEN_EXPERTS}",
            (vocab, g.used),
            "token_experts",
            GGMLQuantizationType.I32,
            _token_experts(vocab, g.experts, g.used),
        )
        for i in range(min(HASH_LAYERS, g.layers))
    ]
    return [
        Spec("output_hc_fn.weight", (HC, HC * g.embd), "router"),
        Spec("output_hc_base.weight", (HC,), "bias"),
        Spec("output_hc_scale.weight", (1,), "norm"),
        *table,
    ]


def _kv(g: Geometry) -> KV:
    return {
        "attention.key_length": HEAD_DIM,
        "attention.value_length": HEAD_DIM,
        "rope.dimension_count": ROPE_DIM,
        "attention.q_lora_rank": q_lora_rank(g),
        "attention.sliding_window": SWA_WINDOW,
        "expert_shared_count": 1,
        "expert_weights_scale": ROUTED_SCALE,
        "expert_weights_norm": True,
        "expert_gating_func": GATING_SQRT_SOFTPLUS,
        "swiglu_clamp_exp": [SWIGLU_LIMIT] * g.layers,
        "swiglu_clamp_shexp": [SWIGLU_LIMIT] * g.layers,
        "attention.indexer.head_count": INDEXER_HEADS,
        "attention.indexer.key_length": INDEXER_HEAD_DIM,
        "attention.indexer.top_k": INDEXER_TOP_K,
        "attention.output_group_count": O_GROUPS,
        "attention.output_lora_rank": o_lora_rank(g),
        "attention.compress_rope_freq_base": COMPRESS_ROPE_BASE,
        "attention.compress_ratios": [compress_ratio(i) for i in range(g.layers)],
        "hyper_connection.count": HC,
        "hyper_connection.sinkhorn_iterations": SINKHORN_ITERATIONS,
        "hyper_connection.epsilon": HC_EPS,
        "hash_layer_count": HASH_LAYERS,
        "embedding_length_out": HC * g.embd,
    }


# One kv head: the shared `attn_kv` row is every head's key and value.
PLAN = ArchPlan(_layer, _kv, kv_heads=lambda heads, kv_heads: 1, expert_quant="mxfp4", model_tensors=_model_tensors)
