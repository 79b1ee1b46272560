"""Verify mode against a real daemon: a file rewritten in place under it fails the acquire loudly."""

from __future__ import annotations

import os
import shutil

import pytest

from moed.gguf.catalog import Catalog
from moed.protocol import errors
from moed.testing import wait_for
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
    """A write in place (same inode) is caught by the file's identity before any
    hash is needed: the model goes stale in both modes, and nothing of it is served."""
    path = tmp_path / "m.gguf"
    shutil.copy(tiny_model, path)
    cat = Catalog.open(path)
    slot = expert_bytes(path, 0)
    conf = tmp_path / "moed.toml"
    conf.write_text(f"verify = {'true' if verify else 'false'}\n")
    d = start_daemon(str(4 * slot), "--config", str(conf))
    with d.client() as c:
        h = c.open_model(path)
        with h.acquire(0, [1, 2]) as lease:  # first reads: hashes recorded
            check_lease(cat, lease, 0, [1, 2])
        churn(h, 1, 8)  # evict them
        with h.acquire(0, [1, 2]) as lease:  # read again, unchanged: verified
            check_lease(cat, lease, 0, [1, 2])
        if verify:
            s = c.stats()
            assert s["verify_mismatches"] == 0 and s["verified_reads"] >= 2
        corrupt(path, cat, 0, 1)
        # Engines' local hits check no file: the daemon finds the change within a
        # maintenance period (20 ms) and stops them, with no acquire needed.
        wait_for(lambda: c.stats()["stale_detected"] == 1, 5, what="the change detected")
        for e in (1, 2):  # the changed expert and an untouched one
            with pytest.raises(errors.ModelStale):
                h.acquire(0, [e])
        assert c.stats()["stale_detected"] == 1
        h2 = c.open_model(path)  # the new content is a new model
        assert h2.model_id != h.model_id
        with h2.acquire(0, [1]) as lease:
            check_lease(Catalog.open(path), lease, 0, [1])
    assert d.stop() == 0
