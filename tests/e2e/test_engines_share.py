"""Several engines on one daemon: same text as alone; a killed engine harms nobody; two architectures at once."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.e2e.conftest import LLAMA_KW, PROMPT, assert_bit_equal, greedy_steps

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")  # e2e needs the real llama.cpp (pyproject extra "llama")

PROMPTS = ("hello world, the model", "memory pages on the drive")
N_TOKENS = 40


def spawn(socket: str, model, prompt: str, n: int = N_TOKENS, *mode: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.e2e.engine_proc", socket, str(model), prompt, str(n), *mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def result(proc: subprocess.Popen, timeout_s: float = 120) -> dict:
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def read_lines(proc: subprocess.Popen, count: int, timeout_s: float = 60) -> None:
    """Wait (with a deadline) until the process printed `count` lines."""
    deadline = time.monotonic() + timeout_s
    seen = 0
    while seen < count:
        left = deadline - time.monotonic()
        assert left > 0, "engine made no progress"
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if ready:
            line = proc.stdout.readline()
            assert line, f"engine exited early: {proc.stderr.read()[-3000:]}"
            seen += 1


@pytest.fixture
def small_daemon(start_daemon):
    # ~21 slots of the tiny model's 32 experts: the engines share and evict.
    return start_daemon("512KiB")


@pytest.mark.parametrize(
    "model, budget",
    [
        ("tiny_model", "512KiB"),  # copy path, ~21 slots of 32 experts
        ("aligned_model", "2MiB"),  # zero copy, ~10 slots of 32: stale mappings must be remapped
    ],
)
def test_two_engines_produce_the_same_text_as_each_alone(request, start_daemon, model, budget):
    path = request.getfixturevalue(model)
    daemon = start_daemon(budget)
    alone = [result(spawn(daemon.socket, path, p)) for p in PROMPTS]
    procs = [spawn(daemon.socket, path, p) for p in PROMPTS]
    together = [result(p) for p in procs]
    assert together == alone
    with daemon.client("check") as c:
        stats = c.stats()
    assert len(stats["models"]) == 1
    assert stats["hits"] > 0 and stats["evictions"] > 0


def test_killed_engine_leaves_daemon_and_other_engine_unharmed(small_daemon, tiny_model):
    want = result(spawn(small_daemon.socket, tiny_model, PROMPTS[1]))
    victim = spawn(small_daemon.socket, tiny_model, PROMPTS[0], 0, "--forever")
    try:
        read_lines(victim, 20)  # mid-generation
        other = spawn(small_daemon.socket, tiny_model, PROMPTS[1])
        read_lines(victim, 5)
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(30)
        assert result(other) == want
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    with small_daemon.client("check") as c:
        c.ping()
        stats = c.stats()
    assert all(t["leases"] == 0 for t in stats["tenants"])
    assert small_daemon.running()
    assert "Traceback" not in small_daemon.log()
    # and the daemon still serves a fresh engine the same text
    assert result(spawn(small_daemon.socket, tiny_model, PROMPTS[1])) == want


def test_two_architectures_share_a_daemon_and_each_stays_bit_exact(
    start_daemon, reference_logits, tiny_model, olmoe_model
):
    """A qwen3moe and an olmoe engine on one daemon, stepping in turn: each equals its resident run."""
    from moed.engines.llama_cpp import StreamedLlama

    paths = (tiny_model, olmoe_model)
    want = [reference_logits(p)[1] for p in paths]
    daemon = start_daemon("384KiB")  # fewer slots than the two models' 64 experts: they evict each other's
    clients = [daemon.client(f"e2e-{i}") for i in range(len(paths))]
    llms: list = []
    got: list[list] = [[] for _ in paths]
    try:
        llms = [StreamedLlama(str(p), client=c, **LLAMA_KW) for p, c in zip(paths, clients)]
        runs = [greedy_steps(llm, llm.tokenize(PROMPT), rows) for llm, rows in zip(llms, got)]
        while runs:  # one eval of each in turn, until both are done
            runs = [r for r in runs if next(r, StopIteration) is not StopIteration]
        stats = clients[0].stats()
    finally:
        for llm in llms:
            llm.close()
        for c in clients:
            c.close()
    for rows, expected in zip(got, want):
        assert_bit_equal(np.concatenate(rows), expected)
    assert len(stats["models"]) == 2
    assert stats["evictions"] > 0 and stats["hits"] > 0
