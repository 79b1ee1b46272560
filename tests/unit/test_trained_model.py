"""The committed tiny trained MoE: its digest, geometry and vocabulary (no llama.cpp, no torch)."""

from __future__ import annotations

import hashlib

from moed.data import TINY_MOE, expected_sha256, tiny_moe
from moed.gguf.catalog import Catalog
from moed.gguf.header import read_header
from moed.modelgen.makemodel import build_vocab


def test_the_committed_file_matches_its_sha256_and_stays_small():
    path = tiny_moe(verify=True)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == expected_sha256()
    assert path.stat().st_size < 10 * 2**20


def test_geometry_is_qwen3moe_6_layers_16_experts_top_2():
    h = read_header(TINY_MOE)
    assert h.get("general.architecture") == "qwen3moe"
    assert (h.get("qwen3moe.block_count"), h.get("qwen3moe.expert_count"), h.get("qwen3moe.expert_used_count")) == (
        6,
        16,
        2,
    )
    assert h.get("qwen3moe.embedding_length") == 128 and h.get("qwen3moe.context_length") == 128
    assert "Python standard library" in h.get("general.description")
    cat = Catalog.open(TINY_MOE)
    assert list(cat.moe_layers) == list(range(6)) and cat.n_experts == 16
    assert cat.expert_bytes(0) == 3 * 128 * 128 // 32 * 34  # gate, up, down at q8_0


def test_vocabulary_is_makemodels_bytes_and_space_piece_without_a_space_prefix():
    h = read_header(TINY_MOE)
    tokens = h.get("tokenizer.ggml.tokens")
    assert tokens == build_vocab()[0][:260]
    assert tokens[3] == "<0x00>" and tokens[258] == "<0xFF>" and tokens[259] == "\u2581"
    assert h.get("tokenizer.ggml.add_space_prefix") is False
