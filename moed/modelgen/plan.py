"""The building blocks of a test model's tensor plan, shared by every architecture's plan.

What this module owns: `Geometry` (a model's sizes), `Spec` (one tensor to write: name,
numpy-order shape, fill kind, quant type), `ArchPlan` (how one architecture is written:
its per-layer plan, its own metadata keys, its model-level tensors), and the layer parts
several architectures share (GQA attention, the router and routed experts, shared
experts, DeepSeek-style leading dense layers). moed.modelgen.makemodel turns a plan into
a file; moed.modelgen.families holds the plans of the newer architectures, one module
each. Pure data, no I/O.

Invariants:
- Routed experts are always `blk.N.ffn_{gate,up,down}_exps.weight` (or the fused
  `ffn_gate_up_exps`) of kind "experts": the only tensors a quant or recipe gives an
  expert type, and the ones moed serves.
- Kinds in `F32_KINDS` are written F32, "f16" and "embd" F16 unless a recipe quantizes them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from moed.gguf.archs import ROUTER_BIAS, ROUTER_WEIGHT, SELECTION_BIAS, Arch

Quants = tuple[GGMLQuantizationType, GGMLQuantizationType, GGMLQuantizationType]  # (gate, up, down)
# A tuple is (element type, values): arrays whose type gguf-py cannot infer (UINT64).
KV = dict[str, "int | float | bool | str | list[int] | list[float] | list[bool] | tuple[GGUFValueType, list[int]]"]


@dataclass(frozen=True)
class Geometry:
    layers: int
    experts: int
    used: int
    embd: int
    ff: int
    heads: int
    kv_heads: int
    ctx: int

    @property
    def head_dim(self) -> int:
        return self.embd // self.heads


F32_KINDS = ("norm", "router", "bias", "router_bias", "decay")


@dataclass(frozen=True)
class Spec:
    """One tensor to write: numpy-order shape, how to fill it, and its quant type."""

    name: str
    shape: tuple[int, ...]
    kind: str  # embd | norm | bias | f16 | router | router_bias | decay | experts
    qtype: GGMLQuantizationType | None = None
    # Contents the plan computes itself, from the file's random stream (deepseek4's I32
    # token -> experts table); None: made from `kind`.
    values: Callable[[np.random.Generator], np.ndarray] | None = None

    @property
    def nbytes(self) -> int:
        if self.qtype is not None:
            block, size = GGML_QUANT_SIZES[self.qtype]
            return math.prod(self.shape) // block * size
        return math.prod(self.shape) * (4 if self.kind in F32_KINDS else 2)

    @property
    def byte_shape(self) -> tuple[int, ...]:
        if self.qtype is None:
            return self.shape
        block, size = GGML_QUANT_SIZES[self.qtype]
        return (*self.shape[:-1], self.shape[-1] // block * size)

    @property
    def dtype(self):
        if self.qtype is not None:
            return np.uint8
        return np.float32 if self.kind in F32_KINDS else np.float16


def attention(g: Geometry, p: str, *, qk_norm: str = "", bias: bool = False) -> list[Spec]:
    """GQA attention; `qk_norm`: "head" (per head) or "full" (whole projection) q/k norms; `bias`: q/k/v biases."""
    hd = g.head_dim
    specs = [Spec(p + "attn_norm.weight", (g.embd,), "norm")]
    for name, rows in (("q", g.heads * hd), ("k", g.kv_heads * hd), ("v", g.kv_heads * hd)):
        specs.append(Spec(p + f"attn_{name}.weight", (rows, g.embd), "f16"))
        if bias:
            specs.append(Spec(p + f"attn_{name}.bias", (rows,), "bias"))
    specs.append(Spec(p + "attn_output.weight", (g.embd, g.heads * hd), "f16"))
    if qk_norm:
        q, k = (hd, hd) if qk_norm == "head" else (g.heads * hd, g.kv_heads * hd)
        specs += [Spec(p + "attn_q_norm.weight", (q,), "norm"), Spec(p + "attn_k_norm.weight", (k,), "norm")]
    return specs


def router_norm(g: Geometry, p: str, facts: Arch) -> Spec:
    """The FFN input's norm, which the router reads: `ffn_norm`, or the architecture's own."""
    return Spec(p + facts.router_input.norm + ".weight", (g.embd,), "norm")


def routed(
    g: Geometry, p: str, qt: Quants, facts: Arch, selection_bias: bool = False, fused_gate_up: bool = False
) -> list[Spec]:
    """The router's input norm, the router (with the biases its architecture carries, and
    V3's selection bias when `selection_bias`) and the routed experts, each part followed
    by its bias rows where the architecture has them: the experts are what moed serves.
    `fused_gate_up`: gate and up as one `ffn_gate_up_exps` part ([experts, 2 x ff, embd],
    gate rows first, as llama.cpp's build_moe_ffn splits it) in the gate's quant."""
    specs = [router_norm(g, p, facts), Spec(p + ROUTER_WEIGHT, (g.experts, g.embd), "router")]
    if facts.router_bias:
        specs.append(Spec(p + ROUTER_BIAS, (g.experts,), "router_bias"))
    if selection_bias:
        specs.append(Spec(p + SELECTION_BIAS, (g.experts,), "bias"))
    gate_up = (
        [("gate_up", (g.experts, 2 * g.ff, g.embd), qt[0])]
        if fused_gate_up
        else [("gate", (g.experts, g.ff, g.embd), qt[0]), ("up", (g.experts, g.ff, g.embd), qt[1])]
    )
    for name, shape, q in (*gate_up, ("down", (g.experts, g.embd, g.ff), qt[2])):
        specs.append(Spec(p + f"ffn_{name}_exps.weight", shape, "experts", q))
        if facts.expert_bias:
            specs.append(Spec(p + f"ffn_{name}_exps.bias", shape[:2], "bias"))
    return specs


def shared_expert(g: Geometry, p: str, gated: bool) -> list[Spec]:
    """One dense shared expert (F16, resident), with qwen2moe's sigmoid gate when `gated`."""
    specs = [Spec(p + "ffn_gate_inp_shexp.weight", (g.embd,), "router")] if gated else []
    return specs + [
        Spec(p + "ffn_gate_shexp.weight", (g.ff, g.embd), "f16"),
        Spec(p + "ffn_up_shexp.weight", (g.ff, g.embd), "f16"),
        Spec(p + "ffn_down_shexp.weight", (g.embd, g.ff), "f16"),
    ]


DENSE_LEAD = 1


def moe_or_dense_ffn(g: Geometry, i: int, p: str, qt: Quants, facts: Arch) -> list[Spec]:
    """DeepSeek-V3's and GLM-4.5's FFN: a plain F16 one (resident, no experts) in the
    leading dense layers, else V3-style routing with the selection bias and an ungated
    shared expert."""
    if i < DENSE_LEAD:
        return [
            router_norm(g, p, facts),
            Spec(p + "ffn_gate.weight", (g.ff, g.embd), "f16"),
            Spec(p + "ffn_up.weight", (g.ff, g.embd), "f16"),
            Spec(p + "ffn_down.weight", (g.embd, g.ff), "f16"),
        ]
    return routed(g, p, qt, facts, selection_bias=True) + shared_expert(g, p, gated=False)


@dataclass(frozen=True)
class ArchPlan:
    """How to write one architecture: its per-layer tensor plan and the metadata keys only
    it has. What moed relies on about it (router input, biases) is `moed.gguf.archs`'s,
    handed to the plan."""

    layer: Callable[[Geometry, int, Quants, Arch], list[Spec]]
    extra_kv: Callable[[Geometry], KV] = lambda g: {}
    kv_heads: Callable[[int, int], int] = lambda heads, kv_heads: kv_heads  # what llama.cpp wants of it
    expert_quant: str = "q8_0"  # the routed experts' quant when the caller names none
    # Model-level tensors besides token_embd, output_norm and output (per-layer token
    # embeddings, hyper-connection heads, ...), written after token_embd.
    model_tensors: Callable[[Geometry, int], list[Spec]] = lambda g, vocab: []
    # Whether the model carries output.weight (False: tied to token_embd, as Gemma).
    output: bool = True
    # Whether the model carries output_norm.weight (False: qwen4exp, whose final
    # hyper-connection mixer is the output norm).
    output_norm: bool = True
