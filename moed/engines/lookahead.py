"""The engine's look-ahead: predictions at `ffn_norm-L`, prefetches after L's acquire, and their counts.

What this module owns, per graph (one ubatch) of a decode: the predictions made
for later layers (per token, best first), the prefetches issued from them, and
the counters that say how they did (recall, issued, hits, wasted, stall), per
layer and in total. The math is `moed.engines.predictor`'s; whether a decode
step prefetches at all is `moed.engines.governor`'s.

Timeline of layer L in one graph:

    ffn_norm-L      `observe(L, x)`: predict L+1 (and L+2 in gate2) from x; keep them
    ffn_moe_topk-L  the streamer acquires L (releasing L-1), then `routed(L, ids, ...)`:
                    score what was predicted and prefetched for L, then send the
                    prefetches kept for L+1 (and L+2)

Why the prefetches go out after L's acquire and not at ffn_norm-L: until L's
grant is taken, L's experts (prefetched a layer earlier, READY but held by
nobody) are evictable, and a prefetch for L+1 could evict them. Once L is
held, a prefetch can only evict what no grant holds. The lead time lost is
L's router alone; L's expert matmuls and L+1's attention still overlap the reads.

Counting: an issued expert is one (layer, expert) named in a prefetch for a
graph, counted once however many prefetches named it (gate2 names L+2 twice: two
layers ahead, then again one layer ahead, which supersedes the first in the
daemon). It is resolved when that layer routes in the same graph: a hit if some
token routed to it, wasted if none did. Until then it is pending; `end_decode`
resolves what a stopped graph left as wasted. So issued = hits + wasted +
pending, per layer and in total, at every moment. Recall is per token: routed
(token, expert) pairs that the one-ahead prediction (its first `width`) named,
over all routed pairs of layers that had a prediction.

The governor (moed.engines.governor) hears, per step, how many of the experts a
prefetch would read (predicted, and gone by the cache estimate below; in a shadow
step only named) the layer then routed: the precision its floor is about, of the
bytes prefetch adds.

Only predicted experts that this engine's own LRU estimate of the daemon's
cache (moed.engines.cache_estimate) says are gone are sent: once everything fits,
a warm engine sends (almost) nothing, and a wrong guess of a resident expert
costs no message.

Prompt batches: the prefetch is the union of every token's prediction; when that
union covers most of the layer (`WHOLE_LAYER_SHARE`), the whole layer is asked
for, most-predicted experts first; the last layer, which keeps only the
batch's output rows when not every token's logits are wanted, is predicted from
those rows alone. Every prefetch is cut to what the budget can hold beside the
current grant (`capacity - taken`), best first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moed.engines.cache_estimate import CacheEstimate
from moed.engines.governor import ON, SHADOW, PrefetchGovernor
from moed.engines.predictor import GatePredictor, top
from moed.engines.sources import ExpertSource

MODES = ("off", "gate", "gate2")
LEADS = {"off": (), "gate": (1,), "gate2": (1, 2)}
WHOLE_LAYER_SHARE = 0.75
DECODE_ROWS = 4  # graphs of at most this many tokens are decode steps for the governor

# A benchmark hook: (target layer, lead, ids) where ids is the writable (n_tokens,
# width) prediction, best first; it may overwrite it before anything uses it.
PredictHook = Callable[[int, int, np.ndarray], None]


class AheadObserver:
    """What sees the look-ahead's predictions (traces record them; tests check them): a
    route observer (moed.engines.streamer.RouteObserver) handed to `record`. Every method
    does nothing unless a subclass says otherwise."""

    def route(self, layer: int, ids: np.ndarray) -> None:
        """Layer `layer` routed `ids` (a copy)."""

    def decoded(self) -> None:
        """A decode ended."""

    def ahead(self, layer: int, lead: int, ids: np.ndarray) -> None:
        """Layer `layer` was predicted `lead` layers ahead: `ids`, (n_tokens, width), best first."""

    def hidden(self, layer: int, x: np.ndarray) -> None:
        """The router's input rows of `layer`, before its predictions are made."""


@dataclass
class LayerLook:
    """One layer's look-ahead counters (the layer predicted and prefetched, not the observer)."""

    routed: int = 0  # routed (token, expert) pairs in graphs that predicted this layer
    predicted: int = 0  # ... of which the one-ahead prediction named
    routed2: int = 0  # the same for the two-ahead prediction (gate2, traces)
    predicted2: int = 0
    issued: int = 0
    hits: int = 0
    wasted: int = 0
    stall_s: float = 0.0  # time in this layer's acquires

    def as_dict(self, tokens: int) -> dict:
        return {
            "recall": self.predicted / self.routed if self.routed else None,
            "recall2": self.predicted2 / self.routed2 if self.routed2 else None,
            "issued": self.issued,
            "hits": self.hits,
            "wasted": self.wasted,
            "pending": self.issued - self.hits - self.wasted,
            "stall_s": self.stall_s,
            "stall_s_per_token": self.stall_s / tokens if tokens else 0.0,
        }


