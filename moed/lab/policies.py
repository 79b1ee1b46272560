"""Cache policy replay over routing traces: every classic policy and Belady's bound.

The rules, exactly (the same for every policy, and the numbers depend on them):

* An **access** is a distinct (layer, expert) of one token. A token's accesses
  come layer by layer (0..L-1), and within a layer in the router's order; an
  expert listed twice for one token in one layer is one access. Tokens come in
  trace order (a prompt step's tokens one after another).
* **Every** access updates the cache, prompt or decode, counted or not.
* A **hit** is an access whose expert is resident when it is accessed. Hits are
  counted on **decode tokens only**: prompt tokens warm the cache, and `warm=N`
  additionally treats the first N decode tokens as warm-up (for traces that have
  no prompt). `accesses` in a result is the number of counted accesses;
  `hit_rate = hits / accesses`.
* **Sizes**: `size=f` gives a per-layer policy round(f x n_experts) slots in every
  layer, and a shared policy round(f x n_experts x layers) slots. `slots=N` is a
  total: a shared policy gets N, a per-layer policy N // layers in each layer.
  `slots` in a result is always the total the policy held.
* Replays are deterministic: ties are broken by the rule each policy states,
  never by hashing or randomness, so a number is exactly reproducible.

Per-layer policies (one independent cache per layer, same capacity each):
  lru    least recently used.
  lfu    least frequently used; counts are per expert and survive eviction
         (perfect LFU); ties go to the oldest last use.
  slru   segmented LRU: new experts enter a probation segment (20% of the slots
         rounded down, at least 1); a hit there promotes to the protected segment (the rest),
         whose LRU end falls back to probation's MRU end; probation's LRU end is
         evicted.
  opt    Belady's MIN with bypass (below).
Shared policies (one budget over all layers):
  g-lru  least recently used.
  g-lfu  decaying LFU: an access adds 1 to the expert's score, and every score
         is halved every 64 tokens (at tokens 64, 128, ... of the trace); scores
         survive eviction; evict the lowest score, ties to the oldest last use.
  g-hot  llama.cpp's decaying route hotness: an access adds 1 to the expert's
         hotness, and all hotness decays continuously by 2^(-1/16) per token
         (half-life 16 tokens); evict the coldest, ties to the least recently used.
  g-arc  ARC (Megiddo & Modha 2003) with ghost lists B1, B2 and target p.
  g-lru2 LRU-2: evict the expert whose second-to-last use is oldest; experts
         used once so far go first, oldest last use first; history survives
         eviction.
  g-tlfu1, g-tlfu10  W-TinyLFU (as in Caffeine) with exact counts: an LRU window
         of 1% / 10% of the slots (at least 1) admits every new expert; one
         pushed out of the window enters the main segmented LRU (80% protected)
         only if its count is higher than main's victim's (probation's LRU end,
         or protected's when probation is empty). Counts are halved every
         10 x slots accesses.
  g-opt  Belady's MIN with bypass over the shared budget.

**opt / g-opt are true upper bounds.** On a miss with a full cache the incoming
expert is itself a candidate: whichever of the resident experts and the incoming
one is next *counted* use is furthest away is dropped (the incoming one is then
not inserted). An expert whose next access is not counted (a prompt or warm-up
token) or never comes has its next use at infinity: keeping it can win nothing,
and it can be reloaded for free at that uncounted access. With that rule the
replay is the greedy optimum of the interval-packing problem "keep at most C
reuse intervals open at once, maximise the counted ones", so no policy with the
same slots gets more counted hits. Ties at infinity drop the most recent access.

Speed: policies run as tight loops over Python ints from numpy arrays (lru and
g-lru on the daemon's own `moed.cache.eviction.LRU`, slru, g-arc and g-tlfu on OrderedDicts,
the heap policies on heapq with lazy deletion and periodic compaction); see
bench/lab_replay_speed.py for the measured rates.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from moed.badinput import BadInput
from moed.cache.eviction import LRU
from moed.traces import DECODE, Trace

PER_LAYER = ("lru", "lfu", "slru", "opt")
SHARED = ("g-lru", "g-lfu", "g-hot", "g-arc", "g-lru2", "g-tlfu1", "g-tlfu10", "g-opt")
POLICIES = PER_LAYER + SHARED
DEFAULT_SIZES = (0.25, 0.5, 0.75)
LFU_HALVE_EVERY_TOKENS = 64
HOT_HALF_LIFE_TOKENS = 16
SLRU_PROBATION = 0.2
TLFU_PROTECTED = 0.8
TLFU_RESET_PER_SLOT = 10


@dataclass(frozen=True)
class Accesses:
    """The access stream of a trace (see the module docstring for the rules).

    `keys[i] = layer * n_experts + expert`; `token[i]` is the token index in the
    trace; `counted[i]` says whether access i counts towards hits.
    """

    keys: np.ndarray
    token: np.ndarray
    counted: np.ndarray
    moe_layers: int
    n_experts: int
    n_counted_tokens: int

    @property
    def n(self) -> int:
        return len(self.keys)

    @property
    def layer(self) -> np.ndarray:
        return self.keys // self.n_experts

    @property
    def n_counted(self) -> int:
        return int(np.count_nonzero(self.counted))


def counted_tokens(trace: Trace, warm: int = 0) -> np.ndarray:
    """Bool per token: a decode token after the first `warm` decode tokens."""
    if warm < 0:
        raise BadInput(f"--warm must be >= 0, not {warm}")
    decode = trace.token_kinds == ord(DECODE)
    return decode & (np.cumsum(decode) > warm)


def accesses(trace: Trace, warm: int = 0) -> Accesses:
    """Flatten a trace into its access stream (token-major, then layer, then rank)."""
    ids = trace.ids.astype(np.int64)
    n_tok, n_layers, k = ids.shape
    keep = ids >= 0
    for j in range(1, k):  # drop an id already listed earlier in the same row
        keep[:, :, j] &= ~(ids[:, :, :j] == ids[:, :, j : j + 1]).any(axis=2)
    keys = (ids + (np.arange(n_layers, dtype=np.int64) * trace.n_experts)[None, :, None])[keep]
    token = np.broadcast_to(np.arange(n_tok, dtype=np.int64)[:, None, None], ids.shape)[keep]
    counted_tok = counted_tokens(trace, warm)
    return Accesses(keys, token, counted_tok[token], n_layers, trace.n_experts, int(counted_tok.sum()))


# ---- next use (Belady) ----------------------------------------------------------


def next_counted_use(keys: np.ndarray, counted: np.ndarray) -> np.ndarray:
    """For access i: the position of the next access to the same key when that
    access is counted, else `n + i` (infinity, and unique so ties are decided)."""
    n = len(keys)
    out = np.arange(n, 2 * n, dtype=np.int64)
    if n == 0:
        return out
    order = _stable_order(keys)
    same = keys[order[:-1]] == keys[order[1:]]
    src, dst = order[:-1][same], order[1:][same]
    useful = counted[dst]
    out[src[useful]] = dst[useful]
    return out


def _stable_order(keys: np.ndarray) -> np.ndarray:
    """argsort(keys, stable); keys below 2^16 (48 x 512 experts fit) take numpy's radix sort."""
    if len(keys) and keys.min() >= 0 and keys.max() < 1 << 16:
        keys = keys.astype(np.uint16)
    return np.argsort(keys, kind="stable")


