"""Real models' headers (moed.modelgen.sparse_headers) over sparse files: the catalog reads them as GGUFReader does."""

from __future__ import annotations

import re

import gguf
import pytest

from moed.gguf.catalog import Catalog
from moed.modelgen.quantmix import use_more_bits
from moed.modelgen.sparse_headers import deepseek_v3, qwen3_30b_a3b, write_sparse

EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(\w+)_exps\.weight$")

# Fewer layers, experts and tokens than the real models; every width is the real one.
SMALL = {
    "qwen3_30b_a3b": lambda: qwen3_30b_a3b(layers=8, experts=8, vocab=2048, merges=1500),
    "deepseek_v3": lambda: deepseek_v3(layers=6, experts=16, dense_lead=2, vocab=2048, merges=1500),
}


@pytest.fixture(scope="module", params=sorted(SMALL))
def sparse(request, tmp_path_factory):
    spec = SMALL[request.param]()
    path = tmp_path_factory.mktemp("headers") / f"{request.param}.gguf"
    return spec, path, write_sparse(path, spec)


def test_the_file_is_sparse_and_as_long_as_its_tensors(sparse):
    spec, path, size = sparse
    st = path.stat()
    assert st.st_size == size
    assert st.st_blocks * 512 < size // 100  # no tensor data was written
    last = gguf.GGUFReader(path).tensors[-1]
    assert last.data_offset + last.n_bytes <= size < last.data_offset + last.n_bytes + spec.alignment


def test_catalog_extents_equal_gguf_readers(sparse):
    spec, path, _ = sparse
    cat = Catalog.open(path)
    reader = gguf.GGUFReader(path)
    truth = {}
    for t in reader.tensors:
        m = EXPERT.match(t.name)
        if m:
            truth[(int(m.group(1)), m.group(2))] = t
    assert cat.arch == spec.arch and cat.moe_layers == spec.moe_layers and cat.n_experts == spec.n_experts
    assert set(truth) == {(l, p) for l in cat.moe_layers for p in cat.parts}
    assert cat.parts == ("gate", "up", "down")
    for (layer, part), t in truth.items():
        ext = cat.layers[layer].parts[part]
        assert ext.offset == t.data_offset
        assert ext.bytes_per_expert * spec.n_experts == t.n_bytes
        assert ext.ggml_type == t.tensor_type
        assert ext.shape == tuple(int(d) for d in t.shape)
        assert cat.extent(layer, spec.n_experts - 1, part) == (
            str(path),
            t.data_offset + t.n_bytes - ext.bytes_per_expert,
            ext.bytes_per_expert,
        )
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == spec.vocab == len(reader.fields["tokenizer.ggml.token_type"].data)


def test_qwen3_experts_have_the_published_sizes_by_llama_cpp_rule(tmp_path):
    spec = qwen3_30b_a3b(layers=8, experts=4, vocab=1024, merges=600)
    write_sparse(tmp_path / "q.gguf", spec)
    cat = Catalog.open(tmp_path / "q.gguf")
    six = tuple(l for l in range(8) if use_more_bits(l, 8))
    assert six == (0, 3, 6, 7)
    assert {sum(b for _, b in key): layers for key, layers in cat.size_classes.items()} == {
        3_059_712: six,  # down Q6_K
        2_654_208: (1, 2, 4, 5),  # all Q4_K
    }
    assert {cat.layers[l].parts["down"].type_name for l in six} == {"Q6_K"}


def test_use_more_bits_over_qwen3s_48_layers():
    more = [l for l in range(48) if use_more_bits(l, 48)]
    assert more == [*range(6), *range(8, 42, 3), *range(42, 48)]
    assert len(more) == 24
