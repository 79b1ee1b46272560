"""Real models' GGUF headers over sparse files: what the catalog must open fast.

`write_sparse(path, spec)` writes a header exactly as a converted model has it
(every metadata key, the whole tokenizer, the real tensor table with the real
quant types) with `gguf.GGUFWriter`, then extends the file with `ftruncate` to
the size its tensors need. No tensor byte is written: the file is sparse (a
DeepSeek-V3-sized one is 404 GB apparent and under 10 MB on disk), so only
header-reading code may open it (the catalog, `gguf.GGUFReader`, llama.cpp with
`vocab_only`); reading an expert gives zeros.

Specs (each function takes smaller counts for tests; the defaults are the real
model's):
- `qwen3_30b_a3b()`: Qwen3-30B-A3B, 48 layers x 128 experts, top-8, n_embd 2048,
  expert ff 768, 32 query / 4 kv heads of 128, 151,936 tokens and 151,387 merges.
- `deepseek_v3()`: DeepSeek-V3, 61 layers of which the first 3 are dense, 256
  routed experts (top-8, ff 2048) plus one shared expert, n_embd 7168, MLA (q
  rank 1536, kv rank 512, split `attn_k_b`/`attn_v_b`), the selection bias
  `exp_probs_b`, 129,280 tokens and 127,741 merges.

Quant types follow llama.cpp's Q4_K_M (`q4_k_m_type`, the rule in moed.modelgen.quantmix): Q4_K by default; Q6_K for
`output.weight`, and for `ffn_down*` and `attn_v` in the layers llama.cpp's
`use_more_bits` picks (the first and last eighth, and every third between);
norms, biases and routers F32; a row that is not whole 256-blocks falls back as
llama.cpp does (Q4_K -> Q5_0, Q6_K -> Q8_0). So Qwen3-30B-A3B's experts come in
its two published sizes, 3,059,712 and 2,654,208 bytes.

The vocabulary is byte-level BPE built like a real one (llama.cpp loads it with
`vocab_only`): the 256 byte tokens, one token per merge (two earlier tokens
joined, at most 12 characters, ~10 UTF-8 bytes on average), then special and
padding tokens, with their token types; deterministic from `seed`. A parser
cares about the counts and lengths, not the content.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.constants import TokenType

from moed.modelgen import quantmix

Q = GGMLQuantizationType
V = GGUFValueType
_MAX_TOKEN_CHARS = 12


@dataclass(frozen=True)
class Tensor:
    name: str
    dims: tuple[int, ...]  # ggml order: ne0 (contiguous) first
    qtype: GGMLQuantizationType

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.dims) // block * size


@dataclass(frozen=True)
class HeaderSpec:
    arch: str
    metadata: list[tuple[str, object, GGUFValueType, GGUFValueType | None]]  # key, value, type, array element type
    tensors: list[Tensor]
    moe_layers: tuple[int, ...]
    n_experts: int
    vocab: int
    alignment: int = 32


def q4_k_m_type(name: str, dims: tuple[int, ...], n_layers: int, n_experts: int) -> GGMLQuantizationType:
    """The type llama.cpp's Q4_K_M gives a tensor: F32 for vectors, routers and biases, else quantmix's rule."""
    if len(dims) == 1 or "ffn_gate_inp" in name or name.endswith(".bias"):
        return Q.F32
    return quantmix.q4_k_m_type(name, dims[0], n_layers, n_experts)


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-in for every byte (the byte-level BPE alphabet)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def bpe_vocab(
    n_tokens: int, n_merges: int, specials: list[str], seed: int = 0
) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a byte-level BPE vocabulary of `n_tokens`.

    Layout: 256 byte tokens, `n_merges` merged tokens, `specials` (CONTROL), then
    `[PADn]` tokens (USER_DEFINED) up to `n_tokens`.
    """
    if 256 + n_merges + len(specials) > n_tokens:
        raise ValueError(f"{n_tokens} tokens cannot hold 256 bytes, {n_merges} merges and {len(specials)} specials")
    rng = np.random.default_rng(seed)
    tokens = _bytes_to_unicode()
    seen = set(tokens)
    # Right halves are mostly letters and the space marker; lefts mostly recent short tokens.
    common = [tokens[b] for b in range(97, 123)] * 4 + [tokens[32]] * 8 + [tokens[b] for b in range(65, 91)]
    merges: list[str] = []
    while len(merges) < n_merges:
        for a, b in rng.integers(0, 1 << 30, size=(4096, 2)):
            n = len(tokens)
            left = tokens[int(a) % min(n, 4096)] if a & 1 else tokens[int(a) % n]
            right = common[int(b) % len(common)] if b & 1 else tokens[int(b) % min(n, 1024)]
            s = left + right
            if len(s) > _MAX_TOKEN_CHARS or s in seen:
                continue
            seen.add(s)
            tokens.append(s)
            merges.append(f"{left} {right}")
            if len(merges) == n_merges:
                break
    types = [int(TokenType.NORMAL)] * len(tokens)
    tokens += specials
    types += [int(TokenType.CONTROL)] * len(specials)
    pads = [f"[PAD{i}]" for i in range(len(tokens), n_tokens)]
    tokens += pads
    types += [int(TokenType.USER_DEFINED)] * len(pads)
    return tokens, types, merges


