"""Test-model generator: tiny, real MoE GGUF files that llama.cpp loads and runs.

`make_model(path, ...)` writes a model with random weights (deterministic from
`seed`) and a small SentencePiece-style vocabulary with byte fallback, so llama.cpp
tokenizes any text. Nothing but this generator is checked in; tests and the demo
make their models with it.

Architectures (`arch`, see `ARCHS`: one layer plan and its own keys each; the facts
moed relies on, the router's input norm and the router-side biases, are read from
the architecture table `moed.gguf.archs`):
- `qwen3moe` (the default): per-head q/k norms.
- `olmoe`: q/k norms over the whole projection; llama.cpp wants kv_heads == heads,
  so `kv_heads` is ignored.
- `qwen2moe`: q/k/v biases, and next to the routed experts a dense F16 shared expert
  (`ffn_{gate,up,down}_shexp`) with its sigmoid gate `ffn_gate_inp_shexp`.
- `deepseek2`: MLA attention (q and kv latents, split `attn_k_b`/`attn_v_b`, one kv
  head, so `kv_heads` is ignored), a leading dense layer (`ffn_{gate,up,down}`), an
  ungated dense shared expert, V3-style sigmoid gating with the selection bias
  `exp_probs_b`, normalized top-k weights scaled by 2.5. No expert groups.
- `llama` (Mixtral-style; moectl also takes `--arch mixtral`): plain GQA attention
  with no q/k norms or biases, then the routed experts; the file's architecture is
  `llama` with `llama.expert_count` / `llama.expert_used_count`.
- `gpt-oss` (llama.cpp's OPENAI_MOE): MXFP4 routed experts by default, each part with
  an F32 bias row per expert (`ffn_{gate,up,down}_exps.bias`, [experts, rows]); the
  router's bias `ffn_gate_inp.bias`; q/k/v and output biases; one attention sink per
  head (`attn_sinks`); the FFN input normed by `post_attention_norm` (no ffn_norm);
  `attention.sliding_window` (32 here) on every other layer, llama.cpp's default
  pattern. The expert biases are dense, not served: llama.cpp adds them with add_id
  from the whole tensor; a part's row is 2880 f32 (11,520 bytes, not whole pages) in
  gpt-oss-20b, all three 0.26% of an expert's 13.2 MB; and the catalog's parts are the
  `.weight` tensors only, so the skeleton and `align` keep them as dense bytes.
- `glm4moe` (GLM-4.5): q/k/v biases, per-head q/k norms (the 355B's), partial rope
  (half of each head), the FFN input normed by `post_attention_norm`, a leading dense
  layer, V3-style sigmoid gating with `exp_probs_b`, normalized top-k weights scaled
  by 2.5, an ungated dense shared expert; `nextn_predict_layers` 0 (no MTP layer).

Invariants:
- Routed experts are `blk.N.ffn_{gate,up,down}_exps.weight`, quantized with q8_0,
  q4_0, q4_k, q6_k or mxfp4 (the arch's own when `quant` is not given; per layer
  with `layer_quants`, which makes mixed size classes; per tensor with a `recipe` from `RECIPES`: `q4_k_m` is llama.cpp's Q4_K_M rule,
  which mixes Q4_K and Q6_K inside a layer and across layers and quantizes the
  attention and embeddings too).
  Dense weights are F16 (matrices) and F32 (norms, router, biases, sinks).
- `align` becomes `general.alignment` in every shard (llama.cpp reads each shard's
  own alignment), so with `align=4096` an expert whose byte size is a multiple of
  4096 starts on a page boundary.
- `split=N` writes llama.cpp's shard naming `X-00001-of-0000N.gguf` with the
  `split.no / split.count / split.tensors.count` keys in every shard; general
  metadata lives in the first shard. The first returned path is the one to load.
- The same arguments always produce the same bytes.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, quants
from gguf.constants import GGUFValueType, Keys, TokenType

from moed.gguf.archs import GATING_SIGMOID, Arch, arch_of
from moed.gguf.header import shard_names
from moed.modelgen import families, quantmix
from moed.modelgen.plan import (
    DENSE_LEAD,
    KV,
    ArchPlan,
    Geometry,
    Quants,
    Spec,
    attention,
    moe_or_dense_ffn,
    routed,
    shared_expert,
)

ARCH = "qwen3moe"
QUANTS = {
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
    "q4_k": GGMLQuantizationType.Q4_K,
    "q6_k": GGMLQuantizationType.Q6_K,
    "mxfp4": GGMLQuantizationType.MXFP4,  # gpt-oss's experts: 32 E2M1 values and one E8M0 scale in 17 bytes
}
PartQuants = tuple[str, str, str]  # one layer's (gate, up, down) quants

Q = GGMLQuantizationType


def _q4_k_m(name: str, row: int, g: Geometry) -> GGMLQuantizationType | None:
    """llama.cpp's Q4_K_M type for one weight matrix (moed.modelgen.quantmix); None: F16."""
    qtype = quantmix.q4_k_m_type(name, row, g.layers, g.experts)
    return None if qtype == Q.F16 else qtype


