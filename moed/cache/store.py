"""The slot state machine and the one byte budget shared by every model and tenant.

Pure: no I/O, no clocks, no asyncio. In the daemon, core (moed.daemon.core) drives it
and the RAM tier follows the page effects it reports (`take_dropped`). The records
it works on (`Slot`, `SlotClass`, `ExpertKey`, `Want`, `Plan`) are moed.cache.records';
which slots give way to new bytes is its `RoomSearch`'s (moed.cache.room), which
chooses and claims victims without changing anything; the store evicts them.

Invariants, kept here:
- A slot is EMPTY, LOADING or READY. Only LOADING and READY slots are in the
  table, and each holds exactly one expert key.
- `used_bytes` is the sum of `slot_bytes` over non-EMPTY unpinned slots and
  never exceeds `budget_bytes`; pinned slots count in `pinned_bytes` instead,
  which never exceeds `pin_budget_bytes`. Pinned slots are never evicted (not
  by the policy, quotas or `shrink`); unpinning a held or loading slot is
  deferred (`unpin_pending`) until it is READY and unreferenced.
- A new slot is only reserved while `used_bytes + slot_bytes` fits under
  `effective_budget_bytes` (the memory guard lowers it); used may sit above
  it after a lowering until leases are released and `shrink` evicts.
- A slot's `refs` is the number of leases (granted or waiting) that hold it.
  A slot is evictable iff READY, refs == 0 and not pinned; exactly the
  evictable slots are in the policy, so the policy can never pick a held slot.
- An acquire is all-or-nothing: either every expert gets a reference (and the
  missing ones a LOADING slot), or nothing changes and the caller waits.
- Every (slot, generation) pair names one residency of one key; a stale pair
  (the load failed, the slot was reused) is ignored on release.
- Each resident, unpinned slot is charged to one owner (the tenant whose
  acquire or prefetch loaded it); `owned_bytes[owner]` is the sum over its
  slots. With quotas (`set_quota`), an owner's slots are not evicted for
  another owner while that would take it below its floor, and an owner never
  holds more than its ceiling (it evicts its own slots first, or waits).
  Without quotas, eviction is the policy's single order, untouched.
- A prefetched slot (`prefetched`) that leaves the table before any lease used
  it (evicted, or its queued read cancelled) counts once in `wasted_prefetches`.
- A READY slot leaves the table only after `claim(slot)` said yes: engines may
  hold READY slots without telling the store (the residency table's local
  holds, moed.daemon.residency), and `claim` is how the store asks. A refused
  slot is adopted: it takes a reference (`adopted`), leaves the policy, and is
  given back by `release_adopted` once nobody holds it locally. Victims are
  chosen and claimed before anything is changed (moed.cache.room), so an
  acquire either finds all the room it needs or changes nothing; claimed
  slots that end up not evicted are handed back with `unclaim`.
- A pinned slot leaves the pinned partition only after `pins_changing(model)`
  said no engine reads the model's pinned experts in a whole step (a decode with
  no per-layer holds: moed.protocol.residency_words); otherwise it stays pinned,
  `unpin_pending`, in `unpin_waiting`, and `retry_unpins` tries again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, cast

from .eviction import LRU, EvictionPolicy
from .quota import Quota
from .records import READY, ExpertKey, Plan, Slot, SlotClass, SlotState, Want
from .room import RoomSearch

__all__ = ["READY", "ExpertKey", "Plan", "Slot", "SlotClass", "SlotState", "Store", "Want"]


class HoldClaims(Protocol):
    """Who the store asks before a READY slot leaves the table (moed.daemon.residency)."""

    def claim(self, slot: Slot) -> bool: ...

    def unclaim(self, slot: Slot) -> None: ...

    def pins_changing(self, model_id: int) -> bool: ...


class Store:
    def __init__(self, budget_bytes: int, policy: EvictionPolicy | None = None, pin_budget_bytes: int = 0, holds=None):
        self.budget_bytes = budget_bytes
        self.pin_budget_bytes = pin_budget_bytes
        self.used_bytes = 0
        self.pinned_bytes = 0
        # What the store may grow to now: the budget, or less while the memory
        # guard holds the box above its floor. Never above budget_bytes.
        self.effective_budget_bytes = budget_bytes
        self.policy = policy if policy is not None else LRU()
        self.classes: dict[int, SlotClass] = {}
        self.table: dict[ExpertKey, Slot] = {}
        self.evictable_bytes = 0
        self.evictions = 0
        self.wasted_prefetches = 0  # prefetched slots gone before any use
        self._dropped: list[Slot] = []  # slots whose pages the RAM tier should give back
        self.owned_bytes: dict[object, int] = {}  # owner -> bytes of its resident slots
        self.quotas: dict[object, Quota] = {}  # owner -> floor/ceiling, when configured
        # Local holds (see the module docstring): their owner (`holds`, a HoldClaims)
        # answers `claim`; the defaults are a store with no local holds.
        self.claim: Callable[[Slot], bool] = holds.claim if holds else lambda slot: True
        self.unclaim: Callable[[Slot], None] = holds.unclaim if holds else lambda slot: None
        self.pins_changing: Callable[[int], bool] = holds.pins_changing if holds else lambda model_id: False
        self.unpin_waiting: set[Slot] = set()  # unpins a whole step holds off (`retry_unpins`)
        self.adopted: set[Slot] = set()
        self.room = RoomSearch(self, self._adopt)

    # ---- classes --------------------------------------------------------

    def add_class(self, class_id: int, slot_bytes: int, capacity: int) -> SlotClass:
        if class_id in self.classes:
            raise ValueError(f"size class {class_id} exists")
        cls = SlotClass(class_id, slot_bytes, capacity)
        self.classes[class_id] = cls
        return cls

    def remove_class(self, class_id: int) -> bool:
        """Forget a class none of whose slots holds anything; False if one still does."""
        cls = self.classes.get(class_id)
        if cls is None or len(cls.free) != len(cls.slots):
            return False
        del self.classes[class_id]
        return True

    # ---- acquire --------------------------------------------------------

    def acquire(self, wants: list[Want], owner: object = None) -> Plan | None:
        """Reference every wanted key, reserving LOADING slots for misses.

        Returns None (and changes nothing) when the misses cannot be made room
        for now; raises ValueError when they never could. The keys must be
        distinct (the daemon dedupes experts at the edge): a repeated missing
        key would get two slots.
        """
        table = self.table
        slots = [table.get(w.key) for w in wants]
        if None in slots:
            missing = [w for w, s in zip(wants, slots) if s is None]
            need = sum(self.classes[w.class_id].slot_bytes for w in missing)
            # Hits must stay resident beside the misses, so they count too.
            whole = need + sum(s.slot_bytes for s in slots if s is not None and not s.pinned)
            if whole > self.budget_bytes:
                raise ValueError(f"request needs {whole} bytes, the budget is {self.budget_bytes}")
            if not self._find_room(owner, need, slots):
                return None
        # The hit path: take a reference on every resident slot (inlined: it runs
        # for every expert of every acquire).
        loading, hits = [], 0
        policy = self.policy
        touch = policy.touch if policy.wants_touch else None
        for s in slots:
            if s is None:
                continue
            if s.refs == 0 and s.state is READY and not s.pinned:
                policy.remove(s)
                self.evictable_bytes -= s.slot_bytes
            s.refs += 1
            if touch is not None:
                touch(s)
            if s.state is READY:
                hits += 1
            else:
                loading.append(s)
        to_load = []
        if len(loading) + hits < len(slots):
            for i, s in enumerate(slots):
                if s is None:
                    s = slots[i] = self._reserve(wants[i], owner)
                    to_load.append(s)
        self.room.settle()
        granted = cast(list[Slot], slots)  # every None was reserved above
        return Plan(granted, [s.generation for s in granted], to_load, loading, hits, len(to_load))

    def prefetch(self, want: Want, owner: object = None) -> Slot | None:
        """Reserve a LOADING slot for a key not resident, without evicting a held slot.

        Returns None when the key is resident or in flight, or nothing can be
        evicted. The slot has no references; it becomes evictable once READY.
        A resident evictable key is moved to the recent end of the policy
        instead: it is about to be wanted, so it should not be the next victim.
        """
        resident = self.table.get(want.key)
        if resident is not None:
            if self._is_evictable(resident):
                self.policy.remove(resident)
                self.policy.add(resident)
            return None
        if not self._find_room(owner, self.classes[want.class_id].slot_bytes, ()):
            return None
        slot = self._reserve(want, owner)
        self.room.settle()
        slot.refs = 0
        slot.prefetched = True
        return slot

    def cancel_prefetch(self, slot: Slot) -> None:
        """A queued prefetch was dropped before its read started: give the slot back."""
        if slot.state != SlotState.LOADING or slot.refs or not slot.prefetched:
            raise ValueError("only an unreferenced prefetch still loading can be cancelled")
        self.wasted_prefetches += 1
        self.failed(slot)

    # ---- tenant quotas -----------------------------------------------------

    def set_quota(self, owner: object, floor_bytes: int = 0, ceiling_bytes: int = 0) -> None:
        """Give `owner` a reserved floor and/or a ceiling (both 0: remove its quota)."""
        if floor_bytes or ceiling_bytes:
            self.quotas[owner] = Quota(floor_bytes, ceiling_bytes)
            self.owned_bytes.setdefault(owner, 0)
        else:
            self.quotas.pop(owner, None)

    def _find_room(self, owner: object, need: int, present) -> bool:
        """Make room for `need` new bytes of `owner`'s; False (nothing evicted) if there is none now.

        Without quotas the claimed victims stay first in the policy for `_reserve`
        to evict (`_evict_one`); with quotas they are evicted here.
        """
        if not self.quotas:
            return self.room.claim_room(need, present)
        victims = self.room.quota_victims(owner, need, present)
        if victims is None:
            return False
        for v in victims:
            self._evict(v)
            self._drop(v)
        return True

    def _adopt(self, slot: Slot) -> None:
        """A READY slot someone holds locally: the store takes a reference on their behalf."""
        if self._is_evictable(slot):
            self.policy.remove(slot)
            self.evictable_bytes -= slot.slot_bytes
        slot.refs += 1
        slot.adopted = True
        self.adopted.add(slot)

    def release_adopted(self, slot: Slot) -> None:
        """Nobody holds an adopted slot locally any more: drop the store's reference."""
        if slot in self.adopted:
            self.adopted.discard(slot)
            slot.adopted = False
            self.release(slot, slot.generation)

    def _is_evictable(self, s: Slot) -> bool:
        return s.state is READY and s.refs == 0 and not s.pinned

    def _reserve(self, want: Want, owner: object) -> Slot:
        cls = self.classes[want.class_id]
        slot = None
        while self.effective_budget_bytes - self.used_bytes < cls.slot_bytes:
            victim = self._evict_one()
            if victim is None:
                raise RuntimeError("store accounting broken: room promised but nothing evictable")
            if victim.class_id == cls.class_id:
                slot = victim  # same size: reuse its pages as they are
                break
            self._drop(victim)
        if slot is None:
            slot = cls.take_free()
            if slot is None:
                raise RuntimeError(f"size class {cls.class_id} has no free slot index (capacity {cls.capacity})")
            self.used_bytes += cls.slot_bytes
        self._occupy(slot, want.key, refs=1, owner=owner)
        self.owned_bytes[owner] = self.owned_bytes.get(owner, 0) + slot.slot_bytes
        if self.policy.wants_touch:
            self.policy.touch(slot)
        return slot

    def _occupy(self, slot: Slot, key: ExpertKey, refs: int, owner: object) -> None:
        """A new residency of `key` in `slot`: LOADING, a new generation, in the table."""
        slot.state = SlotState.LOADING
        slot.key = key
        slot.refs = refs
        slot.generation += 1
        slot.prefetched = False
        slot.owner = owner
        self.table[key] = slot

    def _evict_one(self) -> Slot | None:
        """Evict the policy's first claimable slot (the search adopts the locally held); None if none is."""
        victim = self.room.next_victim()
        if victim is not None:
            self._evict(victim)
        return victim

    def _evict(self, victim: Slot) -> None:
        """Take an evictable slot out of the table (it becomes EMPTY, its index kept)."""
        self.policy.remove(victim)
        self.evictable_bytes -= victim.slot_bytes
        self._vacate(victim)
        self._disown(victim)
        self.evictions += 1
        if victim.prefetched:  # read ahead, never used
            victim.prefetched = False
            self.wasted_prefetches += 1

    def _vacate(self, slot: Slot) -> None:
        """Take a slot's key out of the table: it is EMPTY (its index and bytes stay until `_drop`)."""
        del self.table[cast(ExpertKey, slot.key)]  # only occupied slots are vacated
        slot.key = None
        slot.state = SlotState.EMPTY

    def _disown(self, slot: Slot) -> None:
        owner = slot.owner
        if owner in self.owned_bytes and not slot.pinned:  # a pinned slot is charged to nobody
            left = self.owned_bytes[owner] - slot.slot_bytes
            if left > 0 or owner in self.quotas:
                self.owned_bytes[owner] = left
            else:
                del self.owned_bytes[owner]
        slot.owner = None

    def _drop(self, slot: Slot) -> None:
        """Return an EMPTY slot's index and bytes; its pages go back to the kernel."""
        if slot.pinned:
            slot.pinned = slot.unpin_pending = False
            self.pinned_bytes -= slot.slot_bytes
        else:
            self.used_bytes -= slot.slot_bytes
        self.classes[slot.class_id].free.append(slot.index)
        slot.generation += 1
        self._dropped.append(slot)

    # ---- completion and release ----------------------------------------

    def loaded(self, slot: Slot) -> None:
        """A read finished: LOADING -> READY."""
        assert slot.state == SlotState.LOADING
        slot.state = SlotState.READY
        if self._is_evictable(slot):
            self.policy.add(slot)
            self.evictable_bytes += slot.slot_bytes
        elif slot.unpin_pending and not slot.refs:
            self._unpin_free(slot)

    def failed(self, slot: Slot) -> None:
        """A read failed: the slot is dropped; every holder's reference dies with it."""
        if slot.state != SlotState.LOADING:
            return
        self._vacate(slot)
        slot.refs = 0
        self._disown(slot)
        self._drop(slot)

    def release(self, slot: Slot, generation: int) -> None:
        if slot.generation != generation or slot.refs <= 0:
            return
        slot.refs -= 1
        if slot.refs == 0 and slot.state is READY:
            if not slot.pinned:
                self.policy.add(slot)
                self.evictable_bytes += slot.slot_bytes
            elif slot.unpin_pending:
                self._unpin_free(slot)

    def touch_local(self, slot: Slot) -> None:
        """An engine hit this slot without a round trip: it is the most recently used."""
        if slot.state is READY and slot.key is not None:
            if self._is_evictable(slot):
                self.policy.remove(slot)
                self.policy.add(slot)
            if self.policy.wants_touch:
                self.policy.touch(slot)

    def use_prefetched(self, slot: Slot) -> bool:
        """True once, the first time a prefetched slot is hit."""
        if slot.prefetched:
            slot.prefetched = False
            return True
        return False

    # ---- the pinned partition (host mirror) -------------------------------

    def pin(self, want: Want) -> tuple[Slot, bool, bool] | None:
        """Put a key in the pinned partition: (slot, newly pinned, must be read), or None if it is full.

        A resident key moves out of the shared budget (it frees room there);
        a missing key gets a LOADING slot with no references, to be read in.
        Pinned slots are never evicted, by the policy, the guard or quotas.
        """
        slot = self.table.get(want.key)
        if slot is not None and slot.pinned:
            slot.unpin_pending = False
            self.unpin_waiting.discard(slot)
            return slot, False, False
        cls = self.classes[want.class_id]
        size = cls.slot_bytes
        if self.pinned_bytes + size > self.pin_budget_bytes:
            return None
        if slot is not None:
            if self._is_evictable(slot):
                self.policy.remove(slot)
                self.evictable_bytes -= size
            self.used_bytes -= size
            self._disown(slot)
            slot.pinned = True
            self.pinned_bytes += size
            return slot, True, False
        slot = cls.take_free()
        if slot is None:
            return None
        self._occupy(slot, want.key, refs=0, owner=None)
        slot.pinned = True
        self.pinned_bytes += size
        return slot, True, True

    def unpin(self, key: ExpertKey) -> bool:
        """Take a key out of the pinned partition; False if it was not pinned.

        It rejoins the shared budget as most recently used if there is room
        there, else it is dropped; a held or loading slot goes when it is free.
        """
        slot = self.table.get(key)
        if slot is None or not slot.pinned:
            return False
        if slot.refs or slot.state is not READY:
            slot.unpin_pending = True
            self.pins_changing(key.model_id)  # no new whole step: the pin word drops now
        else:
            self._unpin_free(slot)
        return True

    def _unpin_free(self, slot: Slot) -> None:
        """Unpin a READY, unreferenced slot, unless a whole step reads its model's pinned
        experts: then it waits, pinned, for `retry_unpins`."""
        assert slot.key is not None
        if self.pins_changing(slot.key.model_id):
            slot.unpin_pending = True
            self.unpin_waiting.add(slot)
        else:
            self.unpin_waiting.discard(slot)
            self._unpin_now(slot)

    def retry_unpins(self) -> list[Slot]:
        """Unpin what whole steps held off, where none reads it now; returns the slots unpinned."""
        done = []
        for slot in list(self.unpin_waiting):
            if not (slot.pinned and slot.unpin_pending and slot.state is READY and not slot.refs):
                self.unpin_waiting.discard(slot)  # re-pinned, or taken over by a lease's release
                continue
            self._unpin_free(slot)
            if slot not in self.unpin_waiting:
                done.append(slot)
        return done

    def _unpin_now(self, slot: Slot) -> None:
        size = slot.slot_bytes
        if self.effective_budget_bytes - self.used_bytes >= size:
            slot.pinned = slot.unpin_pending = False
            self.pinned_bytes -= size
            self.used_bytes += size
            slot.owner = None
            self.owned_bytes[None] = self.owned_bytes.get(None, 0) + size
            self.policy.add(slot)
            self.evictable_bytes += size
        elif self.claim(slot):
            self._vacate(slot)
            self._drop(slot)
        else:  # held locally: it leaves once let go
            slot.unpin_pending = True
            self._adopt(slot)

    # ---- shrinking ------------------------------------------------------

    def set_effective_budget(self, limit_bytes: int) -> None:
        """Let the store grow only to `limit_bytes` (clamped to the budget).

        Lowering it evicts nothing by itself (call `shrink`); acquires that
        would need memory beyond it evict or wait instead, and hits still work.
        """
        self.effective_budget_bytes = max(0, min(self.budget_bytes, limit_bytes))

    def shrink(self, target_used_bytes: int) -> int:
        """Evict unreferenced slots until used <= target; returns bytes freed."""
        freed = 0
        while self.used_bytes > target_used_bytes and self.evictable_bytes > 0:
            victim = self._evict_one()
            if victim is None:
                break
            self._drop(victim)
            freed += victim.slot_bytes
        return freed

    def take_dropped(self) -> list[Slot]:
        """Slots emptied since the last call (their pages can be given back)."""
        out, self._dropped = self._dropped, []
        return out

    def drop_model(self, model_id: int) -> None:
        """Forget every unreferenced slot of a model (it was closed or went stale)."""
        for key in [k for k in self.table if k.model_id == model_id]:
            slot = self.table[key]
            if not self._is_evictable(slot):
                continue
            if not self.claim(slot):
                self._adopt(slot)  # dropped when its local holder lets go
                continue
            self.policy.remove(slot)
            self.evictable_bytes -= slot.slot_bytes
            self._vacate(slot)
            self._disown(slot)
            self._drop(slot)
