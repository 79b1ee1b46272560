"""The GPU hybrid when a decode fails: no signal, a typed error, the engine usable after.

Under an offload ggml's scheduler computes the graph in splits (the device's layers,
the CPU's expert matmuls); an eval callback that answers False only leaves the split
it is in, so a later CPU split still runs its expert matmuls. Before issue 38 those
read expert pages nobody had acquired (PROT_NONE) and the process died with SIGSEGV.
Now every expert address reads zeros from the failure to the end of that decode
(moed.engines.expert_pages.ExpertPages.open_zeros), the decode raises the stored
error, and everything is hidden again after it.

Each probe runs the engine in a new interpreter on lavapipe (GGML_VK_VISIBLE_DEVICES=0,
GGML_VK_DISABLE_FUSION=1, as tests/e2e/test_gpu_hybrid.py says why), and checks the
exit status: a signal fails the test by name. Every result is compared bit for bit
with stock `llama_cpp.Llama` given the same `n_gpu_layers` (StockLlama: the experts
kept on the CPU as `--n-cpu-moe` does) and the same effective `n_batch`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.e2e.conftest import ROOT, VULKAN_ENV, assert_bit_equal, bad_expert
from tests.e2e.test_gpu_hybrid import plain_experts

# Every probe needs the device (the fixture skips, saying what is missing, where there is none).
pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("vulkan_device")]
pytest.importorskip("llama_cpp")

# One engine in a new interpreter, told what to do by a JSON spec; it prints one JSON line.
ENGINE = r"""
import json, os, shutil, signal, sys, warnings
import numpy as np
from moed.engines.llama_cpp import StockLlama, StreamedLlama
from moed.protocol import errors
from tests.e2e.conftest import LLAMA_KW, PROMPT, greedy_logits

spec = json.loads(sys.argv[1])
kw = {**LLAMA_KW, "n_gpu_layers": spec["n_gpu"], **spec.get("llama", {})}
report = {}
if spec["which"] == "stock":
    llm, client = StockLlama(spec["model"], **kw), None
else:
    from moed.client import Client
    client = Client(spec["socket"], "gpu-faults", reconnect_s=spec.get("reconnect_s", 30.0))
    llm = StreamedLlama(spec["model"], client=client, **spec.get("engine", {}), **kw)
tokens = spec.get("tokens") or llm.tokenize(PROMPT)


def leases():
    return sum(t["leases"] for t in client.stats()["tenants"])


def expect(kind, step):
    try:
        for _ in range(4):
            step()
    except getattr(errors, kind) as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["held_after"] = llm.streamer.held is not None
        return
    report["error"] = "none"


scenario = spec["scenario"]
if scenario == "logits":
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        split = []
        np.save(spec["out"], greedy_logits(llm, tokens, steps=spec.get("steps", 8), batches=spec.get("batches"), split=split))
    report["warnings"] = [str(w.message) for w in caught]
    report["batches"], report["n_batch"] = split, llm.n_batch
elif scenario == "killed":
    llm.eval(tokens)
    os.kill(spec["daemon_pid"], signal.SIGKILL)
    expect("DaemonUnavailable", lambda: llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))]))
elif scenario == "replaced":
    llm.eval(tokens)
    fresh = spec["model"] + ".new"
    shutil.copyfile(spec["model"], fresh)
    os.replace(fresh, spec["model"])  # a new inode: the daemon's identity of the file changes
    expect("ModelStale", lambda: llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))]))
elif scenario == "read_error":
    expect("ReadError", lambda: (llm.reset(), llm.eval(tokens)))
    report["leases"] = leases()
    np.save(spec["out"], greedy_logits(llm, spec["tokens_b"], steps=0))  # B's batch alone: no bad expert
if spec["which"] == "streamed":
    report["devices"] = llm.stream_stats()["devices"]
print(json.dumps(report))
llm.close()
if client is not None:
    client.close()
