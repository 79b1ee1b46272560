"""Counters, per-tenant accounting and the stats snapshot `moectl stats` prints.

What this module owns: the daemon's mutable counts (`Counters`, `Tenant`,
`ModelUse`, kept by core.py and sessions.py on the event loop) and `snapshot()`,
which turns them and the daemon's state into the dict the wire's `Stats`
(moed/protocol/stats.py, the one schema: field names, types, metrics) converts.

Invariants: a count goes on the wire under the schema field of its own name:
`Counters.row()` copies every counter by name (`WIRE` renames `timed_out` and
keeps `connections` and `errors_sent` off the wire), and the rows copy a schema
field from the tenant or model attribute of the same name unless the row computes
it. So a new counter is its field here plus its declaration in the schema, and
snapshot() needs no edit; a name the schema lacks fails the conversion
(`forbid_unknown_fields`). The contract keys (`CONTRACT_KEYS`) are only added.
"""

from __future__ import annotations

import bisect
import os
import time
from dataclasses import dataclass, field, fields

import msgspec

from moed.protocol.stats import ModelRow, TenantModelRow, TenantRow

from . import repackcache
from .bounds import limits

# Upper bounds of the latency histograms' buckets, in seconds (a hit is tens of µs,
# a miss one NVMe read of an expert or a few, a wait for room up to the timeout).
LATENCY_BOUNDS_S = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


@dataclass
class LatencyHistogram:
    """Counts of durations per bucket (`counts[i]`: at most `LATENCY_BOUNDS_S[i]` and more
    than the bound before it; the last counts everything above the last bound)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BOUNDS_S) + 1))
    sum_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BOUNDS_S, seconds)] += 1
        self.sum_s += seconds

    def row(self) -> dict:
        return {
            "bounds_s": list(LATENCY_BOUNDS_S),
            "counts": list(self.counts),
            "sum_s": self.sum_s,
            "count": sum(self.counts),
        }


@dataclass
class Counters:
    """The daemon's own counts since start (tenant and model ones: `Tenant`, `ModelUse`)."""

    hits: int = 0
    shared_hits: int = 0  # hits on experts another tenant's acquire read in
    misses: int = 0
    joined_reads: int = 0
    prefetches: int = 0
    prefetch_hits: int = 0
    bytes_read: int = 0
    read_errors: int = 0
    bad_frames: int = 0
    errors_sent: int = 0
    connections: int = 0  # accepted since start (off the wire: its `connections` is those open now)
    pinned_hits: int = 0
    local_hits: int = 0  # hits engines served themselves (folded from hold regions)
    timed_out: int = 0  # connections closed for sending no Hello, or nothing, in time
    stale_detected: int = 0  # models found changed on disk (fstat) while open
    repacked_bytes: int = 0  # expert bytes transformed on read (moed.daemon.onread)
    repack_cpu_s: float = 0.0  # the reader threads' CPU time spent on it
    repack_wait_cpu_s: float = 0.0  # of it, on reads an engine waited on (demand, or promoted)
    # Engines' device slots (DeviceReport): each report's increase over that engine's last,
    # so the sums only grow, and an engine that closes keeps what it counted.
    device_hits: int = 0
    device_uploads: int = 0
    device_upload_bytes: int = 0
    device_evictions: int = 0
    # Daemon acquires, from the request on the loop to its grant (hits granted at
    # once included; failed and local acquires not); reads, from submission to
    # completion on the loop (queueing behind other reads included).
    acquire_latency_s: LatencyHistogram = field(default_factory=LatencyHistogram)
    read_latency_s: LatencyHistogram = field(default_factory=LatencyHistogram)

    def row(self) -> dict:
        """Every counter under its wire name (histograms as their rows)."""
        out: dict = {}
        for f in fields(self):
            name, value = WIRE.get(f.name, f.name), getattr(self, f.name)
            if name is not None:
                out[name] = value.row() if isinstance(value, LatencyHistogram) else value
        return out


# Counters whose wire name is not their own (None: not on the wire).
WIRE: dict[str, str | None] = {"timed_out": "timed_out_connections", "connections": None, "errors_sent": None}


def _row(schema: type[msgspec.Struct], source: object, **computed) -> dict:
    """The `schema` row of `source`: each field computed here, or else `source`'s
    attribute of the same name (a field with neither fails here, loudly)."""
    return {k: computed[k] if k in computed else getattr(source, k) for k in schema.__struct_fields__}