def _tokenizer(pre: str, n_tokens: int, n_merges: int, specials: list[str], ids: dict[str, int], seed: int):
    tokens, types, merges = bpe_vocab(n_tokens, n_merges, specials, seed)
    kv: list[tuple[str, object, GGUFValueType, GGUFValueType | None]] = [
        ("tokenizer.ggml.model", "gpt2", V.STRING, None),
        ("tokenizer.ggml.pre", pre, V.STRING, None),
        ("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING),
        ("tokenizer.ggml.token_type", types, V.ARRAY, V.INT32),
        ("tokenizer.ggml.merges", merges, V.ARRAY, V.STRING),
    ]
    kv += [(f"tokenizer.ggml.{k}_token_id", min(v, n_tokens - 1), V.UINT32, None) for k, v in ids.items()]
    return kv


# A stand-in of a real chat template's size (Qwen3's is ~4 KB): one string either way.
_TEMPLATE = "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content }}{%- endfor %}"
_TEMPLATE = (_TEMPLATE + "\n") * 40


def _spec(arch: str, kv, tensors: list[Tensor], moe_layers, n_experts: int, vocab: int) -> HeaderSpec:
    head = [
        ("general.type", "model", V.STRING, None),
        # the module's first name, kept: the header's bytes (and so its measured sizes) stay the same
        ("general.name", f"{arch} header (moed.lab.headers)", V.STRING, None),
        ("general.file_type", 15, V.UINT32, None),  # LLAMA_FTYPE_MOSTLY_Q4_K_M
        ("general.quantization_version", 2, V.UINT32, None),
    ]
    return HeaderSpec(arch, head + kv, tensors, tuple(moe_layers), n_experts, vocab)


def _u32(arch: str, **keys: int):
    return [(f"{arch}.{k.replace('__', '.')}", v, V.UINT32, None) for k, v in keys.items()]


def _f32(arch: str, **keys: float):
    return [(f"{arch}.{k.replace('__', '.')}", v, V.FLOAT32, None) for k, v in keys.items()]


def _place(names_dims: list[tuple[str, tuple[int, ...]]], n_layers: int, n_experts: int) -> list[Tensor]:
    return [Tensor(n, d, q4_k_m_type(n, d, n_layers, n_experts)) for n, d in names_dims]


def qwen3_30b_a3b(
    layers: int = 48, experts: int = 128, vocab: int = 151_936, merges: int = 151_387, seed: int = 0
) -> HeaderSpec:
    """Qwen3-30B-A3B Q4_K_M's header (smaller `layers`/`experts`/`vocab` for tests)."""
    a, embd, ff, heads, kv_heads, hd = "qwen3moe", 2048, 768, 32, 4, 128
    kv = _u32(
        a,
        context_length=40960,
        embedding_length=embd,
        feed_forward_length=6144,
        block_count=layers,
        attention__head_count=heads,
        attention__head_count_kv=kv_heads,
        attention__key_length=hd,
        attention__value_length=hd,
        expert_count=experts,
        expert_used_count=min(8, experts),
        expert_feed_forward_length=ff,
    )
    kv += _f32(a, rope__freq_base=1_000_000.0, attention__layer_norm_rms_epsilon=1e-6)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
    ids = {"eos": 256 + merges + 2, "padding": 256 + merges, "bos": 256 + merges}
    kv += _tokenizer("qwen2", vocab, merges, specials, ids, seed)
    kv += [
        ("tokenizer.ggml.add_bos_token", False, V.BOOL, None),
        ("tokenizer.chat_template", _TEMPLATE, V.STRING, None),
    ]
    tensors = _place([("token_embd.weight", (embd, vocab))], layers, experts)
    for i in range(layers):
        p = f"blk.{i}."
        plan = [
            (p + "attn_norm.weight", (embd,)),
            (p + "attn_q.weight", (embd, heads * hd)),
            (p + "attn_k.weight", (embd, kv_heads * hd)),
            (p + "attn_v.weight", (embd, kv_heads * hd)),
            (p + "attn_output.weight", (heads * hd, embd)),
            (p + "attn_q_norm.weight", (hd,)),
            (p + "attn_k_norm.weight", (hd,)),
            (p + "ffn_norm.weight", (embd,)),
            (p + "ffn_gate_inp.weight", (embd, experts)),
            (p + "ffn_gate_exps.weight", (embd, ff, experts)),
            (p + "ffn_up_exps.weight", (embd, ff, experts)),
            (p + "ffn_down_exps.weight", (ff, embd, experts)),
        ]
        tensors += _place(plan, layers, experts)
    tensors += _place([("output_norm.weight", (embd,)), ("output.weight", (embd, vocab))], layers, experts)
    return _spec(a, kv, tensors, range(layers), experts, vocab)


def deepseek_v3(
    layers: int = 61,
    experts: int = 256,
    dense_lead: int = 3,
    vocab: int = 129_280,
    merges: int = 127_741,
    seed: int = 0,
) -> HeaderSpec:
    """DeepSeek-V3 Q4_K_M's header (smaller counts for tests)."""
    a, embd, ff, moe_ff, heads = "deepseek2", 7168, 18432, 2048, 128
    q_rank, kv_rank, rope, nope, v_dim = 1536, 512, 64, 128, 128
    kv = _u32(
        a,
        context_length=163840,
        embedding_length=embd,
        feed_forward_length=ff,
        block_count=layers,
        attention__head_count=heads,
        attention__head_count_kv=1,
        attention__key_length=kv_rank + rope,
        attention__value_length=kv_rank,
        attention__key_length_mla=nope + rope,
        attention__value_length_mla=v_dim,
        attention__q_lora_rank=q_rank,
        attention__kv_lora_rank=kv_rank,
        rope__dimension_count=rope,
        rope__scaling__original_context_length=4096,
        leading_dense_block_count=dense_lead,
        vocab_size=vocab,
        expert_count=experts,
        expert_used_count=min(8, experts),
        expert_feed_forward_length=moe_ff,
        expert_shared_count=1,
        expert_group_count=8 if experts % 8 == 0 else 1,
        expert_group_used_count=4 if experts % 8 == 0 else 1,
        expert_gating_func=2,  # sigmoid
    )
    kv += _f32(
        a,
        rope__freq_base=10000.0,
        attention__layer_norm_rms_epsilon=1e-6,
        expert_weights_scale=2.5,
        rope__scaling__factor=40.0,
        rope__scaling__yarn_log_multiplier=0.1,
    )
    kv += [
        (f"{a}.expert_weights_norm", True, V.BOOL, None),
        (f"{a}.rope.scaling.type", "yarn", V.STRING, None),
    ]
    specials = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>", "<｜Assistant｜>"]
    ids = {"bos": 256 + merges, "eos": 256 + merges + 1, "padding": 256 + merges + 2}
    kv += _tokenizer("deepseek-v3", vocab, merges, specials, ids, seed)
    kv += [
        ("tokenizer.ggml.add_bos_token", True, V.BOOL, None),
        ("tokenizer.ggml.add_eos_token", False, V.BOOL, None),
        ("tokenizer.chat_template", _TEMPLATE, V.STRING, None),
    ]
    tensors = _place([("token_embd.weight", (embd, vocab))], layers, experts)
    for i in range(layers):
        p = f"blk.{i}."
        plan = [
            (p + "attn_norm.weight", (embd,)),
            (p + "attn_q_a_norm.weight", (q_rank,)),
            (p + "attn_kv_a_norm.weight", (kv_rank,)),
            (p + "attn_q_a.weight", (embd, q_rank)),
            (p + "attn_q_b.weight", (q_rank, heads * (nope + rope))),
            (p + "attn_kv_a_mqa.weight", (embd, kv_rank + rope)),
            (p + "attn_k_b.weight", (nope, kv_rank, heads)),
            (p + "attn_v_b.weight", (kv_rank, v_dim, heads)),
            (p + "attn_output.weight", (heads * v_dim, embd)),
            (p + "ffn_norm.weight", (embd,)),
        ]
        if i < dense_lead:
            plan += [
                (p + "ffn_gate.weight", (embd, ff)),
                (p + "ffn_up.weight", (embd, ff)),
                (p + "ffn_down.weight", (ff, embd)),
            ]
        else:
            plan += [
                (p + "ffn_gate_inp.weight", (embd, experts)),
                (p + "exp_probs_b.bias", (experts,)),
                (p + "ffn_gate_exps.weight", (embd, moe_ff, experts)),
                (p + "ffn_up_exps.weight", (embd, moe_ff, experts)),
                (p + "ffn_down_exps.weight", (moe_ff, embd, experts)),
                (p + "ffn_gate_shexp.weight", (embd, moe_ff)),
                (p + "ffn_up_shexp.weight", (embd, moe_ff)),
                (p + "ffn_down_shexp.weight", (moe_ff, embd)),
            ]
        tensors += _place(plan, layers, experts)
    tensors += _place([("output_norm.weight", (embd,)), ("output.weight", (embd, vocab))], layers, experts)
    return _spec(a, kv, tensors, range(dense_lead, layers), experts, vocab)


def write_sparse(path: str | os.PathLike, spec: HeaderSpec) -> int:
    """Write `spec`'s header to `path` and extend it, as a hole, to its full size; returns that size."""
    w = GGUFWriter(os.fspath(path), spec.arch)
    for key, value, vtype, sub in spec.metadata:
        w.add_key_value(key, value, vtype, sub_type=sub)
    data = 0
    for t in spec.tensors:
        # ggml stores ne0 first; the writer takes numpy order (it reverses).
        w.add_tensor_info(t.name, tuple(reversed(t.dims)), np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
        data += GGUFWriter.ggml_pad(t.nbytes, spec.alignment)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    size = GGUFWriter.ggml_pad(os.path.getsize(path), spec.alignment) + data
    os.truncate(path, size)
    return size
