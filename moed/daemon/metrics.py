"""Prometheus metrics: a custom collector over the daemon's own stats snapshot.

What this module owns: the mapping from the stats snapshot (`Daemon.stats()`, the
same object `moectl stats --json` prints) to Prometheus metric families, and the
HTTP endpoint (`metrics_listen`, off unless configured). The exposition format is
prometheus_client's; nothing here writes it by hand.

Threads: prometheus_client's `start_http_server` answers scrapes on its own
thread, and the daemon's state belongs to the event loop thread (core.py). So a
scrape never reads daemon state: the collector asks the loop for a snapshot
(`run_coroutine_threadsafe`, waited with a timeout) and turns that plain dict into
families on the scrape thread. The loop pays for one snapshot per scrape, as for
a GetStats request, and no formatting; a loop too busy to answer within
`timeout_s` fails that scrape (HTTP 500) instead of blocking the server thread
forever. The snapshot folds the engines' local hits first (Daemon.stats calls
fold_local), so the metrics equal `moectl stats --json` taken at the same moment.

Naming: counters end in `_total`, sizes in `_bytes`, durations in `_seconds`.
Per-tenant metrics are labelled by `uid`, per-model ones by `model_id` and `model`
(its path), per tenant and model by both. Left out of any equality with the JSON:
nothing; `moed_mem_available_bytes` and `moed_uptime_seconds` simply move between
two snapshots.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from .config import parse_listen

log = logging.getLogger("moed.metrics")

# (stats key, metric name without `moed_` and without `_total`, help)
COUNTERS = [
    ("hits", "hits", "Experts granted that were resident (local hits included)"),
    ("misses", "misses", "Experts granted that had to be read (or joined a read in flight)"),
    ("shared_hits", "shared_hits", "Hits on experts another tenant's acquire read in"),
    ("local_hits", "local_hits", "Hits engines served themselves with no round trip"),
    ("pinned_hits", "pinned_hits", "Hits on experts of the pinned partition"),
    ("joined_reads", "joined_reads", "Misses that joined a read already in flight"),
    ("bytes_read", "read_bytes", "Bytes read from model files"),
    ("read_errors", "read_errors", "Expert reads that failed (after their retries)"),
    ("read_retries", "read_retries", "Chunk reads that failed and were tried again"),
    ("quarantine_refusals", "quarantine_refusals", "Acquires refused at once: the expert's read failed recently"),
    ("prefetch_dropped", "prefetch_dropped", "Prefetched experts not read because the drive was behind"),
    ("stalled_reads", "stalled_reads", "Reads that ran past read_stall_warn_s"),
    ("drive_behind_episodes", "drive_behind_episodes", "Times the drive went behind (read-ahead held back)"),
    ("evictions", "evictions", "Experts evicted from the RAM tier"),
    ("prefetches", "prefetch_issued", "Prefetch reads issued"),
    ("prefetch_hits", "prefetch_hits", "Prefetched experts that a later acquire used"),
    ("wasted_prefetches", "prefetch_wasted", "Prefetched experts dropped or evicted unused"),
    ("given_back_bytes", "given_back_bytes", "Bytes the memory guard gave back to the kernel"),
    ("mem_guard_actions", "mem_guard_actions", "Times the memory guard acted"),
    ("verified_reads", "verified_reads", "Re-reads checked against the first read (verify mode)"),
    ("verify_mismatches", "verify_mismatches", "Re-reads whose bytes differed (verify mode)"),
    ("bad_frames", "bad_frames", "Malformed frames received"),
    ("timed_out_connections", "timed_out_connections", "Connections closed for silence"),
    ("stale_detected", "stale_models", "Models found changed on disk while open"),
]
GAUGES = [
    ("budget_bytes", "budget_bytes", "The shared RAM tier budget"),
    ("effective_budget_bytes", "effective_budget_bytes", "The budget the memory guard allows now"),
    ("used_bytes", "used_bytes", "Bytes of the RAM tier in use"),
    ("pinned_bytes", "pinned_bytes", "Bytes of the pinned partition in use"),
    ("pin_budget_bytes", "pin_budget_bytes", "The pinned partition's budget"),
    ("evictable_bytes", "evictable_bytes", "Bytes held by nobody (evictable now)"),
    ("locked_bytes", "locked_bytes", "Bytes of expert memory locked (mlock)"),
    ("resident_experts", "resident_experts", "Experts resident in the RAM tier"),
    ("mem_available_bytes", "mem_available_bytes", "The box's MemAvailable as last sampled"),
    ("mem_floor_bytes", "mem_floor_bytes", "The memory floor the guard keeps MemAvailable above"),
    ("mem_guard_active", "mem_guard_active", "1 while the memory guard holds the store below its budget"),
    ("reads_in_flight", "reads_in_flight", "Expert reads in flight"),
    ("quarantined_experts", "quarantined_experts", "Experts whose acquires fail at once for now"),
    ("stuck_reads", "stuck_reads", "Reads running past read_stall_warn_s now"),
    ("drive_behind", "drive_behind", "1 while read-ahead is held back (the drive is behind)"),
    ("drive_latency_ratio", "drive_latency_ratio", "Recent read latency over the drive's own baseline"),
    # A scrape opens no connection (the collector asks the loop); moectl stats and top count their own.
    ("connections", "connections", "Open client connections, a scrape opening none"),
    ("locked", "locked", "1 if the RAM tier is locked in memory"),
    ("uptime_s", "uptime_seconds", "Seconds since the daemon started"),
]
TENANT = [  # (key, name, counter?, help)
    ("hits", "hits", True, "Hits of this tenant"),
    ("shared_hits", "shared_hits", True, "Hits of this tenant on experts another tenant read in"),
    ("misses", "misses", True, "Misses of this tenant"),
    ("bytes_read", "read_bytes", True, "Bytes read for this tenant's misses and prefetches"),
    ("resident_bytes", "resident_bytes", False, "RAM tier bytes of experts this tenant read in"),
    ("leases", "leases", False, "Leases this tenant holds now"),
    ("connections", "connections", False, "Open connections of this tenant"),
    ("floor_bytes", "floor_bytes", False, "This tenant's reserved floor"),
    ("ceiling_bytes", "ceiling_bytes", False, "This tenant's ceiling (0: none)"),
]
MODEL = [
    ("hits", "hits", True, "Hits on this model"),
    ("misses", "misses", True, "Misses on this model"),
    ("bytes_read", "read_bytes", True, "Bytes read from this model's files"),
    ("resident_bytes", "resident_bytes", False, "RAM tier bytes of this model's experts"),
    ("resident_experts", "resident_experts", False, "This model's experts resident"),
    ("pinned_bytes", "pinned_bytes", False, "Pinned partition bytes of this model"),
    ("leases", "leases", False, "Leases on this model held now"),
    ("stale", "stale", False, "1 if the model changed on disk and is draining"),
    ("read_errors", "read_errors", True, "Reads of this model's experts that failed"),
]
TENANT_MODEL = [
    ("hits", "hits", True, "Hits of this tenant on this model"),
    ("misses", "misses", True, "Misses of this tenant on this model"),
    ("bytes_read", "read_bytes", True, "Bytes read for this tenant on this model"),
    ("resident_bytes", "resident_bytes", False, "RAM tier bytes of this model this tenant read in"),
    ("leases", "leases", False, "Leases of this tenant on this model held now"),
]
HISTOGRAMS = [
    ("acquire_latency_s", "acquire_duration_seconds", "Daemon acquires, from request to grant on the event loop"),
    ("read_latency_s", "read_duration_seconds", "Expert reads, from submission to completion on the event loop"),
]


def _family(name: str, counter: bool, doc: str, labels: list[str] | None = None):
    cls = CounterMetricFamily if counter else GaugeMetricFamily
    return cls(f"moed_{name}", doc, labels=labels)


def families(stats: dict) -> Iterator:
    """The metric families of one stats snapshot (a pure function: tests call it too)."""
    yield InfoMetricFamily(
        "moed",
        "The daemon's version and policy",
        value={
            "version": str(stats["version"]),
            "policy": str(stats["policy"]),
            "direct_io": str(bool(stats["direct_io"])).lower(),
        },
    )
    for key, name, doc in COUNTERS:
        f = _family(name, True, doc)
        f.add_metric([], float(stats.get(key, 0)))
        yield f
    for key, name, doc in GAUGES:
        f = _family(name, False, doc)
        f.add_metric([], float(stats.get(key, 0)))
        yield f
    for key, name, doc in HISTOGRAMS:
        yield _histogram(f"moed_{name}", doc, stats[key])
    yield from _rows("tenant_", TENANT, ["uid"], [([str(t["uid"])], t) for t in stats["tenants"]])
    yield from _rows(
        "model_", MODEL, ["model_id", "model"], [([str(m["model_id"]), m["path"]], m) for m in stats["models"]]
    )
    pairs = [([str(t["uid"]), mid], row) for t in stats["tenants"] for mid, row in t["models"].items()]
    yield from _rows("tenant_model_", TENANT_MODEL, ["uid", "model_id"], pairs)


def _rows(prefix: str, table, labels: list[str], rows: list[tuple[list[str], dict]]) -> Iterator:
    for key, name, counter, doc in table:
        f = _family(prefix + name, counter, doc, labels)
        for values, row in rows:
            f.add_metric(values, float(row[key]))
        yield f


def _histogram(name: str, doc: str, h: dict) -> HistogramMetricFamily:
    cumulative, buckets = 0, []
    for bound, n in zip([*h["bounds_s"], float("inf")], h["counts"]):
        cumulative += n
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(cumulative)))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=h["sum_s"])


class DaemonCollector(Collector):
    """Collects by asking the event loop for `daemon.stats()` (see the module docstring)."""

    def __init__(self, daemon, loop: asyncio.AbstractEventLoop, timeout_s: float = 5.0):
        self.daemon, self.loop, self.timeout_s = daemon, loop, timeout_s

    async def _snapshot(self) -> dict:
        return self.daemon.stats()

    def snapshot(self) -> dict:
        future = asyncio.run_coroutine_threadsafe(self._snapshot(), self.loop)
        try:
            return future.result(self.timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    def describe(self):
        return []  # nothing is collected at registration (the loop may not be running yet)

    def collect(self):
        return families(self.snapshot())


class MetricsServer:
    """The `/metrics` endpoint on its own thread; `close()` stops it."""

    def __init__(self, daemon, loop: asyncio.AbstractEventLoop, listen: str):
        host, port = parse_listen(listen)
        self.registry = CollectorRegistry()
        self.registry.register(DaemonCollector(daemon, loop))
        self.httpd, self.thread = start_http_server(port, addr=host, registry=self.registry)
        log.info("metrics on http://%s/metrics", listen)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


__all__ = ["DaemonCollector", "MetricsServer", "families"]
