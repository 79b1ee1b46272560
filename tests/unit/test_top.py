"""`moectl top`'s frame from two stats snapshots with known deltas: the rates and what it shows."""

from __future__ import annotations

import copy

import msgspec
import pytest
from rich.console import Console

from moed.cli.top import device_rows, engine_rows, frame, model_rows, rates, tenant_rows
from moed.protocol.stats import Stats, TurnRow

MIB = 1 << 20


def snapshot(**top) -> dict:
    """A full stats snapshot (typed: every field the daemon sends), one tenant and one model."""
    model = dict(
        model_id=1,
        path="/models/a.gguf",
        files=["/models/a.gguf"],
        moe_layers=4,
        n_experts=8,
        n_expert_used=2,
        resident_experts=4,
        resident_bytes=4 * MIB,
        pinned_experts=0,
        pinned_bytes=0,
        pinned=[],
        hits=0,
        misses=0,
        bytes_read=0,
        leases=1,
        direct_io=True,
        stale=False,
        users=[1000],
    )
    tenant = dict(
        uid=1000,
        names=["engine-a"],
        pids=[42],
        connections=2,
        hits=0,
        shared_hits=0,
        misses=0,
        bytes_read=0,
        resident_bytes=4 * MIB,
        leases=1,
        floor_bytes=0,
        ceiling_bytes=0,
        models={"1": dict(hits=0, misses=0, bytes_read=0, resident_bytes=4 * MIB, leases=1)},
    )
    limits = dict(
        max_clients=256,
        max_clients_per_tenant=64,
        operator_reserve=8,
        max_request_frame_bytes=1 << 20,
        max_queued_requests=64,
        max_queued_bytes=256 << 10,
        write_high_bytes=64 << 10,
        hello_timeout_s=5.0,
        idle_timeout_s=0.0,
        max_opens_per_tenant=2,
        open_timeout_s=30.0,
    )
    s = dict(
        version="0.1.0",
        pid=7,
        uptime_s=10.0,
        cpu_user_s=1.0,
        cpu_system_s=0.5,
        budget_bytes=64 * MIB,
        used_bytes=4 * MIB,
        pinned_bytes=0,
        pin_budget_bytes=0,
        evictable_bytes=0,
        locked=True,
        lock_error="",
        locked_bytes=4 * MIB,
        resident_experts=4,
        evictions=0,
        hits=0,
        shared_hits=0,
        misses=0,
        pinned_hits=0,
        pinned_hit_share=0.0,
        pinned_experts=0,
        hit_rate=0.0,
        joined_reads=0,
        prefetches=0,
        prefetch_hits=0,
        wasted_prefetches=0,
        bytes_read=0,
        read_errors=0,
        reads_in_flight=0,
        direct_io=True,
        policy="lru",
        mem_available_bytes=8 << 30,
        mem_floor_bytes=2 << 30,
        mem_guard_active=False,
        effective_budget_bytes=64 * MIB,
        given_back_bytes=0,
        mem_guard_actions=0,
        mem_hysteresis_bytes=0,
        mem_cgroup_limited=False,
        verify=False,
        connections=2,
        bad_frames=0,
        timed_out_connections=0,
        stale_detected=0,
        limits=limits,
        clients=[],
        models=[model],
        tenants=[tenant],
    )
    s.update(top)
    return msgspec.to_builtins(msgspec.convert(s, Stats))  # exactly the shape the daemon sends


def advanced(prev: dict) -> dict:
    """`prev` two seconds later: 300 hits, 100 misses, 8 MiB read, 50 evictions, 40 prefetches (10 wasted),
    200 acquires taking 0.02 s in all; all of it by the one tenant on the one model."""
    cur = copy.deepcopy(prev)
    for k, v in dict(
        hits=300, misses=100, bytes_read=8 * MIB, evictions=50, prefetches=40, wasted_prefetches=10
    ).items():
        cur[k] += v
    cur["acquire_latency_s"]["count"] += 200
    cur["acquire_latency_s"]["sum_s"] += 0.02
    cur["uptime_s"] += 2
    cur["reads_in_flight"] = 3
    for row in (cur["tenants"][0], cur["models"][0], cur["tenants"][0]["models"]["1"]):
        row["hits"] += 300
        row["misses"] += 100
        row["bytes_read"] += 8 * MIB
    return cur


@pytest.fixture
def pair():
    prev = snapshot(hits=1000, misses=500, bytes_read=100 * MIB, evictions=7, prefetches=5, wasted_prefetches=1)
    return prev, advanced(prev)


