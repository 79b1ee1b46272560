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
gemma4's router reads no norm node: its input is rms_norm(attn_out) / sqrt(n_embd) *
`ffn_gate_inp.scale`, so the predictor is given the residual `attn_out-L` and norms it
itself (`router_rms_input`); `ffn_gate_inp.scale` then plays the norm weight's part.
llama4's graph names no normed FFN row in an MoE layer (its `ffn_norm-L` is the attention
output), so the predictor is given the residual `ffn_inp-L` and computes rms_norm(x) *
`ffn_norm` itself (`Arch.rms_node`); it selects on the logits (sigmoid only weights).
deepseek4 reads `ffn_norm-L` as the common case and gates with sqrt(softplus) (monotone:
without a selection bias the logits' order is the probabilities'); its first
`hash_layer_count` layers select no expert from the router: `ffn_gate_tid2eid` names each
token's experts (`Router.token_experts`). Those layers are `GatePredictor.hashed`: exact
from the token ids (`token_experts`), never from hidden rows, so the look-ahead, which
sees rows and not tokens, predicts and prefetches no hashed layer (their rows still
predict the routed layers after them).

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

import os
from dataclasses import dataclass

import numpy as np

from moed.gguf.archs import (
    GATING_SIGMOID,
    GATING_SOFTMAX,
    GATING_SOFTMAX_WEIGHT,
    GATING_SQRT_SOFTPLUS,
    ROUTER_BIAS,
    ROUTER_SCALE,
    ROUTER_WEIGHT,
    SELECTION_BIAS,
    TOKEN_EXPERTS,
    arch_of,
    gating_of,
    router_input,
)

_TINY_NORM = 1e-12
_RMS_EPS_KEY = "attention.layer_norm_rms_epsilon"  # llama.cpp's f_norm_rms_eps, per architecture
_HC_COUNT_KEY = "hyper_connection.count"  # llama.cpp's dsv4_hc_mult: the residual's streams


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
    # Set where the node is the un-normed residual (Arch.router_scale): the rows are RMS-normed
    # with this epsilon and scaled by 1/sqrt(n_embd), then `norm` (ffn_gate_inp.scale) applies.
    rms_eps: float | None = None
    # Set where the node is the hyper-connection residual (Arch.hc_mix, qwen4exp): this
    # layer's FFN mixer, which turns any layer's residual rows into this router's input.
    hc: HcMix | None = None
    # Set where the layer selects by token id (deepseek4's hash layers): (n_vocab, k) int32,
    # each token's experts, `blk.L.ffn_gate_tid2eid`; the router then only weights them.
    token_experts: np.ndarray | None = None
    # With `rms_eps`: whether the normed rows are also scaled by 1/sqrt(n_embd) (gemma4's router)
    # or not (llama4's, Arch.rms_node: the node is ffn_inp-L and `norm` is ffn_norm's weight).
    rms_sqrt_n: bool = True


@dataclass(frozen=True)
class HcMix:
    """One layer's FFN hyper-connection mixer (qwen4exp's build_hc_mix), float32: the grouped
    RMS norm's gamma `norm` (hc, n_embd), the low-rank gate `down` (rank, hc * n_embd) and
    `up` (hc * n_embd, rank), the norm's `eps`, and for each projection the dtype ggml
    rounds its input to before the matmul (np.float16 for an F16 weight, as the CPU
    backend converts the activation to the weight's vec_dot type; None: no rounding)."""

    norm: np.ndarray
    down: np.ndarray
    up: np.ndarray
    eps: float
    down_input: type | None = None
    up_input: type | None = None


