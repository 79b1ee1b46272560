"""Trace format: building, the native file, the nvmoe and TSV importers, round trips."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moed.traces import BadTrace, Trace, TraceGeometry, TraceWriter

NVMOE_SMOKE = Path(__file__).resolve().parents[1] / "data/olmoe-smoke.jsonl"  # MIT, from nvmoe


def trace_with_predictions() -> Trace:
    w = TraceWriter(
        moe_layers=3,
        n_experts=8,
        top_k=2,
        bytes_per_expert=3 << 20,
        layer_ids=[1, 2, 3],
        meta={"workload": "chat", "model": "x.gguf"},
    )
    w.append_step("P", [[[0, 1], [2, 3], [4, 5]], [[1, 2], [3, 4], [5, 6]], [[7, 0], [1, 2], [3, 4]]])
    w.append_step("D", [[1, 2], [3, 4], [5, 6]], ahead1=[[], [3, 4, 0, 1], [5, 6, 7, 0]], ahead2=[[], [], [6, 5, 1, 2]])
    w.append_step("D", [[1, 7], [0, 4], [5]])  # a short row is padded with -1
    return w.finish()


def test_writer_builds_steps_and_views():
    t = trace_with_predictions()
    assert (t.n_steps, t.n_tokens, t.n_prompt_tokens, t.n_decode_tokens) == (3, 5, 3, 2)
    assert (t.moe_layers, t.n_experts, t.top_k, t.bytes_per_expert) == (3, 8, 2, 3 << 20)
    p, d1, d2 = t.steps
    assert p.kind == "P" and p.n_tokens == 3 and d1.kind == "D" and d1.n_tokens == 1
    assert p.ids[1].tolist() == [[1, 2], [3, 4], [5, 6]]  # layer 1, every token
    assert d2.ids[2].tolist() == [[5, -1]]
    assert p.experts(2).tolist() == [0, 1, 2, 3, 4, 7]
    assert d1.ahead1[1].tolist() == [[3, 4, 0, 1]]
    assert d1.ahead1[0].tolist() == [[-1, -1, -1, -1]]  # no prediction for layer 0
    assert d2.ahead1 is not None and (d2.ahead1 == -1).all()  # a step without predictions
    assert p.ahead2 is not None and (p.ahead2 == -1).all()
    assert t.token_kinds.tobytes() == b"PPPDD"
    with pytest.raises(ValueError):
        t.ids[0, 0, 0] = 5  # immutable


@pytest.mark.parametrize(
    "bad",
    [
        lambda w: w.append_step("X", [[0, 1]] * 3),
        lambda w: w.append_step("D", [[0, 1]] * 2),  # wrong layer count
        lambda w: w.append_step("D", [[0, 1, 2]] * 3),  # wider than top_k
        lambda w: w.append_step("D", [[0, 8]] * 3),  # id out of range
        lambda w: w.append_step("D", [[[0, 1], [1, 2]], [[0, 1]], [[0, 1]]]),  # ragged tokens
    ],
)
def test_writer_rejects_bad_steps(bad):
    with pytest.raises(BadTrace):
        bad(TraceWriter(3, 8, 2))


def test_empty_writer_and_bad_geometry():
    with pytest.raises(BadTrace):
        TraceWriter(3, 8, 2).finish()
    with pytest.raises(BadTrace):
        TraceGeometry(0, 8, 2)
    with pytest.raises(BadTrace):
        TraceGeometry(2, 8, 2, layer_ids=(1,))


@pytest.mark.parametrize("suffix", [".npz", ".trace", ".tsv"])
def test_round_trip_keeps_everything(tmp_path, suffix):
    t = trace_with_predictions()
    path = tmp_path / f"t{suffix}"
    t.save(path)
    back = Trace.load(path, **({"n_experts": 8, "bytes_per_expert": 3 << 20} if suffix == ".tsv" else {}))
    if suffix == ".tsv":  # TSV keeps routes, kinds, predictions and layer numbers, not meta
        assert back.meta["source_format"] == "tsv"
        back = Trace(
            back.geometry, back.ids, back.step_kinds, np.diff(back.step_offsets), back.ahead1, back.ahead2, t.meta
        )
    assert back == t
    assert not list(tmp_path.glob(".*tmp*"))  # written through a temporary name


def test_jsonl_round_trip_of_a_decode_trace(tmp_path):
    w = TraceWriter(2, 16, 3, layer_ids=[3, 5])
    rng = np.random.default_rng(0)
    for _ in range(10):
        w.append_step("D", [rng.choice(16, 3, replace=False) for _ in range(2)])
    t = w.finish()
    t.save(tmp_path / "t.jsonl")
    first = json.loads((tmp_path / "t.jsonl").read_text().splitlines()[0])
    assert [pair[0] for pair in first] == [3, 3, 3, 5, 5, 5]
    back = Trace.load(tmp_path / "t.jsonl", n_experts=16)
    assert np.array_equal(back.ids, t.ids) and back.geometry == t.geometry
    assert back.meta["source_format"] == "nvmoe-jsonl"


def test_nvmoe_import(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text("[[1, 5], [1, 2], [2, 7], [2, 0]]\n\n[[1, 2], [1, 3], [2, 1], [2, 0]]\n")
    t = Trace.load(path)
    assert t.geometry == TraceGeometry(2, 8, 2, None, (1, 2))
    assert t.ids.tolist() == [[[5, 2], [7, 0]], [[2, 3], [1, 0]]]
    assert t.step_kinds.tobytes() == b"DD"
    assert Trace.load(path, n_experts=64).n_experts == 64


def test_shipped_nvmoe_trace_loads():
    t = Trace.load(NVMOE_SMOKE)
    assert (t.moe_layers, t.n_experts, t.top_k, t.n_decode_tokens) == (16, 64, 8, 47)
    assert (t.ids >= 0).all()


def test_tsv_import_six_columns(tmp_path):
    # a prompt step of 2 tokens over layers 1-2, then two decode tokens with predictions
    path = tmp_path / "t.tsv"
    path.write_text(
        "# model=x.gguf\n"
        "0\t1\tP\t0,1\n0\t1\tP\t2,3\n0\t2\tP\t4,5\n0\t2\tP\t6,7\n"
        "1\t1\tD\t1,2\t-\t-\n1\t2\tD\t3,4\t3,4,5,6\t-\n"
        "2\t1\tD\t1,2\t-\t-\n2\t2\tD\t5,4\t4,5,1,2\t7,6,5,4\n"
    )
    t = Trace.load(path)
    assert t.geometry.layer_ids == (1, 2) and t.top_k == 2 and t.n_experts == 8
    assert t.step_kinds.tobytes() == b"PDD" and t.n_prompt_tokens == 2
    assert t.steps[0].ids[1].tolist() == [[4, 5], [6, 7]]
    assert t.ahead1[3, 1].tolist() == [4, 5, 1, 2] and t.ahead1[3, 0].tolist() == [-1] * 4
    assert t.ahead2[3, 1].tolist() == [7, 6, 5, 4] and (t.ahead2[2] == -1).all()
    assert t.meta["model"] == "x.gguf"


def test_tsv_import_old_three_columns(tmp_path):
    path = tmp_path / "old.tsv"
    path.write_text("0\t0\t1,2\n0\t0\t3,4\n0\t1\t5,6\n0\t1\t7,0\n1\t0\t1,3\n1\t1\t5,7\n")
    t = Trace.load(path)
    assert t.step_kinds.tobytes() == b"PD"  # step 0 is the prompt
    assert t.steps[0].n_tokens == 2 and not t.has_predictions


@pytest.mark.parametrize(
    "content", [b"", b"hello world\n", b"0\t1\tQ\t1,2\n", b"0\t1\tD\tx,y\n", b"[[0, 1], [0]]\n", b"PK\x03\x04garbage"]
)
def test_bad_files_are_typed_errors(tmp_path, content):
    path = tmp_path / "bad"
    path.write_bytes(content)
    with pytest.raises(BadTrace):
        Trace.load(path)


def test_missing_file_and_future_version(tmp_path):
    with pytest.raises(BadTrace):
        Trace.load(tmp_path / "nope.npz")
    path = tmp_path / "t.npz"
    trace_with_predictions().save(path)
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    header = json.loads(np.load(path)["header"].tobytes())
    header["version"] = 99
    future = tmp_path / "future.npz"
    arrays = {n: np.load(path)[n] for n in np.load(path).files}
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    with open(future, "wb") as f:
        np.savez(f, **arrays)
    assert members  # the native file is a plain zip of .npy members
    with pytest.raises(BadTrace, match="version 99"):
        Trace.load(future)


def test_native_file_is_compact(tmp_path):
    w = TraceWriter(48, 128, 8)
    w.append_step("P", np.random.default_rng(0).integers(0, 128, (48, 2000, 8)))
    w.append_step("D", np.zeros((48, 8), int), ahead1=np.zeros((48, 16), int))
    path = tmp_path / "big.npz"
    w.finish().save(path)
    # one byte per id, predictions stored for the one decode token only
    assert path.stat().st_size < 2001 * 48 * 8 + 48 * 16 + 64 * 1024


@st.composite
def traces(draw):
    layers, experts = draw(st.integers(1, 4)), draw(st.integers(1, 300))
    k = draw(st.integers(1, 4))
    w = TraceWriter(layers, experts, k)
    with_pred = draw(st.booleans())
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from("PD"))
        n = draw(st.integers(1, 3))
        ids = draw(
            st.lists(
                st.lists(st.lists(st.integers(0, experts - 1), min_size=1, max_size=k), min_size=n, max_size=n),
                min_size=layers,
                max_size=layers,
            )
        )
        ids = [[row + [-1] * (k - len(row)) for row in layer] for layer in ids]
        pred = None
        if with_pred and kind == "D":
            pred = draw(
                st.lists(
                    st.lists(
                        st.lists(st.integers(0, experts - 1), min_size=2 * k, max_size=2 * k), min_size=n, max_size=n
                    ),
                    min_size=layers,
                    max_size=layers,
                )
            )
        w.append_step(kind, ids, ahead1=pred)
    return w.finish()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(t=traces())
def test_round_trip_property(tmp_path, t):
    for name in ("p.npz", "p.tsv"):
        t.save(tmp_path / name)
        back = (
            Trace.load(tmp_path / name, n_experts=t.n_experts, top_k=t.top_k)
            if name.endswith(".tsv")
            else Trace.load(tmp_path / name)
        )
        assert np.array_equal(back.ids, t.ids), name
        assert np.array_equal(back.step_offsets, t.step_offsets) and np.array_equal(back.step_kinds, t.step_kinds)
        if t.ahead1 is None or not (t.ahead1 >= 0).any():
            assert back.ahead1 is None or not (back.ahead1 >= 0).any()
        else:
            assert np.array_equal(back.ahead1[:, :, : 2 * t.top_k], t.ahead1)
