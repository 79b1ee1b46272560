"""The decode steps: what happens around each llama_decode, and warm.

What this module owns: `begin` (the decode's path choice in the layer holds, the
look-ahead's decode, whether the callback stops at the router's input), `finish`
(what the last layer holds let go, each placement's end of decode, the look-ahead told
what the holds did alone), whole steps (every expert pinned: no stop at all), the
decode and token counters, and `warm` (experts mapped before the first decode).

Invariants:
- `finish` runs after every llama_decode that `begin` began, failed or not: it hides
  and releases what is still held (`LayerHolds.end`), so an idle engine holds nothing,
  and it ends the decode in every placement (after a failure under an offload: every
  expert hidden again).
- A whole step (every expert pinned: `begin` took the holds' pin hold) makes no stop
  at all and holds nothing per layer; `finish` lets the pin hold go. Only a quiet
  engine (no hook, substitution or trace) takes one, only when every routed layer is a
  lane layer, and never while repacked experts wait for their kernels.
- No stop is done alone in C while Python must see it: the ids not final, something
  to observe, or the repacked experts not yet switched (the cycle switches them at
  the decode's first stop, before the layer's expert matmuls).
- `warm` holds nothing after it returns: each acquire is a lease like a decode's,
  released at once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from moed.engines.holds import lost
from moed.engines.lookahead import AheadObserver
from moed.engines.sources import ExpertSource

if TYPE_CHECKING:
    from moed.engines.binding import Bound
    from moed.engines.cycle import StopCycle
    from moed.engines.mapping import ModelMapping


@dataclass
class StepCounts:
    decodes: int = 0
    tokens: int = 0  # tokens in all decodes (prompt and generated)


class DecodeSteps:
    def __init__(self, source: ExpertSource, cycle: StopCycle, model: ModelMapping, bound: Bound):
        """`cycle`: the callback and what Python does at a stop; `model`: the look-ahead, the
        router and the kernel switch (read after install); `bound`: the holds and placements."""
        self._source, self._cycle, self._model, self._bound = source, cycle, model, bound
        self._grants = cycle.grants
        self.counts = StepCounts()
        self._whole_tokens = 0  # tokens of the whole step under way (0: none)
        # The toggle: MOED_WHOLE_STEPS=0 stops at every layer even with every expert pinned
        # (to measure them). Whether one can be taken is the holds' (`has_pin_word`); how
        # many were is their counter (`whole_decodes`).
        self.whole_steps_allowed = os.environ.get("MOED_WHOLE_STEPS", "1") != "0"
        # MOED_HITS_IN_C=0: the holds try no hit (lane or device) and every routed stop goes
        # through Python's path, as before the holds took them (to measure what C saves:
        # bench/gpu_slots.py toggles it between decodes).
        self.hits_in_c = os.environ.get("MOED_HITS_IN_C", "1") != "0"

    def begin(self, n_tokens: int, tokens: np.ndarray | None = None) -> None:
        """Before llama_decode of a batch of `n_tokens` (`tokens`: their ids, None for embeddings)."""
        self.counts.tokens += n_tokens
        if self._begin_whole(n_tokens):
            return
        la, cycle, model = self._model.lookahead, self._cycle, self._model
        if la is not None:
            la.begin_decode(n_tokens, tokens)
        observing = la is not None and la.observing
        cycle.callback.stop_at_router_input(observing, model.router.input_prefix)
        holds = self._bound.holds
        if holds is not None:
            # With the ids final at the stop the holds try a lane layer's hit before Python
            # sees it; with nothing for Python to do at a stop either (no trace, no prediction
            # this step: prefetch off, or the governor has it off) a hit is the whole layer,
            # in C, and the look-ahead's cache estimate hears the layers done alone from the
            # holds' log at the end of the decode (`finish`). A hit only maps pages, which the
            # expert switch does not move.
            final = cycle.ids_final() and self.hits_in_c
            alone = final and cycle.quiet() and not observing and not model.experts_pending()
            holds.begin(final, alone, alone and la is not None and la.mode != "off")

    def finish(self) -> None:
        """After llama_decode: hide and release what the last layer holds."""
        self.counts.decodes += 1
        if self._whole_tokens:
            self._finish_whole()
            return
        la, holds = self._model.lookahead, self._bound.holds
        if la is not None:
            la.end_decode()
        grant, hit_ok = holds.end() if holds is not None else (None, True)
        try:
            self._grants.swap(grant)
        finally:
            for placement in self._bound.placements():
                placement.end_decode()  # after a failure under an offload: all hidden again
        if not hit_ok:
            raise lost()
        if la is not None and holds is not None:
            for layer, experts in holds.take_log():
                la.cache.touch(layer, experts)
        self._cycle.decoded()

    def rebound(self) -> None:
        """The engine was bound again to a daemon that came back: no whole step spans two
        connections, and the look-ahead's estimate of what the daemon holds starts empty."""
        self._whole_tokens = 0
        if self._model.lookahead is not None:
            self._model.lookahead.forget_cache()

    def _begin_whole(self, n_tokens: int) -> bool:
        """A whole step: every expert of the model pinned and now held by the region's pin
        hold (moed.engines.holds), so the graph runs with no stop at all, as with no callback.
        Nothing to predict or prefetch either: the look-ahead sits the step out."""
        holds = self._bound.holds
        if holds is None or not holds.has_pin_word or not self.whole_steps_allowed or not self._cycle.quiet():
            return False
        if self._model.experts_pending() or holds.layers != set(self._model.parts):
            return False
        if not holds.whole_begin():  # nothing else held, the pin word 1, every expert mapped
            return False
        self._whole_tokens = n_tokens
        return True

    def _finish_whole(self) -> None:
        holds = self._bound.holds
        assert holds is not None, "a whole step runs on the holds' pin hold"
        n, k = self._whole_tokens, self._source.n_expert_used
        self._whole_tokens = 0
        # What the step used, as a hit would have counted it: each layer's distinct
        # experts, at most k a token and at most all of them.
        holds.whole_end(len(holds.layers) * min(n * k, self._source.n_experts))

    def warm(self, everything: bool = False) -> int:
        """Map the experts the daemon holds now (`everything`: every expert, reading what it
        lacks) at their addresses with their page-table entries made; returns how many.

        Without it an expert's first use costs a mapping and ~19 minor faults a part
        inside the matmuls (and, for one the daemon lacks, a read): a resident engine
        pays that at load instead. Only the lane layers keep experts mapped (strict
        mode and copy layers hide every released expert). Run bound (ensure_bound).
        """
        holds, src, n = self._bound.holds, self._source, 0
        if holds is None or not holds.layers or holds.held() is not None:
            return 0
        every = np.arange(src.n_experts)
        for layer in sorted(holds.layers):
            experts = [int(e) for e in (every if everything else every[src.resident(layer, every.tolist())])]
            for i in range(0, len(experts), src.n_expert_used):
                grant = self._grants.swap(None, layer, experts[i : i + src.n_expert_used], try_hit=True)
                assert grant is not None, "an acquire of experts grants them"
                try:
                    for expert in grant.experts:
                        holds.place(layer, expert, grant.slot(expert), populate=True)
                finally:
                    self._grants.swap(grant)
                n += len(grant.experts)
        return n

    def record_predictions(self, observer: AheadObserver, width: int) -> None:
        """Also predict one and two layers ahead, `width` per token, for `observer` (traces)."""
        if self._model.lookahead is None:
            raise RuntimeError("this model has no gate-ahead predictor: no predictions to record")
        self._model.lookahead.record(observer, width)

    def stop_recording(self, observer: AheadObserver) -> None:
        la = self._model.lookahead
        assert la is not None, "stop_recording follows record_predictions, which needs the look-ahead"
        la.stop_recording(observer)
