"""The pinned partition (host mirror): which experts an operator keeps resident for good.

A pinned slot lives in the store's pin budget, apart from the shared budget:
it is never evicted, so a hit on it never waits for a read again. The pins
themselves are the store's state (`Slot.pinned`, `Store.pinned_bytes`); this
room decides which experts to pin, hottest first until the pin budget is full,
and starts the reads of those not resident. A model whose every expert fits in
what is left of the pin budget is mirrored whole when it is opened.

Invariants:
- nothing is pinned beyond the pin budget (the store refuses; refusals are
  counted as skipped);
- while the memory guard holds the budget back, no expert is read in to be
  pinned (that would be growth); resident ones may still be pinned;
- a stale model's pins go with it (moed.daemon.registry, through the store),
  never through `unpin`, so the registry does not depend on this room.
"""

from __future__ import annotations

import asyncio
import logging

from moed.cache.store import Slot
from moed.protocol import errors

from .memguard import MemGuard
from .models import Model
from .slots import Slots, wants

log = logging.getLogger("moed")


class Pins:
    def __init__(self, slots: Slots, memguard: MemGuard):
        self.slots, self.store, self.memguard = slots, slots.store, memguard

    async def pin(self, model: Model, experts, all_experts: bool = False, from_stats: bool = False) -> tuple[int, int]:
        """Pin experts hottest first until the pin budget is full; wait for their reads.

        Returns (newly pinned, skipped for want of pin budget).
        """
        if not self.store.pin_budget_bytes:
            raise errors.BadRequest("this daemon has no pin budget (start it with --pin-budget)")
        if all_experts or self._model_fits(model):
            order = _all_experts(model)
        elif from_stats:
            if self.slots.heat is None:
                raise errors.BadRequest("no access counts kept (no pin budget at start)")
            order = self.slots.heat.ranked(model.model_id)
        else:
            order = [tuple(p) for p in experts]
        pinned, skipped, slots = self._pin_keys(model, order)
        waits = self.slots.done(slots)
        if waits:
            results = await asyncio.gather(*waits, return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                raise errors.ReadError(f"{len(failed)} pinned experts could not be read: {failed[0]}")
        log.info(
            "pinned %d experts of model %d (%d skipped); pinned partition %d of %d bytes",
            pinned,
            model.model_id,
            skipped,
            self.store.pinned_bytes,
            self.store.pin_budget_bytes,
        )
        return pinned, skipped

    def mirror(self, model: Model) -> None:
        """A model just opened: pin it whole if it fits what is left of the pin budget."""
        if self.store.pin_budget_bytes and self._model_fits(model):
            self._pin_keys(model, _all_experts(model))

    def _pin_keys(self, model: Model, order) -> tuple[int, int, list[Slot]]:
        pinned, skipped, slots = 0, 0, []
        growing_refused = self.memguard.active  # reading new experts in is growth
        for layer, expert in order:
            (want,) = wants(model, layer, [expert])
            if growing_refused and want.key not in self.store.table:
                skipped += 1
                continue
            got = self.store.pin(want)
            if got is None:
                skipped += 1
                continue
            slot, new, must_read = got
            pinned += new
            slots.append(slot)
            if must_read:
                self.slots.start_read(model, slot, demand=False)
        self.slots.room_changed()  # pinning resident keys freed room in the shared budget
        self.slots.residency.pins_dirty.add(model.model_id)  # its pin word is recomputed next period
        return pinned, skipped, slots

    def unpin(self, model: Model, experts, all_experts: bool = False) -> int:
        if all_experts:
            keys = [k for k, s in self.store.table.items() if k.model_id == model.model_id and s.pinned]
        else:
            keys = [w.key for layer, e in experts for w in wants(model, layer, [e])]
        n = sum(1 for k in keys if self.store.unpin(k))
        self.slots.settle()
        return n

    def _model_fits(self, model: Model) -> bool:
        st = self.store
        mine = sum(s.slot_bytes for k, s in st.table.items() if k.model_id == model.model_id and s.pinned)
        whole = sum(st.classes[p.class_id].slot_bytes for p in model.layers.values()) * model.catalog.n_experts
        return whole <= st.pin_budget_bytes - st.pinned_bytes + mine


def _all_experts(model: Model) -> list[tuple[int, int]]:
    return [(layer, e) for layer in sorted(model.layers) for e in range(model.catalog.n_experts)]


__all__ = ["Pins"]
