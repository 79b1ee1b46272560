"""Ling 2.0 (llama.cpp's `bailingmoe2`): fused QKV, a leading dense layer, V3-style sigmoid routing.

What this module owns: the test-model plan `PLAN` of `bailingmoe2`, written as llama.cpp's
loader reads it (`src/models/bailingmoe2.cpp`, `load_arch_hparams` / `load_arch_tensors`).

Kept from the real model (Ling-mini-2.0: 20 layers, 256 experts top-8, one shared expert):
- A leading dense layer (`leading_dense_block_count` 1, the real first_k_dense_replace)
  with a plain `ffn_{gate,up,down}`; every later layer MoE.
- The FFN of an MoE layer: the router reads `ffn_norm-L` (the common case), the file's
  sigmoid gating (`expert_gating_func`, which llama.cpp requires) with the selection bias
  `exp_probs_b`, normalized top-k weights scaled by 2.5, and an ungated dense shared expert
  (experts' width times `expert_shared_count`).
- Attention: one fused `attn_qkv` projection (n_embd query rows, then K and V), per-head
  q/k norms, partial rope (half of each head, the real partial_rotary_factor 0.5).
- `nextn_predict_layers` 0: no MTP layer (the trunk-only GGUFs).

Shrunk: 4 layers; 8 experts top-2; no expert groups (the real n_group 8 / topk_group 4,
which the gate-ahead predictor does not model).
"""

from __future__ import annotations

from moed.gguf.archs import GATING_SIGMOID, Arch
from moed.modelgen.plan import DENSE_LEAD, KV, ArchPlan, Geometry, Quants, Spec, moe_or_dense_ffn


def _attention(g: Geometry, p: str) -> list[Spec]:
    hd = g.head_dim
    return [
        Spec(p + "attn_norm.weight", (g.embd,), "norm"),
        Spec(p + "attn_qkv.weight", (g.embd + 2 * g.kv_heads * hd, g.embd), "f16"),
        Spec(p + "attn_output.weight", (g.embd, g.heads * hd), "f16"),
        Spec(p + "attn_q_norm.weight", (hd,), "norm"),
        Spec(p + "attn_k_norm.weight", (hd,), "norm"),
    ]


def _layer(g: Geometry, i: int, qt: Quants, facts: Arch) -> list[Spec]:
    p = f"blk.{i}."
    return _attention(g, p) + moe_or_dense_ffn(g, i, p, qt, facts)


def _kv(g: Geometry) -> KV:
    return {
        "rope.dimension_count": g.head_dim // 2,
        "leading_dense_block_count": DENSE_LEAD,
        "expert_shared_count": 1,
        "expert_weights_scale": 2.5,
        "expert_weights_norm": True,
        "expert_gating_func": GATING_SIGMOID,
        "nextn_predict_layers": 0,
    }


PLAN = ArchPlan(_layer, _kv)
