"""Qwen3-Next (llama.cpp's `qwen3next`): Qwen3.5-MoE's hybrid layout, one generation earlier.

What this module owns: the test-model plan `PLAN` of `qwen3next`, written as llama.cpp's
loader reads it (`src/models/qwen3next.cpp`). The layer parts are
moed.modelgen.families.qwen35moe's (the two graphs are the same but for what is below).

Kept from the real model (Qwen3-Next-80B-A3B: 48 layers, 36 DeltaNet + 12 attention,
512 experts top-10, a sigmoid-gated shared expert): everything qwen35moe's plan keeps
(`full_attention_interval` 4, every layer MoE, the router at `attn_post_norm-L` with
softmax fixed by the graph, the gated query, per-head q/k norms, the DeltaNet tensors),
with Qwen3-Next's own differences:
- one fused `ssm_ba` projection (per key head, its value heads' betas then their alphas)
  instead of `ssm_beta` and `ssm_alpha`;
- plain NeoX rope over part of each head, no rope sections.
The DeltaNet input is the current converter's `attn_qkv` + `attn_gate` (llama.cpp's
"optimized path"); the legacy fused `ssm_in` (q/k/v/z in one matrix) is not written.

Shrunk as qwen35moe's plan (head sizes, 2 key and 4 value heads, half-head rope, no MTP layer).
"""

from __future__ import annotations

from moed.gguf.archs import Arch
from moed.modelgen.families.qwen35moe import delta_net, gated_attention, hybrid_ffn, hybrid_kv, is_recurrent
from moed.modelgen.plan import ArchPlan, Geometry, Quants, Spec


def _layer(g: Geometry, i: int, qt: Quants, facts: Arch) -> list[Spec]:
    p = f"blk.{i}."
    mixer = delta_net(g, p, fused_beta_alpha=True) if is_recurrent(i) else gated_attention(g, p)
    return [Spec(p + "attn_norm.weight", (g.embd,), "norm"), *mixer, *hybrid_ffn(g, p, qt, facts)]


PLAN = ArchPlan(_layer, hybrid_kv)
