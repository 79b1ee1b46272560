"""Prometheus metrics: a custom collector over the daemon's own stats snapshot.

What this module owns: the mapping from the stats snapshot (`Daemon.stats()`, the
same object `moectl stats --json` prints) to Prometheus metric families, and the
HTTP endpoint (`metrics_listen`, off unless configured). Which fields are metrics,
and their names, kinds and help, are declared once, on the stats schema's fields
(moed/protocol/stats.py, `metric_fields`); this module only decides which rows
become labelled families. The exposition format is prometheus_client's; nothing
here writes it by hand.

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
(its path), per tenant and model by both, per engine (a connection that took a compute
turn: its threads and its waits) by `connection` (the daemon's number), `pid` and `name`.
An engine's device slots
(`moed_engine_device_*`, its last DeviceReport) by `connection` (the daemon's number),
`pid` and `model_id`. Left out of any equality with the JSON:
nothing; `moed_mem_available_bytes` and `moed_uptime_seconds` simply move between
two snapshots.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import msgspec
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from moed.protocol.stats import (
    DeviceRow,
    Metric,
    ModelRow,
    Stats,
    TenantModelRow,
    TenantRow,
    TurnRow,
    metric_fields,
)

from .config import parse_listen

log = logging.getLogger("moed.prometheus")


def _family(prefix: str, metric: Metric, labels: list[str]):
    cls = CounterMetricFamily if metric.kind == "counter" else GaugeMetricFamily
    return cls(f"moed_{prefix}{metric.name}", metric.help, labels=labels)


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
    for key, metric in metric_fields(Stats):
        if metric.kind == "histogram":
            yield _histogram(f"moed_{metric.name}", metric.help, stats[key])
        else:  # a key the snapshot leaves out (verify off) counts 0
            f = _family("", metric, [])
            f.add_metric([], float(stats.get(key, 0)))
            yield f
    yield from _rows("tenant_", TenantRow, ["uid"], [([str(t["uid"])], t) for t in stats["tenants"]])
    yield from _rows(
        "model_", ModelRow, ["model_id", "model"], [([str(m["model_id"]), m["path"]], m) for m in stats["models"]]
    )
    pairs = [([str(t["uid"]), mid], row) for t in stats["tenants"] for mid, row in t["models"].items()]
    yield from _rows("tenant_model_", TenantModelRow, ["uid", "model_id"], pairs)
    engines = [([str(e["connection"]), str(e["pid"]), e["name"]], e) for e in stats.get("engines", [])]
    yield from _rows("engine_", TurnRow, ["connection", "pid", "name"], engines)
    devices = [
        ([str(d["connection"]), str(d["pid"]), str(d["model_id"])], d)
        for c in stats["clients"]
        for d in c.get("devices", [])
    ]
    yield from _rows("engine_device_", DeviceRow, ["connection", "pid", "model_id"], devices)


def _rows(
    prefix: str, row_type: type[msgspec.Struct], labels: list[str], rows: list[tuple[list[str], dict]]
) -> Iterator:
    for key, metric in metric_fields(row_type):
        f = _family(prefix, metric, labels)
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
