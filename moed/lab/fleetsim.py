"""Fleet replay: several engines' traces on one shared budget, against a static split and floors.

moed's budget is one LRU shared by every model and tenant on the box. This
module measures what that is worth: it interleaves several routing traces (one
per engine, each at its own rate) into one access stream and replays it three
ways over the same memory:

    shared   one cache over the whole budget (the daemon without quotas);
    static   each engine its own cache, the budget split in proportion to its
             model's size (all of its experts' bytes, or slots);
    floors   the shared cache with a reserved floor per engine (tenant), as the
             daemon's quotas keep them (below).

What it owns: the interleaving (`interleave`), the budget arithmetic of a fleet
(`Member.all_size`, `static_split`), the three replays and their per-model and
aggregate hit rates (`replay_fleet`, `FleetReport`).

Units. With a MODEL, a member's slots are that model's real RAM-tier bytes per
expert (`moed.gguf.budget.slot_bytes`: every part page-rounded), per layer, so a
model with mixed quantisations has several size classes; budgets and floors are
bytes. Without a MODEL every expert is one slot, and budgets are slot counts.
A fleet is all one or all the other.

The interleaving, exactly. Engine i runs its tokens back to back at RATE r_i
(relative tokens per unit time): token j spans [(j + phase_i) / r_i,
(j + 1 + phase_i) / r_i), and its accesses (the rules of `moed.lab.policies`:
distinct (layer, expert) per token, layer by layer) are spread evenly over that
span. The fleet's stream is every access in time order, ties to the engine
listed first. Phases are drawn uniformly from [0, 1) by `seed` (or given), so
the order is deterministic. The fleet runs while every engine is still
running: a token belongs to the replay iff it starts before the first engine
runs out of trace, so every engine keeps its rate throughout. Engines that
open the same model file (same file identity, as the daemon keys models)
share its experts' slots; otherwise every engine's keys are its own.

Counting is that of `moed.lab.policies` per engine: hits count on decode tokens
after each engine's first `warm` decode tokens; every access updates the
cache. A model's hit rate is its hits over its counted accesses; the aggregate
is all hits over all counted accesses (so a faster engine weighs more, as on
the box). Invariants: a one-engine fleet's shared and static replays are
`policies.replay(trace, policy, slots=budget)` exactly (unit slots); two
copies of one trace in lockstep (equal rates and phases) with budget 2B hit
exactly as one copy with B (g-lru: every stack distance doubles plus one).

Floors are those of `moed.cache.store.Store` with quotas set (`set_quota`,
`moed.cache.room.RoomSearch.quota_victims`): the floor rule is the store's own (`moed.cache.quota.keeps_floor`),
and the walk is the store's, over one LRU order per group (see Speed, below):
  * every resident slot is charged to the engine whose access loaded it (a
    hit by another engine does not move the charge);
  * a miss needing b with free room >= b takes it; otherwise the walk goes
    over every resident slot in LRU order and takes slot s (owner q) when q is
    the requester, or q has no floor, or q's bytes minus what the walk already
    took from q minus s's bytes stay >= q's floor; it stops once enough is
    free. A slot skipped once stays skipped (what is taken only grows);
  * if the walk cannot free enough, the daemon changes nothing and the acquire
    waits (and would time out): the replay counts a miss, caches nothing and
    counts it in `refused`;
  * an access larger than the whole budget is refused the same way (the
    store's ValueError); floors must add up to at most the budget (the
    daemon's config rule). Ceilings are not modelled (no CLI gives them).
With all floors zero the floors replay is the shared g-lru replay exactly.

Speed: the shared and static replays are `moed.lab.policies`' loops (unit
slots) or the daemon's LRU class counting bytes; the floors replay keeps one LRU
order per (engine, slot size), so finding a victim looks at a handful of
group heads, never at the protected slots (bench/fleet_shared_vs_static.py
prints the rates).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moed.badinput import BadInput
from moed.cache.eviction import LRU
from moed.cache.quota import keeps_floor
from moed.lab import policies
from moed.lab.policies import Accesses
from moed.protocol.sizes import parse_size
from moed.traces import Trace

MODES = ("shared", "static", "floors")
PLOT_FRACTIONS = tuple(round(0.05 * i, 2) for i in range(1, 21))


# ---- members ----------------------------------------------------------------


@dataclass(frozen=True)
class Member:
    """One engine of the fleet: its trace, rate and (optionally) its model's slot bytes.

    `slot_bytes[l]` is one expert's RAM-tier bytes in MoE layer l (None: one slot
    each); `model_key` is the model file's identity (engines with equal keys share
    slots), None for a member of its own.
    """

    name: str
    trace: Trace
    rate: float = 1.0
    slot_bytes: tuple[int, ...] | None = None
    model_key: Any = None
    model_path: str | None = None

    def __post_init__(self) -> None:
        if not (self.rate > 0 and np.isfinite(self.rate)):
            raise BadInput(f"{self.name}: a rate must be a positive number, not {self.rate}")
        if self.slot_bytes is not None and len(self.slot_bytes) != self.trace.moe_layers:
            raise BadInput(
                f"{self.name}: {len(self.slot_bytes)} layers of slot bytes for a "
                f"trace of {self.trace.moe_layers} MoE layers"
            )

    @property
    def n_keys(self) -> int:
        return self.trace.moe_layers * self.trace.n_experts

    @property
    def key_bytes(self) -> np.ndarray:
        """Bytes (or 1 slot) of every key of this member's model, layer-major."""
        per_layer = (
            np.ones(self.trace.moe_layers, np.int64)
            if self.slot_bytes is None
            else np.asarray(self.slot_bytes, np.int64)
        )
        return np.repeat(per_layer, self.trace.n_experts)

    @property
    def all_size(self) -> int:
        """Bytes (or slots) of every routed expert of the model: its share of a static split."""
        return int(self.key_bytes.sum())


