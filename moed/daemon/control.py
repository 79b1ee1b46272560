"""Operator requests: change the memory floor, pin and unpin experts, clear read errors, live.

They change what every tenant gets, so only an operator may send them: a peer
whose uid is root or the daemon's own uid (SO_PEERCRED, not anything the
client says). Everyone else gets PermissionDenied.
"""

from __future__ import annotations

import os

from moed.protocol import errors
from moed.protocol import messages as m


def is_operator(session) -> bool:
    return session.uid in (0, os.getuid())


def require_operator(session) -> None:
    if not is_operator(session):
        raise errors.PermissionDenied(
            f"uid {session.uid} may not change the daemon's settings (only root or uid {os.getuid()})"
        )


def on_set_mem_floor(session, msg: m.SetMemFloor):
    require_operator(session)
    if msg.floor_bytes < 0:
        raise errors.BadRequest(f"floor_bytes must not be negative, got {msg.floor_bytes}")
    guard = session.daemon.memguard
    guard.set_floor(msg.floor_bytes)
    return m.MemFloorSet(
        guard.floor_bytes, session.daemon.store.effective_budget_bytes, guard.available_bytes(), guard.given_back_bytes
    )


async def on_pin(session, msg: m.Pin):
    require_operator(session)
    model = session.model(msg.model_id)
    pinned, skipped = await session.daemon.pin(model, msg.experts, all_experts=msg.all, from_stats=msg.from_stats)
    return m.Pinned(pinned, skipped, session.daemon.store.pinned_bytes)


def on_unpin(session, msg: m.Unpin):
    require_operator(session)
    model = session.model(msg.model_id)
    n = session.daemon.unpin(model, msg.experts, all_experts=msg.all)
    return m.Unpinned(n, session.daemon.store.pinned_bytes)


def on_clear_read_errors(session, msg: m.ClearReadErrors):
    require_operator(session)
    model = session.model(msg.model_id) if msg.model_id else None
    return m.ReadErrorsCleared(session.daemon.clear_read_errors(model))


def handlers(session) -> dict:
    """The control handlers bound to one session, keyed by request type."""
    return {
        m.SetMemFloor: lambda msg: on_set_mem_floor(session, msg),
        m.Pin: lambda msg: on_pin(session, msg),
        m.Unpin: lambda msg: on_unpin(session, msg),
        m.ClearReadErrors: lambda msg: on_clear_read_errors(session, msg),
    }


def visible_stats(session, stats: dict) -> dict:
    """What one peer may see: operators everything; others their own tenant row, their
    own connections, and only the models they could open themselves (no other
    tenant's pids, names or leases)."""
    if is_operator(session):
        return stats
    from .access import check_readable, peer_identity

    peer = peer_identity(session.pid, session.uid, session.gid)

    def readable(row) -> bool:
        try:
            for path in row["files"]:
                check_readable(peer, path, path)
            return True
        except errors.MoedError:
            return False

    return {
        **stats,
        "tenants": [t for t in stats["tenants"] if t["uid"] == session.uid],
        "clients": [c for c in stats["clients"] if c["uid"] == session.uid],
        "engines": [e for e in stats.get("engines", []) if e["uid"] == session.uid],
        "models": [r for r in stats["models"] if readable(r)],
    }
