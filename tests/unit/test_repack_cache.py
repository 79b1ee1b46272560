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


def settled(daemon: Daemon, model) -> bool:
    s = daemon.stats()
    return s["repack_cache_writes"] + s["repack_cache_skipped"] >= n_experts(model)


async def filled(daemon: Daemon, path: str):
    """The model made on read, every expert of it read once and written to the cache."""
    model = await daemon.open_model(path, layout=LAYOUT)
    await read_all(daemon, model, check=False)
    wait_for(lambda: written_all(daemon, model), 30, what="every expert written")
    return model


def touch(path: str) -> None:
    """A new identity for the same bytes (mtime one second later)."""
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


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


def test_a_page_aligned_model_is_cached_the_same(model_factory, tmp_path):
    """Parts of whole pages: written and read back with O_DIRECT, straight from and into slots."""
    path = tmp_path / "a.gguf"
    path.write_bytes(model_factory(quant="q4_0", embd=256, ff=256, align=4096).read_bytes())
    d = str(tmp_path / "cache")

    async def body(daemon: Daemon):
        model = await daemon.open_model(str(path), layout=LAYOUT)
        await read_all(daemon, model)
        wait_for(lambda: written_all(daemon, model), 30, what="every expert written")
        await read_all(daemon, model)
        assert daemon.stats()["repack_cache_reads"] > 0
        assert model.repack_cache is not None and model.repack_cache._direct_write

    run(body, budget_bytes=4 * slot_bytes_of(str(path)), repack_cache_dir=d)


def test_a_changed_file_voids_its_cache(plain, tmp_path):
    d = tmp_path / "cache"

    async def fill(daemon: Daemon):
        await filled(daemon, plain)

    run(fill, budget_bytes=6 * slot_bytes_of(plain), repack_cache_dir=str(d))
    before = cache_files(d)
    touch(plain)  # same bytes, new identity (as a rewrite in place would leave it): the cache is void

    async def after(daemon: Daemon):
        model = await daemon.open_model(plain, layout=LAYOUT)
        await read_all(daemon, model)
        s = daemon.stats()
        assert s["repack_cache_reads"] == 0 and s["repacked_bytes"] > 0

    run(after, budget_bytes=6 * slot_bytes_of(plain), repack_cache_dir=str(d))
    assert not set(before) & set(cache_files(d))  # the old identity's files are gone


def test_a_file_changed_while_open_retires_its_model_and_voids_its_cache(plain, tmp_path):
    d = tmp_path / "cache"

    async def body(daemon: Daemon):
        model = await filled(daemon, plain)
        touch(plain)
        newer = await daemon.open_model(plain, layout=LAYOUT)
        assert model.stale and newer is not model
        await read_all(daemon, newer)  # transformed from the file again, never the old cache
        assert model.repack_cache.key != newer.repack_cache.key
        daemon.registry.drop_if_drained(model)  # no lease left: it goes, and its cache with it
        assert model.model_id not in daemon.models
        assert not any(n.startswith(model.repack_cache.key) for n in cache_files(d))
        assert daemon.stats()["repack_cache_dropped"] == 1

    run(body, budget_bytes=6 * slot_bytes_of(plain), repack_cache_dir=str(d))


def test_a_start_deletes_caches_of_files_changed_or_gone(plain, tmp_path):
    d = tmp_path / "cache"

    async def fill(daemon: Daemon):
        model = await daemon.open_model(plain, layout=LAYOUT)
        daemon.release(await lease_of(daemon, model, 0, [0]))
        wait_for(lambda: daemon.stats()["repack_cache_writes"] == 1, 30, what="one expert written")

    run(fill, repack_cache_dir=str(d))
    assert cache_files(d)
    os.unlink(plain)
    repackcache.RepackCaches(str(d), None).close()
    assert cache_files(d) == []


def test_the_disk_budget_bounds_the_cache_and_skips_what_does_not_fit(plain, tmp_path):
    d = str(tmp_path / "cache")

    async def body(daemon: Daemon):
        model = await daemon.open_model(plain, layout=LAYOUT)
        per = model.repack_cache.geo.expert_bytes(0)
        assert daemon.repack_caches.budget_bytes == 3 * per
        await read_all(daemon, model)
        wait_for(lambda: daemon.stats()["repack_cache_skipped"] > 0, 30, what="writes skipped")
        s = daemon.stats()
        assert s["repack_cache_writes"] == 3 and s["repack_cache_bytes"] <= 3 * per
        await read_all(daemon, model)  # what is not cached is transformed again, still right

    from moed.gguf.catalog import Catalog
    from moed.protocol.layout import round_up

    cat = Catalog.open(plain)
    entry = cat.layers[min(cat.layers)]
    per = sum(round_up(p.bytes_per_expert) for p in entry.parts.values())
    run(body, budget_bytes=6 * slot_bytes_of(plain), repack_cache_dir=d, repack_cache_bytes=3 * per)


def test_a_cache_no_open_model_uses_gives_way_least_recently_used_first(model_factory, tmp_path):
    d = str(tmp_path / "cache")
    paths = []
    for name, ff in (("a", 64), ("b", 128)):
        p = tmp_path / f"{name}.gguf"
        p.write_bytes(model_factory(quant="q4_0", ff=ff).read_bytes())
        paths.append(str(p))

    def fill(path):
        async def body(daemon: Daemon):
            model = await daemon.open_model(path, layout=LAYOUT)
            await read_all(daemon, model, check=False)
            wait_for(lambda: settled(daemon, model), 30, what="every expert written or skipped")
            return daemon.stats()["repack_cache_bytes"]

        return body

    a_bytes = run(fill(paths[0]), budget_bytes=64 << 20, repack_cache_dir=d)
    (a_index,) = [n for n in cache_files(d) if n.endswith(".index")]
    # b's experts are larger: its cache needs room that only deleting a's (unused) gives
    got = run(fill(paths[1]), budget_bytes=64 << 20, repack_cache_dir=d, repack_cache_bytes=a_bytes + 1)
    assert 0 < got <= a_bytes + 1
    assert [n for n in cache_files(d) if n.endswith(".index")] != [a_index]
    assert len([n for n in cache_files(d) if n.endswith(".index")]) == 1


