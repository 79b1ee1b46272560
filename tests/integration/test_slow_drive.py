"""A real daemon on a slow and a stalled drive: a cgroup v1 blkio read throttle on a loop device.

The model lives on btrfs on a loop device, and the daemon's process is moved into
a blkio cgroup whose `blkio.throttle.read_bps_device` limits its reads of that
device (moed.testing.faultfs: the limit applies to the O_DIRECT reads the daemon
submits to the loop device). Nothing is mocked: the kernel holds the reads back.
Root only; skipped with the reason where loop devices, mkfs.btrfs or the blkio
controller are missing.
"""

from __future__ import annotations

import time

import pytest

from moed.gguf.catalog import Catalog
from moed.protocol import errors
from moed.testing import file_bytes, wait_for
from moed.testing.faultfs import BlkioThrottle, LoopBtrfs, drop_caches, unavailable

pytestmark = pytest.mark.skipif(
    bool(unavailable(throttle=True)), reason=f"a throttled drive needs a loop btrfs and blkio: {unavailable(True)}"
)

MiB = 1 << 20
# What may finish while a demand read waits if it goes ahead of 10 queued prefetched
# experts: its own, the two reader threads' reads in flight (a job counts whole when
# its last chunk lands), and what the throttle lets through around the calls. Behind
# the queue it would be at least 11.
AHEAD_EXPERTS = 6


def ahead_bytes(model: str) -> int:
    """AHEAD_EXPERTS experts of `model` (all its experts are one size), in bytes."""
    cat = Catalog.open(model)
    return AHEAD_EXPERTS * sum(cat.extent(cat.moe_layers[0], 0, p)[2] for p in cat.parts)


@pytest.fixture(scope="module")
def slow_fs(model_factory):
    """(LoopBtrfs, model path on it): 4 layers of 32 experts, 204 KiB each (3 page-aligned parts)."""
    src = model_factory(embd=256, ff=256, align=4096, experts=32)
    with LoopBtrfs() as fs:
        yield fs, str(fs.copy_in(src, "model.gguf"))


@pytest.fixture
def throttled(start_daemon, slow_fs):
    """`throttled(**config) -> (daemon, throttle)`: a daemon in its own blkio group, unthrottled."""
    fs, _ = slow_fs
    made = []

    def start(budget: str = "8MiB", **config):
        # An earlier test's buffered check (file_bytes) leaves the model's pages cached, with
        # readahead's neighbours, and btrfs serves O_DIRECT reads of cached pages with no I/O:
        # a throttle would then limit nothing (seen in CI: layer 1's expert 9 came back in
        # under a second at 4 KiB/s after expert 7 had been read buffered).
        drop_caches()
        d = start_daemon(budget, config=config or None)
        t = BlkioThrottle(fs.major_minor)
        made.append(t)
        t.add(d.proc.pid)
        return d, t

    yield start
    for t in made:
        t.close()


def _warm(h, layer: int, experts) -> None:
    """Unthrottled reads, so the drive's health has its own baseline (>= 32 chunk reads)."""
    for e in experts:
        with h.acquire(layer, [e], timeout_s=30):
            pass


def test_prefetch_backs_off_and_demand_goes_ahead_on_a_throttled_drive(throttled, slow_fs):
    _, model = slow_fs
    d, throttle = throttled(reader_threads=2)
    with d.client("engine") as c:
        h = c.open_model(model)
        _warm(h, 0, range(16))
        assert not c.stats()["drive_behind"]
        throttle.read_bps(1 * MiB)
        h.prefetch(2, list(range(10)))  # 6 MiB of read-ahead, queued before the drive is known slow
        wait_for(lambda: c.stats()["drive_behind"], timeout_s=20, what="the drive to be seen behind")
        before = c.stats()["bytes_read"]
        with h.acquire(1, [20], timeout_s=30):  # 204 KiB of demand
            s = c.stats()
        # Demand went ahead of the queued prefetches (and they were dropped): while it
        # waited, the reads in flight (2 threads) and a few around the calls finished
        # besides its own 204 KiB, never the 10 experts of read-ahead queued before it.
        # Counted in bytes, not seconds, so a loaded box cannot make it pass or fail.
        assert s["bytes_read"] - before <= ahead_bytes(model), (s["bytes_read"] - before) // 1024
        assert s["prefetch_dropped"] >= 5, s["prefetch_dropped"]
        issued = s["prefetches"]
        h.prefetch(3, list(range(8)))  # while behind: none is issued
        wait_for(lambda: c.stats()["prefetch_dropped"] >= s["prefetch_dropped"] + 8, what="the prefetch held back")
        assert c.stats()["prefetches"] == issued
        throttle.read_bps(0)
        wait_for(lambda: c.stats()["reads_in_flight"] == 0, timeout_s=20, what="reads to drain")