@dataclass
class ModelUse:
    """One tenant's use of one model."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    leases: int = 0  # held now (kept by core at grant and release)


@dataclass(eq=False)
class Tenant:
    """A peer uid; `names` are what its clients called themselves in Hello."""

    uid: int
    names: set = field(default_factory=set)
    pids: set = field(default_factory=set)
    connections: int = 0  # open connections of this uid (max_clients_per_tenant)
    opens_in_flight: int = 0  # model opens running for this uid (max_opens_per_tenant)
    hits: int = 0
    shared_hits: int = 0  # hits on experts another tenant's acquire read in
    misses: int = 0
    bytes_read: int = 0
    floor_bytes: int = 0
    ceiling_bytes: int = 0
    per_model: dict[int, ModelUse] = field(default_factory=dict)

    def use(self, model_id: int) -> ModelUse:
        u = self.per_model.get(model_id)
        if u is None:
            u = self.per_model[model_id] = ModelUse()
        return u

    @property
    def leases(self) -> int:
        return sum(u.leases for u in self.per_model.values())


def _model_row(daemon, model) -> dict:
    mid = model.model_id
    slots = [s for k, s in daemon.store.table.items() if k.model_id == mid]
    pinned = [s for s in slots if s.pinned]
    users = sorted({s.tenant.uid for s in daemon.sessions if mid in s.models})
    uses = [t.per_model[mid] for t in daemon.tenants.values() if mid in t.per_model]
    # model_id, path, leases, direct_io, stale, read_errors: the model's own attributes
    return _row(
        ModelRow,
        model,
        files=[f.path for f in model.files],
        moe_layers=len(model.layers),
        n_experts=model.catalog.n_experts,
        n_expert_used=model.catalog.n_expert_used,
        resident_experts=len(slots),
        resident_bytes=sum(s.slot_bytes for s in slots),
        pinned_experts=len(pinned),
        pinned_bytes=sum(s.slot_bytes for s in pinned),
        pinned=sorted([s.key.layer, s.key.expert] for s in pinned),
        hits=sum(u.hits for u in uses),
        misses=sum(u.misses for u in uses),
        bytes_read=sum(u.bytes_read for u in uses),
        expert_layout=model.expert_layout,
        repack_on_read=bool(model.layouts),
        users=users,
        quarantined=sorted([k.layer, k.expert] for k in daemon.faults.quarantine.entries(mid)),
        all_pinned=daemon.residency.whole(mid),
    )


def _tenant_row(daemon, tenant: Tenant) -> dict:
    per_model = {mid: _row(TenantModelRow, u, resident_bytes=0) for mid, u in tenant.per_model.items()}
    for key, slot in daemon.store.table.items():
        if slot.owner is tenant and key.model_id in per_model:
            per_model[key.model_id]["resident_bytes"] += slot.slot_bytes
    # uid, connections, hits, shared_hits, misses, bytes_read, leases, floor and ceiling: the tenant's own
    return _row(
        TenantRow,
        tenant,
        names=sorted(tenant.names),
        pids=sorted(tenant.pids),
        resident_bytes=daemon.store.owned_bytes.get(tenant, 0),
        models={str(mid): row for mid, row in sorted(per_model.items())},
    )


def _cpu() -> dict:
    t = os.times()
    return {"cpu_user_s": round(t.user, 3), "cpu_system_s": round(t.system, 3)}


def snapshot(daemon) -> dict:
    store, c = daemon.store, daemon.counters
    models = list(daemon.models.values())
    return {
        "version": daemon.version,
        "pid": daemon.pid,
        "uptime_s": round(time.time() - daemon.started_at, 3),
        **_cpu(),
        "budget_bytes": store.budget_bytes,
        "used_bytes": store.used_bytes,
        "pinned_bytes": store.pinned_bytes,
        "pin_budget_bytes": store.pin_budget_bytes,
        "evictable_bytes": store.evictable_bytes,
        "locked": daemon.ramtier.locked,
        "lock_error": daemon.ramtier.lock_error,
        "locked_bytes": daemon.ramtier.locked_bytes,
        "resident_experts": len(store.table),
        "evictions": store.evictions,
        **c.row(),  # hits, misses, prefetches, bytes_read, ...: the daemon's counters, by wire name
        "pinned_hit_share": c.pinned_hits / c.hits if c.hits else 0.0,
        "pinned_experts": sum(1 for s in store.table.values() if s.pinned),
        "hit_rate": c.hits / (c.hits + c.misses) if c.hits + c.misses else 0.0,
        "wasted_prefetches": store.wasted_prefetches,
        **daemon.faults.stats(),
        "reads_in_flight": daemon.reads_in_flight,
        "direct_io": all(m.direct_io for m in models) if models else True,
        "policy": daemon.config.policy,
        "mem_available_bytes": daemon.mem_available_bytes(),
        "mem_floor_bytes": daemon.memguard.floor_bytes,
        **daemon.memguard.stats(),
        **(daemon.verifier.stats() if daemon.verifier is not None else {"verify": False}),
        "connections": len(daemon.sessions),
        "local_claims_refused": daemon.residency.claims_refused,
        "adopted_slots": len(daemon.store.adopted),
        "unpins_held": len(daemon.store.unpin_waiting),
        "revoked_regions": len(daemon.residency.revoked),
        **daemon.prefault.stats(),
        **repackcache.stats_row(daemon.repack_caches),
        **daemon.turns.stats(),  # turns, turn_waits, turn_wait_s, turns_overdue, engines_active
        "engines": daemon.turns.rows(),
        "limits": limits(daemon.config),
        "clients": [s.buffers() for s in daemon.sessions],
        "models": [_model_row(daemon, m) for m in models],
        "tenants": [_tenant_row(daemon, t) for t in daemon.tenants.values()],
    }