def test_rates_over_the_interval(pair):
    prev, cur = pair
    r = rates(prev, cur, 2.0)
    assert r["hits_s"] == 150 and r["misses_s"] == 50
    assert r["hit_pct"] == pytest.approx(75.0)  # 300 of 400 in the interval, not the lifetime's 1300/1900
    assert r["read_mib_s"] == pytest.approx(4.0)
    assert r["evictions_s"] == 25 and r["prefetch_s"] == 20
    assert r["prefetch_waste_pct"] == pytest.approx(25.0)
    assert r["acquire_mean_s"] == pytest.approx(100e-6)
    (t,) = tenant_rows(prev, cur, 2.0)
    (m,) = model_rows(prev, cur, 2.0)
    for row in (t, m):
        assert row["hits_s"] == 150 and row["hit_pct"] == pytest.approx(75.0)
        assert row["read_mib_s"] == pytest.approx(4.0)


def test_quiet_interval_has_no_shares(pair):
    prev, _ = pair
    r = rates(prev, prev, 1.0)
    assert r["hits_s"] == 0 and r["hit_pct"] is None and r["prefetch_waste_pct"] is None
    assert r["acquire_mean_s"] is None


def test_a_new_tenant_counts_from_zero(pair):
    prev, cur = pair
    newcomer = copy.deepcopy(cur["tenants"][0]) | {"uid": 2000, "hits": 10, "misses": 10, "bytes_read": MIB}
    cur["tenants"].append(newcomer)
    rows = {r["uid"]: r for r in tenant_rows(prev, cur, 2.0)}
    assert rows[2000]["hits_s"] == 5 and rows[2000]["hit_pct"] == pytest.approx(50.0)
    assert rows[2000]["read_mib_s"] == pytest.approx(0.5)


def render(prev: dict, cur: dict, dt: float) -> str:
    console = Console(record=True, width=140, color_system=None)
    console.print(frame(prev, cur, dt))
    return console.export_text()


def test_frame_shows_the_rates_rows_and_memory(pair):
    prev, cur = pair
    text = render(prev, cur, 2.0)
    assert "over the last 2.0 s" in text
    for shown in ("150.0", "50.0", "75.0%", "4.00", "25.0", "20.0", "25.0%", "100 µs"):
        assert shown in text, shown
    assert "3 reads in flight" in text
    assert "MemAvailable 8.00 GiB, floor 2.00 GiB (headroom 6.00 GiB)" in text
    assert "engine-a" in text and "a.gguf" in text
    tenant_line = next(line for line in text.splitlines() if "engine-a" in line)
    assert "150.0" in tenant_line and "75.0%" in tenant_line and "4.00" in tenant_line
    assert "GUARD ACTIVE" not in text


def test_frame_says_when_the_guard_holds_the_store(pair):
    prev, cur = pair
    cur.update(mem_guard_active=True, effective_budget_bytes=16 * MIB)
    assert "GUARD ACTIVE: store held to 16.00 MiB" in render(prev, cur, 2.0)


def test_tenant_names_are_shown_whole_on_one_line(pair):
    prev, cur = pair
    names = ["moectl serve", "moectl serve", "moectl serve probe", "moectl top", "a-long-engine-name-for-a-tenant"]
    cur["tenants"][0]["names"] = names
    prev["tenants"][0]["names"] = names
    text = render(prev, cur, 2.0)
    line = next(line for line in text.splitlines() if "moectl serve" in line)
    assert "moectl serve x2, moectl serve probe, moectl top, a-long-engine-name-for-a-tenant" in line
    assert "150.0" in line  # the same row as the tenant's rates: not wrapped onto lines of its own


def test_the_connection_count_says_it_includes_the_view(pair):
    prev, cur = pair
    assert "2 connections (this view's included)" in render(prev, cur, 2.0)


SERVE_METRICS_T0 = """
moed_serve_requests_total{model="m",status="200"} 10.0
moed_serve_requests_total{model="m",status="400"} 1.0
moed_serve_tokens_generated_total{model="m"} 100.0
moed_serve_time_to_first_token_seconds_sum{model="m"} 1.0
moed_serve_time_to_first_token_seconds_count{model="m"} 10.0
moed_serve_requests_in_flight{model="m"} 1.0
moed_serve_requests_queued{model="m"} 0.0
moed_serve_workers{model="m"} 2.0
moed_serve_workers_ready{model="m"} 2.0
"""


