"""GLM-5 (llama.cpp's `glm-dsa`): MLA attention with DeepSeek's sparse-attention lightning indexer, V3-style MoE.

What this module owns: the test-model plan `PLAN` of `glm-dsa`, written as llama.cpp's
loader reads it (`src/models/glm-dsa.cpp`, `load_arch_hparams` / `load_arch_tensors`),
and the sizes the tests rely on (`INDEXER_TOP_K`, `indexer_full`).

Kept from the real model (GLM-5 / 5.1 / 5.2, `GlmMoeDsaForCausalLM`: 78 layers, the
first 3 dense, 256 routed experts top-8 and one shared expert):
- Attention is DeepSeek's MLA as llama.cpp reads it: a q latent (`attn_q_a`,
  `attn_q_a_norm`, `attn_q_b` with a no-rope and a rope part per head, 3:1 as the real
  192 + 64), one compressed kv latent plus a shared rope key (`attn_kv_a_mqa`,
  `attn_kv_a_norm`), the split `attn_k_b` / `attn_v_b` the converter writes (3-D,
  absorbed into the query and applied to the attention output), `attn_output`. The file
  says MQA as the converter does: one kv head, key_length = kv latent + rope key,
  value_length = kv latent, and the per-head sizes in `key_length_mla` /
  `value_length_mla` (their presence is what makes llama.cpp take it as MLA).
- The lightning indexer (DSA): per layer `indexer.attn_q_b` (from the q latent),
  `indexer.attn_k` with a LayerNorm (`indexer.k_norm` weight and bias), the per-head
  weights `indexer.proj`; llama.cpp ropes and Hadamard-rotates q and k, keeps the
  indexer keys in a cache of their own and unmasks only each query's `indexer.top_k`
  best keys in the MLA attention. `attention.indexer.types` is GLM-5.2's: the first
  layers "full" (own indexer), then one full in four; a "shared" layer reuses the
  previous full layer's top-k and carries no indexer tensors (llama.cpp marks them
  not required and reads them only in full layers).
- The FFN: DeepSeek-V3's (plan.moe_or_dense_ffn): a leading dense layer, then a router
  reading `ffn_norm-L`, sigmoid gating (`expert_gating_func`, as the converter writes it
  from `scoring_func`) with the selection bias `exp_probs_b`, normalized top-k weights
  scaled by `expert_weights_scale` (the real routed_scaling_factor 2.5), one ungated
  shared expert of the experts' width.
- Rope: llama.cpp's NORM type (adjacent pairs), over the rope part of each head only
  (and over the first rope-width values of each indexer head).

Shrunk: 4 layers, 1 leading dense (the real 3); q latent embd wide (the real 2048 of
6144: embd keeps it a whole number of k-quant blocks in q4_k_m), kv latent 64 (512);
per head 96 no-rope + 32 rope (192 + 64) and values 64 wide (256); 8 indexer heads of 64
(32 of 128), top 16 keys (2048), so a test prompt and its greedy steps are attended
sparsely; indexer types full, full, full, shared (the real 5.2 pattern's first four);
no NextN/MTP layer (`nextn_predict_layers` 0: the real files append one block of
full layer tensors, experts included, that llama.cpp skips unless it loads MTP); all
matrices F16 (the converter writes `indexer.proj` F32; llama.cpp's Q4_K_M quantizes it
with the rest, as the q4_k_m recipe here does).

Invariants: the indexer head size is a power of two of at least 64 (llama.cpp's
Hadamard rotation is one matrix of that size) and at least the rope width; the
n_ctx_train of a test model is below 2^20, so without `attention.indexer.types`
llama.cpp would make every layer full (its GLM-5/5.1 fallback).
"""

from __future__ import annotations

from moed.gguf.archs import GATING_SIGMOID, Arch
from moed.modelgen.plan import DENSE_LEAD, KV, ArchPlan, Geometry, Quants, Spec, moe_or_dense_ffn

