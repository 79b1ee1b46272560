"""The pinned partition (host mirror) in a real daemon: pin, never evicted, unpin, profiles."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moed.gguf.catalog import Catalog
from moed.protocol import errors
from moed.protocol import messages as m
from moed.testing import wait_for
from moed.traces import TraceWriter
from tests.integration.test_daemon import check_lease, expert_bytes


def moectl(sock: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moed.ctl", "--socket", sock, *args], capture_output=True, text=True, timeout=60
    )


def stream(h, layers, n_experts: int) -> None:
    for layer in layers:
        for e in range(n_experts):
            with h.acquire(layer, [e], timeout_s=5):
                pass


def test_pinned_experts_are_never_evicted_and_unpin_is_live(start_daemon, model_factory):
    model = str(model_factory(layers=4, experts=16, used=2))
    cat = Catalog.open(model)
    slot = expert_bytes(model, 0)
    d = start_daemon(str(4 * slot), "--pin-budget", str(3 * slot))
    out = moectl(d.socket, "pin", model, "--experts", "0:0-2,0:5")
    assert out.returncode == 0, out.stderr
    assert "pinned 3 experts (1 skipped" in out.stdout
    with d.client() as c:
        h = c.open_model(model)
        s = c.stats()
        assert (s["pinned_bytes"], s["pinned_experts"], s["used_bytes"]) == (3 * slot, 3, 0)
        stream(h, (1, 2, 3), 16)  # 48 misses through a 4-slot budget
        before = c.stats()
        with h.acquire(0, [0, 1, 2]) as lease:  # the pinned three are still there
            check_lease(cat, lease, 0, [0, 1, 2])
        s = c.stats()
        assert s["hits"] - before["hits"] == 3 and s["misses"] == before["misses"]
        assert s["pinned_hits"] == 3 and 0 < s["pinned_hit_share"] <= 1
        assert s["used_bytes"] <= s["budget_bytes"] and s["evictions"] >= 40
        assert s["models"][0]["pinned_experts"] == 3

        held = h.acquire(0, [1])
        out = moectl(d.socket, "unpin", model, "--all")
        assert out.returncode == 0 and "unpinned 3 experts" in out.stdout, out.stderr
        s = c.stats()
        assert s["pinned_bytes"] == slot  # expert 1 is held: it leaves when released
        held.release()
        wait_for(lambda: c.stats()["pinned_bytes"] == 0, 5, what="unpinned expert to leave")
        stream(h, (1, 2), 16)
        before = c.stats()
        with h.acquire(0, [0, 1, 2]):
            pass
        assert c.stats()["misses"] - before["misses"] == 3  # evicted like anything else now


def test_whole_model_that_fits_is_pinned_at_open(start_daemon, tiny_model):
    slot = expert_bytes(tiny_model, 0)
    d = start_daemon(str(4 * slot), "--pin-budget", str(40 * slot))
    with d.client() as c:
        h = c.open_model(tiny_model)
        wait_for(
            lambda: c.stats()["pinned_experts"] == 32 and c.stats()["reads_in_flight"] == 0,
            10,
            what="the whole model pinned",
        )
        before = c.stats()
        stream(h, h.moe_layers, 8)
        s = c.stats()
        assert s["misses"] == before["misses"] and s["hits"] - before["hits"] == 32
        assert s["used_bytes"] == 0 and s["pinned_hit_share"] == 1.0


def test_pin_from_stats_and_from_trace(start_daemon, model_factory, tmp_path):
    model = str(model_factory(layers=4, experts=16, used=2))
    slot = expert_bytes(model, 0)
    d = start_daemon(str(8 * slot), "--pin-budget", str(2 * slot))
    with d.client() as c:
        h = c.open_model(model)
        for _ in range(5):
            with h.acquire(2, [7]):
                pass
        for _ in range(3):
            with h.acquire(3, [9]):
                pass
        with h.acquire(1, [4]):
            pass
        out = moectl(d.socket, "pin", model, "--from-stats")
        assert out.returncode == 0 and "pinned 2 experts" in out.stdout, out.stderr
        assert _pinned(c) == {(2, 7), (3, 9)}
        c.request(m.Unpin(h.model_id, all=True))

        w = TraceWriter(moe_layers=4, n_experts=16, top_k=2, layer_ids=h.moe_layers)
        for t in range(10):
            w.append_step("D", [[t, (t + 5) % 16], [t + 1, (t + 6) % 16], [5, 11], [t + 2, (t + 9) % 16]])
        trace = tmp_path / "t.npz"
        w.finish().save(trace)
        out = moectl(d.socket, "pin", model, "--trace", str(trace))
        assert out.returncode == 0, out.stderr
        assert _pinned(c) == {(h.moe_layers[2], 5), (h.moe_layers[2], 11)}  # routed 10x; others <= 2x


def _pinned(c) -> set[tuple[int, int]]:
    return {tuple(k) for k in c.stats()["models"][0]["pinned"]}


def test_pin_needs_a_pin_budget_and_an_operator(daemon, tiny_model):
    with daemon.client() as c:
        h = c.open_model(tiny_model)
        with pytest.raises(errors.BadRequest, match="pin budget"):
            c.request(m.Pin(h.model_id, [(0, 1)]))
        with pytest.raises(errors.UnknownModel):
            c.request(m.Pin(99, [(0, 1)]))


def test_pinning_does_not_grow_memory_while_the_guard_holds_the_floor(start_daemon, tiny_model):
    import psutil

    slot = expert_bytes(tiny_model, 0)
    d = start_daemon(str(8 * slot), "--pin-budget", str(4 * slot))
    with d.client() as c:
        h = c.open_model(tiny_model)
        held = h.acquire(0, [3])  # resident and leased: the guard keeps it
        c.request(m.SetMemFloor(psutil.virtual_memory().available + (4 << 30)))
        r = c.request(m.Pin(h.model_id, [(0, 3), (0, 1), (0, 2)]))
        assert (r.pinned, r.skipped, r.pinned_bytes) == (1, 2, slot)  # moving in is no growth
        s = c.stats()
        assert s["mem_guard_active"] and s["used_bytes"] == 0
        held.release()
        c.request(m.SetMemFloor(0))
        r = c.request(m.Pin(h.model_id, [(0, 1), (0, 2)]))
        assert (r.pinned, r.skipped) == (2, 0)


def test_the_pin_word_says_when_every_expert_is_pinned(start_daemon, model_factory):
    """Engines take whole steps on a model whose table's pin word reads 1: only once every
    expert is pinned and READY, and it drops at once when one is unpinned."""
    model = str(model_factory(layers=2, experts=4, used=2))
    slot = expert_bytes(model, 0)
    d = start_daemon(str(4 * slot), "--pin-budget", str(8 * slot))
    with d.client() as c:
        h = c.open_model(model)  # the mirror pins it whole (8 experts fit)
        wait_for(h.all_pinned, 5, what="the pin word once the mirror's reads are in")
        assert c.stats()["models"][0]["all_pinned"] is True
        c.request(m.Unpin(h.model_id, [(h.moe_layers[1], 3)]))
        assert not h.all_pinned() and c.stats()["models"][0]["all_pinned"] is False
        c.request(m.Pin(h.model_id, [(h.moe_layers[1], 3)]))
        wait_for(h.all_pinned, 5, what="the pin word again once the expert is pinned again")
