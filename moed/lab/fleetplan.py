"""Sizing a box for several models: one budget, pins and tenant floors (`moectl plan --fleet`).

Inputs: the fleet (`moed.lab.fleetsim.Member`s, each with its MODEL, so slots are
real bytes), interleaved as `moectl fleet` does; each model's read bytes per
expert from its catalog (`moed.lab.plan.ModelCost`); the drive's rate; the
machine's memory; the compute time per token.

The cost model is `moed.lab.plan`'s serial one, for the box: it runs one token
at a time, a token of engine i computes for `compute_ms` and then reads its
misses (the read bytes of the experts it missed), and tokens come in the mix
of the interleaving. Over the counted decode tokens:

    io_ms   = all missed bytes / counted tokens / (drive_gbps * 1e9) * 1e3
    tok_s   = 1000 / (compute_ms + io_ms)        the whole box, all engines together

and engine i gets its share of tokens (its rate's share). Engines that compute in
parallel, or prefetch, can only do better: this is the planner's lower bound.

The recommendation:
  * budget: the smallest total (RAM + pin budget) whose predicted box rate
    reaches the target, by bisection over bytes in mean-slot steps; without a
    target, the largest that fits `ram - every model's dense bytes - reserve`;
  * pins: a share of it (`plan.PIN_SHARES`) filled with the fleet's most used
    experts (counted accesses in the interleaved stream, so a faster engine's
    experts weigh more; ties to the lower key), the rest an LRU; the share with
    the best predicted rate (ties to fewer pins). Pins are scored on the trace
    they were chosen from: an upper estimate, as in `moectl plan`;
  * floors: each engine's low-water mark, the fewest bytes it held in the
    shared LRU (the unpinned part) once its counted tokens began. Floors there
    do not bind in this mix (no eviction the shared replay made would break
    them), yet keep each engine's working set if another engine turns noisy;
    the floors replay's hit rate is reported beside the shared one to show it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from moed.badinput import BadInput
from moed.lab import fleetsim
from moed.lab.fleetsim import Member, Stream
from moed.lab.plan import PIN_SHARES, ModelCost, Sizing, drive_rate
from moed.protocol.sizes import format_size


@dataclass
class FleetPlan(Sizing):
    budget_bytes: int  # RAM budget (the LRU) + pin budget
    ram_budget_bytes: int
    pin_budget_bytes: int
    tok_s: float
    hit_rate: float
    unpinned_hit_rate: float
    floors_hit_rate: float
    static_hit_rate: float
    meets_target: bool
    per_model: list[dict[str, Any]]
    commands: list[str]
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in asdict(self).items()}


class FleetPlanner:
    """The fleet's stream, read bytes per access and the box's predicted rate at any budget."""

    def __init__(
        self, members: Sequence[Member], drive_gbps: float, compute_ms: float = 0.0, warm: int = 0, seed: int = 0
    ):
        if fleetsim.unit_of(members) != "bytes":
            raise BadInput("plan --fleet needs TRACE:MODEL.gguf for every engine (its real expert bytes)")
        if drive_gbps <= 0 or compute_ms < 0:
            raise BadInput("--drive-gbps must be > 0 and --compute-ms >= 0")
        self.members = fleetsim.unique_names(members)
        self.drive_gbps, self.compute_ms = drive_gbps, compute_ms
        self.stream: Stream = fleetsim.interleave(self.members, warm, seed)
        self.costs = [ModelCost.of(m.model_path or "") for m in self.members]
        self.read_bytes = self._read_bytes()
        self.counted_tokens = sum(a.n_counted_tokens for a in self.stream.members)
        if self.counted_tokens == 0:
            raise BadInput("the traces have no counted decode tokens (after --warm)")
        self.all_bytes = fleetsim.all_size(self.members)
        self.mean_slot = fleetsim.mean_slot(self.members)

    def _read_bytes(self) -> np.ndarray:
        """Bytes read from the drive when access i misses (its model's layer)."""
        out = np.zeros(self.stream.n)
        for i, (m, cost) in enumerate(zip(self.members, self.costs)):
            mine = self.stream.owner == i
            layer = self.stream.members[i].keys[self.stream.local[mine]] // m.trace.n_experts
            out[mine] = cost.read_bytes[layer]
        return out

    def hits(self, budget: int, pins: int = 0) -> np.ndarray:
        """Hit per access: the `pins` bytes of hottest experts pinned, an LRU over the rest."""
        s = self.stream
        pinned = np.isin(s.keys, self.hottest(pins)) if pins else np.zeros(s.n, bool)
        rest = ~pinned
        hit = pinned.copy()
        lru, _ = fleetsim._cache_hits(
            s.keys[rest], s.token[rest], s.counted[rest], s.key_bytes, max(0, budget - pins), "g-lru"
        )
        hit[rest] = lru
        return hit

    def hottest(self, pin_bytes: int) -> np.ndarray:
        """The most used keys (counted accesses; ties to the lower key) that fit in `pin_bytes`."""
        keys, counts = np.unique(self.stream.keys[self.stream.counted], return_counts=True)
        order = keys[np.lexsort((keys, -counts))]
        fits = np.cumsum(self.stream.key_bytes[order]) <= pin_bytes
        return order[fits]

    def tok_s(self, hit: np.ndarray) -> float:
        miss = self.stream.counted & ~hit
        io_ms = float(self.read_bytes[miss].sum()) / self.counted_tokens / (self.drive_gbps * 1e9) * 1e3
        total = self.compute_ms + io_ms
        return 1e3 / total if total > 0 else float("inf")

    def hit_rate(self, hit: np.ndarray) -> float:
        counted = self.stream.counted
        return float(np.count_nonzero(hit & counted)) / max(1, int(np.count_nonzero(counted)))

    def smallest_for(self, target_tok_s: float, max_bytes: int) -> int | None:
        """Fewest mean-slot steps of budget (<= max_bytes) whose box rate reaches the target."""
        step = max(1.0, self.mean_slot)
        hi = int(max_bytes // step)
        if self.tok_s(self.hits(int(hi * step))) < target_tok_s:
            return None
        lo = 0  # invariant: hi reaches the target
        while lo < hi:
            mid = (lo + hi) // 2
            if self.tok_s(self.hits(int(mid * step))) >= target_tok_s:
                hi = mid
            else:
                lo = mid + 1
        return int(hi * step)

    def best_pins(self, budget: int) -> int:
        best, best_rate = 0, -1.0
        for share in PIN_SHARES:
            pins = int(share * budget)
            rate = self.tok_s(self.hits(budget, pins))
            if rate > best_rate:
                best, best_rate = pins, rate
        return best


def make_fleet_plan(
    members: Sequence[Member],
    *,
    target_tok_s: float | None = None,
    drive_gbps: float | None = None,
    ram_bytes: int | None = None,
    reserve_bytes: int | None = None,
    compute_ms: float = 0.0,
    warm: int = 0,
    seed: int = 0,
    measure_s: float = 3.0,
) -> FleetPlan:
    first = next((m.model_path for m in members if m.model_path), None)
    if drive_gbps is None and first is None:
        raise BadInput("plan --fleet needs TRACE:MODEL.gguf for every engine")
    drive = drive_rate(drive_gbps, first, measure_s)
    planner = FleetPlanner(members, drive[0], compute_ms, warm, seed)
    box = Sizing.of(drive, compute_ms, ram_bytes, reserve_bytes, _dense_bytes(planner), planner.all_bytes, target_tok_s)
    usable = box.usable_bytes
    max_bytes = min(usable, planner.all_bytes)
    notes: list[str] = []
    budget = max_bytes
    if target_tok_s is not None:
        found = planner.smallest_for(target_tok_s, max_bytes)
        if found is None:
            best = planner.tok_s(planner.hits(max_bytes))
            notes.append(
                f"{target_tok_s:g} tok/s is out of reach with {format_size(usable)} for experts "
                f"(best {best:.1f} tok/s for the box)"
            )
        else:
            budget = found
    pins = planner.best_pins(budget) if budget else 0
    return _assemble(planner, box, budget, pins, notes)


def _dense_bytes(planner: FleetPlanner) -> int:
    """Dense bytes once per distinct model file: engines that map one file share its page-cache pages."""
    seen: dict[Any, int] = {}
    for m, cost in zip(planner.members, planner.costs):
        seen.setdefault(m.model_key, cost.dense_bytes)
    return sum(seen.values())


def _assemble(planner: FleetPlanner, box: Sizing, budget: int, pins: int, notes: list[str]) -> FleetPlan:
    s = planner.stream
    hit = planner.hits(budget, pins)
    lru_budget = max(0, budget - pins)
    keep = ~np.isin(s.keys, planner.hottest(pins)) if pins else None
    floors = fleetsim.low_water(s, lru_budget, keep)
    floor_hits, _ = fleetsim._quota_lru(_masked(s, keep), lru_budget, floors)
    floor_all = hit.copy()
    floor_all[keep if keep is not None else slice(None)] = floor_hits
    static = fleetsim.static(s, planner.members, budget)
    pinned = planner.hottest(pins)
    per_model = []
    commands = [f"moed --ram-budget {lru_budget}" + (f" --pin-budget {pins}" if pins else "")]
    for i, m in enumerate(planner.members):
        mine = s.owner == i
        counted = s.counted & mine
        n = max(1, int(np.count_nonzero(counted)))
        mine_pins = _pins_of(pinned, i, planner)
        per_model.append(
            {
                "name": m.name,
                "model": m.model_path,
                "rate": m.rate,
                "floor_bytes": floors[i],
                "hit_rate": float(np.count_nonzero(hit & counted)) / n,
                "static_hit_rate": static.per_model[i].hit_rate,
                "pins": [list(p) for p in mine_pins],
            }
        )
        if mine_pins:
            experts = ",".join(f"{layer}:{e}" for layer, e in mine_pins)
            commands.append(f"moectl pin {m.model_path} --experts {experts}")
    notes.append(
        "floors are each engine's low-water mark in the shared replay; set them per tenant "
        "(floor_bytes in moed.toml's [tenants.NAME])"
    )
    if pins:
        notes.append("pins are the fleet's most used experts, scored on the same traces: an upper estimate")
    if box.drive_measured:
        notes.append(f"drive rate measured on the first model file: {box.drive_gbps:.2f} GB/s")
    tok_s = planner.tok_s(hit)
    return FleetPlan(
        **asdict(box),
        budget_bytes=budget,
        ram_budget_bytes=lru_budget,
        pin_budget_bytes=pins,
        tok_s=tok_s,
        hit_rate=planner.hit_rate(hit),
        unpinned_hit_rate=planner.hit_rate(planner.hits(budget)),
        floors_hit_rate=planner.hit_rate(floor_all),
        static_hit_rate=static.hit_rate,
        meets_target=box.target_tok_s is None or tok_s >= box.target_tok_s,
        per_model=per_model,
        commands=commands,
        notes=notes,
    )


def _masked(s: Stream, keep: np.ndarray | None) -> Stream:
    if keep is None:
        return s
    return Stream(
        s.keys[keep],
        s.owner[keep],
        s.local[keep],
        s.counted[keep],
        s.token[keep],
        s.key_bytes,
        s.members,
        s.tokens_used,
        s.phases,
    )


def _pins_of(pinned: np.ndarray, i: int, planner: FleetPlanner) -> list[tuple[int, int]]:
    """(block number, expert) of the pinned keys in member i's model."""
    s, m = planner.stream, planner.members[i]
    mine = s.owner == i
    local_keys = planner.stream.members[i].keys[s.local[mine]]
    global_keys = s.keys[mine]
    if not len(global_keys):
        return []
    offset = int(global_keys[0] - local_keys[0])
    ids = m.trace.geometry.layer_ids or tuple(range(m.trace.moe_layers))
    mine_pinned = [int(k) - offset for k in pinned if 0 <= int(k) - offset < m.n_keys]
    return [(ids[k // m.trace.n_experts], k % m.trace.n_experts) for k in mine_pinned]


def describe(plan: FleetPlan) -> list[str]:
    lines = [f"{plan.describe_box()}; all experts {format_size(plan.all_experts_bytes)}"]
    target = f" for {plan.target_tok_s:g} tok/s" if plan.target_tok_s is not None else ""
    lines.append(
        f"recommended{target}: RAM budget {format_size(plan.ram_budget_bytes)} + pin budget "
        f"{format_size(plan.pin_budget_bytes)}: {plan.tok_s:.1f} tok/s for the box, hit "
        f"{100 * plan.hit_rate:.1f}% (unpinned {100 * plan.unpinned_hit_rate:.1f}%, with the floors "
        f"{100 * plan.floors_hit_rate:.1f}%, static split {100 * plan.static_hit_rate:.1f}%)"
    )
    for m in plan.per_model:
        lines.append(
            f"  {m['name']} @{m['rate']:g}: floor {format_size(m['floor_bytes'])}, hit "
            f"{100 * m['hit_rate']:.1f}% (static split {100 * m['static_hit_rate']:.1f}%), "
            f"{len(m['pins'])} pinned"
        )
    lines += [f"  {c}" for c in plan.commands]
    return lines + [f"note: {n}" for n in plan.notes]
