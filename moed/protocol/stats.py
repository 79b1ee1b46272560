"""The stats schema: what `moectl stats --json`, `Client.stats()` and `/metrics` carry.

What this module owns: the one declaration of every stats field. `Stats` is the
GetStats reply's payload and `ModelRow` the ListModels reply's rows; a field that
is also a Prometheus metric says so where it is declared, in its annotation
(`Annotated[int, counter(name, help)]`, `gauge(...)`, `histogram(...)`), and
moed/daemon/prometheus.py exports exactly those (`metric_fields`). msgspec ignores
annotations that are not its own `Meta`, so the wire does not see them.

Invariants: the contract keys (`CONTRACT_KEYS`: budget_bytes, used_bytes,
pinned_bytes, hits, misses, prefetch_hits, bytes_read, direct_io,
mem_available_bytes, mem_floor_bytes, models, tenants: what tools reading
`moectl stats --json` may rely on) are fields here; fields are only appended,
with defaults, like every message; a metric's name and help never change (they
are what dashboards query). The daemon builds a snapshot and converts it through
these types, so a key it forgets or mistypes fails loudly in the tests, and a key
it adds without declaring it here is refused (`forbid_unknown_fields`).

Adding a counter: declare the field here with its metric; the daemon fills it
(moed/daemon/counters.py copies its `Counters` and rows by field name).
"""

from __future__ import annotations

import functools
import typing
from typing import Annotated, Literal, NamedTuple

import msgspec

# The contract: `moectl stats --json` carries at least these keys, and always will.
CONTRACT_KEYS = frozenset(
    {
        "budget_bytes",
        "used_bytes",
        "pinned_bytes",
        "hits",
        "misses",
        "prefetch_hits",
        "bytes_read",
        "direct_io",
        "mem_available_bytes",
        "mem_floor_bytes",
        "models",
        "tenants",
    }
)


class Metric(NamedTuple):
    """How one field is exported: `moed_<row prefix><name>`, `_total` added to counters
    by prometheus_client. Names carry units (`_bytes`, `_seconds`)."""

    kind: Literal["counter", "gauge", "histogram"]
    name: str
    help: str


def counter(name: str, help: str) -> Metric:
    return Metric("counter", name, help)


def gauge(name: str, help: str) -> Metric:
    return Metric("gauge", name, help)


def histogram(name: str, help: str) -> Metric:
    return Metric("histogram", name, help)


@functools.cache
def metric_fields(cls: type[msgspec.Struct]) -> tuple[tuple[str, Metric], ...]:
    """(field name, Metric) of every field of `cls` declared as a metric, in field order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    found = []
    for name in cls.__struct_fields__:
        extras = getattr(hints[name], "__metadata__", ())
        found += [(name, x) for x in extras if isinstance(x, Metric)]
    return tuple(found)


class _Row(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=False):
    pass


class ModelRow(_Row):
    model_id: int
    path: str
    files: list[str]
    moe_layers: int
    n_experts: int
    n_expert_used: int
    resident_experts: Annotated[int, gauge("resident_experts", "This model's experts resident")]
    resident_bytes: Annotated[int, gauge("resident_bytes", "RAM tier bytes of this model's experts")]
    pinned_experts: int
    pinned_bytes: Annotated[int, gauge("pinned_bytes", "Pinned partition bytes of this model")]
    pinned: list[tuple[int, int]]  # (layer, expert) of every pinned expert
    hits: Annotated[int, counter("hits", "Hits on this model")]
    misses: Annotated[int, counter("misses", "Misses on this model")]
    bytes_read: Annotated[int, counter("read_bytes", "Bytes read from this model's files")]
    leases: Annotated[int, gauge("leases", "Leases on this model held now")]
    direct_io: bool
    stale: Annotated[bool, gauge("stale", "1 if the model changed on disk and is draining")]
    users: list[int]  # uids with the model open
    read_errors: Annotated[int, counter("read_errors", "Reads of this model's experts that failed")] = 0
    quarantined: list[tuple[int, int]] = []  # (layer, expert) whose acquires fail at once for now
    expert_layout: str = "plain"  # the layout its experts are served in (moed.gguf.layouts)
    # Every expert pinned and READY: engines take whole steps (no per-layer stop)
    all_pinned: Annotated[bool, gauge("all_pinned", "1 if every expert is pinned: engines take whole steps")] = False
    # expert_layout is made as the experts are read (the file is plain; moed.daemon.onread)
    repack_on_read: bool = False


class TenantModelRow(_Row):
    hits: Annotated[int, counter("hits", "Hits of this tenant on this model")]
    misses: Annotated[int, counter("misses", "Misses of this tenant on this model")]
    bytes_read: Annotated[int, counter("read_bytes", "Bytes read for this tenant on this model")]
    resident_bytes: Annotated[int, gauge("resident_bytes", "RAM tier bytes of this model this tenant read in")]
    leases: Annotated[int, gauge("leases", "Leases of this tenant on this model held now")]


class TenantRow(_Row):
    uid: int
    names: list[str]
    pids: list[int]
    connections: Annotated[int, gauge("connections", "Open connections of this tenant")]
    hits: Annotated[int, counter("hits", "Hits of this tenant")]
    shared_hits: Annotated[int, counter("shared_hits", "Hits of this tenant on experts another tenant read in")]
    misses: Annotated[int, counter("misses", "Misses of this tenant")]
    bytes_read: Annotated[int, counter("read_bytes", "Bytes read for this tenant's misses and prefetches")]
    resident_bytes: Annotated[int, gauge("resident_bytes", "RAM tier bytes of experts this tenant read in")]
    leases: Annotated[int, gauge("leases", "Leases this tenant holds now")]
    floor_bytes: Annotated[int, gauge("floor_bytes", "This tenant's reserved floor")]
    ceiling_bytes: Annotated[int, gauge("ceiling_bytes", "This tenant's ceiling (0: none)")]
    models: dict[str, TenantModelRow]


class DeviceRow(_Row):
    """One engine's device slots for one model (its latest DeviceReport; moed.engines.device_slots)."""

    model_id: int
    pid: int  # the engine's process
    connection: int  # the daemon's number for the engine's connection (labels: connection, pid, model_id)
    slots: Annotated[int, gauge("slots", "Device expert slots a layer of this engine")]
    layers: int  # layers whose experts compute in the device slots
    hits: Annotated[int, counter("hits", "Experts this engine's device slots already held")]
    uploads: Annotated[int, counter("uploads", "Experts this engine copied into a device slot")]
    upload_bytes: Annotated[int, counter("upload_bytes", "Bytes this engine copied into device slots")]
    evictions: Annotated[int, counter("evictions", "Device slots this engine gave to another expert")]
    zero_copy: bool = False  # the device reads moed's RAM tier in place


