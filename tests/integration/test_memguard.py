"""The memory guard in a real daemon: raising the floor live gives memory back."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from moed.daemon.memguard import hysteresis_for
from moed.gguf.catalog import Catalog
from moed.protocol import errors
from moed.protocol import messages as m
from moed.testing import proc_status_bytes, wait_for
from tests.integration.peer import NOBODY, Outcome, as_peer
from tests.integration.test_daemon import check_lease, expert_bytes


def test_floor_raised_live_gives_back_all_but_leased_then_grows_back(start_daemon, model_factory):
    model = model_factory(layers=4, experts=16, used=2, embd=256, ff=512)
    cat = Catalog.open(model)
    slot = expert_bytes(model, 0)
    d = start_daemon(str(40 * slot), "--mem-floor", "0")
    with d.client() as c:
        h = c.open_model(model)
        for layer in h.moe_layers:  # fill: 32 experts resident
            for e in range(0, 8, 2):
                with h.acquire(layer, [e, e + 1]):
                    pass
        held = h.acquire(0, [0, 1])  # a lease the guard must not break
        s = c.stats()
        assert s["used_bytes"] == 32 * slot and not s["mem_guard_active"]
        shmem_before = proc_status_bytes(d.proc.pid, "RssShmem")
        assert shmem_before >= 30 * slot

        floor = psutil.virtual_memory().available + (4 << 30)  # unreachable: give everything back
        r = c.request(m.SetMemFloor(floor))
        assert r.floor_bytes == floor
        s = c.stats()
        assert s["mem_guard_active"] and s["mem_floor_bytes"] == floor
        assert s["used_bytes"] == 2 * slot  # only the leased experts remain
        assert s["effective_budget_bytes"] == 2 * slot
        assert s["given_back_bytes"] >= 30 * slot
        assert proc_status_bytes(d.proc.pid, "RssShmem") <= shmem_before - 29 * slot  # pages really went back

        check_lease(cat, held, 0, [0, 1])  # the lease still reads the right bytes
        with h.acquire(0, [0]):  # hits still work
            pass
        with pytest.raises(errors.BudgetExhausted, match="memory guard"):
            h.acquire(1, [5], timeout_s=0.3)  # growing is refused
        held.release()
        wait_for(lambda: c.stats()["used_bytes"] == 0, 5, what="released experts given back")

        # the box recovered: a floor well below MemAvailable (beyond the hysteresis band)
        avail = psutil.virtual_memory().available
        r = c.request(m.SetMemFloor(avail - 3 * hysteresis_for(avail) - s["budget_bytes"]))
        s = c.stats()
        assert not s["mem_guard_active"] and s["effective_budget_bytes"] == s["budget_bytes"]
        assert r.effective_budget_bytes == s["budget_bytes"]
        with h.acquire(1, [5, 6], timeout_s=5) as lease:
            check_lease(cat, lease, 1, [5, 6])
    assert "memory guard" in d.log() and "gave back" in d.log()
    assert d.stop() == 0


def test_guard_started_with_floor_above_available_holds_store_empty(start_daemon, tiny_model):
    floor = psutil.virtual_memory().available + (4 << 30)
    d = start_daemon("16MiB", "--mem-floor", str(floor))
    with d.client() as c:
        h = c.open_model(tiny_model)
        with pytest.raises(errors.BudgetExhausted):
            h.acquire(0, [0], timeout_s=0.5)
        s = c.stats()
        assert s["mem_guard_active"] and s["effective_budget_bytes"] == 0 and s["used_bytes"] == 0


def test_default_floor_is_derived_and_0_turns_the_guard_off(start_daemon):
    """Issue 46: with no floor given the guard is on (5% of RAM or the cgroup's limit, at least 256 MiB)."""
    from moed.daemon.memguard import MemoryReader

    want = MemoryReader().auto_floor_bytes()  # the daemon sees the box and the cgroup this process sees
    d = start_daemon("16MiB")
    with d.client() as c:
        assert c.stats()["mem_floor_bytes"] == want >= 256 << 20
    assert "(the default: 5% of the smaller of RAM" in d.log()  # on the ready line
    off = start_daemon("16MiB", "--mem-floor", "0")
    with off.client() as c:
        s = c.stats()
    assert s["mem_floor_bytes"] == 0 and not s["mem_guard_active"]
    auto = start_daemon("16MiB", "--mem-floor", "auto")
    with auto.client() as c:
        assert c.stats()["mem_floor_bytes"] == want


def _set_floor(sock: str, floor: int) -> str:
    from moed.client import Client

    with Client(sock) as c:
        try:
            c.request(m.SetMemFloor(floor))
        except errors.PermissionDenied:
            return "denied"
    return "allowed"


def test_only_an_operator_may_set_the_floor(daemon):
    os.chmod(daemon.dir, 0o755)
    os.chmod(daemon.socket, 0o666)
    with daemon.client() as c:
        floor = c.stats()["mem_floor_bytes"]  # the default floor
    assert as_peer(NOBODY, NOBODY, _set_floor, daemon.socket, 1) == Outcome(result="denied")
    with daemon.client() as c:
        assert c.stats()["mem_floor_bytes"] == floor != 1
    assert _set_floor(daemon.socket, 1) == "allowed"


def test_moectl_set_mem_floor(daemon):
    out = subprocess.run(
        [sys.executable, "-m", "moed.ctl", "--socket", daemon.socket, "set", "mem-floor", "1MiB"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert "mem floor 1.00 MiB" in out.stdout
    with daemon.client() as c:
        assert c.stats()["mem_floor_bytes"] == 1 << 20
    bad = subprocess.run(
        [sys.executable, "-m", "moed.ctl", "--socket", daemon.socket, "set", "mem-floor", "lots"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 2 and "BadRequest" in bad.stderr
