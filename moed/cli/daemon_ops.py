"""moectl verbs that talk to a running daemon: ping, stats, models."""

from __future__ import annotations

import json
import time

from moed.client import Client
from moed.protocol.sizes import format_size


def register(sub) -> None:
    p = sub.add_parser("ping", help="check that the daemon answers, and how fast")
    p.add_argument("-n", type=int, default=1, help="round trips to time")
    p.set_defaults(func=cmd_ping)
    p = sub.add_parser("stats", help="budget, hits, reads, models and tenants")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=cmd_stats)
    p = sub.add_parser("models", help="open models and who uses them")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)


def cmd_ping(args) -> int:
    with Client(args.socket, "moectl") as c:
        times = []
        for _ in range(max(1, args.n)):
            t0 = time.perf_counter()
            c.ping()
            times.append((time.perf_counter() - t0) * 1e6)
        times.sort()
        h = c.hello
        assert h is not None  # set by connect()
        print(
            f"moed {h.daemon_version} pid {h.daemon_pid} on {c.socket_path}: "
            f"round trip {times[len(times) // 2]:.0f} µs (median of {len(times)})"
        )
    return 0


def _repack_line(s: dict) -> str:
    """Repack on read and its cache on disk (moed.daemon.onread, moed.daemon.repackcache)."""
    made = f"{format_size(s.get('repacked_bytes', 0))} made on read ({s.get('repack_cpu_s', 0.0):.1f} CPU-s)"
    if not s.get("repack_cache_dir"):
        return made + "; cache off"
    return (
        made + f"; cache {format_size(s['repack_cache_bytes'])} in {s['repack_cache_dir']}: "
        f"{s['repack_cache_reads']} read, {s['repack_cache_writes']} written, {s['repack_cache_skipped']} skipped"
    )


def _drive_line(s: dict) -> str:
    """How the drive does: behind or not, quarantined experts, stuck reads (docs/design.md §12)."""
    parts = [
        f"BEHIND (latency {s.get('drive_latency_ratio', 0):.1f}x its own baseline): no read-ahead"
        if s.get("drive_behind")
        else "keeping up",
        f"{s.get('read_retries', 0)} retried reads",
        f"{s.get('quarantined_experts', 0)} experts quarantined (moectl clear-errors)",
    ]
    if s.get("stuck_reads"):
        parts.append(f"{s['stuck_reads']} READS STUCK now")
    return ", ".join(parts)


def cmd_stats(args) -> int:
    with Client(args.socket, "moectl") as c:
        stats = c.stats()
    if args.json:
        print(json.dumps(stats, sort_keys=True))
    else:
        print_stats(stats)
    return 0