def parse_spec(spec: str) -> tuple[str, str | None, float]:
    """`TRACE[:MODEL.gguf][@RATE]` -> (trace, model or None, rate)."""
    rate = 1.0
    body, at, tail = spec.rpartition("@")
    if at:
        try:
            rate = float(tail)
        except ValueError:
            raise BadInput(f"{spec!r}: the rate after @ must be a number (e.g. trace.jsonl@0.25)") from None
        spec = body
    trace, colon, model = spec.rpartition(":")
    if colon and model.lower().endswith(".gguf") and trace:
        return trace, model, rate
    return spec, None, rate


def load_member(spec: str, name: str | None = None) -> Member:
    """A member from `TRACE[:MODEL.gguf][@RATE]`: the trace, and the model's slot bytes if given."""
    trace_path, model_path, rate = parse_spec(spec)
    trace = Trace.load(trace_path)
    label = name or os.path.basename(trace_path).split(".")[0]
    if model_path is None:
        return Member(label, trace, rate)
    from moed.gguf.budget import slot_bytes
    from moed.gguf.catalog import Catalog

    cat = Catalog.open(model_path)
    if trace.moe_layers != len(cat.moe_layers) or trace.n_experts > cat.n_experts:
        raise BadInput(
            f"{trace_path}: trace geometry ({trace.moe_layers} MoE layers, {trace.n_experts} "
            f"experts) does not match {model_path} ({len(cat.moe_layers)} MoE layers, "
            f"{cat.n_experts} experts)"
        )
    if trace.n_experts != cat.n_experts:  # an importer only saw the ids that were used
        trace = trace.with_geometry(n_experts=cat.n_experts)
    per_layer = tuple(slot_bytes(cat.layers[l]) for l in cat.moe_layers)
    return Member(label, trace, rate, per_layer, cat.identity, model_path)


def unique_names(members: Sequence[Member]) -> list[Member]:
    """Members renamed `name#2`, `name#3` where names repeat (two engines on one trace)."""
    seen: dict[str, int] = {}
    out = []
    for m in members:
        seen[m.name] = seen.get(m.name, 0) + 1
        n = seen[m.name]
        out.append(m if n == 1 else Member(f"{m.name}#{n}", m.trace, m.rate, m.slot_bytes, m.model_key, m.model_path))
    return out


