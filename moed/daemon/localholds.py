"""Local holds: what engines hit without a round trip, brought back into the daemon's books.

An engine with a hold region (moed.protocol.residency_words) takes hits on resident
experts by itself; the residency tables (moed.daemon.residency) are the shared
words, and this room is the daemon's side of them, run every maintenance period
and whenever a connection with a region closes:
- fold: the touches engines recorded go into the eviction order (so the shared
  LRU sees local hits) and, with `counters`, their hit counts into the stats;
- sweep: slots the store adopted because a local hold refused their eviction
  give their reference back once nobody holds them; revoked regions stop
  counting once their holds clear or their grace ends;
- bound: no tenant keeps another from room by holding more than
  LOCAL_HOLD_SHARE of the budget locally;
- pins: each model's pin word says whether every expert is pinned (so engines
  may take whole steps), and unpins a whole step held off go ahead once it ends.

It owns no state of its own: the holds are the residency tables', the adopted
slots the store's. What it keeps is the order: a region's counts are folded
before its region ends, so no recorded hit is lost.
"""

from __future__ import annotations

import logging
import time

from moed.cache.records import ExpertKey
from moed.cache.store import Slot, SlotState
from moed.protocol.sizes import format_size

from .bounds import LOCAL_HOLD_SHARE, REVOKE_GRACE_S
from .config import Config
from .counters import Counters, Tenant
from .registry import Registry
from .slots import Slots

log = logging.getLogger("moed")


class LocalHolds:
    def __init__(self, config: Config, slots: Slots, registry: Registry, counters: Counters):
        self.config, self.slots, self.registry, self.counters = config, slots, registry, counters
        self.store, self.residency = slots.store, slots.residency

    def close_region(self, session, revoke: bool = False) -> None:
        """A connection with a hold region closed: count what it recorded, then its holds
        end: at once if its peer left, once released (or the grace ends) if we closed it."""
        self.fold(counters=True, only=session)
        if revoke:
            cap = self.config.max_clients_per_tenant
            ended = self.residency.revoke(session, time.monotonic(), session.tenant, cap, self._fold_ending)
            self._warn_ended(ended)
        else:
            self.residency.close_region(session)
        self.sweep_adopted()
        self.refresh_pins()  # a whole step the region held is over

    def sweep_revoked(self) -> None:
        """Revoked regions that hold nothing live (or outlived the grace) stop counting;
        what their engines recorded is counted first."""
        self._warn_ended(self.residency.sweep_revoked(time.monotonic(), self._fold_ending))

    def _fold_ending(self, session) -> None:
        self.fold(counters=True, only=session)

    @staticmethod
    def _warn_ended(ended: list) -> None:
        for session, holds in ended:
            log.warning(
                "pid %d (uid %d) kept %d local holds after the daemon closed its connection "
                "(past the %.0fs grace, or past its tenant's revoked regions); "
                "they no longer keep slots from eviction",
                session.pid,
                session.uid,
                holds,
                REVOKE_GRACE_S,
            )

    def fold(self, counters: bool = False, only=None) -> None:
        """Fold what engines recorded in their regions: recency (touches) into the
        eviction order, so the shared LRU sees local hits; with `counters`, local hit
        counts into the stats."""
        res, store = self.residency, self.store
        for session in [only] if only is not None else [*res.regions, *res.revoked]:
            for class_id, index in res.touches(session):
                cls = store.classes.get(class_id)
                slot = cls.slots.get(index) if cls is not None else None
                if slot is not None and slot.state is SlotState.READY and slot.key is not None:
                    self._count_local(slot, session.tenant)
            if counters:
                self._count_hits(session)

    def _count_hits(self, session) -> None:
        models = self.registry.models
        for model_id, hits in self.residency.local_hits(session).items():
            if model_id in models:
                self.counters.local_hits += hits
                self.counters.hits += hits
                session.tenant.hits += hits
                session.tenant.use(model_id).hits += hits

    def _count_local(self, slot: Slot, tenant: Tenant) -> None:
        """One local hit on `slot`: recency and the per-slot counts a daemon hit keeps
        (hit totals come from the regions' counters, which cannot overflow)."""
        self.store.touch_local(slot)
        self.slots.count_access([slot], tenant, any_ready=True)

    def sweep_adopted(self) -> None:
        """Give back the references the store took for local holds that are gone."""
        released = False
        for slot in list(self.store.adopted):
            if not self.residency.held(slot.class_id, slot.index, slot.generation):
                key = slot.key
                self.store.release_adopted(slot)
                released = True
                model = self.registry.models.get(key.model_id) if key is not None else None
                if model is not None and model.stale:
                    self.registry.drop_if_drained(model)
        if released:
            self.slots.settle()
            self.slots.room_changed()
        if self.store.adopted:
            self._bound()

    def refresh_pins(self) -> None:
        """Unpins that waited on whole steps go ahead where none reads the model now (a stale
        model may then go); every model whose pins changed gets its pin word recomputed."""
        for slot in self.store.retry_unpins():
            model = self.registry.models.get(slot.key.model_id) if slot.key is not None else None
            if model is not None and model.stale:
                self.registry.drop_if_drained(model)
        res = self.residency
        dirty, res.pins_dirty = res.pins_dirty, set()
        for model_id in dirty:
            model = self.registry.models.get(model_id)
            res.set_whole(model_id, model is not None and not model.stale and self._all_pinned(model))

    def _all_pinned(self, model) -> bool:
        """Every expert of `model` pinned, READY and staying (no unpin waiting)."""
        table, mid = self.store.table, model.model_id
        for layer in model.layers:
            for e in range(model.catalog.n_experts):
                slot = table.get(ExpertKey(mid, layer, e))
                if slot is None or not slot.pinned or slot.unpin_pending or slot.state is not SlotState.READY:
                    return False
        return True

    def _bound(self) -> None:
        """No tenant keeps another from room by holding more than LOCAL_HOLD_SHARE of the
        budget locally: while another tenant's acquire waits for room, the connections
        of one that does are closed and their regions revoked (their holds count until
        released, at most REVOKE_GRACE_S). A tenant starving only itself is left alone,
        as with socket leases."""
        waiting = self.slots.waiting
        if not waiting:
            return
        cap = int(self.store.budget_bytes * LOCAL_HOLD_SHARE)
        by_tenant: dict[Tenant, int] = {}
        holders: dict[Tenant, set] = {}
        for slot in self.store.adopted:
            for session in self.residency.holders(slot.class_id, slot.index, slot.generation):
                by_tenant[session.tenant] = by_tenant.get(session.tenant, 0) + slot.slot_bytes
                holders.setdefault(session.tenant, set()).add(session)
            # A cut-off tenant's revoked holds still count against it: a new connection
            # holding the same slots again is over the share too.
            for tenant in self.residency.revoked_owners(slot.class_id, slot.index, slot.generation):
                by_tenant[tenant] = by_tenant.get(tenant, 0) + slot.slot_bytes
        for tenant, held in by_tenant.items():
            if held > cap and holders.get(tenant) and any(t is not tenant for t in waiting):
                log.warning(
                    "uid %d holds %s locally, over its share %s of the budget: closing %d connection(s)",
                    tenant.uid,
                    format_size(held),
                    format_size(cap),
                    len(holders[tenant]),
                )
                for session in holders[tenant]:  # only open ones: revoked ones run out their grace
                    session.abort()


__all__ = ["LocalHolds"]
