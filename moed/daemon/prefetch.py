"""Read-ahead: prefetches queued for a source, and when they are dropped.

A prefetch only reserves a slot the store can make room for without touching
a held one, and its read queues behind every demand read (the reader's order).
A demand acquire of a key being prefetched joins that read and promotes it.

This room owns which source (a session) queued which prefetch, per (model,
layer), held weakly so a session that goes leaves nothing behind here. A
queued prefetch whose read has not started is dropped (its slot goes back,
counted as wasted) when it is no longer wanted:
- the same source prefetches the same (model, layer) again without it;
- the source's connection closes (`forget`);
- a demand acquire finds no room while unreferenced prefetches hold the
  budget (`cancel_newest`, newest first: demand goes before read-ahead);
- the drive is behind (`drop_queued`; then no new prefetch is issued either,
  moed.daemon.faults).
A prefetch whose read started, or that an acquire references, is never dropped.
"""

from __future__ import annotations

import weakref
from typing import cast

from moed.cache.store import Slot, SlotState, Want

from .counters import Tenant
from .models import Model
from .slots import Slots


class Prefetches:
    def __init__(self, slots: Slots):
        self.slots, self.store, self.faults = slots, slots.store, slots.faults
        # source (a session) -> (model_id, layer) -> [(slot, generation)] of its prefetches
        self._by_source: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def queue(self, model: Model, layer: int, wants: list[Want], tenant: Tenant, source: object = None) -> int:
        """Queue reads of the wanted experts not resident; returns how many were queued.

        `source` (the session) supersedes its own earlier prefetches of this layer.
        """
        mine = self._supersede(source, (model.model_id, layer), {w.key for w in wants})
        if self.faults.behind():  # read-ahead would only deepen the drive's queue
            self.faults.prefetch_dropped += sum(1 for w in wants if w.key not in self.store.table)
            self.drop_queued()
            return 0
        queued = 0
        for want in wants:
            slot = self.store.prefetch(want, owner=tenant)
            if slot is not None:
                self.slots.settle()
                self.slots.start_read(model, slot, demand=False)
                mine.append((slot, slot.generation))
                queued += 1
        return queued

    def _supersede(self, source, where: tuple, keep: set) -> list:
        """Cancel `source`'s queued prefetches at `where` not in `keep`; returns the list to extend."""
        if source is None:
            return []
        by_layer = self._by_source.setdefault(source, {})
        alive = []
        for slot, gen in by_layer.get(where, ()):
            if slot.generation != gen or slot.state != SlotState.LOADING:
                continue  # its read finished or failed: nothing to drop
            if slot.key in keep or not self.slots.cancel_prefetch(slot):
                alive.append((slot, gen))
        by_layer[where] = alive
        return alive

    def forget(self, source) -> None:
        """The source went away: its prefetches whose reads have not started are dropped."""
        for entries in self._by_source.pop(source, {}).values():
            for slot, gen in entries:
                if slot.generation == gen and slot.state == SlotState.LOADING:
                    self.slots.cancel_prefetch(slot)

    def drop_queued(self) -> None:
        """The drive is behind: drop every prefetch whose read has not started (counted)."""
        for job in self.slots.reader.queued_prefetches():
            slot = cast(Slot, job.tag)
            if not slot.pinned and self.slots.cancel_prefetch(slot):
                self.faults.prefetch_dropped += 1

    def cancel_newest(self) -> bool:
        """Drop the newest queued, unreferenced prefetch; False if there is none."""
        for slot in reversed(self.slots.reading()):
            if slot.prefetched and not slot.refs and self.slots.cancel_prefetch(slot):
                return True
        return False


__all__ = ["Prefetches"]
