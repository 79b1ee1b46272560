"""moectl align: realigned copies are byte-identical per tensor and page-align experts."""

from __future__ import annotations

import os
import shutil

import gguf
import numpy as np
import pytest

from moed.ctl import main as moectl
from moed.gguf.align import align_gguf, verify_aligned
from moed.gguf.catalog import Catalog
from moed.gguf.header import read_header, read_split
from moed.protocol.errors import BadModelFile


def same_model(a_first, b_first, alignment):
    """Every tensor's bytes and every key/value (but the alignment) are equal."""
    a_files, b_files = Catalog.open(a_first).files, Catalog.open(b_first).files
    assert len(a_files) == len(b_files)
    for fa, fb in zip(a_files, b_files):
        ra, rb = gguf.GGUFReader(fa), gguf.GGUFReader(fb)
        assert rb.alignment == alignment
        assert [t.name for t in ra.tensors] == [t.name for t in rb.tensors]
        for ta, tb in zip(ra.tensors, rb.tensors):
            assert ta.tensor_type == tb.tensor_type and list(ta.shape) == list(tb.shape)
            assert tb.data_offset % alignment == 0
            assert np.asarray(ta.data).tobytes() == np.asarray(tb.data).tobytes(), ta.name
        ka = {k for k in ra.fields if not k.startswith("GGUF.") and k != "general.alignment"}
        kb = {k for k in rb.fields if not k.startswith("GGUF.") and k != "general.alignment"}
        assert ka == kb
        for k in ka:
            assert ra.fields[k].contents() == rb.fields[k].contents(), k


def test_align_round_trip(tiny_model, tmp_path):
    out = tmp_path / "aligned.gguf"
    assert align_gguf(tiny_model, out) == [str(out)]
    same_model(tiny_model, out, 4096)
    # and back again: the original alignment gives the original data section
    back = tmp_path / "back.gguf"
    align_gguf(out, back, alignment=32)
    same_model(tiny_model, back, 32)
    a, b = read_header(tiny_model), read_header(back)
    assert tiny_model.read_bytes()[a.data_offset :] == back.read_bytes()[b.data_offset :]


def test_align_makes_page_multiples_page_aligned(model_factory, tmp_path):
    src = model_factory(embd=256, ff=256)  # 69632-byte experts, 32-byte alignment
    assert not Catalog.open(src).page_aligned
    out = tmp_path / "out.gguf"
    align_gguf(src, out)
    cat = Catalog.open(out)
    assert cat.page_aligned and cat.alignment == 4096
    same_model(src, out, 4096)


def test_align_split_model(split_model, tmp_path):
    outs = align_gguf(split_model, tmp_path / "big.gguf")
    assert [os.path.basename(o) for o in outs] == [f"big-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    same_model(split_model, outs[0], 4096)
    a, b = Catalog.open(split_model), Catalog.open(outs[0])
    for layer in a.moe_layers:
        for e in range(a.n_experts):
            for part in a.parts:
                pa, oa, na = a.extent(layer, e, part)
                pb, ob, nb = b.extent(layer, e, part)
                assert na == nb and (ob - e * nb) % 4096 == 0
                with open(pa, "rb") as fa, open(pb, "rb") as fb:
                    assert os.pread(fa.fileno(), na, oa) == os.pread(fb.fileno(), nb, ob)


def test_align_split_output_named_as_first_shard(split_model, tmp_path):
    outs = align_gguf(split_model, tmp_path / "x-00001-of-00003.gguf")
    assert outs[2] == str(tmp_path / "x-00003-of-00003.gguf")


def test_verify_catches_a_changed_byte(tiny_model, tmp_path):
    out = tmp_path / "out.gguf"
    align_gguf(tiny_model, out)
    h = read_header(out)
    with open(out, "r+b") as f:
        f.seek(h.tensors[5].offset + 3)
        f.write(b"\xff" if f.read(1) != b"\xff" else b"\x00")
    with pytest.raises(ValueError, match=h.tensors[5].name):
        verify_aligned(read_split(tiny_model), str(out), 4096)


def test_refuses_to_overwrite(tiny_model, tmp_path):
    out = tmp_path / "out.gguf"
    out.write_bytes(b"keep me")
    with pytest.raises(FileExistsError):
        align_gguf(tiny_model, out)
    assert out.read_bytes() == b"keep me"
    align_gguf(tiny_model, out, overwrite=True)
    assert read_header(out).alignment == 4096


def test_refuses_same_file(tiny_model, tmp_path):
    p = tmp_path / "m.gguf"
    shutil.copy(tiny_model, p)
    with pytest.raises(ValueError, match="input file"):
        align_gguf(p, p, overwrite=True)


def test_bad_input_leaves_nothing(tmp_path):
    src = tmp_path / "junk.gguf"
    src.write_text("not a model")
    with pytest.raises(BadModelFile, match="not a GGUF"):
        align_gguf(src, tmp_path / "out.gguf")
    assert sorted(os.listdir(tmp_path)) == ["junk.gguf"]


def test_moectl_align(split_model, tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert moectl(["align", str(split_model), str(out)]) == 0
    cap = capsys.readouterr()
    assert cap.out.split()[0] == str(tmp_path / "cli-00001-of-00003.gguf")
    assert "expert tensors page-aligned" in cap.err
    assert moectl(["align", str(split_model), str(out)]) == 2
    assert "exists" in capsys.readouterr().err
    assert moectl(["align", str(tmp_path / "none.gguf"), str(tmp_path / "o.gguf")]) == 2
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())


def test_a_transform_rewrites_expert_units_and_records_its_keys(model_factory, tmp_path):
    """align's Transform (what --repack uses): named tensors rewritten unit by unit, keys added,
    everything else byte for byte, and verification repeats the transform."""
    from moed.gguf.align import Transform
    from moed.gguf.catalog import EXPERT_RE
    from moed.gguf.layouts import KEY_LAYOUTS

    src = model_factory(split=2)

    def unit_of(t):
        return (lambda b: b[::-1]) if EXPERT_RE.match(t.name) else None

    tr = Transform(unit_of, {KEY_LAYOUTS: ["Q8_0=reversed"], "moed.repack.cpu": "test"})
    outs = align_gguf(src, tmp_path / "t.gguf", transform=tr)
    cat = Catalog.open(outs[0])
    assert cat.expert_layouts == {"Q8_0": "reversed"} and cat.expert_layout == "reversed"
    ins = read_split(src)
    for h_in, h_out in zip(ins, read_split(outs[0])):
        assert h_out.get("moed.repack.cpu") == "test"
        for a, b in zip(h_in.tensors, h_out.tensors):
            with open(h_in.path, "rb") as fa, open(h_out.path, "rb") as fb:
                fa.seek(a.offset)
                fb.seek(b.offset)
                x, y = fa.read(a.n_bytes), fb.read(b.n_bytes)
            if EXPERT_RE.match(a.name):
                unit = a.n_bytes // a.dims[-1]
                assert y == b"".join(x[k : k + unit][::-1] for k in range(0, len(x), unit))
            else:
                assert x == y
    # the output verified against a different transform fails
    other = Transform(lambda t: None, tr.kvs)
    with pytest.raises(ValueError, match="differs"):
        verify_aligned(ins, outs[0], 4096, transform=other)
