"""Compute turns on the engine's side: a turn per decode, and the thread counts it brings.

What this module owns: a streamed engine's thread counts (`n_threads`, `n_threads_batch`)
while it runs on a daemon, and its turns (the rules are the daemon's, moed/daemon/turns.py).
Before each llama_decode, `ComputeTurns.take` asks the daemon for a turn with one round
trip and applies the counts granted with `llama_set_n_threads` when they change (the
engine's attributes follow, through `on_counts`); after the decode, `end` lets it go with a
fire-and-forget EndTurn (no second round trip).

Invariants:
- the engine computes with the counts each grant carries; the daemon grants a count the
  user gave (`n_threads=K`, K >= 1) as given while the engine is the only active one, and
  at most its share while others are (the operator's `turn_user_threads = "keep"`: always
  as given); the
  counts left to the daemon (None, 0 or negative) follow the split of the cores. A count
  above the wire's bound (`MAX_THREADS`), sent as the bound, is kept as given;
- a decode never fails for lack of a turn: with no daemon, a daemon without the verb
  (BadFrame: it is not asked again on that connection), any other error of the request,
  or `MOED_TURNS=0`, the engine computes with the counts it has;
- EndTurn goes only after a granted TakeTurn, on the connection that granted it, so a
  daemon that lacks the verb never sees one.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from moed.protocol import errors
from moed.protocol.messages import MAX_THREADS

COUNT_NAMES = ("n_threads", "n_threads_batch")


def own_count(value) -> int:
    """The user's count (>= 1), or 0 where it is left to the daemon (None, 0, negative).

    llama-cpp-python takes 0 as its default and passes a negative count on to llama.cpp,
    which computes it with GGML_DEFAULT_N_THREADS (4) whatever the box: neither is a count
    the user chose for this box, so the daemon decides both."""
    if value is None or isinstance(value, bool):
        return 0
    n = int(value)
    return n if n >= 1 else 0


def cpus() -> int:
    """The cores this process may run on (taskset, cgroup cpusets)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except OSError:
        return max(1, os.cpu_count() or 1)


class ComputeTurns:
    """One engine's turns on `client` (a moed.client.Client, or None: no turns at all).

    `threads`, `threads_batch`: the user's counts (`own_count`); `on_counts(n, n_batch)` is
    called when the counts applied change (the engine's attributes follow); `set_threads(ctx,
    n, n_batch)` applies them (llama.cpp's `llama_set_n_threads` unless given)."""

    def __init__(
        self,
        client,
        threads: int,
        threads_batch: int,
        on_counts: Callable[[int, int], None],
        set_threads: Callable[[object, int, int], None] | None = None,
    ):
        self.client = client
        self.set_threads = set_threads
        self.threads, self.threads_batch = threads, threads_batch
        self.on_counts = on_counts
        self.applied: tuple[int, int] | None = None  # the counts llama.cpp computes with
        self.held: int | None = None  # the connection (client generation) a held turn is on
        self.refused_on = None  # the HelloReply of a connection whose daemon has no turns
        self.enabled = client is not None and os.environ.get("MOED_TURNS", "1") != "0"
        self.turns = 0
        self.wait_s = 0.0

    @property
    def auto(self) -> bool:
        """Whether the daemon decides a count (the user gave not both)."""
        return not (self.threads and self.threads_batch)

    def take(self, ctx, batch: bool) -> None:
        """Before a decode: wait for a turn and compute with its counts (never raises for it)."""
        if not self.enabled or self.client.hello is self.refused_on:
            return
        try:
            got = self.client.take_turn(self.threads, self.threads_batch, cpus(), batch)
        except errors.BadFrame:  # an older daemon: no turns on this connection
            self.refused_on = self.client.hello
            return
        except errors.MoedError:  # no daemon now (its acquires will say so), or a refusal
            return
        self.held = self.client.generation
        self.turns += 1
        self.wait_s += got.waited_s
        self.apply(ctx, got.n_threads, got.n_threads_batch)

    def apply(self, ctx, n_threads: int, n_threads_batch: int) -> None:
        """Compute with the daemon's counts; llama_set_n_threads only when they change (it
        costs nothing, but the attributes follow only it)."""
        n, nb = _granted(self.threads, n_threads), _granted(self.threads_batch, n_threads_batch)
        if (n, nb) == self.applied:
            return
        if self.set_threads is None:
            import llama_cpp

            self.set_threads = llama_cpp.llama_set_n_threads
        self.set_threads(ctx, n, nb)
        self.applied = (n, nb)
        self.on_counts(n, nb)

    def end(self) -> None:
        """After a decode (also a failed one): let the turn go, if one is held."""
        held, self.held = self.held, None
        if held is None:
            return
        try:
            self.client.end_turn(generation=held)
        except errors.MoedError:  # the connection went: the daemon let the turn go with it
            pass

    def stats(self) -> dict:
        return {
            "turns": self.turns,
            "turn_wait_s": round(self.wait_s, 6),
            "threads_auto": self.auto,
        }


def _granted(own: int, granted: int) -> int:
    """The count to compute with: the grant, but a user's count above the wire's bound (sent
    as the bound, and granted back as it) as the user gave it."""
    if own > MAX_THREADS and granted == MAX_THREADS:
        return own
    return max(1, int(granted))


def check_counts(llama_kwargs: dict) -> tuple[int, int]:
    """The user's own counts from llama.cpp's keywords (TypeError for one that is not a whole
    number); a count left to the daemon is set to None there, so llama-cpp-python starts
    with its defaults until the first turn."""
    own = []
    for name in COUNT_NAMES:
        value = llama_kwargs.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be a whole number of threads (or None: moed decides), got {value!r}")
        n = own_count(value)
        if not n:
            llama_kwargs[name] = None
        own.append(n)
    return own[0], own[1]


__all__ = ["ComputeTurns", "check_counts", "cpus", "own_count"]
