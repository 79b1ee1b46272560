"""moectl fleet: one trace is `moectl policy`, copies compose, floors are the store's, the CLI's schema."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from moed.cache.store import ExpertKey, Store, Want
from moed.ctl import main
from moed.lab import fleetsim, policies
from moed.traces import Trace, TraceWriter

SMOKE = pathlib.Path(__file__).resolve().parents[1] / "data" / "olmoe-smoke.jsonl"


def skewed(seed: int, layers: int = 3, experts: int = 8, k: int = 2, tokens: int = 200, prompt: int = 0) -> Trace:
    """A trace with a hot few experts per layer and, sometimes, anything."""
    rng = np.random.default_rng(seed)
    w = TraceWriter(layers, experts, k)
    if prompt:
        w.append_step("P", [rng.integers(0, experts, (prompt, k)) for _ in range(layers)])
    for _ in range(tokens):
        w.append_step("D", [rng.choice(experts if rng.random() < 0.3 else 3, k, replace=False) for _ in range(layers)])
    return w.finish()


def run_json(capsys, *argv):
    assert main([str(a) for a in argv]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def two_traces(tmp_path):
    paths = []
    for seed, layers in ((1, 3), (2, 2)):
        p = tmp_path / f"t{seed}.npz"
        skewed(seed, layers=layers, prompt=4).save(p)
        paths.append(p)
    return paths


# ---- one trace in a fleet is `moectl policy` ------------------------------------


@pytest.mark.parametrize("policy", ["g-lru", "g-opt", "g-lfu", "g-arc"])
@pytest.mark.parametrize("slots", [0, 64, 256, 700])
def test_one_trace_equals_moectl_policy(capsys, policy, slots):
    ref = run_json(capsys, "policy", SMOKE, "--policies", policy, "--slots", slots, "--warm", 11, "--json")[0]
    got = run_json(capsys, "fleet", SMOKE, "--budget", slots, "--policy", policy, "--warm", 11, "--json")
    for mode in ("shared", "static"):
        assert (got[mode]["hits"], got[mode]["accesses"]) == (ref["hits"], ref["accesses"])
        assert got[mode]["hit_rate"] == ref["hit_rate"] == got[mode]["per_model"][0]["hit_rate"]


def test_one_trace_with_a_prompt_and_a_share(capsys, tmp_path):
    path = tmp_path / "p.npz"
    skewed(5, prompt=6).save(path)
    ref = run_json(capsys, "policy", path, "--policies", "g-lru", "--sizes", "0.25", "--json")[0]
    got = run_json(capsys, "fleet", path, "--budget", "25%", "--json")
    assert got["budget"] == ref["slots"] == 6
    assert got["shared"]["hits"] == ref["hits"] and got["shared"]["accesses"] == ref["accesses"]


# ---- copies compose -----------------------------------------------------------------


def test_two_copies_with_twice_the_budget_equal_one():
    trace = Trace.load(SMOKE)
    for slots in (32, 128, 300):
        one = policies.replay(trace, "g-lru", slots=slots, warm=11)
        two = fleetsim.replay_fleet(
            [fleetsim.Member("a", trace), fleetsim.Member("b", trace)], 2 * slots, warm=11, phases=(0.0, 0.0)
        )
        assert (two.shared.hits, two.shared.accesses) == (2 * one.hits, 2 * one.accesses)
        assert [m.hit_rate for m in two.shared.per_model] == [one.hit_rate] * 2
        assert two.static.hit_rate == one.hit_rate  # each copy its half: one copy with B


def test_copies_out_of_phase_stay_close(capsys):
    # out of phase, a stack distance is no longer exactly 2d + 1: close, not equal
    one = policies.replay(Trace.load(SMOKE), "g-lru", slots=256, warm=11).hit_rate
    got = run_json(capsys, "fleet", SMOKE, SMOKE, "--budget", 512, "--warm", 11, "--seed", 3, "--json")
    phases = [m["phase"] for m in got["members"]]
    assert phases[0] != phases[1] and [m["name"] for m in got["members"]] == ["olmoe-smoke", "olmoe-smoke#2"]
    assert got["shared"]["hit_rate"] == pytest.approx(one, abs=0.005)


# ---- the interleaving ---------------------------------------------------------------


def test_rates_set_the_token_mix_and_the_seed_fixes_the_order():
    a, b = fleetsim.Member("a", skewed(1, tokens=400)), fleetsim.Member("b", skewed(2, tokens=400), rate=0.25)
    s = fleetsim.interleave([a, b], seed=7)
    assert s.tokens_used[0] == 400 and abs(s.tokens_used[1] - 100) <= 1  # 1:4, while both run
    assert np.array_equal(s.keys, fleetsim.interleave([a, b], seed=7).keys)
    assert not np.array_equal(s.owner, fleetsim.interleave([a, b], seed=8).owner)
    for i, acc in enumerate(s.members):  # each engine's own order is kept
        assert np.array_equal(s.local[s.owner == i], np.arange(acc.n))
    tok = s.token[s.owner == 1]
    assert (np.diff(tok) >= 0).all()
    # in time order, b's tokens come one per four of a's
    first_b = np.unique(s.token[s.owner == 1])
    assert np.all(np.diff(first_b)[5:-5] == 5)


def test_engines_on_one_model_file_share_its_slots(model_factory):
    path = model_factory(layers=3, experts=8, used=2)
    trace = skewed(4, tokens=60)
    spec = f"{trace_file(trace, path.parent / 't.npz')}:{path}"
    a, b = fleetsim.load_member(spec), fleetsim.load_member(spec)
    s = fleetsim.interleave([a, b], phases=(0.0, 0.0))
    assert np.array_equal(s.keys[s.owner == 0], s.keys[s.owner == 1])  # the same keys
    assert fleetsim.all_size([a, b]) == a.all_size  # one model's experts
    r = fleetsim.replay_fleet([a, b], a.all_size // 2, phases=(0.0, 0.0))
    assert r.shared.per_model[1].hits == r.shared.per_model[1].accesses  # b finds what a loaded
    assert r.shared.hit_rate > r.static.hit_rate


def trace_file(trace: Trace, path: pathlib.Path) -> pathlib.Path:
    trace.save(path)
    return path


# ---- floors are the store's -----------------------------------------------------------


def store_replay(stream: fleetsim.Stream, budget: int, floors: list[int]) -> tuple[np.ndarray, int]:
    """The daemon's own Store as the oracle: acquire, load, release each access as its tenant."""
    store = Store(budget)
    tenants = [object() for _ in floors]
    for t, f in zip(tenants, floors):
        store.set_quota(t, f)
    for b in np.unique(stream.key_bytes).tolist():
        store.add_class(b, b, budget // b + 1)
    hit, refused = np.zeros(stream.n, bool), 0
    for i, (k, o) in enumerate(zip(stream.keys.tolist(), stream.owner.tolist())):
        b = int(stream.key_bytes[k])
        try:
            plan = store.acquire([Want(ExpertKey(0, k, 0), b)], tenants[o])
        except ValueError:  # larger than the budget
            plan = None
        if plan is None:
            refused += 1
            continue
        hit[i] = plan.hits == 1
        for s in plan.to_load:
            store.loaded(s)
        for s, g in zip(plan.slots, plan.generations):
            store.release(s, g)
    return hit, refused


@pytest.mark.parametrize(
    "budget, floors",
    [(40, [0, 0]), (40, [20, 20]), (40, [35, 0]), (40, [0, 40]), (60, [10, 30]), (30, [7, 9]), (12, [6, 6])],
)
def test_floors_replay_exactly_as_the_store_keeps_them(budget, floors):
    # size classes: a's layers hold 3, 5 and 3 bytes per expert, b's 5 and 8
    a = fleetsim.Member("a", skewed(1), 1.0, (3, 5, 3))
    b = fleetsim.Member("b", skewed(2, layers=2), 0.5, (5, 8))
    stream = fleetsim.interleave([a, b], seed=1)
    hit, refused = fleetsim._quota_lru(stream, budget, floors)
    want_hit, want_refused = store_replay(stream, budget, floors)
    assert np.array_equal(hit, want_hit) and refused == want_refused


def test_zero_floors_are_the_shared_replay_and_a_floor_protects_its_tenant():
    quiet = fleetsim.Member("quiet", skewed(1, tokens=400), rate=0.25)
    noisy = fleetsim.Member("noisy", skewed(2, experts=32, tokens=400))
    budget = 24
    r = fleetsim.replay_fleet([quiet, noisy], budget, floors=[0, 0], seed=2)
    assert r.floors is not None and r.floors.hits == r.shared.hits and r.floors.refused == 0
    guarded = fleetsim.replay_fleet([quiet, noisy], budget, floors=[9, 0], seed=2).floors
    assert guarded is not None
    assert guarded.per_model[0].hit_rate > r.shared.per_model[0].hit_rate + 0.1
    assert guarded.per_model[1].hit_rate < r.shared.per_model[1].hit_rate


# ---- bytes ------------------------------------------------------------------------------


def test_model_slots_are_real_bytes_with_size_classes(capsys, model_factory, tmp_path):
    mixed = model_factory(layers=4, experts=8, used=2, layer_quants="q8_0,q4_0,q8_0,q4_0")
    plain = model_factory(layers=4, experts=8, used=2)
    t = trace_file(skewed(3, layers=4, tokens=80), tmp_path / "t.npz")
    m = fleetsim.load_member(f"{t}:{mixed}")
    assert len(set(m.slot_bytes or ())) == 2
    got = run_json(
        capsys, "fleet", f"{t}:{mixed}", f"{t}:{plain}@0.5", "--budget", "50%", "--floors", "25%,10%", "--json"
    )
    assert got["unit"] == "bytes" and got["all_experts"] == sum(x["all_experts"] for x in got["members"])
    shares = [x["budget"] for x in got["static"]["per_model"]]
    sizes = [x["all_experts"] for x in got["members"]]
    assert shares == [got["budget"] * s // sum(sizes) for s in sizes]
    assert [x["budget"] for x in got["floors"]["per_model"]] == [got["budget"] // 4, round(got["budget"] / 10)]
    size = run_json(capsys, "fleet", f"{t}:{mixed}", "--budget", f"{got['budget'] // 2}B", "--json")
    assert size["budget"] == got["budget"] // 2
    single = fleetsim.replay_fleet([fleetsim.load_member(f"{t}:{plain}")], 8 * m.key_bytes.max())
    assert single.shared.hit_rate == policies.replay(Trace.load(t), "g-lru", slots=8).hit_rate


# ---- the CLI ------------------------------------------------------------------------------


def test_json_table_and_plot(capsys, two_traces, tmp_path):
    a, b = two_traces
    got = run_json(capsys, "fleet", a, f"{b}@0.25", "--budget", "25%", "--floors", "30%,30%", "--json")
    assert {"shared", "static", "floors", "budget", "unit", "members"} <= set(got)
    for mode in ("shared", "static", "floors"):
        assert {"hit_rate", "per_model"} <= set(got[mode]) and len(got[mode]["per_model"]) == 2
        pm = got[mode]["per_model"]
        assert got[mode]["hits"] == sum(p["hits"] for p in pm)
        assert got[mode]["hit_rate"] == got[mode]["hits"] / got[mode]["accesses"]
    assert [m["rate"] for m in got["members"]] == [1.0, 0.25]
    assert "floors" not in run_json(capsys, "fleet", a, b, "--budget", 10, "--json")
    out = tmp_path / "f.png"
    assert main(["fleet", str(a), str(b), "--budget", "40%", "--plot", str(out)]) == 0
    text = capsys.readouterr().out
    assert "shared / static" in text and "all" in text
    assert out.stat().st_size > 1000


@pytest.mark.parametrize(
    "argv",
    [
        ["fleet", "{a}", "--budget", "120%"],
        ["fleet", "{a}", "--budget", "4GiB"],
        ["fleet", "{a}", "--budget", "lots"],
        ["fleet", "{a}@fast", "--budget", "10"],
        ["fleet", "{a}@0", "--budget", "10"],
        ["fleet", "{a}", "{b}", "--budget", "10", "--floors", "6,6"],
        ["fleet", "{a}", "{b}", "--budget", "10", "--floors", "5"],
        ["fleet", "{a}", "--budget", "10", "--policy", "lru"],
        ["fleet", "{a}", "--budget", "10", "--floors", "5", "--policy", "g-lfu"],
        ["fleet", "{a}/missing.npz", "--budget", "10"],
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, two_traces, argv):
    a, b = two_traces
    argv = [x.replace("{a}", str(a)).replace("{b}", str(b)) for x in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("moectl: ") and err.count("\n") == 1


# ---- plan --fleet -----------------------------------------------------------------------


@pytest.fixture
def fleet_specs(model_factory, tmp_path):
    a = model_factory(layers=3, experts=8, used=2)
    b = model_factory(layers=2, experts=8, used=2, layer_quants="q8_0,q4_0")
    ta = trace_file(skewed(1, tokens=300), tmp_path / "a.npz")
    tb = trace_file(skewed(2, layers=2, tokens=300), tmp_path / "b.npz")
    return [f"{ta}:{a}", f"{tb}:{b}@0.25"]


def test_plan_fleet_smallest_budget_for_the_target(fleet_specs):
    from moed.lab import fleetplan

    members = [fleetsim.load_member(s) for s in fleet_specs]
    planner = fleetplan.FleetPlanner(members, drive_gbps=0.001, compute_ms=1.0)
    target = 0.5 * planner.tok_s(planner.hits(planner.all_bytes)) + 0.5 * planner.tok_s(planner.hits(0))
    p = fleetplan.make_fleet_plan(
        members, target_tok_s=target, drive_gbps=0.001, compute_ms=1.0, ram_bytes=1 << 30, reserve_bytes=0
    )
    assert p.meets_target and p.tok_s >= target and 0 < p.budget_bytes < p.all_experts_bytes
    step = int(max(1.0, planner.mean_slot))
    assert planner.tok_s(planner.hits(p.budget_bytes - step)) < target <= planner.tok_s(planner.hits(p.budget_bytes))
    assert p.hit_rate >= p.unpinned_hit_rate and p.ram_budget_bytes + p.pin_budget_bytes == p.budget_bytes
    assert sum(m["floor_bytes"] for m in p.per_model) <= p.ram_budget_bytes
    assert all(m["floor_bytes"] > 0 for m in p.per_model)


def test_plan_fleet_cli(capsys, fleet_specs):
    got = run_json(
        capsys, "plan", "--fleet", *fleet_specs, "--drive-gbps", 1, "--ram", "64MiB", "--reserve", 0, "--json"
    )
    assert got["budget_bytes"] == got["all_experts_bytes"]  # no target: all the RAM allows
    assert [m["rate"] for m in got["per_model"]] == [1.0, 0.25]
    assert got["commands"][0].startswith("moed --ram-budget ")
    assert main(["plan", "--fleet", *fleet_specs, "--drive-gbps", "1", "--ram", "64MiB"]) == 0
    assert "recommended" in capsys.readouterr().out
    assert main(["plan", "--fleet", fleet_specs[0].split(":")[0], "--drive-gbps", "1"]) == 2
    assert main(["plan"]) == 2
