"""Qwen3.5/3.6-MoE (llama.cpp's `qwen35moe`): hybrid Gated-DeltaNet and gated full attention, every layer MoE.

What this module owns: the test-model plan `PLAN` of `qwen35moe`, and the hybrid layer
parts `qwen3next` shares with it (`gated_attention`, `delta_net`, `ssm_sizes`,
`hybrid_ffn`, `hybrid_kv`). Written as llama.cpp's loader reads them
(`src/models/qwen35moe.cpp`, `load_arch_hparams` / `load_arch_tensors`).

Kept from the real models (Qwen3.6-35B-A3B: 40 layers, 30 DeltaNet + 10 attention,
256 experts top-8, a sigmoid-gated shared expert):
- The layer pattern: `full_attention_interval` 4 (the real value), so layers 3, 7, ...
  are full attention and the others Gated DeltaNet; the default 4 layers hold three
  DeltaNet layers and one attention layer, and every layer, of either kind, is an MoE
  FFN (llama.cpp's graph asserts a router in every layer).
- Full attention: the query projection carries the output gate (2 x heads x head_dim
  rows), per-head q/k norms, IMRoPE over part of each head with `rope.dimension_sections`.
- DeltaNet: the fused q/k/v projection `attn_qkv`, the output gate `attn_gate` (z),
  the F32 causal conv `ssm_conv1d` (kernel 4, never quantized, as llama.cpp's quantizer
  leaves it), `ssm_dt.bias`, `ssm_a` (= -exp(A_log), negative, so the state decays),
  `ssm_beta`/`ssm_alpha` (one row per value head), the gated norm `ssm_norm` and
  `ssm_out`; twice as many value heads as key heads, as the real models have.
- The FFN: the router reads `attn_post_norm-L` (the weight `post_attention_norm`;
  there is no ffn_norm), softmax gating fixed by the graph (the file carries no
  `expert_gating_func`), normalized top-k weights, and a dense shared expert gated by
  sigmoid(`ffn_gate_inp_shexp` . x) (not part of the selection).

Shrunk: head_dim is embd / heads (the real 256 is twice that); the DeltaNet head size
is head_dim with 2 key and 4 value heads (real: 128, 16 and 32), so the value width
equals embd; rope covers half of each head (real: a quarter); no MTP layer
(`nextn_predict_layers` 0, as the trunk-only GGUFs).
"""

from __future__ import annotations

from moed.gguf.archs import Arch
from moed.modelgen.plan import KV, ArchPlan, Geometry, Quants, Spec, routed, shared_expert

FULL_ATTENTION_INTERVAL = 4  # the real models': three DeltaNet layers, then one full attention
SSM_CONV_KERNEL = 4
SSM_K_HEADS, SSM_V_HEADS = 2, 4  # llama.cpp's ssm.group_count and ssm.time_step_rank


def is_recurrent(i: int) -> bool:
    """llama.cpp's rule from `full_attention_interval`: every interval-th layer is full attention."""
    return (i + 1) % FULL_ATTENTION_INTERVAL != 0


def ssm_sizes(g: Geometry) -> tuple[int, int, int]:
    """(head size, key width, value width) of a DeltaNet layer: head size is ssm.state_size."""
    head = g.head_dim
    return head, head * SSM_K_HEADS, head * SSM_V_HEADS


def gated_attention(g: Geometry, p: str) -> list[Spec]:
    """Full attention whose q projection also yields the per-channel output gate (Q then gate per head)."""
    hd = g.head_dim
    return [
        Spec(p + "attn_q.weight", (2 * g.heads * hd, g.embd), "f16"),
        Spec(p + "attn_k.weight", (g.kv_heads * hd, g.embd), "f16"),
        Spec(p + "attn_v.weight", (g.kv_heads * hd, g.embd), "f16"),
        Spec(p + "attn_output.weight", (g.embd, g.heads * hd), "f16"),
        Spec(p + "attn_q_norm.weight", (hd,), "norm"),
        Spec(p + "attn_k_norm.weight", (hd,), "norm"),
    ]


def delta_net(g: Geometry, p: str, fused_beta_alpha: bool) -> list[Spec]:
    """A Gated DeltaNet mixer: qwen35moe has `ssm_beta` and `ssm_alpha`, qwen3next one `ssm_ba`."""
    head, key, value = ssm_sizes(g)
    conv = 2 * key + value
    specs = [
        Spec(p + "attn_qkv.weight", (conv, g.embd), "f16"),
        Spec(p + "attn_gate.weight", (value, g.embd), "f16"),
        Spec(p + "ssm_conv1d.weight", (conv, SSM_CONV_KERNEL), "bias"),  # F32: llama.cpp never quantizes it
        Spec(p + "ssm_dt.bias", (SSM_V_HEADS,), "bias"),
        Spec(p + "ssm_a", (SSM_V_HEADS,), "decay"),  # llama.cpp's name has no suffix
    ]
    if fused_beta_alpha:  # per key head: its value heads' betas, then their alphas
        specs.append(Spec(p + "ssm_ba.weight", (2 * SSM_V_HEADS, g.embd), "f16"))
    else:
        specs += [
            Spec(p + "ssm_beta.weight", (SSM_V_HEADS, g.embd), "f16"),
            Spec(p + "ssm_alpha.weight", (SSM_V_HEADS, g.embd), "f16"),
        ]
    return specs + [
        Spec(p + "ssm_norm.weight", (head,), "norm"),
        Spec(p + "ssm_out.weight", (g.embd, value), "f16"),
    ]


def hybrid_ffn(g: Geometry, p: str, qt: Quants, facts: Arch) -> list[Spec]:
    """Every layer's FFN: post_attention_norm (the router's input norm), router, routed experts,
    then the sigmoid-gated shared expert."""
    return routed(g, p, qt, facts) + shared_expert(g, p, gated=True)


def hybrid_kv(g: Geometry) -> KV:
    head, _, value = ssm_sizes(g)
    return {
        "expert_shared_feed_forward_length": g.ff,
        "full_attention_interval": FULL_ATTENTION_INTERVAL,
        "ssm.conv_kernel": SSM_CONV_KERNEL,
        "ssm.state_size": head,
        "ssm.group_count": SSM_K_HEADS,
        "ssm.time_step_rank": SSM_V_HEADS,
        "ssm.inner_size": value,
        "rope.dimension_count": g.head_dim // 2,  # partial rope
    }


def _layer(g: Geometry, i: int, qt: Quants, facts: Arch) -> list[Spec]:
    p = f"blk.{i}."
    mixer = delta_net(g, p, fused_beta_alpha=False) if is_recurrent(i) else gated_attention(g, p)
    return [Spec(p + "attn_norm.weight", (g.embd,), "norm"), *mixer, *hybrid_ffn(g, p, qt, facts)]


def _kv(g: Geometry) -> KV:
    # IMRoPE's sections split the rotated pairs (rope dims / 2) as the real [11, 11, 10, 0] splits 32.
    pairs = g.head_dim // 4
    third = pairs // 3
    sections = [pairs - 2 * third, third, third, 0]
    return {**hybrid_kv(g), "rope.dimension_sections": sections}


PLAN = ArchPlan(_layer, _kv)
