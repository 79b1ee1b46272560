"""Catalog.open on a real model's header, beside gguf.GGUFReader on the same file.

The daemon opens the catalog on every first open_model, so it must stay fast for
big models with big vocabularies. This writes a sparse GGUF with the metadata and
tensor table of a Qwen3-30B-A3B-sized model (48 MoE layers x 128 experts, top-8,
n_embd 2048, expert ff 768, Q4_K experts, a 151,936-token vocabulary with merges;
~17 GB apparent size, no data blocks on disk), then times both parsers.

    .venv/bin/python bench/catalog_open.py [--dir DIR] [--repeat N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from moed.gguf.catalog import Catalog

Q = GGMLQuantizationType
LAYERS, EXPERTS, USED, EMBD, FF, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 48, 128, 8, 2048, 768, 151936, 32, 4, 128


def tensors():
    yield "token_embd.weight", (VOCAB, EMBD), Q.Q6_K
    for i in range(LAYERS):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", (EMBD,), Q.F32
        yield p + "attn_q.weight", (HEADS * HEAD_DIM, EMBD), Q.Q4_K
        yield p + "attn_k.weight", (KV_HEADS * HEAD_DIM, EMBD), Q.Q4_K
        yield p + "attn_v.weight", (KV_HEADS * HEAD_DIM, EMBD), Q.Q6_K
        yield p + "attn_output.weight", (EMBD, HEADS * HEAD_DIM), Q.Q4_K
        yield p + "attn_q_norm.weight", (HEAD_DIM,), Q.F32
        yield p + "attn_k_norm.weight", (HEAD_DIM,), Q.F32
        yield p + "ffn_norm.weight", (EMBD,), Q.F32
        yield p + "ffn_gate_inp.weight", (EXPERTS, EMBD), Q.F32
        yield p + "ffn_gate_exps.weight", (EXPERTS, FF, EMBD), Q.Q4_K
        yield p + "ffn_up_exps.weight", (EXPERTS, FF, EMBD), Q.Q4_K
        yield p + "ffn_down_exps.weight", (EXPERTS, EMBD, FF), Q.Q6_K
    yield "output_norm.weight", (EMBD,), Q.F32
    yield "output.weight", (VOCAB, EMBD), Q.Q6_K


def write_sparse_model(path: str) -> None:
    w = GGUFWriter(path, "qwen3moe")
    a = "qwen3moe"
    for key, val in [
        ("block_count", LAYERS),
        ("expert_count", EXPERTS),
        ("expert_used_count", USED),
        ("embedding_length", EMBD),
        ("expert_feed_forward_length", FF),
        ("attention.head_count", HEADS),
        ("attention.head_count_kv", KV_HEADS),
    ]:
        w.add_uint32(f"{a}.{key}", val)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(VOCAB)])
    w.add_array("tokenizer.ggml.token_type", [1] * VOCAB)
    w.add_array("tokenizer.ggml.merges", [f"t{i} k{i}" for i in range(151387)])
    total = 0
    for name, shape, qtype in tensors():
        block, size = GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape)) // block * size
        byte_shape = (*shape[:-1], shape[-1] // block * size)
        w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
        total += GGUFWriter.ggml_pad(nbytes, w.data_alignment)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(GGUFWriter.ggml_pad(size, w.data_alignment) + total)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="where to write the sparse model (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = os.path.join(d, "qwen3-30b-a3b-like.gguf")
        write_sparse_model(path)
        ours = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            cat = Catalog.open(path)
            ours.append(time.perf_counter() - t)
        import gguf

        t = time.perf_counter()
        gguf.GGUFReader(path)
        theirs = time.perf_counter() - t
        ours_s = statistics.median(ours)
        print(
            f"model: {os.path.getsize(path) / 1e9:.1f} GB apparent, {len(cat.moe_layers)} MoE layers x "
            f"{cat.n_experts} experts, vocab {VOCAB}"
        )
        print(f"Catalog.open        median {ours_s * 1e3:8.1f} ms  (n={args.repeat})")
        print(f"gguf.GGUFReader            {theirs * 1e3:8.1f} ms  (n=1)")
        print(f"ratio GGUFReader / Catalog.open: {theirs / ours_s:.0f}x")


if __name__ == "__main__":
    main()
