"""Counters, per-tenant accounting and the stats snapshot `moectl stats` prints.

The snapshot's top-level keys are a contract (DESIGN.md): budget_bytes,
used_bytes, pinned_bytes, hits, misses, prefetch_hits, bytes_read, direct_io,
mem_available_bytes, mem_floor_bytes, models, tenants. Keys are only added.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Counters:
    hits: int = 0
    misses: int = 0
    joined_reads: int = 0
    prefetches: int = 0
    prefetch_hits: int = 0
    bytes_read: int = 0
    read_errors: int = 0
    bad_frames: int = 0
    errors_sent: int = 0
    connections: int = 0


@dataclass(eq=False)
class Tenant:
    """A peer uid; `names` are what its clients called themselves in Hello."""

    uid: int
    names: set = field(default_factory=set)
    pids: set = field(default_factory=set)
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0

    def key(self) -> str:
        return str(self.uid)


def _model_row(daemon, model) -> dict:
    resident = sum(1 for k in daemon.store.table if k.model_id == model.model_id)
    users = sorted({s.tenant.uid for s in daemon.sessions if model.model_id in s.models})
    return {
        "model_id": model.model_id,
        "path": model.path,
        "files": [f.path for f in model.files],
        "moe_layers": len(model.layers),
        "n_experts": model.catalog.n_experts,
        "n_expert_used": model.catalog.n_expert_used,
        "resident_experts": resident,
        "direct_io": model.direct_io,
        "stale": model.stale,
        "users": users,
    }


def _tenant_row(daemon, tenant: Tenant) -> dict:
    leases = sum(len(s.leases) for s in daemon.sessions if s.tenant is tenant)
    resident = sum(s.slot_bytes for s in daemon.store.table.values() if s.owner is tenant)
    return {
        "uid": tenant.uid,
        "names": sorted(tenant.names),
        "pids": sorted(tenant.pids),
        "hits": tenant.hits,
        "misses": tenant.misses,
        "bytes_read": tenant.bytes_read,
        "resident_bytes": resident,
        "leases": leases,
    }


def snapshot(daemon) -> dict:
    store, c = daemon.store, daemon.counters
    models = list(daemon.models.values())
    return {
        "version": daemon.version,
        "pid": daemon.pid,
        "uptime_s": round(time.time() - daemon.started_at, 3),
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
        "hits": c.hits,
        "misses": c.misses,
        "hit_rate": c.hits / (c.hits + c.misses) if c.hits + c.misses else 0.0,
        "joined_reads": c.joined_reads,
        "prefetches": c.prefetches,
        "prefetch_hits": c.prefetch_hits,
        "wasted_prefetches": store.wasted_prefetches,
        "bytes_read": c.bytes_read,
        "read_errors": c.read_errors,
        "reads_in_flight": len(daemon._loading),
        "direct_io": all(m.direct_io for m in models) if models else True,
        "policy": daemon.config.policy,
        "mem_available_bytes": daemon.mem_available_bytes(),
        "mem_floor_bytes": daemon.memguard.floor_bytes,
        **daemon.memguard.stats(),
        "connections": len(daemon.sessions),
        "bad_frames": c.bad_frames,
        "models": [_model_row(daemon, m) for m in models],
        "tenants": [_tenant_row(daemon, t) for t in daemon.tenants.values()],
    }
