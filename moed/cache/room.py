"""Finding room: which resident slots give way to new bytes, chosen before anything changes.

The store (moed.cache.store) asks its `RoomSearch` before it reserves a slot.
A search reads the store's budget, policy, quotas and ownership and changes
none of them; the store evicts what it found.

Invariants, kept here:
- A search walks the policy's candidates in order and asks `store.claim` of
  each slot it would evict: engines may hold READY slots without telling the
  store (moed.daemon.residency), and a claimed slot is one they no longer hold.
  A refused slot is never a victim; it goes to `adopt` (the store takes a
  reference for its local holder) and the walk goes on.
- All or nothing: when the room cannot be found now, every slot the search
  claimed is handed back with `store.unclaim` and the search reports failure.
- The request's own resident slots (`present`) are about to be referenced:
  they are never chosen.
- Without quotas the victims are the policy's first claimable slots and stay
  first in the policy, so the store's evictions that follow (`next_victim`,
  which asks `claim` again: a claimed slot stays claimed until `unclaim`) take exactly them;
  they are kept in `claims` until `settle`, which hands back any that ended up
  not evicted. With quotas, an owner first gives up its own slots down to its
  ceiling, then any slot whose owner stays at or above its floor without it
  (moed.cache.quota.keeps_floor); the store evicts the victims at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from .eviction import EvictionPolicy
from .quota import Quota, keeps_floor
from .records import READY, Slot


class Budget(Protocol):
    """What a search reads of the store and the two calls it makes (moed.cache.store.Store
    is the one implementation): the search owns none of this state."""

    effective_budget_bytes: int
    used_bytes: int
    policy: EvictionPolicy
    quotas: dict[object, Quota]
    owned_bytes: dict[object, int]

    def claim(self, slot: Slot) -> bool: ...

    def unclaim(self, slot: Slot) -> None: ...


class RoomSearch:
    """The victim search of one store; `adopt` is the store's, for locally held slots."""

    def __init__(self, store: Budget, adopt: Callable[[Slot], None]):
        self.store = store
        self.adopt = adopt
        self.claims: list[Slot] = []  # claimed by `claim_room` during one operation

    def shortfall(self, need: int) -> int:
        """Bytes to evict before `need` new bytes fit under the effective budget (<= 0: none)."""
        store = self.store
        return need - (store.effective_budget_bytes - store.used_bytes)

    def claim_room(self, need: int, present: Iterable[Slot | None]) -> bool:
        """Claim, in policy order, evictable slots enough for `need` new bytes; False
        (nothing claimed, though locally held candidates are adopted) if there are not.
        """
        short = self.shortfall(need)
        if short <= 0:
            return True
        skip = {s for s in present if s is not None}
        claimed: list[Slot] = []
        refused: list[Slot] = []
        for s in self.store.policy.candidates():
            if short <= 0:
                break
            if s in skip:
                continue
            if self.store.claim(s):
                claimed.append(s)
                short -= s.slot_bytes
            else:
                refused.append(s)
        for s in refused:
            self.adopt(s)
        if short > 0:
            self._unclaim_all(claimed)
            return False
        self.claims += claimed
        return True

    def quota_victims(self, owner: object, need: int, present: Iterable[Slot | None]) -> list[Slot] | None:
        """The slots to evict so `need` new bytes fit for `owner`, or None if they cannot now.

        First its own least recently used slots down to its ceiling, then any
        slot in policy order whose owner stays at or above its floor without it.
        Raises ValueError if `need` exceeds the ceiling.
        """
        store = self.store
        q = store.quotas.get(owner)
        ceiling = q.ceiling_bytes if q is not None else 0
        if ceiling and need > ceiling:
            raise ValueError(f"request needs {need} bytes, the tenant's ceiling is {ceiling}")
        short = self.shortfall(need)
        over = store.owned_bytes.get(owner, 0) + need - ceiling if ceiling else 0
        if short <= 0 and over <= 0:
            return []
        skip = {s for s in present if s is not None}
        taken: dict = {}
        victims: list[Slot] = []
        refused: list[Slot] = []
        for s in store.policy.candidates():
            if over <= 0:
                break
            if s.owner is owner and s not in skip:
                skip.add(s)
                if not store.claim(s):
                    refused.append(s)
                    continue
                victims.append(s)
                over -= s.slot_bytes
                short -= s.slot_bytes
        if over <= 0:
            for s in store.policy.candidates():
                if short <= 0:
                    break
                if s in skip or not self._may_evict_for(s, owner, taken):
                    continue
                skip.add(s)
                if not store.claim(s):
                    refused.append(s)
                    continue
                victims.append(s)
                taken[s.owner] = taken.get(s.owner, 0) + s.slot_bytes
                short -= s.slot_bytes
        for s in refused:
            self.adopt(s)
        if over > 0 or short > 0:
            self._unclaim_all(victims)
            return None
        return victims

    def next_victim(self) -> Slot | None:
        """The policy's first slot `claim` allows (the refused are adopted), or None if none is."""
        while (victim := self.store.policy.victim()) is not None:
            if self.store.claim(victim):
                return victim
            self.adopt(victim)
        return None

    def settle(self) -> None:
        """Claimed slots the operation did not evict after all are handed back."""
        claims, self.claims = self.claims, []
        self._unclaim_all(s for s in claims if s.state is READY)

    def _unclaim_all(self, slots: Iterable[Slot]) -> None:
        for s in slots:
            self.store.unclaim(s)

    def _may_evict_for(self, s: Slot, owner: object, taken: dict) -> bool:
        o = s.owner
        q = self.store.quotas.get(o) if o is not owner else None
        if q is None:
            return True
        return keeps_floor(self.store.owned_bytes.get(o, 0), taken.get(o, 0), s.slot_bytes, q.floor_bytes)
