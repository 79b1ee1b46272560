"""Gate-ahead prediction: a later layer's router applied to this layer's normed FFN input.

What this module owns: the routers of a model's MoE layers (read once from the
dense, resident weights), the folded matrices that predict layer M's routing from
layer L's `ffn_norm-L` tensor, and the selection of the best `width` experts per
token. No I/O after `load_routers`, no state between calls.

The math. llama.cpp computes, at MoE layer L with residual stream h_L:

    x_L      = rms_norm(h_L) * n_L              (the graph's `ffn_norm-L`)
    logits_L = W_L @ x_L [+ c_L]                (`ffn_moe_logits-L`; c: the router bias)
    chosen   = top_k(gating(logits_L) + b_L)    (`ffn_moe_topk-L`; b: `exp_probs_b`)

Architectures differ in where the router's input is normed and in the gating
(the architecture table, `moed.gguf.archs`): gpt-oss norms it with `post_attention_norm`
(the graph's `attn_post_norm-L`; there is no ffn_norm; glm4moe's is
`post_attn_norm-L`, from the same weight name), adds a router bias
`ffn_gate_inp.bias` to the logits, and gates with SOFTMAX_WEIGHT: it selects on the
biased logits and takes the softmax over the chosen k only (the weights, which
selection does not need). qwen35moe and qwen3next read `attn_post_norm-L` too, in every
layer (DeltaNet or attention, all MoE), with softmax; their shared expert's sigmoid
gate scales its output and takes no part in selection.

RMS norm's scale is per token and shared by every layer, and the residual stream
changes little from one layer to the next, so rms_norm(h_M) ~ rms_norm(h_L) and

    logits_M ~ W_M @ (x_L * n_M / n_L) [+ c_M] = F[L, M] @ x_L [+ c_M]

`F[L, M]` is computed once, on first use (as its transpose, so a batch is one
matmul: `x @ F.T`). At zero lead (M = L) the ratio is 1 and F = W_L: the selection then
reproduces llama.cpp's own top-k, which is the test of this code.

Invariants:
- Without a selection bias, top-k of softmax or sigmoid equals top-k of the
  logits (both are monotone), so selection sorts logits; with a bias it sorts
  gating(logits) + bias, as llama.cpp does. A router bias is part of the logits
  (llama.cpp's `ffn_moe_logits_biased`), added before either.
- A norm weight of (almost) zero in layer L carries no signal to fold; its ratio
  is taken as 0 rather than dividing by it.
- Group-limited selection (DeepSeek's n_group/topk_group) is not modelled: on
  those architectures the prediction is an approximation, not llama.cpp's choice.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from moed.gguf.archs import (
    GATING_SIGMOID,
    GATING_SOFTMAX,
    GATING_SOFTMAX_WEIGHT,
    ROUTER_BIAS,
    ROUTER_WEIGHT,
    SELECTION_BIAS,
    gating_of,
    router_input,
)

_TINY_NORM = 1e-12


def graph_moe_layers(header, moe_layers) -> list[int]:
    """The MoE layers llama.cpp's graph runs: all but the last `nextn_predict_layers`
    blocks (GLM-4.5's and DeepSeek-V3's multi-token-prediction layers, which the
    file carries with their experts and the graph never reaches)."""
    arch = str(header.get("general.architecture", ""))
    blocks = header.get(f"{arch}.block_count")
    nextn = int(header.get(f"{arch}.nextn_predict_layers", 0) or 0)
    if blocks is None or nextn <= 0:
        return list(moe_layers)
    return [layer for layer in moe_layers if layer < int(blocks) - nextn]


@dataclass(frozen=True)
class Router:
    """One MoE layer's routing weights, float32: W (n_experts, n_embd), norm (n_embd,), the
    selection bias `exp_probs_b` or None, and the router bias on the logits or None."""

    weight: np.ndarray
    norm: np.ndarray
    bias: np.ndarray | None = None
    logit_bias: np.ndarray | None = None


class GatePredictor:
    """Predicts layer M's experts from layer L's `ffn_norm-L` rows, for any L <= M."""

    def __init__(self, routers: dict[int, Router], moe_layers: list[int], gating: int = GATING_SOFTMAX):
        self.moe_layers = list(moe_layers)
        self.gating = gating
        self.routers = routers
        self.n_experts = int(next(iter(routers.values())).weight.shape[0])
        # (L, M) -> F[L, M].T, (n_embd, n_experts) C-contiguous: one matmul per target.
        # Folded once, by `prepare` at install or on first use: only the pairs a mode needs take memory.
        self._folded: dict[tuple[int, int], np.ndarray] = {}

    def prepare(self, leads: tuple[int, ...]) -> None:
        """Fold every (L, L + lead) pair now, so that no decode pays for it."""
        for i, layer in enumerate(self.moe_layers):
            for lead in leads:
                if i + lead < len(self.moe_layers):
                    self.folded(layer, self.moe_layers[i + lead])

    def folded(self, src: int, dst: int) -> np.ndarray:
        f = self._folded.get((src, dst))
        if f is None:
            f = self._folded[(src, dst)] = self._fold(src, dst)
        return f

    def _fold(self, src: int, dst: int) -> np.ndarray:
        n_src, r = self.routers[src].norm, self.routers[dst]
        if src == dst:
            return np.ascontiguousarray(r.weight.T)
        safe = np.abs(n_src) > _TINY_NORM
        ratio = np.where(safe, r.norm / np.where(safe, n_src, 1.0), 0.0).astype(np.float32)
        return np.ascontiguousarray((r.weight * ratio[None, :]).T)

    def logits(self, x: np.ndarray, src: int, dst: int) -> np.ndarray:
        """Predicted router logits (n_rows, n_experts) of layer `dst` from layer `src`'s rows `x`."""
        return x @ self.folded(src, dst)

    def scores(self, x: np.ndarray, src: int, dst: int) -> np.ndarray:
        """What llama.cpp's selection sorts: the (router-biased) logits, or gating(logits) +
        bias with a selection bias."""
        logits = self.logits(x, src, dst)
        r = self.routers[dst]
        if r.logit_bias is not None:
            logits = logits + r.logit_bias
        if r.bias is None:
            return logits
        return gate(logits, self.gating) + r.bias


