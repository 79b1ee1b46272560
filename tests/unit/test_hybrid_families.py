"""The hybrid Gated-DeltaNet families (qwen35moe, qwen3next): their test models are what llama.cpp's loader reads.

What llama.cpp running them checks is in tests/e2e (test_arch_matrix, test_prefetch,
test_repacked_kernels); here: the layer pattern, each kind's tensors and shapes, the
keys, and that the architecture table's facts (router input, gating, dense MUL_MAT
names) match the files.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from moed.modelgen.families.qwen35moe import FULL_ATTENTION_INTERVAL

Q = gguf.GGMLQuantizationType
ARCHS = ["qwen35moe", "qwen3next"]
MIXER = {  # per layer kind, besides attn_norm and the FFN
    "attention": {"attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm"},
    "qwen35moe": {
        "attn_qkv",
        "attn_gate",
        "ssm_conv1d",
        "ssm_dt",
        "ssm_a",
        "ssm_beta",
        "ssm_alpha",
        "ssm_norm",
        "ssm_out",
    },
    "qwen3next": {"attn_qkv", "attn_gate", "ssm_conv1d", "ssm_dt", "ssm_a", "ssm_ba", "ssm_norm", "ssm_out"},
}
FFN = {"post_attention_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}
FFN |= {"ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"}


def read(path) -> tuple[dict, dict]:
    r = gguf.GGUFReader(path)
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return kv, {t.name: t for t in r.tensors}


def layer_parts(tensors: dict, layer: int) -> set[str]:
    p = f"blk.{layer}."
    return {n[len(p) :].split(".")[0] for n in tensors if n.startswith(p)}


@pytest.mark.parametrize("arch", ARCHS)
def test_layers_alternate_delta_net_and_attention_and_all_are_moe(model_factory, arch):
    from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES

    kv, t = read(model_factory(arch=arch))
    enum = next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch)
    allowed = {TENSOR_NAMES[x].format(bid=i) for x in MODEL_TENSORS[enum] for i in range(4)}
    assert {n.removesuffix(".weight").removesuffix(".bias") for n in t} <= allowed
    assert kv[f"{arch}.full_attention_interval"] == FULL_ATTENTION_INTERVAL == 4
    for layer in range(4):  # llama.cpp: recurrent unless (layer + 1) % interval == 0
        kind = "attention" if layer == 3 else arch
        assert layer_parts(t, layer) == {"attn_norm"} | MIXER[kind] | FFN, (layer, kind)
    assert f"{arch}.expert_gating_func" not in kv  # the graph fixes softmax
    assert kv[f"{arch}.ssm.state_size"] == 16 and kv[f"{arch}.ssm.group_count"] == 2
    assert kv[f"{arch}.ssm.time_step_rank"] == 4 and kv[f"{arch}.ssm.inner_size"] == 64
    assert kv[f"{arch}.ssm.conv_kernel"] == 4 and kv[f"{arch}.expert_shared_feed_forward_length"] == 64
    assert (f"{arch}.rope.dimension_sections" in kv) == (arch == "qwen35moe")  # IMRoPE vs NeoX


@pytest.mark.parametrize("arch", ARCHS)
def test_shapes_are_the_loaders(model_factory, arch):
    """ggml's ne order, as load_arch_tensors creates them: key width 32, value width 64, conv 128."""
    _, t = read(model_factory(arch=arch))
    shape = {n: [int(d) for d in x.shape] for n, x in t.items()}
    assert shape["blk.0.attn_qkv.weight"] == [64, 2 * 32 + 64] and shape["blk.0.attn_gate.weight"] == [64, 64]
    assert shape["blk.0.ssm_conv1d.weight"] == [4, 128] and shape["blk.0.ssm_out.weight"] == [64, 64]
    assert shape["blk.0.ssm_a"] == [4] and shape["blk.0.ssm_dt.bias"] == [4] and shape["blk.0.ssm_norm.weight"] == [16]
    if arch == "qwen35moe":
        assert shape["blk.0.ssm_beta.weight"] == [64, 4] and shape["blk.0.ssm_alpha.weight"] == [64, 4]
    else:
        assert shape["blk.0.ssm_ba.weight"] == [64, 8]
    assert shape["blk.3.attn_q.weight"] == [64, 2 * 4 * 16]  # the query and its output gate
    assert shape["blk.3.attn_k.weight"] == [64, 2 * 16] and shape["blk.3.attn_q_norm.weight"] == [16]
    assert shape["blk.1.ffn_gate_inp_shexp.weight"] == [64] and shape["blk.1.ffn_down_shexp.weight"] == [64, 64]
    assert a_decays(t["blk.0.ssm_a"])


def a_decays(ssm_a) -> bool:
    a = np.asarray(ssm_a.data, dtype=np.float32)
    return ssm_a.tensor_type == Q.F32 and bool(np.all(a <= -1.0) and np.all(a >= -16.0))


@pytest.mark.parametrize("arch", ARCHS)
def test_q4_k_m_keeps_the_conv_and_decay_f32(model_factory, arch):
    _, t = read(model_factory(arch=arch, embd=256, ff=256, recipe="q4_k_m"))
    for layer in (0, 1, 2):
        assert t[f"blk.{layer}.ssm_conv1d.weight"].tensor_type == Q.F32  # llama.cpp's quantizer skips it
        assert t[f"blk.{layer}.ssm_out.weight"].tensor_type == Q.Q4_K and a_decays(t[f"blk.{layer}.ssm_a"])
    assert (
        t["blk.3.ffn_down_exps.weight"].tensor_type == Q.Q6_K and t["blk.0.ffn_gate_exps.weight"].tensor_type == Q.Q4_K
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_the_architecture_table_matches_the_files(model_factory, arch):
    """The router reads attn_post_norm-L (weight post_attention_norm), softmax fixed; the dense
    MUL_MAT weights (llama-arch.cpp's LLM_TENSOR_INFOS) are named, nothing else of the mixer is."""
    from moed.gguf.archs import DENSE_MATMUL, GATING_SOFTMAX, gating_of, router_input
    from moed.gguf.header import read_header

    h = read_header(model_factory(arch=arch))
    assert router_input(arch).node == "attn_post_norm" and router_input(arch).norm == "post_attention_norm"
    assert gating_of(h) == GATING_SOFTMAX
    names = {t.name for t in h.tensors}
    assert all(
        f"blk.{i}.post_attention_norm.weight" in names and f"blk.{i}.ffn_norm.weight" not in names for i in range(4)
    )
    matmul = {n.split(".", 2)[2].split(".")[0] for n in names if DENSE_MATMUL.match(n) and n.startswith("blk.0.")}
    ssm = {"ssm_beta", "ssm_alpha"} if arch == "qwen35moe" else {"ssm_ba"}
    want = {"attn_qkv", "attn_gate", "ssm_out", *ssm, "ffn_gate_inp", "ffn_gate_inp_shexp"}
    assert matmul == want | {"ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"}
    assert not any(DENSE_MATMUL.match(n) for n in names if "ssm_conv1d" in n or "ssm_norm" in n or "ssm_dt" in n)
