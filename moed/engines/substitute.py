"""Routing that prefers resident experts: a missing expert replaced by one the router nearly chose.

What this module owns: the rewrite of one layer's routed ids (pure numpy over the
router's own arrays), its counters, and the optional co-occurrence rule. The
streamer calls `Substituter.rewrite` at `ffn_moe_topk-L`, before llama.cpp
gathers the routing weights from `ffn_moe_probs-L` at those ids, so a stand-in
carries its own probability (docs/design.md, "Substitution").

The plain rule, per token and per chosen expert that is not resident (best
choice first): among the router's next `window` choices (ranks k..k+window-1 of
`ffn_moe_argsort-L`), take the best-ranked one that is resident, not already
chosen for this token, and whose probability is at least `r` times the missing
expert's. None qualifies: the missing expert stays (and is read).

The co-occurrence rule (`rule="cooc"`) takes, among the same qualifying
candidates, the one that has most often been routed together with the missing
expert (counts learned online from the router's own choices, before any rewrite),
ties broken by rank.

Invariants:
- Residency is decided from one read of the residency table per layer (a hint,
  no round trip, never waits); the acquire that follows still holds whatever the
  final ids name, so a stand-in evicted in between is read like any miss.
- No expert appears twice in one token's row after a rewrite.
- `r > 1` never substitutes (a lower-ranked expert cannot have a higher
  probability), and None means no Substituter at all: the exact path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

RULES = ("plain", "cooc")

# (layer, experts) -> bool array: which are resident now (ModelHandle.resident).
Resident = Callable[[int, Any], np.ndarray]


@dataclass
class Swap:
    """One substitution: token row, slot in its top-k, the missing expert and its stand-in."""

    token: int
    slot: int
    missing: int
    standin: int
    rank: int  # the stand-in's rank in the router's order (k .. k + window - 1)
    p_missing: float
    p_standin: float


@dataclass
class Rewrite:
    """What one call did (kept only when recording): enough to replay it in another engine."""

    layer: int
    n_tokens: int
    resident: np.ndarray  # the residency read the choice was made from (bool per expert)
    swaps: list[Swap] = field(default_factory=list)


@dataclass
class SubstStats:
    routed: int = 0  # (token, slot) pairs seen
    substitutions: int = 0
    missing: int = 0  # chosen (token, slot) pairs whose expert was not resident, before rewriting
    reads_needed: int = 0  # distinct non-resident experts per layer-call, before rewriting
    reads_avoided: int = 0  # ... of which the rewrite removed every use
    weight_chosen: float = 0.0  # routing probability of every final choice, summed
    weight_moved: float = 0.0  # ... of which on stand-ins


class Substituter:
    def __init__(self, r: float, n_experts: int, k: int, window: int | None = None, rule: str = "plain"):
        if not r > 0:
            raise ValueError(f"subst r must be > 0, not {r}")
        if rule not in RULES:
            raise ValueError(f"subst rule must be one of {', '.join(RULES)}, not {rule!r}")
        self.r = float(r)
        self.n_experts = n_experts
        self.k = k
        self.window = min(window if window is not None else k, n_experts - k)
        self.rule = rule
        self.stats = SubstStats()
        self.log: list[Rewrite] | None = None  # set to [] to record every call
        self._all = np.arange(n_experts)
        self._cooc: dict[int, np.ndarray] = {}

    def rewrite(self, layer: int, ids: np.ndarray, ranked: np.ndarray, probs: np.ndarray, resident: Resident) -> int:
        """Rewrite `ids` (n_tokens, k), writable, in place; returns the number of substitutions.

        `ranked` (n_tokens, n_experts): every expert, best first (argsort);
        `probs` (n_tokens, n_experts): the routing probabilities.
        """
        n_tokens, k = ids.shape
        st = self.stats
        st.routed += ids.size
        original = np.array(ids)
        if self.rule == "cooc":
            self._learn(layer, original)
        mask = np.asarray(resident(layer, self._all), dtype=bool)
        gone = ~mask[original]
        rec = Rewrite(layer, n_tokens, mask.copy()) if self.log is not None else None
        done = 0
        if gone.any() and self.window > 0:
            st.missing += int(gone.sum())
            for t in np.flatnonzero(gone.any(axis=1)):
                done += self._row(layer, int(t), ids, ranked, probs, mask, gone[t], rec)
        before = np.unique(original[gone])
        after = np.unique(ids[~mask[ids]]) if done else before
        st.reads_needed += len(before)
        st.reads_avoided += len(before) - len(after)
        st.substitutions += done
        rows = np.arange(n_tokens)[:, None]
        st.weight_chosen += float(probs[rows, ids].sum())
        if rec is not None:
            st.weight_moved += sum(s.p_standin for s in rec.swaps)
            assert self.log is not None
            self.log.append(rec)
        elif done:
            st.weight_moved += float(probs[rows, ids][ids != original].sum())
        return done

    def _row(self, layer, t, ids, ranked, probs, mask, gone_row, rec: Rewrite | None) -> int:
        k = self.k
        cand = ranked[t, k : k + self.window]
        p_cand = probs[t, cand]
        done = 0
        for slot in np.flatnonzero(gone_row):
            miss = int(ids[t, slot])
            ok = mask[cand] & (p_cand >= self.r * probs[t, miss]) & ~np.isin(cand, ids[t])
            if not ok.any():
                continue
            idx = np.flatnonzero(ok)
            if self.rule == "cooc":
                counts = self._cooc[layer][miss, cand[idx]]
                j = int(idx[int(np.argmax(counts))])  # argmax keeps the first (best-ranked) of ties
            else:
                j = int(idx[0])
            c = int(cand[j])
            ids[t, slot] = c
            done += 1
            if rec is not None:
                rec.swaps.append(Swap(t, int(slot), miss, c, k + j, float(probs[t, miss]), float(p_cand[j])))
        return done

    def _learn(self, layer: int, ids: np.ndarray) -> None:
        """Count, per pair of experts, the tokens the router sent to both (its own choice)."""
        onehot = np.zeros((ids.shape[0], self.n_experts), dtype=np.int64)
        np.put_along_axis(onehot, ids.astype(np.int64), 1, axis=1)
        c = self._cooc.get(layer)
        if c is None:
            c = self._cooc[layer] = np.zeros((self.n_experts, self.n_experts), dtype=np.int64)
        c += onehot.T @ onehot

    def totals(self, tokens: int) -> dict:
        """The counters for stream_stats (`tokens`: the engine's, prompt and generated)."""
        st = self.stats
        return {
            "subst_r": self.r,
            "subst_rule": self.rule,
            "subst_window": self.window,
            "subst_substitutions": st.substitutions,
            "subst_per_token": st.substitutions / tokens if tokens else 0.0,
            "subst_missing": st.missing,
            "subst_reads_needed": st.reads_needed,
            "subst_reads_avoided": st.reads_avoided,
            "subst_weight_share": st.weight_moved / st.weight_chosen if st.weight_chosen else 0.0,
        }
