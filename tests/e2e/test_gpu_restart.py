"""GPU-slot engines across a daemon restart (issue 46, item 1), on lavapipe.

Copying device slots (moed.engines.device_slots) hold copies of the file's bytes: they
stay valid when the daemon dies, and the first eval after it is back runs on the same
engine, bit for bit with stock llama.cpp computing every expert on the device. Zero-copy
slots (moed.engines.device_host) were built over the dead daemon's segments, which a
running context cannot import again: every eval after the restart fails with a clear
`HostImportUnavailable`, never a signal or wrong logits.

Each engine runs in a new interpreter (the device must be chosen before llama.cpp first
enumerates its backends; tests/e2e/test_gpu_slots.py says why), stopping after a few
tokens until the test has killed the daemon and started it again on the same socket.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from moed.testing import DaemonProcess, wait_for
from tests.e2e.conftest import LLAMA_KW, ROOT, VULKAN_ENV, assert_bit_equal
from tests.e2e.test_gpu_slots import GEOMETRY, STEPS, ZERO_COPY_BUDGET, ZERO_COPY_GEOMETRY, finish, run_engine

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("vulkan_device")]
pytest.importorskip("llama_cpp")

BEFORE = 4  # greedy steps before the daemon is killed; the rest of STEPS after the restart


def _child(argv: list[str]) -> None:
    """which model out socket: decode, print "paused", wait for a line (the daemon restarted), go on."""
    which, model, out, socket = argv
    from moed.client import Client
    from moed.engines.llama_cpp import StreamedLlama
    from moed.protocol.errors import MoedError
    from tests.e2e.test_gpu_slots import prompt_tokens

    kw = {**LLAMA_KW, "n_gpu_layers": -1}
    client = Client(socket, "gpu-restart", timeout_s=10)
    llm = StreamedLlama(model, client=client, gpu_slots=8, gpu_zero_copy=which == "zero-copy", **kw)
    llm.reset()
    llm.eval(prompt_tokens(llm, "short"))
    rows = [llm.scores[: llm.n_tokens].copy()]

    def step() -> None:
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        rows.append(llm.scores[llm.n_tokens - 1 : llm.n_tokens].copy())

    for _ in range(BEFORE):
        step()
    print("paused", flush=True)
    sys.stdin.readline()
    report: dict = {"errors": []}
    for _ in range(STEPS - BEFORE):
        try:
            step()
        except (MoedError, RuntimeError) as exc:
            report["errors"].append(f"{type(exc).__name__}: {exc}")
            if len(report["errors"]) == 2:
                break
    np.save(out, np.concatenate(rows))
    st = llm.stream_stats()
    report.update(rebinds=st["rebinds"], gpu_slots=st["gpu_slots"], generation=client.generation)
    llm.close()
    client.close()
    print(json.dumps(report))


def restarted(model, which: str, budget: str, tmp_path, start_daemon) -> tuple[np.ndarray, dict]:
    d = start_daemon(budget)
    out = tmp_path / f"{which}-restart.npy"
    env = {**os.environ, **VULKAN_ENV, "PYTHONPATH": str(ROOT)}
    code = "import sys\nfrom tests.e2e.test_gpu_restart import _child\n_child(sys.argv[1:])"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, which, str(model), str(out), d.socket],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    d2 = None
    try:
        line = proc.stdout.readline()
        assert line.strip() == "paused", f"the engine did not get that far: {proc.stderr.read()[-3000:]}"
        os.kill(d.proc.pid, signal.SIGKILL)
        wait_for(lambda: not d.running(), 10, what="the daemon to die")
        d2 = DaemonProcess(budget, socket_dir=str(d.dir))  # as systemd restarts it, on the same socket
        proc.stdin.write("go\n")
        proc.stdin.flush()
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"rc {proc.returncode} (a signal is negative)\n{stderr[-3000:]}"
        return np.load(out), json.loads(stdout.strip().splitlines()[-1])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if d2 is not None:
            d2.stop()


def test_copied_device_slots_survive_a_restart_and_match_stock(model_factory, start_daemon, tmp_path):
    model = model_factory(**GEOMETRY)
    stock = run_engine("stock", model, tmp_path)
    got, report = restarted(model, "slots", "256KiB", tmp_path, start_daemon)
    want, _ = finish(stock, "stock")
    assert report["errors"] == [], report
    assert report["rebinds"] == 1 and report["generation"] == 2
    assert_bit_equal(got, want)
    assert report["gpu_slots"]["hits"] > 0  # slots filled before the restart served after it


def test_zero_copy_slots_fail_clearly_after_a_restart(model_factory, start_daemon, tmp_path):
    model = model_factory(arch="qwen3moe", **ZERO_COPY_GEOMETRY["qwen3moe"])
    stock = run_engine("stock", model, tmp_path)
    got, report = restarted(model, "zero-copy", ZERO_COPY_BUDGET, tmp_path, start_daemon)
    want, _ = finish(stock, "stock")
    assert len(report["errors"]) == 2, report  # every eval after the restart, the same error
    for err in report["errors"]:
        assert err.startswith("HostImportUnavailable: gpu_zero_copy: moed restarted"), err
        assert "close the engine and load it again" in err
    assert report["rebinds"] == 0
    assert_bit_equal(got, want[: len(got)])  # what it computed before the restart was right


def test_serve_with_zero_copy_slots_loads_the_model_again_after_a_restart(model_factory, tmp_path, monkeypatch):
    """`moectl serve --gpu-zero-copy`: the one engine that cannot be bound again is closed and
    loaded again by the server when moed is back; the same greedy text as before the restart."""
    pytest.importorskip("llama_cpp.server.app")  # the [server] extra
    pytest.importorskip("openai")
    from tests.e2e.serving import ServeProcess, complete

    for k, v in VULKAN_ENV.items():
        monkeypatch.setenv(k, v)  # the server's workers choose their device from these
    model = model_factory(arch="qwen3moe", **ZERO_COPY_GEOMETRY["qwen3moe"])
    d = DaemonProcess(ZERO_COPY_BUDGET)
    d2 = server = None
    try:
        # 16 slots: every expert, so no prompt batch is split (lavapipe is slow enough)
        gpu = ("--n-gpu-layers", "-1", "--gpu-slots", "16", "--gpu-zero-copy")
        server = ServeProcess(d.socket, model, *gpu, log_dir=tmp_path)
        server.client = server.client.with_options(timeout=300)
        before = complete(server, 8).choices[0].text
        d.kill()
        d2 = DaemonProcess(ZERO_COPY_BUDGET, socket_dir=str(d.dir))
        after = complete(server, 8)
        assert after.choices[0].text == before and after.usage.completion_tokens == 8
        assert server.proc.poll() is None
    finally:
        if server is not None:
            server.stop()
        if d2 is not None:
            d2.stop()
        d.close()