# ---- the policies: each returns a bytearray hit mask over its access list -----


def _lru(keys: list[int], cap: int, **_: Any) -> bytearray:
    """The daemon's own LRU class, driven as the store drives it: a hit takes the
    expert out of the policy (acquired) and puts it back at the recent end
    (released); a miss with every slot full evicts the policy's victim."""
    hit = bytearray(len(keys))
    if cap <= 0:
        return hit
    lru = LRU()
    add, remove, victim = lru.add, lru.remove, lru.victim
    for i, k in enumerate(keys):
        if k in lru:
            remove(k)
            hit[i] = 1
        elif len(lru) >= cap:
            remove(victim())
        add(k)
    return hit


def _opt(keys: list[int], cap: int, nxt: list[int], **_: Any) -> bytearray:
    """Belady with bypass. The heap holds -next_use; `owner[v]` is the key whose
    next use is v (keys[v] for a real use, keys[v - n] for an infinite one)."""
    n = len(keys)
    hit = bytearray(n)
    if cap <= 0:
        return hit
    owner = keys + keys
    cache: dict[int, int] = {}  # key -> its next use
    heap: list[int] = []
    push, pop, replace = heapq.heappush, heapq.heappop, heapq.heapreplace
    limit = 2 * cap + 64
    stream = zip(range(n), keys, nxt)
    for i, k, v in stream:  # filling: every expert goes in
        if k in cache:
            hit[i] = 1
        cache[k] = v
        push(heap, -v)
        if len(cache) == cap:
            break
    for i, k, v in stream:  # full from now on: a miss evicts or bypasses
        if k in cache:
            hit[i] = 1
            cache[k] = v
            push(heap, -v)
            continue
        if len(heap) > limit:  # hits leave stale entries behind; drop them now and then
            heap = [-x for x in cache.values()]
            heapq.heapify(heap)
        top = -heap[0]
        victim = owner[top]
        while cache.get(victim) != top:  # stale: that key's next use has moved on
            pop(heap)
            top = -heap[0]
            victim = owner[top]
        if v > top:
            continue  # bypass: the incoming expert is needed last
        del cache[victim]
        cache[k] = v
        replace(heap, -v)
    return hit


