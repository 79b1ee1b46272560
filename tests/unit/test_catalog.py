"""Catalog on generated GGUF files: extents, size classes, alignment, identity, errors."""

from __future__ import annotations

import json
import os
import re
import shutil

import gguf
import numpy as np
import pytest

from moed.ctl import main as moectl
from moed.gguf.archs import SERVED_ARCHS
from moed.gguf.catalog import Catalog
from moed.gguf.header import identity_of, read_header
from moed.protocol.errors import BadModelFile, BadRequest, UnknownExpert, UnknownLayer

EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(\w+)_exps\.weight$")


def q8_bytes(rows: int, cols: int) -> int:
    return rows * cols // 32 * 34


def q4_bytes(rows: int, cols: int) -> int:
    return rows * cols // 32 * 18


def file_experts(paths):
    """{(layer, part): (path, bytes of every expert)} computed from GGUFReader's tensor data."""
    out = {}
    for path in paths:
        for t in gguf.GGUFReader(path).tensors:
            m = EXPERT.match(t.name)
            if m:
                raw = np.asarray(t.data).view(np.uint8).reshape(int(t.shape[2]), -1)
                out[(int(m.group(1)), m.group(2))] = (str(path), raw)
    return out


def read_extent(path: str, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def copy_shards(src_first, dst_dir):
    cat = Catalog.open(src_first)
    out = []
    for f in cat.files:
        out.append(dst_dir / os.path.basename(f))
        shutil.copy(f, out[-1])
    return out


# ---------------------------------------------------------------------- contents


def test_tiny_model_geometry(tiny_model):
    cat = Catalog.open(tiny_model)
    assert cat.arch == "qwen3moe"
    assert cat.moe_layers == (0, 1, 2, 3) and cat.n_layers == 4
    assert (cat.n_experts, cat.n_expert_used) == (8, 2)
    assert cat.parts == ("gate", "up", "down")
    assert cat.files == (str(tiny_model),)
    size = q8_bytes(64, 64)
    assert list(cat.size_classes.items()) == [((("gate", size), ("up", size), ("down", size)), (0, 1, 2, 3))]
    assert cat.expert_bytes(0) == 3 * size
    assert cat.layers[0].parts["gate"].type_name == "Q8_0"
    assert cat.layers[0].parts["down"].shape == (64, 64, 8)
    assert cat.alignment == 32 and not cat.page_aligned


@pytest.mark.parametrize(
    "fixture",
    [
        "tiny_model",
        "split_model",
        "aligned_model",
        "mixed_model",
        "olmoe_model",
        "qwen2moe_model",
        "deepseek2_model",
        "mixtral_model",
        "gpt_oss_model",
        "glm4moe_model",
    ],
)
def test_every_extent_holds_the_tensor_bytes(fixture, request):
    cat = Catalog.open(request.getfixturevalue(fixture))
    truth = file_experts(cat.files)
    assert set(truth) == {(l, p) for l in cat.moe_layers for p in cat.parts}
    for (layer, part), (path, raw) in truth.items():
        for e in range(cat.n_experts):
            shard, offset, length = cat.extent(layer, e, part)
            assert shard == path
            assert length == raw.shape[1]
            assert read_extent(shard, offset, length) == raw[e].tobytes()


def test_split_model_spans_shards(split_model):
    cat = Catalog.open(split_model)
    assert len(cat.files) == 3 and len(cat.identity) == 3
    assert [os.path.basename(f) for f in cat.files] == [f"model-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert len({p.shard for e in cat.layers.values() for p in e.parts.values()}) >= 2
    assert Catalog.open(split_model).identity == cat.identity


def test_mixed_quants_make_size_classes(mixed_model):
    cat = Catalog.open(mixed_model)
    q8, q4 = q8_bytes(64, 64), q4_bytes(64, 64)
    assert cat.size_classes == {
        (("gate", q8), ("up", q8), ("down", q8)): (0, 2),
        (("gate", q4), ("up", q4), ("down", q4)): (1, 3),
    }
    assert cat.layers[1].parts["up"].type_name == "Q4_0"


def test_aligned_model_is_page_aligned(aligned_model):
    cat = Catalog.open(aligned_model)
    assert cat.alignment == 4096 and cat.page_aligned
    for e in cat.layers.values():
        for p in e.parts.values():
            assert p.offset % 4096 == 0 and p.bytes_per_expert == q8_bytes(256, 256) == 17 * 4096


def test_q4_k_layers(model_factory):
    cat = Catalog.open(model_factory(embd=256, ff=256, layer_quants="q4_k,q8_0,q4_k,q8_0"))
    assert cat.layers[0].parts["gate"].type_name == "Q4_K"
    assert cat.layers[0].parts["gate"].bytes_per_expert == 256 * 256 // 256 * 144
    assert len(cat.size_classes) == 2


def test_identity_changes_with_any_change(tiny_model, tmp_path):
    path = tmp_path / "m.gguf"
    shutil.copy(tiny_model, path)
    a, b = Catalog.open(path), Catalog.open(path)
    assert a.identity == b.identity and hash(a.identity) == hash(b.identity)
    st = os.stat(path)
    assert a.identity[0] == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a touch is a change
    assert identity_of(os.stat(path)) != a.identity[0]
    os.chmod(path, 0o600)  # so is a chmod (ctime)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime put back ...
    assert identity_of(os.stat(path)) != a.identity[0]  # ... ctime still tells


def test_lookup_errors(tiny_model):
    cat = Catalog.open(tiny_model)
    with pytest.raises(UnknownLayer):
        cat.extent(4, 0, "gate")
    with pytest.raises(UnknownExpert):
        cat.extent(0, 8, "gate")
    with pytest.raises(UnknownExpert):
        cat.extent(0, -1, "gate")
    with pytest.raises(BadRequest):
        cat.extent(0, 0, "gate_up")


def test_to_dict_is_json(split_model):
    d = json.loads(json.dumps(Catalog.open(split_model).to_dict()))
    assert d["n_experts"] == 8 and d["n_expert_used"] == 2 and len(d["files"]) == 3
    assert d["size_classes"][0]["layers"] == [0, 1, 2, 3]


def test_moectl_index(mixed_model, capsys):
    assert moectl(["index", str(mixed_model), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert len(d["size_classes"]) == 2 and d["page_aligned"] is False
    assert moectl(["index", str(mixed_model)]) == 0
    out = capsys.readouterr().out
    assert "top-k 2" in out and "Q4_0" in out and "page-aligned expert extents: no" in out


@pytest.mark.parametrize(
    "fixture, arch",
    [
        ("olmoe_model", "olmoe"),
        ("qwen2moe_model", "qwen2moe"),
        ("deepseek2_model", "deepseek2"),
        ("mixtral_model", "llama"),
        ("gpt_oss_model", "gpt-oss"),
        ("glm4moe_model", "glm4moe"),
    ],
)
def test_other_architectures_serve_only_routed_experts(fixture, arch, request, capsys):
    path = request.getfixturevalue(fixture)
    cat = Catalog.open(path)
    first = 1 if arch in ("deepseek2", "glm4moe") else 0  # their leading dense layer has no experts
    assert cat.arch == arch and cat.n_layers == 4 and cat.moe_layers == tuple(range(first, 4))
    assert cat.parts == ("gate", "up", "down")
    served = {(l, p) for l in cat.moe_layers for p in cat.parts}
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    shared = sorted(n for n in names if "_shexp" in n)
    assert (
        len(shared)
        == {"olmoe": 0, "qwen2moe": 4 * 4, "deepseek2": 3 * 3, "llama": 0, "gpt-oss": 0, "glm4moe": 3 * 3}[arch]
    )  # dense, never a part
    assert served == {(int(m.group(1)), m.group(2)) for n in names if (m := EXPERT.match(n))}
    if arch == "gpt-oss":  # the expert bias rows stay dense: no part, and not inside any part's extent
        biases = sorted(n for n in names if re.fullmatch(r"blk\.\d+\.ffn_\w+_exps\.bias", n))
        assert len(biases) == 4 * 3
        extents = [
            (x.offset, x.offset + x.bytes_per_expert * cat.n_experts)
            for e in cat.layers.values()
            for x in e.parts.values()
        ]
        for t in gguf.GGUFReader(path).tensors:
            if t.name in biases:
                start = int(t.data_offset)
                assert all(start + int(t.n_bytes) <= lo or start >= hi for lo, hi in extents), t.name
    assert moectl(["index", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    quant = "MXFP4" if arch == "gpt-oss" else "Q8_0"
    assert f"({arch}, 1" in out and "parts gate+up+down" in out and quant in out


# ---------------------------------------------------------------------- header parser


def test_header_matches_gguf_reader(split_model):
    for path in Catalog.open(split_model).files:
        ours, theirs = read_header(path), gguf.GGUFReader(path)
        assert ours.data_offset == theirs.data_offset
        assert [(t.name, t.offset, t.n_bytes, t.ggml_type) for t in ours.tensors] == [
            (t.name, t.data_offset, t.n_bytes, int(t.tensor_type)) for t in theirs.tensors
        ]
        for key, field in theirs.fields.items():
            if key.startswith("GGUF."):
                continue
            assert ours.get(key) == pytest.approx(field.contents()), key


# ---------------------------------------------------------------------- bad files


def expect_bad(path, *words):
    with pytest.raises(BadModelFile) as err:
        Catalog.open(path)
    for w in words:
        assert w in str(err.value), str(err.value)
    return str(err.value)


def test_missing_file(tmp_path):
    expect_bad(tmp_path / "nope.gguf", "no such file")


def test_not_gguf(tmp_path):
    p = tmp_path / "text.gguf"
    p.write_text("this is not a model at all, just some text\n")
    expect_bad(p, "not a GGUF")
    (tmp_path / "empty.gguf").write_bytes(b"")
    expect_bad(tmp_path / "empty.gguf", "not a GGUF")
    expect_bad(tmp_path, "directory")


def test_truncated_data(tiny_model, tmp_path):
    p = tmp_path / "cut.gguf"
    data = tiny_model.read_bytes()
    p.write_bytes(data[:-100])
    expect_bad(p, "truncated", "output.weight")


def test_truncated_header(tiny_model, tmp_path):
    p = tmp_path / "cut.gguf"
    p.write_bytes(tiny_model.read_bytes()[:300])
    expect_bad(p, "truncated")


def test_no_routed_experts(tmp_path):
    # a plain (dense) llama: the architecture Mixtral shares, but no routed experts
    p = tmp_path / "dense.gguf"
    w = gguf.GGUFWriter(p, "llama")
    w.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    w.add_tensor("blk.0.ffn_gate.weight", np.zeros((32, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    expect_bad(p, "no routed expert", "not a mixture-of-experts model")


def test_missing_shard(split_model, tmp_path):
    shards = copy_shards(split_model, tmp_path)
    shards[1].unlink()
    expect_bad(shards[0], "missing shard", shards[1].name)


def test_shards_that_disagree_on_experts(model_factory, split_model, tmp_path):
    shards = copy_shards(split_model, tmp_path)
    other = Catalog.open(model_factory(split=3, experts=4)).files
    shutil.copy(other[2], shards[2])
    expect_bad(shards[0], "experts")


def test_shard_with_wrong_split_number(split_model, tmp_path):
    shards = copy_shards(split_model, tmp_path)
    shutil.copy(shards[1], shards[2])
    expect_bad(shards[0], "split keys")


def test_open_second_shard(split_model):
    expect_bad(Catalog.open(split_model).files[1], "first shard")


def test_split_file_with_wrong_name(split_model, tmp_path):
    p = tmp_path / "renamed.gguf"
    shutil.copy(split_model, p)
    expect_bad(p, "naming")


# ---------------------------------------------------------------------- other layouts


def write_moe(path, layers: dict[int, dict[str, tuple[int, int, int]]], n_expert_kv=None, used=2, arch="qwen3moe"):
    """A minimal GGUF with expert tensors {layer: {part: (n_expert, ne1, ne0)}} in Q8_0 (layouts, not llama.cpp's)."""
    w = gguf.GGUFWriter(path, arch)
    w.add_uint32(f"{arch}.block_count", max(layers) + 1)
    if n_expert_kv is not None:
        w.add_uint32(f"{arch}.expert_count", n_expert_kv)
    w.add_uint32(f"{arch}.expert_used_count", used)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    for layer, parts in layers.items():
        for part, (n, ne1, ne0) in parts.items():
            raw = np.arange(n * ne1 * ne0 // 32 * 34, dtype=np.uint32).astype(np.uint8)
            w.add_tensor(
                f"blk.{layer}.ffn_{part}_exps.weight",
                raw.reshape(n, ne1, ne0 // 32 * 34),
                raw_dtype=gguf.GGMLQuantizationType.Q8_0,
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_an_architecture_moed_does_not_serve_is_named(tmp_path):
    p = write_moe(tmp_path / "foo.gguf", {0: {p: (4, 32, 32) for p in ("gate", "up", "down")}}, arch="foomoe")
    msg = expect_bad(p, "architecture 'foomoe' is not one moed serves", str(p))
    assert all(a in msg for a in SERVED_ARCHS)


def test_every_generated_architecture_is_served():
    from moed.modelgen.makemodel import ARCHS

    assert set(ARCHS) == set(SERVED_ARCHS)


def test_fused_gate_up_and_leading_dense_layers(tmp_path):
    p = write_moe(
        tmp_path / "fused.gguf", {l: {"gate_up": (4, 128, 64), "down": (4, 64, 64)} for l in (2, 3, 5)}, n_expert_kv=4
    )
    cat = Catalog.open(p)
    assert cat.moe_layers == (2, 3, 5) and cat.n_layers == 6
    assert cat.parts == ("gate_up", "down")
    assert cat.layers[3].parts["gate_up"].bytes_per_expert == 128 * 64 // 32 * 34
    truth = file_experts([p])
    for (layer, part), (_, raw) in truth.items():
        for e in range(4):
            assert read_extent(*cat.extent(layer, e, part)) == raw[e].tobytes()
    with pytest.raises(UnknownLayer):
        cat.extent(0, 0, "down")


def test_layers_with_different_parts(tmp_path):
    p = write_moe(
        tmp_path / "odd.gguf",
        {
            0: {"gate": (4, 32, 32), "up": (4, 32, 32), "down": (4, 32, 32)},
            1: {"gate": (4, 32, 32), "down": (4, 32, 32)},
        },
    )
    expect_bad(p, "different expert parts", "layer 1: gate+down")


def test_expert_counts_disagree(tmp_path):
    p = write_moe(tmp_path / "n.gguf", {0: {"gate": (4, 32, 32)}, 1: {"gate": (6, 32, 32)}})
    expect_bad(p, "disagree on the number of experts")
    p = write_moe(tmp_path / "kv.gguf", {0: {"gate": (4, 32, 32)}}, n_expert_kv=8)
    expect_bad(p, "expert_count is 8")
    p = write_moe(tmp_path / "used.gguf", {0: {"gate": (4, 32, 32)}}, used=5)
    expect_bad(p, "expert_used_count")


# ---------------------------------------------------------------------- damaged files never crash


def test_any_truncation_is_bad_model_file(tiny_model, tmp_path):
    data = tiny_model.read_bytes()
    header_end = read_header(tiny_model).data_offset
    p = tmp_path / "cut.gguf"
    for n in list(range(0, 64)) + list(range(64, header_end, 97)) + [len(data) - 1]:
        p.write_bytes(data[:n])
        with pytest.raises(BadModelFile):
            Catalog.open(p)


def test_random_corruption_is_bad_model_file_or_opens(tiny_model, tmp_path):
    data = bytearray(tiny_model.read_bytes())
    header_end = read_header(tiny_model).data_offset
    rng = np.random.default_rng(0)
    p = tmp_path / "bad.gguf"
    for _ in range(300):
        bad = bytearray(data)
        for pos in rng.integers(4, header_end, size=rng.integers(1, 4)):
            bad[pos] = int(rng.integers(0, 256))
        p.write_bytes(bad)
        try:
            Catalog.open(p)
        except BadModelFile:
            pass
