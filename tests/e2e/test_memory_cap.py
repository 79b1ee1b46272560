"""The memory guard is on by default (issue 46): in a memory cgroup, a daemon started with no
floor keeps the OOM killer away while two engines load and decode next to its 1 GiB store.

The issue's case: two engines on an 8-layer, 64-expert, embd-2048 model (Qwen3-30B-A3B's
expert parts), `moed --ram-budget 1GiB` with defaults, daemon and engines in one 1280 MiB
cgroup v1 memory cgroup. With the old default (floor 0) the kernel OOM-killed the daemon and
both engines failed; with the default floor (256 MiB there) the guard shrinks the store as
the engines grow, and everything finishes.

The test body (a fresh fork, tests/forked.py) joins the cgroup, so the daemon and the engines
it starts (fresh processes) are born in it. Needs root and the cgroup v1 memory controller;
skipped, saying so, where no memory cgroup can be made.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moed.testing import wait_for

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")  # e2e needs the real llama.cpp (pyproject extra "llama")

MiB = 1 << 20
CAP_BYTES = 1280 * MiB
CG_V1 = Path("/sys/fs/cgroup/memory")
MODEL = dict(
    layers=8, experts=64, used=8, embd=2048, ff=768, heads=32, kv_heads=4, quant="q4_0", align=4096, random_experts=True
)
PROMPTS = ("the expert model reads memory pages", "one token at a time from the drive")
N_TOKENS = 8
ENGINE_TIMEOUT_S = 400.0


def _our_v1_memory_cgroup() -> Path | None:
    """The cgroup v1 memory directory this process is in, or None where there is none."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            d = CG_V1 / path.lstrip("/")
            return d if (d / "cgroup.procs").exists() else None
    return None


class MemoryCgroup:
    """A fresh cgroup v1 memory cgroup under ours, capped at `cap_bytes` (no swap above it)."""

    def __init__(self, parent: Path, cap_bytes: int):
        self.path = parent / f"moed-test-cap-{os.getpid()}"
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(str(cap_bytes))
        memsw = self.path / "memory.memsw.limit_in_bytes"
        if memsw.exists():
            memsw.write_text(str(cap_bytes))

    def join(self) -> None:
        """Move the calling process in: whatever it starts from now on is born inside."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def procs(self) -> list[int]:
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer killed in this cgroup."""
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        wait_for(lambda: not self.procs(), 30, 0.05, what="the cgroup's processes to exit")
        wait_for(self._rmdir, 10, 0.05, what="the cgroup's removal")

    def _rmdir(self) -> bool:
        try:
            self.path.rmdir()
            return True
        except OSError:
            return False


@pytest.fixture
def memory_cgroup():
    """A 1280 MiB cgroup v1 memory cgroup, removed after the test; skipped where none can be made."""
    parent = _our_v1_memory_cgroup()
    if parent is None:
        pytest.skip(f"no cgroup v1 memory controller for this process under {CG_V1}: cannot cap a daemon's memory")
    if os.geteuid() != 0:
        pytest.skip("making a memory cgroup needs root")
    try:
        group = MemoryCgroup(parent, CAP_BYTES)
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup under {parent}: {exc}")
    yield group
    group.remove()


def spawn_engine(socket: str, model: Path, prompt: str) -> subprocess.Popen:
    """An engine in a fresh process (tests/e2e/engine_proc.py): greedy text as JSON on stdout."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.e2e.engine_proc", socket, str(model), prompt, str(N_TOKENS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, deadline: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return -9, out, "timed out\n" + err
    return proc.returncode, out, err


def test_two_engines_and_a_1GiB_store_in_a_1280MiB_cgroup_with_default_floor(
    memory_cgroup, model_factory, start_daemon
):
    model = model_factory(**MODEL)
    memory_cgroup.join()
    d = start_daemon("1GiB")  # no --mem-floor: the default
    with d.client("check") as c:
        s = c.stats()
    assert s["mem_floor_bytes"] == 256 * MiB, s["mem_floor_bytes"]  # 5% of 1280 MiB is less
    assert s["budget_bytes"] == 1 << 30  # 1280 MiB - 256 MiB: the budget fits, nothing lowered

    # Both at once, as the repro starts them (and as they write the same skeleton:
    # moed.engines.skeleton keeps the first one published).
    engines = [spawn_engine(d.socket, model, prompt) for prompt in PROMPTS[:2]]
    deadline = time.monotonic() + ENGINE_TIMEOUT_S
    ends = [finish(p, deadline) for p in engines]
    alive = d.running()
    oom = memory_cgroup.oom_kills()
    log = d.log()[-3000:]
    for i, (rc, out, err) in enumerate(ends):
        assert rc == 0, f"engine {i} exited {rc} (daemon alive: {alive}, OOM kills: {oom}):\n{err[-3000:]}\n{log}"
        assert len(json.loads(out.strip().splitlines()[-1])["tokens"]) == N_TOKENS
    assert alive and oom == 0, f"daemon alive: {alive}, OOM kills in the cgroup: {oom}\n{log}"
    with d.client("check") as c:
        s = c.stats()
    assert s["mem_guard_actions"] > 0, "the engines never pushed the cgroup below the floor"
    assert d.stop() == 0
