"""Kimi-K3 (llama.cpp's `kimi-k3`): hybrid KDA linear attention and MLA, a latent MoE, attention residuals.

What this module owns: the test-model plan `PLAN` of `kimi-k3`, written as llama.cpp's
loader reads it (`src/models/kimi-k3.cpp`, `load_arch_hparams` / `load_arch_tensors`;
the keys as `conversion/kimi_k3.py` writes them), and the sizes the tests rely on
(`is_recurrent`, `latent`).

Kept from the real model (Kimi-K3: 93 layers of KDA and MLA, a leading dense layer,
routed experts in a latent space plus a shared expert):
- The layer pattern: `attention.head_count_kv` per layer, 0 marking a KDA (recurrent)
  layer and 1 an MLA layer (MLA served as MQA, as the converter writes it); here one
  MLA layer in four (layers 3, 7, ...), the others KDA.
- KDA: separate `attn_q` / `attn_k` / `attn_v` projections, each through its own F32
  causal conv (`ssm_conv1d_{q,k,v}`, 4-D [d_conv, 1, d_inner, 1] as the converter writes
  them), the decay gate from `ssm_f_a` -> `ssm_f_b` plus `ssm_dt.bias`, `ssm_a`
  (= -exp(A_log), 1-D) with K3's `kda.gate_lower_bound` -5 (the sigmoid form), one beta
  per head (`ssm_beta`), the full-rank output gate `ssm_g`, the per-head `ssm_norm`
  and `attn_output`.
- MLA, nope-only (rope type none): a q latent (`attn_q_a`, `attn_q_a_norm`, `attn_q_b`),
  `attn_kv_a_mqa` with the kv latent and the un-rotated "rope" part, `attn_kv_a_norm`,
  the split `attn_k_b` / `attn_v_b` (3-D), K3's sigmoid output gate `attn_gate` and
  `attn_output`; `key_length` = kv latent + rope width, `value_length` = kv latent, the
  per-head sizes in `key_length_mla` / `value_length_mla`.
- Cross-layer attention residuals (`attn_res.block_size`): per layer the F32 score
  vectors `attn_res_score` / `ffn_res_score` and the model's `output_res_score`; the
  raw residual is banked every block_size layers and each sub-block reads a softmax
  mix of the bank and the current stream.
- The FFN: the situ activation (`activation.situ_beta`, `situ_linear_beta`) in the
  dense, shared and routed FFNs; a leading dense layer; then the router `ffn_gate_inp`
  reading `ffn_norm-L` at full width (llama.cpp computes these logits itself and hands
  them to build_moe_ffn), sigmoid gating (`expert_gating_func`) with `exp_probs_b`,
  normalized top-k weights scaled by `expert_weights_scale`; the routed experts run in
  the latent space: `ffn_routed_down` ([latent, embd]) before them, `ffn_routed_norm`
  and `ffn_routed_up` after, so the experts are [latent, ff] ([n_embd_latent, n_ff_exp,
  n_expert] in ggml order); one shared expert at full width on the un-projected input.

Shrunk: 4 layers (3 KDA, 1 MLA), 1 leading dense; KDA heads = the attention heads with
head_dim embd / heads (real 128); MLA sizes as glm_dsa's (96 no-rope + 32 "rope", values
64, kv latent 64, q latent embd); the latent is half of embd below 256 and at least 256
from there (`latent`: the tiny model's experts are 32 x 64, narrower than embd, while at
the 256 x 256 geometries of the zero-copy and q4_k_m tests a part stays whole pages and
whole Q4_K blocks); attn_res.block_size 2; the situ betas, the routed scale and the
block size are chosen, not the real config's (not in the llama.cpp tree); all matrices
F16 unless a recipe quantizes them; no vision tower.

Invariants: the router reads the full-width `ffn_norm-L` (the same node the eval
callback stops at), so the gate-ahead predictor reproduces llama.cpp's top-k exactly
at zero lead; the experts' width is `latent(g)`, not embd, and the catalog takes any
[ne0, ne1, n_expert] part.
"""

from __future__ import annotations

from moed.gguf.archs import GATING_SIGMOID, ROUTER_WEIGHT, SELECTION_BIAS, Arch
from moed.modelgen.plan import DENSE_LEAD, KV, ArchPlan, Geometry, Quants, Spec, router_norm, shared_expert

MLA_INTERVAL = 4  # one MLA layer in four, the others KDA
SSM_CONV_KERNEL = 4
GATE_LOWER_BOUND = -5.0  # K3's kda.gate_lower_bound (the sigmoid decay gate)
QK_NOPE, QK_ROPE = 96, 32  # per head: no-rope and "rope" (un-rotated in K3) parts of q and k
V_HEAD = 64  # value width per head after attn_v_b
KV_LORA = 64  # the compressed kv latent
ATTN_RES_BLOCK = 2  # attn_res.block_size: the raw residual is banked every 2 layers
SITU_BETA, SITU_LINEAR_BETA = 2.0, 8.0
ROUTED_SCALE = 2.5


def is_recurrent(i: int) -> bool:
    """Whether layer i is KDA (head_count_kv 0); every MLA_INTERVAL-th layer is MLA."""
    return (i + 1) % MLA_INTERVAL != 0


def latent(g: Geometry) -> int:
    """The routed experts' width (`expert_latent_length`): embd / 2, and at least 256 where embd is."""
    return g.embd // 2 if g.embd < 256 else max(256, g.embd // 2)