def unit_of(members: Sequence[Member]) -> str:
    """'bytes' when every member has a model, 'slots' when none has; a mix is an error."""
    with_model = [m.slot_bytes is not None for m in members]
    if not members:
        raise BadInput("a fleet needs at least one trace")
    if all(with_model):
        return "bytes"
    if not any(with_model):
        return "slots"
    raise BadInput("give a MODEL for every trace or for none (slots in bytes and in experts do not mix)")


# ---- budgets ------------------------------------------------------------------


def parse_amount(spec: str, unit: str, whole: int, mean_slot: float = 1.0, what: str = "--budget") -> int:
    """A budget or floor: `P%` of `whole`, `N` or `Nslots` slots, or a size with a unit.

    A plain number is a slot count (a size needs its unit: 512MiB, 4GiB, 1000B).
    A slot of a byte fleet is `mean_slot` bytes (the mean over all its experts,
    as `moectl plan` converts).
    """
    text = str(spec).strip().lower()
    try:
        if text.endswith("%"):
            frac = float(text[:-1]) / 100
            if not 0 <= frac <= 1:
                raise BadInput(f"{what}: a share must be in [0%, 100%], not {spec}")
            return int(round(frac * whole))
        count = text[:-5].strip() if text.endswith("slots") else text
        if count.isdigit():
            return int(count) if unit == "slots" else int(round(int(count) * mean_slot))
        if unit == "slots":
            raise BadInput(f"{what} {spec}: a size needs a MODEL for every trace; give slots or a share (25%)")
        return parse_size(spec)
    except ValueError:
        raise BadInput(f"{what}: not a size, slot count or share: {spec!r}") from None


def static_split(members: Sequence[Member], budget: int) -> list[int]:
    """Each member's share of `budget` in proportion to its model's size (rounded down)."""
    sizes = [m.all_size for m in members]
    total = sum(sizes)
    return [budget * s // total for s in sizes]


# ---- the interleaved stream ---------------------------------------------------


@dataclass(frozen=True)
class Stream:
    """The fleet's accesses in time order.

    `keys` are global (member model offsets added), `owner[i]` the member index,
    `local[i]` the access's index in its member's own stream, `token` the fleet's
    token index (tokens of all engines in start order: the decay clock of g-lfu
    and g-hot). `key_bytes[k]` is key k's bytes (1 for a slot fleet).
    """

    keys: np.ndarray
    owner: np.ndarray
    local: np.ndarray
    counted: np.ndarray
    token: np.ndarray
    key_bytes: np.ndarray
    members: tuple[Accesses, ...]  # each member's own stream, cut to the fleet's window
    tokens_used: tuple[int, ...]
    phases: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.keys)


def phases_for(n: int, seed: int) -> tuple[float, ...]:
    return tuple(float(x) for x in np.random.default_rng(seed).random(n))


def interleave(
    members: Sequence[Member], warm: int = 0, seed: int = 0, phases: Sequence[float] | None = None
) -> Stream:
    """The fleet's access stream (see the module docstring for the rules)."""
    phases = tuple(phases) if phases is not None else phases_for(len(members), seed)
    if len(phases) != len(members) or any(not 0 <= p < 1 for p in phases):
        raise BadInput("one phase in [0, 1) per member")
    horizon = min((m.trace.n_tokens + p) / m.rate for m, p in zip(members, phases))
    offsets, key_bytes = _key_space(members)
    parts: list[tuple[np.ndarray, ...]] = []
    cut: list[Accesses] = []
    used: list[int] = []
    for i, (m, p) in enumerate(zip(members, phases)):
        acc = policies.accesses(m.trace, warm)
        starts = (np.arange(m.trace.n_tokens) + p) / m.rate
        n_tok = int(np.count_nonzero(starts < horizon))
        acc = _cut(acc, n_tok)
        cut.append(acc)
        used.append(n_tok)
        parts.append((_times(acc, p, m.rate), np.full(acc.n, i), acc.keys + offsets[i], acc.counted, starts[acc.token]))
    times, owner, keys, counted, token_start = (np.concatenate(x) for x in zip(*parts))
    order = np.lexsort((owner, times))
    local = np.concatenate([np.arange(a.n) for a in cut])
    token = _fleet_tokens(token_start, owner, [a.token for a in cut])
    return Stream(
        keys[order],
        owner[order],
        local[order],
        counted[order],
        token[order],
        key_bytes,
        tuple(cut),
        tuple(used),
        phases,
    )


