"""WorkerPool (moed.serve.pool): dispatch to idle workers, a bounded FIFO wait, dead workers out of dispatch."""

from __future__ import annotations

import asyncio

import pytest

from moed.serve.pool import NoWorker, QueueFull, QueueTimeout, WorkerPool, WorkerSlot


def pool_of(n: int, queue_bound: int = 2, interrupting: bool = False) -> WorkerPool:
    pool = WorkerPool("m", [WorkerSlot(i, f"/w{i}") for i in range(n)], queue_bound, interrupting)
    for slot in pool.slots:
        pool.set_ready(slot, True)
    return pool


def run(coro):
    return asyncio.run(coro)


def test_requests_go_to_idle_workers_then_wait_in_order_then_are_refused():
    async def scenario():
        pool = pool_of(2, queue_bound=2)
        a, b = await pool.take(), await pool.take()
        assert {a.index, b.index} == {0, 1}
        waiting = [asyncio.create_task(pool.take()) for _ in range(2)]
        await asyncio.sleep(0)
        assert pool.queued == 2
        with pytest.raises(QueueFull, match="2 requests wait"):
            await pool.take()
        pool.give_back(b)
        assert (await waiting[0]) is b and not waiting[1].done()  # first come, first served
        pool.give_back(a)
        assert (await waiting[1]) is a and pool.queued == 0

    run(scenario())


def test_a_waiter_that_leaves_is_skipped():
    async def scenario():
        pool = pool_of(1)
        held = await pool.take()
        leaving, staying = asyncio.create_task(pool.take()), asyncio.create_task(pool.take())
        await asyncio.sleep(0)
        leaving.cancel()
        await asyncio.sleep(0)
        pool.give_back(held)
        assert (await staying) is held

    run(scenario())


def test_a_dead_worker_is_out_of_dispatch_and_its_old_request_gives_nothing_back():
    async def scenario():
        pool = pool_of(1)
        async with pool.worker() as slot:
            pool.set_ready(slot, False)  # died under its request
            waiter = asyncio.create_task(pool.take())
            await asyncio.sleep(0)
            assert not waiter.done()
            pool.set_ready(slot, True)  # restarted: the waiter gets it
            assert (await waiter) is slot and slot.in_flight == 1
        assert slot.in_flight == 1  # the old request's exit did not free the new one's worker
        pool.give_back(slot)
        assert slot.in_flight == 0

    run(scenario())


def test_interrupting_sends_to_a_busy_worker_instead_of_waiting():
    async def scenario():
        pool = pool_of(2, queue_bound=0, interrupting=True)
        first, second = await pool.take(), await pool.take()
        third = await pool.take()  # no queue at all: to the least busy
        assert first is not second and third.in_flight == 2

    run(scenario())


def test_closing_fails_the_waiters():
    async def scenario():
        pool = pool_of(1)
        await pool.take()
        waiter = asyncio.create_task(pool.take())
        await asyncio.sleep(0)
        pool.close()
        with pytest.raises(NoWorker):
            await waiter
        with pytest.raises(NoWorker):
            await pool.take()

    run(scenario())


def test_a_request_waits_at_most_the_queue_timeout():
    async def scenario():
        pool = WorkerPool("m", [WorkerSlot(0, "/w0")], queue_bound=4, queue_timeout_s=0.05)  # never ready
        with pytest.raises(QueueTimeout, match="0 of 1 ready"):
            await pool.take()
        assert pool.queued == 0
        pool.set_ready(pool.slots[0], True)
        assert (await pool.take()) is pool.slots[0]  # the timed-out waiter got nothing

    run(scenario())
