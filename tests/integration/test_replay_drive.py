"""`moectl bench-drive` on a small file: raw reads, and --paired through a private daemon."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from moed.gguf.catalog import Catalog
from moed.lab import drivebench as db


@pytest.fixture(scope="module")
def bench_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("drive") / "bench.gguf"
    return db.write_bench_model(path, 24 << 20, part_bytes=64 << 10)


def moectl(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "moed.ctl", *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


def test_bench_model_is_a_catalogued_moe_file(bench_file):
    cat = Catalog.open(bench_file)
    assert cat.n_experts == 64 and cat.page_aligned
    assert all(p.bytes_per_expert == 64 << 10 for e in cat.layers.values() for p in e.parts.values())
    assert os.path.getsize(bench_file) >= 24 << 20


def test_raw_reads_of_any_file(tmp_path):
    f = tmp_path / "plain.bin"
    f.write_bytes(os.urandom(4 << 20))
    r = db.raw_reads(str(f), 64 << 10, depth=2, seconds=0.3)
    assert r.ops > 0 and r.bytes == r.ops * (64 << 10) and r.gbps > 0
    assert 0 < r.p50_ms <= r.p90_ms <= r.p99_ms <= r.max_ms


def test_paired_json(bench_file):
    out = moectl("bench-drive", bench_file, "--size", "64KiB", "--depth", "2", "--seconds", "0.4", "--paired", "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["raw_gbps"] > 0 and r["moed_gbps"] > 0
    assert r["ratio"] == pytest.approx(r["moed_gbps"] / r["raw_gbps"])
    raw1, moed, raw2 = r["runs"]
    assert r["raw_gbps"] == pytest.approx((raw1["gbps"] + raw2["gbps"]) / 2)
    assert moed["label"] == "moed" and moed["ops"] > 0 and moed["bytes"] >= moed["ops"] * 3 * (64 << 10) // 2


def test_raw_only_json_and_errors(bench_file, tmp_path):
    out = moectl("bench-drive", bench_file, "--size", "64KiB", "--depth", "1", "--seconds", "0.2", "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["raw_gbps"] > 0 and "moed_gbps" not in r
    assert moectl("bench-drive", tmp_path / "missing", "--seconds", "0.1").returncode == 2
    bad = moectl("bench-drive", bench_file, "--size", "1000", "--seconds", "0.1")
    assert bad.returncode == 2 and "size" in bad.stderr
