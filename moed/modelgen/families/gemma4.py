"""Gemma 4 MoE (llama.cpp's `gemma4`): a dense GELU MLP and routed experts side by side in every layer.

What this module owns: the test-model plan `PLAN` of `gemma4`, written as llama.cpp's
loader reads it (`src/models/gemma4.cpp`, `load_arch_hparams` / `load_arch_tensors`).

Kept from the real model (Gemma-4-26B-A4B: 30 layers, 128 experts top-8, sliding-window
layers with one full-attention layer in six, a tied output):
- The FFN of every layer: a dense GELU MLP (`ffn_{gate,up,down}` after `ffn_norm`, then
  `post_ffw_norm_1`) plus routed experts after `pre_ffw_norm_2` (the graph's
  `ffn_norm_2-L`, what `build_moe_ffn` is given), then `post_ffw_norm_2`, the sum normed
  by `post_ffw_norm`. The routed gate and up projections are one fused tensor
  `ffn_gate_up_exps` ([experts, 2 x ff, embd]: gate rows, then up rows), so an expert is
  two parts, gate_up and down; each expert's output is scaled by `ffn_down_exps.scale`.
- The router: its logits are computed outside `build_moe_ffn`, from
  rms_norm(attn_out) / sqrt(embd) * `ffn_gate_inp.scale` (no norm weight of its own),
  with softmax fixed by the graph and normalized top-k weights.
- Attention: per-head q/k norms and an unweighted v norm, `post_attention_norm`,
  attention scale 1; sliding-window layers (`attention.sliding_window_pattern`, an array
  of bools) with their own head size (`key_length_swa`) and rope width; the full-attention
  layers have twice the head size, rope frequency factors (`rope_freqs`, one tensor
  shared by them) and no `attn_v` (llama.cpp then takes V = K, the real model's
  `attention_k_eq_v`).
- Per-layer token embeddings: `per_layer_token_embd` ([vocab, per-layer width x layers],
  which llama.cpp marks TENSOR_READ_LAZY), `per_layer_model_proj`, `per_layer_proj_norm`,
  and per layer `inp_gate`, `proj`, `post_norm`; each layer's output scaled by
  `layer_output_scale`; the final logits soft-capped (`final_logit_softcapping` 30).
- `output` is tied to `token_embd` (no output.weight).

Shrunk: 4 layers, the last one full attention (the real pattern is five sliding, one
full); per-layer width embd / 4 (the E-series' 256 of 1536-2560); a window of 32;
`rope_freqs` filled as a norm (about 1), so every pair rotates (the real file parks the
unrotated pairs at 1e30); no shared-KV layers (`attention.shared_kv_layers` 0).

Invariants: gate_up of an expert is 2 x ff x embd values in the experts' quant, so a
part is whole pages wherever gate, up and down each would be (aligned_geometry's 256 x
256 gives 34 and 17 pages in q8_0).
"""

from __future__ import annotations

from moed.gguf.archs import Arch
from moed.modelgen.plan import KV, ArchPlan, Geometry, Quants, Spec, attention, routed

FULL_EVERY = 4  # layers 3, 7, ... are full attention; the others slide
SWA_WINDOW = 32  # short enough that the sliding layers attend to a window on a test prompt
FINAL_SOFTCAP = 30.0  # the real models' final_logit_softcapping


def is_swa(i: int) -> bool:
    return (i + 1) % FULL_EVERY != 0


def per_layer_width(g: Geometry) -> int:
    return g.embd // 4


def full_head_dim(g: Geometry) -> int:
    return 2 * g.head_dim  # the real full-attention heads are twice the sliding ones (512 vs 256)


def _attention(g: Geometry, i: int, p: str) -> list[Spec]:
    if is_swa(i):
        specs = attention(g, p, qk_norm="head")
    else:  # wider heads, and no attn_v: llama.cpp uses K as V
        hd = full_head_dim(g)
        specs = [
            Spec(p + "attn_norm.weight", (g.embd,), "norm"),
            Spec(p + "attn_q.weight", (g.heads * hd, g.embd), "f16"),
            Spec(p + "attn_k.weight", (g.kv_heads * hd, g.embd), "f16"),
            Spec(p + "attn_output.weight", (g.embd, g.heads * hd), "f16"),
            Spec(p + "attn_q_norm.weight", (hd,), "norm"),
            Spec(p + "attn_k_norm.weight", (hd,), "norm"),
        ]
    return specs + [Spec(p + "post_attention_norm.weight", (g.embd,), "norm")]


def _layer(g: Geometry, i: int, qt: Quants, facts: Arch) -> list[Spec]:
    p, pl = f"blk.{i}.", per_layer_width(g)
    dense_mlp = [
        Spec(p + "ffn_norm.weight", (g.embd,), "norm"),
        Spec(p + "ffn_gate.weight", (g.ff, g.embd), "f16"),
        Spec(p + "ffn_up.weight", (g.ff, g.embd), "f16"),
        Spec(p + "ffn_down.weight", (g.embd, g.ff), "f16"),
        Spec(p + "post_ffw_norm_1.weight", (g.embd,), "norm"),
    ]
    # routed(): pre_ffw_norm_2 (the architecture table's router-input norm), the router,
    # then the fused gate_up and the down experts.
    experts = [
        *routed(g, p, qt, facts, fused_gate_up=True),
        Spec(p + "ffn_gate_inp.scale", (g.embd,), "norm"),
        Spec(p + "ffn_down_exps.scale", (g.experts,), "norm"),  # the real per_expert_scale
        Spec(p + "post_ffw_norm_2.weight", (g.embd,), "norm"),
        Spec(p + "post_ffw_norm.weight", (g.embd,), "norm"),
    ]
    per_layer = [
        Spec(p + "inp_gate.weight", (pl, g.embd), "f16"),
        Spec(p + "proj.weight", (g.embd, pl), "f16"),
        Spec(p + "post_norm.weight", (g.embd,), "norm"),
        Spec(p + "layer_output_scale.weight", (1,), "norm"),
    ]
    return _attention(g, i, p) + dense_mlp + experts + per_layer


def _model_tensors(g: Geometry, vocab: int) -> list[Spec]:
    pl = per_layer_width(g) * g.layers
    return [
        Spec("per_layer_token_embd.weight", (vocab, pl), "embd"),
        Spec("per_layer_model_proj.weight", (pl, g.embd), "f16"),
        Spec("per_layer_proj_norm.weight", (per_layer_width(g),), "norm"),
        Spec("rope_freqs.weight", (full_head_dim(g) // 2,), "norm"),
    ]


def _kv(g: Geometry) -> KV:
    full = full_head_dim(g)
    return {
        "attention.key_length": full,
        "attention.value_length": full,
        "attention.key_length_swa": g.head_dim,
        "attention.value_length_swa": g.head_dim,
        "rope.dimension_count": full,
        "rope.dimension_count_swa": g.head_dim,
        "attention.sliding_window": SWA_WINDOW,
        "attention.sliding_window_pattern": [is_swa(i) for i in range(g.layers)],
        "attention.shared_kv_layers": 0,
        "embedding_length_per_layer_input": per_layer_width(g),
        "final_logit_softcapping": FINAL_SOFTCAP,
    }


PLAN = ArchPlan(_layer, _kv, model_tensors=_model_tensors, output=False)
