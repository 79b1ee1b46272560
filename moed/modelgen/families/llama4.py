"""Llama 4 (llama.cpp's `llama4`): routed experts with a shared expert, top-k on the logits, sigmoid weights.

What this module owns: the test-model plan `PLAN` of `llama4`, written as llama.cpp's
loader reads it (`src/models/llama4.cpp`, `load_arch_hparams` / `load_arch_tensors`).

Kept from the real model (Llama-4-Scout-17B-16E: 48 layers, 16 experts top-1, every
layer MoE, a shared expert, chunked attention with one NoPE layer in four):
- The FFN of an MoE layer: `ffn_norm`, then the router `ffn_gate_inp`, the routed experts
  and an ungated dense shared expert (`ffn_{gate,up,down}_shexp`, the experts' width)
  side by side. The graph fixes the gating: it selects on the raw logits and weights with
  sigmoid, and scales each chosen expert's input by its weight (not its output); the file
  carries no `expert_gating_func`. `interleave_moe_layer_step` 1, as Scout (every layer MoE).
- The router's input is rms_norm(ffn_inp) * ffn_norm; the graph names that row nowhere
  (its `ffn_norm-L` is the attention output), so the architecture table stops the
  look-ahead at `ffn_inp-L` and the predictor norms it itself (`Arch.rms_node`).
- Attention: plain GQA (no q/k weights or biases) with the unweighted L2 (rms) norm of Q and
  K after rope (`use_kq_norm`, which llama.cpp turns off for 128 experts only); no
  `attention.sliding_window` key, so llama.cpp takes the real model's chunked attention
  (chunk 8192) with every fourth layer full and unroped (NoPE) with attention-temperature
  tuning; llama3-style `rope_freqs` (one tensor shared by every layer).

Shrunk: 4 layers (layer 3 the NoPE full-attention one); 8 experts top-2 (the matrix's
geometry; the graph is the same for top-1); `rope_freqs` filled as a norm (about 1); the
8192-token chunk is longer than a test's context, so the chunked layers attend to all of it.
Maverick's interleave (`MOE_LAYER_STEP` 2: dense layers 0 and 2 between MoE layers 1 and 3)
was checked by hand too: bit-exact in the arch matrix and the repacked test, the zero-lead
predictor exact; only the gate2 prefetch test has nothing to predict two MoE layers ahead.
"""

from __future__ import annotations

from moed.gguf.archs import Arch
from moed.modelgen.plan import KV, ArchPlan, Geometry, Quants, Spec, attention, routed, shared_expert

MOE_LAYER_STEP = 1  # Scout: every layer MoE (Maverick's 2 interleaves dense layers)


def _layer(g: Geometry, i: int, qt: Quants, facts: Arch) -> list[Spec]:
    p = f"blk.{i}."
    if (i + 1) % MOE_LAYER_STEP:  # a dense layer (none with step 1)
        ffn = [
            Spec(p + "ffn_norm.weight", (g.embd,), "norm"),
            Spec(p + "ffn_gate.weight", (g.ff, g.embd), "f16"),
            Spec(p + "ffn_up.weight", (g.ff, g.embd), "f16"),
            Spec(p + "ffn_down.weight", (g.embd, g.ff), "f16"),
        ]
    else:  # ffn_norm (the table's norm), router, routed experts, then the ungated shared expert
        ffn = routed(g, p, qt, facts) + shared_expert(g, p, gated=False)
    return attention(g, p) + ffn


def _model_tensors(g: Geometry, vocab: int) -> list[Spec]:
    return [Spec("rope_freqs.weight", (g.head_dim // 2,), "norm")]


def _kv(g: Geometry) -> KV:
    return {"interleave_moe_layer_step": MOE_LAYER_STEP}


PLAN = ArchPlan(_layer, _kv, model_tensors=_model_tensors)