def hc_mix(x: np.ndarray, m: HcMix) -> np.ndarray:
    """The router input (n_tokens, n_embd) from residual rows `x` (n_tokens, hc * n_embd: the
    streams of a token side by side, as `hc_combine-L` lays them out), in ggml's order:

        xn    = rms_norm(x_c) * norm_c                  per stream c (`hc_norm-L`)
        gate  = up @ silu(down @ xn / hc)               (`hc_gate-L`)
        mixed = sum_c xn_c * sigmoid(gate_c) / hc       (`hc_mixed-L`, the router's input)
    """
    hc, n = m.norm.shape
    xs = np.asarray(x, dtype=np.float32).reshape(-1, hc, n)
    # ggml's rms_norm: float squares summed in double, the mean and 1/sqrt in float
    mean = (np.square(xs).astype(np.float64).sum(axis=2, keepdims=True) / n).astype(np.float32)
    xn = (xs * (np.float32(1.0) / np.sqrt(mean + np.float32(m.eps)))) * m.norm
    lo = _rounded(xn.reshape(-1, hc * n), m.down_input) @ m.down.T
    lo = lo * np.float32(1.0 / hc)
    lo = lo / (np.float32(1.0) + np.exp(-lo))
    gate = _rounded(lo, m.up_input) @ m.up.T
    weights = np.float32(1.0) / (np.float32(1.0) + np.exp(-gate))
    return (xn * weights.reshape(-1, hc, n)).sum(axis=1) * np.float32(1.0 / hc)


def _rounded(x: np.ndarray, dtype: type | None) -> np.ndarray:
    return x if dtype is None else x.astype(dtype).astype(np.float32)


class GatePredictor:
    """Predicts layer M's experts from layer L's `ffn_norm-L` rows, for any L <= M."""

    def __init__(self, routers: dict[int, Router], moe_layers: list[int], gating: int = GATING_SOFTMAX):
        self.moe_layers = list(moe_layers)
        self.gating = gating
        self.routers = routers
        self.n_experts = int(next(iter(routers.values())).weight.shape[0])
        # Layers that select by token id: no hidden rows predict them (see `token_experts`).
        self.hashed = frozenset(layer for layer, r in routers.items() if r.token_experts is not None)
        # (L, M) -> F[L, M].T, (n_embd, n_experts) C-contiguous: one matmul per target.
        # Folded once, by `prepare` at install or on first use: only the pairs a mode needs take memory.
        self._folded: dict[tuple[int, int], np.ndarray] = {}

    def prepare(self, leads: tuple[int, ...]) -> None:
        """Fold every (L, L + lead) pair now, so that no decode pays for it (none into a hashed layer)."""
        for i, layer in enumerate(self.moe_layers):
            for lead in leads:
                if i + lead < len(self.moe_layers) and self.moe_layers[i + lead] not in self.hashed:
                    self.folded(layer, self.moe_layers[i + lead])

    def folded(self, src: int, dst: int) -> np.ndarray:
        f = self._folded.get((src, dst))
        if f is None:
            f = self._folded[(src, dst)] = self._fold(src, dst)
        return f

    def _fold(self, src: int, dst: int) -> np.ndarray:
        n_src, r = self.routers[src].norm, self.routers[dst]
        if r.hc is not None and src != dst:  # the mix is not linear: dst's own mix runs on src's rows
            return self.folded(dst, dst)
        if src == dst:
            return np.ascontiguousarray(r.weight.T)
        safe = np.abs(n_src) > _TINY_NORM
        ratio = np.where(safe, r.norm / np.where(safe, n_src, 1.0), 0.0).astype(np.float32)
        return np.ascontiguousarray((r.weight * ratio[None, :]).T)

    def logits(self, x: np.ndarray, src: int, dst: int) -> np.ndarray:
        """Predicted router logits (n_rows, n_experts) of layer `dst` from layer `src`'s rows `x`."""
        r = self.routers[src]
        if r.rms_eps is not None:
            x = router_rms_input(x, r.norm, r.rms_eps, r.rms_sqrt_n)
        hc = self.routers[dst].hc
        if hc is not None:  # layer dst's own FFN mix of layer src's residual, then dst's router
            x = hc_mix(x, hc)
        return x @ self.folded(src, dst)

    def token_experts(self, layer: int, tokens) -> np.ndarray:
        """The experts (n_tokens, k) a hashed layer routes `tokens` to: llama.cpp's own
        `ffn_moe_topk-L` there (a gather of `ffn_gate_tid2eid` rows), exact, in its order."""
        table = self.routers[layer].token_experts
        if table is None:
            raise ValueError(f"layer {layer} selects with its router, not by token id")
        return table[np.asarray(tokens, dtype=np.int64)]

    def scores(self, x: np.ndarray, src: int, dst: int) -> np.ndarray:
        """What llama.cpp's selection sorts: the (router-biased) logits, or gating(logits) +
        bias with a selection bias. Not for a hashed `dst`: its choice is not in the rows."""
        if dst in self.hashed:
            raise ValueError(f"layer {dst} selects by token id: hidden rows do not predict it")
        logits = self.logits(x, src, dst)
        r = self.routers[dst]
        if r.logit_bias is not None:
            logits = logits + r.logit_bias
        if r.bias is None:
            return logits
        return gate(logits, self.gating) + r.bias