def _slru(keys: list[int], cap: int, **_: Any) -> bytearray:
    hit = bytearray(len(keys))
    if cap <= 0:
        return hit
    prob_cap = max(1, int(cap * SLRU_PROBATION))
    prot_cap = cap - prob_cap
    prob: OrderedDict[int, None] = OrderedDict()
    prot: OrderedDict[int, None] = OrderedDict()
    for i, k in enumerate(keys):
        if k in prot:
            prot.move_to_end(k)
            hit[i] = 1
        elif k in prob:
            hit[i] = 1
            if prot_cap == 0:
                prob.move_to_end(k)
                continue
            del prob[k]
            prot[k] = None
            if len(prot) > prot_cap:  # protected's LRU end falls back to probation
                prob[prot.popitem(False)[0]] = None
        else:
            prob[k] = None
            if len(prob) > prob_cap:
                prob.popitem(False)
    return hit


class _ScoreHeap:
    """Evict-the-minimum cache over (a, b, key) entries with lazy deletion: the
    cache maps a key to its live entry, and a heap entry is live iff it is that
    very object (stale ones are skipped when they surface)."""

    def __init__(self, cap: int):
        self.cap = cap
        self.cache: dict[int, tuple] = {}
        self.heap: list[tuple] = []
        self.limit = 2 * cap + 64

    def touch(self, k: int, a: Any, b: int) -> bool:
        cache = self.cache
        was = k in cache
        if not was and len(cache) >= self.cap:
            heap, pop = self.heap, heapq.heappop
            entry = pop(heap)
            while cache.get(entry[2]) is not entry:
                entry = pop(heap)
            del cache[entry[2]]
        entry = (a, b, k)
        cache[k] = entry
        heapq.heappush(self.heap, entry)
        if len(self.heap) > self.limit:
            self.rebuild()
        return was

    def rebuild(self) -> None:
        self.heap = list(self.cache.values())
        heapq.heapify(self.heap)