def test_without_backoff_demand_still_goes_before_queued_prefetches(throttled, slow_fs):
    _, model = slow_fs
    d, throttle = throttled(reader_threads=2, prefetch_backoff=False)
    with d.client("engine") as c:
        h = c.open_model(model)
        _warm(h, 0, range(16))
        # 256 KiB/s: the 10 prefetches (2 MiB) take ~8 s, so they are all still in flight when
        # looked at even on a loaded box (at 1 MiB/s they could drain first: seen once in a full run)
        throttle.read_bps(256 << 10)
        h.prefetch(2, list(range(10)))
        wait_for(lambda: c.stats()["reads_in_flight"] >= 10, what="the prefetches queued")
        before = c.stats()["bytes_read"]
        with h.acquire(1, [20], timeout_s=30):
            s = c.stats()
        # the demand's own and a few in flight finished, not the 10 queued before it
        assert s["bytes_read"] - before <= ahead_bytes(model), (s["bytes_read"] - before) // 1024
        assert s["prefetch_dropped"] == 0 and s["reads_in_flight"] > 0  # the read-ahead goes on, behind
        throttle.read_bps(0)
        wait_for(lambda: c.stats()["reads_in_flight"] == 0, timeout_s=20, what="reads to drain")


def test_timeout_fires_on_time_with_a_stalled_read_and_nothing_leaks(throttled, slow_fs):
    _, model = slow_fs
    d, throttle = throttled(read_stall_warn_s=0.5)
    cat = Catalog.open(model)
    with d.client("engine") as c:
        h = c.open_model(model)
        _warm(h, 0, range(4))
        throttle.read_bps(8 << 10)  # 8 KiB/s: one expert takes ~25 s, a stalled drive
        t0 = time.monotonic()
        with pytest.raises(errors.ReadTimeout, match="did not finish"):
            h.acquire(1, [7], timeout_s=1.0)
        waited = time.monotonic() - t0
        assert 0.9 <= waited < 2.5, waited
        s = c.stats()
        assert s["tenants"][0]["leases"] == 0 and s["reads_in_flight"] == 1
        # The pool and the loop keep serving: a resident expert is still a hit.
        with h.acquire(0, [1], timeout_s=5):
            pass
        wait_for(lambda: c.stats()["stalled_reads"] >= 1, timeout_s=10, what="the stuck read to be reported")
        assert c.stats()["stuck_reads"] >= 1
        assert "has not returned" in d.log()
        throttle.read_bps(0)  # the drive comes back: the stalled read ends and fills its slot
        wait_for(lambda: c.stats()["reads_in_flight"] == 0, timeout_s=20, what="the stalled read to return")
        t0 = time.monotonic()
        with h.acquire(1, [7], timeout_s=5) as lease:
            for part in h.parts:
                _, off, length = cat.extent(1, 7, part)
                assert lease.view(7, part).tobytes() == file_bytes(model, off, length)
        assert time.monotonic() - t0 < 1.0
        s = c.stats()
        assert s["tenants"][0]["leases"] == 0 and s["stuck_reads"] == 0


def test_throughput_recovers_once_the_throttle_lifts(throttled, slow_fs):
    _, model = slow_fs
    d, throttle = throttled(budget="4MiB")  # 20 experts: new reads keep coming
    with d.client("engine") as c:
        h = c.open_model(model)
        _warm(h, 0, range(16))
        throttle.read_bps(2 * MiB)
        slow = iter(range(32))

        def behind() -> bool:  # the throttle lets a first burst through: read until it bites
            with h.acquire(1, [next(slow)], timeout_s=30):
                pass
            return c.stats()["drive_behind"]

        wait_for(behind, timeout_s=20, what="the throttled drive to be seen behind")
        throttle.read_bps(0)
        lifted = time.monotonic()
        expert = iter(range(3, 32))

        def recovered() -> bool:
            with h.acquire(2, [next(expert)], timeout_s=30):
                pass
            return not c.stats()["drive_behind"]

        wait_for(recovered, timeout_s=5, what="the drive to be seen healthy again")
        assert time.monotonic() - lifted < 5
        issued = c.stats()["prefetches"]
        h.prefetch(3, [0, 1])  # read-ahead is issued again
        wait_for(lambda: c.stats()["prefetches"] >= issued + 2, what="prefetches issued again")
        t0 = time.monotonic()
        with h.acquire(3, [30, 31], timeout_s=30):
            pass
        assert time.monotonic() - t0 < 0.5


def test_a_spare_reader_serves_another_drive_while_reads_are_stuck(throttled, slow_fs, tiny_model):
    """Both readers stuck on a stalled drive: spares take their place, so a model on another
    (healthy) drive is still served."""
    _, model = slow_fs
    d, throttle = throttled(reader_threads=2, read_stall_warn_s=0.5)
    with d.client("engine") as c:
        h = c.open_model(model)
        other = c.open_model(str(tiny_model))  # on the box's own disk: not throttled
        _warm(h, 0, range(2))
        throttle.read_bps(4 << 10)  # one expert's three 68 KiB parts: ~50 s
        with pytest.raises(errors.ReadTimeout):
            h.acquire(1, [9], timeout_s=1.0)  # both readers now sit in a read that does not return
        t0 = time.monotonic()
        with other.acquire(2, [3, 4], timeout_s=10):
            served_s = time.monotonic() - t0
        assert served_s < 5, served_s
        assert c.stats()["stalled_reads"] >= 2
        throttle.read_bps(0)
        wait_for(lambda: c.stats()["reads_in_flight"] == 0, timeout_s=20, what="the stalled reads to return")
