"""Sizing: which RAM budget and pin budget give a target decode rate on this box.

Inputs: the model's catalog (bytes per expert and per RAM-tier slot, per layer;
the dense bytes the engine keeps resident), a routing trace replayed through a
cache policy (`moed.lab.policies`, the same access and counting rules, so every
hit rate here equals `policies.replay` at the same slots), the drive's rate
(given, or measured with `moed.lab.drivebench.raw_reads` on the model file),
the machine's memory, and the compute time per token.

The rate model is the serial one (reads after compute, no overlap, as on the
reference page's drive ceilings): a counted decode token reads its policy
misses, `bytes_per_token`, and

    io_ms  = bytes_per_token / (drive_gbps * 1e9) * 1e3
    tok_s  = 1000 / (compute_ms + io_ms)

so prefetch that hides reads behind compute can only do better (measure that
with `moectl replay`). The RAM the plan may use is `ram - dense - reserve`.

The recommendation is the smallest budget (in slots, found by bisection: LRU is
a stack algorithm, so its hit rate only grows with slots) whose predicted rate
reaches the target; without a target, the largest budget that fits. The pin
budget then splits that many slots into a pinned partition holding the most
used experts of the trace (the hotness profile) and an LRU over the rest, at the
split that hits most (pinning none is a candidate, and ties go to fewer pins).
The profile comes from the same trace it is scored on, so the pin gain is an
upper estimate.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from moed.badinput import BadInput
from moed.lab import policies
from moed.lab.policies import Accesses
from moed.protocol.sizes import format_size

DEFAULT_SIZES = tuple(round(0.05 * i, 2) for i in range(21))
PIN_SHARES = (0.0, 0.05, 0.1, 0.25, 0.5)


@dataclass(frozen=True)
class ModelCost:
    """What the catalog says a model costs, per MoE layer (dense index order)."""

    layers: int
    n_experts: int
    read_bytes: np.ndarray  # bytes read from the drive per expert, per layer
    slot_bytes: np.ndarray  # bytes of RAM tier per expert, per layer (parts page-rounded)
    dense_bytes: int  # file bytes that are not routed experts

    @classmethod
    def of(cls, model_path: str | os.PathLike) -> ModelCost:
        from moed.gguf.budget import slot_bytes
        from moed.gguf.catalog import Catalog

        cat = Catalog.open(model_path)
        entries = [cat.layers[l] for l in cat.moe_layers]
        read = np.array([e.expert_bytes for e in entries], dtype=np.float64)
        slot = np.array([slot_bytes(e) for e in entries], dtype=np.float64)
        file_bytes = sum(os.path.getsize(f) for f in cat.files)
        return cls(len(entries), cat.n_experts, read, slot, max(0, file_bytes - cat.expert_bytes_total))

    @property
    def mean_slot_bytes(self) -> float:
        return float(self.slot_bytes.mean())

    @property
    def all_slots(self) -> int:
        return self.layers * self.n_experts


@dataclass
class Point:
    size: float
    slots: int
    budget_bytes: int
    hit_rate: float
    reads_per_token: float
    mb_per_token: float
    io_ms: float
    tok_s: float
    drive_ceiling_tok_s: float

    def to_json(self) -> dict[str, Any]:
        return {k: _finite(v) for k, v in asdict(self).items()}


def _finite(v: Any) -> Any:
    """Plain JSON: an unbounded rate (nothing to read, no compute) becomes null."""
    return None if isinstance(v, float) and not np.isfinite(v) else v


@dataclass
class Sizing:
    """What a plan sizes against, for one model (`ModelPlan`) or a fleet (`fleetplan.FleetPlan`):
    the drive's rate (given, or measured on a model file), the compute time per token,
    the machine's RAM and what of it is spoken for, every expert's bytes, the target."""

    drive_gbps: float
    drive_measured: bool
    compute_ms: float
    ram_bytes: int
    dense_bytes: int
    reserve_bytes: int
    usable_bytes: int  # what the RAM and pin budgets together may take: ram - dense - reserve
    all_experts_bytes: int
    target_tok_s: float | None

    @classmethod
    def of(
        cls,
        drive: tuple[float, bool],
        compute_ms: float,
        ram_bytes: int | None,
        reserve_bytes: int | None,
        dense_bytes: int,
        all_experts_bytes: int,
        target_tok_s: float | None,
    ) -> Sizing:
        """The sizing, with this machine's RAM when none is given and a default reserve."""
        if ram_bytes is None:
            import psutil

            ram_bytes = int(psutil.virtual_memory().total)
        if reserve_bytes is None:  # the OS, the engine's own buffers, the page cache
            reserve_bytes = max(1 << 30, ram_bytes // 10)
        usable = max(0, ram_bytes - dense_bytes - reserve_bytes)
        gbps, measured = drive
        return cls(
            gbps, measured, compute_ms, ram_bytes, dense_bytes, reserve_bytes, usable, all_experts_bytes, target_tok_s
        )

    def describe_box(self) -> str:
        """The drive, the compute time and the RAM, as a plan's description opens."""
        return (
            f"drive {self.drive_gbps:.2f} GB/s{' (measured)' if self.drive_measured else ''}, compute "
            f"{self.compute_ms:g} ms/token, RAM {format_size(self.ram_bytes)} (dense "
            f"{format_size(self.dense_bytes)}, reserve {format_size(self.reserve_bytes)}, usable "
            f"{format_size(self.usable_bytes)})"
        )


def drive_rate(drive_gbps: float | None, model_path, measure_s: float) -> tuple[float, bool]:
    """The drive's rate in GB/s, and whether it was measured: when none is given, 1 MiB
    random reads 8 deep on the model file for `measure_s`."""
    if drive_gbps is not None:
        return drive_gbps, False
    from moed.lab.drivebench import raw_reads

    return raw_reads(os.fspath(model_path), 1 << 20, 8, measure_s).gbps, True


@dataclass
class ModelPlan(Sizing):
    policy: str
    curve: list[Point]
    recommended: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["curve"] = [p.to_json() for p in self.curve]
        d["recommended"] = {k: _finite(v) for k, v in self.recommended.items()}
        return d


class Planner:
    """One trace, one model, one drive rate: hit rates and predicted rates at any slot count."""

    def __init__(
        self,
        cost: ModelCost,
        trace,
        policy: str = "g-lru",
        warm: int = 0,
        drive_gbps: float = 3.0,
        compute_ms: float = 0.0,
    ):
        if policy not in policies.SHARED:
            raise BadInput(f"plan needs a shared-budget policy ({', '.join(policies.SHARED)}), not {policy!r}")
        if trace.moe_layers != cost.layers or trace.n_experts > cost.n_experts:
            raise BadInput(
                f"trace geometry ({trace.moe_layers} MoE layers, {trace.n_experts} experts) does "
                f"not match the model ({cost.layers} MoE layers, {cost.n_experts} experts)"
            )
        if drive_gbps <= 0 or compute_ms < 0:
            raise BadInput("--drive-gbps must be > 0 and --compute-ms >= 0")
        self.cost, self.policy = cost, policy
        self.drive_gbps, self.compute_ms = drive_gbps, compute_ms
        if trace.n_experts != cost.n_experts:  # an importer only saw the ids that were used
            trace = trace.with_geometry(n_experts=cost.n_experts)
        self.acc = policies.accesses(trace, warm)
        if self.acc.n_counted_tokens == 0:
            raise BadInput("the trace has no counted decode tokens (after --warm)")
        self._bytes = cost.read_bytes[self.acc.layer]  # bytes per access if missed
        self._cache: dict[tuple[int, int], np.ndarray] = {}

    def _hits(self, slots: int, pins: int = 0) -> np.ndarray:
        """Bool per access: a hit with `pins` pinned hottest experts and an LRU of the rest."""
        key = (slots, pins)
        if key not in self._cache:
            acc = self.acc
            if pins <= 0:
                hit = policies.hit_mask(self.policy, acc, slots)
            else:
                pinned = np.isin(acc.keys, self.hottest(pins))
                rest = ~pinned
                sub = Accesses(
                    acc.keys[rest],
                    acc.token[rest],
                    acc.counted[rest],
                    acc.moe_layers,
                    acc.n_experts,
                    acc.n_counted_tokens,
                )
                hit = pinned.copy()
                hit[rest] = policies.hit_mask(self.policy, sub, max(0, slots - pins))
            self._cache[key] = hit
        return self._cache[key]

    def hottest(self, n: int) -> np.ndarray:
        """The n most used experts of the trace (every access), ties to the lower key."""
        keys, counts = np.unique(self.acc.keys, return_counts=True)
        order = np.lexsort((keys, -counts))
        return keys[order[:n]]

    def point(self, slots: int, pins: int = 0, size: float | None = None) -> Point:
        slots = int(min(max(slots, 0), self.cost.all_slots))
        hit = self._hits(slots, pins)
        counted = self.acc.counted
        n_tok = self.acc.n_counted_tokens
        miss = counted & ~hit
        bytes_per_token = float(self._bytes[miss].sum()) / n_tok
        io_ms = bytes_per_token / (self.drive_gbps * 1e9) * 1e3
        total = self.compute_ms + io_ms
        return Point(
            size if size is not None else slots / self.cost.all_slots,
            slots,
            self.budget_bytes(slots),
            float((hit & counted).sum()) / max(1, self.acc.n_counted),
            float(miss.sum()) / n_tok,
            bytes_per_token / 1e6,
            io_ms,
            1e3 / total if total > 0 else float("inf"),
            1e3 / io_ms if io_ms > 0 else float("inf"),
        )

    def budget_bytes(self, slots: int) -> int:
        return int(round(slots * self.cost.mean_slot_bytes))

    def slots_for_bytes(self, budget_bytes: int) -> int:
        return int(min(self.cost.all_slots, budget_bytes // self.cost.mean_slot_bytes))

    def curve(self, sizes=DEFAULT_SIZES) -> list[Point]:
        return [self.point(round(s * self.cost.all_slots), size=s) for s in sizes]

    def smallest_for(self, target_tok_s: float, max_slots: int) -> int | None:
        """Fewest slots (<= max_slots) whose predicted rate reaches the target, or None."""
        if self.point(max_slots).tok_s < target_tok_s:
            return None
        lo, hi = 0, max_slots  # invariant: hi reaches the target
        while lo < hi:
            mid = (lo + hi) // 2
            if self.point(mid).tok_s >= target_tok_s:
                hi = mid
            else:
                lo = mid + 1
        return hi

    def best_pins(self, slots: int) -> int:
        """The pinned share of `slots` that hits most (ties: fewer pins)."""
        best, best_hits = 0, -1
        for share in PIN_SHARES:
            pins = int(share * slots)
            hits = int((self._hits(slots, pins) & self.acc.counted).sum())
            if hits > best_hits:
                best, best_hits = pins, hits
        return best


def make_plan(
    model_path,
    trace,
    *,
    target_tok_s: float | None = None,
    drive_gbps: float | None = None,
    ram_bytes: int | None = None,
    reserve_bytes: int | None = None,
    compute_ms: float = 0.0,
    policy: str = "g-lru",
    warm: int = 0,
    measure_s: float = 3.0,
    sizes=DEFAULT_SIZES,
    trace_path: str | None = None,
) -> ModelPlan:
    cost = ModelCost.of(model_path)
    drive = drive_rate(drive_gbps, model_path, measure_s)
    planner = Planner(cost, trace, policy, warm, drive[0], compute_ms)
    box = Sizing.of(
        drive,
        compute_ms,
        ram_bytes,
        reserve_bytes,
        cost.dense_bytes,
        planner.budget_bytes(cost.all_slots),
        target_tok_s,
    )
    usable = box.usable_bytes
    curve = planner.curve(sizes)
    max_slots = planner.slots_for_bytes(usable)
    notes = []
    if target_tok_s is not None:
        slots = planner.smallest_for(target_tok_s, max_slots)
        if slots is None:
            slots = max_slots
            full = planner.point(cost.all_slots)
            notes.append(
                f"{target_tok_s:g} tok/s is out of reach with {format_size(usable)} for experts "
                f"(best {planner.point(max_slots).tok_s:.1f} tok/s; every expert in RAM: "
                f"{full.tok_s:.1f} tok/s with {format_size(planner.budget_bytes(cost.all_slots))})"
            )
    else:
        slots = max_slots
    pins = planner.best_pins(slots) if slots else 0
    final = planner.point(slots, pins)
    rec = {
        "slots": slots,
        "pin_slots": pins,
        "ram_budget_bytes": planner.budget_bytes(slots - pins),
        "pin_budget_bytes": planner.budget_bytes(pins),
        "total_bytes": planner.budget_bytes(slots),
        "share_of_experts": slots / cost.all_slots,
        "hit_rate": final.hit_rate,
        "mb_per_token": final.mb_per_token,
        "tok_s": final.tok_s,
        "unpinned_hit_rate": planner.point(slots).hit_rate,
        "meets_target": target_tok_s is None or final.tok_s >= target_tok_s,
        "fits_ram": planner.budget_bytes(slots) <= usable,
        "command": f"moed --ram-budget {planner.budget_bytes(slots - pins)}"
        + (f" --pin-budget {planner.budget_bytes(pins)}" if pins else ""),
        # the operator's pin verb ranks a trace's experts by routing count, as `hottest` does
        "pin_command": (f"moectl pin {os.fspath(model_path)} --trace {trace_path or 'TRACE'}" if pins else ""),
    }
    if box.drive_measured:
        notes.append(f"drive rate measured on the model file: {box.drive_gbps:.2f} GB/s (1 MiB random reads, 8 deep)")
    if pins:
        notes.append("pins are the trace's most used experts, scored on the same trace: an upper estimate")
    return ModelPlan(**asdict(box), policy=policy, curve=curve, recommended=rec, notes=notes)


def describe(plan: ModelPlan, bars: bool = False) -> list[str]:
    """Human lines: the curve as a table (with bars when asked), then the recommendation."""
    width = 40
    top = max((p.tok_s for p in plan.curve if np.isfinite(p.tok_s)), default=1.0) or 1.0
    lines = [
        f"{plan.describe_box()}, policy {plan.policy}",
        f"{'budget':>11} {'share':>6} {'hit %':>6} {'MB/tok':>8} {'tok/s':>8}",
    ]
    for p in plan.curve:
        bar = ("  " + "#" * int(round(width * min(p.tok_s, top) / top))) if bars else ""
        mark = " *" if p.budget_bytes > plan.usable_bytes else ""
        lines.append(
            f"{format_size(p.budget_bytes):>11} {100 * p.size:5.0f}% {100 * p.hit_rate:6.1f} "
            f"{p.mb_per_token:8.2f} {p.tok_s:8.1f}{bar}{mark}"
        )
    if any(p.budget_bytes > plan.usable_bytes for p in plan.curve):
        lines.append("  * does not fit in this machine's usable RAM")
    r = plan.recommended
    target = f" for {plan.target_tok_s:g} tok/s" if plan.target_tok_s is not None else ""
    lines.append(
        f"recommended{target}: RAM budget {format_size(r['ram_budget_bytes'])} + pin budget "
        f"{format_size(r['pin_budget_bytes'])} ({100 * r['share_of_experts']:.0f}% of experts): "
        f"{r['tok_s']:.1f} tok/s predicted, hit {100 * r['hit_rate']:.1f}%"
    )
    lines.append(f"  {r['command']}")
    if r["pin_command"]:
        lines.append(f"  {r['pin_command']}")
    return lines + [f"note: {n}" for n in plan.notes]


def plot(plan: ModelPlan, path: str) -> None:
    """The predicted rate across budgets, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = [p.budget_bytes / (1 << 30) for p in plan.curve]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(gib, [p.tok_s for p in plan.curve], marker="o", label=f"predicted ({plan.policy})")
    if plan.target_tok_s is not None:
        ax.axhline(plan.target_tok_s, color="tab:green", linestyle="--", label="target")
    ax.axvline(plan.usable_bytes / (1 << 30), color="tab:red", linestyle=":", label="usable RAM")
    ax.axvline(plan.recommended["total_bytes"] / (1 << 30), color="tab:orange", label="recommended")
    ax.set_xlabel("expert budget (GiB)")
    ax.set_ylabel("decode tok/s")
    ax.set_title(f"drive {plan.drive_gbps:.2f} GB/s, compute {plan.compute_ms:g} ms/token")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
