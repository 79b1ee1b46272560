"""Every architecture make-model writes (`makemodel.ARCHS`), through the real daemon and llama.cpp.

Each case runs at a budget that forces eviction and is bit-exact against the
same-kernel resident engine (UnpackedLlama, `reference_logits`) over a prompt batch
and 32 greedy steps:
- zero copy: a model whose every expert part is whole pages at 4096 alignment
  (`makemodel.aligned_geometry`, in the arch's own expert quant): the engine maps the
  daemon's slots, never copies;
- split shards: a 3-shard model on the copy path, and `align` of a 3-shard model on
  the zero-copy path, with the catalog checked against gguf.GGUFReader shard by shard;
- the q4_k_m recipe after `align`: layers whose Q4_K parts are mapped and whose Q6_K
  part is copied, in two size classes;
- two processes: engines of two architectures (one zero copy, one copy) stepping
  at the same time on one daemon, for every adjacent pair of the sorted names; and
  one zero-copy engine process per architecture, all at once, in strict mode (a read
  of an expert not held faults).

An architecture added to ARCHS joins every case here.
"""

from __future__ import annotations

import json
import re
import select
import subprocess
import sys

import gguf
import numpy as np
import pytest

from moed.modelgen import makemodel
from tests.e2e.conftest import LLAMA_KW, PROMPT, assert_bit_equal, greedy_logits, unsplit

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")  # e2e needs the real llama.cpp (pyproject extra "llama")

ARCHS = sorted(makemodel.ARCHS)
PAIRS = [(a, b) for a, b in zip(ARCHS, ARCHS[1:] + ARCHS[:1]) if a != b]  # each arch once per role
# Budgets of 8-21 slots: a prompt batch routes to at most 8 experts of a layer, and the
# models hold 24-32 experts, so every run evicts (each test checks that it did).
COPY_BUDGET = "256KiB"  # tiny geometry: 3 parts of 4352 bytes (q8_0), 24 KiB slots
ZERO_COPY_BUDGET = "2MiB"  # aligned geometry: 3 parts of 69632 bytes (17 pages), 204 KiB slots
MIXED_BUDGET = "1MiB"  # q4_k_m at 256 x 256 after align: 2 x 36864 + 53760 bytes, ~128 KiB slots
PAIR_BUDGET = "2560KiB"  # 8 aligned and 8 tiny slots at once, fewer than the two models' experts
ALL_BUDGET = f"{len(ARCHS) * 10 * 204}KiB"  # 10 aligned slots an engine: room for every prompt batch at once
ROUTED = re.compile(r"^blk\.(\d+)\.ffn_(gate_up|gate|up|down)_exps\.weight$")


def aligned(arch: str) -> dict:
    return {"arch": arch, **makemodel.aligned_geometry(arch=arch)}  # the arch's own expert quant


def run_streamed(daemon, path) -> tuple[np.ndarray, dict, dict]:
    from moed.engines.llama_cpp import StreamedLlama

    client = daemon.client("e2e")
    try:
        llm = StreamedLlama(str(path), client=client, **LLAMA_KW)
        try:
            split: list[int] = []
            logits = greedy_logits(llm, llm.tokenize(PROMPT), split=split)
            assert split == unsplit(sum(split)), f"the engine split the prompt {split}: the budget is too small"
            return logits, llm.stream_stats(), client.stats()
        finally:
            llm.close()
    finally:
        client.close()


def assert_evicting_and_exact(got, want, engine: dict, daemon_stats: dict) -> None:
    assert_bit_equal(got, want)
    assert engine["decodes"] >= 33 and engine["layers"] > 0
    assert daemon_stats["evictions"] > 0, "the budget did not force eviction"
    assert all(t["leases"] == 0 for t in daemon_stats["tenants"])


