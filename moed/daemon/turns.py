"""Compute turns: which engines compute now, and with how many threads.

What this module owns: the rules that share the box's cores among the engines of one
daemon (docs/design.md §11.1, "Cores shared by the engines"), as a pure, synchronous
state machine: no I/O, no asyncio and no clock of its own (every call is given `now`,
seconds of a monotonic clock). The turn desk (moed/daemon/turndesk.py) drives it from
the sessions and a timer. An engine asks for a turn before each llama_decode and lets it
go after; ggml's workers spin at barriers, so two engines whose threads together exceed
the cores run many times slower than one after the other (issue 46: 2.2-3.5 tok/s
against 20.9-26.7 on two vCPUs).

The rules:
- Threads. A count the engine's user gave (`threads` >= 1) is granted as it is while
  the engine is the only active one; while others are active it is the most the engine
  gets, `min(threads, cpus // active)` (`user_threads="ceiling"`, the default: ggml's
  workers gain little from a core another engine would otherwise use, so engines given
  every core compute side by side on their share instead of in turn; bench/threads.py
  measured 0.98x the per-core aggregate against about 0.2-0.5x taking turns). With
  `"keep"` a user's count is always granted as given, and such engines take turns. A count left to the daemon (0) is `cpus // active`, at least 1: `cpus` are the
  cores the engine may run on (its sched_getaffinity), `active` the engines that hold or
  wait for a turn now or asked for or let go of one within `idle_s`, itself included. So
  one active engine gets every core it may run on, N share them, and an engine idle for
  more than `idle_s` stops counting. Counts are computed when the turn is granted.
- Turns. A turn is granted at once when none waits ahead of it and the threads of the
  turns held now plus its own fit in its cores, or when no turn is held; otherwise it
  waits, first come first served. A turn is charged the threads its decode computes
  with (`threads_batch` for a batch of more than one token), at most `cpus`.
- Bounds (a tenant cannot hurt another). A turn held longer than `max_s` is overdue: it
  no longer counts in the cores computing, nor makes its engine active (once `idle_s`
  has passed since it was asked for); a turn waited for longer than `max_s` is granted
  whatever computes. So no engine waits much more than `max_s` for a turn, whatever
  another engine does, and a waiter is granted by `tick` at `next_deadline()` at the
  latest. What one connection makes this hold: one record, at most one turn held and
  one waited for (its connection has one request in flight), until `forget`.

Invariants: an engine holds a turn (`held_s` set), waits in `queue` (`asked_s` set), or
neither, never both; every mutating call returns the turns it granted (the driver
delivers them); `end` and `forget` of an engine holding nothing change nothing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TurnAsk:
    """What an engine tells with its request for a turn (the wire's TakeTurn)."""

    threads: int = 0  # its own n_threads; 0: the daemon's to decide
    threads_batch: int = 0  # its own n_threads_batch; 0: the daemon's to decide
    cpus: int = 1  # the cores it may run on (len(sched_getaffinity(0)) in the engine)
    batch: bool = False  # this decode computes more than one token (llama.cpp uses threads_batch)


@dataclass(frozen=True)
class TurnGrant:
    """A turn granted: the counts to compute with, and how long it waited."""

    key: Hashable
    n_threads: int
    n_threads_batch: int
    waited_s: float
    waited: bool  # it was queued (not granted when asked)


@dataclass
class Totals:
    """Turns counted: one engine's (EngineTurns.counts) or, since the daemon started,
    every connection's, closed ones included (Turns.totals, for stats)."""

    turns: int = 0
    turn_waits: int = 0
    turn_wait_s: float = 0.0
    turns_overdue: int = 0

    def granted(self, waited_s: float | None) -> None:
        """A turn given; `waited_s`: how long it was queued (None: granted when asked)."""
        self.turns += 1
        if waited_s is not None:
            self.turn_waits += 1
            self.turn_wait_s += waited_s


@dataclass(eq=False)
class EngineTurns:
    """One engine's (one connection's) turns: what it asked, holds, and has been given."""

    key: Hashable
    ask: TurnAsk = TurnAsk()
    last_s: float = 0.0  # when it last asked for or let go of a turn
    asked_s: float | None = None  # waiting since (None: not waiting)
    held_s: float | None = None  # holding since (None: not holding)
    charge: int = 0  # threads its held turn counts for
    overdue: bool = False  # its held turn ran past max_s
    n_threads: int = 0  # the counts of its last grant (0: none yet)
    n_threads_batch: int = 0
    counts: Totals = field(default_factory=Totals)  # its own; Turns.totals counts them all


@dataclass
class Turns:
    idle_s: float = 1.0
    max_s: float = 2.0
    user_threads: str = "ceiling"  # "ceiling": a user's count is at most the share; "keep": granted as it is
    engines: dict[Hashable, EngineTurns] = field(default_factory=dict)
    queue: deque = field(default_factory=deque)  # keys waiting, first come first
    totals: Totals = field(default_factory=Totals)
    _asking: Hashable = None  # the key whose `take` is granting now (its grant waited for nothing)

    # ---- what the sessions call --------------------------------------------------

    def take(self, key: Hashable, ask: TurnAsk, now: float) -> list[TurnGrant]:
        """`key` asks for a turn (a turn it still holds is let go first: one at a time)."""
        e = self.engines.get(key)
        if e is None:
            e = self.engines[key] = EngineTurns(key)
        if e.held_s is not None:
            self._let_go(e, now)
        if e.asked_s is None:
            self.queue.append(key)
        e.ask, e.asked_s, e.last_s = ask, now, now
        self._asking = key
        try:
            return self._grant(now)
        finally:
            self._asking = None

    def end(self, key: Hashable, now: float) -> list[TurnGrant]:
        """`key` lets its turn go (nothing if it holds none)."""
        e = self.engines.get(key)
        if e is None or e.held_s is None:
            return []
        self._let_go(e, now)
        return self._grant(now)

    def forget(self, key: Hashable, now: float) -> list[TurnGrant]:
        """`key`'s connection closed: its turn, its wait and its record go."""
        e = self.engines.pop(key, None)
        if e is None:
            return []
        if e.asked_s is not None:
            self.queue.remove(key)
        return self._grant(now)

    def tick(self, now: float) -> list[TurnGrant]:
        """Time passed: turns that went overdue, or waits that did, may let others in."""
        return self._grant(now)

    def holding(self, key: Hashable) -> TurnAsk | None:
        """What `key` asked with, if it holds a turn now."""
        e = self.engines.get(key)
        return e.ask if e is not None and e.held_s is not None else None

    # ---- the rules -----------------------------------------------------------------

    def counts(self, ask: TurnAsk, now: float) -> tuple[int, int]:
        """(n_threads, n_threads_batch) for `ask` now: the user's, or the cores' share."""
        active = max(1, self.active(now))
        share = max(1, ask.cpus // active)
        if self.user_threads == "ceiling" and active > 1:  # alone, a user's count is granted as given
            return (min(ask.threads, share) or share, min(ask.threads_batch, share) or share)
        return (ask.threads or share, ask.threads_batch or share)

    def active(self, now: float) -> int:
        """Engines holding or waiting for a turn, or that let one go within idle_s."""
        return sum(1 for e in self.engines.values() if self._is_active(e, now))

    def _is_active(self, e: EngineTurns, now: float) -> bool:
        # An overdue turn counts against no one, for threads either (a hung engine holds one forever).
        holds = e.held_s is not None and not (e.overdue or now - e.held_s > self.max_s)
        return holds or e.asked_s is not None or now - e.last_s <= self.idle_s

    def computing(self, now: float) -> int:
        """Threads of the turns held now that still count (not overdue)."""
        busy = 0
        for e in self.engines.values():
            if e.held_s is None or e.overdue:
                continue
            if now - e.held_s > self.max_s:  # it no longer blocks anyone (counted once)
                e.overdue = True
                for t in (e.counts, self.totals):
                    t.turns_overdue += 1
                continue
            busy += e.charge
        return busy

    def _grant(self, now: float) -> list[TurnGrant]:
        out = []
        while self.queue:
            e = self.engines[self.queue[0]]
            assert e.asked_s is not None
            n, nb = self.counts(e.ask, now)
            charge = max(1, min(nb if e.ask.batch else n, e.ask.cpus))
            busy = self.computing(now)
            waited_out = now - e.asked_s > self.max_s
            if busy and busy + charge > e.ask.cpus and not waited_out:
                break
            self.queue.popleft()
            out.append(self._give(e, n, nb, charge, now))
        return out

    def _give(self, e: EngineTurns, n: int, nb: int, charge: int, now: float) -> TurnGrant:
        assert e.asked_s is not None
        waited_s, waited = now - e.asked_s, e.key != self._asking
        e.asked_s, e.held_s, e.charge, e.overdue = None, now, charge, False
        e.n_threads, e.n_threads_batch = n, nb
        for t in (e.counts, self.totals):
            t.granted(waited_s if waited else None)
        return TurnGrant(e.key, n, nb, waited_s, waited)

    def _let_go(self, e: EngineTurns, now: float) -> None:
        e.held_s, e.charge, e.overdue, e.last_s = None, 0, False, now

    def next_deadline(self) -> float | None:
        """When time alone may let a waiter in: the first held turn going overdue, or the
        first wait running out (None: nothing waits)."""
        if not self.queue:
            return None
        times = [e.held_s + self.max_s for e in self.engines.values() if e.held_s is not None and not e.overdue]
        times += [e.asked_s + self.max_s for e in self.engines.values() if e.asked_s is not None]
        return min(times) if times else None

    def row(self, e: EngineTurns, now: float) -> dict:
        """The stats row of one engine (moed.protocol.stats.TurnRow's fields, less the
        connection's own: connection, pid, uid, name)."""
        return {
            "cpus": e.ask.cpus,
            "threads": e.n_threads,
            "threads_batch": e.n_threads_batch,
            "auto": not (e.ask.threads and e.ask.threads_batch),
            "computing": e.held_s is not None,
            "waiting": e.asked_s is not None,
            "active": self._is_active(e, now),
            "turns": e.counts.turns,
            "turn_waits": e.counts.turn_waits,
            "turn_wait_s": round(e.counts.turn_wait_s, 6),
            "turns_overdue": e.counts.turns_overdue,
        }


__all__ = ["EngineTurns", "TurnGrant", "TurnAsk", "Turns", "Totals"]
