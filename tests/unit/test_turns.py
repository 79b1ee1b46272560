"""The compute-turn rules (moed.daemon.turns): thread counts, who computes when, the bounds,
with the values users pass (the engine's side: tests/unit/test_engine_turns.py)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from moed.daemon.turns import TurnAsk, Turns

IDLE_S, MAX_S = 1.0, 2.0


def turns() -> Turns:
    """The turn rules with a user's count kept as given (the mechanics of waiting)."""
    return Turns(idle_s=IDLE_S, max_s=MAX_S, user_threads="keep")


def granted(grants, key) -> tuple[int, int] | None:
    return next(((g.n_threads, g.n_threads_batch) for g in grants if g.key == key), None)


def test_one_engine_alone_gets_every_core():
    t = turns()
    assert granted(t.take("a", TurnAsk(cpus=8), 0.0), "a") == (8, 8)


def test_active_engines_split_the_cores_and_an_idle_one_drops_out():
    t = turns()
    assert granted(t.take("a", TurnAsk(cpus=8), 0.0), "a") == (8, 8)
    t.end("a", 0.1)
    assert granted(t.take("b", TurnAsk(cpus=8), 0.2), "b") == (4, 4)  # a let go 0.1 s ago: active
    t.end("b", 0.3)
    assert granted(t.take("a", TurnAsk(cpus=8), 0.4), "a") == (4, 4)
    t.end("a", 0.5)
    # b's last turn ended 1.2 s before: it no longer counts
    assert granted(t.take("a", TurnAsk(cpus=8), 1.5), "a") == (8, 8)
    assert t.active(1.5) == 1


def test_more_engines_than_cores_get_one_thread_each_and_at_most_cores_compute():
    t = turns()
    got = []
    for i, key in enumerate("abcd"):
        got += t.take(key, TurnAsk(cpus=2), i * 0.01)
    assert [(g.key, g.n_threads) for g in got] == [("a", 2)]  # alone when it asked: every core
    got = t.end("a", 0.05)
    assert [(g.key, g.n_threads, g.n_threads_batch) for g in got] == [("b", 1, 1), ("c", 1, 1)]
    assert t.computing(0.05) == 2 and list(t.queue) == ["d"]


@pytest.mark.parametrize("threads", [1, 3, 2, 10**6])
def test_the_users_count_stays_the_users(threads):
    t = turns()
    t.take("other", TurnAsk(cpus=2), 0.0)
    t.end("other", 0.0)
    g = t.take("mine", TurnAsk(threads=threads, threads_batch=threads, cpus=2), 0.1)
    assert granted(g, "mine") == (threads, threads)


def test_by_default_a_users_count_is_kept_alone_and_a_ceiling_among_others():
    t = Turns(idle_s=IDLE_S, max_s=MAX_S)
    alone = TurnAsk(threads=3, threads_batch=3, cpus=2)
    assert granted(t.take("a", alone, 0.0), "a") == (3, 3)  # the only engine: as given, past the cores too
    t.end("a", 0.0)
    assert granted(t.take("b", TurnAsk(threads=2, threads_batch=2, cpus=2), 0.1), "b") == (1, 1)  # a is active


def test_as_a_ceiling_the_users_count_is_the_most_it_gets():
    t = Turns(idle_s=IDLE_S, max_s=MAX_S, user_threads="ceiling")
    k = TurnAsk(threads=2, threads_batch=2, cpus=2)
    assert granted(t.take("a", k, 0.0), "a") == (2, 2)  # alone: all it asked for
    assert granted(t.take("b", k, 0.1), "b") is None  # a computes on both cores: b waits
    got = t.end("a", 0.2)
    assert granted(got, "b") == (1, 1)  # two active: the share
    assert granted(t.take("a", k, 0.3), "a") == (1, 1)  # side by side, one core each
    assert granted(t.take("c", TurnAsk(threads=1, threads_batch=1, cpus=2), 0.4), "c") is None


def test_only_the_count_left_out_follows_the_daemon():
    t = turns()
    t.take("other", TurnAsk(cpus=4), 0.0)
    t.end("other", 0.0)
    assert granted(t.take("mine", TurnAsk(threads=3, cpus=4), 0.1), "mine") == (3, 2)


def test_turns_fit_in_the_cores_else_first_come_first_served():
    t = turns()
    k = TurnAsk(threads=2, threads_batch=2, cpus=2)
    assert granted(t.take("a", k, 0.0), "a") == (2, 2)
    assert t.take("b", k, 0.1) == []  # 2 + 2 > 2 cores: waits
    assert t.take("c", TurnAsk(threads=1, threads_batch=1, cpus=2), 0.2) == []  # behind b, even though 1 fits
    got = t.end("a", 0.3)
    assert [g.key for g in got] == ["b"]
    assert got[0].waited and got[0].waited_s == pytest.approx(0.2)
    assert [g.key for g in t.end("b", 0.4)] == ["c"]


def test_small_turns_compute_side_by_side():
    t = turns()
    one = TurnAsk(threads=1, threads_batch=1, cpus=2)
    assert granted(t.take("a", one, 0.0), "a") == (1, 1)
    assert granted(t.take("b", one, 0.0), "b") == (1, 1)
    assert t.take("c", one, 0.0) == []


def test_a_batch_is_charged_its_batch_threads():
    t = turns()
    assert t.take("a", TurnAsk(threads=1, threads_batch=2, cpus=2, batch=True), 0.0)
    assert t.take("b", TurnAsk(threads=1, threads_batch=2, cpus=2, batch=False), 0.0) == []
    assert t.computing(0.0) == 2


