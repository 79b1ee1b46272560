"""MiniMax-M3 (llama.cpp's `minimax-m3`): M2-style GQA with MiniMax Sparse Attention, V3-style MoE.

What this module owns: the test-model plan `PLAN` of `minimax-m3`, written as llama.cpp's
loader reads it (`src/models/minimax-m3.cpp`, `load_arch_hparams` / `load_arch_tensors`;
the keys as `conversion/minimax.py`'s MiniMaxM3Model writes them), and the sizes the
tests rely on (`INDEXER_BLOCK`, `INDEXER_TOP_K`, `INDEXER_LOCAL`).

Kept from the real model (MiniMax-M3: 60 layers, leading dense layers, routed experts
with a shared expert, MSA in the MoE layers):
- Attention: GQA with per-head q/k RMS norms (one head_dim vector each, the converter's
  Gemma-style +1 baked in), partial NeoX rope (half of each head).
- MiniMax Sparse Attention (MSA) in every layer after the dense lead: an indexer per
  layer (`indexer.q_proj` with one head per GQA group, `indexer.k_proj` one key head,
  their RMS norms `indexer.q_norm` / `indexer.k_norm`; F32, as the converter forces
  them), scoring position blocks of `indexer.block_size` tokens; each query attends to
  its `indexer.top_k` best blocks plus `indexer.local_blocks` forced local ones. llama.cpp
  runs MSA only with flash attention on (else its dense fallback, with a warning).
- The FFN: swigluoai (gpt-oss's alpha and limit, fixed by the graph) in the dense, shared
  and routed FFNs; a leading dense layer; then V3-style routing: the router reads
  `ffn_norm-L`, sigmoid gating (`expert_gating_func`) with `exp_probs_b` (required),
  normalized top-k weights scaled by `expert_weights_scale`; one shared expert of the
  experts' width (required).

Shrunk: 4 layers, 1 leading dense; 8 experts top-2; 2 indexer heads (= kv heads) of 32
(real: 128 wide), blocks of 16 tokens (so a test prompt spans several), the top 2 blocks
and 1 local block; the routed scale 2.5 is chosen, not the real routed_scaling_factor;
no MTP layer and no vision tower.
"""

from __future__ import annotations

from moed.gguf.archs import GATING_SIGMOID, Arch
from moed.modelgen.plan import DENSE_LEAD, KV, ArchPlan, Geometry, Quants, Spec, attention, moe_or_dense_ffn

INDEXER_HEAD_DIM = 32
INDEXER_BLOCK, INDEXER_TOP_K, INDEXER_LOCAL = 16, 2, 1
ROUTED_SCALE = 2.5


def _indexer(g: Geometry, p: str) -> list[Spec]:
    """The MSA indexer of an MoE layer: F32 projections (the converter forces them) and RMS norms."""
    return [
        Spec(p + "indexer.q_proj.weight", (g.kv_heads * INDEXER_HEAD_DIM, g.embd), "router"),
        Spec(p + "indexer.k_proj.weight", (INDEXER_HEAD_DIM, g.embd), "router"),
        Spec(p + "indexer.q_norm.weight", (INDEXER_HEAD_DIM,), "norm"),
        Spec(p + "indexer.k_norm.weight", (INDEXER_HEAD_DIM,), "norm"),
    ]


def _layer(g: Geometry, i: int, qt: Quants, facts: Arch) -> list[Spec]:
    p = f"blk.{i}."
    indexer = _indexer(g, p) if i >= DENSE_LEAD else []
    return attention(g, p, qk_norm="head") + moe_or_dense_ffn(g, i, p, qt, facts) + indexer


def _kv(g: Geometry) -> KV:
    return {
        "rope.dimension_count": g.head_dim // 2,
        "leading_dense_block_count": DENSE_LEAD,
        "expert_shared_count": 1,
        "expert_weights_scale": ROUTED_SCALE,
        "expert_weights_norm": True,
        "expert_gating_func": GATING_SIGMOID,
        "attention.indexer.head_count": g.kv_heads,  # one indexer head per GQA group (asserted by the graph)
        "attention.indexer.key_length": INDEXER_HEAD_DIM,
        "attention.indexer.top_k": INDEXER_TOP_K,
        "attention.indexer.block_size": INDEXER_BLOCK,
        "attention.indexer.local_blocks": INDEXER_LOCAL,
    }


PLAN = ArchPlan(_layer, _kv)
