"""The stats contract as code: what `moectl stats --json` and `Client.stats()` carry.

`Stats` is the GetStats reply's payload and `ModelRow` the ListModels reply's
rows. The contract keys (`CONTRACT_KEYS`: budget_bytes, used_bytes, pinned_bytes,
hits, misses, prefetch_hits, bytes_read, direct_io, mem_available_bytes,
mem_floor_bytes, models, tenants: what tools reading `moectl stats --json` may
rely on) are fields here; fields are only appended,
with defaults, like every message. The daemon builds a snapshot and converts
it through these types, so a key it forgets or mistypes fails loudly in the
tests, and a key it adds without declaring it here is refused
(`forbid_unknown_fields`).
"""

from __future__ import annotations

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


class _Row(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=False):
    pass


class ModelRow(_Row):
    model_id: int
    path: str
    files: list[str]
    moe_layers: int
    n_experts: int
    n_expert_used: int
    resident_experts: int
    resident_bytes: int
    pinned_experts: int
    pinned_bytes: int
    pinned: list[tuple[int, int]]  # (layer, expert) of every pinned expert
    hits: int
    misses: int
    bytes_read: int
    leases: int
    direct_io: bool
    stale: bool
    users: list[int]  # uids with the model open
    read_errors: int = 0  # reads of its experts that failed (after their retries)
    quarantined: list[tuple[int, int]] = []  # (layer, expert) whose acquires fail at once for now
    expert_layout: str = "plain"  # the file's expert layout: plain or repacked (moed.gguf.layouts)


class TenantModelRow(_Row):
    hits: int
    misses: int
    bytes_read: int
    resident_bytes: int
    leases: int


class TenantRow(_Row):
    uid: int
    names: list[str]
    pids: list[int]
    connections: int
    hits: int
    shared_hits: int
    misses: int
    bytes_read: int
    resident_bytes: int
    leases: int
    floor_bytes: int
    ceiling_bytes: int
    models: dict[str, TenantModelRow]


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
    uptime_s: float
    budget_bytes: int
    used_bytes: int
    pinned_bytes: int
    pin_budget_bytes: int
    evictable_bytes: int
    locked: bool
    lock_error: str
    locked_bytes: int
    resident_experts: int
    evictions: int
    hits: int
    shared_hits: int
    misses: int
    pinned_hits: int
    pinned_hit_share: float
    pinned_experts: int
    hit_rate: float
    joined_reads: int
    prefetches: int
    prefetch_hits: int
    wasted_prefetches: int
    bytes_read: int
    read_errors: int
    reads_in_flight: int
    direct_io: bool
    policy: str
    mem_available_bytes: int
    mem_floor_bytes: int
    mem_guard_active: bool
    effective_budget_bytes: int
    given_back_bytes: int
    mem_guard_actions: int
    mem_hysteresis_bytes: int
    mem_cgroup_limited: bool
    verify: bool
    connections: int
    bad_frames: int
    timed_out_connections: int
    stale_detected: int
    limits: Limits
    clients: list[ClientRow]
    models: list[ModelRow]
    tenants: list[TenantRow]
    local_hits: int = 0  # hits served in engines with no round trip (folded from regions)
    local_claims_refused: int = 0  # evictions put off because an engine held the slot locally
    adopted_slots: int = 0  # slots the store holds for engines' local holds now
    revoked_regions: int = 0  # hold regions of connections the daemon closed, still counting
    verified_reads: int = 0  # verify mode only
    verify_mismatches: int = 0
    verify_hashed_experts: int = 0
    acquire_latency_s: HistogramRow = msgspec.field(default_factory=HistogramRow)  # request to grant
    read_latency_s: HistogramRow = msgspec.field(default_factory=HistogramRow)  # submit to done
    # When the drive misbehaves (docs/design.md):
    read_retries: int = 0  # chunk reads that failed and were tried again
    quarantined_experts: int = 0  # experts whose acquires fail at once for now (read failed)
    quarantine_refusals: int = 0  # acquires refused at once by a quarantine
    prefetch_dropped: int = 0  # prefetched experts not read because the drive was behind
    prefetch_backoff: bool = True  # whether read-ahead holds back while the drive is behind
    stalled_reads: int = 0  # reads that ran past read_stall_warn_s (each once)
    stuck_reads: int = 0  # reads running past read_stall_warn_s now
    drive_behind: bool = False  # read-ahead held back now
    drive_latency_ratio: float = 0.0  # recent read latency over the drive's own baseline
    drive_behind_episodes: int = 0  # times the drive went behind