def _key_space(members: Sequence[Member]) -> tuple[list[int], np.ndarray]:
    """Key offset per member (one block per distinct model) and bytes of every global key."""
    blocks: dict[Any, int] = {}
    offsets, chunks, top = [], [], 0
    for i, m in enumerate(members):
        ident = m.model_key if m.model_key is not None else ("member", i)
        if ident not in blocks:
            blocks[ident] = top
            chunks.append(m.key_bytes)
            top += m.n_keys
        offsets.append(blocks[ident])
    return offsets, np.concatenate(chunks)


def _cut(acc: Accesses, n_tok: int) -> Accesses:
    """The accesses of the first `n_tok` tokens (the stream is token-major)."""
    n = int(np.searchsorted(acc.token, n_tok))
    counted_tokens = len(np.unique(acc.token[:n][acc.counted[:n]]))
    return Accesses(acc.keys[:n], acc.token[:n], acc.counted[:n], acc.moe_layers, acc.n_experts, counted_tokens)


def _times(acc: Accesses, phase: float, rate: float) -> np.ndarray:
    """Each access's time: its token's span, split evenly among the token's accesses."""
    if acc.n == 0:
        return np.zeros(0)
    first = np.searchsorted(acc.token, acc.token, side="left")
    per_token = np.bincount(acc.token)[acc.token]
    pos = np.arange(acc.n) - first
    return (acc.token + phase + pos / per_token) / rate


def _fleet_tokens(token_start: np.ndarray, owner: np.ndarray, tokens: list[np.ndarray]) -> np.ndarray:
    """The fleet token index of every access: its token's rank among all tokens by start time."""
    ids = np.concatenate([t + (i << 32) for i, t in enumerate(tokens)]) if tokens else np.zeros(0, np.int64)
    uniq, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    rank_order = np.lexsort((owner[first], token_start[first]))
    rank = np.empty(len(uniq), np.int64)
    rank[rank_order] = np.arange(len(uniq))
    return rank[inverse]


# ---- the replays ----------------------------------------------------------------


def _byte_lru(keys: list[int], key_bytes: list[int], budget: int) -> tuple[bytearray, int]:
    """The daemon's LRU (moed.cache.eviction.LRU) over a byte budget, as the store's
    `_reserve` drives it: evict the victim until the miss fits. Returns (hit mask,
    refused: accesses larger than the whole budget)."""
    hit = bytearray(len(keys))
    lru = LRU()
    add, remove, victim = lru.add, lru.remove, lru.victim
    used = refused = 0
    for i, k in enumerate(keys):
        if k in lru:
            remove(k)
            add(k)
            hit[i] = 1
            continue
        b = key_bytes[k]
        if b > budget:
            refused += 1
            continue
        used += b
        while used > budget:
            v = victim()
            remove(v)
            used -= key_bytes[v]
        add(k)
    return hit, refused


