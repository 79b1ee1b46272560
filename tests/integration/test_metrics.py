"""Prometheus metrics from a real daemon, scraped over HTTP and parsed with prometheus_client.

The scrape must equal `moectl stats --json` taken around it with no traffic in
between (both snapshots equal each other, so nothing moved).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from moed.testing import wait_for

parser = pytest.importorskip("prometheus_client.parser")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in parser.text_string_to_metric_families(text)
        for s in fam.samples
    }


def moectl_stats(sock: str) -> dict:
    r = subprocess.run(
        [sys.executable, "-m", "moed.ctl", "--socket", sock, "stats", "--json"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return json.loads(r.stdout)


def traffic(d, model) -> None:
    """Misses, hits (local and not), a prefetch and evictions (the budget holds 6 experts of 32)."""
    c = d.client("traffic")
    h = c.open_model(model)
    for rnd in range(3):
        for layer in h.moe_layers:
            with h.acquire(layer, [0, 1]):
                pass
            with h.acquire(layer, [rnd % h.n_experts, 2 + rnd]):
                pass
        h.prefetch(h.moe_layers[0], [5, 6])
    c.ping()  # the prefetch was sent before this answer
    return c


MOVING = {
    "moed_mem_available_bytes",
    "moed_uptime_seconds",
    "moed_cpu_user_seconds_total",
    "moed_cpu_system_seconds_total",
}


def test_metrics_equal_moectl_stats(start_daemon, tiny_model):
    port = free_port()
    d = start_daemon("160KiB", "--metrics-listen", f"127.0.0.1:{port}", "--mem-floor", "1MiB")
    c = traffic(d, tiny_model)
    wait_for(lambda: moectl_stats(d.socket)["reads_in_flight"] == 0, what="reads to settle")

    before = moectl_stats(d.socket)
    got = scrape(port)
    after = moectl_stats(d.socket)
    for snap in (before, after):  # what moves by itself, or names each moectl process
        for k in ("uptime_s", "cpu_user_s", "cpu_system_s", "mem_available_bytes", "clients"):
            snap.pop(k)
        for t in snap["tenants"]:
            t.pop("pids")
    assert before == after, "traffic between the snapshots"
    s = after
    assert s["hits"] and s["misses"] and s["evictions"] and s["prefetches"]

    def one(name: str, **labels) -> float:
        return got[(name, tuple(sorted(labels.items())))]

    # moectl's own connection is in its snapshots, not in the scrape.
    expected = {
        "moed_hits_total": s["hits"],
        "moed_misses_total": s["misses"],
        "moed_shared_hits_total": s["shared_hits"],
        "moed_local_hits_total": s["local_hits"],
        "moed_read_bytes_total": s["bytes_read"],
        "moed_evictions_total": s["evictions"],
        "moed_budget_bytes": s["budget_bytes"],
        "moed_used_bytes": s["used_bytes"],
        "moed_pinned_bytes": s["pinned_bytes"],
        "moed_mem_floor_bytes": s["mem_floor_bytes"],
        "moed_given_back_bytes_total": s["given_back_bytes"],
        "moed_reads_in_flight": s["reads_in_flight"],
        "moed_prefetch_issued_total": s["prefetches"],
        "moed_prefetch_hits_total": s["prefetch_hits"],
        "moed_prefetch_wasted_total": s["wasted_prefetches"],
        "moed_connections": s["connections"] - 1,
        "moed_verify_mismatches_total": s["verify_mismatches"],
        "moed_read_errors_total": s["read_errors"],
        "moed_read_retries_total": s["read_retries"],
        "moed_prefetch_dropped_total": s["prefetch_dropped"],
        "moed_quarantined_experts": s["quarantined_experts"],
        "moed_stalled_reads_total": s["stalled_reads"],
        "moed_drive_behind": s["drive_behind"],
        "moed_effective_budget_bytes": s["effective_budget_bytes"],
    }
    for name, value in expected.items():
        assert one(name) == value, name
    assert one("moed_mem_available_bytes") > 0

    for key, metric in (
        ("acquire_latency_s", "moed_acquire_duration_seconds"),
        ("read_latency_s", "moed_read_duration_seconds"),
    ):
        h = s[key]
        assert h["count"] > 0
        assert one(metric + "_count") == h["count"] and one(metric + "_bucket", le="+Inf") == h["count"]
        assert one(metric + "_sum") == pytest.approx(h["sum_s"])
        first = one(metric + "_bucket", le=repr(float(h["bounds_s"][0])))
        assert first == h["counts"][0]
    assert s["read_latency_s"]["count"] == s["misses"] - s["joined_reads"] + s["prefetches"]

    (tenant,) = s["tenants"]
    uid = str(tenant["uid"])
    assert tenant["uid"] == os.getuid()
    for key, metric in (
        ("hits", "hits_total"),
        ("misses", "misses_total"),
        ("shared_hits", "shared_hits_total"),
        ("bytes_read", "read_bytes_total"),
        ("resident_bytes", "resident_bytes"),
        ("leases", "leases"),
    ):
        assert one(f"moed_tenant_{metric}", uid=uid) == tenant[key], key
    assert one("moed_tenant_connections", uid=uid) == tenant["connections"] - 1
    (model,) = s["models"]
    mid = str(model["model_id"])
    for key, metric in (
        ("hits", "hits_total"),
        ("misses", "misses_total"),
        ("bytes_read", "read_bytes_total"),
        ("resident_bytes", "resident_bytes"),
        ("pinned_bytes", "pinned_bytes"),
    ):
        assert one(f"moed_model_{metric}", model_id=mid, model=model["path"]) == model[key], key
    row = tenant["models"][mid]
    assert one("moed_tenant_model_hits_total", uid=uid, model_id=mid) == row["hits"]
    assert one("moed_tenant_model_read_bytes_total", uid=uid, model_id=mid) == row["bytes_read"]
    c.close()


def test_metrics_are_off_unless_configured(start_daemon):
    port = free_port()
    d = start_daemon()
    assert moectl_stats(d.socket)["hits"] == 0
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_bad_metrics_listen_fails_the_start_with_one_line():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "moed.daemon.main",
            "--socket",
            "/tmp/moed-metrics-bad.sock",
            "--metrics-listen",
            "localhost",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and "metrics_listen must be HOST:PORT" in r.stderr
    assert not os.path.exists("/tmp/moed-metrics-bad.sock")


def test_metrics_port_taken_fails_the_start_and_leaves_no_socket(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        sock = f"/tmp/moed-metrics-{os.getpid()}.sock"
        r = subprocess.run(
            [sys.executable, "-m", "moed.daemon.main", "--socket", sock, "--metrics-listen", f"127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert r.returncode == 2 and "cannot serve metrics" in r.stderr
    assert not os.path.exists(sock)


def test_engines_device_counters_reach_stats_text_json_and_metrics(start_daemon, tiny_model):
    """An engine's DeviceReport (issue 47): its latest counters per connection in `moectl stats`
    (text and --json) and /metrics, labelled by pid and model; the daemon's sums grow by each
    report's increase, so a second report adds nothing twice and a closed engine's count stays."""
    port = free_port()
    d = start_daemon("160KiB", "--metrics-listen", f"127.0.0.1:{port}")
    one, two = d.client("engine one"), d.client("engine two")
    h1, h2 = one.open_model(tiny_model), two.open_model(tiny_model)
    h1.report_device(slots=4, layers=4, hits=10, uploads=6, upload_bytes=600, evictions=2)
    h1.report_device(slots=4, layers=4, hits=30, uploads=9, upload_bytes=900, evictions=5)  # totals, not more
    h2.report_device(slots=8, layers=2, hits=7, zero_copy=True)
    h1.report_device(slots=4, layers=4, hits=1)  # a count that went down adds nothing
    one.ping()
    two.ping()  # each report was read before this answer
    s = moectl_stats(d.socket)
    rows = {d["hits"]: d for c in s["clients"] for d in c["devices"]}
    assert set(rows) == {1, 7}
    conn = rows[7].pop("connection")
    assert conn > rows[1]["connection"] > 0, "numbered as the daemon accepted them"
    assert rows[7] == {
        "model_id": h2.model_id,
        "pid": os.getpid(),
        "slots": 8,
        "layers": 2,
        "hits": 7,
        "uploads": 0,
        "upload_bytes": 0,
        "evictions": 0,
        "zero_copy": True,
    }
    assert (s["device_hits"], s["device_uploads"], s["device_upload_bytes"], s["device_evictions"]) == (37, 9, 900, 5)
    got = scrape(port)
    assert got[("moed_device_hits_total", ())] == 37 and got[("moed_device_evictions_total", ())] == 5
    labels = (("connection", str(conn)), ("model_id", str(h2.model_id)), ("pid", str(os.getpid())))
    assert got[("moed_engine_device_slots", labels)] == 8 and got[("moed_engine_device_hits_total", labels)] == 7
    text = subprocess.run(
        [sys.executable, "-m", "moed.ctl", "--socket", d.socket, "stats"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "300"},  # rich's tables unwrapped
    ).stdout
    assert "37 hits, 9 uploads (900 B), 5 evictions in engines' device slots" in " ".join(text.split()), text
    two.close()
    wait_for(lambda: len(moectl_stats(d.socket)["clients"]) == 2, what="engine two's connection to close")
    assert moectl_stats(d.socket)["device_hits"] == 37, "a closed engine's count stays in the sums"
    one.close()


def test_a_device_report_for_a_model_not_opened_is_dropped(start_daemon):
    d = start_daemon("160KiB")
    c = d.client("stray")
    from moed.protocol import messages as m

    c.send(m.DeviceReport(model_id=12345, hits=3))  # fire and forget: no reply, not even an error
    c.ping()
    assert c.stats()["device_hits"] == 0
    c.close()
