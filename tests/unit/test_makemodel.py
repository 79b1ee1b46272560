"""The test-model generator writes real, deterministic qwen3moe GGUF files."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from moed.ctl import main as moectl
from moed.modelgen.makemodel import aligned_geometry, build_vocab, make_model, quantize, random_blocks
from moed.modelgen.quantmix import use_more_bits

Q = gguf.GGMLQuantizationType


def fields(path) -> dict:
    r = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def test_qwen3moe_keys(model_factory):
    kv = fields(model_factory(layers=3, experts=6, used=3, embd=64, ff=96, heads=8, kv_heads=2))
    a = "qwen3moe"
    assert kv["general.architecture"] == a
    assert kv[f"{a}.block_count"] == 3
    assert kv[f"{a}.expert_count"] == 6 and kv[f"{a}.expert_used_count"] == 3
    assert kv[f"{a}.expert_feed_forward_length"] == 96
    assert kv[f"{a}.embedding_length"] == 64
    assert kv[f"{a}.attention.head_count"] == 8 and kv[f"{a}.attention.head_count_kv"] == 2
    assert kv[f"{a}.attention.key_length"] == 8 and kv[f"{a}.attention.value_length"] == 8
    assert kv["tokenizer.ggml.model"] == "llama"
    assert "<0x0A>" in kv["tokenizer.ggml.tokens"]


def test_default_arch_bytes_never_change(tmp_path):
    import hashlib

    # The default (qwen3moe) model: fixtures, traces and benchmarks depend on these exact bytes.
    data = make_model(tmp_path / "m.gguf")[0].read_bytes()
    assert hashlib.sha256(data).hexdigest() == "ae2e4f69c431665ace9eff39f788d981899aacc1dd741022143119ceeb2cabf2"


@pytest.mark.parametrize("arch", ["qwen3moe", "olmoe", "qwen2moe", "deepseek2", "llama", "gpt-oss", "glm4moe"])
def test_arch_tensors_are_llama_cpps(model_factory, arch):
    """Every tensor name is one gguf-py lists for the architecture; each arch's own tensors and keys."""
    from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES

    path = model_factory(arch=arch, heads=4, kv_heads=2)
    kv = fields(path)
    assert kv["general.architecture"] == arch and kv[f"{arch}.expert_count"] == 8
    enum = next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch)
    allowed = {TENSOR_NAMES[t].format(bid=i) for t in MODEL_TENSORS[enum] for i in range(4)}
    t = {x.name: x for x in gguf.GGUFReader(path).tensors}
    assert {n.rsplit(".", 1)[0] for n in t} <= allowed
    if arch == "olmoe":  # whole-projection q/k norms, and llama.cpp's olmoe wants kv_heads == heads
        assert kv["olmoe.attention.head_count_kv"] == 4
        assert list(t["blk.0.attn_q_norm.weight"].shape) == [64] and list(t["blk.0.attn_k_norm.weight"].shape) == [64]
    elif arch == "deepseek2":  # MLA: one latent kv head; the first layer dense
        assert kv["deepseek2.attention.head_count_kv"] == 1 and kv["deepseek2.leading_dense_block_count"] == 1
        assert kv["deepseek2.expert_gating_func"] == 2 and kv["deepseek2.expert_weights_scale"] == 2.5
        assert "blk.0.ffn_gate.weight" in t and "blk.0.ffn_gate_exps.weight" not in t
        assert "blk.1.attn_k_b.weight" in t and list(t["blk.1.exp_probs_b.bias"].shape) == [8]
    elif arch == "glm4moe":  # a leading dense layer, partial rope, sigmoid gating with a selection bias
        assert kv["glm4moe.leading_dense_block_count"] == 1 and kv["glm4moe.nextn_predict_layers"] == 0
        assert kv["glm4moe.rope.dimension_count"] == 8 and kv["glm4moe.attention.key_length"] == 16
        assert kv["glm4moe.expert_gating_func"] == 2 and kv["glm4moe.expert_shared_count"] == 1
        assert "blk.0.ffn_gate.weight" in t and "blk.0.ffn_gate_exps.weight" not in t
        assert "blk.1.ffn_norm.weight" not in t and list(t["blk.1.post_attention_norm.weight"].shape) == [64]
        assert list(t["blk.1.attn_q_norm.weight"].shape) == [16] and list(t["blk.1.exp_probs_b.bias"].shape) == [8]
    else:
        assert kv[f"{arch}.attention.head_count_kv"] == 2
    shared = [n for n in t if "_shexp" in n or n.endswith(".bias")]
    if arch == "qwen2moe":
        assert kv["qwen2moe.expert_shared_feed_forward_length"] == 64
        assert list(t["blk.1.ffn_gate_inp_shexp.weight"].shape) == [64]
        assert t["blk.1.ffn_down_shexp.weight"].tensor_type == Q.F16 and list(t["blk.1.attn_k.bias"].shape) == [32]
        assert len(shared) == 4 * (4 + 3)
    elif arch == "deepseek2":  # an ungated shared expert and the selection bias in each MoE layer
        assert len(shared) == 3 * (3 + 1)
    elif arch == "gpt-oss":  # q/k/v/output biases, the router's bias and one bias row per expert and part
        assert len(shared) == 4 * (4 + 1 + 3)
        assert kv["gpt-oss.attention.sliding_window"] == 32 and "gpt-oss.expert_gating_func" not in kv
        assert "blk.0.ffn_norm.weight" not in t and list(t["blk.0.post_attention_norm.weight"].shape) == [64]
        assert list(t["blk.0.attn_sinks.weight"].shape) == [4] and list(t["blk.0.attn_output.bias"].shape) == [64]
        assert list(t["blk.0.ffn_gate_inp.bias"].shape) == [8]
        for part in ("gate", "up", "down"):
            assert t[f"blk.0.ffn_{part}_exps.weight"].tensor_type == Q.MXFP4  # the arch's own expert quant
            assert t[f"blk.0.ffn_{part}_exps.bias"].tensor_type == Q.F32
            assert list(t[f"blk.0.ffn_{part}_exps.bias"].shape) == [64, 8]  # [ff or embd, experts]
    elif arch == "glm4moe":  # q/k/v biases everywhere; the selection bias and a shared expert in MoE layers
        assert len(shared) == 4 * 3 + 3 * (1 + 3)
    else:
        assert shared == []


