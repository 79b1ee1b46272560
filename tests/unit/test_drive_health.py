"""The pure parts of drive-fault handling: the quarantine's marks and the drive's "behind" signal."""

from __future__ import annotations

from typing import NamedTuple

from moed.daemon.drivehealth import DriveHealth
from moed.daemon.quarantine import Quarantine


class ExpertKey(NamedTuple):  # the store's key has the same fields; the quarantine needs only model_id
    model_id: int
    layer: int
    expert: int


def test_a_mark_refuses_until_it_ends_or_is_cleared():
    q = Quarantine(30.0)
    bad, other = ExpertKey(1, 1, 5), ExpertKey(2, 1, 5)
    q.mark(bad, "reading model 1 layer 1 expert 5 part down failed: [Errno 5] EIO", now=100.0)
    q.mark(other, "reading model 2 ...", now=100.0)
    message = q.check(bad, now=110.0)
    assert message is not None and "EIO" in message and "20s more" in message
    assert q.check(ExpertKey(1, 1, 4), now=110.0) is None
    assert q.count() == 2 and q.entries(1) == [bad]
    assert q.clear(model_id=1) == 1 and q.check(bad, now=110.0) is None
    assert q.check(other, now=130.0) is None  # ended by itself
    assert q.count() == 0


def test_no_quarantine_when_its_length_is_zero():
    q = Quarantine(0.0)
    q.mark(ExpertKey(1, 1, 5), "failed", now=0.0)
    assert q.count() == 0


def _feed(h: DriveHealth, seconds: float, n: int, nbytes: int = 256 << 10) -> None:
    for _ in range(n):
        h.observe(seconds, nbytes)


def test_behind_on_sustained_slow_reads_not_on_one_outlier_and_recovers():
    h = DriveHealth()
    _feed(h, 100e-6, 200)  # an NVMe-like drive: ~100 us per 256 KiB
    assert not h.behind(0.0)
    h.observe(0.5, 256 << 10)  # one read stalls 5,000x
    assert not h.behind(0.0), "one outlier is not a slow drive"
    _feed(h, 100e-6, 20)
    _feed(h, 400e-6 * 4, 40)  # the drive drops to a sixteenth of its rate
    assert h.behind(1.0) and h.stats()["drive_behind"]
    _feed(h, 100e-6, 60)  # the throttle lifts
    assert not h.behind(2.0)
    assert h.stats()["drive_behind_episodes"] == 1


def test_behind_when_demand_waits_in_the_queue():
    h = DriveHealth(queue_behind_s=0.1)
    assert not h.behind(0.0, oldest_demand_wait_s=0.01)
    assert h.behind(0.0, oldest_demand_wait_s=0.2)


def test_nothing_is_judged_before_enough_reads():
    h = DriveHealth(min_samples=32)
    _feed(h, 100e-6, 5)
    _feed(h, 1.0, 20)
    assert not h.behind(0.0)
