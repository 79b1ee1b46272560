"""StreamedLlama against resident llama.cpp, bit for bit, with experts from the real daemon."""

from __future__ import annotations

import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

from tests.e2e.conftest import LLAMA_KW, PROMPT, assert_bit_equal, greedy_logits

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")  # e2e needs the real llama.cpp (pyproject extra "llama")


def streamed(daemon, path, reconnect_s: float = 30.0, **kw):
    from moed.engines.llama_cpp import StreamedLlama

    client = daemon.client("e2e", reconnect_s=reconnect_s)
    return StreamedLlama(str(path), client=client, **{**LLAMA_KW, **kw}), client


def run_streamed(daemon, path) -> tuple[np.ndarray, dict, dict]:
    llm, client = streamed(daemon, path)
    try:
        tokens = llm.tokenize(PROMPT)
        logits = greedy_logits(llm, tokens)
        return logits, llm.stream_stats(), client.stats()
    finally:
        llm.close()
        client.close()


def test_ggml_layout_and_pinned_version(llama_cpp):
    from moed.engines import ggml_api
    from moed.engines.llama_cpp import LLAMA_CPP_PYTHON_VERSION

    assert llama_cpp.__version__ == LLAMA_CPP_PYTHON_VERSION
    assert ggml_api.layout_matches()


@pytest.mark.parametrize(
    "model, budget, path_kind",
    [
        ("aligned_model", "64MiB", "zero_copy"),
        ("tiny_model", "64MiB", "copy"),
        ("split_model", "64MiB", "copy"),
        ("mixed_model", "64MiB", "copy"),
        ("q4_k_m_model", "1MiB", "evicting"),  # Q4_K_M's mix: 127488- and 110592-byte experts, 32 of them
        ("tiny_model", "256KiB", "evicting"),  # ~10 slots of 32 experts: evicted between layers
        ("aligned_model", "2MiB", "evicting"),
        ("trained_model", "64MiB", "copy"),  # learned weights and routing (17408-byte parts: copy path)
        ("trained_model", "1MiB", "evicting"),  # ~17 slots of 96 experts
        ("olmoe_model", "256KiB", "evicting"),  # other architectures, tiny_model's expert size
        ("qwen2moe_model", "256KiB", "evicting"),  # routed experts served, the shared expert resident
        ("deepseek2_model", "256KiB", "evicting"),  # MLA, a leading dense layer, gating bias
        ("mixtral_model", "256KiB", "evicting"),  # general.architecture "llama" with ffn_*_exps
        ("gpt_oss_model", "256KiB", "copy+evicting"),  # MXFP4 experts, dense bias rows, sinks, SWA
        ("gpt_oss_aligned_model", "2MiB", "zero_copy+evicting"),  # MXFP4 256 x 512: 17-page parts
        ("glm4moe_model", "256KiB", "evicting"),  # a leading dense layer, shared expert, partial rope
    ],
)
def test_logits_bit_exact(request, start_daemon, reference_logits, model, budget, path_kind):
    path = request.getfixturevalue(model)
    _, want = reference_logits(path)
    got, engine, daemon_stats = run_streamed(start_daemon(budget), path)
    assert_bit_equal(got, want)
    assert engine["decodes"] >= 33 and engine["layers"] > 0
    kinds = set(path_kind.split("+"))
    if "zero_copy" in kinds:
        assert engine["pages_maps"] > 0 and engine["pages_copies"] == 0
        # The lane takes the layers that are all local hits in C; with evictions, the
        # misses go through Python's path, and the two alternate within a decode.
        assert engine["lane_layers"] > 0
        if "evicting" in kinds:
            assert engine["lane_layers"] < engine["layers"]
    if "copy" in kinds:
        assert engine["pages_copies"] > 0 and engine["pages_maps"] == 0
    if "evicting" in kinds:
        assert daemon_stats["evictions"] > 0
    assert daemon_stats["tenants"][0]["leases"] == 0 or all(t["leases"] == 0 for t in daemon_stats["tenants"])