def test_off_makes_no_directory_and_reads_as_before(plain, tmp_path):
    d = tmp_path / "cache"

    async def body(daemon: Daemon):
        model = await daemon.open_model(plain, layout=LAYOUT)
        assert daemon.repack_caches is None and model.repack_cache is None
        await read_all(daemon, model)
        s = daemon.stats()
        assert s["repack_cache_writes"] == 0 and s["repack_cache_dir"] == ""

    run(body, budget_bytes=6 * slot_bytes_of(plain), repack_cache_dir=str(d), repack_cache_bytes=0)
    assert not d.exists()


def test_a_daemon_that_makes_nothing_on_read_leaves_no_directory(plain, tmp_path):
    d = tmp_path / "cache"

    async def body(daemon: Daemon):
        model = await daemon.open_model(plain)  # the file's own layout: nothing made on read
        daemon.release(await lease_of(daemon, model, 0, [0]))
        assert model.repack_cache is None

    run(body, repack_cache_dir=str(d))
    assert not d.exists()


def test_a_damaged_cache_is_read_from_the_file_instead_and_turned_off(plain, tmp_path):
    d = str(tmp_path / "cache")

    async def body(daemon: Daemon):
        model = await daemon.open_model(plain, layout=LAYOUT)
        await read_all(daemon, model, check=False)
        wait_for(lambda: written_all(daemon, model), 30, what="every expert written")
        os.truncate(os.path.join(d, model.repack_cache.key + ".data"), 0)  # every read of it now ends short
        await read_all(daemon, model)  # the bytes are still right: read from the file
        assert not model.repack_cache.on
        s = daemon.stats()
        assert s["read_errors"] == 0  # not a failure of the model's reads

    run(body, budget_bytes=6 * slot_bytes_of(plain), repack_cache_dir=d)


@pytest.mark.parametrize("where", ["tmpfs", "buffered"])
def test_a_cache_on_tmpfs_or_without_o_direct_reads_back_the_same_bytes(plain, tmp_path, where):
    """/dev/shm (tmpfs: O_DIRECT there depends on the kernel, 6.6 and later accept it), and
    `direct_io = "off"`, which writes and reads the cache through the page cache."""
    import shutil
    import tempfile

    root = tempfile.mkdtemp(prefix="moed-rc-", dir="/dev/shm") if where == "tmpfs" else str(tmp_path)
    direct_io = "auto" if where == "tmpfs" else "off"
    try:

        async def body(daemon: Daemon):
            model = await daemon.open_model(plain, layout=LAYOUT)
            await read_all(daemon, model)
            wait_for(lambda: written_all(daemon, model), 30, what="every expert written")
            if direct_io == "off":
                assert not model.repack_cache._direct_write and not model.repack_cache.reader.direct
            await read_all(daemon, model)
            assert daemon.stats()["repack_cache_reads"] > 0

        run(body, budget_bytes=6 * slot_bytes_of(plain), repack_cache_dir=os.path.join(root, "c"), direct_io=direct_io)
    finally:
        if where == "tmpfs":
            shutil.rmtree(root, ignore_errors=True)


def test_verify_mode_hashes_reads_from_the_cache_as_the_first_read(plain, tmp_path):
    async def body(daemon: Daemon):
        model = await daemon.open_model(plain, layout=LAYOUT)
        await read_all(daemon, model, check=False)
        wait_for(lambda: written_all(daemon, model), 30, what="every expert written")
        await read_all(daemon, model, check=False)
        s = daemon.stats()
        assert s["repack_cache_reads"] > 0 and s["verified_reads"] > 0 and s["verify_mismatches"] == 0

    run(body, budget_bytes=6 * slot_bytes_of(plain), repack_cache_dir=str(tmp_path / "c"), verify=True)


def test_a_second_daemon_on_the_same_directory_goes_without_the_cache(plain, tmp_path):
    d = str(tmp_path / "cache")
    other = repackcache.RepackCaches(d, None)
    try:

        async def first(daemon: Daemon):
            model = await daemon.open_model(plain, layout=LAYOUT)
            mine = model.repack_cache
            assert mine is not None
            # the same model opened by another daemon's cache: its data file is locked
            assert other.open_cache(mine.index.files, mine.index.identity, mine.index.layouts, mine.geo) is None
            await read_all(daemon, model)

        run(first, budget_bytes=6 * slot_bytes_of(plain), repack_cache_dir=d)
    finally:
        other.close()


def test_bad_cache_settings_are_refused_naming_the_key(tmp_path):
    from moed.daemon.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="negative"):
        load_config(repack_cache_bytes=-1)
    assert load_config(repack_cache_bytes="auto").repack_cache_bytes is None
    assert load_config(repack_cache_bytes="2GiB").repack_cache_bytes == 2 << 30
    with pytest.raises(ConfigError):
        load_config(repack_cache_dir=5)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError, match="repack_cache_dir"):
        repackcache.from_config(str(blocker / "sub"), None)
    assert repackcache.from_config(str(blocker / "sub"), 0) is None  # off: never touched
