"""WorkerSupervisor: one engine worker process, started, watched, restarted and stopped.

What this module owns: the life of one worker (`python -m moed.serve.worker SPEC
INDEX`, llama-cpp-python's server on one model, listening on a Unix socket in the
front's private run directory) and its `WorkerSlot`'s readiness in the pool.

Invariants:
- a worker is in dispatch (`ready`) only from its first answer to GET /v1/models
  until its process is seen to exit;
- a worker that exits while the front runs is started again after a backoff that
  doubles from `backoff_s` to `max_backoff_s` for each start that did not stay up
  `stable_s`, and falls back to `backoff_s` after one that did: a model that
  cannot load does not spin, and one crash after a day waits half a second;
- `stop()` sends SIGTERM (the worker's uvicorn finishes its request, its model
  closes and the daemon releases what it held), then SIGKILL after the grace;
- a worker never outlives the front: it asks the kernel for SIGTERM when its
  parent dies (PR_SET_PDEATHSIG, moed.serve.worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from dataclasses import dataclass

import httpx2 as httpx

from moed.serve.pool import WorkerPool, WorkerSlot


@dataclass(frozen=True)
class Backoff:
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    stable_s: float = 30.0

    def delay_s(self, failed_starts: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** max(0, failed_starts - 1))


class WorkerFailed(RuntimeError):
    """A worker exited before it was ready (at the front's start: the server does not start)."""


def _exit_text(rc: int) -> str:
    return f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"


class WorkerSupervisor:
    """Runs one worker for `pool` as `slot` (see module)."""

    def __init__(self, pool: WorkerPool, slot: WorkerSlot, spec_path: str, backoff: Backoff = Backoff()):
        self.pool, self.slot, self.spec_path, self.backoff = pool, slot, spec_path, backoff
        self.proc: asyncio.subprocess.Process | None = None
        self.stopping = False
        self._first_ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"worker {self.pool.model}#{self.slot.index}")

    async def ready(self) -> None:
        """Wait for the first start to answer (raises WorkerFailed if it exits first)."""
        await asyncio.shield(self._first_ready)

    async def _run(self) -> None:
        failed_starts = 0
        while not self.stopping:
            started = time.monotonic()
            rc = await self._one_life()
            if self.stopping:
                return
            self.slot.last_exit = _exit_text(rc)
            print(
                f"moectl serve: worker {self.slot.index} of {self.pool.model} ({self.slot.pid}) "
                f"ended ({self.slot.last_exit}); restarting",
                file=sys.stderr,
                flush=True,
            )
            failed_starts = 1 if time.monotonic() - started >= self.backoff.stable_s else failed_starts + 1
            await asyncio.sleep(self.backoff.delay_s(failed_starts))
            self.slot.restarts += 1

    async def _one_life(self) -> int:
        # A session of its own: a terminal's Ctrl-C (or a group kill) reaches the front,
        # which drains and then stops its workers; not the workers under their requests.
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "moed.serve.worker", self.spec_path, str(self.slot.index), start_new_session=True
        )
        self.slot.pid = self.proc.pid
        waiting = asyncio.create_task(self.proc.wait())
        answered = asyncio.create_task(self._answers())
        await asyncio.wait({waiting, answered}, return_when=asyncio.FIRST_COMPLETED)
        if answered.done() and not answered.exception():
            self.pool.set_ready(self.slot, True)
            if not self._first_ready.done():
                self._first_ready.set_result(None)
        answered.cancel()
        rc = await waiting
        self.pool.set_ready(self.slot, False)
        if not self._first_ready.done():
            self._first_ready.set_exception(
                WorkerFailed(
                    f"worker {self.slot.index} of {self.pool.model} ended before it was ready ({_exit_text(rc)})"
                )
            )
        return rc

    async def _answers(self) -> None:
        """Return once the worker answers GET /v1/models on its socket."""
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=self.slot.address)) as http:
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get("http://worker/v1/models", timeout=5)).status_code == 200:
                        return
                await asyncio.sleep(0.05)

    def drain(self) -> None:
        """The server stops: this worker finishes what it serves, and is not restarted if it ends."""
        self.stopping = True

    async def stop(self, grace_s: float) -> None:
        """SIGTERM, then SIGKILL after `grace_s`; returns once the process is gone."""
        self.stopping = True
        if self._task is not None:
            self._task.cancel()
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


__all__ = ["Backoff", "WorkerFailed", "WorkerSupervisor"]