@pytest.mark.parametrize("arch", ["qwen3moe", "olmoe", "qwen2moe", "deepseek2", "llama", "gpt-oss", "glm4moe"])
def test_generated_models_agree_with_the_architecture_table(model_factory, arch):
    """Every MoE layer has the router input norm, router bias and expert bias rows the
    architecture table (moed.gguf.archs) says, and the gating the predictor will read."""
    from moed.gguf.archs import arch_of, gating_of
    from moed.gguf.header import read_header

    facts = arch_of(arch)
    h = read_header(model_factory(arch=arch))
    names = {t.name for t in h.tensors}
    moe = sorted({int(n.split(".")[1]) for n in names if n.endswith("_exps.weight")})
    assert moe
    for layer in moe:
        p = f"blk.{layer}."
        assert p + facts.router_input.norm + ".weight" in names
        assert (p + "ffn_norm.weight" in names) == (facts.router_input.norm == "ffn_norm")
        assert (p + "ffn_gate_inp.bias" in names) == facts.router_bias
        assert all((p + f"ffn_{part}_exps.bias" in names) == facts.expert_bias for part in ("gate", "up", "down"))
    assert gating_of(h) == (facts.gating or h.get(f"{arch}.expert_gating_func", 1))


def test_expert_tensors(tiny_model):
    r = gguf.GGUFReader(tiny_model)
    t = {x.name: x for x in r.tensors}
    gate = t["blk.0.ffn_gate_exps.weight"]
    assert gate.tensor_type == Q.Q8_0 and list(gate.shape) == [64, 64, 8]
    assert list(t["blk.3.ffn_down_exps.weight"].shape) == [64, 64, 8]
    assert t["blk.0.ffn_gate_inp.weight"].tensor_type == Q.F32
    assert t["token_embd.weight"].tensor_type == Q.F16


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_deterministic(tmp_path, arch):
    a = make_model(tmp_path / "a.gguf", seed=7, arch=arch)[0].read_bytes()
    b = make_model(tmp_path / "b.gguf", seed=7, arch=arch)[0].read_bytes()
    c = make_model(tmp_path / "c.gguf", seed=8, arch=arch)[0].read_bytes()
    assert a == b and a != c


