"""MiniMax-M2 (llama.cpp's `minimax-m2`): routed experts only, sigmoid routing with a selection bias.

What this module owns: the test-model plan `PLAN` of `minimax-m2`, written as llama.cpp's
loader reads it (`src/models/minimax-m2.cpp`, `load_arch_hparams` / `load_arch_tensors`).

Kept from the real model (MiniMax-M2: 62 layers, 256 experts top-8, no shared expert):
- The FFN of every layer: the router reads `ffn_norm-L` (the common case), the file's
  sigmoid gating (`expert_gating_func`) with the selection bias `exp_probs_b` (which
  llama.cpp requires), normalized top-k weights (fixed by the graph); the routed experts
  are `feed_forward_length` wide (llama.cpp sizes them by n_ff); no shared expert.
- Attention: GQA with q/k norms over the whole projection (n_head x head_dim and
  n_head_kv x head_dim wide), partial rope (half of each head: the real 64 of 128).

Shrunk: 4 layers; 8 experts top-2.
"""

from __future__ import annotations

from moed.gguf.archs import GATING_SIGMOID, Arch
from moed.modelgen.plan import KV, ArchPlan, Geometry, Quants, Spec, attention, routed


def _layer(g: Geometry, i: int, qt: Quants, facts: Arch) -> list[Spec]:
    p = f"blk.{i}."
    return attention(g, p, qk_norm="full") + routed(g, p, qt, facts, selection_bias=True)


def _kv(g: Geometry) -> KV:
    return {"rope.dimension_count": g.head_dim // 2, "expert_gating_func": GATING_SIGMOID}


PLAN = ArchPlan(_layer, _kv)