# Named quant mixes: the quant type of every weight matrix (None: F16), by name.
RECIPES: dict[str, Callable[[str, int, Geometry], GGMLQuantizationType | None]] = {"q4_k_m": _q4_k_m}

# A few whole-word tokens so sampled text looks like text; everything else falls
# back to single characters or bytes.
_WORDS = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "it",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "be",
    "at",
    "this",
    "have",
    "from",
    "or",
    "one",
    "by",
    "not",
    "but",
    "what",
    "all",
    "were",
    "we",
    "when",
    "your",
    "can",
    "expert",
    "model",
    "memory",
    "page",
    "drive",
    "token",
    "hello",
    "world",
)
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def shard_paths(path: str | pathlib.Path, split: int) -> list[pathlib.Path]:
    """llama.cpp's shard names for `path` (`X.gguf` -> `X-0000i-of-0000N.gguf`)."""
    return [pathlib.Path(p) for p in shard_names(path, split)]


# --------------------------------------------------------------------------- vocab


def build_vocab(size: int | None = None) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, types): <unk> <s> </s>, 256 byte tokens, characters, words."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [TokenType.BYTE] * 256
    pieces = ["\u2581"] + [chr(c) for c in range(33, 127)]
    pieces += ["\u2581" + w for w in _WORDS]
    tokens += pieces
    types += [TokenType.NORMAL] * len(pieces)
    if size is not None:
        if size < len(tokens):
            raise ValueError(f"vocab must be at least {len(tokens)} tokens, got {size}")
        extra = [f"\u2581tok{i}" for i in range(size - len(tokens))]
        tokens += extra
        types += [TokenType.NORMAL] * len(extra)
    # SentencePiece merges prefer higher scores: longer pieces win.
    scores = [
        0.0 if t in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.BYTE) else -100.0 + len(tok)
        for tok, t in zip(tokens, types)
    ]
    return tokens, scores, [int(t) for t in types]


# --------------------------------------------------------------------------- quantization


def _fit_k_affine(data: np.ndarray, top: int) -> tuple[np.ndarray, ...]:
    """The min/max fit Q4_K and Q5_K share: per 256 values an f16 d and dmin, per
    32-value sub-block a 6-bit scale and min, per value q in 0..top.

    A plain fit, not llama.cpp's iterative search: good enough for random test
    weights, and exact in layout (checked against gguf.quants.dequantize in the tests).
    Returns (d16, dmin16, sc, m, q) with sc, m (n, 8) and q (n, 8, 32), all uint8.
    """
    rows = data.reshape(-1, 256).astype(np.float32)
    n = rows.shape[0]
    sub = rows.reshape(n, 8, 32)
    mn = np.minimum(sub.min(axis=-1), 0.0)  # (n, 8), <= 0
    scale = (sub.max(axis=-1) - mn) / float(top)  # (n, 8), >= 0
    d16 = (scale.max(axis=-1) / 63.0).astype(np.float16)
    dmin16 = ((-mn).max(axis=-1) / 63.0).astype(np.float16)
    d32, dmin32 = d16.astype(np.float32), dmin16.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32[:, None] > 0, np.rint(scale / d32[:, None]), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dmin32[:, None] > 0, np.rint(-mn / dmin32[:, None]), 0).clip(0, 63).astype(np.uint8)
        step = d32[:, None] * sc  # (n, 8)
        offs = dmin32[:, None] * m
        q = np.where(step[..., None] > 0, np.rint((sub + offs[..., None]) / step[..., None]), 0)
    return d16, dmin16, sc, m, q.clip(0, top).astype(np.uint8)


