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


# ---- the default floor and the budget fitted to a cgroup (issue 46) ----------------

GiB = 1 << 30


class FakeBox:
    """What `size_memory` reads from the box: MemTotal and the cgroup's lowest limit."""

    def __init__(self, ram_bytes: int, cgroup_limit_bytes: int | None):
        self.ram_bytes, self.limit = ram_bytes, cgroup_limit_bytes

    def total_bytes(self) -> int:
        return self.ram_bytes

    def cgroup_limit_bytes(self) -> int | None:
        return self.limit

    def auto_floor_bytes(self) -> int:
        from moed.daemon.memguard import auto_floor_bytes

        return auto_floor_bytes(self.ram_bytes, self.limit)


def test_default_floor_is_5_percent_of_ram_without_a_cgroup():
    from moed.daemon.memguard import auto_floor_bytes

    assert auto_floor_bytes(24 * GiB, None) == 24 * GiB // 20
    assert auto_floor_bytes(64 * GiB, None) == int(3.2 * GiB)


def test_default_floor_follows_a_cgroup_smaller_than_ram():
    from moed.daemon.memguard import auto_floor_bytes

    assert auto_floor_bytes(64 * GiB, 16 * GiB) == 16 * GiB // 20
    assert auto_floor_bytes(8 * GiB, 16 * GiB) == 8 * GiB // 20  # a limit above RAM: RAM counts


def test_default_floor_on_a_tiny_box_is_256_MiB():
    from moed.daemon.memguard import MIN_AUTO_FLOOR_BYTES, auto_floor_bytes

    assert MIN_AUTO_FLOOR_BYTES == 256 * MiB
    assert auto_floor_bytes(2 * GiB, None) == 256 * MiB
    assert auto_floor_bytes(24 * GiB, 1280 * MiB) == 256 * MiB  # the cgroup


def test_size_memory_resolves_only_a_floor_not_given():
    from moed.daemon.config import Config
    from moed.daemon.main import size_memory

    box = FakeBox(24 * GiB, None)
    assert Config().mem_floor_bytes is None
    assert size_memory(Config(), box).mem_floor_bytes == 24 * GiB // 20
    assert size_memory(Config(mem_floor_bytes=0), box).mem_floor_bytes == 0
    assert size_memory(Config(mem_floor_bytes=3 * MiB), box).mem_floor_bytes == 3 * MiB
    tiny = FakeBox(24 * GiB, 1280 * MiB)
    assert size_memory(Config(), tiny).mem_floor_bytes == 256 * MiB


def test_config_tells_not_given_from_zero(tmp_path):
    from moed.daemon.config import load_config

    assert load_config().mem_floor_bytes is None
    assert load_config(mem_floor_bytes=0).mem_floor_bytes == 0
    assert load_config(mem_floor_bytes="auto").mem_floor_bytes is None
    path = tmp_path / "moed.toml"
    path.write_text('mem_floor_bytes = "1GiB"\n')
    assert load_config(str(path)).mem_floor_bytes == GiB
    assert load_config(str(path), mem_floor_bytes="auto").mem_floor_bytes is None  # the flag wins
    path.write_text('mem_floor_bytes = "auto"\n')
    assert load_config(str(path)).mem_floor_bytes is None


def test_moed_flag_takes_auto_zero_and_sizes():
    from moed.daemon.main import parse_args

    assert parse_args([]).mem_floor_bytes is None
    assert parse_args(["--mem-floor", "auto"]).mem_floor_bytes == "auto"
    assert parse_args(["--mem-floor", "0"]).mem_floor_bytes == 0
    assert parse_args(["--mem-floor", "512MiB"]).mem_floor_bytes == 512 * MiB


def test_fit_budget_lowers_only_a_budget_above_the_limit_less_floor_and_pins():
    import pytest

    from moed.daemon.memguard import fit_budget

    assert fit_budget(64 * GiB, 0, 256 * MiB, None) == 64 * GiB  # no cgroup: left alone
    assert fit_budget(GiB, 0, 256 * MiB, 1280 * MiB) == GiB  # the case fits exactly
    assert fit_budget(4 * GiB, 0, 256 * MiB, 2 * GiB) == 2 * GiB - 256 * MiB
    assert fit_budget(4 * GiB, 512 * MiB, 256 * MiB, 2 * GiB) == 2 * GiB - 768 * MiB
    assert fit_budget(4 * GiB, 0, 0, 2 * GiB) == 2 * GiB  # guard off: the limit itself
    assert fit_budget(4 * GiB, 0, 0, 2 * GiB + 100) == 2 * GiB  # whole pages
    with pytest.raises(ValueError, match=r"limit 200\.00 MiB.*floor 256\.00 MiB.*--mem-floor"):
        fit_budget(GiB, 0, 256 * MiB, 200 * MiB)


def test_size_memory_clamps_the_budget_and_warns_naming_the_numbers(caplog):
    import pytest

    from moed.daemon.config import Config, TenantConfig
    from moed.daemon.main import StartupError, size_memory

    box = FakeBox(24 * GiB, 2 * GiB)  # default floor: 256 MiB
    with caplog.at_level("WARNING", logger="moed"):
        sized = size_memory(Config(ram_budget_bytes=4 * GiB), box)
    assert sized.ram_budget_bytes == 2 * GiB - 256 * MiB and sized.mem_floor_bytes == 256 * MiB
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "4.00 GiB" in warning and "2.00 GiB" in warning and "256.00 MiB" in warning
    assert "lowered to 1.75 GiB" in warning
    caplog.clear()
    with caplog.at_level("WARNING", logger="moed"):
        kept = size_memory(Config(ram_budget_bytes=GiB), box)
    assert kept.ram_budget_bytes == GiB and not [r for r in caplog.records if r.levelname == "WARNING"]
    with pytest.raises(StartupError, match="leaves no room"):
        size_memory(Config(), FakeBox(24 * GiB, 200 * MiB))
    floors = {"0": TenantConfig(floor_bytes=GiB)}
    with pytest.raises(StartupError, match="tenant floors"):  # a lowered budget below the tenant floors
        size_memory(Config(ram_budget_bytes=4 * GiB, tenants=floors), FakeBox(24 * GiB, GiB))


def test_moed_help_states_the_default_floor(capsys):
    import pytest

    from moed.daemon.main import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "5% of the smaller of the box's RAM and the memory cgroup's limit, at least 256MiB" in text
    assert "0 turns the guard off" in text
