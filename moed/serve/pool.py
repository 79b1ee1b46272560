"""WorkerPool: which worker of a model takes the next request, and who waits.

What this module owns: the dispatch state of one model's workers, on the front's
event loop (no I/O, no processes: moed.serve.supervisor starts and watches them).

Invariants:
- a ready worker is either idle or busy with exactly one request (llama.cpp runs
  one at a time per model; a second would only wait behind the first's locks,
  where no other worker could take it);
- requests wait in arrival order, at most `queue_bound` of them; one more is
  refused at once (`QueueFull`: the front answers 503 with Retry-After), and one
  that waited `queue_timeout_s` is refused then (`QueueTimeout`), so a request
  never hangs: not behind an unbounded queue, nor on a model whose workers keep
  failing to start;
- with `interrupting` (the operator's `interrupt_requests`), nothing waits here:
  a request goes to the least busy ready worker, whose server cuts its running
  stream (ending it with finish_reason "interrupted");
- a worker that dies is taken out of dispatch until it is ready again; the
  request it held is failed by the front, not re-sent (it may have run halfway).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass


class QueueFull(Exception):
    """Every worker is busy and `queue_bound` requests already wait."""


class QueueTimeout(QueueFull):
    """A request waited `queue_timeout_s` for a worker (all busy, or none alive: a model that keeps failing)."""


class NoWorker(Exception):
    """No worker of the model is ready, and none is starting (the pool is stopping)."""


@dataclass(eq=False)
class WorkerSlot:
    """A worker as dispatch sees it; `address` is where the front reaches it."""

    index: int
    address: str
    ready: bool = False
    in_flight: int = 0
    served: int = 0
    restarts: int = 0
    pid: int | None = None
    last_exit: str = ""
    generation: int = 0  # one per life of the process: a request of an earlier life gives nothing back


class WorkerPool:
    """One model's workers, its wait queue and its bound (see module)."""

    def __init__(
        self,
        model: str,
        slots: list[WorkerSlot],
        queue_bound: int,
        interrupting: bool = False,
        queue_timeout_s: float | None = None,
    ):
        self.model, self.slots, self.queue_bound, self.interrupting = model, slots, queue_bound, interrupting
        self.queue_timeout_s = queue_timeout_s
        self._waiters: deque[asyncio.Future[WorkerSlot]] = deque()
        self.closed = False

    @property
    def queued(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    @property
    def in_flight(self) -> int:
        return sum(s.in_flight for s in self.slots)

    def _idle(self) -> WorkerSlot | None:
        ready = [s for s in self.slots if s.ready and s.in_flight == 0]
        return min(ready, key=lambda s: s.served) if ready else None

    def _take(self, slot: WorkerSlot) -> WorkerSlot:
        slot.in_flight += 1
        slot.served += 1
        return slot

    async def take(self) -> WorkerSlot:
        """The worker for the next request (waiting in line for one if all are busy)."""
        if self.closed:
            raise NoWorker(f"model {self.model}: the server is stopping")
        if self.interrupting:
            ready = [s for s in self.slots if s.ready]
            if ready:
                return self._take(min(ready, key=lambda s: s.in_flight))
        elif (idle := self._idle()) is not None and not self.queued:
            return self._take(idle)
        if self.queued >= self.queue_bound:
            raise QueueFull(
                f"all {len(self.slots)} workers of model {self.model} are busy and {self.queued} requests wait"
            )
        waiter: asyncio.Future[WorkerSlot] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), self.queue_timeout_s)
        except TimeoutError:
            if waiter.done():
                return waiter.result()  # granted at the deadline
            waiter.cancel()
            raise QueueTimeout(
                f"waited {self.queue_timeout_s:g} s for a worker of model {self.model} "
                f"({sum(s.ready for s in self.slots)} of {len(self.slots)} ready)"
            ) from None
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.give_back(waiter.result())  # granted as the request left: pass it on
            else:
                waiter.cancel()
            raise

    def give_back(self, slot: WorkerSlot) -> None:
        slot.in_flight -= 1
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand idle ready workers to the longest waiters (called whenever one frees or becomes ready)."""
        while self._waiters:
            if self._waiters[0].done():  # cancelled while waiting
                self._waiters.popleft()
                continue
            idle = self._idle() if not self.interrupting else next((s for s in self.slots if s.ready), None)
            if idle is None:
                return
            self._waiters.popleft().set_result(self._take(idle))

    def set_ready(self, slot: WorkerSlot, ready: bool) -> None:
        if slot.ready and not ready:
            slot.generation += 1
            slot.in_flight = 0  # its request fails with it (the front sees the connection end)
        slot.ready = ready
        self._dispatch()

    def close(self) -> None:
        """Stop dispatch: the waiting requests fail with NoWorker."""
        self.closed = True
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_exception(NoWorker(f"model {self.model}: the server is stopping"))

    @contextlib.asynccontextmanager
    async def worker(self) -> AsyncIterator[WorkerSlot]:
        slot = await self.take()
        life = slot.generation
        try:
            yield slot
        finally:
            if slot.generation == life:
                self.give_back(slot)


__all__ = ["NoWorker", "QueueFull", "QueueTimeout", "WorkerPool", "WorkerSlot"]
