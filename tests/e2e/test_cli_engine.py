"""moectl generate / chat / trace against the real daemon and real llama.cpp."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")   # e2e needs the real llama.cpp (pyproject extra "llama")


def moectl(socket: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moed.ctl", "--socket", socket, *args], input=stdin,
                          capture_output=True, text=True, timeout=120)


def test_generate_prints_text_and_the_hit_rate(start_daemon, tiny_model):
    d = start_daemon("512KiB")
    r = moectl(d.socket, "generate", str(tiny_model), "--prompt", "hello world", "-n", "12", "--ctx", "256")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "daemon hit rate" in r.stderr and "tok/s" in r.stderr


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
    from moed.lab.traces import Trace

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\n\nthe expert model reads pages\n")
    out = tmp_path / "run.npz"
    d = start_daemon()
    r = moectl(d.socket, "trace", str(mixed_model), "--prompt-file", str(prompts), "-n", "6",
               "--ctx", "256", *(["--chat"] if chat else []), "-o", str(out))
    assert r.returncode == 0, r.stderr
    t = Trace.load(out)
    kinds = bytes(t.step_kinds).decode()
    assert kinds.count("P") == 2 and kinds.count("D") == 12
    assert (t.moe_layers, t.n_experts, t.top_k) == (4, 8, 2)
    assert np.all(t.ids >= 0)
