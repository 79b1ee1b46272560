"""Tenant quotas: a reserved floor and a ceiling over the shared budget, and the floor rule.

A tenant's floor is bytes other tenants cannot evict it below; its ceiling is
the most it may hold (it evicts its own slots first, or waits). The floor rule
is the one question every quota walk asks of a candidate victim, and it is
answered here only: the store's eviction walk (moed.cache.room's
`RoomSearch.quota_victims`) and the lab's fleet replay (`moed.lab.fleetsim`) both
call `keeps_floor`.
"""

from __future__ import annotations

from typing import NamedTuple


class Quota(NamedTuple):
    floor_bytes: int = 0  # not evicted for other owners below this
    ceiling_bytes: int = 0  # never holds more than this; 0: no ceiling


def keeps_floor(owned_bytes: int, taken_bytes: int, slot_bytes: int, floor_bytes: int) -> bool:
    """May a slot of `slot_bytes` be evicted from an owner for another owner?

    `owned_bytes` is what the owner holds, `taken_bytes` what this walk already
    chose to evict from it. Yes when it has no floor, or when it stays at or
    above its floor without the slot. (An owner's own slots are always its to
    evict: callers ask only about other owners'.) Since a walk's `taken_bytes`
    only grows, a slot refused once stays refused for the rest of that walk.
    """
    return not floor_bytes or owned_bytes - taken_bytes - slot_bytes >= floor_bytes
