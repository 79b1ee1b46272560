"""The repack cache (issue 49, moed.daemon.repackcache): a plain file's experts made on read are
kept on disk, and every later read of them is a read of those bytes, never different ones.

In-process daemons on real files (no mock of the drive): bytes against the transform of the
file's own bytes, a restart finding the cache, a changed file voiding it, the disk budget, a
damaged cache read from the file instead, and the buffered path where O_DIRECT is refused."""

from __future__ import annotations

import os

import pytest

from moed.daemon import repackcache
from moed.daemon.core import Daemon
from moed.testing import wait_for
from tests.unit.test_daemon_in_process import lease_of, run, slot_bytes_of
from tests.unit.test_repack_on_read import made_on_read, stored

LAYOUT = "q4_0_8x8"


async def read_all(daemon: Daemon, model, check: bool = True) -> None:
    """Acquire every expert of every layer once; with `check`, each equals the transform of the
    file's bytes."""
    for layer in sorted(model.catalog.layers):
        for e in range(model.catalog.n_experts):
            lease = await lease_of(daemon, model, layer, [e])
            if check:
                for part in model.catalog.parts:
                    assert stored(daemon, lease, 0, part) == made_on_read(model, layer, e, part), (layer, e, part)
            daemon.release(lease)


def n_experts(model) -> int:
    return len(model.catalog.layers) * model.catalog.n_experts


def written_all(daemon: Daemon, model) -> bool:
    return daemon.stats()["repack_cache_writes"] >= n_experts(model)


def cache_files(directory) -> list[str]:
    return sorted(os.listdir(directory))


@pytest.fixture
def plain(model_factory, tmp_path):
    """A private copy of a plain q4_0 model (tests change it)."""
    path = tmp_path / "m.gguf"
    path.write_bytes(model_factory(quant="q4_0").read_bytes())
    return str(path)


def test_experts_made_on_read_are_written_then_read_back_from_the_cache(plain, tmp_path):
    d = str(tmp_path / "cache")

    async def body(daemon: Daemon):
        model = await daemon.open_model(plain, layout=LAYOUT)
        await read_all(daemon, model)  # cold: transformed, then written
        wait_for(lambda: written_all(daemon, model), 30, what="every expert written")
        made = daemon.stats()["repacked_bytes"]
        await read_all(daemon, model)  # the budget holds 6 experts: these are read again
        s = daemon.stats()
        assert s["repack_cache_reads"] >= n_experts(model) - 6
        assert s["repacked_bytes"] == made  # nothing transformed again
        assert s["repack_cache_bytes"] > 0 and s["repack_cache_dir"] == d

    run(body, budget_bytes=6 * slot_bytes_of(plain), repack_cache_dir=d)

    async def restarted(daemon: Daemon):
        model = await daemon.open_model(plain, layout=LAYOUT)
        await read_all(daemon, model)
        s = daemon.stats()
        assert s["repack_cache_reads"] == n_experts(model) and s["repacked_bytes"] == 0

    run(restarted, budget_bytes=6 * slot_bytes_of(plain), repack_cache_dir=d)