class Lookahead:
    """Predictions and prefetches of one engine; the streamer calls it from the eval callback."""

    def __init__(
        self,
        predictor: GatePredictor | None,
        source: ExpertSource,
        mode: str,
        width: int,
        record_width: int = 0,
        adapt: bool = True,
        predict_hook: PredictHook | None = None,
        layers: list[int] | None = None,
    ):
        """`layers`: the MoE layers the graph runs (default: all of the source's)."""
        if mode not in MODES:
            raise ValueError(f"prefetch must be one of {', '.join(MODES)}, not {mode!r}")
        self.predictor = predictor
        self.source = source
        self.mode = mode
        self.width = width
        self.record_width = record_width  # > 0: predictions for observers (traces), both leads
        self.governor = PrefetchGovernor() if adapt and mode != "off" else None
        self.predict_hook = predict_hook
        self.observers: list[AheadObserver] = []
        self.leads = LEADS[mode] if not record_width else (1, 2)
        if predictor is not None:
            predictor.prepare(self.leads)
        self.moe_layers = list(layers) if layers is not None else list(source.moe_layers)
        self.layers: dict[int, LayerLook] = {layer: LayerLook() for layer in self.moe_layers}
        self.cache = CacheEstimate(source.capacity, source.size_class)
        self.skipped_resident = 0  # predicted experts not sent: the estimate says the daemon has them
        self.predict_s = 0.0  # in observe: the predictor's matmul, top-k, prefetch set
        self.account_s = 0.0  # in routed: scoring, counting, sending the prefetches
        self.decode_steps = 0
        self.tokens = 0
        self._issuing = mode != "off"
        self._shadow = False  # this step predicts and scores but sends nothing
        self._step_named = [0, 0]  # this step's (named and routed, named), sent or shadow
        self._named: dict[int, np.ndarray] = {}  # target -> experts predicted for prefetch
        self._t0 = 0.0
        self._pred: dict[int, dict[int, np.ndarray]] = {}  # target -> lead -> (rows, width) ids
        self._outbox: list[tuple[int, np.ndarray]] = []  # (target, experts) to send after this acquire
        self._pending: dict[int, np.ndarray] = {}  # target -> bool mask of experts issued
        self._last_layer = self.moe_layers[-1]
        self._rows_now = 0  # rows of the last ffn_norm seen (the graph's tokens)
        self._out_rows: int | None = None  # rows the last layer kept, when fewer than the graph's

    def forget_cache(self) -> None:
        """The daemon restarted: it holds none of what the estimate counts resident, so the
        estimate starts empty again (capacities and classes asked of the source anew)."""
        self.cache = CacheEstimate(self.source.capacity, self.source.size_class)

    def mode_leads(self) -> tuple[int, ...]:
        return LEADS[self.mode]

    def record(self, observer: AheadObserver, width: int) -> None:
        """Also predict one and two layers ahead, `width` per token, for `observer` (traces)."""
        if self.predictor is None:
            raise RuntimeError("this model has no gate-ahead predictor: no predictions to record")
        self.record_width = width
        self.leads = (1, 2)
        self.predictor.prepare(self.leads)
        self.observers.append(observer)

    def stop_recording(self, observer: AheadObserver) -> None:
        """`observer` sees no more predictions; with none left, the mode's own leads again."""
        self.observers.remove(observer)
        if not self.observers:
            self.record_width = 0
            self.leads = self.mode_leads()

    @property
    def _gate(self) -> GatePredictor:
        """The predictor, on the paths that only `observe` opens (predictions, their prefetches).

        `observing` is False without a predictor, so the streamer never calls
        `observe` then, and nothing is predicted, named, pending or sent.
        """
        assert self.predictor is not None, "predictions exist only with a predictor"
        return self.predictor

    @property
    def observing(self) -> bool:
        """Whether the callback should stop at ffn_norm nodes now."""
        return self.predictor is not None and (self._issuing or self._shadow or self.record_width > 0)

    # ---- a decode ----------------------------------------------------------

    def begin_decode(self, n_tokens: int, tokens: np.ndarray | None = None) -> None:
        """Before llama_decode of `n_tokens`; `tokens`: the batch's token ids (None for
        embeddings), from which a hashed layer's experts are known before the graph runs."""
        self._t0 = time.perf_counter()
        self.tokens += n_tokens
        self._step_named = [0, 0]
        if self.governor is not None:
            mode = self.governor.begin(n_tokens <= DECODE_ROWS)
            self._issuing, self._shadow = mode == ON, mode == SHADOW
        if tokens is not None and self.mode != "off" and self.predictor is not None and self.predictor.hashed:
            self._prefetch_hashed(tokens)

    def _prefetch_hashed(self, tokens: np.ndarray) -> None:
        """Each hashed layer's experts (deepseek4's first layers pick by token id), sent at
        once: exact, so whatever the governor says about predictions, nothing is wasted."""
        for layer in sorted(self._gate.hashed & self.layers.keys()):
            experts = np.unique(self._gate.token_experts(layer, tokens))
            self._send(layer, self._within_capacity(layer, experts, 0))

    def end_decode(self) -> None:
        """After llama_decode: what a stopped graph never routed is wasted."""
        for target, mask in self._pending.items():
            self.layers[target].wasted += int(mask.sum())
        self._pending.clear()
        self._named.clear()
        self._pred.clear()
        self._outbox.clear()
        self.decode_steps += 1
        if self.governor is not None:
            self.governor.scored(*self._step_named)
            self.governor.end(time.perf_counter() - self._t0)

    # ---- ffn_norm-L ----------------------------------------------------------

    def observe(self, layer: int, x: np.ndarray) -> None:
        t0 = time.perf_counter()
        width = max(self.width, self.record_width)
        for observer in self.observers:
            observer.hidden(layer, x)
        for target, lead in self._targets(layer):
            ids = top(self._gate.scores(x, layer, target), width)
            if self.predict_hook is not None:
                self.predict_hook(target, lead, ids)
            self._pred.setdefault(target, {})[lead] = ids
            for observer in self.observers:
                observer.ahead(target, lead, ids)
            if (self._issuing or self._shadow) and lead in LEADS[self.mode]:
                self._outbox.append((target, self._prefetch_set(self._output_rows(target, ids)[:, : self.width])))
        self._rows_now = x.shape[0]
        self.predict_s += time.perf_counter() - t0

    def expect_output_rows(self, n: int | None) -> None:
        """The last layer will route only the batch's last `n` rows (None: every row)."""
        self._out_rows = n

    def _output_rows(self, target: int, ids: np.ndarray) -> np.ndarray:
        """The rows the target layer will route: the last layer of a batch may keep only its outputs.

        Without logits for every token, llama.cpp's last layer routes only the
        batch's output rows (its last token for Llama.eval); once seen, its
        prefetch is predicted from that many last rows instead of the whole batch.
        """
        if target == self._last_layer and self._out_rows and ids.shape[0] > self._out_rows:
            return ids[-self._out_rows :]
        return ids

    def _targets(self, layer: int):
        """The layers `layer`'s rows predict; never a hashed one (deepseek4's first layers
        select by token id, which the rows do not carry: no prediction, no prefetch)."""
        layers = self._gate.moe_layers
        i = layers.index(layer)
        for lead in self.leads:
            if i + lead < len(layers) and layers[i + lead] not in self._gate.hashed:
                yield layers[i + lead], lead

    def _prefetch_set(self, ids: np.ndarray) -> np.ndarray:
        """Experts to prefetch for a batch's predictions: the union, or the whole layer, best first."""
        n = self._gate.n_experts
        if ids.shape[0] == 1:
            return ids[0][ids[0] >= 0]  # one token: its row is distinct and best first already
        votes = np.bincount(ids[ids >= 0].ravel(), minlength=n)
        chosen = np.flatnonzero(votes)
        if len(chosen) >= WHOLE_LAYER_SHARE * n and ids.shape[0] > 1:
            chosen = np.arange(n)
        return chosen[np.argsort(-votes[chosen], kind="stable")]

    # ---- ffn_moe_topk-L, after L's acquire -------------------------------------

    def routed(self, layer: int, ids: np.ndarray, granted: int, stall_s: float) -> None:
        """Layer `layer` routed `ids` and holds a grant of `granted` experts now; score it, then
        send prefetches."""
        t0 = time.perf_counter()
        look = self.layers[layer]
        look.stall_s += stall_s
        if self.mode != "off":
            self.cache.touch(layer, np.unique(ids[ids >= 0]))
        if layer == self._last_layer and self._rows_now > 1:  # a batch: what did it keep?
            self._out_rows = ids.shape[0] if ids.shape[0] < self._rows_now else None
        preds = self._pred.pop(layer, None)
        if preds:
            self._score(look, ids, preds)
        mask, named = self._pending.pop(layer, None), self._named.pop(layer, None)
        if mask is not None or named is not None:
            used = np.zeros(self._gate.n_experts, dtype=bool)
            used[ids[ids >= 0]] = True
            if named is not None:
                self._step_named[0] += int((named & used).sum())
                self._step_named[1] += int(named.sum())
                if self._issuing and self.governor is not None and self.governor.cut(*self._step_named):
                    self._issuing, self._shadow = False, True  # a trial batch that proved wrong
            if mask is not None:
                hit = int((mask & used).sum())
                look.hits += hit
                look.wasted += int(mask.sum()) - hit
        outbox, self._outbox = self._outbox, []
        taken = granted  # slots this layer's grant and the prefetches sent so far take
        for target, experts in outbox:
            # The governor's precision is of what a prefetch reads: the predicted experts the
            # estimate says are gone. Resident ones cost no read and are the popular ones, so
            # counting them hid wrong reads (Qwen3-30B geometry in a 6 GiB cap: precision over
            # everything named kept prefetch on while decode read 55% more and ran 0.83x off).
            gone = np.asarray(self.cache.missing(target, experts.tolist()), dtype=np.int64)
            _name(self._named, target, gone, self._gate.n_experts)
            if not self._issuing:
                continue  # a shadow step: named for the governor, not sent
            self.skipped_resident += len(experts) - len(gone)
            experts = self._within_capacity(target, gone, taken)
            self._send(target, experts)
            self.cache.touch(target, experts)
            taken += len(experts)
        self.account_s += time.perf_counter() - t0

    def _score(self, look: LayerLook, ids: np.ndarray, preds: dict[int, np.ndarray]) -> None:
        for lead, pred in preds.items():
            if pred.shape[0] != ids.shape[0]:
                continue  # the last layer keeps only the output rows: no row-by-row match
            pred = pred[:, : self.width]
            if ids.shape[0] == 1:  # a decode step: sets are cheaper than masks
                routed = {int(e) for e in ids[0] if e >= 0}
                got, n_routed = len(routed.intersection(pred[0].tolist())), len(routed)
            else:
                got, n_routed = _named_pairs(pred, ids, self._gate.n_experts)
            if lead == 1:
                look.routed += n_routed
                look.predicted += got
            else:
                look.routed2 += n_routed
                look.predicted2 += got

    def _within_capacity(self, target: int, experts: np.ndarray, taken: int) -> np.ndarray:
        cap = self.source.capacity(target)
        return experts if cap is None else experts[: max(0, cap - taken)]

    def _send(self, target: int, experts: np.ndarray) -> None:
        if not len(experts):
            return
        self.source.prefetch(target, experts.tolist())
        self.layers[target].issued += _name(self._pending, target, experts, self._gate.n_experts)

    # ---- reporting -----------------------------------------------------------

    def arm(self) -> bool:
        """Whether the current (or last) decode step prefetches."""
        return self._issuing

    def totals(self) -> dict:
        ls = self.layers.values()
        routed, predicted = sum(l.routed for l in ls), sum(l.predicted for l in ls)
        routed2, predicted2 = sum(l.routed2 for l in ls), sum(l.predicted2 for l in ls)
        issued, hits, wasted = sum(l.issued for l in ls), sum(l.hits for l in ls), sum(l.wasted for l in ls)
        out = {
            "prefetch": self.mode,
            "prefetch_width": self.width,
            "prediction_recall": predicted / routed if routed else None,
            "prediction_recall2": predicted2 / routed2 if routed2 else None,
            "prefetch_issued": issued,
            "prefetch_hits": hits,
            "prefetch_wasted": wasted,
            "prefetch_pending": issued - hits - wasted,
            "predict_s": self.predict_s,
            "lookahead_account_s": self.account_s,
            "prefetch_skipped_resident": self.skipped_resident,
            "per_layer": {layer: l.as_dict(self.tokens) for layer, l in self.layers.items()},
        }
        if self.governor is not None:
            out.update(self.governor.state())
        return out


def _named_pairs(pred: np.ndarray, ids: np.ndarray, n_experts: int) -> tuple[int, int]:
    """(routed (token, expert) pairs that `pred` named in the same row, routed pairs)."""
    named = np.zeros((ids.shape[0], n_experts), dtype=bool)
    r, c = np.nonzero(pred >= 0)
    named[r, pred[r, c]] = True
    r, c = np.nonzero(ids >= 0)
    return int(named[r, ids[r, c]].sum()), len(r)


def _name(named: dict[int, np.ndarray], target: int, experts: np.ndarray, n_experts: int) -> int:
    """Add `experts` to `target`'s mask in `named`; returns how many were not in it yet."""
    mask = named.get(target)
    if mask is None:
        mask = named[target] = np.zeros(n_experts, dtype=bool)
    fresh = int((~mask[experts]).sum())
    mask[experts] = True
    return fresh
