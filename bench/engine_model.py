"""A large benchmark model with a real model's geometry, written fast.

`moed.modelgen.makemodel` quantizes real random weights, which takes minutes for
gigabytes on two cores. Routed experts here are random Q4_0 blocks written
directly (a sane f16 scale and random nibbles): the numbers are as arbitrary as
any random model's and cost nothing to make. The dense weights, vocabulary and
metadata come from makemodel, so llama.cpp loads it like the test models.

    python bench/engine_model.py OUT.gguf [--layers 16 --experts 64 --used 8 --embd 2048 --ff 1024] [--recipe q4_k_m]

The default geometry is OLMoE-1B-7B's routing shape (16 MoE layers x 64 experts,
top-8), so the real OLMoE routing trace in ../shared/traces/ can drive it.
Alignment is 4096: every expert part (1024*2048 Q4_0 = 1,179,648 bytes = 288 pages)
is page-aligned and the zero-copy path applies.

`--recipe q4_k_m` writes what llama.cpp's Q4_K_M gives such a model: Q4_K
gate/up experts and attention q/k/output, Q6_K down experts, attention v and
output, all random blocks with sane scales (f16 d in every block).
"""

from __future__ import annotations

import argparse
import math
import pathlib

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

from moed.modelgen import makemodel as mk


