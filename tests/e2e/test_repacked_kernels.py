"""StreamedLlama on stock llama.cpp's repacked CPU kernels, bit for bit against stock.

A file made by `moectl align --repack` holds its experts in the layout this CPU's
llama.cpp computes on; StreamedLlama(repack="auto") then runs every weight on the
kernels stock `llama_cpp.Llama` picks for the original file, so the logits of a
prompt batch and greedy steps must equal stock's exactly, at budgets that evict.
Types this CPU does not repack are skipped with the reason (ggml repacks Q4_0,
Q4_K, IQ4_NL and MXFP4 on AVX2 and NEON hosts; the test names which ran).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.e2e.conftest import LLAMA_KW, PROMPT, assert_bit_equal, greedy_logits

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")


def repacked(path, out_dir) -> str:
    """`moectl align --repack path OUT`, through the CLI a user runs; the first shard's path."""
    proc = subprocess.run(
        [sys.executable, "-m", "moed.ctl", "align", "--repack", str(path), os.path.join(out_dir, "repacked.gguf")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "experts repacked:" in proc.stderr
    return proc.stdout.splitlines()[0]


def stock_logits(path) -> tuple[list[int], np.ndarray]:
    import llama_cpp

    llm = llama_cpp.Llama(str(path), **LLAMA_KW)
    try:
        tokens = llm.tokenize(PROMPT)
        return tokens, greedy_logits(llm, tokens)
    finally:
        llm.close()


def streamed_logits(daemon, path, tokens, **kw) -> tuple[np.ndarray, dict, dict]:
    from moed.engines.llama_cpp import StreamedLlama

    client = daemon.client("e2e")
    llm = StreamedLlama(str(path), client=client, **{**LLAMA_KW, **kw})
    try:
        return greedy_logits(llm, tokens), llm.stream_stats(), client.stats()
    finally:
        llm.close()
        client.close()


def need_repack(path) -> None:
    """Skip when this CPU's llama.cpp repacks none of the file's expert types."""
    from moed.engines import kernels

    if expected_layout(path) == kernels.PLAIN:
        pytest.skip(
            f"this CPU's llama.cpp repacks none of this model's expert types ({kernels.cpu_backend().features()})"
        )


def expected_layout(path) -> str:
    """What the engine should report: each expert type's layout on this CPU (Q6_K stays plain on x86)."""
    from moed.engines import kernels
    from moed.gguf.catalog import Catalog
    from moed.gguf.layouts import summary

    cat = Catalog.open(path)
    layouts = {
        p.type_name: kernels.layout_of(p.ggml_type, p.shape[:2]) for e in cat.layers.values() for p in e.parts.values()
    }
    return summary({t: v for t, v in layouts.items() if v != kernels.PLAIN}, layouts)


MODELS = {
    # name: (make_model kwargs, budget, which path the experts take)
    "q4_0-copy": (dict(quant="q4_0"), "96KiB", "copy"),  # 2304-byte parts: the copy path, evicting
    "q4_0-zero-copy": (dict(quant="q4_0", embd=256, ff=256), "1MiB", "zero_copy"),  # 9-page parts
    "q4_0-split": (dict(quant="q4_0", split=3), "96KiB", "copy"),
    "q4_k_m": (dict(embd=256, ff=256, recipe="q4_k_m"), "1MiB", "mixed"),  # Q4_K gate/up, Q6_K down, Q4_K attention
    "gpt-oss-mxfp4": (dict(arch="gpt-oss", embd=256, ff=512), "2MiB", "zero_copy"),
    "olmoe-q4_0": (dict(arch="olmoe", quant="q4_0"), "96KiB", "copy"),
    "qwen2moe-q4_0": (dict(arch="qwen2moe", quant="q4_0"), "96KiB", "copy"),  # shared expert dense
    "deepseek2-q4_0": (dict(arch="deepseek2", quant="q4_0"), "96KiB", "copy"),  # MLA, leading dense layer
    "mixtral-q4_0": (dict(arch="llama", quant="q4_0"), "96KiB", "copy"),
    "glm4moe-q4_0": (dict(arch="glm4moe", quant="q4_0"), "96KiB", "copy"),
    # DeltaNet and gated attention in Q4_K: ssm_out, attn_qkv, attn_gate (and qwen3next's 8-row ssm_ba) on
    # CPU_REPACK as stock puts them; each fails without its name in archs.DENSE_MATMUL_NAMES (checked by hand)
    "qwen35moe-q4_k_m": (dict(arch="qwen35moe", embd=256, ff=256, recipe="q4_k_m"), "1MiB", "mixed"),
    "qwen3next-q4_k_m": (dict(arch="qwen3next", embd=256, ff=256, recipe="q4_k_m"), "1MiB", "mixed"),  # ssm_ba
    # fused gate_up experts; per_layer_model_proj (model-level) and inp_gate on CPU_REPACK as stock puts
    # them (its log's "repack tensor" list); here their plain and repacked results happen to be equal
    "gemma4-q4_k_m": (dict(arch="gemma4", embd=256, ff=256, recipe="q4_k_m"), "1MiB", "mixed"),
    # hyper-connection down/inject (per layer and output_hc_down), ple_key/ple_value, the QSA indexer's
    # q/k projections in Q4_K, on CPU_REPACK where stock puts them
    "qwen4exp-q4_k_m": (dict(arch="qwen4exp", embd=256, ff=256, recipe="q4_k_m"), "1MiB", "mixed"),
    # MLA-like q latent, attn_kv, attn_output_b, compressor and indexer matrices in Q4_K on CPU_REPACK as stock
    # puts them (attn_output_a is 3-D once loaded: plain in both); hash-routed layer 0
    "deepseek4-q4_k_m": (dict(arch="deepseek4", embd=256, ff=256, recipe="q4_k_m"), "1MiB", "mixed"),
    # ungated shared expert beside the routed ones; the look-ahead's first node is ffn_inp-L (no norm)
    "llama4-q4_k_m": (dict(arch="llama4", embd=256, ff=256, recipe="q4_k_m"), "1MiB", "mixed"),
    # leading dense ffn_{gate,up,down} and shared experts on CPU_REPACK (dots1: MHA; bailingmoe2: fused attn_qkv)
    "dots1-q4_k_m": (dict(arch="dots1", embd=256, ff=256, recipe="q4_k_m"), "1MiB", "mixed"),
    "ernie4_5-moe-q4_k_m": (dict(arch="ernie4_5-moe", embd=256, ff=256, recipe="q4_k_m"), "1MiB", "mixed"),
    "hunyuan-moe-q4_k_m": (dict(arch="hunyuan-moe", embd=256, ff=256, recipe="q4_k_m"), "1MiB", "mixed"),
    "bailingmoe2-q4_k_m": (dict(arch="bailingmoe2", embd=256, ff=256, recipe="q4_k_m"), "1MiB", "mixed"),
    "minimax-m2-q4_k_m": (dict(arch="minimax-m2", embd=256, ff=256, recipe="q4_k_m"), "1MiB", "mixed"),
    # MLA q latent, kv_a_mqa, output and the lightning indexer's attn_q_b, attn_k, proj (8 rows) in Q4_K on
    # CPU_REPACK as stock puts them (attn_k_b / attn_v_b are 3-D: plain in both); 16 experts, so that
    # Q4_K_M's 8-expert rule (attn_k, which indexer.attn_k matches, in Q8_0) is not taken, as in the real 256
    "glm-dsa-q4_k_m": (dict(arch="glm-dsa", embd=256, ff=256, experts=16, recipe="q4_k_m"), "2MiB", "mixed"),
    # KDA's q/k/v, ssm_f_a, ssm_g, ssm_beta, attn_output and MLA's q latent, kv_a_mqa, attn_gate in Q4_K
    # on CPU_REPACK as stock puts them, the latent MoE's ffn_routed_down/up too (the experts are 256 x 256)
    "kimi-k3-q4_k_m": (dict(arch="kimi-k3", embd=256, ff=256, recipe="q4_k_m"), "1MiB", "mixed"),
    # GQA, leading dense and shared swigluoai FFNs on CPU_REPACK; the MSA indexer's q/k projections stay F32
    "minimax-m3-q4_k_m": (dict(arch="minimax-m3", embd=256, ff=256, recipe="q4_k_m"), "1MiB", "mixed"),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_repacked_file_is_bit_exact_with_stock(name, model_factory, tmp_path, start_daemon):
    kwargs, budget, path_kind = MODELS[name]
    src = model_factory(**kwargs)
    need_repack(src)
    tokens, want = stock_logits(src)
    got, engine, stats = streamed_logits(start_daemon(budget), repacked(src, tmp_path), tokens)
    assert_bit_equal(got, want)
    assert engine["expert_layout"] != "plain"
    assert stats["evictions"] > 0, "the budget must force eviction"
    if path_kind == "zero_copy":
        assert engine["pages_maps"] > 0 and engine["pages_copies"] == 0
    if path_kind == "copy":
        assert engine["pages_copies"] > 0
    assert engine["expert_layout"] == expected_layout(src)
    if name == "q4_k_m":
        from moed.engines import kernels

        # the Q4_K attention goes to CPU_REPACK, as stock's does
        assert (engine["dense_repacked_tensors"] > 0) == (kernels.layout_of(kernels.Q4_K, (256, 256)) != "plain")


def test_repack_dense_keeps_a_plain_files_experts_plain(q4_k_m_model, start_daemon):
    """repack="dense": dense weights as stock places them, experts plain (no repack on read);
    the same as UnpackedLlama(repack="dense")."""
    from moed.engines import kernels
    from moed.engines.llama_cpp import UnpackedLlama

    ref = UnpackedLlama(str(q4_k_m_model), repack="dense", **LLAMA_KW)
    tokens = ref.tokenize(PROMPT)
    want = greedy_logits(ref, tokens)
    ref.close()
    got, engine, stats = streamed_logits(start_daemon("1MiB"), q4_k_m_model, tokens, repack="dense")
    assert_bit_equal(got, want)
    assert engine["expert_layout"] == "plain"
    assert stats["models"][0]["expert_layout"] == "plain" and stats["repacked_bytes"] == 0
    if kernels.layout_of(kernels.Q4_K, (256, 256)) != kernels.PLAIN:
        assert engine["dense_repacked_tensors"] > 0 and "q4_K_8x8" in engine["dense_layouts"]


def test_repack_off_is_still_the_plain_kernels(q4_k_m_model, reference_logits, start_daemon):
    from tests.e2e.conftest import plain_reference_logits

    tokens, want = plain_reference_logits(q4_k_m_model)
    got, engine, _ = streamed_logits(start_daemon("1MiB"), q4_k_m_model, tokens, repack="off")
    assert_bit_equal(got, want)
    assert engine["expert_layout"] == "plain" and engine["dense_repacked_tensors"] == 0


def test_two_engine_processes_share_the_repacked_slots(model_factory, tmp_path, start_daemon):
    """Two engines on one repacked file: one copy of each expert serves both, both exact."""
    src = model_factory(quant="q4_0", embd=256, ff=256)
    need_repack(src)
    path = repacked(src, tmp_path)
    tokens, want = stock_logits(src)
    d = start_daemon("64MiB")
    code = (
        "import sys, numpy as np\n"
        "from tests.e2e.conftest import LLAMA_KW, greedy_logits\n"
        "from moed.engines.llama_cpp import StreamedLlama\n"
        "from moed.client import Client\n"
        f"c = Client({d.socket!r}, 'worker')\n"
        f"llm = StreamedLlama({path!r}, client=c, **LLAMA_KW)\n"
        f"np.save(sys.argv[1], greedy_logits(llm, {tokens!r}))\n"
        "assert llm.stream_stats()['expert_layout'] != 'plain'\n"
        "llm.close(); c.close()\n"
    )
    outs = [str(tmp_path / f"w{k}.npy") for k in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", code, o], cwd=os.getcwd()) for o in outs]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    for o in outs:
        assert_bit_equal(np.load(o), want)
    with d.client("check") as c:
        s = c.stats()
        assert len(s["models"]) == 1 and s["models"][0]["expert_layout"] != "plain"
        # one copy: the two engines read no more experts than the model has
        n_experts = 8 * 4
        assert s["models"][0]["resident_experts"] <= n_experts


def test_a_file_repacked_for_another_layout_is_refused(model_factory, tmp_path, start_daemon):
    """Metadata naming a layout this CPU does not compute on: LayoutUnavailable, nothing served."""
    from moed.engines.llama_cpp import StreamedLlama
    from moed.gguf.align import Transform, align_gguf
    from moed.gguf.layouts import KEY_CPU, KEY_LAYOUTS
    from moed.protocol.errors import LayoutUnavailable

    src = model_factory(quant="q4_0")
    foreign = str(tmp_path / "foreign.gguf")
    # An ARM host's layout for Q4_0 with i8mm; bytes left as they are (never read).
    align_gguf(src, foreign, transform=Transform(lambda t: None, {KEY_LAYOUTS: ["Q4_0=q4_0_4x8"], KEY_CPU: "aarch64"}))
    d = start_daemon("1MiB")
    with d.client("e2e") as client:
        with pytest.raises(LayoutUnavailable, match="q4_0_4x8.*aarch64"):
            StreamedLlama(foreign, client=client, **LLAMA_KW)
        with pytest.raises(LayoutUnavailable, match="repack='auto'"):
            StreamedLlama(foreign, client=client, repack="off", **LLAMA_KW)
        with pytest.raises(LayoutUnavailable, match="repack='auto'"):
            StreamedLlama(foreign, client=client, repack="dense", **LLAMA_KW)
        # the daemon refuses a layout it cannot give, whoever asks (it makes q4_0_8x8 of Q4_0 on read)
        with pytest.raises(LayoutUnavailable, match="its experts are plain.*no expert is Q4_K"):
            client.open_model(src, expert_layout="q4_K_8x8")
        assert client.stats()["tenants"][0]["leases"] == 0


def test_a_repacked_file_cannot_be_repacked_again(model_factory, tmp_path):
    src = model_factory(quant="q4_0")
    need_repack(src)
    once = repacked(src, tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "moed.ctl", "align", "--repack", once, str(tmp_path / "twice.gguf")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "repacked already" in proc.stderr


@pytest.mark.parametrize("pinned", [False, True], ids=["evicting", "whole-steps"])
def test_prefetch_off_engine_switches_its_experts_before_the_lane_takes_a_layer(
    model_factory, tmp_path, start_daemon, pinned
):
    """With prefetch off and no hook, nothing runs in Python at a topk once the lane takes
    layers alone; the repacked experts are switched to their kernels at the first node
    Python sees, so the lane (and whole steps) must wait for that first node."""
    src = model_factory(quant="q4_0", embd=256, ff=256)
    need_repack(src)
    tokens, want = stock_logits(src)
    from moed.engines.llama_cpp import StreamedLlama
    from moed.testing import wait_for

    daemon = start_daemon("1MiB", "--pin-budget", "64MiB") if pinned else start_daemon("1MiB")
    client = daemon.client("e2e")
    llm = StreamedLlama(repacked(src, tmp_path), client=client, prefetch="off", **LLAMA_KW)
    try:
        if pinned:
            wait_for(llm.streamer.source.model.all_pinned, what="the mirror to pin the model whole")
        assert_bit_equal(greedy_logits(llm, tokens), want)
        engine = llm.stream_stats()
    finally:
        llm.close()
        client.close()
    assert engine["expert_layout"] == expected_layout(src)
    if pinned:  # the first decode switches the experts (Python sees its first node); then no stop
        assert engine["whole_decodes"] == engine["decodes"] - 1 and engine["lane_layers"] == engine["layers"]
    else:
        assert engine["lane_layers"] > 0 and engine["whole_decodes"] == 0