def router_rms_input(x: np.ndarray, scale: np.ndarray, eps: float, sqrt_n: bool = True) -> np.ndarray:
    """gemma4's router input from the residual rows `x`: rms_norm(x) / sqrt(n_embd) * scale, in
    ggml's order and precision (squares summed in double, the mean and 1/sqrt in float);
    without `sqrt_n`, llama4's rms_norm(x) * scale (the FFN norm the graph leaves unnamed)."""
    x = np.asarray(x, dtype=np.float32)
    mean = (np.square(x).astype(np.float64).sum(axis=1, keepdims=True) / x.shape[1]).astype(np.float32)
    y = x * (np.float32(1.0) / np.sqrt(mean + np.float32(eps)))
    if sqrt_n:
        y = y * np.float32(1.0 / np.sqrt(np.float32(x.shape[1])))
    return y * scale.astype(np.float32)


def gate(logits: np.ndarray, gating: int) -> np.ndarray:
    """The router's probabilities: softmax over experts, a per-expert sigmoid, sqrt(softplus)
    (ggml's softplus: x itself above 20), or (SOFTMAX_WEIGHT) the logits themselves, as
    llama.cpp's `ffn_moe_probs` is for that gating."""
    if gating == GATING_SOFTMAX_WEIGHT:
        return logits
    if gating == GATING_SQRT_SOFTPLUS:
        x = np.asarray(logits, dtype=np.float32)
        soft = np.log(np.float32(1.0) + np.exp(np.minimum(x, np.float32(20.0))))
        return np.sqrt(np.where(x > np.float32(20.0), x, soft))
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


def load_routers(headers, files: list[str], moe_layers: list[int]) -> tuple[dict[int, Router], int]:
    """Every MoE layer's Router, read from the model's files (a few MiB of dense weights, in
    the page cache after llama.cpp's load), and the gating func.

    `headers`: `moed.gguf.header.read_split` of the model (one per shard); `files`: each
    shard's path (the real file or its skeleton: the dense bytes at the same offsets).
    Read from the files, never through llama.cpp's mapping: llama.cpp unmaps the pages of
    the tensors it put in a device's memory (`n_gpu_layers`), and a page-aligned model's
    router tensors (gemma4's `ffn_gate_inp.scale`) can sit on such pages alone (a read
    through the mapping was SIGSEGV there).
    """
    infos = {}
    for shard, h in enumerate(headers):
        for t in h.tensors:
            infos[t.name] = (shard, t)
    gating = gating_of(headers[0])
    arch = str(headers[0].get("general.architecture", ""))
    norm_name = router_input(arch).norm

    def read(name: str) -> np.ndarray | None:
        if name not in infos:
            return None
        t = infos[name][1]
        return tensor_f32(_bytes_of(name, files, infos), t.ggml_type, t.dims)

    routers = {}
    for layer in moe_layers:
        w = read(f"blk.{layer}.{ROUTER_WEIGHT}")
        norm = read(f"blk.{layer}.{norm_name}.weight")
        if w is None or norm is None:
            raise ValueError(
                f"layer {layer} has no ffn_gate_inp/{norm_name} weight: gate-ahead prediction "
                "needs both (this architecture is not supported for prefetch)"
            )
        rms_eps, hc = None, None
        if arch_of(arch).rms_node:  # the node is ffn_inp-L: norm it here with the FFN norm's weight
            rms_eps = float(headers[0].get(f"{arch}.{_RMS_EPS_KEY}", 1e-6))
        if arch_of(arch).hc_mix:
            n_hc = int(headers[0].get(f"{arch}.{_HC_COUNT_KEY}", 0) or 0)
            hc = _hc_mix(layer, norm, n_hc, float(headers[0].get(f"{arch}.{_RMS_EPS_KEY}", 1e-6)), read, infos)
        if arch_of(arch).router_scale:  # the node is the residual: norm it here, scale by ffn_gate_inp.scale
            norm, rms_eps = read(f"blk.{layer}.{ROUTER_SCALE}"), float(headers[0].get(f"{arch}.{_RMS_EPS_KEY}", 1e-6))
            if norm is None:
                raise ValueError(f"layer {layer} has no {ROUTER_SCALE}: its router's input cannot be rebuilt")
        bias, logit_bias = read(f"blk.{layer}.{SELECTION_BIAS}"), read(f"blk.{layer}.{ROUTER_BIAS}")
        routers[layer] = Router(
            w,
            norm.reshape(-1),
            bias,
            None if logit_bias is None else logit_bias.reshape(-1),
            rms_eps,
            hc,
            _token_table(f"blk.{layer}.{TOKEN_EXPERTS}", files, infos),
            rms_sqrt_n=not arch_of(arch).rms_node,
        )
    return routers, gating


