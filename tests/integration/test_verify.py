"""Verify mode against a real daemon: a file rewritten in place under it fails the acquire loudly."""

from __future__ import annotations

import os
import shutil

import pytest

from moed.daemon.catalog import Catalog
from moed.protocol import errors
from tests.integration.test_daemon import check_lease, expert_bytes


def corrupt(path, cat: Catalog, layer: int, expert: int) -> None:
    """Flip bytes of one expert's down part in place (same inode: the daemon keeps the model)."""
    p, off, n = cat.extent(layer, expert, "down")
    fd = os.open(p, os.O_RDWR)
    try:
        at = off + n // 2
        os.pwrite(fd, bytes(b ^ 0x5A for b in os.pread(fd, 64, at)), at)
        os.fsync(fd)
    finally:
        os.close(fd)


def churn(h, layer: int, n: int) -> None:
    for e in range(n):
        with h.acquire(layer, [e]):
            pass


@pytest.mark.parametrize("verify", [True, False])
def test_bytes_changed_under_the_daemon(start_daemon, tiny_model, tmp_path, verify):
    path = tmp_path / "m.gguf"
    shutil.copy(tiny_model, path)
    cat = Catalog.open(path)
    slot = expert_bytes(path, 0)
    conf = tmp_path / "moed.toml"
    conf.write_text(f"verify = {'true' if verify else 'false'}\n")
    d = start_daemon(str(4 * slot), "--config", str(conf))
    with d.client() as c:
        h = c.open_model(path)
        with h.acquire(0, [1, 2]) as lease:            # first reads: hashes recorded
            check_lease(cat, lease, 0, [1, 2])
        churn(h, 1, 8)                                 # evict them
        corrupt(path, cat, 0, 1)
        if verify:
            with pytest.raises(errors.VerifyMismatch, match="differ from the first read"):
                h.acquire(0, [1])
            with h.acquire(0, [2]) as lease:           # an untouched expert still verifies
                check_lease(cat, lease, 0, [2])
            s = c.stats()
            assert s["verify"] and s["verify_mismatches"] == 1 and s["verified_reads"] >= 1
            assert "VERIFY MISMATCH" in d.log()
            with pytest.raises(errors.VerifyMismatch):  # and it stays refused
                h.acquire(0, [1])
        else:
            with h.acquire(0, [1]):                    # served silently: what verify mode is for
                pass
            assert c.stats()["verify"] is False
    assert d.stop() == 0