class _QuotaLRU:
    """The store's LRU with tenant floors (see the module docstring), one access at a time.

    One OrderedDict (key -> last use) per (owner, slot bytes) group: a group's
    entries are in LRU order and share the floor check, so the store's walk over
    the global LRU order is "the oldest head among the groups still eligible".
    """

    def __init__(self, floors: Sequence[int], sizes: Sequence[int], budget: int):
        self.floors, self.budget = list(floors), budget
        self.sizes = sorted(set(sizes))
        n_sizes = len(self.sizes)
        self.groups: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(len(floors) * n_sizes)]
        self.g_owner = [g // n_sizes for g in range(len(self.groups))]
        self.g_bytes = [self.sizes[g % n_sizes] for g in range(len(self.groups))]
        self.size_index = {b: j for j, b in enumerate(self.sizes)}
        self.owned = [0] * len(floors)
        self.where: dict[int, int] = {}
        self.used = 0
        self.refused = 0

    def access(self, i: int, k: int, o: int, b: int) -> bool:
        g = self.where.get(k)
        if g is not None:
            od = self.groups[g]
            od.move_to_end(k)
            od[k] = i
            return True
        if b > self.budget:
            self.refused += 1
            return False
        short = b - (self.budget - self.used)
        if short > 0 and not self._make_room(o, short):
            self.refused += 1
            return False
        g = o * len(self.sizes) + self.size_index[b]
        self.groups[g][k] = i
        self.where[k] = g
        self.used += b
        self.owned[o] += b
        return False

    def _make_room(self, o: int, short: int) -> bool:
        victims = self._victims(o, short)
        if victims is None:
            return False
        for g in victims:
            k, _ = self.groups[g].popitem(False)
            del self.where[k]
            b, q = self.g_bytes[g], self.g_owner[g]
            self.used -= b
            self.owned[q] -= b
        return True

    def _victims(self, o: int, short: int) -> list[int] | None:
        """Groups to evict the head of, in order (the store's `RoomSearch.quota_victims`), or None."""
        groups, floors, owned = self.groups, self.floors, self.owned
        iters = [iter(od.values()) for od in groups]
        heads = [next(it, None) for it in iters]
        taken = [0] * len(floors)
        victims: list[int] = []
        while short > 0:
            best, best_use = -1, -1
            for g, use in enumerate(heads):
                if use is None or (best >= 0 and use > best_use):
                    continue
                q, b = self.g_owner[g], self.g_bytes[g]
                if q != o and not keeps_floor(owned[q], taken[q], b, floors[q]):
                    heads[g] = None  # skipped once, skipped for good: taken only grows
                    continue
                best, best_use = g, use
            if best < 0:
                return None
            q, b = self.g_owner[best], self.g_bytes[best]
            victims.append(best)
            taken[q] += b
            short -= b
            heads[best] = next(iters[best], None)
        return victims


def _quota_lru(stream: Stream, budget: int, floors: Sequence[int]) -> tuple[np.ndarray, int]:
    q = _QuotaLRU(floors, np.unique(stream.key_bytes).tolist(), budget)
    kb = stream.key_bytes.tolist()
    access, where, groups = q.access, q.where, q.groups
    hit = bytearray(stream.n)
    for i, (k, o) in enumerate(zip(stream.keys.tolist(), stream.owner.tolist())):
        g = where.get(k)
        if g is not None:  # the hit path of `access`, inlined: most accesses take it
            od = groups[g]
            od.move_to_end(k)
            od[k] = i
            hit[i] = 1
        elif access(i, k, o, kb[k]):
            hit[i] = 1
    return np.frombuffer(hit, np.uint8).astype(bool), q.refused


def low_water(stream: Stream, budget: int, keep: np.ndarray | None = None) -> list[int]:
    """Each engine's fewest bytes held in the shared LRU (no floors) from its first counted
    access on; `keep` masks the accesses replayed (the rest are served elsewhere: pins)."""
    n = int(stream.owner.max(initial=0)) + 1
    q = _QuotaLRU([0] * n, np.unique(stream.key_bytes).tolist(), budget)
    kb = stream.key_bytes.tolist()
    low: list[int | None] = [None] * n
    mask = np.ones(stream.n, bool) if keep is None else keep
    for i, k, o, c in zip(
        np.flatnonzero(mask).tolist(),
        stream.keys[mask].tolist(),
        stream.owner[mask].tolist(),
        stream.counted[mask].tolist(),
    ):
        q.access(i, k, o, kb[k])
        if c and low[o] is None:
            low[o] = q.owned[o]
        for j, v in enumerate(low):
            if v is not None and q.owned[j] < v:
                low[j] = q.owned[j]
    return [v or 0 for v in low]


def _cache_hits(
    keys: np.ndarray, token: np.ndarray, counted: np.ndarray, key_bytes: np.ndarray, budget: int, policy: str
) -> tuple[np.ndarray, int]:
    """Hit mask (and refused count) of one cache of `budget` over an access list."""
    used = np.unique(key_bytes[keys]) if len(keys) else np.ones(1, np.int64)
    if len(used) == 1:  # one slot size: a slot LRU of budget // size slots
        acc = Accesses(keys, token, counted, 1, max(int(keys.max(initial=0)) + 1, 1), 0)
        return policies.hit_mask(policy, acc, int(budget // used[0])), 0
    if policy != "g-lru":
        raise BadInput(f"slots of several sizes replay with g-lru only, not {policy}")
    hit, refused = _byte_lru(keys.tolist(), key_bytes.tolist(), budget)
    return np.frombuffer(hit, np.uint8).astype(bool), refused


# ---- results ------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelResult:
    name: str
    hits: int
    accesses: int
    hit_rate: float
    budget: int | None = None  # static: its share; floors: its floor

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "hits": self.hits,
            "accesses": self.accesses,
            "hit_rate": self.hit_rate,
            **({} if self.budget is None else {"budget": self.budget}),
        }


@dataclass(frozen=True)
class Outcome:
    mode: str
    budget: int
    hits: int
    accesses: int
    hit_rate: float
    per_model: tuple[ModelResult, ...]
    refused: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "budget": self.budget,
            "hits": self.hits,
            "accesses": self.accesses,
            "hit_rate": self.hit_rate,
            "refused": self.refused,
            "per_model": [m.to_json() for m in self.per_model],
        }


def _outcome(
    mode: str,
    budget: int,
    names: Sequence[str],
    hits: Sequence[int],
    accesses: Sequence[int],
    shares: Sequence[int | None],
    refused: int = 0,
) -> Outcome:
    per = tuple(ModelResult(n, h, a, h / a if a else 0.0, s) for n, h, a, s in zip(names, hits, accesses, shares))
    total_h, total_a = sum(hits), sum(accesses)
    return Outcome(mode, budget, total_h, total_a, total_h / total_a if total_a else 0.0, per, refused)


def shared(stream: Stream, names: Sequence[str], budget: int, policy: str = "g-lru") -> Outcome:
    hit, refused = _cache_hits(stream.keys, stream.token, stream.counted, stream.key_bytes, budget, policy)
    return _by_owner("shared", stream, names, budget, hit, [None] * len(names), refused)


def floored(stream: Stream, names: Sequence[str], budget: int, floors: Sequence[int]) -> Outcome:
    check_floors(floors, budget, len(names))
    hit, refused = _quota_lru(stream, budget, floors)
    return _by_owner("floors", stream, names, budget, hit, list(floors), refused)


def static(stream: Stream, members: Sequence[Member], budget: int, policy: str = "g-lru") -> Outcome:
    shares = static_split(members, budget)
    hits, accesses, refused = [], [], 0
    for m, acc, share in zip(members, stream.members, shares):
        hit, r = _cache_hits(acc.keys, acc.token, acc.counted, m.key_bytes, share, policy)
        hits.append(int(np.count_nonzero(hit & acc.counted)))
        accesses.append(acc.n_counted)
        refused += r
    return _outcome("static", budget, [m.name for m in members], hits, accesses, shares, refused)


def _by_owner(
    mode: str,
    stream: Stream,
    names: Sequence[str],
    budget: int,
    hit: np.ndarray,
    shares: Sequence[int | None],
    refused: int,
) -> Outcome:
    n = len(names)
    hits = np.bincount(stream.owner[hit & stream.counted], minlength=n)
    accesses = np.bincount(stream.owner[stream.counted], minlength=n)
    return _outcome(mode, budget, names, hits.tolist(), accesses.tolist(), shares, refused)


def check_floors(floors: Sequence[int], budget: int, n: int) -> None:
    """The daemon's config rules: one floor per tenant, none negative, their sum within the budget."""
    if len(floors) != n:
        raise BadInput(f"--floors needs one floor per trace ({n}), not {len(floors)}")
    if any(f < 0 for f in floors):
        raise BadInput("floors must not be negative")
    if sum(floors) > budget:
        raise BadInput(f"floors add up to {sum(floors)}, more than the budget {budget}")


def check_policy(policy: str, unit: str, floors: bool) -> str:
    if policy not in policies.SHARED:
        raise BadInput(
            f"a fleet shares one budget: choose a shared policy ({', '.join(policies.SHARED)}), not {policy!r}"
        )
    if floors and policy != "g-lru":
        raise BadInput(f"floors replay as the daemon keeps them, over its LRU: --policy g-lru, not {policy}")
    return policy


# ---- the whole report ----------------------------------------------------------------


@dataclass
class FleetReport:
    unit: str
    budget: int
    all_size: int
    policy: str
    seed: int
    warm: int
    members: list[dict[str, Any]]
    shared: Outcome
    static: Outcome
    floors: Outcome | None = None
    curve: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "unit": self.unit,
            "budget": self.budget,
            "all_experts": self.all_size,
            "share_of_experts": self.budget / self.all_size if self.all_size else 0.0,
            "policy": self.policy,
            "seed": self.seed,
            "warm": self.warm,
            "members": self.members,
            "shared": self.shared.to_json(),
            "static": self.static.to_json(),
        }
        if self.floors is not None:
            d["floors"] = self.floors.to_json()
        if self.curve:
            d["curve"] = self.curve
        return d