def _k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The 12 bytes that pack eight 6-bit scales and mins (Q4_K's and Q5_K's get_scale_min_k4)."""
    scales = np.empty((sc.shape[0], 12), np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return scales


def _quantize_q4_k(data: np.ndarray) -> np.ndarray:
    """Q4_K blocks (gguf-py only dequantizes it): 256 values -> d, dmin, 12 scale bytes, 128 nibbles."""
    d16, dmin16, sc, m, q = _fit_k_affine(data, 15)
    n = q.shape[0]
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(n, 128)
    blocks = np.concatenate(
        [d16.view(np.uint8).reshape(n, 2), dmin16.view(np.uint8).reshape(n, 2), _k_scales(sc, m), qs], axis=-1
    )
    return blocks.reshape(*data.shape[:-1], data.shape[-1] // 256 * 144)


def _quantize_q5_k(data: np.ndarray) -> np.ndarray:
    """Q5_K blocks (gguf-py only dequantizes it): Q4_K's layout plus 32 bytes whose bit s is
    sub-block s's fifth bit: d, dmin, 12 scale bytes, 32 high-bit bytes, 128 nibbles."""
    d16, dmin16, sc, m, q = _fit_k_affine(data, 31)
    n = q.shape[0]
    lo = q & 0x0F
    qs = (lo[:, 0::2, :] | (lo[:, 1::2, :] << 4)).reshape(n, 128)
    qh = ((q >> 4).astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    blocks = np.concatenate(
        [d16.view(np.uint8).reshape(n, 2), dmin16.view(np.uint8).reshape(n, 2), _k_scales(sc, m), qh, qs], axis=-1
    )
    return blocks.reshape(*data.shape[:-1], data.shape[-1] // 256 * 176)


def _quantize_q6_k(data: np.ndarray) -> np.ndarray:
    """Q6_K blocks (gguf-py only dequantizes it): 256 values -> 128 low nibbles, 64 bytes of
    high bit pairs, 16 int8 scales, then d.

    A plain absmax fit per 16-value sub-block (q - 32 in -31..31), exact in layout
    (checked against gguf.quants.dequantize in the tests).
    """
    rows = data.reshape(-1, 256).astype(np.float32)
    n = rows.shape[0]
    sub = rows.reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31.0  # (n, 16), >= 0
    d16 = (scale.max(axis=-1) / 127.0).astype(np.float16)
    d32 = d16.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32[:, None] > 0, np.rint(scale / d32[:, None]), 0).clip(0, 127).astype(np.int8)
        step = d32[:, None] * sc
        q = np.where(step[..., None] > 0, np.rint(sub / step[..., None]), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)  # two halves of 128 values
    lo, hi = (q & 0x0F).reshape(n, 2, 2, 64), (q >> 4).reshape(n, 2, 4, 32)
    ql = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(n, 128)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(n, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), d16.view(np.uint8).reshape(n, 2)], axis=-1)
    return blocks.reshape(*data.shape[:-1], data.shape[-1] // 256 * 210)


_OWN_QUANTIZERS = {Q.Q4_K: _quantize_q4_k, Q.Q5_K: _quantize_q5_k, Q.Q6_K: _quantize_q6_k}


def quantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Raw bytes of `data` in `qtype`, shaped like gguf-py's quantize (last axis in bytes)."""
    block, _ = GGML_QUANT_SIZES[qtype]
    if data.shape[-1] % block:
        raise ValueError(f"{qtype.name} needs rows that are a multiple of {block} values, got {data.shape[-1]}")
    if qtype in _OWN_QUANTIZERS:
        return _OWN_QUANTIZERS[qtype](data)
    return quants.quantize(data.astype(np.float32), qtype)


# Random raw blocks: the scale that gives values of about unit standard deviation
# for uniformly random quant bytes (q8_0: int8 std ~73.9; q4_0: (q - 8) std ~4.6;
# q4_k: d*sc*q - dmin*m with dmin = 7.5 d has std ~258 d and mean ~0; q6_k: int8
# scale times (q - 32), 73.9 * 18.5), and where each block keeps its f16 d.
_RANDOM_BLOCK_STD = {
    GGMLQuantizationType.Q8_0: 73.9,
    GGMLQuantizationType.Q4_0: 4.6,
    GGMLQuantizationType.Q4_K: 258.0,
    GGMLQuantizationType.Q6_K: 1367.0,
    GGMLQuantizationType.MXFP4: 5.85,  # E2M1 values (doubled, as ggml stores them): std of the 16 codes
}
_D_OFFSET = {GGMLQuantizationType.Q6_K: 208}  # the others start with d


def random_blocks(n_rows: int, row: int, qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """`n_rows` rows of `row` values as uniformly random quant blocks with sane scales.

    About 20x faster than quantizing Gaussian floats: for big benchmark models,
    whose weights only need to be well-formed, not meaningful.
    """
    block, size = GGML_QUANT_SIZES[qtype]
    n_blocks = n_rows * row // block
    raw = rng.bit_generator.random_raw(-(-n_blocks * size // 8)).view(np.uint8)[: n_blocks * size]
    blocks = raw.reshape(n_blocks, size)
    scale = 1.0 / (_RANDOM_BLOCK_STD[qtype] * math.sqrt(row))
    if qtype == GGMLQuantizationType.MXFP4:  # one E8M0 byte, e: the block's scale is 2**(e - 128)
        blocks[:, 0] = round(math.log2(scale)) + 128
        return blocks.reshape(n_rows, row // block * size)
    d = np.float16(scale)
    at = _D_OFFSET.get(qtype, 0)
    blocks[:, at : at + 2] = np.frombuffer(d.tobytes(), np.uint8)
    if qtype == GGMLQuantizationType.Q4_K:
        blocks[:, 2:4] = np.frombuffer(np.float16(7.5 * float(d)).tobytes(), np.uint8)
    return blocks.reshape(n_rows, row // block * size)


# --------------------------------------------------------------------------- model


def _check(g: Geometry, quant_names: list[str], split: int, align: int) -> None:
    if min(g.layers, g.experts, g.used, g.embd, g.ff, g.heads, g.kv_heads, g.ctx, split) < 1:
        raise ValueError("all sizes must be positive")
    if g.used > g.experts:
        raise ValueError(f"used ({g.used}) must not exceed experts ({g.experts})")
    if g.embd % g.heads or g.heads % g.kv_heads:
        raise ValueError("embd must be a multiple of heads, heads a multiple of kv_heads")
    if align < 8 or align & (align - 1):
        raise ValueError(f"align must be a power of two >= 8, got {align}")
    for q in dict.fromkeys(quant_names):
        if q not in QUANTS:
            raise ValueError(f"unknown quant {q!r} (use {', '.join(QUANTS)})")
        block, _ = GGML_QUANT_SIZES[QUANTS[q]]
        if g.embd % block or g.ff % block:
            raise ValueError(f"{q} needs embd and ff to be multiples of {block} (got embd={g.embd}, ff={g.ff})")


def _layer_qwen3moe(g: Geometry, i: int, qt: Quants, facts: Arch) -> list[Spec]:
    p = f"blk.{i}."
    return attention(g, p, qk_norm="head") + routed(g, p, qt, facts)


def _layer_olmoe(g: Geometry, i: int, qt: Quants, facts: Arch) -> list[Spec]:
    # OLMoE normalizes the whole q and k projections (n_embd wide), not each head.
    p = f"blk.{i}."
    return attention(g, p, qk_norm="full") + routed(g, p, qt, facts)


def _layer_llama(g: Geometry, i: int, qt: Quants, facts: Arch) -> list[Spec]:
    # Mixtral: llama's attention (no q/k norms, no biases) and routed experts only.
    p = f"blk.{i}."
    return attention(g, p) + routed(g, p, qt, facts)


def _layer_qwen2moe(g: Geometry, i: int, qt: Quants, facts: Arch) -> list[Spec]:
    p = f"blk.{i}."
    return attention(g, p, bias=True) + routed(g, p, qt, facts) + shared_expert(g, p, gated=True)


# DeepSeek-V2/V3-style MLA: q and kv compressed to latents of _MLA_RANK, rope and
# no-rope halves of _MLA_ROPE each per query/key head, values head_dim wide.
_MLA_RANK, _MLA_ROPE = 32, 16


def _layer_deepseek2(g: Geometry, i: int, qt: Quants, facts: Arch) -> list[Spec]:
    p, hd, nope = f"blk.{i}.", g.head_dim, _MLA_ROPE
    specs = [
        Spec(p + "attn_norm.weight", (g.embd,), "norm"),
        Spec(p + "attn_q_a.weight", (_MLA_RANK, g.embd), "f16"),
        Spec(p + "attn_q_a_norm.weight", (_MLA_RANK,), "norm"),
        Spec(p + "attn_q_b.weight", (g.heads * (nope + _MLA_ROPE), _MLA_RANK), "f16"),
        Spec(p + "attn_kv_a_mqa.weight", (_MLA_RANK + _MLA_ROPE, g.embd), "f16"),
        Spec(p + "attn_kv_a_norm.weight", (_MLA_RANK,), "norm"),
        Spec(p + "attn_k_b.weight", (g.heads, _MLA_RANK, nope), "f16"),
        Spec(p + "attn_v_b.weight", (g.heads, hd, _MLA_RANK), "f16"),
        Spec(p + "attn_output.weight", (g.embd, g.heads * hd), "f16"),
    ]
    return specs + moe_or_dense_ffn(g, i, p, qt, facts)


def _layer_glm4moe(g: Geometry, i: int, qt: Quants, facts: Arch) -> list[Spec]:
    # GLM-4.5: q/k/v biases, per-head q/k norms (the 355B's; optional in llama.cpp),
    # the FFN input normed by post_attention_norm (no ffn_norm: the architecture table's
    # router input), a leading dense layer, then sigmoid routing with the selection bias
    # exp_probs_b and an ungated shared expert.
    p = f"blk.{i}."
    return attention(g, p, qk_norm="head", bias=True) + moe_or_dense_ffn(g, i, p, qt, facts)


def _kv_glm4moe(g: Geometry) -> KV:
    return {
        "rope.dimension_count": g.head_dim // 2,  # partial rope: GLM rotates half of each head
        "leading_dense_block_count": DENSE_LEAD,
        "expert_shared_count": 1,
        "expert_weights_scale": 2.5,  # GLM-4.5's routed_scaling_factor
        "expert_weights_norm": True,
        "expert_gating_func": GATING_SIGMOID,
        "nextn_predict_layers": 0,  # no multi-token-prediction layer
    }


def _layer_gpt_oss(g: Geometry, i: int, qt: Quants, facts: Arch) -> list[Spec]:
    # llama.cpp's OPENAI_MOE: biases on q/k/v and the output, one attention sink per
    # head, then (the architecture table's facts) the FFN input normed by
    # post_attention_norm (there is no ffn_norm), a router with a bias, and a bias row
    # per routed expert and part. The expert biases stay dense (see the module
    # docstring): llama.cpp adds them with add_id from the whole [experts, rows] tensor,
    # and they are 0.26% of the expert bytes (gpt-oss-20b).
    p = f"blk.{i}."
    attn = attention(g, p, bias=True) + [
        Spec(p + "attn_output.bias", (g.embd,), "bias"),
        Spec(p + "attn_sinks.weight", (g.heads,), "bias"),
    ]
    return attn + routed(g, p, qt, facts)


# gpt-oss's sliding window (128 in the real models): short enough here that the
# alternate layers (llama.cpp's default pattern: every other layer, from the first)
# attend to a window on a test prompt.
_SWA_WINDOW = 32


def _kv_deepseek2(g: Geometry) -> KV:
    return {
        "attention.key_length": _MLA_RANK + _MLA_ROPE,  # MLA's cache: the latent and the rope key
        "attention.value_length": _MLA_RANK,
        "attention.key_length_mla": 2 * _MLA_ROPE,
        "attention.value_length_mla": g.head_dim,
        "attention.q_lora_rank": _MLA_RANK,
        "attention.kv_lora_rank": _MLA_RANK,
        "rope.dimension_count": _MLA_ROPE,
        "leading_dense_block_count": DENSE_LEAD,
        "expert_shared_count": 1,
        "expert_weights_scale": 2.5,
        "expert_weights_norm": True,
        "expert_gating_func": GATING_SIGMOID,  # as V3
    }


ARCHS: dict[str, ArchPlan] = {
    "qwen3moe": ArchPlan(_layer_qwen3moe),
    "olmoe": ArchPlan(_layer_olmoe, kv_heads=lambda heads, kv_heads: heads),
    "qwen2moe": ArchPlan(_layer_qwen2moe, lambda g: {"expert_shared_feed_forward_length": g.ff}),
    "deepseek2": ArchPlan(_layer_deepseek2, _kv_deepseek2, kv_heads=lambda heads, kv_heads: 1),  # one latent kv
    "llama": ArchPlan(_layer_llama),  # Mixtral-style: llama with ffn_*_exps
    "gpt-oss": ArchPlan(_layer_gpt_oss, lambda g: {"attention.sliding_window": _SWA_WINDOW}, expert_quant="mxfp4"),
    "glm4moe": ArchPlan(_layer_glm4moe, _kv_glm4moe),
    **families.PLANS,  # the newer architectures, one module each (moed.modelgen.families)
}


def _plan(
    g: Geometry, part_quants: list[PartQuants], vocab_size: int, arch: str = ARCH, recipe: str | None = None
) -> list[Spec]:
    """Every tensor of the model, in file order; a `recipe` then picks every weight matrix's type."""
    plan, facts = ARCHS[arch], arch_of(arch)
    specs = [Spec("token_embd.weight", (vocab_size, g.embd), "embd"), *plan.model_tensors(g, vocab_size)]
    for i in range(g.layers):
        gate, up, down = part_quants[i]
        specs += plan.layer(g, i, (QUANTS[gate], QUANTS[up], QUANTS[down]), facts)
    if plan.output_norm:
        specs.append(Spec("output_norm.weight", (g.embd,), "norm"))
    if plan.output:
        specs.append(Spec("output.weight", (vocab_size, g.embd), "f16"))
    if recipe is None:
        return specs
    rule = RECIPES[recipe]
    return [dataclasses.replace(s, qtype=rule(s.name, s.shape[-1], g)) if s.kind in _MATRIX_KINDS else s for s in specs]


_MATRIX_KINDS = ("embd", "f16", "experts")  # what a recipe quantizes; norms, biases and routers stay F32


def _fill(spec: Spec, rng: np.random.Generator, random_experts: bool = False) -> np.ndarray:
    """The tensor's data; experts are made one at a time to bound memory on big models."""

    def mat(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) / np.float32(math.sqrt(shape[-1]))

    def dense(values: np.ndarray) -> np.ndarray:  # F16, or the type a recipe gave it
        return values.astype(np.float16) if spec.qtype is None else quantize(values, spec.qtype)

    if spec.values is not None:  # the plan's own contents, as the file's bytes
        return np.ascontiguousarray(spec.values(rng)).view(np.uint8).reshape(spec.byte_shape)
    if spec.kind == "embd":
        return dense(rng.standard_normal(spec.shape, dtype=np.float32))
    if spec.kind == "norm":
        return (1.0 + 0.1 * rng.standard_normal(spec.shape, dtype=np.float32)).astype(np.float32)
    if spec.kind == "bias":
        return 0.1 * rng.standard_normal(spec.shape, dtype=np.float32)
    if spec.kind == "f16":
        return dense(mat(*spec.shape))
    if spec.kind == "router":
        return 4.0 * mat(*spec.shape)  # a strong router spreads choices over all experts
    if spec.kind == "decay":  # a recurrent layer's A = -exp(A_log), in [-16, -1] as Mamba initializes it: state decays
        return -np.exp(rng.uniform(0.0, math.log(16.0), spec.shape)).astype(np.float32)
    if spec.kind == "router_bias":  # a quarter of the logits' spread: it changes some choices, not all
        return rng.standard_normal(spec.shape, dtype=np.float32)
    qtype = spec.qtype
    assert qtype is not None  # only the "experts" kind is left, and _plan gives every one a quant type
    out = np.empty(spec.byte_shape, np.uint8)
    for e in range(spec.shape[0]):
        if random_experts:
            out[e] = random_blocks(spec.shape[1], spec.shape[2], qtype, rng)
        else:
            out[e] = quantize(mat(*spec.shape[1:]), qtype)
    return out


def _add_metadata(w: GGUFWriter, g: Geometry, tokens, scores, types, arch: str = ARCH) -> None:
    a = arch
    w.add_name("moed test model")
    w.add_uint32(Keys.LLM.CONTEXT_LENGTH.format(arch=a), g.ctx)
    w.add_uint32(Keys.LLM.EMBEDDING_LENGTH.format(arch=a), g.embd)
    w.add_uint32(Keys.LLM.BLOCK_COUNT.format(arch=a), g.layers)
    w.add_uint32(Keys.LLM.FEED_FORWARD_LENGTH.format(arch=a), g.ff)
    w.add_uint32(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH.format(arch=a), g.ff)
    w.add_uint32(Keys.LLM.EXPERT_COUNT.format(arch=a), g.experts)
    w.add_uint32(Keys.LLM.EXPERT_USED_COUNT.format(arch=a), g.used)
    w.add_uint32(Keys.Attention.HEAD_COUNT.format(arch=a), g.heads)
    extra = dict(ARCHS[a].extra_kv(g))  # an arch's own keys; it may also set the head lengths
    # and a per-layer kv head count (kimi-k3: 0 marks a recurrent layer)
    kv_heads = extra.pop("attention.head_count_kv", g.kv_heads)
    if isinstance(kv_heads, list):
        w.add_array(Keys.Attention.HEAD_COUNT_KV.format(arch=a), kv_heads)
    else:
        assert isinstance(kv_heads, int), "attention.head_count_kv must be an int or a list"
        w.add_uint32(Keys.Attention.HEAD_COUNT_KV.format(arch=a), kv_heads)
    for key, name in (
        (Keys.Attention.KEY_LENGTH, "attention.key_length"),
        (Keys.Attention.VALUE_LENGTH, "attention.value_length"),
    ):
        length = extra.pop(name, g.head_dim)
        assert isinstance(length, int), f"{name} must be an int"
        w.add_uint32(key.format(arch=a), length)
    w.add_float32(Keys.Attention.LAYERNORM_RMS_EPS.format(arch=a), 1e-6)
    w.add_float32(Keys.Rope.FREQ_BASE.format(arch=a), 10000.0)
    for key, value in extra.items():
        if isinstance(value, bool):
            w.add_bool(f"{a}.{key}", value)
        elif isinstance(value, float):
            w.add_float32(f"{a}.{key}", value)
        elif isinstance(value, str):
            w.add_string(f"{a}.{key}", value)
        elif isinstance(value, list):
            w.add_array(f"{a}.{key}", value)
        elif isinstance(value, tuple):  # (GGUF element type, values): 64-bit arrays gguf-py cannot infer
            w.add_key_value(f"{a}.{key}", list(value[1]), GGUFValueType.ARRAY, sub_type=value[0])
        else:
            w.add_uint32(f"{a}.{key}", value)
    w.add_string(Keys.Tokenizer.MODEL, "llama")
    w.add_array(Keys.Tokenizer.LIST, tokens)
    w.add_array(Keys.Tokenizer.SCORES, scores)
    w.add_array(Keys.Tokenizer.TOKEN_TYPE, types)
    w.add_uint32(Keys.Tokenizer.UNK_ID, 0)
    w.add_uint32(Keys.Tokenizer.BOS_ID, 1)
    w.add_uint32(Keys.Tokenizer.EOS_ID, 2)
    w.add_bool(Keys.Tokenizer.ADD_BOS, True)
    w.add_bool(Keys.Tokenizer.ADD_EOS, False)
    w.add_string(Keys.Tokenizer.CHAT_TEMPLATE, _CHAT_TEMPLATE)


def _chunks(items: list, n: int) -> list[list]:
    """`items` cut into `n` contiguous runs of near-equal length."""
    size = math.ceil(len(items) / n)
    return [items[i * size : (i + 1) * size] for i in range(n)]


def make_model(
    path: str | pathlib.Path,
    *,
    layers: int = 4,
    experts: int = 8,
    used: int = 2,
    embd: int = 64,
    ff: int = 64,
    quant: str | None = None,
    layer_quants: list[str] | str | None = None,
    align: int = 32,
    split: int = 1,
    seed: int = 0,
    vocab: int | None = None,
    ctx: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    random_experts: bool = False,
    arch: str = ARCH,
    recipe: str | None = None,
) -> list[pathlib.Path]:
    """Write the model; returns its shard paths (the first is the one to load).

    `random_experts` fills expert tensors with random quant blocks instead of
    quantized Gaussian weights: much faster for multi-GB benchmark models.
    `arch` is one of `ARCHS` (the default, qwen3moe, writes the same bytes as ever).
    `quant` is the routed experts' quant for every layer; by default the arch's own
    (`_Arch.expert_quant`: mxfp4 for gpt-oss, q8_0 for the others).
    `recipe` (one of `RECIPES`) picks every weight matrix's quant, as llama.cpp's
    quantizer would, instead of `quant`/`layer_quants`.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r} (use {', '.join(ARCHS)})")
    kv_heads = ARCHS[arch].kv_heads(heads, kv_heads)
    quant = quant or ARCHS[arch].expert_quant
    g = Geometry(layers, experts, used, embd, ff, heads, kv_heads, ctx)
    if isinstance(layer_quants, str):
        layer_quants = layer_quants.split(",")
    lq = list(layer_quants) if layer_quants else [quant] * layers
    if len(lq) != layers:
        raise ValueError(f"layer_quants has {len(lq)} entries for {layers} layers")
    part_quants = _part_quants(lq, recipe, layer_quants is not None)
    _check(g, [q for pq in part_quants for q in pq], split, align)
    tokens, scores, types = build_vocab(vocab)
    specs = _plan(g, part_quants, len(tokens), arch, recipe)
    if split > len(specs):
        raise ValueError(f"split ({split}) exceeds the number of tensors ({len(specs)})")
    paths = shard_paths(path, split)
    for path_i in paths:
        path_i.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)  # one stream, consumed in file order
    for i, (p, chunk) in enumerate(zip(paths, _chunks(specs, split))):
        _write_shard(
            p,
            i,
            split,
            len(specs),
            chunk,
            align,
            rng,
            random_experts,
            arch,
            (lambda w: _add_metadata(w, g, tokens, scores, types, arch)) if i == 0 else None,
        )
    return paths


def _part_quants(layer_quants: list[str], recipe: str | None, explicit: bool) -> list[PartQuants]:
    """Each layer's (gate, up, down) quants: the layer's quant for all three.

    With a recipe the experts start as Q4_K (every recipe's k-quant base, which needs
    embd and ff to be multiples of 256); `_plan` then applies the recipe per tensor.
    """
    if recipe is None:
        return [(q, q, q) for q in layer_quants]
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r} (use {', '.join(RECIPES)})")
    if explicit:
        raise ValueError("give a recipe or layer_quants, not both")
    return [("q4_k", "q4_k", "q4_k")] * len(layer_quants)


def _write_shard(
    path: pathlib.Path,
    index: int,
    count: int,
    total_tensors: int,
    specs: list[Spec],
    align: int,
    rng: np.random.Generator,
    random_experts: bool,
    arch: str,
    add_metadata,
) -> None:
    """Header first, then each tensor made and written in turn (never all in memory)."""
    w = GGUFWriter(path, arch)
    if add_metadata is not None:
        add_metadata(w)
    if count > 1:
        w.add_uint16(Keys.Split.LLM_KV_SPLIT_NO, index)
        w.add_uint16(Keys.Split.LLM_KV_SPLIT_COUNT, count)
        w.add_int32(Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, total_tensors)
    if align != 32 or count > 1:
        w.add_custom_alignment(align)
    for spec in specs:
        w.add_tensor_info(spec.name, spec.byte_shape, np.dtype(spec.dtype), spec.nbytes, raw_dtype=spec.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for spec in specs:
        w.write_tensor_data(_fill(spec, rng, random_experts))
    w.close()


def aligned_geometry(quant: str | None = None, arch: str = ARCH) -> dict:
    """embd/ff that make every expert part a multiple of 4096 bytes for `quant` (by
    default `arch`'s own expert quant).

    q8_0 stores 32 values in 34 bytes, q4_0 in 18, q4_k 256 in 144: in each case
    `embd * ff` must be a multiple of 65536 (17 and 9 are odd), so 256 x 256.
    mxfp4 stores 32 in 17, so `embd * ff` must be a multiple of 131072: 256 x 512.
    """
    quant = quant or ARCHS[arch].expert_quant
    return {"embd": 256, "ff": 512 if quant == "mxfp4" else 256, "align": 4096, "quant": quant}
