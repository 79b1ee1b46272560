"""Hunyuan-A13B (llama.cpp's `hunyuan-moe`): every layer MoE beside a dense shared MLP, softmax routing.

What this module owns: the test-model plan `PLAN` of `hunyuan-moe`, written as llama.cpp's
loader reads it (`src/models/hunyuan-moe.cpp`, `load_arch_hparams` / `load_arch_tensors`).

Kept from the real model (Hunyuan-A13B: 32 layers, 64 experts top-8, one shared MLP):
- The FFN of every layer: the router reads `ffn_norm-L` (the common case), softmax fixed
  by the graph (the file carries no `expert_gating_func`), normalized top-k weights; the
  routed experts are `feed_forward_length` wide (llama.cpp sizes them by n_ff), and an
  ungated dense shared MLP (`ffn_*_shexp`, `expert_shared_feed_forward_length`) is added.
- Attention: GQA with per-head q/k norms applied after rope (llama.cpp's order for it).

Shrunk: 4 layers; 8 experts top-2; the shared MLP as wide as a routed expert.
"""

from __future__ import annotations

from moed.gguf.archs import Arch
from moed.modelgen.plan import KV, ArchPlan, Geometry, Quants, Spec, attention, routed, shared_expert


def _layer(g: Geometry, i: int, qt: Quants, facts: Arch) -> list[Spec]:
    p = f"blk.{i}."
    return attention(g, p, qk_norm="head") + routed(g, p, qt, facts) + shared_expert(g, p, gated=False)


def _kv(g: Geometry) -> KV:
    return {"expert_shared_feed_forward_length": g.ff}


PLAN = ArchPlan(_layer, _kv)