"""


def start_engine(**spec) -> subprocess.Popen:
    env = {**os.environ, **VULKAN_ENV, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", ENGINE, json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def finish(proc: subprocess.Popen, what: str) -> dict:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"{what}: rc {proc.returncode} (a negative rc is a signal)\n{err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


def engine(**spec) -> dict:
    return finish(start_engine(**spec), f"{spec['which']} engine, {spec['scenario']}")


def logits(which: str, model, out: Path, n_gpu: int, socket: str = "", **spec) -> tuple[np.ndarray, dict]:
    report = engine(which=which, scenario="logits", model=str(model), out=str(out), n_gpu=n_gpu, socket=socket, **spec)
    return np.load(out), report


@pytest.fixture
def wide_model(model_factory):
    """The issue's model: 16 experts of 256x256, 4 a token, so a 1 MiB budget holds fewer
    experts than two tokens route to."""
    model = model_factory(experts=16, used=4, embd=256, ff=256)
    plain_experts(model)
    return model


@pytest.mark.parametrize("n_gpu", [99, -1])
def test_a_batch_over_the_budget_is_split_under_an_offload_and_matches_stock(wide_model, start_daemon, tmp_path, n_gpu):
    """The prompt's call is split (issue 47: n_batch stays the user's), the warning names the
    budget, and stock fed the same sub-batches computes the same logits, bit for bit."""
    daemon = start_daemon("1MiB")
    got, report = logits("streamed", wide_model, tmp_path / "s.npy", n_gpu, daemon.socket)
    split = report["batches"]
    assert max(split) < 64 and report["n_batch"] == 64, report
    assert any("the daemon's budget" in w and "n_batch stays 64" in w for w in report["warnings"]), report
    assert report["devices"]["gpu_layers"] == [0, 3] and report["devices"]["output_on_gpu"]
    want, _ = logits("stock", wide_model, tmp_path / "w.npy", n_gpu, batches=split)
    assert_bit_equal(got, want)
    assert daemon.client("check").stats()["evictions"] > 0


def test_the_daemon_killed_mid_generation_is_a_typed_error_not_a_signal(aligned_model, start_daemon):
    daemon = start_daemon("2MiB")  # misses: a hit needs no daemon, only a miss can tell
    report = engine(
        which="streamed",
        scenario="killed",
        model=str(aligned_model),
        n_gpu=99,
        socket=daemon.socket,
        daemon_pid=daemon.proc.pid,
        reconnect_s=0.5,  # it never comes back: each eval waits this long for it, then says so
    )
    assert report["error"].startswith("DaemonUnavailable"), report
    assert report["held_after"] is False


def test_a_model_file_replaced_while_open_is_a_typed_error_not_a_signal(model_factory, start_daemon, tmp_path):
    model = tmp_path / "model.gguf"
    shutil.copyfile(model_factory(), model)
    daemon = start_daemon("256KiB")  # evicting: later tokens read from the (replaced) file
    report = engine(which="streamed", scenario="replaced", model=str(model), n_gpu=2, socket=daemon.socket)
    assert report["error"].startswith("ModelStale"), report
    assert report["held_after"] is False


def test_a_read_error_under_an_offload_is_typed_and_the_next_prompt_matches_stock(
    model_factory, start_daemon, tmp_path
):
    with bad_expert(model_factory) as bad:
        plain_experts(bad.pristine)
        daemon = start_daemon("64MiB")
        report = engine(
            which="streamed",
            scenario="read_error",
            model=str(bad.path),
            n_gpu=99,
            socket=daemon.socket,
            tokens=bad.a_tokens,
            tokens_b=bad.b_tokens,
            out=str(tmp_path / "b.npy"),
            engine={"prefetch": "off"},  # as the routes were found: only A's batch asks for the bad expert
        )
        assert report["error"].startswith("ReadError") and f"layer {bad.layer} expert {bad.expert}" in report["error"]
        assert report["held_after"] is False and report["leases"] == 0
        got = np.load(tmp_path / "b.npy")
        want, _ = logits("stock", bad.pristine, tmp_path / "w.npy", 99, tokens=bad.b_tokens, steps=0)
        assert_bit_equal(got, want)


def test_two_engines_with_different_offloads_share_one_daemon_and_match_stock(model_factory, start_daemon, tmp_path):
    model = model_factory()
    plain_experts(model)
    daemon = start_daemon("256KiB")
    procs = {
        n_gpu: start_engine(
            which="streamed",
            scenario="logits",
            model=str(model),
            out=str(tmp_path / f"s{n_gpu}.npy"),
            n_gpu=n_gpu,
            socket=daemon.socket,
        )
        for n_gpu in (99, 2)
    }
    for n_gpu, proc in procs.items():
        finish(proc, f"streamed engine with n_gpu_layers={n_gpu}")
        want, _ = logits("stock", model, tmp_path / f"w{n_gpu}.npy", n_gpu)
        assert_bit_equal(np.load(tmp_path / f"s{n_gpu}.npy"), want)
    assert daemon.client("check").stats()["evictions"] > 0