def _lfu(keys: list[int], cap: int, **_: Any) -> bytearray:
    hit = bytearray(len(keys))
    if cap <= 0:
        return hit
    counts: dict[int, int] = {}
    c = _ScoreHeap(cap)
    for i, k in enumerate(keys):
        n = counts.get(k, 0) + 1
        counts[k] = n
        if c.touch(k, n, i):
            hit[i] = 1
    return hit


def _g_lfu(keys: list[int], cap: int, token: list[int], **_: Any) -> bytearray:
    """Halving every score every 64 tokens keeps their order, so scores are kept
    scaled up by 2^epoch instead: an access adds 2^(token // 64), exactly."""
    hit = bytearray(len(keys))
    if cap <= 0:
        return hit
    score: dict[int, int] = {}
    c = _ScoreHeap(cap)
    for i, k in enumerate(keys):
        s = score.get(k, 0) + (1 << (token[i] // LFU_HALVE_EVERY_TOKENS))
        score[k] = s
        if c.touch(k, s, i):
            hit[i] = 1
    return hit


def _g_hot(keys: list[int], cap: int, token: list[int], **_: Any) -> bytearray:
    """Continuous decay kept the same way: an access adds 2^(t / half-life) in a
    frame that is rescaled (all scores at once, order kept) every 1024 tokens."""
    hit = bytearray(len(keys))
    if cap <= 0:
        return hit
    hot: dict[int, float] = {}
    c = _ScoreHeap(cap)
    base = 0
    rescale_every = 1024
    for i, k in enumerate(keys):
        t = token[i]
        if t - base >= rescale_every:
            shift = (t - base) // rescale_every * rescale_every
            f = 2.0 ** (-shift / HOT_HALF_LIFE_TOKENS)
            base += shift
            hot = {key: v * f for key, v in hot.items()}
            c.cache = {key: (e[0] * f, e[1], key) for key, e in c.cache.items()}
            c.rebuild()
        h = hot.get(k, 0.0) + 2.0 ** ((t - base) / HOT_HALF_LIFE_TOKENS)
        hot[k] = h
        if c.touch(k, h, i):
            hit[i] = 1
    return hit


def _g_lru2(keys: list[int], cap: int, **_: Any) -> bytearray:
    hit = bytearray(len(keys))
    if cap <= 0:
        return hit
    last: dict[int, int] = {}
    c = _ScoreHeap(cap)
    for i, k in enumerate(keys):
        prev = last.get(k)
        last[k] = i
        # (0, last use) for one use so far: before every (1, second-to-last use)
        if c.touch(k, 0, i) if prev is None else c.touch(k, 1, prev):
            hit[i] = 1
    return hit


def _g_arc(keys: list[int], cap: int, **_: Any) -> bytearray:
    hit = bytearray(len(keys))
    if cap <= 0:
        return hit
    t1: OrderedDict[int, None] = OrderedDict()
    t2: OrderedDict[int, None] = OrderedDict()
    b1: OrderedDict[int, None] = OrderedDict()
    b2: OrderedDict[int, None] = OrderedDict()
    p = 0.0

    def replace(in_b2: bool) -> None:
        if t1 and (len(t1) > p or (in_b2 and len(t1) == p) or not t2):
            b1[t1.popitem(False)[0]] = None  # (p can reach cap while T2 is empty)
        else:
            b2[t2.popitem(False)[0]] = None

    for i, k in enumerate(keys):
        if k in t1:
            del t1[k]
            t2[k] = None
            hit[i] = 1
        elif k in t2:
            t2.move_to_end(k)
            hit[i] = 1
        elif k in b1:
            p = min(float(cap), p + max(1.0, len(b2) / len(b1)))
            replace(False)
            del b1[k]
            t2[k] = None
        elif k in b2:
            p = max(0.0, p - max(1.0, len(b1) / len(b2)))
            replace(True)
            del b2[k]
            t2[k] = None
        else:
            l1 = len(t1) + len(b1)
            if l1 == cap:
                if len(t1) < cap:
                    b1.popitem(False)
                    replace(False)
                else:
                    t1.popitem(False)
            elif l1 + len(t2) + len(b2) >= cap:
                if l1 + len(t2) + len(b2) == 2 * cap:
                    b2.popitem(False)
                replace(False)
            t1[k] = None
    return hit


def _g_tlfu(keys: list[int], cap: int, window: float, **_: Any) -> bytearray:
    hit = bytearray(len(keys))
    if cap <= 0:
        return hit
    win_cap = max(1, int(cap * window))
    main_cap = cap - win_cap
    prot_cap = int(main_cap * TLFU_PROTECTED)
    reset_every = TLFU_RESET_PER_SLOT * cap
    win: OrderedDict[int, None] = OrderedDict()
    prob: OrderedDict[int, None] = OrderedDict()
    prot: OrderedDict[int, None] = OrderedDict()
    freq: dict[int, int] = {}
    for i, k in enumerate(keys):
        if (i + 1) % reset_every == 0:  # every 10 x slots accesses, this one included
            freq = {key: f // 2 for key, f in freq.items() if f > 1}
        freq[k] = freq.get(k, 0) + 1
        if k in prot:
            prot.move_to_end(k)
            hit[i] = 1
        elif k in prob:
            hit[i] = 1
            del prob[k]
            prot[k] = None
            if len(prot) > prot_cap:
                prob[prot.popitem(False)[0]] = None
        elif k in win:
            win.move_to_end(k)
            hit[i] = 1
        else:
            win[k] = None
            if len(win) <= win_cap:
                continue
            cand = win.popitem(False)[0]
            if main_cap == 0:
                continue
            if len(prob) + len(prot) < main_cap:
                prob[cand] = None
                continue
            victims = prob if prob else prot
            victim = next(iter(victims))
            if freq.get(cand, 0) > freq.get(victim, 0):  # admission: only the more frequent enters
                del victims[victim]
                prob[cand] = None
    return hit


_IMPL: dict[str, Callable[..., bytearray]] = {
    "lru": _lru,
    "lfu": _lfu,
    "slru": _slru,
    "opt": _opt,
    "g-lru": _lru,
    "g-lfu": _g_lfu,
    "g-hot": _g_hot,
    "g-arc": _g_arc,
    "g-lru2": _g_lru2,
    "g-tlfu1": lambda keys, cap, **kw: _g_tlfu(keys, cap, 0.01),
    "g-tlfu10": lambda keys, cap, **kw: _g_tlfu(keys, cap, 0.10),
    "g-opt": _opt,
}


# ---- replay -------------------------------------------------------------------


@dataclass(frozen=True)
class ReplayResult:
    policy: str
    size: float | None
    slots: int
    accesses: int
    hits: int
    hit_rate: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def check_policies(names: Iterable[str]) -> list[str]:
    names = [n.strip() for n in names if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise BadInput(f"unknown policy {', '.join(unknown) or '(none)'}; choose from {', '.join(POLICIES)}")
    return names


def capacity(policy: str, acc: Accesses, size: float | None = None, slots: int | None = None) -> tuple[int, int]:
    """(capacity of each cache, total slots) for a policy at a size or slot count."""
    if (size is None) == (slots is None):
        raise BadInput("give exactly one of size (a fraction) or slots")
    if size is not None and not 0 <= size <= 1:
        raise BadInput(f"size must be a fraction in [0, 1], not {size}")
    if slots is not None and slots < 0:
        raise BadInput(f"slots must be >= 0, not {slots}")
    per_layer = policy in PER_LAYER
    if size is not None:
        cap = round(size * acc.n_experts * (1 if per_layer else acc.moe_layers))
    else:
        assert slots is not None  # exactly one of size and slots was given (checked above)
        cap = slots // acc.moe_layers if per_layer else slots
    return cap, cap * acc.moe_layers if per_layer else cap


def hit_mask(policy: str, acc: Accesses, cap: int, nxt: np.ndarray | None = None) -> np.ndarray:
    """Bool per access: was it a hit under `policy` with `cap` slots per cache."""
    impl = _IMPL[check_policies([policy])[0]]
    if policy in ("opt", "g-opt") and nxt is None:
        nxt = next_counted_use(acc.keys, acc.counted)
    if policy not in PER_LAYER:
        return _run(impl, policy, acc.keys, acc.token, nxt)(cap)
    out = np.zeros(acc.n, dtype=bool)
    layer = acc.layer
    order = np.argsort(layer, kind="stable")
    bounds = np.searchsorted(layer[order], np.arange(acc.moe_layers + 1))
    for l in range(acc.moe_layers):
        idx = order[bounds[l] : bounds[l + 1]]
        sub_nxt = None
        if nxt is not None:  # next uses renumbered into this layer's stream (same key, same layer)
            n, pos = len(idx), np.empty(acc.n, dtype=np.int64)
            pos[idx] = np.arange(n)
            sub = nxt[idx]
            sub_nxt = np.where(sub < acc.n, pos[np.minimum(sub, acc.n - 1)], n + np.arange(n))
        out[idx] = _run(impl, policy, acc.keys[idx], acc.token[idx], sub_nxt)(cap)
    return out


def _run(
    impl: Callable[..., bytearray], policy: str, keys: np.ndarray, token: np.ndarray, nxt: np.ndarray | None
) -> Callable[[int], np.ndarray]:
    kwargs: dict[str, Any] = {}
    if policy in ("g-lfu", "g-hot"):
        kwargs["token"] = token.tolist()
    if nxt is not None:
        kwargs["nxt"] = nxt.tolist()
    key_list = keys.tolist()
    return lambda cap: np.frombuffer(impl(key_list, cap, **kwargs), dtype=np.uint8).astype(bool)


def replay(
    source: Trace | Accesses, policy: str, size: float | None = None, slots: int | None = None, warm: int = 0
) -> ReplayResult:
    acc = source if isinstance(source, Accesses) else accesses(source, warm)
    cap, total = capacity(policy, acc, size, slots)
    hits = int(np.count_nonzero(hit_mask(policy, acc, cap) & acc.counted))
    n = acc.n_counted
    return ReplayResult(policy, size, total, n, hits, hits / n if n else 0.0)


def replay_many(
    trace: Trace,
    policies: Sequence[str],
    sizes: Sequence[float] | None = None,
    slots: Sequence[int] | None = None,
    warm: int = 0,
) -> list[ReplayResult]:
    """Every policy at every size (or slot count), sharing one access stream."""
    acc = accesses(trace, warm)
    points: list[tuple[float | None, int | None]] = (
        [(s, None) for s in sizes] if sizes is not None else [(None, n) for n in slots or ()]
    )
    return [replay(acc, p, size, n) for size, n in points for p in check_policies(policies)]


def simulate(
    policy: str,
    keys: Sequence[int],
    cap: int,
    counted: Sequence[bool] | None = None,
    token: Sequence[int] | None = None,
) -> list[bool]:
    """Hit (True) or miss per access of ONE cache of `cap` slots over raw keys.

    For hand-worked cases and tests: a per-layer policy here is just its single
    cache. `counted` (default: all) matters only to opt/g-opt's next-use rule;
    `token` (default: one token per access) only to g-lfu and g-hot's decay.
    """
    impl = _IMPL[check_policies([policy])[0]]
    arr = np.asarray(keys, dtype=np.int64)
    cnt = np.ones(len(arr), bool) if counted is None else np.asarray(counted, dtype=bool)
    kwargs: dict[str, Any] = {"token": list(range(len(arr))) if token is None else list(token)}
    if policy in ("opt", "g-opt"):
        kwargs["nxt"] = next_counted_use(arr, cnt).tolist()
    return [bool(h) for h in impl(arr.tolist(), cap, **kwargs)]
