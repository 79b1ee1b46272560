"""The GPU hybrid: dense layers on a Vulkan device, the routed experts on the CPU from moed.

StreamedLlama(n_gpu_layers=N) loads as llama.cpp's `--n-cpu-moe` does: the last N
layers' dense weights (and the output) in the device's memory, every routed expert
overridden to the CPU (`-ot exps=CPU`) and served from moed's slots, op offload off.
The router's top-k and the predictor's norm rows of an offloaded layer are in the
device's memory and are read through ggml's backend API (moed.engines.ggml_tensor).

Checked bit for bit against stock `llama_cpp.Llama` with the same n_gpu_layers, the
same override and op offload off (moed.engines.llama_cpp.StockLlama), at an evicting
budget, on the same device: lavapipe, Mesa's software Vulkan device, here and in CI
(GGML_VK_VISIBLE_DEVICES=0 makes ggml use a CPU-type device). Vulkan's op fusion is
off in both (GGML_VK_DISABLE_FUSION=1): the engine's callback must see the top-k, so
the device computes the graph in pieces split there, and stock's fused kernels across
those nodes round differently (max |diff| about 1e-6, measured).

Every engine runs in a new interpreter: the device must be chosen before llama.cpp
first enumerates its backends, and a test process never computes with llama.cpp.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.e2e.conftest import ROOT, VULKAN_ENV, assert_bit_equal

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")


# Run in a new interpreter: one engine's logits of a prompt and greedy steps, and its stats.
ENGINE = """
import json, sys
import numpy as np
from moed.engines.llama_cpp import StockLlama, StreamedLlama
from tests.e2e.conftest import LLAMA_KW, PROMPT, greedy_logits

which, model, out, n_gpu, sock = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
kw = {**LLAMA_KW, "n_gpu_layers": n_gpu}
if which == "stock":
    llm, client = StockLlama(model, **kw), None
else:
    from moed.client import Client
    client = Client(sock, "gpu-hybrid")
    llm = StreamedLlama(model, client=client, **kw)
np.save(out, greedy_logits(llm, llm.tokenize(PROMPT), steps=8))
stats = llm.stream_stats() if which == "streamed" else {}
if client is not None:  # what the daemon shows for this engine (moectl stats' engines table)
    stats["engines"] = [what for c in client.stats()["clients"] for _, what in c["engines"]]
print(json.dumps(stats))
llm.close()
if client is not None:
    client.close()
"""


def run_engine(which: str, model, tmp_path, n_gpu: int, socket: str = "") -> tuple[np.ndarray, dict]:
    out = tmp_path / f"{which}-{n_gpu}.npy"
    env = {**os.environ, **VULKAN_ENV, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE, which, str(model), str(out), str(n_gpu), socket],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, f"{which} engine: rc {proc.returncode}\n{proc.stderr[-3000:]}"
    return np.load(out), json.loads(proc.stdout.strip().splitlines()[-1])


def plain_experts(path) -> None:
    """Skip where this CPU's llama.cpp would repack the experts stock keeps on the CPU (ARM: Q8_0):
    stock's `-ot exps=CPU` then computes them on repacked kernels, the engine on the plain ones."""
    from tests.e2e.test_repacked_kernels import expected_layout

    if expected_layout(path) != "plain":
        pytest.skip(f"this CPU repacks the experts' type ({expected_layout(path)}): stock computes them repacked")


@pytest.mark.parametrize(
    "n_gpu, aligned",
    [(99, False), (2, False), (99, True)],
    ids=["every-layer-copy-path", "last-layer-and-output", "every-layer-zero-copy"],
)
def test_dense_on_the_gpu_experts_from_moed_match_stock_with_the_same_offload(
    vulkan_device, model_factory, start_daemon, tmp_path, n_gpu, aligned
):
    from moed.modelgen.makemodel import aligned_geometry

    model = model_factory(**aligned_geometry()) if aligned else model_factory()
    plain_experts(model)
    want, _ = run_engine("stock", model, tmp_path, n_gpu)
    daemon = start_daemon("2MiB" if aligned else "256KiB")  # 10 aligned slots of 32; ~19 plain of 32
    got, stats = run_engine("streamed", model, tmp_path, n_gpu, daemon.socket)
    assert_bit_equal(got, want)
    dev = stats["devices"]
    assert dev["gpu"] == vulkan_device and dev["experts"] == "CPU"
    n_layer = 4
    assert dev["gpu_layers"] == ([0, n_layer - 1] if n_gpu > n_layer else [n_layer + 1 - n_gpu, n_layer - 1])
    first = dev["gpu_layers"][0]
    assert stats["engines"] == [
        f"experts on the CPU; layers {first}-{n_layer - 1} and the output layer on {vulkan_device}"
    ]
    # The top-k of an offloaded layer is in the device's memory: the holds read it through
    # ggml's backend, so an aligned model's layers (relaxed zero copy) keep the lane.
    assert (stats["lane_layers"] > 0) == aligned, stats["crossings"]
    assert daemon.client("check").stats()["evictions"] > 0, "the budget must force eviction"


def test_without_a_gpu_device_n_gpu_layers_warns_and_runs_on_the_cpu(model_factory, start_daemon, tmp_path):
    """No device visible (lavapipe is a CPU-type device ggml skips unless named): the engine
    says so and computes everything on the CPU, bit-exact with resident llama.cpp."""
    model = model_factory()
    script = ENGINE.replace(
        'kw = {**LLAMA_KW, "n_gpu_layers": n_gpu}',
        'kw = {**LLAMA_KW, "n_gpu_layers": n_gpu}\nimport warnings\nwarnings.simplefilter("error")',
    )
    daemon = start_daemon("256KiB")
    env = {k: v for k, v in os.environ.items() if k != "GGML_VK_VISIBLE_DEVICES"}
    proc = subprocess.run(
        [sys.executable, "-c", script, "streamed", str(model), str(tmp_path / "x.npy"), "99", daemon.socket],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert proc.returncode != 0 and "sees no GPU device" in proc.stderr, proc.stderr[-2000:]


def test_moectl_generate_runs_the_hybrid_and_says_where(vulkan_device, model_factory, start_daemon):
    model = model_factory()
    daemon = start_daemon("256KiB")
    env = {**os.environ, **VULKAN_ENV, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "moed.ctl", "--socket", daemon.socket, "generate", str(model)]
    cmd += ["--prompt", "the expert model", "-n", "6", "--n-gpu-layers", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"dense layers 3-3 and output on {vulkan_device}, experts on the CPU" in proc.stderr