def random_q4_0(rng: np.random.Generator, n_experts: int, rows: int, cols: int) -> np.ndarray:
    """Random Q4_0 bytes shaped like gguf's quantized array (n_experts, rows, cols/32*18)."""
    blocks = n_experts * rows * cols // 32
    raw = rng.integers(0, 256, size=(blocks, 18), dtype=np.uint8)
    scale = (1.0 / (4.6 * math.sqrt(cols))) * rng.uniform(0.5, 1.5, size=blocks)
    raw[:, :2] = scale.astype(np.float16).view(np.uint8).reshape(blocks, 2)
    return raw.reshape(n_experts, rows, cols // 32 * 18)


# K-quant blocks: (values, bytes, offset of the f16 super-block scale d, offset of dmin or None)
K_BLOCKS = {GGMLQuantizationType.Q4_K: (256, 144, 0, 2), GGMLQuantizationType.Q6_K: (256, 210, 208, None)}


def random_k(rng: np.random.Generator, kind, lead: tuple[int, ...], rows: int, cols: int) -> np.ndarray:
    """Random Q4_K/Q6_K bytes shaped (*lead, rows, cols/256*block): random quants and sub-scales,
    a sane d (dmin small), as a quantizer's output would look."""
    n, size, d_at, dmin_at = K_BLOCKS[kind]
    blocks = int(np.prod(lead, dtype=np.int64)) * rows * cols // n
    raw = rng.integers(0, 256, size=(blocks, size), dtype=np.uint8)
    d = ((1.0 / (40 * math.sqrt(cols))) * rng.uniform(0.5, 1.5, size=blocks)).astype(np.float16)
    raw[:, d_at : d_at + 2] = d.view(np.uint8).reshape(blocks, 2)
    if dmin_at is not None:
        raw[:, dmin_at : dmin_at + 2] = (d / 8).astype(np.float16).view(np.uint8).reshape(blocks, 2)
    return raw.reshape(*lead, rows, cols // n * size)


def specs(g: mk.Geometry, vocab_size: int, seed: int, recipe: str | None = None):
    """(name, shape, dtype, raw_dtype, make) in file order; `make()` builds the bytes on demand."""
    hd, q4 = g.head_dim, GGMLQuantizationType.Q4_0
    q4k, q6k = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K

    def kmat(kind, *shape: int):
        return (
            (*shape[:-1], shape[-1] // 256 * K_BLOCKS[kind][1]),
            np.uint8,
            kind,
            lambda r: random_k(r, kind, (), shape[0], shape[1]),
        )

    def mat(*shape: int, kind=None):
        if recipe == "q4_k_m" and kind is not None:
            return kmat(kind, *shape)
        return (
            shape,
            np.float16,
            None,
            lambda r: (r.standard_normal(shape, dtype=np.float32) / math.sqrt(shape[-1])).astype(np.float16),
        )

    def norm(n: int):
        return (n,), np.float32, None, lambda r: 1.0 + 0.1 * r.standard_normal(n, dtype=np.float32)

    def router(e: int, n: int):
        return (e, n), np.float32, None, lambda r: 4.0 * r.standard_normal((e, n), dtype=np.float32) / math.sqrt(n)

    def experts(rows: int, cols: int, kind=q4k):
        if recipe == "q4_k_m":
            size = K_BLOCKS[kind][1]
            return (
                (g.experts, rows, cols // 256 * size),
                np.uint8,
                kind,
                lambda r: random_k(r, kind, (g.experts,), rows, cols),
            )
        return (g.experts, rows, cols // 32 * 18), np.uint8, q4, lambda r: random_q4_0(r, g.experts, rows, cols)

    out = [("token_embd.weight", mat(vocab_size, g.embd))]
    for i in range(g.layers):
        p = f"blk.{i}."
        out += [
            (p + "attn_norm.weight", norm(g.embd)),
            (p + "attn_q.weight", mat(g.heads * hd, g.embd, kind=q4k)),
            (p + "attn_k.weight", mat(g.kv_heads * hd, g.embd, kind=q4k)),
            (p + "attn_v.weight", mat(g.kv_heads * hd, g.embd, kind=q6k)),
            (p + "attn_output.weight", mat(g.embd, g.heads * hd, kind=q4k)),
            (p + "attn_q_norm.weight", norm(hd)),
            (p + "attn_k_norm.weight", norm(hd)),
            (p + "ffn_norm.weight", norm(g.embd)),
            (p + "ffn_gate_inp.weight", router(g.experts, g.embd)),
            (p + "ffn_gate_exps.weight", experts(g.ff, g.embd)),
            (p + "ffn_up_exps.weight", experts(g.ff, g.embd)),
            (p + "ffn_down_exps.weight", experts(g.embd, g.ff, kind=q6k)),
        ]
    out += [("output_norm.weight", norm(g.embd)), ("output.weight", mat(vocab_size, g.embd, kind=q6k))]
    for k, (name, (shape, dtype, raw, make)) in enumerate(out):
        yield name, shape, dtype, raw, (lambda make=make, k=k: make(np.random.default_rng([seed, k])))


def write(
    path: str | pathlib.Path,
    *,
    layers: int = 16,
    experts: int = 64,
    used: int = 8,
    embd: int = 2048,
    ff: int = 1024,
    heads: int = 16,
    kv_heads: int = 4,
    ctx: int = 4096,
    seed: int = 0,
    recipe: str | None = None,
) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    g = mk.Geometry(layers, experts, used, embd, ff, heads, kv_heads, ctx)
    toks, scores, types = mk.build_vocab()
    w = GGUFWriter(path, mk.ARCH)
    mk._add_metadata(w, g, toks, scores, types)
    w.add_custom_alignment(4096)
    # Tensor infos first, then each tensor made, written and dropped: the model
    # never has to fit in memory at once.
    items = list(specs(g, len(toks), seed, recipe))
    for name, shape, dtype, raw, _ in items:
        n_bytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, shape, np.dtype(dtype), n_bytes, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, _, _, _, make in items:
        w.write_tensor_data(make())
    w.close()
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    for k, v in (("layers", 16), ("experts", 64), ("used", 8), ("embd", 2048), ("ff", 1024)):
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--recipe", choices=("q4_k_m",), default=None)
    a = ap.parse_args()
    p = write(a.out, layers=a.layers, experts=a.experts, used=a.used, embd=a.embd, ff=a.ff, recipe=a.recipe)
    print(f"wrote {p} ({p.stat().st_size / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