def test_split_naming_and_keys(split_model):
    shards = sorted(split_model.parent.glob("*.gguf"))
    assert [s.name for s in shards] == [f"model-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    total = 0
    for i, s in enumerate(shards):
        kv = fields(s)
        assert (kv["split.no"], kv["split.count"]) == (i, 3)
        assert kv["general.alignment"] == 32
        total += len(gguf.GGUFReader(s).tensors)
    assert fields(shards[0])["split.tensors.count"] == total


def test_layer_quants(model_factory):
    r = gguf.GGUFReader(model_factory(embd=256, ff=256, layer_quants="q8_0,q4_0,q4_k,q8_0"))
    types = {x.name: x.tensor_type for x in r.tensors}
    assert [types[f"blk.{i}.ffn_up_exps.weight"] for i in range(4)] == [Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q8_0]


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_quantize_round_trips(qtype):
    x = np.random.default_rng(1).standard_normal((4, 512), dtype=np.float32)
    back = gguf.quants.dequantize(quantize(x, qtype), qtype)
    step = {Q.Q8_0: 1 / 127, Q.Q4_0: 1 / 7, Q.Q4_K: 1 / 15, Q.Q5_K: 1 / 31, Q.Q6_K: 1 / 31}[qtype] * 2 * np.abs(x).max()
    assert np.abs(back - x).max() <= step


def test_use_more_bits_is_llama_cpps_rule():
    """Qwen3-30B-A3B's 48 layers: the first and last six, and every third between (24 in all)."""
    more = [i for i in range(48) if use_more_bits(i, 48)]
    assert more == [0, 1, 2, 3, 4, 5, *range(8, 42, 3), 42, 43, 44, 45, 46, 47] and len(more) == 24
    assert [i for i in range(4) if use_more_bits(i, 4)] == [2, 3]


def test_q4_k_m_recipe(model_factory):
    """llama.cpp's Q4_K_M: experts gate/up Q4_K, down Q6_K in the use_more_bits layers; quantized attention."""
    r = gguf.GGUFReader(model_factory(embd=256, ff=256, recipe="q4_k_m"))
    types = {x.name: x.tensor_type for x in r.tensors}
    for i in range(4):
        assert types[f"blk.{i}.ffn_gate_exps.weight"] == types[f"blk.{i}.ffn_up_exps.weight"] == Q.Q4_K
        # eight experts: Mixtral's rule bumps attn_v and attn_k to Q8_0 and attn_output to Q5_K
        assert types[f"blk.{i}.attn_v.weight"] == types[f"blk.{i}.attn_k.weight"] == Q.Q8_0
        assert (types[f"blk.{i}.attn_q.weight"], types[f"blk.{i}.attn_output.weight"]) == (Q.Q4_K, Q.Q5_K)
        assert types[f"blk.{i}.ffn_gate_inp.weight"] == types[f"blk.{i}.attn_norm.weight"] == Q.F32
    assert [types[f"blk.{i}.ffn_down_exps.weight"] for i in range(4)] == [Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q6_K]
    assert (types["token_embd.weight"], types["output.weight"], types["output_norm.weight"]) == (Q.Q4_K, Q.Q6_K, Q.F32)
    r16 = gguf.GGUFReader(model_factory(embd=256, ff=256, experts=16, recipe="q4_k_m"))
    types = {x.name: x.tensor_type for x in r16.tensors}
    assert [types[f"blk.{i}.attn_v.weight"] for i in range(4)] == [Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q6_K]
    assert types["blk.0.attn_k.weight"] == types["blk.0.attn_output.weight"] == Q.Q4_K


def test_q4_k_m_falls_back_for_short_rows(model_factory):
    """Rows that 256 does not divide take llama.cpp's fallbacks (Q4_K -> Q5_0), else stay F16 (MLA's 16-wide rows)."""
    r = gguf.GGUFReader(model_factory(embd=256, ff=256, arch="deepseek2", experts=16, recipe="q4_k_m"))
    types = {x.name: x.tensor_type for x in r.tensors}
    assert types["blk.1.attn_q_b.weight"] == Q.Q5_0  # a 32-wide row (the q latent)
    assert types["blk.1.attn_k_b.weight"] == Q.F16  # 16-wide rows
    assert types["blk.1.ffn_down_shexp.weight"] == Q.Q4_K and types["blk.3.ffn_down_shexp.weight"] == Q.Q6_K
    assert types["blk.0.ffn_down.weight"] == Q.Q4_K  # the leading dense layer's FFN


def test_quantize_mxfp4_round_trips():
    """MXFP4 (gguf-py's quantizer): per 32 values a power-of-two scale s with the block's
    absmax in [4s, 8s), and E2M1 levels at most 2s apart (the top, above 6s, clamps to 6s)."""
    x = np.random.default_rng(1).standard_normal((4, 512), dtype=np.float32)
    raw = quantize(x, Q.MXFP4)
    assert raw.shape == (4, 512 // 32 * 17)
    blocks = x.reshape(-1, 32)
    s = 2.0 ** (np.floor(np.log2(np.abs(blocks).max(axis=1))) - 2)
    err = np.abs(gguf.quants.dequantize(raw, Q.MXFP4).reshape(-1, 32) - blocks)
    assert (err <= 2 * s[:, None]).all() and err.mean() < 0.5 * s.mean()


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.MXFP4])
def test_random_blocks_are_well_scaled(qtype):
    x = gguf.quants.dequantize(random_blocks(32, 512, qtype, np.random.default_rng(0)), qtype)
    assert x.shape == (32, 512) and np.isfinite(x).all()
    lo, hi = (2**-0.5, 2**0.5) if qtype == Q.MXFP4 else (0.8, 1.2)  # MXFP4's scale is a power of two
    assert lo < x.std() * np.sqrt(512) < hi


