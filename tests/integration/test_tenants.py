"""Tenants against a real daemon: two uids, a reserved floor, a ceiling, per-tenant stats."""

from __future__ import annotations

import os
import shutil

import pytest

from moed.client import Client
from tests.integration.peer import NOBODY, Outcome, as_peer
from tests.integration.test_daemon import expert_bytes


def public_copy(model, shared_dir: str) -> str:
    path = shutil.copy(model, os.path.join(shared_dir, "model.gguf"))
    os.chmod(path, 0o644)
    return path


def _use(sock: str, model: str, layer: int, experts: list[int]) -> tuple[int, int]:
    """Acquire each expert once as this process's uid; returns (hits, misses) of the tenant."""
    with Client(sock, "nobody-engine") as c:
        m = c.open_model(model)
        for e in experts:
            with m.acquire(layer, [e], timeout_s=5):
                pass
        me = next(t for t in c.stats()["tenants"] if t["uid"] == os.getuid())
    return me["hits"], me["misses"]


def test_floor_holds_under_the_other_tenants_pressure_and_ceiling_caps(start_shared, model_factory, shared_dir):
    src = model_factory(layers=4, experts=16, used=2)
    slot = expert_bytes(src, 0)
    model = public_copy(src, shared_dir)
    d = start_shared(
        str(8 * slot), f"[tenants.nobody]\nfloor_bytes = {3 * slot}\n[tenants.0]\nceiling_bytes = {6 * slot}\n"
    )
    # nobody loads 5 experts of layer 0 and leaves
    assert as_peer(NOBODY, NOBODY, _use, d.socket, model, 0, [0, 1, 2, 3, 4]) == Outcome(result=(0, 5))
    with d.client("root-engine") as c:
        m = c.open_model(model)
        for layer in (1, 2, 3):  # root streams 48 experts through 8 slots
            for e in range(16):
                with m.acquire(layer, [e], timeout_s=5):
                    pass
        s = c.stats()
    rows = {t["uid"]: t for t in s["tenants"]}
    assert rows[NOBODY]["resident_bytes"] == 3 * slot and rows[NOBODY]["floor_bytes"] == 3 * slot
    assert rows[0]["resident_bytes"] == 5 * slot and rows[0]["ceiling_bytes"] == 6 * slot
    assert s["used_bytes"] <= s["budget_bytes"]
    # nobody's three most recent experts survived the pressure: all hits now
    assert as_peer(NOBODY, NOBODY, _use, d.socket, model, 0, [2, 3, 4]) == Outcome(result=(3, 5))
    # per-tenant, per-model breakdown
    with d.client() as c:
        c.open_model(model)
        s = c.stats()
    rows = {t["uid"]: t for t in s["tenants"]}
    (mrow,) = s["models"]
    assert rows[NOBODY]["models"][str(mrow["model_id"])]["resident_bytes"] == 3 * slot
    assert rows[0]["models"][str(mrow["model_id"])]["misses"] == 48
    assert mrow["hits"] == rows[0]["hits"] + rows[NOBODY]["hits"]
    assert mrow["misses"] == rows[0]["misses"] + rows[NOBODY]["misses"]
    assert mrow["bytes_read"] == s["bytes_read"]
    assert sorted(mrow["users"]) == [0]
    assert d.stop() == 0


def test_without_tenant_config_everyone_shares_one_lru(start_shared, model_factory, shared_dir):
    src = model_factory(layers=4, experts=16, used=2)
    slot = expert_bytes(src, 0)
    model = public_copy(src, shared_dir)
    d = start_shared(str(8 * slot))
    as_peer(NOBODY, NOBODY, _use, d.socket, model, 0, [0, 1, 2, 3, 4])
    with d.client() as c:
        m = c.open_model(model)
        for e in range(16):
            with m.acquire(1, [e], timeout_s=5):
                pass
        rows = {t["uid"]: t for t in c.stats()["tenants"]}
    assert rows[NOBODY]["resident_bytes"] == 0
    assert rows[0]["resident_bytes"] == 8 * slot


def test_unknown_tenant_user_fails_the_start(tmp_path):
    from moed.protocol.errors import DaemonUnavailable
    from moed.testing import DaemonProcess

    conf = tmp_path / "moed.toml"
    conf.write_text("[tenants.no-such-user-here]\nfloor_bytes = 1\n")
    with pytest.raises(DaemonUnavailable, match="no such user"):
        DaemonProcess("8MiB", "--config", str(conf))


def test_hits_on_another_tenants_reads_are_counted_as_shared(start_shared, model_factory, shared_dir):
    model = public_copy(model_factory(layers=4, experts=16, used=2), shared_dir)
    d = start_shared("64MiB")
    out = as_peer(NOBODY, NOBODY, _use, d.socket, model, 2, [0, 1, 2])
    assert not out.error and out.result == (0, 3), out
    with d.client() as c:
        m = c.open_model(model)
        with m.acquire(2, [0, 1, 2, 3], timeout_s=5):  # three were read in by nobody, one is new
            pass
        s = c.stats()
    rows = {t["uid"]: t for t in s["tenants"]}
    assert rows[0]["shared_hits"] == 3 and rows[0]["misses"] == 1
    assert rows[NOBODY]["shared_hits"] == 0
    assert s["shared_hits"] == 3
