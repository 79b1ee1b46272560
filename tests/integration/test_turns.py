"""Compute turns through a real daemon and real clients (moed.daemon.turns, turndesk):
engines whose threads do not fit the cores take turns, a closed connection lets its turn
go, an acquire that waits on reads lets another compute, a held turn is bounded, and
`moectl stats --json` and the metrics show each engine's threads and waits."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from moed.protocol import messages as m
from moed.testing import wait_for

CORES = 2  # what the clients say they may run on: the rules, not this host, decide here
WHOLE = dict(threads=CORES, threads_batch=CORES, cpus=CORES)  # a user's n_threads = the core count


@pytest.fixture
def daemon(start_daemon):
    """A daemon that grants a user's count as given (`turn_user_threads = "keep"`): engines
    given every core then take turns, the mechanics these tests watch. The default (a
    ceiling among others) has its own test below."""
    return start_daemon("64MiB", config={"turn_user_threads": "keep"})


@pytest.fixture
def pool():
    with ThreadPoolExecutor(4) as ex:
        yield ex


def take(client, threads: int = 0, threads_batch: int = 0, cpus: int = CORES) -> m.TurnGranted:
    return client.request(m.TakeTurn(threads, threads_batch, cpus))


def end(client) -> None:
    client.send(m.EndTurn())  # fire and forget


def engine_rows(d) -> dict[str, dict]:
    with d.client("observer") as c:
        return {e["name"]: e for e in c.stats()["engines"]}


def waiting(d, name: str) -> bool:
    return engine_rows(d).get(name, {}).get("waiting", False)


def still_waiting(future: Future) -> bool:
    return not future.done()


def test_auto_engines_split_the_cores_and_one_alone_gets_every_one(daemon):
    with daemon.client("a") as a, daemon.client("b") as b:
        assert take(a, cpus=CORES) == m.TurnGranted(CORES, CORES, 0.0)  # alone
        end(a)
        got = take(b, cpus=CORES)  # a took a turn just now: it still counts
        assert (got.n_threads, got.n_threads_batch) == (CORES // 2, CORES // 2)
        end(b)
        assert take(a, cpus=CORES).n_threads == CORES // 2
        end(a)
        rows = engine_rows(daemon)
        assert rows["a"]["auto"] and rows["a"]["threads"] == CORES // 2 and rows["a"]["turns"] == 2
        assert rows["b"]["active"] and rows["b"]["pid"] == os.getpid() and rows["b"]["cpus"] == CORES


def test_engines_given_every_core_take_turns(daemon, pool):
    with daemon.client("a") as a, daemon.client("b") as b:
        assert take(a, **WHOLE) == m.TurnGranted(CORES, CORES, 0.0)  # the user's count stays
        second = pool.submit(take, b, **WHOLE)
        wait_for(lambda: waiting(daemon, "b"), what="b to wait for a's turn")
        assert still_waiting(second)
        end(a)
        got = second.result(timeout=10)
        assert (got.n_threads, got.n_threads_batch) == (CORES, CORES) and got.waited_s > 0
        rows = engine_rows(daemon)
        assert rows["b"]["computing"] and not rows["a"]["computing"]
        assert rows["b"]["turn_waits"] == 1 and rows["b"]["turn_wait_s"] > 0 and not rows["b"]["auto"]


def test_a_closed_connection_lets_its_turn_go(daemon, pool):
    a = daemon.client("a")
    with daemon.client("b") as b:
        take(a, **WHOLE)
        second = pool.submit(take, b, **WHOLE)
        wait_for(lambda: waiting(daemon, "b"), what="b to wait")
        a.close()  # a crashed engine: its turn goes with its connection
        assert second.result(timeout=10).n_threads == CORES
        assert "a" not in engine_rows(daemon)


def test_an_acquire_waiting_on_reads_lets_another_compute(daemon, tiny_model, pool):
    with daemon.client("a") as a, daemon.client("b") as b:
        model = a.open_model(tiny_model)
        take(a, **WHOLE)
        b_turn = pool.submit(take, b, **WHOLE)
        wait_for(lambda: waiting(daemon, "b"), what="b to wait")
        # a misses (nothing is resident yet): its turn goes to b while it reads, and it gets
        # its experts only with its turn back, after b's
        acquired = pool.submit(model.acquire, model.moe_layers[0], [0, 1])
        b_turn.result(timeout=10)
        wait_for(lambda: engine_rows(daemon)["a"]["waiting"], what="a to wait for its turn back")
        assert still_waiting(acquired)
        end(b)
        lease = acquired.result(timeout=10)
        assert engine_rows(daemon)["a"]["computing"]
        lease.release()
        end(a)


def test_a_turn_held_too_long_no_longer_blocks(start_daemon, pool):
    d = start_daemon("64MiB", config={"turn_max_s": 0.3, "turn_user_threads": "keep"})
    with d.client("hog") as hog, d.client("b") as b:
        take(hog, **WHOLE)  # and never lets it go
        got = pool.submit(take, b, **WHOLE).result(timeout=10)
        assert 0.2 < got.waited_s < 5
        end(b)
        assert take(b, **WHOLE).waited_s == 0.0  # the hog's overdue turn blocks no one
        with d.client() as c:
            s = c.stats()
        assert s["turns_overdue"] == 1 and s["limits"]["turn_max_s"] == 0.3
        assert {e["name"]: e["turns_overdue"] for e in s["engines"]} == {"hog": 1, "b": 0}


def test_stats_and_metrics_keys(daemon):
    with daemon.client("a") as a:
        take(a, threads=1, cpus=CORES)
        with daemon.client() as c:
            s = c.stats()
        end(a)
    for key in ("turns", "turn_waits", "turn_wait_s", "turns_overdue", "engines_active", "engines"):
        assert key in s, key
    (row,) = [e for e in s["engines"] if e["name"] == "a"]
    assert row["threads"] == 1 and row["threads_batch"] == CORES and row["auto"] and row["computing"]
    assert s["turns"] >= 1 and s["engines_active"] >= 1

    from moed.daemon.prometheus import families

    names = {f.name for f in families(s)}
    assert {"moed_engine_threads", "moed_engine_turn_wait_seconds", "moed_turns", "moed_engines_active"} <= names


def test_moectl_stats_shows_each_engines_threads(daemon):
    with daemon.client("engine-x") as a:
        take(a, threads=1, cpus=CORES)
        r = subprocess.run(
            [sys.executable, "-m", "moed.ctl", "--socket", daemon.socket, "stats"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        end(a)
    assert r.returncode == 0, r.stderr
    assert "compute turns" in r.stdout and "1 granted" in r.stdout
    line = next(x for x in r.stdout.splitlines() if "engine-x" in x)
    assert "computing" in line and "moed" in line  # the batch count is the daemon's


def test_a_users_count_as_a_ceiling(start_daemon):
    d = start_daemon("64MiB")  # the default: a user's count is a ceiling among others
    with d.client("a") as a, d.client("b") as b:
        assert take(a, **WHOLE).n_threads == CORES  # alone: what it asked for
        end(a)
        assert take(b, **WHOLE).n_threads == CORES // 2  # a still counts: the share at most
        assert take(a, **WHOLE).waited_s == 0.0  # side by side, not in turn
        rows = engine_rows(d)
        assert rows["a"]["computing"] and rows["b"]["computing"] and not rows["a"]["auto"]
