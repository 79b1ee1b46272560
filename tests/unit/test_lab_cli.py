"""moectl trace-info / policy / mrc, run in-process: output schemas and errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moed.ctl import main
from moed.lab.policies import POLICIES
from moed.traces import TraceWriter


@pytest.fixture
def trace_path(tmp_path):
    rng = np.random.default_rng(7)
    w = TraceWriter(3, 8, 2, bytes_per_expert=1 << 20, meta={"workload": "test"})
    w.append_step("P", rng.integers(0, 8, (3, 6, 2)))
    for _ in range(30):
        w.append_step("D", rng.integers(0, 8, (3, 2)), ahead1=rng.integers(0, 8, (3, 4)))
    path = tmp_path / "t.npz"
    w.finish().save(path)
    return path


def run_json(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_policy_json_schema(capsys, trace_path):
    rows = run_json(capsys, "policy", str(trace_path), "--json")
    assert isinstance(rows, list) and len(rows) == len(POLICIES) * 3
    for row in rows:
        assert set(row) == {"policy", "size", "slots", "accesses", "hits", "hit_rate"}
        assert row["policy"] in POLICIES and row["size"] in (0.25, 0.5, 0.75)
        assert isinstance(row["slots"], int) and isinstance(row["hits"], int)
        assert row["accesses"] > 0 and 0 <= row["hit_rate"] <= 1
        assert row["hit_rate"] == row["hits"] / row["accesses"]
    assert [r["policy"] for r in rows[: len(POLICIES)]] == list(POLICIES)


def test_policy_slots_warm_and_subset(capsys, trace_path):
    rows = run_json(
        capsys,
        "policy",
        str(trace_path),
        "--json",
        "--policies",
        "lru,g-opt",
        "--slots",
        "6",
        "--slots",
        "12",
        "--warm",
        "5",
    )
    assert rows == run_json(
        capsys, "policy", str(trace_path), "--json", "--policies", "lru,g-opt", "--slots", "6,12", "--warm", "5"
    )
    assert [(r["policy"], r["size"], r["slots"]) for r in rows] == [
        ("lru", None, 6),
        ("g-opt", None, 6),
        ("lru", None, 12),
        ("g-opt", None, 12),
    ]
    assert all(r["accesses"] <= 25 * 3 * 2 for r in rows)


def test_policy_ceilings_and_mtp_add_fields(capsys, trace_path):
    rows = run_json(
        capsys,
        "policy",
        str(trace_path),
        "--json",
        "--policies",
        "g-lru",
        "--drive-gbps",
        "2",
        "--compute-ms",
        "10",
        "--mtp",
        "3",
        "--accept",
        "2.2",
    )
    for row in rows:
        assert {"reads_per_token", "serial_tok_s", "overlapped_tok_s", "mtp_reads_per_token"} <= set(row)
        assert row["serial_tok_s"] <= row["overlapped_tok_s"] <= 100.0


def test_policy_table_and_plot(capsys, trace_path, tmp_path):
    out = tmp_path / "p.png"
    assert (
        main(
            [
                "policy",
                str(trace_path),
                "--policies",
                "g-lru,opt",
                "--plot",
                str(out),
                "--drive-gbps",
                "2",
                "--compute-ms",
                "10",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "g-lru" in text and "25%" in text and "drive ceiling" in text
    assert out.stat().st_size > 1000


def test_trace_info_json(capsys, trace_path):
    info = run_json(capsys, "trace-info", str(trace_path), "--json", "--predictors")
    assert (info["moe_layers"], info["n_experts"], info["top_k"]) == (3, 8, 2)
    assert (info["prompt_tokens"], info["decode_tokens"], info["gate_ahead"]) == (6, 30, True)
    assert info["meta"] == {"workload": "test"}
    names = [p["predictor"] for p in info["predictors"]]
    assert names == ["gate-ahead k", "gate-ahead 2k", "previous token", "co-occurrence"]
    assert main(["trace-info", str(trace_path)]) == 0
    assert "geometry" in capsys.readouterr().out


def test_mrc_json_and_table(capsys, trace_path, tmp_path):
    data = run_json(capsys, "mrc", str(trace_path), "--json", "--points", "4")
    assert data["max_slots"] == 24 and len(data["lru_hits"]) == 25
    assert [p["slots"] for p in data["points"]] == [0, 6, 12, 18, 24]
    for p in data["points"]:
        assert p["g-opt"] >= p["g-lru"]
    assert main(["mrc", str(trace_path), "--points", "2", "--plot", str(tmp_path / "m.png")]) == 0
    assert "g-opt" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["policy", "{t}", "--policies", "lru,bogus"],
        ["policy", "{t}", "--sizes", "0.5,2"],
        ["policy", "{t}", "--sizes", "half"],
        ["policy", "{t}", "--drive-gbps", "3"],
        ["policy", "{t}", "--mtp", "3"],
        ["policy", "{t}", "--warm", "-1"],
        ["policy", "{t}", "--slots", "ten"],
        ["policy", "{t}/missing.npz"],
        ["mrc", "{t}", "--points", "0"],
        ["trace-info", "{t}", "--predictors", "--size", "1.5"],
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, trace_path, argv):
    argv = [a.replace("{t}", str(trace_path)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("moectl: ") and err.count("\n") == 1
