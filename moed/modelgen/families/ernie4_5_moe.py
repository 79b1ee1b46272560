"""ERNIE 4.5 MoE (llama.cpp's `ernie4_5-moe`): softmax routing with a selection bias and shared experts.

What this module owns: the test-model plan `PLAN` of `ernie4_5-moe`, written as llama.cpp's
loader reads it (`src/models/ernie4-5.cpp` `load_arch_hparams` / `load_arch_tensors`, the
graph in `src/models/ernie4-5-moe.cpp`).

Kept from the real model (ERNIE-4.5-21B-A3B: 28 layers, 64 experts top-6, shared experts):
- A leading dense layer (`leading_dense_block_count` 1, the real moe_layer_start_index)
  with a plain `ffn_{gate,up,down}`; then every layer MoE (`interleave_moe_layer_step` 1).
- The FFN of an MoE layer: the router reads `ffn_norm-L` (the common case), softmax fixed by
  the graph (the file carries no `expert_gating_func`), the selection bias `exp_probs_b`
  (the real e_score_correction_bias), normalized top-k weights, and an ungated dense shared
  expert of `expert_shared_feed_forward_length`.
- Attention: plain GQA, no q/k norms or biases, full rope.

Shrunk: 4 layers; 8 experts top-2; the shared expert as wide as a routed one (real: two).
"""

from __future__ import annotations

from moed.gguf.archs import Arch
from moed.modelgen.plan import DENSE_LEAD, KV, ArchPlan, Geometry, Quants, Spec, attention, moe_or_dense_ffn


def _layer(g: Geometry, i: int, qt: Quants, facts: Arch) -> list[Spec]:
    p = f"blk.{i}."
    return attention(g, p) + moe_or_dense_ffn(g, i, p, qt, facts)


def _kv(g: Geometry) -> KV:
    return {
        "leading_dense_block_count": DENSE_LEAD,
        "interleave_moe_layer_step": 1,
        "expert_shared_feed_forward_length": g.ff,
    }


PLAN = ArchPlan(_layer, _kv)
