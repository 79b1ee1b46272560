"""Repack on read (issue 41): a plain file's experts made by the daemon in the layout this CPU's
llama.cpp computes on, checked against ggml itself.

- Bytes: every layout moed.gguf.interleave makes (with its C moves and with numpy's)
  equals ggml's repack of the same bytes, through ggml's own code: the repack member of ggml's `tensor_traits` for that layout
  (exported by libggml-cpu, so every layout is checked on any CPU), and, for the layouts
  this CPU's ggml chooses, a CPU_REPACK tensor's `ggml_backend_tensor_set` (what stock's
  load does).
- Logits: StreamedLlama(repack="auto") on the plain file, at a budget that evicts, equals
  stock `llama_cpp.Llama` on that file bit for bit (stock repacks at load); the daemon
  serves those experts from slots of their own, apart from an engine that asks for the
  plain layout of the same file.
Cases where this CPU repacks none of a model's expert types are skipped with the reason.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.e2e.conftest import LLAMA_KW, assert_bit_equal, greedy_logits
from tests.e2e.test_repacked_kernels import expected_layout, need_repack, stock_logits, streamed_logits

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")

# ---- bytes, against ggml ------------------------------------------------------------------


def traits_symbol(layout) -> str:
    """The mangled name of ggml's tensor_traits<block, chunk, rows, vec_dot type>::repack."""
    block = f"block_{layout.block.prefix}"
    vec_dot = 15 if layout.block.per_block == 256 else 8  # GGML_TYPE_Q8_K for K-quants, Q8_0 otherwise
    return (
        f"_ZN4ggml3cpu6repack13tensor_traitsI{len(block)}{block}Ll{layout.chunk}ELl{layout.rows}E"
        f"L9ggml_type{vec_dot}EE6repackEP11ggml_tensorPKvm"
    )


def ggml_traits_repack(layout, plain: bytes, ne0: int, ne1: int) -> bytes:
    """ggml's own repack code for `layout`, whichever this CPU would choose: the traits' member
    (`repack(ggml_tensor *, const void *, size_t)`, which reads nothing of `this`) on a tensor
    of a plain CPU context."""
    from moed.engines.ggml_api import GgmlInitParams, GgmlTensor, api, loaded_library

    g = api()
    try:
        fn = getattr(loaded_library("ggml-cpu"), traits_symbol(layout))
    except AttributeError:
        pytest.skip(f"this libggml-cpu exports no repack for {layout.name}")
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    ctx = g.ggml_init(GgmlInitParams(len(plain) + 4096 + g.ggml_tensor_overhead(), None, False))
    try:
        t = g.ggml_new_tensor(ctx, layout.ggml_type, 4, (ctypes.c_int64 * 4)(ne0, ne1, 1, 1))
        view = GgmlTensor.from_address(t)
        assert view.nb[3] == len(plain)
        assert fn(None, t, plain, len(plain)) == 0
        return ctypes.string_at(view.data, len(plain))
    finally:
        g.ggml_free(ctx)


def layouts():
    from moed.gguf import interleave

    return list(interleave.LAYOUTS)


def shapes(layout) -> list[tuple[int, int]]:
    """(ne0, ne1) per expert: one and several blocks per row, one and several row groups."""
    per = layout.block.per_block
    return [(per, layout.rows), (per * 3, layout.rows * 2), (max(per, 256) * 2, layout.rows * 5)]