def _kda(g: Geometry, p: str) -> list[Spec]:
    hd, heads = g.head_dim, g.heads
    inner = hd * heads
    conv = [Spec(p + f"ssm_conv1d_{x}.weight", (1, inner, 1, SSM_CONV_KERNEL), "bias") for x in "qkv"]  # F32
    return [
        *conv,
        Spec(p + "attn_q.weight", (inner, g.embd), "f16"),
        Spec(p + "attn_k.weight", (inner, g.embd), "f16"),
        Spec(p + "attn_v.weight", (inner, g.embd), "f16"),
        Spec(p + "ssm_f_a.weight", (hd, g.embd), "f16"),
        Spec(p + "ssm_f_b.weight", (inner, hd), "f16"),
        Spec(p + "ssm_beta.weight", (heads, g.embd), "f16"),
        Spec(p + "ssm_a", (heads,), "decay"),  # llama.cpp's name has no suffix
        Spec(p + "ssm_dt.bias", (inner,), "bias"),
        Spec(p + "ssm_g.weight", (inner, g.embd), "f16"),
        Spec(p + "ssm_norm.weight", (hd,), "norm"),
        Spec(p + "attn_output.weight", (g.embd, inner), "f16"),
    ]


def _mla(g: Geometry, p: str) -> list[Spec]:
    qr, heads = g.embd, g.heads
    return [
        Spec(p + "attn_q_a_norm.weight", (qr,), "norm"),
        Spec(p + "attn_kv_a_norm.weight", (KV_LORA,), "norm"),
        Spec(p + "attn_q_a.weight", (qr, g.embd), "f16"),
        Spec(p + "attn_q_b.weight", (heads * (QK_NOPE + QK_ROPE), qr), "f16"),
        Spec(p + "attn_kv_a_mqa.weight", (KV_LORA + QK_ROPE, g.embd), "f16"),
        Spec(p + "attn_k_b.weight", (heads, KV_LORA, QK_NOPE), "f16"),
        Spec(p + "attn_v_b.weight", (heads, V_HEAD, KV_LORA), "f16"),
        Spec(p + "attn_gate.weight", (heads * V_HEAD, g.embd), "f16"),
        Spec(p + "attn_output.weight", (g.embd, heads * V_HEAD), "f16"),
    ]


def _ffn(g: Geometry, i: int, p: str, qt: Quants, facts: Arch) -> list[Spec]:
    if i < DENSE_LEAD:
        return [
            router_norm(g, p, facts),
            Spec(p + "ffn_gate.weight", (g.ff, g.embd), "f16"),
            Spec(p + "ffn_down.weight", (g.embd, g.ff), "f16"),
            Spec(p + "ffn_up.weight", (g.ff, g.embd), "f16"),
        ]
    n = latent(g)
    return [
        router_norm(g, p, facts),
        Spec(p + ROUTER_WEIGHT, (g.experts, g.embd), "router"),
        Spec(p + SELECTION_BIAS, (g.experts,), "bias"),
        Spec(p + "ffn_gate_exps.weight", (g.experts, g.ff, n), "experts", qt[0]),
        Spec(p + "ffn_up_exps.weight", (g.experts, g.ff, n), "experts", qt[1]),
        Spec(p + "ffn_down_exps.weight", (g.experts, n, g.ff), "experts", qt[2]),
        Spec(p + "ffn_routed_down.weight", (n, g.embd), "f16"),
        Spec(p + "ffn_routed_up.weight", (g.embd, n), "f16"),
        Spec(p + "ffn_routed_norm.weight", (n,), "norm"),
        *shared_expert(g, p, gated=False),
    ]


def _layer(g: Geometry, i: int, qt: Quants, facts: Arch) -> list[Spec]:
    p = f"blk.{i}."
    mixer = _kda(g, p) if is_recurrent(i) else _mla(g, p)
    return [
        Spec(p + "attn_norm.weight", (g.embd,), "norm"),
        Spec(p + "attn_res_score.weight", (g.embd,), "norm"),
        Spec(p + "ffn_res_score.weight", (g.embd,), "norm"),
        *mixer,
        *_ffn(g, i, p, qt, facts),
    ]


def _model_tensors(g: Geometry, vocab: int) -> list[Spec]:
    return [Spec("output_res_score.weight", (g.embd,), "norm")]


def _kv(g: Geometry) -> KV:
    return {
        "attention.head_count_kv": [0 if is_recurrent(i) else 1 for i in range(g.layers)],
        "attention.key_length": KV_LORA + QK_ROPE,  # MLA's cache row: the kv latent and the rope part
        "attention.value_length": KV_LORA,
        "attention.key_length_mla": QK_NOPE + QK_ROPE,
        "attention.value_length_mla": V_HEAD,
        "attention.q_lora_rank": g.embd,
        "attention.kv_lora_rank": KV_LORA,
        "rope.dimension_count": QK_ROPE,
        "ssm.conv_kernel": SSM_CONV_KERNEL,
        "kda.head_dim": g.head_dim,
        "kda.gate_lower_bound": GATE_LOWER_BOUND,
        "expert_shared_count": 1,
        "leading_dense_block_count": DENSE_LEAD,
        "expert_weights_scale": ROUTED_SCALE,
        "expert_weights_norm": True,
        "expert_gating_func": GATING_SIGMOID,
        "expert_latent_length": latent(g),
        "attn_res.block_size": ATTN_RES_BLOCK,
        "activation.situ_beta": SITU_BETA,
        "activation.situ_linear_beta": SITU_LINEAR_BETA,
    }


PLAN = ArchPlan(_layer, _kv, model_tensors=_model_tensors)
