"""moectl top: a live view of the daemon, refreshed each second (rich Live).

What this module owns: turning two stats snapshots into rates over the interval
between them (`rates`, `tenant_rows`, `model_rows`: pure, unit-tested) and
rendering them (`frame`). Shown: hits/s, misses/s, hit % and MiB/s read over the
interval, evictions/s, prefetches issued/s and the share of them wasted, the
mean acquire service time, reads in flight, memory (the RAM tier against its
budget, MemAvailable against the floor, bytes given back), and one row per
tenant and per model. With `--serve URL` (a `moectl serve --metrics-listen`
endpoint, repeatable), one row per server and model too: requests/s, errors/s,
tokens/s, mean time to first token over the interval, in flight, queued, workers
ready (`serve_snapshot`, `serve_rows`: pure). q or Ctrl-C quits; `--once` prints
one frame (rates over one `--interval`) for scripts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import sys
import time

from rich.console import Group
from rich.table import Table
from rich.text import Text

from moed.protocol.sizes import format_size

MIB = float(1 << 20)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("top", help="live view: rates, tenants, models, memory (q quits)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between snapshots (default 1)")
    p.add_argument(
        "--serve",
        action="append",
        default=[],
        metavar="URL",
        help="a moectl serve metrics address (http://HOST:PORT/metrics); repeat for several servers",
    )
    p.set_defaults(func=cmd_top)


# ---- rates (pure) ----------------------------------------------------------


def _per_s(prev: dict, cur: dict, key: str, dt: float) -> float:
    return (cur.get(key, 0) - prev.get(key, 0)) / dt if dt > 0 else 0.0


def _share(part: float, whole: float) -> float | None:
    return 100.0 * part / whole if whole > 0 else None


def rates(prev: dict, cur: dict, dt: float) -> dict:
    """Daemon-wide rates over the `dt` seconds between two snapshots (None: nothing to divide)."""
    d = {k: cur[k] - prev[k] for k in ("hits", "misses", "prefetches", "wasted_prefetches")}
    acq_prev, acq_cur = prev.get("acquire_latency_s") or {}, cur.get("acquire_latency_s") or {}
    acquires = acq_cur.get("count", 0) - acq_prev.get("count", 0)
    return {
        "hits_s": _per_s(prev, cur, "hits", dt),
        "misses_s": _per_s(prev, cur, "misses", dt),
        "hit_pct": _share(d["hits"], d["hits"] + d["misses"]),
        "read_mib_s": _per_s(prev, cur, "bytes_read", dt) / MIB,
        "evictions_s": _per_s(prev, cur, "evictions", dt),
        "prefetch_s": _per_s(prev, cur, "prefetches", dt),
        "prefetch_waste_pct": _share(d["wasted_prefetches"], d["prefetches"]),
        "acquire_mean_s": (
            (acq_cur.get("sum_s", 0.0) - acq_prev.get("sum_s", 0.0)) / acquires if acquires > 0 else None
        ),
    }


def _row_rates(prev: dict | None, cur: dict, dt: float) -> dict:
    prev = prev or {"hits": 0, "misses": 0, "bytes_read": 0}
    hits, misses = cur["hits"] - prev["hits"], cur["misses"] - prev["misses"]
    return {
        "hits_s": _per_s(prev, cur, "hits", dt),
        "hit_pct": _share(hits, hits + misses),
        "read_mib_s": _per_s(prev, cur, "bytes_read", dt) / MIB,
    }


def tenant_rows(prev: dict, cur: dict, dt: float) -> list[dict]:
    """One row per tenant of `cur`: its snapshot row plus its rates (a new tenant counts from 0)."""
    before = {t["uid"]: t for t in prev["tenants"]}
    return [{**t, **_row_rates(before.get(t["uid"]), t, dt)} for t in cur["tenants"]]


def names_cell(names: list[str]) -> str:
    """A tenant's client names, each once with its count: 'moectl serve x2, moectl top'."""
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(name if n == 1 else f"{name} x{n}" for name, n in counts.items())


