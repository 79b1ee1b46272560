"""Gemma 4 MoE (gemma4): its test models are what llama.cpp's loader reads, and moed's facts about it hold.

What llama.cpp running it checks is in tests/e2e (test_arch_matrix, test_prefetch,
test_repacked_kernels); here: the tensors, shapes and keys, the fused gate_up part
through the catalog and `moectl align`, the architecture table (router input, gating,
the dense MUL_MAT names), and the predictor's rebuilt router input against the graph's
formula.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from moed.modelgen.families.gemma4 import FULL_EVERY, is_swa

Q = gguf.GGMLQuantizationType


def read(path) -> tuple[dict, dict]:
    r = gguf.GGUFReader(path)
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return kv, {t.name: t for t in r.tensors}


def test_tensors_and_keys_are_llama_cpps(gemma4_model):
    from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES

    kv, t = read(gemma4_model)
    allowed = {TENSOR_NAMES[x].format(bid=i) for x in MODEL_TENSORS[MODEL_ARCH.GEMMA4] for i in range(4)}
    assert {n.rsplit(".", 1)[0] for n in t} <= allowed
    assert kv["general.architecture"] == "gemma4" and "output.weight" not in t  # tied to token_embd
    assert kv["gemma4.attention.sliding_window_pattern"] == [is_swa(i) for i in range(4)] == [True] * 3 + [False]
    assert FULL_EVERY == 4 and kv["gemma4.attention.sliding_window"] == 32
    assert kv["gemma4.attention.key_length"] == kv["gemma4.attention.value_length"] == 32
    assert kv["gemma4.attention.key_length_swa"] == kv["gemma4.rope.dimension_count_swa"] == 16
    assert kv["gemma4.embedding_length_per_layer_input"] == 16 and kv["gemma4.final_logit_softcapping"] == 30.0
    assert "gemma4.expert_gating_func" not in kv  # softmax is the graph's
    for i in range(4):
        p = f"blk.{i}."
        gate_up, down = t[p + "ffn_gate_up_exps.weight"], t[p + "ffn_down_exps.weight"]
        assert list(gate_up.shape) == [64, 128, 8] and list(down.shape) == [64, 64, 8]  # ggml order
        assert gate_up.tensor_type == down.tensor_type == Q.Q8_0
        assert p + "ffn_gate_exps.weight" not in t and p + "ffn_up_exps.weight" not in t
        assert list(t[p + "ffn_gate_inp.scale"].shape) == [64] and list(t[p + "ffn_down_exps.scale"].shape) == [8]
        hd = 16 if is_swa(i) else 32  # the full layers' heads are twice as wide
        assert list(t[p + "attn_q.weight"].shape) == [64, 4 * hd] and list(t[p + "attn_k_norm.weight"].shape) == [hd]
        assert (p + "attn_v.weight" in t) == is_swa(i)  # the full layers take V = K
        assert list(t[p + "inp_gate.weight"].shape) == [64, 16] and list(t[p + "proj.weight"].shape) == [16, 64]
    assert list(t["per_layer_token_embd.weight"].shape) == [16 * 4, len(kv["tokenizer.ggml.tokens"])]
    assert list(t["per_layer_model_proj.weight"].shape) == [64, 16 * 4] and list(t["rope_freqs.weight"].shape) == [16]


def test_architecture_table_matches_the_file(gemma4_model):
    """The router reads the residual attn_out-L, softmax fixed; DENSE_MATMUL is exactly the
    MUL_MAT weights of LLM_TENSOR_INFOS that this file has (stock's "repack tensor" list)."""
    from moed.gguf.archs import DENSE_MATMUL, GATING_SOFTMAX, arch_of, gating_of, router_input
    from moed.gguf.header import read_header

    h = read_header(gemma4_model)
    assert router_input("gemma4").node == "attn_out" and arch_of("gemma4").router_scale
    assert gating_of(h) == GATING_SOFTMAX
    names = {t.name for t in h.tensors}
    blk = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_inp"}
    blk |= {"inp_gate", "proj"}
    want = {"per_layer_model_proj.weight"} | {f"blk.{i}.{n}.weight" for i in range(4) for n in blk}
    want -= {"blk.3.attn_v.weight"}  # the full-attention layer has none
    assert {n for n in names if DENSE_MATMUL.match(n)} == want


def test_fused_part_is_whole_pages_and_aligns(model_factory, tmp_path):
    from moed.ctl import main as moectl
    from moed.gguf.catalog import Catalog
    from moed.modelgen.makemodel import aligned_geometry

    cat = Catalog.open(model_factory(arch="gemma4", **aligned_geometry(arch="gemma4")))
    assert cat.parts == ("gate_up", "down") and cat.page_aligned
    assert cat.size_class(0) == (("gate_up", 2 * 69632), ("down", 69632))  # 34 and 17 pages
    geometry = {k: v for k, v in aligned_geometry(arch="gemma4").items() if k != "align"}
    src = model_factory(arch="gemma4", **geometry)
    assert not Catalog.open(src).page_aligned
    out = tmp_path / "aligned.gguf"
    assert moectl(["align", str(src), str(out)]) == 0
    aligned = Catalog.open(out)
    assert aligned.page_aligned and aligned.parts == ("gate_up", "down")
    a, b = read(src)[1], read(out)[1]
    assert a.keys() == b.keys() and all(np.asarray(a[n].data).tobytes() == np.asarray(b[n].data).tobytes() for n in a)


def test_q4_k_m_mixes_the_fused_part(model_factory):
    from moed.gguf.catalog import Catalog

    cat = Catalog.open(model_factory(arch="gemma4", embd=256, ff=256, recipe="q4_k_m"))
    assert {cat.layers[0].parts["gate_up"].type_name, cat.layers[3].parts["down"].type_name} == {"Q4_K", "Q6_K"}
    assert cat.layers[0].parts["gate_up"].bytes_per_expert == 2 * 256 * 256 // 256 * 144  # 18 pages
    assert len(cat.size_classes) > 1


@pytest.fixture
def routers(gemma4_model):
    """load_routers over the file, and the file's own tensors to check them against."""
    from moed.engines.predictor import GatePredictor, load_routers
    from moed.gguf.header import read_split

    headers = read_split(str(gemma4_model))
    routers, gating = load_routers(headers, [str(gemma4_model)], [0, 1, 2, 3])
    return GatePredictor(routers, [0, 1, 2, 3], gating), read(gemma4_model)[1]


def test_predictor_rebuilds_the_router_input_from_the_residual(routers):
    """llama.cpp: logits = W @ (rms_norm(attn_out) / sqrt(n_embd) * ffn_gate_inp.scale); the
    predictor, given attn_out's rows, gives the same logits (float64 reference) and top-k."""
    from moed.engines.predictor import top

    predictor, t = routers
    rng = np.random.default_rng(1)
    h = (3.0 * rng.standard_normal((40, 64))).astype(np.float32)
    for layer in range(4):
        w = np.asarray(t[f"blk.{layer}.ffn_gate_inp.weight"].data, dtype=np.float64)  # (experts, embd)
        s = np.asarray(t[f"blk.{layer}.ffn_gate_inp.scale"].data, dtype=np.float64)
        x = h / np.sqrt(np.mean(np.square(h.astype(np.float64)), axis=1, keepdims=True) + 1e-6)
        want = (x / 8.0 * s) @ w.T
        got = predictor.scores(h, layer, layer)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert (top(got, 2) == top(want, 2)).all()
        # the residual taken as if it were normed input would choose other experts
        assert not np.allclose(h @ w.T, want, rtol=0.1)
