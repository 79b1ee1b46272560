"""The front's Prometheus metrics: every request of every worker, counted in one place.

What this module owns: the serving metrics of `moectl serve` (`--metrics-listen`).
The front sees every request on its way to a worker and back, so it counts them
itself in one process: no prometheus_client multiprocess directory, and a worker
restarting loses nothing. Counters and histograms are prometheus_client's;
in-flight, queued, ready workers and restarts are read from the pools at scrape
time (a collector), so they can never drift from dispatch.

| metric | labels |
|---|---|
| `moed_serve_requests_total` | model, status |
| `moed_serve_requests_in_flight`, `moed_serve_requests_queued` | model |
| `moed_serve_time_to_first_token_seconds` (streams), `moed_serve_request_duration_seconds` | model |
| `moed_serve_tokens_generated_total` | model |
| `moed_serve_workers`, `moed_serve_workers_ready`, `moed_serve_worker_restarts_total` | model |
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from moed.serve.pool import WorkerPool

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _PoolCollector:
    def __init__(self, pools: dict[str, WorkerPool]):
        self.pools = pools

    def collect(self):
        families = {
            "in_flight": GaugeMetricFamily(
                "moed_serve_requests_in_flight", "Requests a worker is serving now", labels=["model"]
            ),
            "queued": GaugeMetricFamily(
                "moed_serve_requests_queued", "Requests waiting for a free worker", labels=["model"]
            ),
            "workers": GaugeMetricFamily("moed_serve_workers", "Worker processes configured", labels=["model"]),
            "ready": GaugeMetricFamily("moed_serve_workers_ready", "Workers taking requests now", labels=["model"]),
        }
        restarts = CounterMetricFamily("moed_serve_worker_restarts", "Worker processes restarted", labels=["model"])
        for name, pool in self.pools.items():
            families["in_flight"].add_metric([name], pool.in_flight)
            families["queued"].add_metric([name], pool.queued)
            families["workers"].add_metric([name], len(pool.slots))
            families["ready"].add_metric([name], sum(s.ready for s in pool.slots))
            restarts.add_metric([name], sum(s.restarts for s in pool.slots))
        yield from families.values()
        yield restarts


class ServeMetrics:
    """The front's registry (see module)."""

    def __init__(self, pools: dict[str, WorkerPool]):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "moed_serve_requests", "Requests answered, by HTTP status", ["model", "status"], registry=self.registry
        )
        self.ttft = Histogram(
            "moed_serve_time_to_first_token_seconds",
            "A streamed request's arrival to its first token",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.duration = Histogram(
            "moed_serve_request_duration_seconds",
            "A request's arrival to its last byte",
            ["model"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "moed_serve_tokens_generated", "Completion tokens generated", ["model"], registry=self.registry
        )
        self.registry.register(_PoolCollector(pools))

    def serve(self, host: str, port: int):
        """Start the /metrics endpoint on its own thread (prometheus_client's); returns its server."""
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server


__all__ = ["ServeMetrics"]
