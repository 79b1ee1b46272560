"""The streamer: one loaded llama.cpp model's experts, streamed from a source (the composition root).

What this module owns: building the parts below and wiring each to the narrow faces it
needs, the order across them (install, binding, teardown), and the public face the
engine (moed.engines.llama_cpp), the benches and the tests use. The parts, each with
its own invariants in its module:

- the model's mapping (moed.engines.mapping): install time: every expert address
  inaccessible until acquired, the dense pages locked, the expert pages dropped from
  the page cache, the repacked kernels and their switch, the router's facts and the
  look-ahead built over its weights;
- the binding (moed.engines.binding): the layer holds (moed.engines.holds) and each
  layer's placement over the source's live connection, bound again after a daemon
  restart; `Bound` is what the others read of it;
- the layer cycle (moed.engines.cycle): the eval callback and Python's half of each
  routed stop, with every route a grant leaves by in moed.engines.grants;
- the decode steps (moed.engines.steps): `begin` and `finish` around each
  llama_decode, whole steps, warm;
- the report (moed.engines.report): the counters each part keeps, gathered.

Invariants kept here:
- `install` runs after llama.cpp mapped the model and before the first decode: the
  expert addresses first, then the holds bound over them, then the dense pages.
- Every decode starts bound to the source's live connection (`ensure_bound`, and so
  does `warm`): after the daemon died, everything bound to the old connection is let go
  before the source reconnects, and built again before anything is read.
- What the streamer owns is let go by `close`, after llama.cpp's model is freed,
  in the reverse order it was made: the layer holds (their grant, buffers and hold
  indexes), then the placements `place_on` took over (the device's), then the kernels.
"""

from __future__ import annotations

import contextlib
import functools

from moed.engines.binding import Binding, Bound
from moed.engines.cycle import RouteObserver, StopCycle, check_tensor_layout, substituter_for
from moed.engines.mapping import ModelMapping, snapshot_bases
from moed.engines.options import NO_HOOKS, EngineHooks, EngineOptions
from moed.engines.repack import LayoutPlan
from moed.engines.report import StreamReport, StreamStats
from moed.engines.sources import ExpertSource
from moed.engines.steps import DecodeSteps

__all__ = ["ExpertStreamer", "RouteObserver", "StreamStats", "snapshot_bases"]