QK_NOPE, QK_ROPE = 96, 32  # per head: no-rope and rope parts of q and k (the real 192 + 64)
V_HEAD = 64  # value width per head after attn_v_b (the real 256)
KV_LORA = 64  # the compressed kv latent (the real 512)
INDEXER_HEADS, INDEXER_HEAD_DIM, INDEXER_TOP_K = 8, 64, 16
ROUTED_SCALE = 2.5  # the real routed_scaling_factor
FULL_INDEXER_LEAD = 2  # GLM-5.2: layers 0-1 full, then one full in four from layer 2


def q_lora_rank(g: Geometry) -> int:
    return g.embd


def indexer_full(i: int) -> bool:
    """Whether layer i has its own indexer (GLM-5.2's pattern); a shared one reuses the last full top-k."""
    return i < FULL_INDEXER_LEAD or (i - FULL_INDEXER_LEAD) % 4 == 0


def _attention(g: Geometry, i: int, p: str) -> list[Spec]:
    qr, k_mla = q_lora_rank(g), QK_NOPE + QK_ROPE
    specs = [
        Spec(p + "attn_norm.weight", (g.embd,), "norm"),
        Spec(p + "attn_q_a.weight", (qr, g.embd), "f16"),
        Spec(p + "attn_q_a_norm.weight", (qr,), "norm"),
        Spec(p + "attn_q_b.weight", (g.heads * k_mla, qr), "f16"),
        Spec(p + "attn_kv_a_mqa.weight", (KV_LORA + QK_ROPE, g.embd), "f16"),
        Spec(p + "attn_kv_a_norm.weight", (KV_LORA,), "norm"),
        Spec(p + "attn_k_b.weight", (g.heads, KV_LORA, QK_NOPE), "f16"),
        Spec(p + "attn_v_b.weight", (g.heads, V_HEAD, KV_LORA), "f16"),
        Spec(p + "attn_output.weight", (g.embd, g.heads * V_HEAD), "f16"),
    ]
    if indexer_full(i):
        specs += [
            Spec(p + "indexer.k_norm.weight", (INDEXER_HEAD_DIM,), "norm"),
            Spec(p + "indexer.k_norm.bias", (INDEXER_HEAD_DIM,), "bias"),
            Spec(p + "indexer.proj.weight", (INDEXER_HEADS, g.embd), "f16"),
            Spec(p + "indexer.attn_k.weight", (INDEXER_HEAD_DIM, g.embd), "f16"),
            Spec(p + "indexer.attn_q_b.weight", (INDEXER_HEADS * INDEXER_HEAD_DIM, qr), "f16"),
        ]
    return specs


def _layer(g: Geometry, i: int, qt: Quants, facts: Arch) -> list[Spec]:
    p = f"blk.{i}."
    return _attention(g, i, p) + moe_or_dense_ffn(g, i, p, qt, facts)


def _kv(g: Geometry) -> KV:
    return {
        "attention.key_length": KV_LORA + QK_ROPE,  # MLA's cache row: the kv latent and the rope key
        "attention.value_length": KV_LORA,
        "attention.key_length_mla": QK_NOPE + QK_ROPE,
        "attention.value_length_mla": V_HEAD,
        "attention.q_lora_rank": q_lora_rank(g),
        "attention.kv_lora_rank": KV_LORA,
        "rope.dimension_count": QK_ROPE,
        "leading_dense_block_count": DENSE_LEAD,
        "expert_shared_count": 1,
        "expert_weights_scale": ROUTED_SCALE,
        "expert_weights_norm": True,
        "expert_gating_func": GATING_SIGMOID,
        "nextn_predict_layers": 0,  # no MTP block
        "attention.indexer.head_count": INDEXER_HEADS,
        "attention.indexer.key_length": INDEXER_HEAD_DIM,
        "attention.indexer.top_k": INDEXER_TOP_K,
        "attention.indexer.types": [indexer_full(i) for i in range(g.layers)],
    }


# One kv head: MLA's latent is every head's key and value (the converter's MQA).
PLAN = ArchPlan(_layer, _kv, kv_heads=lambda heads, kv_heads: 1)
