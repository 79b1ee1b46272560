"""The daemon's side of hits without a round trip: residency tables, slot states, hold regions.

Owns, as memfds: one residency table per open model and one slot-state array
per size class (the daemon is their only writer; clients get read-only
descriptors with the model's segments), and one hold region per connection
that asked for one (only that client writes it). The words, their encodings and
the memory-ordering argument are in moed.protocol.residency_words.

Invariants, kept here:
- A residency is published (entry and READY state written) only once its slot
  is READY in the store (`publish`, called when a read completes), and taken
  back (`claim`) before the store lets the slot leave the table: the store asks
  `claim` first for every READY slot it evicts, drops or unpins, and a claim
  that finds a hold refuses, leaving the residency published.
- Every region's holds are scanned after the EVICTING store (moed._holds.find
  fences first), so a hold the client made before it checked the state is seen.
- A region stops counting the moment its peer closes the connection
  (`close_region`: the peer is gone or done). One the daemon closes itself is
  revoked instead (`revoke`): it keeps counting until a count after its closed
  store reads no hold of a published residency, or REVOKE_GRACE_S pass
  (`sweep_revoked`); an owner keeps at most `max_per_owner` revoked regions.
  Slots the store adopted for either are then released by the core's sweep.
- A model's pin word (the table's last) reads 1 only while every expert of the
  model is pinned, READY and published (`set_whole`, from the holds room's
  refresh), and is cleared before any pinned slot of it may leave the pinned
  partition (`pins_changing`, which the store asks first); a slot whose model a
  region's pin hold names then stays pinned until the hold is gone.
- Nothing a client writes in its region is trusted beyond "this word matches a
  live residency" (or, for the pin hold, "names this model"): touch and counter
  words are bounds-checked and clamped.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moed import _holds
from moed.daemon.bounds import REVOKE_GRACE_S
from moed.protocol import errors
from moed.protocol import residency_words as rz

log = logging.getLogger("moed.residency")

MAX_COUNTER_STEP = 1 << 32  # a local-hit counter cannot claim more than this per fold


class Words:
    """A memfd of uint64 words, mapped read-write in the daemon."""

    def __init__(self, name: str, n_words: int):
        self.n_words = max(1, n_words)
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.n_words * 8)
        self.map = mmap.mmap(self.fd, self.n_words * 8)
        os.fchmod(self.fd, 0o400)  # clients reopen it read-only, and cannot reopen it writable

    def readonly_fd(self) -> int:
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        _unmap(self.map, self.fd)


@dataclass(eq=False)
class Region:
    """One connection's hold region (the client maps it read-write; we read it)."""

    fd: int
    map: mmap.mmap
    ring_seen: int = 0
    counters_seen: dict = field(default_factory=dict)  # model_id -> local hits already folded
    revoked_at: float | None = None  # monotonic time of the daemon's closed store
    owner: Any = None  # whose (a tenant), for the bound on revoked regions

    def close(self) -> None:
        _unmap(self.map, self.fd)


def _unmap(mapping: mmap.mmap, fd: int) -> None:
    """Unmap and close (fd -1: none); a view still exported keeps its pages, and they go with it."""
    try:
        mapping.close()
    except BufferError:
        pass
    if fd >= 0:
        os.close(fd)


def _nothing(session) -> None:
    pass


