"""An engine's first start in a fresh process, on the files that aborted it (issue 30).

StreamedLlama aborted inside llama_init_from_model ("pre-allocated tensor ... in a
buffer (CPU_REPACK) that cannot run the operation") on a file `moectl align --repack`
made and on a plain K-quant file with repack="auto", in a new process whose llama_cpp
was imported through another path to the same files (the venv's `lib64 -> lib` link,
a symlinked checkout): moed then opened a second copy of libggml-cpu and gave
llama.cpp's tensors that copy's CPU_REPACK buffers. Each case here starts the engine in
a new interpreter, through a symlinked sys.path and through the plain one, and checks
it bit for bit against stock `llama_cpp.Llama` on the original file: the repacked copy,
and the plain Q4_0 and K-quant files themselves, whose experts the daemon repacks on read
(issue 41).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.e2e.conftest import assert_bit_equal
from tests.e2e.test_repacked_kernels import need_repack, repacked, stock_logits

pytestmark = pytest.mark.e2e
llama_cpp = pytest.importorskip("llama_cpp")

ROOT = Path(__file__).resolve().parents[2]

# Run in a new interpreter: start StreamedLlama, save its logits, print its stats.
ENGINE = """
import json, sys
import numpy as np
import llama_cpp
from moed.client import Client
from moed.engines.llama_cpp import StreamedLlama
from tests.e2e.conftest import LLAMA_KW, greedy_logits

sock, model, out, tokens, via = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), sys.argv[5]
assert llama_cpp.__file__.startswith(via), (llama_cpp.__file__, via)  # the path the case is about
client = Client(sock, "start")
llm = StreamedLlama(model, client=client, **LLAMA_KW)
np.save(out, greedy_logits(llm, tokens))
print(json.dumps(llm.stream_stats()))
llm.close()
client.close()
"""


def start_engine(daemon, model, tokens, tmp_path, *, symlinked: bool) -> tuple[np.ndarray, dict]:
    """The engine's logits and stream_stats from a new interpreter; `symlinked`: llama_cpp is
    imported through a symlink to its site-packages (the path that loaded a second ggml)."""
    site = Path(llama_cpp.__file__).resolve().parents[1]
    if symlinked:
        via = tmp_path / "site-link"
        via.symlink_to(site, target_is_directory=True)
    else:
        via = site
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(via), str(ROOT)])}
    out = tmp_path / "logits.npy"
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE, daemon.socket, str(model), str(out), json.dumps(tokens), str(via)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, f"engine process: rc {proc.returncode}\n{proc.stderr[-3000:]}"
    return np.load(out), json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("symlinked", [True, False], ids=["symlinked-path", "plain-path"])
def test_a_repacked_file_starts_and_matches_stock(symlinked, model_factory, tmp_path, start_daemon):
    src = model_factory(layers=4, experts=16, used=4, embd=512, ff=256, quant="q4_0", align=4096)
    need_repack(src)
    tokens, want = stock_logits(src)
    daemon = start_daemon("4MiB")  # 18 slots of 216 KiB: a prompt batch's 16 experts of a layer fit
    got, engine = start_engine(daemon, repacked(src, tmp_path), tokens, tmp_path, symlinked=symlinked)
    assert_bit_equal(got, want)
    assert engine["expert_layout"] != "plain"
    assert daemon.client("check").stats()["evictions"] > 0, "the budget must force eviction"


PLAIN_FILES = {
    # name: (make_model kwargs, budget): every batch's experts fit, and it evicts
    "q4_k_m": (dict(embd=512, ff=256, recipe="q4_k_m", align=4096), "3MiB"),  # 12 slots of ~250 KiB of 32
    "q4_0": (dict(layers=4, experts=16, used=4, embd=512, ff=256, quant="q4_0", align=4096), "4MiB"),
}


@pytest.mark.parametrize(
    "name, symlinked",
    [("q4_k_m", True), ("q4_k_m", False), ("q4_0", False)],
    ids=["q4_k_m-symlinked-path", "q4_k_m-plain-path", "q4_0-plain-path"],
)
def test_a_plain_file_starts_repacked_on_read_and_matches_stock(name, symlinked, model_factory, tmp_path, start_daemon):
    """The file people download, as they run it: the engine in a new process computes every
    weight as stock does (experts this CPU repacks made so on read by the daemon, issue 41)."""
    from moed.engines import kernels
    from tests.e2e.test_repacked_kernels import expected_layout

    kwargs, budget = PLAIN_FILES[name]
    src = model_factory(**kwargs)
    tokens, want = stock_logits(src)
    daemon = start_daemon(budget)
    got, engine = start_engine(daemon, src, tokens, tmp_path, symlinked=symlinked)
    assert_bit_equal(got, want)
    layout = expected_layout(src)  # plain where this CPU repacks none of the expert types
    stats = daemon.client("check").stats()
    assert engine["expert_layout"] == layout == stats["models"][0]["expert_layout"]
    assert stats["models"][0]["repack_on_read"] == (layout != "plain") == (stats["repacked_bytes"] > 0)
    if name == "q4_k_m" and kernels.layout_of(kernels.Q4_K, (512, 256)) != kernels.PLAIN:
        assert engine["dense_repacked_tensors"] > 0, "the K-quant attention must be on CPU_REPACK, as stock puts it"
    assert stats["evictions"] > 0, "the budget must force eviction"


def test_moed_reaches_the_ggml_llama_cpp_runs_whatever_path_imported_it(tmp_path):
    """The library handles kernels.py uses are libllama's own copies, found from libllama, not by path."""
    site = Path(llama_cpp.__file__).resolve().parents[1]
    via = tmp_path / "site-link"
    via.symlink_to(site, target_is_directory=True)
    script = (
        "import ctypes, llama_cpp\n"
        "from llama_cpp import llama_cpp as b\n"
        "from moed.engines.ggml_api import loaded_library\n"
        "for stem, sym in (('ggml-cpu', 'ggml_backend_cpu_reg'), ('ggml-base', 'ggml_init')):\n"
        "    lib = loaded_library(stem)\n"
        "    a = ctypes.cast(getattr(lib, sym), ctypes.c_void_p).value\n"
        "    w = ctypes.cast(getattr(b._lib, sym), ctypes.c_void_p).value\n"
        "    assert a == w, (stem, hex(a), hex(w))\n"
        "    print(stem, lib._name)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(via), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert names["ggml-cpu"].endswith("libggml-cpu.so.0"), names  # the copy libllama links