def test_random_experts_model(tmp_path):
    a = make_model(tmp_path / "a.gguf", random_experts=True, quant="q4_0")[0]
    b = make_model(tmp_path / "b.gguf", random_experts=True, quant="q4_0")[0]
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != make_model(tmp_path / "c.gguf", quant="q4_0")[0].read_bytes()


def test_aligned_geometry_gives_page_multiples():
    g = aligned_geometry()
    assert g["embd"] * g["ff"] // 32 * 34 % 4096 == 0 and g["quant"] == "q8_0"
    g = aligned_geometry(arch="gpt-oss")  # MXFP4: 32 values in 17 bytes
    assert g["quant"] == "mxfp4" and g["embd"] * g["ff"] // 32 * 17 % 4096 == 0


def test_vocab():
    tokens, scores, types = build_vocab()
    assert tokens[:3] == ["<unk>", "<s>", "</s>"] and len(tokens) == len(scores) == len(types)
    assert len(build_vocab(1000)[0]) == 1000
    with pytest.raises(ValueError):
        build_vocab(10)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(quant="q4_k"), "multiples of 256"),
        (dict(used=9), "must not exceed"),
        (dict(layer_quants="q8_0,q8_0"), "2 entries for 4 layers"),
        (dict(quant="f32"), "unknown quant"),
        (dict(align=100), "power of two"),
        (dict(embd=60), "multiple"),
        (dict(arch="mixtral"), "unknown arch"),
        (dict(recipe="q4_k_m"), "multiples of 256"),
        (dict(recipe="q9_x", embd=256, ff=256), "unknown recipe 'q9_x'"),
        (dict(recipe="q4_k_m", embd=256, ff=256, layer_quants="q8_0,q8_0,q8_0,q8_0"), "not both"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, words):
    with pytest.raises(ValueError, match=words):
        make_model(tmp_path / "m.gguf", **kwargs)


def test_moectl_make_model(tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert (
        moectl(
            ["make-model", str(out), "--layers", "2", "--experts", "4", "--split", "2", "--layer-quants", "q8_0,q4_0"]
        )
        == 0
    )
    printed = capsys.readouterr().out.split()
    assert printed == [str(tmp_path / f"cli-0000{i}-of-00002.gguf") for i in (1, 2)]
    assert moectl(["make-model", str(out), "--quant", "q4_k"]) == 2
    assert "multiples of 256" in capsys.readouterr().err
    missing = tmp_path / "no" / "such" / "dir" / "m.gguf"
    assert moectl(["make-model", str(missing)]) == 2  # as align: no directories made
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "no").exists()
    assert moectl(["make-model", str(tmp_path / "o.gguf"), "--arch", "olmoe", "--layers", "2"]) == 0
    assert fields(capsys.readouterr().out.split()[0])["general.architecture"] == "olmoe"
    assert moectl(["make-model", str(tmp_path / "x.gguf"), "--arch", "mixtral", "--layers", "2"]) == 0
    kv = fields(capsys.readouterr().out.split()[0])
    assert kv["general.architecture"] == "llama" and kv["llama.expert_count"] == 8
    assert moectl(["make-model", str(tmp_path / "g.gguf"), "--arch", "gpt-oss", "--layers", "2"]) == 0
    g = {x.name: x for x in gguf.GGUFReader(capsys.readouterr().out.split()[0]).tensors}
    assert g["blk.1.ffn_down_exps.weight"].tensor_type == Q.MXFP4 and "blk.1.ffn_down_exps.bias" in g
    assert moectl(["make-model", str(tmp_path / "g8.gguf"), "--arch", "gpt-oss", "--quant", "q8_0"]) == 0
    g = {x.name: x for x in gguf.GGUFReader(capsys.readouterr().out.split()[0]).tensors}
    assert g["blk.0.ffn_gate_exps.weight"].tensor_type == Q.Q8_0
    assert moectl(["make-model", str(out), "--arch", "nope"]) == 2
    assert "unknown arch 'nope'" in capsys.readouterr().err
    mix = tmp_path / "mix.gguf"
    assert moectl(["make-model", str(mix), "--recipe", "q4_k_m", "--embd", "256", "--ff", "256", "--layers", "2"]) == 0
    capsys.readouterr()
    assert moectl(["index", str(mix), "--json"]) == 0
    classes = json.loads(capsys.readouterr().out)["size_classes"]
    assert [(c["parts"], c["layers"], c["types"]) for c in classes] == [
        ({"gate": 36864, "up": 36864, "down": 36864}, [0], ["Q4_K"]),  # 2 layers: only the last gets more bits
        ({"gate": 36864, "up": 36864, "down": 53760}, [1], ["Q4_K", "Q6_K"]),
    ]