@pytest.mark.parametrize("arch", ["qwen3moe", "olmoe", "qwen2moe", "deepseek2", "llama", "gpt-oss", "glm4moe"])
def test_aligned_copy_of_a_model_gives_identical_logits(start_daemon, reference_logits, model_factory, tmp_path, arch):
    from moed.gguf.align import align_gguf
    from moed.modelgen.makemodel import aligned_geometry

    g = aligned_geometry(arch=arch)  # whole-page parts (gpt-oss's MXFP4: 256 x 512), at 32-byte alignment
    original = model_factory(embd=g["embd"], ff=g["ff"], **({} if arch == "qwen3moe" else {"arch": arch}))
    aligned = align_gguf(original, tmp_path / "aligned.gguf")[0]
    _, want = reference_logits(original)
    got, engine, _ = run_streamed(start_daemon(), aligned)
    assert_bit_equal(got, want)
    assert engine["pages_maps"] > 0 and engine["pages_copies"] == 0


@pytest.mark.parametrize("mode", ["--touch-expert", "--touch-released"])
def test_reading_an_expert_that_is_not_leased_faults(start_daemon, aligned_model, mode):
    d = start_daemon()
    r = subprocess.run(
        [sys.executable, "-m", "tests.e2e.engine_proc", d.socket, str(aligned_model), "x", "4", mode],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "touching" in r.stdout and "read a" not in r.stdout
    assert r.returncode == -11, r.stderr[-2000:]


def test_the_lane_takes_every_layer_that_fits_and_the_connection_closing_stops_it(
    start_daemon, reference_logits, aligned_model
):
    """No route hook, no prefetch: the C lane takes a layer of local hits without Python
    at all; once the client closes, it takes none (the daemon no longer counts its holds)."""
    from moed.protocol.errors import DaemonUnavailable

    _, want = reference_logits(aligned_model)
    llm, client = streamed(start_daemon("64MiB"), aligned_model, prefetch="off")
    try:
        src = llm.streamer.source
        warmed = llm.warm(everything=True)
        assert warmed == len(src.moe_layers) * src.n_experts
        assert_bit_equal(greedy_logits(llm, llm.tokenize(PROMPT)), want)
        stats = llm.stream_stats()
        assert stats["lane_layers"] == stats["layers"] > 0  # every expert resident: every layer in C
        assert stats["pages_maps"] == warmed  # warm mapped every slot; no slot changed after
        client.close()
        taken = stats["lane_layers"]
        with pytest.raises(DaemonUnavailable):
            llm.eval(llm.tokenize(b"x", add_bos=False))
        assert llm.stream_stats()["lane_layers"] == taken
    finally:
        llm.close()
        client.close()


def test_a_layer_tries_its_hit_once_before_asking_the_daemon(start_daemon, reference_logits, aligned_model):
    """At an evicting budget many layers miss: each tries the hit with no round trip once (in
    the layer holds' C, or in Python when the holds did not try), then asks the daemon, never a
    second or third time (issue 33: a miss used to run hp_hit three times). And a missed layer
    crosses into Python once and never back (issue 39: it used to cross five times; issue 48:
    one each way): the holds call Python once, and its answer carries the grant."""
    _, want = reference_logits(aligned_model)
    llm, client = streamed(start_daemon("2MiB"), aligned_model, prefetch="off")
    try:
        assert_bit_equal(greedy_logits(llm, llm.tokenize(PROMPT)), want)
        holds = llm.streamer.holds
        assert holds is not None and holds.layers
        python_layers = llm.streamer.stats.layers  # the layers that reached Python's acquire
        tries = holds.stats().misses + llm.streamer.source.model.local_tries
        assert python_layers > 0 and client.stats()["evictions"] > 0
        assert holds.stats().misses > 0, "the holds tried hits that missed"
        assert tries <= python_layers, f"{tries} hit tries for {python_layers} layers sent on"
        cross = holds.crossings()
        missed, alone = cross["lane_miss"], cross["lane_hit"]
        assert missed.stops == holds.stats().misses > 0
        assert missed.to_python == missed.stops, f"{missed}: one call into Python a missed layer"
        assert missed.from_python == 0, f"{missed}: the answer carries the grant, no call back"
        assert alone.stops > 0 and (alone.to_python, alone.from_python) == (0, 0), alone  # a hit: C alone
        assert cross["failed"].stops == 0 and llm.streamer.held is None  # an idle engine holds nothing
        # Every routed stop under exactly one outcome: each layer of each decode.
        stats = llm.stream_stats()
        per_decode = len(llm.streamer.source.moe_layers)
        assert sum(c["stops"] for c in stats["crossings"].values()) == stats["decodes"] * per_decode
        assert stats["crossings"]["lane_miss"]["stops"] == missed.stops
    finally:
        llm.close()
        client.close()


def test_warm_at_load_maps_what_it_says(start_daemon, reference_logits, aligned_model):
    _, want = reference_logits(aligned_model)
    daemon = start_daemon("64MiB")
    llm, client = streamed(daemon, aligned_model, warm="all")
    try:
        src = llm.streamer.source
        every = len(src.moe_layers) * src.n_experts
        assert llm.stream_stats()["pages_maps"] == every  # read and mapped before any token
        assert_bit_equal(greedy_logits(llm, llm.tokenize(PROMPT)), want)
    finally:
        llm.close()
        client.close()
    # A second engine: the daemon holds every expert now, so "resident" maps them all too.
    llm, client = streamed(daemon, aligned_model, warm="resident")
    try:
        assert llm.stream_stats()["pages_maps"] == every
    finally:
        llm.close()
        client.close()
    with pytest.raises(ValueError, match="warm takes one of off, resident, all"):
        streamed(daemon, aligned_model, warm="yes")


def test_without_local_hits_the_lane_only_maps(start_daemon, reference_logits, aligned_model, monkeypatch):
    monkeypatch.setenv("MOED_LOCAL_HITS", "0")
    _, want = reference_logits(aligned_model)
    got, engine, _ = run_streamed(start_daemon("64MiB"), aligned_model)
    assert_bit_equal(got, want)
    assert engine["lane_layers"] == 0 and engine["pages_maps"] > 0


def test_strict_mode_is_bit_exact_too(start_daemon, reference_logits, aligned_model):
    from moed.engines.llama_cpp import StreamedLlama

    _, want = reference_logits(aligned_model)
    client = start_daemon("2MiB").client("e2e")
    llm = StreamedLlama(str(aligned_model), client=client, strict=True, **LLAMA_KW)
    try:
        assert_bit_equal(greedy_logits(llm, llm.tokenize(PROMPT)), want)
        assert llm.stream_stats()["pages_reprotects"] > 0
    finally:
        llm.close()
        client.close()


def test_a_batch_too_large_for_the_budget_is_split_for_that_call_alone(start_daemon, tiny_model):
    """Issue 47: the call is split (a warning naming the budget), n_batch stays the user's, the
    logits equal the reference fed the same sub-batches, and the next call, which fits, runs
    in one batch at the asked n_batch."""
    from moed.engines.llama_cpp import UnpackedLlama

    # 4 slots of 8 experts: a long prompt batch routes to more than 4 experts per layer.
    d = start_daemon("96KiB")
    llm, client = streamed(d, tiny_model)
    try:
        tokens, split = llm.tokenize(PROMPT), []
        with pytest.warns(RuntimeWarning, match=r"than what the daemon's budget can hold at once .*n_batch stays 64"):
            got = greedy_logits(llm, tokens, steps=8, split=split)
        assert max(split) < LLAMA_KW["n_batch"] and sum(split) == len(tokens), split
        assert llm.n_batch == LLAMA_KW["n_batch"], "a split is for that call alone"
        ref = UnpackedLlama(str(tiny_model), **LLAMA_KW)
        with warnings.catch_warnings():
            want = greedy_logits(ref, tokens, steps=8, batches=split)
        assert np.array_equal(got.argmax(axis=1), want.argmax(axis=1))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
        short = tokens[:2]  # two tokens route to at most 4 experts a layer: one batch
        llm.reset()
        llm.eval(short)
        assert llm.eval_batches == [2]
        ref.reset()
        ref.eval(short)
        np.testing.assert_allclose(llm.scores[:2], ref.scores[:2], rtol=0, atol=1e-4)
        ref.close()
    finally:
        llm.close()
        client.close()


@pytest.mark.parametrize(
    "model", ["aligned_model", "split_model", "gpt_oss_aligned_model"]
)  # gpt-oss: dense bias rows kept
def test_skeleton_load_is_bit_exact_and_holds_no_expert_bytes(request, start_daemon, reference_logits, tmp_path, model):
    import os

    from moed.engines.llama_cpp import StreamedLlama
    from moed.engines.skeleton import expert_ranges

    path = request.getfixturevalue(model)
    _, want = reference_logits(path)
    d = start_daemon()
    client = d.client("e2e")
    llm = StreamedLlama(str(path), client=client, skeleton_dir=tmp_path / "skel", **LLAMA_KW)
    try:
        got = greedy_logits(llm, llm.tokenize(PROMPT))
        skeletons, source = llm.streamer.mapped_files, llm.streamer.source
    finally:
        llm.close()
        client.close()
    assert_bit_equal(got, want)
    for shard, (real, skel) in enumerate(zip(source.files, skeletons)):
        assert os.path.dirname(skel) != os.path.dirname(real)
        assert os.path.getsize(skel) == os.path.getsize(real)
        with open(skel, "rb") as f:
            for lo, hi in expert_ranges(source, shard):
                f.seek(lo)
                assert not any(f.read(hi - lo)), "a skeleton must not hold expert bytes"
    if model != "split_model":  # page-aligned holes are real holes on disk
        st = os.stat(skeletons[0])
        assert st.st_blocks * 512 < st.st_size / 2


def test_default_load_is_a_skeleton_in_the_user_cache(
    start_daemon, aligned_model, reference_logits, monkeypatch, tmp_path
):
    """No skeleton_dir: llama.cpp still loads a skeleton, from $MOED_SKELETON_DIR (this
    llama.cpp MAP_POPULATEs what it maps: the real file would be read whole at load)."""
    from moed.engines.llama_cpp import StreamedLlama

    monkeypatch.setenv("MOED_SKELETON_DIR", str(tmp_path / "cache"))
    _, want = reference_logits(aligned_model)
    d = start_daemon()
    with d.client("e2e") as client:
        llm = StreamedLlama(str(aligned_model), client=client, **LLAMA_KW)
        try:
            got = greedy_logits(llm, llm.tokenize(PROMPT))
            mapped = llm.streamer.mapped_files
        finally:
            llm.close()
    assert_bit_equal(got, want)
    assert len(mapped) == 1 and mapped[0].startswith(str(tmp_path / "cache"))


def test_an_unwritable_skeleton_cache_warns_and_loads_the_real_file(start_daemon, aligned_model, monkeypatch, tmp_path):
    from moed.engines.llama_cpp import StreamedLlama

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("MOED_SKELETON_DIR", str(blocker / "skeletons"))
    d = start_daemon()
    with d.client("e2e") as client:
        with pytest.warns(RuntimeWarning, match="no skeleton of .* loads the real file"):
            llm = StreamedLlama(str(aligned_model), client=client, **LLAMA_KW)
        try:
            assert llm.streamer.mapped_files == list(llm.streamer.source.files)  # the real file
            assert len(greedy_logits(llm, llm.tokenize(PROMPT))) > 0
        finally:
            llm.close()


def test_skeleton_dir_off_loads_the_real_file(start_daemon, aligned_model, monkeypatch, tmp_path):
    from moed.engines.llama_cpp import StreamedLlama

    monkeypatch.setenv("MOED_SKELETON_DIR", str(tmp_path / "cache"))
    d = start_daemon()
    with d.client("e2e") as client:
        llm = StreamedLlama(str(aligned_model), client=client, skeleton_dir="off", **LLAMA_KW)
        try:
            assert llm.streamer.mapped_files == list(llm.streamer.source.files)
            assert len(greedy_logits(llm, llm.tokenize(PROMPT))) > 0
        finally:
            llm.close()
    assert not (tmp_path / "cache").exists()  # nothing was written to the cache


def test_daemon_gone_mid_generation_is_a_typed_error(start_daemon, aligned_model):
    from moed.protocol.errors import DaemonUnavailable

    # A budget that forces misses: experts already resident are served from the
    # engine's own mappings with no daemon (local hits), so only a miss can tell.
    d = start_daemon("2MiB")
    llm, client = streamed(d, aligned_model, reconnect_s=1.0)
    try:
        tokens = llm.tokenize(PROMPT)
        llm.eval(tokens)
        d.kill()
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable, match="did not answer for 1 s"):  # it never comes back
            for _ in range(4):
                llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        assert time.monotonic() - t0 < 10  # the reconnect's bounded wait, never a hang
        assert llm.streamer.held is None
    finally:
        llm.close()
        client.close()


