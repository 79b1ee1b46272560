"""`moectl serve` checks the engine options before it starts any worker (issue 47).

A bad `--gpu-slots` or `--gpu-zero-copy` (alone, below the model's top-k, negative, or with
no `--n-gpu-layers`) ends the command at once with one line naming the option: no
traceback, no worker started, no restart loop. The check is EngineOptions' own
(moed.engines.options: `check` and `for_model`, from the file's header), so it needs no
daemon and no device: the socket named here does not exist.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")
pytest.importorskip("llama_cpp.server.app")  # the [server] extra


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--gpu-slots", "1", "--n-gpu-layers", "-1"], "gpu_slots=1 is not accepted: gpu_slots takes 0 or at least 2"),
        (["--gpu-slots", "-1", "--n-gpu-layers", "-1"], "gpu_slots=-1 is not accepted: gpu_slots takes an int >= 0"),
        (["--gpu-slots", "4"], "gpu_slots=4 is not accepted: gpu_slots takes 0 unless n_gpu_layers is set"),
        (["--gpu-zero-copy"], "gpu_zero_copy=True is not accepted"),
        (["--gpu-slots", "4", "--n-gpu-layers", "1"], "N puts the output layer and the last N-1 blocks on the device"),
    ],
)
def test_a_bad_slot_value_ends_serve_with_one_line_before_any_worker(tiny_model, tmp_path, flags, words):
    """tiny_model routes to 2 of 8 experts a layer: S=1 cannot hold one token's."""
    cmd = [sys.executable, "-m", "moed.ctl", "--socket", str(tmp_path / "none.sock"), "serve", str(tiny_model)]
    t0 = time.monotonic()
    proc = subprocess.run([*cmd, "--port", "1", *flags], capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("moectl: BadInput: bad server settings: "), proc.stderr
    assert words in lines[0], lines[0]
    assert "Traceback" not in proc.stderr and "restart" not in proc.stderr and not proc.stdout.strip()
    assert time.monotonic() - t0 < 60, "refused at once, not after a worker's start"