def gate(logits: np.ndarray, gating: int) -> np.ndarray:
    """The router's probabilities: softmax over experts, a per-expert sigmoid, or (SOFTMAX_WEIGHT)
    the logits themselves, as llama.cpp's `ffn_moe_probs` is for that gating."""
    if gating == GATING_SOFTMAX_WEIGHT:
        return logits
    if gating == GATING_SIGMOID:
        return 1.0 / (1.0 + np.exp(-logits))
    z = np.exp(logits - logits.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


def top(scores: np.ndarray, width: int) -> np.ndarray:
    """The `width` best experts of every row, best first, int32 (n_rows, width)."""
    n = scores.shape[1]
    width = min(width, n)
    if n > 256 and width * 4 < n:  # partition first: sorting every expert is the cost on wide models
        part = np.argpartition(-scores, width - 1, axis=1)[:, :width]
        order = np.argsort(-np.take_along_axis(scores, part, axis=1), axis=1, kind="stable")
        return np.take_along_axis(part, order, axis=1).astype(np.int32)
    return np.argsort(-scores, axis=1, kind="stable")[:, :width].astype(np.int32)


# ---- reading the routers out of llama.cpp's mapping ------------------------------


def load_routers(headers, bases: list[int], moe_layers: list[int]) -> tuple[dict[int, Router], int]:
    """Every MoE layer's Router, read from the mapped model (dense pages, resident), and the gating func.

    `headers`: `moed.gguf.header.read_split` of the model (one per shard); `bases`:
    the address at which each shard is mapped (file offset 0).
    """
    infos = {}
    for shard, h in enumerate(headers):
        for t in h.tensors:
            infos[t.name] = (shard, t)
    gating = gating_of(headers[0])
    norm_name = router_input(str(headers[0].get("general.architecture", ""))).norm

    def read(name: str) -> np.ndarray | None:
        if name not in infos:
            return None
        shard, t = infos[name]
        return tensor_f32(bases[shard] + t.offset, t.n_bytes, t.ggml_type, t.dims)

    routers = {}
    for layer in moe_layers:
        w = read(f"blk.{layer}.{ROUTER_WEIGHT}")
        norm = read(f"blk.{layer}.{norm_name}.weight")
        if w is None or norm is None:
            raise ValueError(
                f"layer {layer} has no ffn_gate_inp/{norm_name} weight: gate-ahead prediction "
                "needs both (this architecture is not supported for prefetch)"
            )
        bias, logit_bias = read(f"blk.{layer}.{SELECTION_BIAS}"), read(f"blk.{layer}.{ROUTER_BIAS}")
        routers[layer] = Router(w, norm.reshape(-1), bias, None if logit_bias is None else logit_bias.reshape(-1))
    return routers, gating


def tensor_f32(addr: int, n_bytes: int, ggml_type: int, dims: tuple[int, ...]) -> np.ndarray:
    """A copy, as float32 in numpy order (dims reversed), of a tensor's bytes at `addr`."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    c_bytes = (ctypes.c_char * n_bytes).from_address(addr)
    raw = np.frombuffer(c_bytes, dtype=np.uint8)  # type: ignore[call-overload]  # numpy's stubs list buffer types before 3.12; a ctypes array is one
    shape = tuple(reversed(dims))
    qtype = GGMLQuantizationType(ggml_type)
    if qtype == GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(shape).copy()
    if qtype == GGMLQuantizationType.F16:
        return raw.view(np.float16).reshape(shape).astype(np.float32)
    return np.asarray(dequantize(raw.copy(), qtype), dtype=np.float32).reshape(shape)