class ClientRow(_Row):
    """What one connection makes the daemon hold now."""

    pid: int
    uid: int
    leases: int
    busy: bool
    queued_requests: int
    queued_bytes: int
    buffered_out_bytes: int
    reading: bool
    local_holds: int = 0  # slots it holds in its hold region (no round trip)
    name: str = ""  # the client's name (Hello)
    engines: list[tuple[int, str]] = []  # (model id, what computes where) of the engines it runs
    devices: list[DeviceRow] = []  # its engines' device slots, as they last reported them


class TurnRow(_Row):
    """One engine's (one connection's) compute turns and thread counts (moed.daemon.turns)."""

    connection: int  # the daemon's number for the engine's connection (labels: connection, pid, name)
    pid: int
    uid: int
    name: str  # the client's name (Hello)
    cpus: int  # the cores the engine may run on, as it said
    threads: Annotated[int, gauge("threads", "Threads this engine computes single tokens with (its last turn)")]
    threads_batch: Annotated[int, gauge("threads_batch", "Threads this engine computes prompt batches with")]
    auto: bool  # the daemon decides a count of it (the user gave not both)
    computing: Annotated[bool, gauge("computing", "1 while this engine holds a compute turn")]
    waiting: bool  # waiting for a turn now
    active: bool  # counts in the split of the cores (took a turn within turn_idle_s)
    turns: Annotated[int, counter("turns", "Compute turns granted to this engine")]
    turn_waits: Annotated[int, counter("turn_waits", "Turns this engine waited for")]
    turn_wait_s: Annotated[float, counter("turn_wait_seconds", "Time this engine waited for turns")]
    turns_overdue: Annotated[int, counter("turns_overdue", "Turns of this engine held past turn_max_s")]


class Limits(_Row):
    max_clients: int
    max_clients_per_tenant: int
    operator_reserve: int
    max_request_frame_bytes: int
    max_queued_requests: int
    max_queued_bytes: int
    write_high_bytes: int
    hello_timeout_s: float
    idle_timeout_s: float
    max_opens_per_tenant: int
    open_timeout_s: float
    local_hold_share: float = 0.5
    local_holds_per_connection: int = 0
    revoke_grace_s: float = 0.0
    turn_max_s: float = 0.0  # a compute turn held (or waited for) longer no longer blocks others


class HistogramRow(_Row):
    """Durations per bucket: `counts[i]` at most `bounds_s[i]` (and above the bound
    before it); the last count is above every bound."""

    bounds_s: list[float] = []
    counts: list[int] = []
    sum_s: float = 0.0
    count: int = 0