class Residency:
    def __init__(self):
        self.states: dict[int, Words] = {}  # class id -> slot states
        self.tables: dict[int, Words] = {}  # model id -> residency table
        self.layer_index: dict[int, dict[int, int]] = {}  # model id -> layer -> row
        self.n_experts: dict[int, int] = {}
        self.regions: dict[Any, Region] = {}  # session -> its region
        self.revoked: dict[Any, Region] = {}  # sessions the daemon closed whose holds still count
        self._published: dict = {}  # slot -> (model id, table word, generation)
        self._retired: set[int] = set()  # models that take no new local hits (stale or closed)
        self.pin_words: dict[int, int] = {}  # model id -> its table's pin word
        self.pins_dirty: set[int] = set()  # models whose pin word the next refresh recomputes
        self.claims_refused = 0

    # ---- tables ----------------------------------------------------------

    def add_class(self, class_id: int, capacity: int) -> None:
        self.states[class_id] = Words(f"moed-states-{class_id}", capacity)

    def remove_class(self, class_id: int) -> None:
        words = self.states.pop(class_id, None)
        if words is not None:
            words.close()

    def add_model(self, model_id: int, layers: list[int], n_experts: int) -> None:
        n_entries = len(layers) * n_experts
        self.tables[model_id] = Words(f"moed-table-{model_id}", n_entries + 1)
        self.pin_words[model_id] = rz.pin_word(n_entries)
        self.layer_index[model_id] = {layer: i for i, layer in enumerate(sorted(layers))}
        self.n_experts[model_id] = n_experts

    def retire_model(self, model_id: int) -> None:
        """No new local hits on a stale or closed model: zero its table (holds still count)."""
        self._retired.add(model_id)
        table = self.tables.get(model_id)
        if table is not None:
            _holds.store(table.map, self.pin_words[model_id], 0)  # no new whole steps either
            for mid, word, _ in list(self._published.values()):
                if mid == model_id:
                    _holds.store(table.map, word, 0)

    def drop_model(self, model_id: int) -> None:
        self._retired.discard(model_id)  # its table is gone: nothing can be published in it
        table = self.tables.pop(model_id, None)
        if table is not None:
            table.close()
        self.layer_index.pop(model_id, None)
        self.n_experts.pop(model_id, None)
        self.pin_words.pop(model_id, None)
        self.pins_dirty.discard(model_id)

    def fds_for(self, model_id: int, class_ids: list[int]) -> list[int]:
        """Read-only descriptors: each class's states, in order, then the model's table."""
        return [self.states[c].readonly_fd() for c in class_ids] + [self.tables[model_id].readonly_fd()]

    # ---- publishing and claiming -------------------------------------------

    def publish(self, slot) -> None:
        """The slot is READY with its key: make it visible to local hits."""
        key = slot.key
        table = self.tables.get(key.model_id)
        if table is None or key.model_id in self._retired:
            return  # a read that finishes after its model was retired is not offered to local hits
        word = self.layer_index[key.model_id][key.layer] * self.n_experts[key.model_id] + key.expert
        g = slot.generation
        _holds.store(self.states[slot.class_id].map, slot.index, rz.state(g, rz.READY))
        _holds.store(table.map, word, rz.entry(g, slot.index))
        self._published[slot] = (key.model_id, word, g)
        if slot.pinned:
            self.pins_dirty.add(key.model_id)  # perhaps the last of the model to be pinned

    # ---- whole steps (the pin word and the regions' pin holds) ---------------

    def set_whole(self, model_id: int, on: bool) -> None:
        """Write the model's pin word: whether every expert is pinned, READY and published."""
        table = self.tables.get(model_id)
        if table is not None and (not on or model_id not in self._retired):
            _holds.store(table.map, self.pin_words[model_id], 1 if on else 0)

    def whole(self, model_id: int) -> bool:
        table = self.tables.get(model_id)
        return table is not None and _holds.load(table.map, self.pin_words[model_id]) == 1

    def pins_changing(self, model_id: int) -> bool:
        """A pinned slot of the model is about to leave the pinned partition: clear the pin
        word (seq_cst), then True if some region's pin hold names the model (it must wait).
        The store and the loads are the daemon's side of the whole-step protocol."""
        table = self.tables.get(model_id)
        if table is not None:
            _holds.store(table.map, self.pin_words[model_id], 0)
        self.pins_dirty.add(model_id)
        target = model_id + 1
        return any(
            _holds.load(r.map, rz.W_PIN_HOLD) == target for r in [*self.regions.values(), *self.revoked.values()]
        )

    def claim(self, slot) -> bool:
        """Take a published residency back unless some region holds it (then False)."""
        pub = self._published.get(slot)
        if pub is None or pub[2] != slot.generation:
            return True
        model_id, word, g = pub
        states = self.states[slot.class_id].map
        ready, evicting = rz.state(g, rz.READY), rz.state(g, rz.EVICTING)
        if not _holds.cas(states, slot.index, ready, evicting) and _holds.load(states, slot.index) != evicting:
            return True  # not READY(g): nothing a client could hold
        if self.held(slot.class_id, slot.index, g):
            _holds.store(states, slot.index, ready)
            self.claims_refused += 1
            return False
        del self._published[slot]
        table = self.tables.get(model_id)
        if table is not None:
            _holds.store(table.map, word, 0)
        return True

    def unclaim(self, slot) -> None:
        """A claimed slot the store kept after all: publish it again."""
        if slot.key is not None and slot not in self._published:
            self.publish(slot)

    def held(self, class_id: int, index: int, generation: int) -> bool:
        target = rz.hold(class_id, index, generation)
        regions = [*self.regions.values(), *self.revoked.values()]
        return any(_holds.find(r.map, rz.HOLD_BASE, rz.HOLD_WORDS, target) for r in regions)

    def revoked_owners(self, class_id: int, index: int, generation: int) -> list:
        """The owners of the revoked regions that hold this residency."""
        target = rz.hold(class_id, index, generation)
        return [r.owner for r in self.revoked.values() if _holds.find(r.map, rz.HOLD_BASE, rz.HOLD_WORDS, target)]

    def holders(self, class_id: int, index: int, generation: int) -> list:
        """The open sessions whose regions hold this residency (revoked ones are closed already)."""
        target = rz.hold(class_id, index, generation)
        return [s for s, r in self.regions.items() if _holds.find(r.map, rz.HOLD_BASE, rz.HOLD_WORDS, target)]

    # ---- regions -------------------------------------------------------------

    def open_region(self, session) -> int:
        """A new region for `session`; returns a read-write descriptor for its client."""
        if session in self.regions:
            raise errors.BadRequest("this connection has its hold region already (MapHolds is asked once)")
        fd = os.memfd_create("moed-holds", os.MFD_CLOEXEC)
        os.ftruncate(fd, rz.REGION_WORDS * 8)
        region = Region(-1, mmap.mmap(fd, rz.REGION_WORDS * 8))  # the map keeps its own descriptor
        _holds.store(region.map, rz.W_MAGIC, rz.MAGIC)
        self.regions[session] = region
        return fd  # the client's; the caller closes it once sent

    def close_region(self, session) -> None:
        """The peer closed the connection: its holds stop counting at once."""
        region = self.regions.pop(session, None)
        if region is not None:
            region.close()

    def revoke(
        self, session, now_s: float, owner: Any = None, max_per_owner: int = 64, before_end: Callable = _nothing
    ) -> list:
        """The daemon closed the connection: no new hits; its holds count until released.

        An owner keeps at most `max_per_owner` revoked regions: past that its oldest
        stops counting at once (only its own engines could notice). `before_end(session)`
        runs before any revoked region is closed (to fold what it recorded). Returns
        (session, live holds) for the regions that stopped counting while holding."""
        region = self.regions.pop(session, None)
        if region is None:
            return []
        _holds.store(region.map, rz.W_CLOSED, 1)  # seq_cst, then count's fence and loads
        region.revoked_at, region.owner = now_s, owner
        self.revoked[session] = region
        mine = [s for s, r in self.revoked.items() if r.owner is owner]  # oldest first (dict order)
        over = set(mine[: max(0, len(mine) - max_per_owner)])
        return self._sweep(lambda s, r: s in over, before_end) + self.sweep_revoked(now_s, before_end)

    def sweep_revoked(self, now_s: float, before_end: Callable = _nothing) -> list:
        """Stop counting the revoked regions that hold no live residency, or outlived the
        grace; returns (session, holds) for those that still held when the grace ended."""

        def expired(session, region: Region) -> bool:
            return region.revoked_at is not None and now_s - region.revoked_at >= REVOKE_GRACE_S

        return self._sweep(expired, before_end, idle_too=True)

    def _sweep(self, ends: Callable, before_end: Callable, idle_too: bool = False) -> list:
        """End the revoked regions `ends(session, region)` names (and, `idle_too`, those
        holding no live residency); (session, live holds) of those ended holding."""
        live = self._live_holds() if self.revoked else set()
        ended = []
        for session, region in list(self.revoked.items()):
            holds = self._holds_in(region, live)
            if ends(session, region) or (idle_too and holds == 0):
                before_end(session)
                del self.revoked[session]
                region.close()
                if holds:
                    ended.append((session, holds))
        return ended

    def _live_holds(self) -> set[int]:
        """The hold word of every published residency: only these can protect a read (a hit
        needs READY(g), and a claim of a held READY slot is refused, so it stays published)."""
        return {rz.hold(slot.class_id, slot.index, g) for slot, (_, _, g) in self._published.items()}

    @staticmethod
    def _holds_in(region: Region, live: set[int]) -> int:
        """Hold words of `region` naming a live residency. `count` fences and loads every word
        first (after the closed store: the revoke's side); zero is then final."""
        # A pin hold (a whole step under way) counts as one hold: it keeps pinned slots.
        pin_hold = int(_holds.load(region.map, rz.W_PIN_HOLD) != 0)
        if _holds.count(region.map, rz.HOLD_BASE, rz.HOLD_WORDS) == 0:
            return pin_hold
        words = np.frombuffer(region.map, dtype=np.uint64, count=rz.HOLD_WORDS, offset=rz.HOLD_BASE * 8)
        return pin_hold + sum(1 for w in words[words != 0].tolist() if w in live)

    def holds_of(self, session) -> int:
        region = self.regions.get(session)
        return _holds.count(region.map, rz.HOLD_BASE, rz.HOLD_WORDS) if region is not None else 0

    # ---- folding what clients recorded -----------------------------------------

    def _region(self, session) -> Region | None:
        return self.regions.get(session) or self.revoked.get(session)

    def touches(self, session) -> list[tuple[int, int]]:
        """(class id, slot) of the local hits `session` recorded since the last call."""
        region = self._region(session)
        if region is None:
            return []
        head = _holds.load(region.map, rz.W_RING_HEAD)
        if head <= region.ring_seen:
            region.ring_seen = min(region.ring_seen, head)
            return []
        start = max(region.ring_seen, head - rz.RING_WORDS)  # older ones were overwritten
        region.ring_seen = head
        out = []
        for i in range(start, head):
            word = _holds.load(region.map, rz.RING_BASE + i % rz.RING_WORDS)
            out.append((word >> 32, word & 0xFFFFFFFF))
        return out

    def local_hits(self, session) -> dict[int, int]:
        """model id -> local hits `session` recorded since the last call (clamped)."""
        region = self._region(session)
        if region is None:
            return {}
        out = {}
        for i in range(rz.MAX_MODEL_COUNTERS):
            base = rz.COUNTER_BASE + 2 * i
            mid, hits = _holds.load(region.map, base), _holds.load(region.map, base + 1)
            if mid == 0:
                continue
            step = hits - region.counters_seen.get(mid, 0)
            if 0 < step <= MAX_COUNTER_STEP:
                out[mid] = step
            region.counters_seen[mid] = hits
        return out

    def close(self) -> None:
        for words in list(self.states.values()) + list(self.tables.values()):
            words.close()
        for region in [*self.regions.values(), *self.revoked.values()]:
            region.close()
        self.states.clear()
        self.tables.clear()
        self.regions.clear()
        self.revoked.clear()