def model_rows(prev: dict, cur: dict, dt: float) -> list[dict]:
    before = {m["model_id"]: m for m in prev["models"]}
    return [{**m, **_row_rates(before.get(m["model_id"]), m, dt)} for m in cur["models"]]


def engine_rows(prev: dict, cur: dict, dt: float) -> list[dict]:
    """One row per engine that took a compute turn (moed.daemon.turns): its snapshot row plus
    turns a second and the share of the interval it waited for turns (a new one from 0)."""
    before = {e["connection"]: e for e in prev.get("engines", [])}
    rows = []
    for e in cur.get("engines", []):
        was = before.get(e["connection"], {"turns": 0, "turn_wait_s": 0.0})
        waited = e["turn_wait_s"] - was["turn_wait_s"]
        rows.append({**e, "turns_s": _per_s(was, e, "turns", dt), "wait_pct": _share(waited, dt)})
    return rows


def device_rows(prev: dict, cur: dict, dt: float) -> list[dict]:
    """One row per engine's device slots (its last DeviceReport, `clients[].devices`): hits,
    uploads and evictions a second over the interval (a new one from 0; reports come about once
    a second, so a rate moves in steps)."""
    key = lambda d: (d["connection"], d["model_id"])  # noqa: E731
    before = {key(d): d for c in prev["clients"] for d in c.get("devices", [])}
    rows = []
    for d in (d for c in cur["clients"] for d in c.get("devices", [])):
        was = before.get(key(d), {"hits": 0, "uploads": 0, "evictions": 0})
        rows.append({**d, **{f"{k}_s": _per_s(was, d, k, dt) for k in ("hits", "uploads", "evictions")}})
    return rows


def serve_snapshot(text: str) -> dict[str, dict[str, float]]:
    """Per model, the front's metrics that top shows, from their Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    rows: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            model = sample.labels.get("model")
            if model is None:
                continue
            row = rows.setdefault(model, {})
            name = sample.name
            if name == "moed_serve_requests_total":
                key = "requests" if int(sample.labels.get("status", "0")) < 400 else "errors"
                row[key] = row.get(key, 0.0) + sample.value
                row.setdefault("errors" if key == "requests" else "requests", 0.0)
            elif name in _SERVE_KEYS:
                row[_SERVE_KEYS[name]] = sample.value
    return rows


_SERVE_KEYS = {
    "moed_serve_tokens_generated_total": "tokens",
    "moed_serve_time_to_first_token_seconds_sum": "ttft_sum_s",
    "moed_serve_time_to_first_token_seconds_count": "ttft_count",
    "moed_serve_requests_in_flight": "in_flight",
    "moed_serve_requests_queued": "queued",
    "moed_serve_workers": "workers",
    "moed_serve_workers_ready": "ready",
}


def serve_rows(server: str, prev: dict, cur: dict, dt: float) -> list[dict]:
    """One row per model of one server: its rates over the interval and its state now."""
    out = []
    for model, row in cur.items():
        before = prev.get(model, {})
        ttfts = row.get("ttft_count", 0) - before.get("ttft_count", 0)
        ttft_s = row.get("ttft_sum_s", 0) - before.get("ttft_sum_s", 0)
        out.append(
            {
                "server": server,
                "model": model,
                "requests_s": _per_s(before, row, "requests", dt),
                "errors_s": _per_s(before, row, "errors", dt),
                "tokens_s": _per_s(before, row, "tokens", dt),
                "ttft_mean_s": ttft_s / ttfts if ttfts > 0 else None,
                "in_flight": int(row.get("in_flight", 0)),
                "queued": int(row.get("queued", 0)),
                "ready": int(row.get("ready", 0)),
                "workers": int(row.get("workers", 0)),
            }
        )
    return out


# ---- rendering ---------------------------------------------------------------


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}%"


def _n(v: float) -> str:
    return f"{v:,.1f}"


def _memory(s: dict) -> Text:
    used, budget = s["used_bytes"], s["budget_bytes"]
    avail, floor = s["mem_available_bytes"], s["mem_floor_bytes"]
    line = Text(
        f"RAM tier {format_size(used)} of {format_size(budget)} ({_pct(_share(used, budget))}), "
        f"pinned {format_size(s['pinned_bytes'])}; MemAvailable {format_size(avail)}, "
        f"floor {format_size(floor)}"
    )
    if floor:
        line.append(f" (headroom {format_size(max(0, avail - floor))})")
    line.append(f"; given back {format_size(s.get('given_back_bytes', 0))}")
    if s.get("mem_guard_active"):
        line.append(f"\nGUARD ACTIVE: store held to {format_size(s['effective_budget_bytes'])}", style="bold red")
    return line


def _servers(rows: list[dict]) -> Table:
    t = Table(
        "server", "model", "req/s", "err/s", "tok/s", "ttft", "in flight", "queued", "workers",
        title="servers", title_justify="left",
    )  # fmt: skip
    for r in rows:
        ttft = "-" if r["ttft_mean_s"] is None else f"{r['ttft_mean_s'] * 1e3:.0f} ms"
        t.add_row(
            r["server"], r["model"], _n(r["requests_s"]), _n(r["errors_s"]), _n(r["tokens_s"]), ttft,
            str(r["in_flight"]), str(r["queued"]), f"{r['ready']}/{r['workers']}",
        )  # fmt: skip
    return t


def _threads(rows: list[dict]) -> Table:
    """The engines' threads and their waits for a compute turn (moed.daemon.turns)."""
    t = Table("pid", "threads", "batch", "set by", "turns/s", "waiting", title="threads", title_justify="left")
    t.add_column("name", no_wrap=True)
    for e in rows:
        t.add_row(
            str(e["pid"]),
            str(e["threads"]),
            str(e["threads_batch"]),
            "moed" if e["auto"] else "user",
            _n(e["turns_s"]),
            _pct(e["wait_pct"]),
            e["name"],
        )
    return t