def _bytes_of(name: str, files: list[str], infos) -> bytes:
    """Tensor `name`'s bytes, read from its shard's file at its offset."""
    shard, t = infos[name]
    with open(files[shard], "rb", buffering=0) as f:
        raw = os.pread(f.fileno(), t.n_bytes, t.offset)
    if len(raw) != t.n_bytes:
        raise ValueError(f"{files[shard]}: {name} ends past the end of the file")
    return raw


def _token_table(name: str, files: list[str], infos) -> np.ndarray | None:
    """A hash layer's (n_vocab, k) int32 token -> experts table, read from the file; None if absent."""
    if name not in infos:
        return None
    from gguf import GGMLQuantizationType

    t = infos[name][1]
    if int(t.ggml_type) != GGMLQuantizationType.I32:  # as llama.cpp's get_rows of it gives the top-k's I32
        raise ValueError(f"{name} has ggml type {t.ggml_type}, expected I32")
    raw = _bytes_of(name, files, infos)
    return np.frombuffer(raw, dtype=np.int32).reshape(tuple(reversed(t.dims))).copy()


# The dtype ggml's CPU matmul rounds an F32 activation to for a weight of this type (its
# vec_dot_type, on x86); quantized weights round to a quantized activation, which is
# not modelled: the mix is then close, not ggml's to the last bit.
_MATMUL_INPUT = {0: None, 1: np.float16}  # GGML_TYPE_F32, GGML_TYPE_F16


def _hc_mix(layer: int, norm: np.ndarray, hc: int, eps: float, read, infos) -> HcMix:
    """Layer `layer`'s FFN mixer of `hc` streams: `norm` is its gamma (read as the router
    input's norm weight; llama.cpp reshapes it to [n_embd, hc], so any file shape is taken)."""
    p = f"blk.{layer}.hc_ffn_"
    down, up = read(p + "down.weight"), read(p + "up.weight")
    if hc < 2:
        raise ValueError(f"{_HC_COUNT_KEY} is {hc}: no hyper-connection streams to mix")
    if down is None or up is None:
        raise ValueError(f"layer {layer} has no hc_ffn_down/hc_ffn_up: its router's input cannot be rebuilt")
    rounding = (_MATMUL_INPUT.get(int(infos[p + f"{w}.weight"][1].ggml_type)) for w in ("down", "up"))
    return HcMix(norm.reshape(hc, -1), down, up, eps, *rounding)


def tensor_f32(data: bytes, ggml_type: int, dims: tuple[int, ...]) -> np.ndarray:
    """A copy, as float32 in numpy order (dims reversed), of a tensor's bytes `data`."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = np.frombuffer(data, dtype=np.uint8)
    shape = tuple(reversed(dims))
    qtype = GGMLQuantizationType(ggml_type)
    if qtype == GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(shape).copy()
    if qtype == GGMLQuantizationType.F16:
        return raw.view(np.float16).reshape(shape).astype(np.float32)
    return np.asarray(dequantize(raw.copy(), qtype), dtype=np.float32).reshape(shape)
