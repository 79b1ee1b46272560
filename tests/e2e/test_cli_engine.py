"""moectl generate / chat / trace against the real daemon and real llama.cpp."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")  # e2e needs the real llama.cpp (pyproject extra "llama")


def moectl(socket: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moed.ctl", "--socket", socket, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_generate_prints_text_and_the_hit_rate(start_daemon, tiny_model):
    d = start_daemon("512KiB")
    r = moectl(d.socket, "generate", str(tiny_model), "--prompt", "hello world", "-n", "12", "--ctx", "256")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "daemon hit rate" in r.stderr and "tok/s" in r.stderr
    assert "prefetch gate: recall" in r.stderr and "ms/token" in r.stderr


@pytest.mark.parametrize("mode", ["off", "gate2"])
def test_generate_prefetch_flag_gives_the_same_text(start_daemon, tiny_model, mode):
    d = start_daemon("512KiB")
    base = ["generate", str(tiny_model), "--prompt", "hello world", "-n", "12", "--ctx", "256"]
    want = moectl(d.socket, *base, "--prefetch", "gate")
    got = moectl(d.socket, *base, "--prefetch", mode, "--prefetch-width", "3")
    assert want.returncode == 0 and got.returncode == 0, got.stderr
    assert got.stdout == want.stdout
    assert (f"prefetch {mode}" in got.stderr) if mode != "off" else ("prefetch off" in got.stderr)


def test_generate_with_a_missing_model_is_a_one_line_error(start_daemon, tmp_path):
    d = start_daemon()
    r = moectl(d.socket, "generate", str(tmp_path / "none.gguf"), "--prompt", "x")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_chat_answers_each_line(start_daemon, tiny_model):
    d = start_daemon()
    r = moectl(d.socket, "chat", str(tiny_model), "-n", "8", "--ctx", "256", stdin="hi there\nand again\n")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip().splitlines()) >= 1
    assert "daemon hit rate" in r.stderr


@pytest.mark.parametrize("chat", [False, True])
def test_trace_records_prompt_and_decode_steps(start_daemon, mixed_model, tmp_path, chat):
    from moed.traces import Trace

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\n\nthe expert model reads pages\n")
    out = tmp_path / "run.npz"
    d = start_daemon()
    r = moectl(
        d.socket,
        "trace",
        str(mixed_model),
        "--prompt-file",
        str(prompts),
        "-n",
        "6",
        "--ctx",
        "256",
        *(["--chat"] if chat else []),
        "-o",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    t = Trace.load(out)
    kinds = bytes(t.step_kinds).decode()
    assert kinds.count("P") == 2 and kinds.count("D") == 12
    assert (t.moe_layers, t.n_experts, t.top_k) == (4, 8, 2)
    assert np.all(t.ids >= 0)


def test_a_recorded_trace_carries_predictions_and_replays_with_gate(start_daemon, tiny_model, tmp_path):
    from moed.traces import Trace

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world, the model reads\nthe expert model reads pages\n")
    out = tmp_path / "run.npz"
    d = start_daemon()
    r = moectl(
        d.socket, "trace", str(tiny_model), "--prompt-file", str(prompts), "-n", "16", "--ctx", "256", "-o", str(out)
    )
    assert r.returncode == 0, r.stderr
    t = Trace.load(out)
    assert t.ahead1 is not None and t.ahead2 is not None
    k = t.top_k
    assert t.ahead1.shape[2] == 2 * k
    assert np.all(t.ahead1[:, 0] == -1) and np.all(t.ahead2[:, :2] == -1)  # nothing precedes them
    assert np.all(t.ahead1[:, 1:] >= 0) and np.all(t.ahead2[:, 2:] >= 0)
    # best first and distinct in every row
    rows = t.ahead1[:, 1:].reshape(-1, 2 * k)
    assert all(len(set(row.tolist())) == 2 * k for row in rows)
    # the predictions are the engine's: better than chance on this random model
    hit = np.mean(
        [len(set(t.ids[i, l]) & set(t.ahead1[i, l, :k])) / k for i in range(t.n_tokens) for l in range(1, t.moe_layers)]
    )
    assert hit > k / t.n_experts

    for mode in ("gate", "gate2"):
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "moed.ctl",
                "replay",
                str(tiny_model),
                str(out),
                "--budget",
                "50%",
                "--prefetch",
                mode,
                "--warm",
                "4",
                "--compute-ms",
                "1",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        import json

        res = json.loads(r.stdout)
        assert res["prefetch_mode"] == mode and res["prefetches"] > 0 and res["tokens"] > 0

    r = subprocess.run(
        [sys.executable, "-m", "moed.ctl", "trace-info", str(out), "--predictors"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "gate-ahead k" in r.stdout and "two-ahead k" in r.stdout
