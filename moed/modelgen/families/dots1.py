"""dots.llm1 (llama.cpp's `dots1`): DeepSeek-V3-style routing under plain multi-head attention.

What this module owns: the test-model plan `PLAN` of `dots1`, written as llama.cpp's
loader reads it (`src/models/dots1.cpp`, `load_arch_hparams` / `load_arch_tensors`).

Kept from the real model (dots.llm1: 62 layers, 128 experts top-6, 2 shared experts):
- A leading dense layer (`leading_dense_block_count`, the real first_k_dense_replace 1)
  with a plain `ffn_{gate,up,down}`; every later layer MoE.
- The FFN of an MoE layer: the router reads `ffn_norm-L` (the common case), the file's
  sigmoid gating (`expert_gating_func`) with the selection bias `exp_probs_b`,
  normalized top-k weights scaled by 2.5 (the real routed_scaling_factor), and an ungated
  dense shared expert (`ffn_*_shexp`, experts' width times `expert_shared_count`).
- Attention: multi-head (llama.cpp sizes K and V by n_head, so kv_heads = heads, as the real
  model's), per-head q/k norms, full rope.

Shrunk: 4 layers; 8 experts top-2; one shared expert (`expert_shared_count` 1); no expert groups.
"""

from __future__ import annotations

from moed.gguf.archs import GATING_SIGMOID, Arch
from moed.modelgen.plan import DENSE_LEAD, KV, ArchPlan, Geometry, Quants, Spec, attention, moe_or_dense_ffn


def _layer(g: Geometry, i: int, qt: Quants, facts: Arch) -> list[Spec]:
    p = f"blk.{i}."
    return attention(g, p, qk_norm="head") + moe_or_dense_ffn(g, i, p, qt, facts)


def _kv(g: Geometry) -> KV:
    return {
        "leading_dense_block_count": DENSE_LEAD,
        "expert_shared_count": 1,
        "expert_weights_scale": 2.5,
        "expert_weights_norm": True,
        "expert_gating_func": GATING_SIGMOID,
    }


PLAN = ArchPlan(_layer, _kv, kv_heads=lambda heads, kv_heads: heads)
