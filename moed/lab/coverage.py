"""Predictor coverage: which decode misses a prefetch predictor would have seen coming.

The cache is the shared LRU (g-lru, the daemon's default) at the given size,
replayed with the usual rules (`moed.lab.policies`); predictions are only scored,
never loaded, so the cache evolves exactly as without prefetch. For every
counted (decode, after warm-up) token and layer, each predictor names a set of
experts before the layer's accesses are made:

  gate-ahead k / 2k   the trace's ahead1 prediction (layer l's router on layer
                      l-1's output): its first top_k ids / all of them (2 x top_k)
  two-ahead k / 2k    the same from ahead2 (layer l-2's output, a layer earlier)
  previous token      the experts this layer used for the previous token
  co-occurrence       for each expert the previous layer used for this token, the
                      2 experts of this layer seen with it most often so far
                      (counts over all earlier tokens; ties to the lower id)

`coverage` = covered misses / all counted misses (every layer; a predictor that
cannot predict a layer, e.g. layer 0, covers none of its misses).
`useless_reads_per_token` = predicted experts that were neither resident nor used
by the token in that layer, per counted token: reads a prefetch would waste.
Gate-ahead rows appear only when the trace has those predictions.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from moed.lab import policies
from moed.traces import Trace

COOCCURRENCE_PER_EXPERT = 2


@dataclass(frozen=True)
class Coverage:
    predictor: str
    size: float
    slots: int
    misses: int
    covered: int
    coverage: float
    useless_reads_per_token: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _names(trace: Trace) -> list[str]:
    names = []
    if trace.ahead1 is not None:
        names += ["gate-ahead k", "gate-ahead 2k"]
    if trace.ahead2 is not None:
        names += ["two-ahead k", "two-ahead 2k"]
    return names + ["previous token", "co-occurrence"]


def coverage(trace: Trace, size: float = 0.5, warm: int = 0) -> list[Coverage]:
    n_layers, n_exp = trace.moe_layers, trace.n_experts
    slots = round(size * n_exp * n_layers)
    counted = policies.counted_tokens(trace, warm)
    names = _names(trace)
    covered = dict.fromkeys(names, 0)
    useless = dict.fromkeys(names, 0)
    misses = 0
    cache: OrderedDict[int, None] = OrderedDict()
    co = np.zeros((max(n_layers - 1, 1), n_exp, n_exp), dtype=np.int64)  # co[l-1, a, b]
    ids = trace.ids
    for t in range(trace.n_tokens):
        for layer in range(n_layers):
            cur = _distinct(ids[t, layer])
            base = layer * n_exp
            if counted[t]:
                preds = _predict(trace, t, layer, co, names)
                used = set(cur)
                for name, pred in preds.items():
                    useless[name] += sum(1 for e in pred if e not in used and base + e not in cache)
            for e in cur:
                key = base + e
                if key in cache:
                    cache.move_to_end(key)
                    continue
                if counted[t]:
                    misses += 1
                    for name, pred in preds.items():
                        covered[name] += e in pred
                if slots > 0:
                    cache[key] = None
                    if len(cache) > slots:
                        cache.popitem(False)
            if layer > 0:
                prev = _distinct(ids[t, layer - 1])
                co[layer - 1][np.ix_(prev, cur)] += 1
    n_tok = int(counted.sum()) or 1
    return [
        Coverage(n, size, slots, misses, covered[n], covered[n] / misses if misses else 0.0, useless[n] / n_tok)
        for n in names
    ]


def _distinct(row: np.ndarray) -> list[int]:
    out: list[int] = []
    for e in row.tolist():
        if e >= 0 and e not in out:
            out.append(e)
    return out


def _predict(trace: Trace, t: int, layer: int, co: np.ndarray, names: list[str]) -> dict[str, set[int]]:
    k = trace.top_k
    preds: dict[str, set[int]] = {}
    for label, ahead in (("gate-ahead", trace.ahead1), ("two-ahead", trace.ahead2)):
        if ahead is None:
            continue
        row = [e for e in ahead[t, layer].tolist() if e >= 0]
        preds[f"{label} k"] = set(row[:k])
        preds[f"{label} 2k"] = set(row)
    preds["previous token"] = set(_distinct(trace.ids[t - 1, layer])) if t > 0 else set()
    preds["co-occurrence"] = _cooccurring(co, t, layer, trace) if layer > 0 else set()
    return preds


def _cooccurring(co: np.ndarray, t: int, layer: int, trace: Trace) -> set[int]:
    prev = _distinct(trace.ids[t, layer - 1])
    if not prev:
        return set()
    rows = co[layer - 1][prev]  # (len(prev), n_experts)
    best = np.argsort(-rows, axis=1, kind="stable")[:, :COOCCURRENCE_PER_EXPERT]
    counts = np.take_along_axis(rows, best, axis=1)
    return set(best[counts > 0].tolist())