class Stats(_Row):
    version: str
    pid: int
    uptime_s: Annotated[float, gauge("uptime_seconds", "Seconds since the daemon started")]
    # The daemon's own CPU, all threads (readers, transforms, the event loop): on a shared box
    # it is taken from the cores the engines compute on, so a bench can price it per GB read.
    cpu_user_s: Annotated[float, counter("cpu_user_seconds", "The daemon process's user CPU time")]
    cpu_system_s: Annotated[float, counter("cpu_system_seconds", "The daemon process's system CPU time")]
    budget_bytes: Annotated[int, gauge("budget_bytes", "The shared RAM tier budget")]
    used_bytes: Annotated[int, gauge("used_bytes", "Bytes of the RAM tier in use")]
    pinned_bytes: Annotated[int, gauge("pinned_bytes", "Bytes of the pinned partition in use")]
    pin_budget_bytes: Annotated[int, gauge("pin_budget_bytes", "The pinned partition's budget")]
    evictable_bytes: Annotated[int, gauge("evictable_bytes", "Bytes held by nobody (evictable now)")]
    locked: Annotated[bool, gauge("locked", "1 if the RAM tier is locked in memory")]
    lock_error: str
    locked_bytes: Annotated[int, gauge("locked_bytes", "Bytes of expert memory locked (mlock)")]
    resident_experts: Annotated[int, gauge("resident_experts", "Experts resident in the RAM tier")]
    evictions: Annotated[int, counter("evictions", "Experts evicted from the RAM tier")]
    hits: Annotated[int, counter("hits", "Experts granted that were resident (local hits included)")]
    shared_hits: Annotated[int, counter("shared_hits", "Hits on experts another tenant's acquire read in")]
    misses: Annotated[int, counter("misses", "Experts granted that had to be read (or joined a read in flight)")]
    pinned_hits: Annotated[int, counter("pinned_hits", "Hits on experts of the pinned partition")]
    pinned_hit_share: float
    pinned_experts: int
    hit_rate: float
    joined_reads: Annotated[int, counter("joined_reads", "Misses that joined a read already in flight")]
    prefetches: Annotated[int, counter("prefetch_issued", "Prefetch reads issued")]
    prefetch_hits: Annotated[int, counter("prefetch_hits", "Prefetched experts that a later acquire used")]
    wasted_prefetches: Annotated[int, counter("prefetch_wasted", "Prefetched experts dropped or evicted unused")]
    bytes_read: Annotated[int, counter("read_bytes", "Bytes read from model files")]
    read_errors: Annotated[int, counter("read_errors", "Expert reads that failed (after their retries)")]
    reads_in_flight: Annotated[int, gauge("reads_in_flight", "Expert reads in flight")]
    direct_io: bool
    policy: str
    mem_available_bytes: Annotated[int, gauge("mem_available_bytes", "The box's MemAvailable as last sampled")]
    mem_floor_bytes: Annotated[int, gauge("mem_floor_bytes", "The memory floor the guard keeps MemAvailable above")]
    mem_guard_active: Annotated[
        bool, gauge("mem_guard_active", "1 while the memory guard holds the store below its budget")
    ]
    effective_budget_bytes: Annotated[int, gauge("effective_budget_bytes", "The budget the memory guard allows now")]
    given_back_bytes: Annotated[int, counter("given_back_bytes", "Bytes the memory guard gave back to the kernel")]
    mem_guard_actions: Annotated[int, counter("mem_guard_actions", "Times the memory guard acted")]
    mem_hysteresis_bytes: int
    mem_cgroup_limited: bool
    verify: bool
    # A scrape opens no connection (the collector asks the loop); moectl stats and top count their own.
    connections: Annotated[int, gauge("connections", "Open client connections, a scrape opening none")]
    bad_frames: Annotated[int, counter("bad_frames", "Malformed frames received")]
    timed_out_connections: Annotated[int, counter("timed_out_connections", "Connections closed for silence")]
    stale_detected: Annotated[int, counter("stale_models", "Models found changed on disk while open")]
    limits: Limits
    clients: list[ClientRow]
    models: list[ModelRow]
    tenants: list[TenantRow]
    local_hits: Annotated[int, counter("local_hits", "Hits engines served themselves with no round trip")] = 0
    local_claims_refused: int = 0  # evictions put off because an engine held the slot locally
    adopted_slots: int = 0  # slots the store holds for engines' local holds now
    unpins_held: int = 0  # unpins waiting for a whole step that reads their model to end
    revoked_regions: int = 0  # hold regions of connections the daemon closed, still counting
    verified_reads: Annotated[
        int, counter("verified_reads", "Re-reads checked against the first read (verify mode)")
    ] = 0  # verify mode only (and verify_mismatches, verify_hashed_experts)
    verify_mismatches: Annotated[int, counter("verify_mismatches", "Re-reads whose bytes differed (verify mode)")] = 0
    verify_hashed_experts: int = 0
    acquire_latency_s: Annotated[
        HistogramRow, histogram("acquire_duration_seconds", "Daemon acquires, from request to grant on the event loop")
    ] = msgspec.field(default_factory=HistogramRow)
    read_latency_s: Annotated[
        HistogramRow,
        histogram("read_duration_seconds", "Expert reads, from submission to completion on the event loop"),
    ] = msgspec.field(default_factory=HistogramRow)
    # When the drive misbehaves (docs/design.md):
    read_retries: Annotated[int, counter("read_retries", "Chunk reads that failed and were tried again")] = 0
    quarantined_experts: Annotated[int, gauge("quarantined_experts", "Experts whose acquires fail at once for now")] = 0
    quarantine_refusals: Annotated[
        int, counter("quarantine_refusals", "Acquires refused at once: the expert's read failed recently")
    ] = 0
    prefetch_dropped: Annotated[
        int, counter("prefetch_dropped", "Prefetched experts not read because the drive was behind")
    ] = 0
    prefetch_backoff: bool = True  # whether read-ahead holds back while the drive is behind
    stalled_reads: Annotated[int, counter("stalled_reads", "Reads that ran past read_stall_warn_s")] = 0
    stuck_reads: Annotated[int, gauge("stuck_reads", "Reads running past read_stall_warn_s now")] = 0
    drive_behind: Annotated[bool, gauge("drive_behind", "1 while read-ahead is held back (the drive is behind)")] = (
        False
    )
    drive_latency_ratio: Annotated[
        float, gauge("drive_latency_ratio", "Recent read latency over the drive's own baseline")
    ] = 0.0
    drive_behind_episodes: Annotated[
        int, counter("drive_behind_episodes", "Times the drive went behind (read-ahead held back)")
    ] = 0
    # Repack on read (moed.daemon.onread): plain experts made in an engine's layout as they are read
    repacked_bytes: Annotated[int, counter("repacked_bytes", "Expert bytes repacked on read")] = 0
    repack_cpu_s: Annotated[float, counter("repack_cpu_seconds", "Reader threads' CPU time repacking on read")] = 0.0
    repack_wait_cpu_s: Annotated[
        float, counter("repack_wait_cpu_seconds", "Of it, on reads an engine waited on (demand or promoted)")
    ] = 0.0
    # The repack cache (moed.daemon.repackcache): experts made on read kept on disk
    repack_cache_reads: Annotated[int, counter("repack_cache_reads", "Experts read from the repack cache")] = 0
    repack_cache_writes: Annotated[int, counter("repack_cache_writes", "Experts written to the repack cache")] = 0
    repack_cache_skipped: Annotated[
        int, counter("repack_cache_skipped", "Experts not written to the repack cache (budget, or writer busy)")
    ] = 0
    repack_cache_dropped: Annotated[
        int, counter("repack_cache_dropped", "Repack caches deleted (their file changed, or for room)")
    ] = 0
    repack_cache_bytes: Annotated[int, gauge("repack_cache_bytes", "Disk the repack cache takes")] = 0
    repack_cache_dir: str = ""  # where it lives ("" : off)
    # Prefault (moed.daemon.prefault): RAM-tier pages made ahead of their first fill
    prefaulted_bytes: Annotated[
        int, gauge("prefaulted_bytes", "RAM-tier bytes made ahead of their first fill (given back first)")
    ] = 0
    prefault_error: str = ""  # why prefaulting stopped, if it did
    # Compute turns (moed.daemon.turns): the cores shared by the engines; per engine in `engines`
    turns: Annotated[int, counter("turns", "Compute turns granted to engines")] = 0
    turn_waits: Annotated[int, counter("turn_waits", "Compute turns an engine waited for")] = 0
    turn_wait_s: Annotated[float, counter("turn_wait_seconds", "Time engines waited for compute turns")] = 0.0
    turns_overdue: Annotated[int, counter("turns_overdue", "Compute turns held past turn_max_s")] = 0
    engines_active: Annotated[int, gauge("engines_active", "Engines sharing the cores now")] = 0
    engines: list[TurnRow] = []  # per connection that took a turn: its threads and its waits
    # Engines' device slots (DeviceReport), summed over every engine that reported, closed ones included
    device_hits: Annotated[int, counter("device_hits", "Experts engines' device slots already held")] = 0
    device_uploads: Annotated[int, counter("device_uploads", "Experts engines copied into device slots")] = 0
    device_upload_bytes: Annotated[int, counter("device_upload_bytes", "Bytes engines copied into device slots")] = 0
    device_evictions: Annotated[int, counter("device_evictions", "Device slots engines gave to another expert")] = 0