def test_server_rows_are_rates_over_the_interval(pair):
    from moed.cli.top import serve_rows, serve_snapshot

    before = serve_snapshot(SERVE_METRICS_T0)
    later = SERVE_METRICS_T0.replace('status="200"} 10.0', 'status="200"} 14.0')
    later = later.replace('{model="m"} 100.0', '{model="m"} 180.0').replace('status="400"} 1.0', 'status="400"} 3.0')
    later = later.replace('_sum{model="m"} 1.0', '_sum{model="m"} 1.4').replace(
        '_count{model="m"} 10.0', '_count{model="m"} 14.0'
    )
    later = later.replace('queued{model="m"} 0.0', 'queued{model="m"} 3.0')
    (row,) = serve_rows("http://s:9478/metrics", before, serve_snapshot(later), 2.0)
    assert row["requests_s"] == 2 and row["errors_s"] == 1 and row["tokens_s"] == 40
    assert row["ttft_mean_s"] == pytest.approx(0.1)
    assert (row["in_flight"], row["queued"], row["ready"], row["workers"]) == (1, 3, 2, 2)
    prev, cur = pair
    text = Console(record=True, width=200, color_system=None)
    text.print(frame(prev, cur, 2.0, [row]))
    line = next(line for line in text.export_text().splitlines() if "s:9478" in line)
    assert "100 ms" in line and "2/2" in line and "40.0" in line


def engine(connection: int, turns: int, wait_s: float, **more) -> dict:
    row = dict(
        connection=connection,
        pid=100 + connection,
        uid=1000,
        name=f"StreamedLlama[{100 + connection}]",
        cpus=2,
        threads=1,
        threads_batch=1,
        auto=True,
        computing=False,
        waiting=False,
        active=True,
        turns=turns,
        turn_waits=0,
        turn_wait_s=wait_s,
        turns_overdue=0,
    )
    return msgspec.to_builtins(msgspec.convert(row | more, TurnRow))


def test_engine_rows_are_turns_and_waits_over_the_interval(pair):
    prev, cur = pair
    prev["engines"] = [engine(1, 100, 1.0)]
    cur["engines"] = [engine(1, 140, 1.5), engine(2, 10, 0.2, auto=False, threads=2, threads_batch=2)]
    rows = {r["connection"]: r for r in engine_rows(prev, cur, 2.0)}
    assert rows[1]["turns_s"] == 20 and rows[1]["wait_pct"] == pytest.approx(25.0)
    assert rows[2]["turns_s"] == 5 and rows[2]["wait_pct"] == pytest.approx(10.0)  # new: counts from 0
    text = render(prev, cur, 2.0)
    line = next(x for x in text.splitlines() if "StreamedLlama[102]" in x)
    assert "user" in line and "10.0%" in line and " 2 " in line
    assert "threads" in text


def test_no_engines_no_threads_table(pair):
    prev, cur = pair
    assert "threads" not in render(prev, cur, 2.0).split("models")[-1]


def client_with_device(connection: int, hits: int, uploads: int, evictions: int) -> dict:
    device = dict(
        model_id=1, pid=100 + connection, connection=connection, slots=8, layers=4,
        hits=hits, uploads=uploads, upload_bytes=uploads * 4096, evictions=evictions, zero_copy=False,
    )  # fmt: skip
    return dict(
        pid=100 + connection, uid=1000, leases=0, busy=False, queued_requests=0, queued_bytes=0,
        buffered_out_bytes=0, reading=True, engines=[[1, "layers 0-3 on Vulkan0"]], devices=[device],
    )  # fmt: skip


def test_device_rows_are_the_engines_device_slots_over_the_interval(pair):
    """Issue 47: each engine's device hits, uploads and evictions a second, from its reports."""
    prev, cur = pair
    prev["clients"] = [client_with_device(1, 100, 40, 10)]
    cur["clients"] = [client_with_device(1, 160, 50, 14), client_with_device(2, 20, 8, 0)]
    rows = {r["connection"]: r for r in device_rows(prev, cur, 2.0)}
    assert (rows[1]["hits_s"], rows[1]["uploads_s"], rows[1]["evictions_s"]) == (30, 5, 2)
    assert (rows[2]["hits_s"], rows[2]["uploads_s"], rows[2]["evictions_s"]) == (10, 4, 0)  # new: counts from 0
    text = render(prev, cur, 2.0)
    assert "device slots" in text
    line = next(x for x in text.splitlines() if " 101 " in x and " 30" in x)
    assert " 8 " in line and " 5" in line


def test_no_device_slots_no_device_table(pair):
    prev, cur = pair
    assert "device slots" not in render(prev, cur, 2.0)