def _devices(rows: list[dict]) -> Table:
    """The engines' device slots (moed.engines.device_slots, as each engine reports them)."""
    t = Table("pid", "model", "slots", "layers", "hits/s", "uploads/s", "evict/s", title="device slots")
    t.title_justify = "left"
    for d in rows:
        slots = f"{d['slots']}" + (" (zero copy)" if d["zero_copy"] else "")
        t.add_row(
            str(d["pid"]), str(d["model_id"]), slots, str(d["layers"]),
            _n(d["hits_s"]), _n(d["uploads_s"]), _n(d["evictions_s"]),
        )  # fmt: skip
    return t


def frame(prev: dict, cur: dict, dt: float, servers: list[dict] | None = None):
    """One screen: header, rates, memory, tenants, models, the engines' threads (and servers, when watched)."""
    r = rates(prev, cur, dt)
    head = Text(
        f"moed {cur['version']}  pid {cur['pid']}  up {cur['uptime_s']:.0f} s  "
        f"{cur['connections']} connections (this view's included)  {cur['reads_in_flight']} reads in flight  "
        f"policy {cur['policy']}",
        style="bold",
    )
    t = Table(
        title=f"over the last {dt:.1f} s (acquire: mean service time)", title_justify="left", box=None, pad_edge=False
    )
    cells = [
        ("hits/s", _n(r["hits_s"])),
        ("miss/s", _n(r["misses_s"])),
        ("hit%", _pct(r["hit_pct"])),
        ("read MiB/s", f"{r['read_mib_s']:.2f}"),
        ("evict/s", _n(r["evictions_s"])),
        ("prefetch/s", _n(r["prefetch_s"])),
        ("waste", _pct(r["prefetch_waste_pct"])),
        ("acquire", "-" if r["acquire_mean_s"] is None else f"{r['acquire_mean_s'] * 1e6:.0f} µs"),
    ]
    for name, _ in cells:
        t.add_column(name, justify="right")
    t.add_row(*(v for _, v in cells))
    tenants = Table(
        "uid", "conns", "leases", "hits/s", "hit %", "read MiB/s", "resident", title="tenants", title_justify="left"
    )
    # The names last and whole: a long list widens the table instead of being cut or wrapped.
    tenants.add_column("clients", no_wrap=True)
    for row in tenant_rows(prev, cur, dt):
        tenants.add_row(
            str(row["uid"]),
            str(row["connections"]),
            str(row["leases"]),
            _n(row["hits_s"]),
            _pct(row["hit_pct"]),
            f"{row['read_mib_s']:.2f}",
            format_size(row["resident_bytes"]),
            names_cell(row["names"]),
        )
    models = Table(
        "id",
        "model",
        "hits/s",
        "hit %",
        "read MiB/s",
        "resident",
        "pinned",
        "leases",
        title="models",
        title_justify="left",
    )
    for row in model_rows(prev, cur, dt):
        name = os.path.basename(row["path"]) + (" (stale)" if row["stale"] else "")
        models.add_row(
            str(row["model_id"]),
            name,
            _n(row["hits_s"]),
            _pct(row["hit_pct"]),
            f"{row['read_mib_s']:.2f}",
            format_size(row["resident_bytes"]),
            format_size(row["pinned_bytes"]),
            str(row["leases"]),
        )
    parts: list[Text | Table] = [head, t, _memory(cur), tenants, models]
    if cur.get("engines"):
        parts.append(_threads(engine_rows(prev, cur, dt)))
    devices = device_rows(prev, cur, dt)
    if devices:
        parts.append(_devices(devices))
    if servers is not None:
        parts.append(_servers(servers))
    return Group(*parts)


