"""The engine's side of compute turns (moed.engines.turns): the thread counts users pass, and
what the engine does when the daemon has no turns to give (the daemon's side with a real
daemon: tests/integration/test_turns.py and tests/e2e/test_threads.py)."""

from __future__ import annotations

import pytest

from moed.engines.turns import ComputeTurns, check_counts, own_count
from moed.protocol import errors
from moed.protocol import messages as m
from moed.protocol.messages import MAX_THREADS


@pytest.mark.parametrize(("value", "own"), [(None, 0), (0, 0), (-1, 0), (-8, 0), (1, 1), (4, 4), (10**9, 10**9)])
def test_own_count(value, own):
    assert own_count(value) == own


def test_check_counts_leaves_the_daemons_to_llama_cpp_python_defaults():
    kwargs = {"n_threads": -1, "n_threads_batch": 3}
    assert check_counts(kwargs) == (0, 3)
    assert kwargs == {"n_threads": None, "n_threads_batch": 3}
    empty: dict = {}
    assert check_counts(empty) == (0, 0)
    assert empty == {"n_threads": None, "n_threads_batch": None}


@pytest.mark.parametrize("bad", ["4", 4.5, True])
def test_check_counts_refuses_what_is_not_a_count(bad):
    with pytest.raises(TypeError, match="n_threads must be a whole number"):
        check_counts({"n_threads": bad})


# ---- when the daemon gives no turn: the decode goes on with the counts it has -------------


class Connection:
    """What ComputeTurns uses of a moed.client.Client: take_turn, end_turn, hello, generation;
    `refuse` (an exception) is what take_turn raises instead of granting."""

    def __init__(self, refuse: Exception | None = None, grant=(2, 2)):
        self.refuse, self.grant = refuse, grant
        self.hello, self.generation = object(), 1
        self.asked: list[tuple] = []
        self.ended: list[int | None] = []

    def take_turn(self, threads, threads_batch, cpus, batch):
        self.asked.append((threads, threads_batch, cpus, batch))
        if self.refuse is not None:
            raise self.refuse
        return m.TurnGranted(*self.grant)

    def end_turn(self, generation=None):
        self.ended.append(generation)

    def reconnected(self) -> None:
        self.hello, self.generation = object(), self.generation + 1


def engine(conn, threads=0, threads_batch=0):
    applied: list[tuple[int, int]] = []
    counts: list[tuple[int, int]] = []
    t = ComputeTurns(
        conn, threads, threads_batch, lambda n, nb: counts.append((n, nb)), lambda ctx, n, nb: applied.append((n, nb))
    )
    return t, applied, counts


def test_granted_counts_are_applied_once_and_the_attributes_follow():
    conn = Connection(grant=(1, 1))
    t, applied, counts = engine(conn)
    for _ in range(3):
        t.take(None, batch=False)
        t.end()
    assert applied == counts == [(1, 1)]  # llama_set_n_threads only when they change
    assert conn.ended == [1, 1, 1] and t.turns == 3


def test_the_engine_computes_with_what_the_daemon_grants():
    conn = Connection(grant=(4, 1))  # the daemon keeps the user's 4 and gives 1 for the batches
    t, applied, _ = engine(conn, threads=4)
    t.take(None, batch=True)
    assert applied == [(4, 1)] and conn.asked == [(4, 0, conn.asked[0][2], True)]


def test_a_count_past_the_wires_bound_stays_as_given():
    conn = Connection(grant=(MAX_THREADS, 2))
    t, applied, _ = engine(conn, threads=10**6)
    t.take(None, batch=False)
    assert applied == [(10**6, 2)]


def test_a_daemon_without_turns_is_not_asked_again_on_that_connection():
    conn = Connection(refuse=errors.BadFrame("unknown tag 'take_turn'"))
    t, applied, _ = engine(conn)
    t.take(None, batch=False)
    t.end()
    t.take(None, batch=False)
    assert len(conn.asked) == 1 and conn.ended == [] and applied == []  # no EndTurn it would not know
    conn.reconnected()  # another daemon (perhaps a newer one) answers now: ask it
    t.take(None, batch=False)
    assert len(conn.asked) == 2


@pytest.mark.parametrize("refusal", [errors.DaemonUnavailable("gone"), errors.TimedOut("closed")])
def test_no_turn_no_failure(refusal):
    conn = Connection(refuse=refusal)
    t, applied, _ = engine(conn)
    t.take(None, batch=False)  # does not raise: the decode computes with what it has
    t.end()
    assert conn.ended == [] and applied == [] and t.turns == 0


def test_the_turn_ends_on_the_connection_that_granted_it():
    conn = Connection()
    t, _, _ = engine(conn)
    t.take(None, batch=False)
    conn.reconnected()
    t.end()
    assert conn.ended == [1]  # the client refuses a stale generation: nothing reaches the new daemon


def test_turns_off(monkeypatch):
    monkeypatch.setenv("MOED_TURNS", "0")
    conn = Connection()
    t, applied, _ = engine(conn)
    t.take(None, batch=False)
    assert conn.asked == [] and applied == []