def assert_catalog_matches_reader(cat) -> None:
    """Every routed-expert tensor of every shard is one catalog extent, at GGUFReader's offset,
    size, type and shape, aligned as that shard says; the catalog has nothing else."""
    seen = 0
    for shard, path in enumerate(cat.files):
        reader = gguf.GGUFReader(path)
        by_offset = {int(t.data_offset): t for t in reader.tensors}
        routed = {(int(m[1]), m[2]): t for t in reader.tensors if (m := ROUTED.match(t.name))}
        mine = {(l, p): x for l, e in cat.layers.items() for p, x in e.parts.items() if x.shard == shard}
        assert set(routed) <= set(mine), f"shard {shard}: routed tensors the catalog missed"
        for (layer, part), x in mine.items():
            t = by_offset.get(x.offset)
            assert t is not None, f"shard {shard}: no tensor at layer {layer} {part}'s offset {x.offset}"
            assert t.name.startswith(f"blk.{layer}.ffn_") and "_exps." in t.name, t.name
            assert x.path == path and x.offset % reader.alignment == 0
            assert (x.bytes_per_expert, x.ggml_type) == (int(t.n_bytes) // cat.n_experts, int(t.tensor_type))
            assert x.shape == tuple(int(d) for d in t.shape) and x.shape[-1] == cat.n_experts
        seen += len(mine)
    assert seen == len(cat.moe_layers) * len(cat.parts)
    assert cat.alignment == gguf.GGUFReader(cat.files[0]).alignment


# ---------------------------------------------------------------------- one engine


@pytest.mark.parametrize("arch", ARCHS)
def test_zero_copy_at_an_evicting_budget(start_daemon, reference_logits, model_factory, arch):
    from moed.gguf.catalog import Catalog

    path = model_factory(**aligned(arch))
    assert Catalog.open(path).page_aligned, "aligned_geometry does not make this arch's parts whole pages"
    _, want = reference_logits(path)
    got, engine, daemon_stats = run_streamed(start_daemon(ZERO_COPY_BUDGET), path)
    assert_evicting_and_exact(got, want, engine, daemon_stats)
    assert engine["pages_maps"] > 0 and engine["pages_copies"] == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_split_shards_at_an_evicting_budget(start_daemon, reference_logits, model_factory, arch):
    from moed.gguf.catalog import Catalog

    shards = model_factory.shards(arch=arch, split=3)
    cat = Catalog.open(shards[0])
    assert cat.files == tuple(str(s) for s in shards)
    assert len({x.shard for e in cat.layers.values() for x in e.parts.values()}) > 1, "experts in one shard only"
    assert_catalog_matches_reader(cat)
    _, want = reference_logits(shards[0])
    got, engine, daemon_stats = run_streamed(start_daemon(COPY_BUDGET), shards[0])
    assert_evicting_and_exact(got, want, engine, daemon_stats)
    assert engine["pages_copies"] > 0 and engine["pages_maps"] == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_aligned_split_is_zero_copy_at_an_evicting_budget(
    start_daemon, reference_logits, model_factory, tmp_path, arch
):
    """`align` of a 3-shard model (32-byte alignment, copy path): every shard page-aligned, same logits."""
    from moed.gguf.align import align_gguf
    from moed.gguf.catalog import Catalog

    geometry = {k: v for k, v in aligned(arch).items() if k != "align"}
    original = model_factory.shards(**geometry, split=3)
    assert not Catalog.open(original[0]).page_aligned
    shards = align_gguf(original[0], tmp_path / "aligned.gguf")
    cat = Catalog.open(shards[0])
    assert len(cat.files) == 3 and cat.page_aligned
    assert all(gguf.GGUFReader(f).alignment == 4096 for f in cat.files)
    assert_catalog_matches_reader(cat)
    _, want = reference_logits(original[0])  # the resident run of the unaligned original
    got, engine, daemon_stats = run_streamed(start_daemon(ZERO_COPY_BUDGET), shards[0])
    assert_evicting_and_exact(got, want, engine, daemon_stats)
    assert engine["pages_maps"] > 0 and engine["pages_copies"] == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_q4_k_m_after_align_maps_and_copies_in_one_layer(start_daemon, reference_logits, model_factory, tmp_path, arch):
    """The real quant mix after `align`: Q4_K gate/up are whole pages (mapped), Q6_K down is not (copied)."""
    from moed.gguf.align import align_gguf
    from moed.gguf.catalog import Catalog

    original = model_factory(arch=arch, embd=256, ff=256, recipe="q4_k_m")
    path = align_gguf(original, tmp_path / "aligned.gguf")[0]
    cat = Catalog.open(path)
    kinds = [{x.page_aligned for x in e.parts.values()} for e in cat.layers.values()]
    assert {True, False} in kinds, "no layer with both a page-aligned and an unaligned part"
    assert len(cat.size_classes) > 1
    _, want = reference_logits(original)
    got, engine, daemon_stats = run_streamed(start_daemon(MIXED_BUDGET), path)
    assert_evicting_and_exact(got, want, engine, daemon_stats)
    assert engine["pages_maps"] > 0 and engine["pages_copies"] > 0


# ---------------------------------------------------------------------- two processes


def spawn_engine(socket: str, path, out, *flags: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "tests.e2e.engine_proc",
        socket,
        str(path),
        PROMPT.decode(),
        "32",
        "--logits",
        str(out),
    ]
    cmd += flags
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_line(proc: subprocess.Popen, timeout_s: float = 60) -> str:
    """The engine's next line of output, waited for with a deadline."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, "engine printed nothing before the deadline"
    line = proc.stdout.readline()
    assert line, f"engine exited early: {proc.stderr.read()[-3000:]}"
    return line.strip()


def finish(proc: subprocess.Popen, timeout_s: float = 120) -> dict:
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def run_at_once(daemon, paths, tmp_path, reference_logits, *flags: str) -> list[dict]:
    """One engine process per model: all loaded, then all stepping at once; each its own resident run."""
    want = [reference_logits(p)[1] for p in paths]
    outs = [tmp_path / f"{i}.npy" for i in range(len(paths))]
    procs = [spawn_engine(daemon.socket, p, o, *flags) for p, o in zip(paths, outs)]
    try:
        for proc in procs:
            assert read_line(proc) == "ready"
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        runs = [finish(proc) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert max(r["started_s"] for r in runs) < min(r["ended_s"] for r in runs), "the engines did not run at once"
    for run, out, expected in zip(runs, outs, want):
        assert run["n_batch"] == LLAMA_KW["n_batch"] and run["decodes"] >= 33
        assert_bit_equal(np.load(out), expected)
    return runs


def assert_daemon_served_all_and_evicted(daemon, paths) -> None:
    with daemon.client("check") as c:
        stats = c.stats()
    rows = {row["path"]: row for row in stats["models"]}
    assert set(rows) == {str(p) for p in paths}
    assert all(row["misses"] > 0 and row["leases"] == 0 for row in rows.values())
    assert stats["evictions"] > 0 and stats["used_bytes"] <= stats["budget_bytes"]


@pytest.mark.parametrize("first, second", PAIRS, ids=[f"{a}+{b}" for a, b in PAIRS])
def test_two_architectures_from_two_processes_share_an_evicting_daemon(
    start_daemon, reference_logits, model_factory, tmp_path, first, second
):
    """`first` zero copy and `second` copy (two size classes on one budget), stepping at once."""
    paths = [model_factory(**aligned(first)), model_factory(arch=second)]
    daemon = start_daemon(PAIR_BUDGET)
    runs = run_at_once(daemon, paths, tmp_path, reference_logits)
    assert runs[0]["pages_maps"] > 0 and runs[0]["pages_copies"] == 0
    assert runs[1]["pages_copies"] > 0 and runs[1]["pages_maps"] == 0
    assert_daemon_served_all_and_evicted(daemon, paths)


def test_every_architecture_at_once_zero_copy_on_one_evicting_daemon(
    start_daemon, reference_logits, model_factory, tmp_path
):
    """One zero-copy engine process per architecture; models of one size class take each other's slots.

    Strict: a released expert faults again, so an engine that read any expert it does
    not hold right now (its bytes possibly another model's by then) would die."""
    from moed.gguf.catalog import Catalog

    paths = [model_factory(**aligned(arch)) for arch in ARCHS]
    classes = [frozenset(Catalog.open(p).size_classes) for p in paths]
    assert any(classes.count(c) > 1 for c in classes), "no two architectures share a size class"
    daemon = start_daemon(ALL_BUDGET)
    runs = run_at_once(daemon, paths, tmp_path, reference_logits, "--strict")
    assert all(r["pages_maps"] > 0 and r["pages_copies"] == 0 and r["pages_reprotects"] > 0 for r in runs)
    assert_daemon_served_all_and_evicted(daemon, paths)
