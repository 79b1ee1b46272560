"""Tenant configuration resolution and the daemon's decayed access counts."""

from __future__ import annotations

import pytest

from moed.cache.store import ExpertKey
from moed.daemon.config import TenantConfig, resolve_tenants, tenant_uid
from moed.daemon.heat import Heat


class S:
    def __init__(self, key):
        self.key = key


def test_tenant_keys_are_uids_or_user_names():
    assert tenant_uid("1234") == 1234
    assert tenant_uid("root") == 0
    with pytest.raises(ValueError, match="no such user"):
        tenant_uid("surely-no-such-user")
    with pytest.raises(ValueError, match="twice"):
        resolve_tenants({"0": TenantConfig(1), "root": TenantConfig(2)})
    assert resolve_tenants({"nobody": TenantConfig(5, 9)}) == {65534: TenantConfig(5, 9)}


def test_heat_ranks_by_decayed_count_per_model():
    h = Heat(half_life=8)
    a, b, c = ExpertKey(1, 0, 3), ExpertKey(1, 2, 5), ExpertKey(2, 0, 0)
    for _ in range(3):
        h.add([S(a)])
    h.add([S(b), S(c)])
    assert h.ranked(1) == [(0, 3), (2, 5)]
    assert h.ranked(2) == [(0, 0)]
    for _ in range(20):  # b gets hot later; old counts halve away
        h.add([S(b)])
    assert h.ranked(1)[0] == (2, 5)
    assert all(v < 20 for v in h.counts.values())