def print_stats(s: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = Table(title=f"moed {s['version']} (pid {s['pid']}, up {s['uptime_s']:.0f} s)", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    pct = lambda a, b: f"{100 * a / b:.1f}%" if b else "-"  # noqa: E731
    rows = [
        (
            "budget",
            f"{format_size(s['used_bytes'])} used of {format_size(s['budget_bytes'])} "
            f"({pct(s['used_bytes'], s['budget_bytes'])}), {s['resident_experts']} experts resident",
        ),
        (
            "pinned",
            f"{format_size(s['pinned_bytes'])} of {format_size(s['pin_budget_bytes'])}, "
            f"{s.get('pinned_experts', 0)} experts, {100 * s.get('pinned_hit_share', 0):.1f}% of hits",
        ),
        ("locked", "yes" if s["locked"] else f"NO: {s['lock_error']}"),
        (
            "hits / misses",
            f"{s['hits']} / {s['misses']} (hit rate {pct(s['hits'], s['hits'] + s['misses'])}), "
            f"{s['shared_hits']} hits on experts another tenant read in",
        ),
        (
            "prefetch",
            f"{s['prefetches']} issued, {s['prefetch_hits']} hit, {s['wasted_prefetches']} wasted, "
            f"{s.get('prefetch_dropped', 0)} dropped (drive behind)",
        ),
        (
            "read",
            f"{format_size(s['bytes_read'])}, {s['read_errors']} errors, "
            f"{'O_DIRECT' if s['direct_io'] else 'buffered'}, {s['reads_in_flight']} in flight",
        ),
        ("drive", _drive_line(s)),
        ("repack", _repack_line(s)),
        ("evictions", str(s["evictions"])),
        (
            "memory",
            f"{format_size(s['mem_available_bytes'])} available, floor {format_size(s['mem_floor_bytes'])}"
            + (
                f"; GUARD ACTIVE: store limited to {format_size(s['effective_budget_bytes'])}"
                if s.get("mem_guard_active")
                else ""
            )
            + f"; {format_size(s.get('given_back_bytes', 0))} given back",
        ),
        (
            "verify",
            (
                f"on: {s['verified_reads']} re-reads verified, {s['verify_mismatches']} MISMATCHES"
                if s.get("verify")
                else "off"
            ),
        ),
        (
            "local hits",
            f"{s.get('local_hits', 0)} served in engines with no round trip, "
            f"{s.get('adopted_slots', 0)} slots held there now"
            + (f", {s['revoked_regions']} closed connection(s) still draining" if s.get("revoked_regions") else ""),
        ),
        ("connections", _connections_line(s)),
        ("compute turns", _turns_line(s)),
        ("device slots", _device_line(s)),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    _print_models(console, s["models"])
    _print_engines(console, s.get("clients", []))
    _print_threads(console, s.get("engines", []))
    tt = Table(title="tenants")
    for col in ("uid", "names", "hits", "misses", "hit rate", "read", "resident", "leases", "floor/ceiling"):
        tt.add_column(col)
    for r in s["tenants"]:
        tt.add_row(
            str(r["uid"]),
            ",".join(r["names"]),
            str(r["hits"]),
            str(r["misses"]),
            pct(r["hits"], r["hits"] + r["misses"]),
            format_size(r["bytes_read"]),
            format_size(r["resident_bytes"]),
            str(r["leases"]),
            f"{format_size(r.get('floor_bytes', 0))}/"
            + (format_size(r["ceiling_bytes"]) if r.get("ceiling_bytes") else "-"),
        )
    console.print(tt)


def _connections_line(s: dict) -> str:
    """Connections, what the busiest one makes the daemon hold, and the bounds on it."""
    clients, lim = s.get("clients", []), s.get("limits", {})
    queued = max((c["queued_bytes"] for c in clients), default=0)
    out = max((c["buffered_out_bytes"] for c in clients), default=0)
    line = (
        f"{s['connections']}, this one included "
        f"(max {lim.get('max_clients', '?')}, {lim.get('max_clients_per_tenant', '?')} a tenant)"
    )
    if clients:
        line += (
            f"; most buffered by one: {format_size(queued)} of requests "
            f"(bound {format_size(lim.get('max_queued_bytes', 0))}), {format_size(out)} of replies "
            f"(bound {format_size(lim.get('write_high_bytes', 0))})"
        )
    if s.get("timed_out_connections"):
        line += f"; {s['timed_out_connections']} closed for silence"
    return line


def _turns_line(s: dict) -> str:
    """The cores shared by the engines (moed.daemon.turns): turns granted, and waited for."""
    waits = s.get("turn_waits", 0)
    line = f"{s.get('turns', 0)} granted, {s.get('engines_active', 0)} engines active"
    if waits:
        line += f"; {waits} waited, {s.get('turn_wait_s', 0.0):.3f} s in all"
    if s.get("turns_overdue"):
        line += f"; {s['turns_overdue']} held past {s.get('limits', {}).get('turn_max_s', '?')} s"
    return line


def _print_threads(console, engines: list[dict]) -> None:
    """Each engine's thread counts (decode/batch, and who set them) and its waits for a turn."""
    from rich.table import Table

    if not engines:
        return
    t = Table(title="threads (compute turns)")
    for col in ("pid", "threads", "cores", "by", "now", "turns", "waited"):
        t.add_column(col)
    t.add_column("name", no_wrap=True)  # last and whole, as the tenants' names
    for e in engines:
        now = "computing" if e["computing"] else "waiting" if e["waiting"] else "active" if e["active"] else "idle"
        t.add_row(
            str(e["pid"]),
            f"{e['threads']}/{e['threads_batch']}",
            str(e["cpus"]),
            "moed" if e["auto"] else "user",
            now,
            str(e["turns"]),
            f"{e['turn_waits']}, {e['turn_wait_s']:.2f} s",
            e["name"],
        )
    console.print(t)


def _print_engines(console, clients: list[dict]) -> None:
    """Each engine connected: whose, which model, and what computes where (OpenModel.compute)."""
    from rich.table import Table

    rows = [(c, mid, what) for c in clients for mid, what in c.get("engines", [])]
    if not rows:
        return
    t = Table(title="engines")
    for col in ("pid", "uid", "name", "model", "computes", "device slots"):
        t.add_column(col)
    for c, mid, what in rows:
        device = next((d for d in c.get("devices", []) if d["model_id"] == mid), None)
        t.add_row(str(c["pid"]), str(c["uid"]), c.get("name", ""), str(mid), what, _device_cell(device))
    console.print(t)


def _device_cell(d: dict | None) -> str:
    """An engine's device slots as it last reported them (DeviceReport), or "" where it has none."""
    if d is None:
        return ""
    moved = "read in place" if d["zero_copy"] else f"uploads {d['uploads']} ({format_size(d['upload_bytes'])})"
    return f"{d['slots']} a layer x {d['layers']}: hits {d['hits']}, {moved}, evictions {d['evictions']}"


def _device_line(s: dict) -> str:
    """Every engine's device slots together, closed engines included (the daemon's sums)."""
    return (
        f"{s.get('device_hits', 0)} hits, {s.get('device_uploads', 0)} uploads "
        f"({format_size(s.get('device_upload_bytes', 0))}), {s.get('device_evictions', 0)} evictions "
        "in engines' device slots"
    )


def _print_models(console, models: list[dict]) -> None:
    from rich.table import Table

    t = Table(title="models")
    for col in ("id", "path", "layers", "experts", "top-k", "layout", "resident", "io", "users"):
        t.add_column(col)
    for r in models:
        t.add_row(
            str(r["model_id"]),
            r["path"] + (" (stale)" if r["stale"] else ""),
            str(r["moe_layers"]),
            str(r["n_experts"]),
            str(r["n_expert_used"]),
            r.get("expert_layout", "plain") + (" (made on read)" if r.get("repack_on_read") else ""),
            str(r["resident_experts"]),
            "direct" if r["direct_io"] else "buffered",
            ",".join(map(str, r["users"])),
        )
    console.print(t)


def cmd_models(args) -> int:
    with Client(args.socket, "moectl") as c:
        models = c.models()
    if args.json:
        print(json.dumps(models, sort_keys=True))
    else:
        from rich.console import Console

        _print_models(Console(), models)
    return 0
