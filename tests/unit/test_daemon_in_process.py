"""The daemon's orchestration in this process: core, slots and sessions with the real
store, RAM tier and reader pool on a model file in a temporary directory.

No daemon subprocess and no mock: `Daemon` is built as moed.daemon.main builds it,
on an event loop here, and reads the file with its own reader threads. A change to
the order of an acquire's steps is checked here in a second, before the integration
tests start a daemon for it. Every lease's bytes are compared with the file's.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading

import pytest

from moed.daemon.config import Config
from moed.daemon.core import Daemon, LeaseRecord, PendingAcquire
from moed.daemon.sessions import Session
from moed.gguf.catalog import Catalog
from moed.protocol import errors
from moed.protocol.layout import slot_bytes
from moed.testing import file_bytes


def run(body, budget_bytes: int = 1 << 20, **config):
    """`body(daemon)` on a new loop with a daemon of `budget_bytes`, closed afterwards."""

    async def main():
        daemon = Daemon(Config(ram_budget_bytes=budget_bytes, **config), asyncio.get_running_loop())
        try:
            return await body(daemon)
        finally:
            await daemon.stop()
            daemon.close()

    return asyncio.run(main())


async def lease_of(daemon: Daemon, model, layer: int, experts: list[int], timeout_s: float = 10.0) -> LeaseRecord:
    got = daemon.acquire(model, layer, experts, daemon.tenant(os.getuid()), timeout_s)
    return await got.wait() if isinstance(got, PendingAcquire) else got


def assert_file_bytes(daemon: Daemon, model, lease: LeaseRecord, experts: list[int]) -> None:
    """Every part of every expert of the lease equals the file's bytes."""
    layer = model.catalog.layers[lease.layer]
    for slot, expert in zip(lease.slots, experts):
        seg = daemon.ramtier.segments[slot.class_id]
        for k, part in enumerate(seg.part_names):
            ext = layer.parts[part]
            n = ext.bytes_per_expert
            got = ctypes.string_at(seg.part_addr(slot.index, k), n)
            assert got == file_bytes(ext.path, ext.offset + expert * n, n), (lease.layer, expert, part)


def slot_bytes_of(path) -> int:
    """What one expert of `path` takes of the budget (its slot, parts page-strided)."""
    layer = next(iter(Catalog.open(str(path)).layers.values()))
    return slot_bytes([e.bytes_per_expert for e in layer.parts.values()])


def test_a_miss_reads_the_files_bytes_and_the_same_acquire_then_hits(tiny_model):
    async def body(daemon: Daemon):
        model = await daemon.open_model(str(tiny_model))
        tenant = daemon.tenant(os.getuid())
        first = daemon.acquire(model, 0, [1, 3], tenant, 10.0)
        assert isinstance(first, PendingAcquire)  # nothing resident: reads
        lease = await first.wait()
        assert_file_bytes(daemon, model, lease, [1, 3])
        second = daemon.acquire(model, 0, [3, 1], tenant, 10.0)
        assert isinstance(second, LeaseRecord)  # resident: granted with no wait
        assert_file_bytes(daemon, model, second, [3, 1])
        assert (tenant.misses, tenant.hits) == (2, 2)
        assert all(s.refs == 2 for s in lease.slots)
        daemon.release(lease)
        daemon.release(second)
        assert all(s.refs == 0 for s in lease.slots) and model.leases == 0

    run(body)


def test_an_evicting_budget_serves_every_expert_exactly(tiny_model):
    budget = 5 * slot_bytes_of(tiny_model)  # 5 experts of 32 (4 layers x 8)

    async def body(daemon: Daemon):
        model = await daemon.open_model(str(tiny_model))
        n_experts = model.catalog.n_experts
        for layer in sorted(model.catalog.layers):
            for e in range(n_experts):
                lease = await lease_of(daemon, model, layer, [e, (e + 1) % n_experts])
                assert_file_bytes(daemon, model, lease, [e, (e + 1) % n_experts])
                daemon.release(lease)
                assert daemon.store.used_bytes <= daemon.store.budget_bytes
        return model

    model = run(body, budget_bytes=budget)
    assert model.catalog.n_experts * len(model.catalog.layers) > 5  # so it evicted


def test_held_leases_leave_no_room_until_released(tiny_model):
    async def body(daemon: Daemon):
        model = await daemon.open_model(str(tiny_model))
        fit = daemon.store.budget_bytes // slot_bytes_of(tiny_model)
        assert fit == 5 < model.catalog.n_experts
        held = await lease_of(daemon, model, 0, list(range(fit)))
        with pytest.raises(errors.BudgetExhausted):
            await lease_of(daemon, model, 1, [0], timeout_s=0.3)
        daemon.release(held)
        lease = await lease_of(daemon, model, 1, [0])
        assert_file_bytes(daemon, model, lease, [0])
        daemon.release(lease)

    run(body, budget_bytes=5 * slot_bytes_of(tiny_model))


def test_a_changed_file_retires_the_model_before_a_grant(tmp_path, tiny_model):
    path = tmp_path / "m.gguf"
    path.write_bytes(tiny_model.read_bytes())

    async def body(daemon: Daemon):
        model = await daemon.open_model(str(path))
        daemon.release(await lease_of(daemon, model, 0, [0]))
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        with pytest.raises(errors.ModelStale):
            daemon.acquire(model, 0, [0], daemon.tenant(os.getuid()), 1.0)
        assert model.stale

    run(body)


def test_a_session_serves_a_client_in_this_process(tmp_path, tiny_model):
    """Session, the real Client in a thread, one Unix socket: acquire, bytes, release."""
    from moed.client import Client

    sock = str(tmp_path / "s")
    result: dict = {}

    def client_side():
        with Client(sock, "in-process") as c:
            h = c.open_model(str(tiny_model))
            with h.acquire(0, [2, 5]) as lease:
                parts = list(lease.segment.info.part_names)
                result["views"] = [bytes(lease.view(e, p)) for e in (2, 5) for p in parts]
                result["parts"] = parts
            result["stats"] = c.stats()

    async def body(daemon: Daemon):
        server = await asyncio.get_running_loop().create_unix_server(lambda: Session(daemon), sock)
        daemon.start()
        try:
            t = threading.Thread(target=client_side)
            t.start()
            await asyncio.get_running_loop().run_in_executor(None, t.join, 30)
            assert not t.is_alive()
        finally:
            server.close()
            await server.wait_closed()
        return daemon.models

    models = run(body)
    model = next(iter(models.values()))
    layer = model.catalog.layers[0]
    want = []
    for e in (2, 5):
        for p in result["parts"]:
            ext = layer.parts[p]
            want.append(file_bytes(ext.path, ext.offset + e * ext.bytes_per_expert, ext.bytes_per_expert))
    assert result["views"] == want
    assert result["stats"]["misses"] == 2
