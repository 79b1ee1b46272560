"""Model opens off the event loop: bounded per tenant, deadlined, never joined at exit.

Parsing a model's headers reads the file, and a file can hang its reader (a
stuck network filesystem, a device). Opens are non-blocking where the kernel
allows (`moed.gguf.header.open_regular`), and what remains runs here:

- each open runs in its own daemon thread, so no pool can be used up by one
  kind of bad file and shutdown never waits on a thread that hangs;
- a tenant has at most `max_opens_per_tenant` opens in flight, counted until
  the thread really returns (an open that timed out still counts), so a hung
  file ties up at most that many threads per tenant; one more is `TooBusy`;
- the caller waits at most `open_timeout_s`, then gets `BadModelFile`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

from moed.protocol import errors

T = TypeVar("T")


class Opener:
    def __init__(self, max_per_tenant: int, timeout_s: float):
        self.max_per_tenant = max_per_tenant
        self.timeout_s = timeout_s
        self.in_flight = 0

    async def run(self, tenant, what: str, fn: Callable[..., T], *args) -> T:
        if tenant is not None and tenant.opens_in_flight >= self.max_per_tenant:
            raise errors.TooBusy(
                f"uid {tenant.uid} already has {tenant.opens_in_flight} model opens in flight "
                f"(max_opens_per_tenant is {self.max_per_tenant}); retry when they finish",
                busy="opens",
            )
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._count(tenant, +1)
        thread = threading.Thread(target=self._work, args=(loop, fut, tenant, fn, args), name="moed-open", daemon=True)
        thread.start()
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
        except TimeoutError:
            raise errors.BadModelFile(
                f"{what}: opening took longer than {self.timeout_s}s (a hung file or filesystem?)"
            ) from None

    def _count(self, tenant, delta: int) -> None:
        self.in_flight += delta
        if tenant is not None:
            tenant.opens_in_flight += delta

    def _work(self, loop, fut, tenant, fn, args) -> None:
        try:
            result, err = fn(*args), None
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting request
            result, err = None, exc
        try:
            loop.call_soon_threadsafe(self._settle, fut, tenant, result, err)
        except RuntimeError:
            pass  # the loop is closed: the daemon is gone, nobody waits

    def _settle(self, fut, tenant, result, err) -> None:
        self._count(tenant, -1)
        if fut.done():  # the caller timed out or went away
            return
        if err is not None:
            fut.set_exception(err)
        else:
            fut.set_result(result)