def test_an_architecture_moed_does_not_serve_is_a_typed_error(start_daemon, tmp_path, monkeypatch):
    """The daemon refuses it at open (BadModelFile naming it), before llama.cpp is asked to load it."""
    from moed.modelgen import makemodel
    from moed.protocol.errors import BadModelFile

    monkeypatch.setitem(makemodel.ARCHS, "foomoe", makemodel.ARCHS["qwen3moe"])  # a name llama.cpp does not know
    path = makemodel.make_model(tmp_path / "foo.gguf", arch="foomoe")[0]
    d = start_daemon("64MiB")
    with pytest.raises(BadModelFile, match="architecture 'foomoe' is not one moed serves"):
        streamed(d, path)


def test_per_layer_token_embeddings_are_read_lazily_never_locked(start_daemon, reference_logits, model_factory):
    """Gemma 4's per-layer token embeddings (Qwen3.8's PLE table too: archs.LAZY_TENSORS) are a
    table of which a token reads a few rows: the engine loads with LLAMA_LAZY_MODE_ON (rows
    from the mapping, no anonymous copy) and leaves their pages out of its mlock of the dense
    weights, or a real file would pin gigabytes (26.8 GiB in Qwen3.8-Flash-Next)."""
    from moed.gguf.archs import LAZY_TENSORS
    from moed.gguf.header import read_header

    # 16 layers: the embeddings (16 MiB) are 4x token_embd (4 MiB), and the rest is under 2 MiB
    path = model_factory(arch="gemma4", layers=16, vocab=32768)
    embd = sum(t.n_bytes for t in read_header(path).tensors if t.name in LAZY_TENSORS)
    tokens, want = reference_logits(path)
    daemon = start_daemon("256KiB")
    llm, client = streamed(daemon, path)
    try:
        got = greedy_logits(llm, tokens)
        locked = llm.stream_stats()["dense_locked_bytes"]
        vm_lck = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmLck"))
    finally:
        llm.close()
        client.close()
    assert_bit_equal(got, want)
    assert embd >= 16 << 20
    assert locked < embd // 2, f"{locked} bytes locked: the embeddings' {embd} bytes were locked too"
    assert vm_lck < embd // 2, f"VmLck {vm_lck}: the embeddings' {embd} bytes were locked"