# ---- the live loop -------------------------------------------------------------


@contextlib.contextmanager
def _keys():
    """A function `wait(timeout_s) -> True if q was pressed`; the terminal in cbreak mode meanwhile."""
    if not sys.stdin.isatty():
        yield lambda timeout_s: bool(time.sleep(timeout_s))
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def wait(timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([fd], [], [], left)
            if ready and os.read(fd, 1) in (b"q", b"Q"):
                return True
        return False

    try:
        yield wait
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


class _Servers:
    """The watched servers' metrics, fetched at each frame (an unreachable one shows as such)."""

    def __init__(self, urls: list[str]):
        self.urls = urls
        self.prev: dict[str, dict] = {url: {} for url in urls}

    @staticmethod
    def _fetch(url: str) -> dict | None:
        import urllib.request

        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return serve_snapshot(r.read().decode())
        except OSError:
            return None

    def rows(self, dt: float) -> list[dict] | None:
        if not self.urls:
            return None
        out = []
        for url in self.urls:
            cur = self._fetch(url)
            if cur is None:
                out.append(_unreachable(url))
                continue
            out += serve_rows(url, self.prev[url], cur, dt)
            self.prev[url] = cur
        return out


def _unreachable(url: str) -> dict:
    return {
        "server": url, "model": "(unreachable)", "requests_s": 0.0, "errors_s": 0.0, "tokens_s": 0.0,
        "ttft_mean_s": None, "in_flight": 0, "queued": 0, "ready": 0, "workers": 0,
    }  # fmt: skip


def cmd_top(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from moed.client import Client

    servers = _Servers(args.serve)
    with Client(args.socket, "moectl top") as c:
        prev, t_prev = c.stats(), time.monotonic()
        servers.rows(0.0)
        if args.once:
            time.sleep(args.interval)
            dt = time.monotonic() - t_prev
            shown = frame(prev, c.stats(), dt, servers.rows(dt))
            console = Console()
            # A script reads the whole frame: as wide as it needs, never cut or wrapped.
            wide = console.options.update_width(1 << 12)
            console.width = max(console.width, console.measure(shown, options=wide).maximum)
            console.print(shown)
            return 0
        try:
            with _keys() as wait, Live(frame(prev, prev, 0.0), refresh_per_second=4) as live:
                while not wait(args.interval):
                    cur, now = c.stats(), time.monotonic()
                    live.update(frame(prev, cur, now - t_prev, servers.rows(now - t_prev)))
                    prev, t_prev = cur, now
        except KeyboardInterrupt:
            pass
    return 0
