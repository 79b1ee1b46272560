"""Miss-ratio curves: the shared LRU's hit rate at every cache size in one pass.

LRU is a stack algorithm: an access hits in a cache of C slots iff its stack
distance (the number of distinct other keys used since the key's previous
access) is below C. So one pass that computes every access's distance gives the
g-lru hit count at every size, and equals separate g-lru replays exactly (the
access and counting rules are those of `moed.lab.policies`).

Distance of access i with previous access p to the same key:
    d(i) = (i - p - 1) - #{j < i : prev(j) > p}
(the window (p, i) minus its repeats: j repeats inside the window iff its own
previous access is after p). The count is a 2-D dominance count, done offline
with a bottom-up merge sort (CDQ divide and conquer) vectorised in numpy: at
each level, every element of a right half counts the left half's `prev` values
above its own while the two sorted halves are merged. O(n log n) in C.

Belady points (g-opt) are not a stack algorithm over this stream with bypass and
counted-only uses, so they come from separate replays at chosen sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moed.lab import policies
from moed.lab.policies import Accesses
from moed.traces import Trace

COLD = np.iinfo(np.int64).max  # distance of a first access: a miss at every size


def previous_use(keys: np.ndarray) -> np.ndarray:
    """Position of the previous access to the same key, -1 for a first access."""
    n = len(keys)
    prev = np.full(n, -1, dtype=np.int64)
    if n:
        order = policies._stable_order(keys)
        same = keys[order[:-1]] == keys[order[1:]]
        prev[order[1:][same]] = order[:-1][same]
    return prev


def _nested_counts(prev: np.ndarray) -> np.ndarray:
    """#{j < i : prev[j] > prev[i]} for every i, by a bottom-up merge sort.

    At each level, neighbouring sorted runs (left, right) are merged with a stable
    sort (two runs: timsort merges them in linear time); a right element's count
    gains the left elements greater than it = |left| - (left elements merged at
    or before it). Equal values from the left come first, so they are not counted.
    """
    n = len(prev)
    size = 1 << max(0, (n - 1).bit_length())
    vals = np.zeros(size, dtype=np.int64)
    vals[:n] = prev  # padding sits at the end: it only ever meets other padding
    perm = np.arange(size, dtype=np.int64)  # original position of each sorted value
    out = np.zeros(size, dtype=np.int64)
    width = 1
    while width < size:
        rows_v = vals.reshape(-1, 2 * width)
        order = np.argsort(rows_v, axis=1, kind="stable")
        vals = np.take_along_axis(rows_v, order, axis=1).ravel()
        perm = np.take_along_axis(perm.reshape(-1, 2 * width), order, axis=1).ravel()
        from_left = (order < width).ravel()
        left_so_far = np.cumsum(order < width, axis=1).ravel()
        right = ~from_left
        out[perm[right]] += width - left_so_far[right]
        width *= 2
    return out[:n]


def stack_distances(keys: np.ndarray) -> np.ndarray:
    """LRU stack distance of every access (COLD for a first access)."""
    prev = previous_use(keys)
    d = np.arange(len(keys), dtype=np.int64) - prev - 1 - _nested_counts(prev)
    d[prev < 0] = COLD
    return d


@dataclass(frozen=True)
class MissRatioCurve:
    """`hits[c]` = counted g-lru hits with c slots, for c = 0 .. max_slots."""

    hits: np.ndarray
    accesses: int
    slots_per_size: float  # slots of size fraction 1.0 (experts x layers)

    @property
    def max_slots(self) -> int:
        return len(self.hits) - 1

    def hit_rate(self, slots: int) -> float:
        c = min(max(slots, 0), self.max_slots)
        return float(self.hits[c]) / self.accesses if self.accesses else 0.0

    def miss_ratio(self, slots: int) -> float:
        return 1.0 - self.hit_rate(slots)

    def to_json(self) -> dict[str, Any]:
        return {"policy": "g-lru", "accesses": self.accesses, "hits": self.hits.tolist()}


def lru_curve(source: Trace | Accesses, warm: int = 0) -> MissRatioCurve:
    acc = source if isinstance(source, Accesses) else policies.accesses(source, warm)
    total = acc.moe_layers * acc.n_experts
    d = stack_distances(acc.keys)[acc.counted]
    d = d[d < total]  # COLD never hits
    hist = np.bincount(d, minlength=total) if len(d) else np.zeros(total, np.int64)
    hits = np.concatenate([[0], np.cumsum(hist)]).astype(np.int64)  # d < c
    return MissRatioCurve(hits, acc.n_counted, float(total))