def test_a_turn_held_too_long_no_longer_blocks():
    t = turns()
    k = TurnAsk(threads=2, threads_batch=2, cpus=2)
    t.take("hog", k, 0.0)
    assert t.take("b", k, 1.0) == []
    assert t.next_deadline() == pytest.approx(MAX_S)
    assert t.tick(MAX_S - 0.01) == []
    assert [g.key for g in t.tick(MAX_S + 0.01)] == ["b"]
    assert t.engines["hog"].counts.turns_overdue == 1 and t.totals.turns_overdue == 1
    # the hog still holds, overdue: b's next turn is granted at once
    t.end("b", 2.1)
    assert granted(t.take("b", k, 2.2), "b") == (2, 2)


def test_a_wait_is_bounded_whatever_computes():
    t = turns()
    one = TurnAsk(threads=1, threads_batch=1, cpus=2)
    t.take("h1", one, 0.0)
    t.take("h2", one, 0.0)
    assert t.take("b", TurnAsk(threads=2, threads_batch=2, cpus=2), 0.5) == []
    t.end("h1", 0.6)
    assert t.take("h1", one, 0.6) == []  # queued behind b: nobody passes a waiter
    assert t.next_deadline() == pytest.approx(MAX_S)  # h2's turn goes overdue
    got = t.tick(MAX_S + 0.01)
    assert [g.key for g in got] == ["b"] and got[0].waited_s <= MAX_S


def test_a_closed_connection_gives_its_turn_to_the_next():
    t = turns()
    k = TurnAsk(threads=2, threads_batch=2, cpus=2)
    t.take("a", k, 0.0)
    t.take("b", k, 0.0)
    t.take("c", k, 0.0)
    assert [g.key for g in t.forget("a", 0.1)] == ["b"]
    assert t.forget("c", 0.2) == []  # waiting: leaves the queue
    assert list(t.queue) == [] and set(t.engines) == {"b"}
    assert t.forget("nobody", 0.3) == [] and t.end("nobody", 0.3) == []


def test_asking_again_while_holding_lets_the_first_turn_go():
    t = turns()
    k = TurnAsk(threads=2, threads_batch=2, cpus=2)
    t.take("a", k, 0.0)
    assert granted(t.take("a", k, 0.1), "a") == (2, 2)
    assert t.engines["a"].counts.turns == 2 and t.computing(0.1) == 2


def test_the_stats_row_says_what_the_engine_has():
    t = turns()
    t.take("a", TurnAsk(threads=2, threads_batch=2, cpus=2), 0.0)
    t.take("b", TurnAsk(cpus=2), 0.0)
    rows = {e.key: t.row(e, 0.5) for e in t.engines.values()}
    assert rows["a"]["computing"] and not rows["a"]["auto"] and rows["a"]["threads"] == 2
    assert rows["b"]["waiting"] and rows["b"]["auto"] and rows["b"]["active"]
    t.end("a", 0.6)
    rows = {e.key: t.row(e, 0.7) for e in t.engines.values()}
    assert rows["b"]["computing"] and rows["b"]["threads"] == 1 and rows["b"]["turn_waits"] == 1


# ---- any sequence: the invariants after every step (hypothesis) ---------------------------

KEYS = st.sampled_from("abcde")
ASKS = st.builds(
    TurnAsk,
    threads=st.sampled_from([0, 0, 1, 2, 4, 10**6]),
    threads_batch=st.sampled_from([0, 1, 2, 64]),
    cpus=st.sampled_from([1, 2, 4]),
    batch=st.booleans(),
)


class TurnsMachine(RuleBasedStateMachine):
    """Engines ask, end, leave and time passes in any order; the driver ticks at every step
    (its timer fires at `next_deadline`, earlier is only more often)."""

    def __init__(self):
        super().__init__()
        self.t = Turns(idle_s=IDLE_S, max_s=MAX_S, user_threads="keep")
        self.now = 0.0

    @rule(key=KEYS, ask=ASKS)
    def take(self, key, ask):
        if key not in self.t.queue:  # a connection has one request in flight
            self.check(self.t.take(key, ask, self.now))

    @rule(key=KEYS)
    def end(self, key):
        self.check(self.t.end(key, self.now))

    @rule(key=KEYS)
    def forget(self, key):
        self.check(self.t.forget(key, self.now))

    @rule(dt=st.sampled_from([0.0, 0.01, 0.5, 1.5, 2.5]))
    def wait(self, dt):
        self.now += dt
        self.check(self.t.tick(self.now))

    def check(self, grants):
        for g in grants:
            e = self.t.engines[g.key]
            assert e.held_s == self.now and e.asked_s is None
            assert g.n_threads >= 1 and g.n_threads_batch >= 1
            # granted within the step after its wait ran out (the clock is a sum of floats:
            # 2.0 + 2.5 may come out as 4.500000000000001)
            assert g.waited_s <= MAX_S + 2.5 + 1e-9
            if e.ask.threads:
                assert g.n_threads == e.ask.threads  # "keep": the user's count as given

    @invariant()
    def holding_or_waiting_never_both(self):
        queued = list(self.t.queue)
        assert len(queued) == len(set(queued))
        for key, e in self.t.engines.items():
            assert (e.asked_s is not None) == (key in queued)
            assert e.asked_s is None or e.held_s is None

    @invariant()
    def nobody_waits_while_nothing_counts(self):
        if self.t.queue:
            assert self.t.computing(self.now) > 0

    @invariant()
    def no_wait_outlives_the_bound(self):
        for key in self.t.queue:
            assert self.now - self.t.engines[key].asked_s <= MAX_S


TestTurnsMachine = TurnsMachine.TestCase
TestTurnsMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