@pytest.mark.parametrize("name", layouts())
@pytest.mark.parametrize("native", [True, False], ids=["c", "numpy"])
def test_every_layout_is_ggmls_repack(name, native):
    from moed.engines import kernels
    from moed.gguf import interleave

    if native and interleave.native_moves is None:
        pytest.skip("moed._interleave is not built (scripts/setup-venv builds it)")
    lay = interleave.LAYOUTS[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    for ne0, ne1 in shapes(lay):
        n = ne1 * ne0 // lay.block.per_block * lay.block.block_bytes
        plain = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        out = bytearray(n)
        interleave.transform(lay, plain, out, ne0, ne1, native=native)
        assert bytes(out) == ggml_traits_repack(lay, plain, ne0, ne1), (name, ne0, ne1)
        if kernels.layout_of(lay.ggml_type, (ne0, ne1)) == name:  # this CPU's choice: stock's own path
            rp = kernels.Repacker(lay.ggml_type, ne0, ne1)
            try:
                assert bytes(out) == rp(plain), (name, ne0, ne1)
            finally:
                rp.close()


def test_this_cpus_layouts_are_all_made_on_read():
    """Every layout this CPU's ggml computes an expert type on is one the daemon makes."""
    from moed.engines import kernels
    from moed.gguf import interleave

    chosen = {kernels.layout_of(t, (256, 64)) for t in interleave.TYPES} - {kernels.PLAIN}
    assert chosen <= set(interleave.LAYOUTS), chosen - set(interleave.LAYOUTS)


# ---- logits, against stock ------------------------------------------------------------------

MODELS = {
    # name: (make_model kwargs, budget, which path the experts take)
    "q4_0-copy": (dict(quant="q4_0"), "96KiB", "copy"),  # 2304-byte parts
    "q4_0-zero-copy": (dict(quant="q4_0", embd=256, ff=256, align=4096), "1MiB", "zero_copy"),  # 9-page parts
    "q4_0-split": (dict(quant="q4_0", split=3), "96KiB", "copy"),
    "q4_k_m": (dict(embd=256, ff=256, recipe="q4_k_m"), "1MiB", "mixed"),  # Q4_K gate/up, Q6_K down in 2 layers
    "gpt-oss-mxfp4": (dict(arch="gpt-oss", embd=256, ff=512, align=4096), "2MiB", "zero_copy"),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_a_plain_file_is_bit_exact_with_stock(name, model_factory, start_daemon):
    kwargs, budget, path_kind = MODELS[name]
    src = model_factory(**kwargs)
    need_repack(src)
    tokens, want = stock_logits(src)
    got, engine, stats = streamed_logits(start_daemon(budget), src, tokens)
    assert_bit_equal(got, want)
    layout = expected_layout(src)
    assert engine["expert_layout"] == layout
    (row,) = stats["models"]
    assert row["expert_layout"] == layout and row["repack_on_read"]
    assert stats["repacked_bytes"] > 0 and stats["evictions"] > 0, "the budget must force eviction"
    if path_kind == "zero_copy":
        assert engine["pages_maps"] > 0 and engine["pages_copies"] == 0
    if path_kind == "copy":
        assert engine["pages_copies"] > 0


ENGINE = (
    "import sys, numpy as np\n"
    "from tests.e2e.conftest import LLAMA_KW, greedy_logits\n"
    "from moed.engines.llama_cpp import StreamedLlama\n"
    "from moed.client import Client\n"
    "sock, path, out, repack, tokens = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], eval(sys.argv[5])\n"
    "c = Client(sock, 'worker')\n"
    "llm = StreamedLlama(path, client=c, repack=repack, **LLAMA_KW)\n"
    "np.save(out, greedy_logits(llm, tokens))\n"
    "llm.close(); c.close()\n"
)


def test_engines_share_the_layout_and_plain_is_apart(model_factory, tmp_path, start_daemon):
    """Two engine processes on the plain file (repack="auto") share one model whose experts are
    made on read; a third asking for plain experts (repack="dense") gets a model of its own,
    with the file's bytes. Each is exact against its own reference."""
    from moed.engines.llama_cpp import UnpackedLlama

    src = model_factory(quant="q4_0", embd=256, ff=256)
    need_repack(src)
    tokens, want = stock_logits(src)
    ref = UnpackedLlama(str(src), repack="dense", **LLAMA_KW)
    want_plain = greedy_logits(ref, tokens)
    ref.close()
    assert not np.array_equal(want, want_plain)  # the kernels differ: each reference tells them apart
    d = start_daemon("64MiB")
    runs = [("auto", want), ("auto", want), ("dense", want_plain)]
    outs = [str(tmp_path / f"w{k}.npy") for k in range(len(runs))]
    procs = [
        subprocess.Popen([sys.executable, "-c", ENGINE, d.socket, str(src), o, repack, repr(tokens)], cwd=os.getcwd())
        for o, (repack, _) in zip(outs, runs)
    ]
    assert [p.wait(timeout=300) for p in procs] == [0] * len(runs)
    for o, (_, expected) in zip(outs, runs):
        assert_bit_equal(np.load(o), expected)
    with d.client("check") as c:
        rows = {r["expert_layout"]: r for r in c.stats()["models"]}
    assert set(rows) == {expected_layout(src), "plain"}
    made, plain = rows[expected_layout(src)], rows["plain"]
    assert made["repack_on_read"] and not plain["repack_on_read"] and made["model_id"] != plain["model_id"]
    n_experts = 8 * 4  # one copy of each expert for the two engines that share: no more than the model has
    assert made["resident_experts"] <= n_experts and plain["resident_experts"] <= n_experts


def test_stats_name_the_layout_made_on_read(model_factory, start_daemon):
    """`moectl stats` (the table a user reads) shows the layout and that it is made on read."""
    from moed.client import Client

    src = model_factory(quant="q4_0")
    need_repack(src)
    d = start_daemon("1MiB")
    with Client(d.socket, "e2e") as c:
        c.open_model(str(src), expert_layout=expected_layout(src))
        proc = subprocess.run(
            [sys.executable, "-m", "moed.ctl", "--socket", d.socket, "stats"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "COLUMNS": "250"},
        )
    assert proc.returncode == 0, proc.stderr
    assert f"{expected_layout(src)} (made on read)" in proc.stdout
    # the repack line: what was made on read, and the cache on disk (issue 49)
    assert "made on read (" in proc.stdout and " written, " in proc.stdout


def test_a_restarted_daemon_serves_its_repack_cache_bit_exact(model_factory, tmp_path):
    """The repack cache (issue 49): an engine process on a plain file through a daemon that
    makes and caches its experts, then another through a new daemon on the same cache (a
    restart): the second reads experts from the cache instead of transforming them, and both
    equal stock bit for bit. The budget evicts, so the first daemon reads from its cache too."""
    import tempfile

    from moed.testing import DaemonProcess, wait_for

    src = model_factory(quant="q4_0")
    need_repack(src)
    tokens, want = stock_logits(src)
    sock_dir = tempfile.mkdtemp(prefix="moed-", dir="/tmp")  # the daemons' cache lives in it
    try:
        seen = []
        for run in range(2):
            d = DaemonProcess("96KiB", socket_dir=sock_dir)
            try:
                out = str(tmp_path / f"r{run}.npy")
                cmd = [sys.executable, "-c", ENGINE, d.socket, str(src), out, "auto", repr(tokens)]
                assert subprocess.run(cmd, cwd=os.getcwd(), timeout=300).returncode == 0
                assert_bit_equal(np.load(out), want)
                with d.client("check") as c:
                    if run == 0:
                        wait_for(lambda: c.stats()["repack_cache_writes"] > 0, 30, what="experts cached")
                    seen.append(c.stats())
                assert d.stop() == 0  # SIGTERM: what is queued is written, the index saved
            finally:
                d.close()
        first, second = seen
        assert first["repacked_bytes"] > 0 and first["repack_cache_writes"] > 0
        assert second["repack_cache_reads"] > 0 and second["repacked_bytes"] < first["repacked_bytes"]
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