def replay_fleet(
    members: Sequence[Member],
    budget: int,
    *,
    policy: str = "g-lru",
    floors: Sequence[int] | None = None,
    warm: int = 0,
    seed: int = 0,
    phases: Sequence[float] | None = None,
    curve: Sequence[float] = (),
) -> FleetReport:
    """Shared, static split and (with `floors`) floored replays of the fleet at `budget`.

    `curve`: fractions of all experts at which shared and static are also
    replayed (aggregate hit rates, for `--plot`).
    """
    members = unique_names(members)
    unit = unit_of(members)
    check_policy(policy, unit, floors is not None)
    if budget < 0:
        raise BadInput("the budget must not be negative")
    stream = interleave(members, warm, seed, phases)
    names = [m.name for m in members]
    total = all_size(members)
    rows = [
        {
            "name": m.name,
            "trace": m.trace.meta.get("source"),
            "model": m.model_path,
            "rate": m.rate,
            "phase": p,
            "tokens": n_tok,
            "counted_tokens": acc.n_counted_tokens,
            "all_experts": m.all_size,
        }
        for m, p, n_tok, acc in zip(members, stream.phases, stream.tokens_used, stream.members)
    ]
    points = []
    for frac in curve:
        b = int(round(frac * total))
        points.append(
            {
                "share": frac,
                "budget": b,
                "shared": shared(stream, names, b, policy).hit_rate,
                "static": static(stream, members, b, policy).hit_rate,
            }
        )
    return FleetReport(
        unit,
        budget,
        total,
        policy,
        seed,
        warm,
        rows,
        shared(stream, names, budget, policy),
        static(stream, members, budget, policy),
        None if floors is None else floored(stream, names, budget, floors),
        points,
    )


def all_size(members: Sequence[Member]) -> int:
    """Bytes (or slots) of every distinct model's experts: a model shared by engines counts once."""
    _, key_bytes = _key_space(members)
    return int(key_bytes.sum())


def mean_slot(members: Sequence[Member]) -> float:
    """Mean bytes (or 1 slot) of one expert over every distinct model of the fleet."""
    _, key_bytes = _key_space(members)
    return float(key_bytes.mean())
