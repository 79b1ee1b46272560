"""moectl against a real daemon: the operator's verbs and the stats contract."""

from __future__ import annotations

import json
import subprocess
import sys

from moed.protocol.stats import CONTRACT_KEYS


def moectl(sock: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moed.ctl", "--socket", sock, *args], capture_output=True, text=True, timeout=60
    )


def test_stats_json_has_the_contract_keys_and_counts_what_happened(daemon, tiny_model):
    with daemon.client("engine") as c:
        m = c.open_model(tiny_model)
        with m.acquire(1, [0, 1]):
            pass
        with m.acquire(1, [1, 2]):
            pass
    r = moectl(daemon.socket, "stats", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert CONTRACT_KEYS <= s.keys()
    assert (s["hits"], s["misses"]) == (1, 3)
    assert s["budget_bytes"] == 64 << 20 and 0 < s["used_bytes"] <= s["budget_bytes"]
    assert s["mem_available_bytes"] > 0 and s["direct_io"] is True
    assert [m["path"] for m in s["models"]] == [str(tiny_model)]
    assert any("engine" in t["names"] for t in s["tenants"])


def test_stats_table_models_and_ping_are_readable(daemon, tiny_model):
    with daemon.client() as c:
        c.open_model(tiny_model)
        r = moectl(daemon.socket, "stats")
        assert r.returncode == 0 and "hits / misses" in r.stdout and "tenants" in r.stdout
        r = moectl(daemon.socket, "models", "--json")
        assert r.returncode == 0 and json.loads(r.stdout)[0]["n_experts"] == 8
    r = moectl(daemon.socket, "ping", "-n", "5")
    assert r.returncode == 0 and "round trip" in r.stdout


def test_no_daemon_is_a_one_line_error(tmp_path):
    r = moectl(str(tmp_path / "nothing.sock"), "stats")
    assert r.returncode == 2
    assert r.stderr.startswith("moectl: DaemonUnavailable") and len(r.stderr.strip().splitlines()) == 1