class ExpertStreamer:
    """Owns the expert pages of one loaded llama.cpp model and the eval callback that fills them."""

    def __init__(
        self,
        source: ExpertSource,
        options: EngineOptions,
        hooks: EngineHooks = NO_HOOKS,
        layout: LayoutPlan | None = None,
    ):
        """`options`: the engine's (moed.engines.options: strict, the look-ahead's, substitution's);
        `hooks`: its callbacks; `layout`: which weights run on ggml's repacked kernels and where
        the layers compute (moed.engines.repack; None: all plain, on the CPU)."""
        check_tensor_layout()
        # What the streamer owns is let go here, in the reverse order (close).
        self._teardown = contextlib.ExitStack()
        self.source, self.options, self.hooks, self.layout = source, options, hooks, layout
        # Substitution (moed.engines.substitute): None is the exact path, untouched.
        self.substituter = substituter_for(source, options)
        self._model = model = ModelMapping(source, options, hooks, layout)
        self.kernels = model.kernels
        if self.kernels is not None:
            self._teardown.callback(self.kernels.close)  # after the model: nothing computes with them
        # A device computes part of the graph (its placement made by the load between
        # llama.cpp's model and its context, handed over by `place_on`): a failed decode
        # runs on to its end (moed.engines.cycle).
        offload = layout.offload if layout is not None else None
        self._bound = bound = Bound()
        self._cycle = cycle = StopCycle(source, hooks, self.substituter, model, bound, offload is not None)
        release = functools.partial(cycle.grants.swap, closing=True)  # what the holds give back at their close
        self._binding = Binding(source, model, bound, cycle.on_stop, cycle.callback, release, offload is not None)
        # The placements place_on took over: after the holds (registered at install), before the kernels.
        self._teardown.callback(self._binding.close_placed)
        self._steps = steps = DecodeSteps(source, cycle, model, bound)
        counts = (cycle.counts, steps.counts, model.stats, self._binding.counts)
        self._report = StreamReport(counts, bound, self._binding.ledger, model, self.substituter, layout)
        self._expose(cycle, steps)

    def _expose(self, cycle: StopCycle, steps: DecodeSteps) -> None:
        """The public verbs that are one part's own are that part's bound methods."""
        # The eval callback, installed into the context's params by the load; kept referenced
        # for as long as llama.cpp may call it.
        self.c_callback = cycle.callback
        self.observers = cycle.observers  # RouteObserver: traces, tests
        self.begin, self.finish, self.take_error = steps.begin, steps.finish, cycle.take_error
        self.record_predictions, self.stop_recording = steps.record_predictions, steps.stop_recording
        # place_on: the streamer owns the placement from the call on (moed.engines.binding: its
        # `rebind` at a rebind, its `close` at the streamer's); `placed`: those it took over.
        self.place_on, self.placements = self._binding.place_on, self._bound.placements
        self.placed = self._binding.placed
        self.totals, self.report, self.placement_stats = (
            self._report.totals,
            self._report.report,
            self._report.placement_stats,
        )

    # ---- what the parts keep ---------------------------------------------

    @property
    def mapped_files(self) -> list[str]:
        """The files llama.cpp maps: the model's own, or its skeleton (same layout)."""
        return self._model.mapped_files

    @mapped_files.setter
    def mapped_files(self, files: list[str]) -> None:
        self._model.mapped_files = files

    @property
    def pages(self):
        """The expert pages (moed.engines.expert_pages), built at install."""
        return self._model.pages

    @property
    def lookahead(self):
        """The look-ahead (moed.engines.lookahead), built at install (it reads the mapped routers)."""
        return self._model.lookahead

    @property
    def probs_are_logits(self) -> bool:
        return self._model.router.probs_are_logits

    @property
    def holds(self):
        """The layer holds (moed.engines.holds), built at install and again at each rebind."""
        return self._bound.holds

    @property
    def held(self) -> tuple[str, object] | None:
        """What the layer holds hold now: None (an idle engine holds nothing), ("hit", n),
        ("grant", grant) or ("pin", model_id)."""
        return self._bound.held()

    @property
    def hits_in_c(self) -> bool:
        """Whether the holds try each layer's hit in C (moed.engines.steps; MOED_HITS_IN_C=0:
        every stop through Python's path, to measure what C saves)."""
        return self._steps.hits_in_c

    @hits_in_c.setter
    def hits_in_c(self, on: bool) -> None:
        self._steps.hits_in_c = on

    @property
    def dead(self) -> BaseException | None:
        """Why the engine cannot be bound again (None: it can)."""
        return self._binding.dead

    @property
    def stats(self) -> StreamStats:
        """Python's counters (`totals`: the holds' in C included)."""
        return self._report.counters()

    # ---- across parts ----------------------------------------------------

    def install(self, bases_before: set[int]) -> None:
        """After llama.cpp mapped the model (`bases_before`: the files' mappings before the load)."""
        bases = self._model.install_experts(bases_before)
        self._binding.bind()
        self._teardown.callback(self._binding.close_holds)  # first at close: nothing else is let go before
        self._model.install_dense(bases)

    def ensure_bound(self) -> None:
        """Before a decode (and `warm`): the engine's experts come through a live connection
        (moed.engines.binding says how it binds again after the daemon died)."""
        if self._binding.ensure_bound():
            self._steps.rebound()

    def warm(self, everything: bool = False) -> int:
        """Map the experts the daemon holds now (`everything`: every expert), returning how
        many; none is held after (moed.engines.steps)."""
        self.ensure_bound()
        return self._steps.warm(everything)

    def close(self) -> None:
        """Let go of what the streamer owns, after llama.cpp's model is freed (nothing reads
        the experts or computes with the kernels any more): the layer holds' grants, buffers
        and hold indexes, then the placements `place_on` took over, then the kernels. Idempotent."""
        self._teardown.close()
