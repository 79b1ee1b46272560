"""The turn desk: compute turns (moed/daemon/turns.py) driven from the sessions and a timer.

What this module owns: the futures of the sessions waiting for a turn, the one timer that
lets time-bound turns in (`Turns.next_deadline`), and the turn an acquire let go while it
waited on reads. It runs on the event loop only; the rules are the pure `Turns`'.

What must happen when:
- a session's TakeTurn is answered at once when granted, or awaits its future; every
  mutation of `Turns` delivers the grants it returned before anything else runs;
- an acquire that must wait on reads or room lets its connection's turn go first
  (`let_go_for_read`), so another engine computes while this one reads, and takes it back,
  queued like any other, before its Granted goes out (`take_back`);
- a connection that closes is forgotten (`forget`): its turn, its wait and its record go,
  and what it held is granted to the next.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Hashable
from typing import Any

from moed.protocol import messages as m

from .turns import TurnAsk, TurnGrant, Turns


class TurnDesk:
    def __init__(self, loop: asyncio.AbstractEventLoop, idle_s: float, max_s: float, user_threads: str = "ceiling"):
        self.loop = loop
        self.turns = Turns(idle_s=idle_s, max_s=max_s, user_threads=user_threads)
        self.waiters: dict[Hashable, asyncio.Future] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_for: float | None = None  # the deadline the timer is armed for
        # time.monotonic, not loop.time(): uvloop's is cached per iteration in whole
        # milliseconds, and a hand-off between two engines takes less than one.
        self.clock = time.monotonic

    def take(self, key: Hashable, ask: TurnAsk) -> m.TurnGranted | Coroutine:
        """The reply to a TakeTurn: now, or a coroutine that waits for it."""
        mine = self._deliver(self.turns.take(key, ask, self.clock()), key)
        if mine is not None:
            return _reply(mine)
        future = self.waiters[key] = self.loop.create_future()
        return self._wait(key, future)

    async def _wait(self, key: Hashable, future: asyncio.Future) -> m.TurnGranted:
        try:
            return _reply(await future)
        finally:
            if self.waiters.get(key) is future:
                del self.waiters[key]

    def end(self, key: Hashable) -> None:
        self._deliver(self.turns.end(key, self.clock()))

    def let_go_for_read(self, key: Hashable) -> TurnAsk | None:
        """`key` waits on reads: its turn goes to the next; what it asked with, to take it back."""
        ask = self.turns.holding(key)
        if ask is not None:
            self.end(key)
        return ask

    async def take_back(self, key: Hashable, ask: TurnAsk) -> None:
        got = self.take(key, ask)
        if not isinstance(got, m.TurnGranted):
            await got

    def forget(self, key: Hashable) -> None:
        future = self.waiters.pop(key, None)
        if future is not None and not future.done():
            future.cancel()
        self._deliver(self.turns.forget(key, self.clock()))

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._timer_for = None

    # ---- delivery and the timer ---------------------------------------------------

    def _deliver(self, grants: list[TurnGrant], key: Hashable = None) -> TurnGrant | None:
        """Wake the waiters granted; return `key`'s own grant, if it is among them."""
        mine = None
        for g in grants:
            if g.key == key:
                mine = g
                continue
            future = self.waiters.get(g.key)
            if future is not None and not future.done():
                future.set_result(g)
        self._arm()
        return mine

    def _arm(self) -> None:
        when = self.turns.next_deadline()
        if self._timer is not None and when != self._timer_for:
            self._timer.cancel()
            self._timer = None
        if when is not None and self._timer is None:
            # A little past the deadline, so the bound has passed when tick looks.
            delay_s = max(0.0, when - self.clock()) + 0.001
            self._timer, self._timer_for = self.loop.call_later(delay_s, self._tick), when

    def _tick(self) -> None:
        self._timer = self._timer_for = None
        self._deliver(self.turns.tick(self.clock()))

    # ---- stats -----------------------------------------------------------------------

    def stats(self) -> dict:
        t, now = self.turns.totals, self.clock()
        return {
            "turns": t.turns,
            "turn_waits": t.turn_waits,
            "turn_wait_s": round(t.turn_wait_s, 6),
            "turns_overdue": t.turns_overdue,
            "engines_active": self.turns.active(now),
        }

    def rows(self) -> list[dict]:
        """One row per connection that took a turn (moed.protocol.stats.TurnRow)."""
        now = self.clock()
        rows = []
        for e in self.turns.engines.values():
            session: Any = e.key  # a Session: the connection's own fields
            own = {"connection": session.number, "pid": session.pid, "uid": session.uid, "name": session.name}
            rows.append(own | self.turns.row(e, now))
        return rows


def _reply(g: TurnGrant) -> m.TurnGranted:
    return m.TurnGranted(g.n_threads, g.n_threads_batch, round(g.waited_s, 6))


__all__ = ["TurnDesk"]
