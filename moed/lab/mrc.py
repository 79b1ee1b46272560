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
with a bottom-up merge (CDQ divide and conquer) vectorised in numpy: at each
level, every query in a right half counts the left half's `prev` values above
its own with one `searchsorted` over the row-sorted halves. O(n log^2 n) in C.

Belady points (g-opt) are not a stack algorithm over this stream with bypass and
counted-only uses, so they come from separate replays at chosen sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moed.lab import policies
from moed.lab.policies import Accesses
from moed.lab.traces import Trace

COLD = np.iinfo(np.int64).max  # distance of a first access: a miss at every size


def previous_use(keys: np.ndarray) -> np.ndarray:
    """Position of the previous access to the same key, -1 for a first access."""
    n = len(keys)
    prev = np.full(n, -1, dtype=np.int64)
    if n:
        order = np.argsort(keys, kind="stable")
        same = keys[order[:-1]] == keys[order[1:]]
        prev[order[1:][same]] = order[:-1][same]
    return prev


def _nested_counts(prev: np.ndarray) -> np.ndarray:
    """#{j < i : prev[j] > prev[i]} for every i."""
    n = len(prev)
    size = 1 << max(0, (n - 1).bit_length())
    vals = np.full(size, 0, dtype=np.int64)
    vals[:n] = prev + 1  # >= 0; padding (0) sits at the end and is never queried
    query = vals.copy()
    out = np.zeros(size, dtype=np.int64)
    off = size + 2  # row offset: keeps each sorted row above the previous one
    sorted_rows = vals.copy()  # rows of width 1 are sorted
    width = 1
    while width < size:
        rows = size // width
        flat = sorted_rows + np.repeat(np.arange(rows, dtype=np.int64) * off, width)
        # queries: every position in an odd row asks its left neighbour row
        pos = np.arange(size, dtype=np.int64)
        row = pos // width
        right = (row & 1) == 1
        q_pos, q_row = pos[right], row[right]
        left = q_row - 1
        below = np.searchsorted(flat, query[q_pos] + left * off, side="right")
        out[q_pos] += (left + 1) * width - below
        width *= 2
        # merge neighbour rows: a stable sort of two sorted runs is a linear merge
        sorted_rows = np.sort(sorted_rows.reshape(-1, width), axis=1, kind="stable").ravel()
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
