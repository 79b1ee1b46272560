"""Tenant configuration and the daemon's own hotness counts.

A tenant is a peer uid (SO_PEERCRED). `[tenants.<uid or user name>]` in the
configuration gives it a reserved floor and/or a ceiling of the shared budget;
names are resolved to uids once, at start, and an unknown name fails the start.
The store enforces the quotas (`Store.set_quota`); this module only resolves
them.

`Heat` keeps decayed access counts per expert so an operator can pin what the
engines actually use (`moectl pin --from-stats`): every access adds 1 and all
counts halve every `half_life` accesses (amortised O(1) per access).
"""

from __future__ import annotations

import pwd
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import TenantConfig


def tenant_uid(key: str) -> int:
    """The uid a `[tenants.<key>]` table names: digits are a uid, anything else a user name."""
    if key.isdigit():
        return int(key)
    try:
        return pwd.getpwnam(key).pw_uid
    except KeyError:
        raise ValueError(f"tenants.{key}: no such user") from None


def resolve_tenants(tenants: dict[str, TenantConfig]) -> dict[int, TenantConfig]:
    out: dict[int, TenantConfig] = {}
    for key, cfg in tenants.items():
        uid = tenant_uid(key)
        if uid in out:
            raise ValueError(f"tenants.{key}: uid {uid} is configured twice")
        out[uid] = cfg
    return out


class Heat:
    """Decayed access counts per ExpertKey."""

    def __init__(self, half_life: int = 1 << 16):
        self.half_life = half_life
        self.counts: dict = {}
        self._since = 0

    def add(self, slots) -> None:
        counts = self.counts
        for s in slots:
            key = s.key
            counts[key] = counts.get(key, 0.0) + 1.0
        self._since += len(slots)
        if self._since >= self.half_life:
            self._decay()

    def _decay(self) -> None:
        self._since = 0
        self.counts = {k: v / 2 for k, v in self.counts.items() if v >= 0.25}

    def ranked(self, model_id: int) -> list[tuple[int, int]]:
        """(layer, expert) of one model, hottest first."""
        mine = [(v, k) for k, v in self.counts.items() if k.model_id == model_id]
        mine.sort(key=lambda vk: -vk[0])
        return [(k.layer, k.expert) for _, k in mine]
