"""The memory guard's decision and cgroup reading, without a daemon."""

from __future__ import annotations

from moed.daemon.memguard import CgroupMemory, decide_limit, find_cgroups, hysteresis_for

MiB = 1 << 20
BUDGET = 1024 * MiB


def test_no_floor_means_full_budget():
    assert decide_limit(10 * MiB, 0, 500 * MiB, 100 * MiB, BUDGET) == BUDGET


def test_below_floor_limit_drops_by_the_deficit():
    # 300 MiB used, 50 MiB short of the floor: may hold 250 MiB
    assert decide_limit(950 * MiB, 1000 * MiB, 300 * MiB, BUDGET, BUDGET) == 250 * MiB
    # never below zero
    assert decide_limit(0, 1000 * MiB, 300 * MiB, BUDGET, BUDGET) == 0
    # measured from the lower of limit and used
    assert decide_limit(950 * MiB, 1000 * MiB, 300 * MiB, 200 * MiB, BUDGET) == 150 * MiB


def test_band_above_floor_holds_the_limit():
    floor = 1000 * MiB
    hyst = hysteresis_for(floor)
    assert hyst >= 16 * MiB
    for avail in (floor, floor + hyst // 2, floor + hyst):
        assert decide_limit(avail, floor, 100 * MiB, 100 * MiB, BUDGET) == 100 * MiB


def test_grows_back_by_the_headroom_beyond_the_band_up_to_the_budget():
    floor = 1000 * MiB
    hyst = hysteresis_for(floor)
    assert decide_limit(floor + hyst + 30 * MiB, floor, 100 * MiB, 100 * MiB, BUDGET) == 130 * MiB
    assert decide_limit(floor + hyst + 10 * BUDGET, floor, 100 * MiB, 100 * MiB, BUDGET) == BUDGET


def test_a_large_floor_with_a_small_budget_still_grows_back():
    """The issue's case: a 22.6 GiB floor over a 1 GiB budget kept the store at 0 B."""
    GiB = 1 << 30
    floor, budget = int(22.6 * GiB), 1 * GiB
    band = hysteresis_for(floor, budget)
    assert band <= budget // 8 < hysteresis_for(floor)
    avail = floor + 300 * MiB  # well above the floor, within the old floor/16 band
    assert decide_limit(avail, floor, 0, 0, budget) == 300 * MiB - band
    assert decide_limit(floor + budget + band, floor, 0, 0, budget) == budget


def test_why_held_tells_the_truth_in_sizes():
    from moed.cache.store import Store
    from moed.daemon.memguard import MemGuard

    store = Store(1 << 30)
    guard = MemGuard(store, floor_bytes=int(22.6 * (1 << 30)), sample_s=1)
    store.set_effective_budget(0)
    guard.last_available_bytes = guard.floor_bytes + 50 * MiB
    text = guard.why_held()
    assert "22.60 GiB" in text and "recovered above the floor" in text and "below" not in text
    guard.last_available_bytes = guard.floor_bytes - 50 * MiB
    assert "is below the floor 22.60 GiB" in guard.why_held()


def test_cgroup_v1_headroom_counts_inactive_file_pages(tmp_path):
    d = tmp_path / "memory" / "a" / "b"
    d.mkdir(parents=True)
    (d / "memory.limit_in_bytes").write_text(str(1000 * MiB))
    (d / "memory.usage_in_bytes").write_text(str(900 * MiB))
    (d / "memory.stat").write_text(f"cache 5\ntotal_inactive_file {50 * MiB}\n")
    up = tmp_path / "memory" / "a"
    (up / "memory.limit_in_bytes").write_text(str(1 << 62))  # unlimited: ignored
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/a/b\n0::/\n")
    found = find_cgroups(str(proc), str(tmp_path))
    assert [c.limit_path for c in found] == [str(d / "memory.limit_in_bytes")]
    assert found[0].headroom_bytes() == 150 * MiB


def test_cgroup_v2_max_means_no_limit(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    d = tmp_path / "svc"
    d.mkdir()
    (d / "memory.max").write_text("max\n")
    (d / "memory.current").write_text("123\n")
    (d / "memory.stat").write_text("inactive_file 0\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/svc\n")
    assert find_cgroups(str(proc), str(tmp_path)) == []
    (d / "memory.max").write_text(str(200 * MiB))
    (d / "memory.current").write_text(str(150 * MiB))
    (cg,) = find_cgroups(str(proc), str(tmp_path))
    assert isinstance(cg, CgroupMemory) and cg.headroom_bytes() == 50 * MiB
