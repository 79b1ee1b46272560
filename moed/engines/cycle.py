"""The layer cycle: Python's half of each routed layer's stop, inside llama.cpp's eval callback.

What this module owns: the eval callback (moed.engines.ggml_tensor.EvalCallback, its
ask pass in C), the decode's stored error, the route hook, substitution
(moed.engines.substitute) and the route observers, and what a stop does with what the
layer holds (moed.engines.holds, in C) tell it. At every routed stop (each layer's
own: its `ffn_moe_topk-<layer>`, or a device placement's `ffn_moe_weights-<layer>`) the
holds go first: a lane layer's hit, a device layer's hit in its slots, and with nothing
for Python to do, the whole layer. Otherwise they call `on_stop` once, saying what they
did and handing over the grant held until then (and the ids, where they read them);
Python reads the routed ids (unless handed), acquires this layer's distinct
experts (the earlier grant released in the same round trip), makes them visible through
the layer's placement (moed.engines.placement), and answers the holds with the grant it
holds then, which they own from the return (and map, on a lane layer). A placement that
copies a grant's bytes (`copies_grant`: device slots) has its grant let go as soon as
`show` returned, so the holds hold nothing of that layer's. The one path a grant is
released by is moed.engines.grants'. When the
look-ahead is on (prefetch or a trace recording predictions), the callback also stops
at the router's input (`moed.gguf.archs.RouterInput`: `ffn_norm-<layer>`; gpt-oss's is
`attn_post_norm-<layer>`, glm4moe's `post_attn_norm-<layer>`, and for gemma4, llama4
and qwen4exp it is a residual) and hands its rows to moed.engines.lookahead, which
predicts later layers and, after this layer's acquire, prefetches them.

Invariants:
- At the topk of layer L every expert matmul of earlier layers has run (the CPU graph
  is one split in layer order), so the previous grant is hidden and then released in
  the same round trip as L's acquire.
- The look-ahead only reads the graph's tensors and sends prefetches; it never writes a
  tensor, so prefetch cannot change what llama.cpp computes.
- Substitution (off unless a `Substituter` is given) rewrites the ids in place at the
  topk, reading the router's ranking and probabilities through the topk's sources
  (both still live there; with SOFTMAX_WEIGHT gating they are logits, and it is given
  their softmax), after the route hook and before the acquire, the observers and the
  look-ahead see them; off, nothing of it runs.
- An exception in the callback is stored (`take_error`), and the decode wrapper
  re-raises it even though llama_decode reports success. Nothing is swallowed. On the
  CPU alone the callback then answers False, which stops the graph (one split: nothing
  after the failing node runs, and every later graph of that decode stops at its first
  routed layer). Under a GPU offload, False would only leave the current split (ggml's
  scheduler), and a later split's expert matmul would read pages nobody acquired: so
  every expert address reads zeros from the failure to the end of the decode
  (`ExpertPages.open_zeros`), the callback answers True to the end (every top-k is
  computed, so every id a CPU matmul reads is in range), and the decode's end hides
  them all. The holds try no hit and hand over no grant after a failure
  (`LayerHolds.fail`); what they hold is let go at the decode's end.
- A grant has one owner at every instant: what Python holds during a stop (`Held`: the
  grant handed over, or the one acquired in its place) goes back to the holds with the
  answer on every path, errors included, so no error path releases a grant.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from moed.engines import ggml_api, ggml_tensor
from moed.engines.grants import GrantRoutes, Held
from moed.engines.holds import DEVICE_MISSED, LOST, MAP_FAILED, NOT_TRIED, lost
from moed.engines.options import EngineHooks, EngineOptions
from moed.engines.predictor import GATING_SOFTMAX, gate
from moed.engines.sources import ExpertSource, Grant
from moed.engines.substitute import Substituter

if TYPE_CHECKING:
    from moed.engines.binding import Bound
    from moed.engines.mapping import ModelMapping

log = logging.getLogger("moed.engine")

# What the stop function answers the holds: the graph goes on, the grant they hold from the
# return (None: none), and a lane layer's new grant's experts and slots, for them to map.
Answer = tuple[bool, Grant | None] | tuple[bool, Grant | None, list[int] | None, list[int] | None]


class RouteObserver(Protocol):
    """Sees every routed layer's ids (a copy) and the end of every decode (traces)."""

    def route(self, layer: int, ids: np.ndarray) -> None: ...

    def decoded(self) -> None: ...


@dataclass
class CycleCounts:
    """What Python's half of the routed stops did (the holds count what they did in C)."""

    layers: int = 0  # acquires
    experts: int = 0  # experts acquired, summed over acquires
    acquire_s: float = 0.0  # time inside acquire (round trip + daemon reads)
    show_s: float = 0.0  # time mapping / copying pages


def check_tensor_layout() -> None:
    if not ggml_api.layout_matches():
        raise RuntimeError(
            "struct ggml_tensor layout does not match this llama.cpp; moed supports llama-cpp-python==0.3.36"
        )


def substituter_for(source: ExpertSource, options: EngineOptions) -> Substituter | None:
    """The options' substitution (None: `subst` off, the exact path)."""
    if options.subst is None:
        return None
    if not source.tells_residency:
        raise ValueError("subst needs a source that knows what is resident (ExpertSource.tells_residency)")
    return Substituter(options.subst, source.n_experts, source.n_expert_used, options.subst_window, options.subst_rule)


class StopCycle:
    """The eval callback's Python half: a routed stop's state machine and the router's input."""

    def __init__(
        self,
        source: ExpertSource,
        hooks: EngineHooks,
        substituter: Substituter | None,
        model: ModelMapping,
        bound: Bound,
        offloaded: bool,
    ):
        """`model`: the router's facts, the look-ahead and the kernel switch (read after
        install); `bound`: the holds and each layer's placement; `offloaded`: a device
        computes part of the graph (a failed decode runs on to its end: `fail`)."""
        self._source, self._route_hook, self.substituter = source, hooks.route, substituter
        self._model, self._bound, self._offloaded = model, bound, offloaded
        self.grants = GrantRoutes(source, bound)
        self.observers: list[RouteObserver] = []
        self.counts = CycleCounts()
        self.error: BaseException | None = None
        # Its ask pass (every graph node) runs in C; the routed stops go to the layer holds
        # (then `on_stop`), the router-input stops to `on_node`. Kept referenced for as long
        # as llama.cpp may call it.
        self.callback = ggml_tensor.EvalCallback(self.on_node)

    def ids_final(self) -> bool:
        """Nothing rewrites the ids at a stop: no route hook, no substitution."""
        return self._route_hook is None and self.substituter is None

    def quiet(self) -> bool:
        """Nothing for Python to do at a topk: no hook, no substitution, no trace."""
        la = self._model.lookahead
        return self.ids_final() and not self.observers and (la is None or not la.observers)

    def decoded(self) -> None:
        for observer in self.observers:
            observer.decoded()

    def take_error(self) -> BaseException | None:
        err, self.error = self.error, None
        return err

    def on_node(self, tensor: int) -> bool:
        """A computed router-input node (while observing; the routed stops go to the layer
        holds, then `on_stop`); False stops the graph."""
        try:
            model = self._model
            found = ggml_tensor.node(tensor, model.router.input_prefix)
            if found is None or found[0] != ggml_tensor.ROUTER_INPUT:
                return True
            if self.error is not None:
                return self._offloaded  # see on_stop
            if model.experts_pending():
                model.switch_experts(tensor)
            layer = found[1]
            if self._observing(layer):
                assert model.lookahead is not None  # _observing requires the look-ahead
                model.lookahead.observe(layer, ggml_tensor.rows_f32(tensor))
            return True
        except BaseException as exc:  # noqa: BLE001 - must not unwind through C
            return self.fail(exc)

    def on_stop(self, topk: int, layer: int, status: int, grant: Grant | None, ids: bytes | None) -> Answer:
        """A computed routed stop, from the layer holds: `topk` the layer's top-k node (its stop,
        or the ids its `ffn_moe_weights-<n>` stop gathered by; 0: none, an unexpected graph),
        `status` what they did (moed.engines.holds: a hit of that many experts, LANE_MISSED,
        DEVICE_MISSED, NOT_TRIED, LOST, MAP_FAILED), `grant` the grant they held until now,
        Python's now (None: none), `ids` the top-k's ids as they read them (None: not read).

        Answers (the graph goes on, the grant the holds hold from the return, and for a grant
        of a lane layer acquired here its experts and slots, which they map): whatever
        happened, the grant Python holds at the end goes back to the holds with the answer,
        so no error path releases one (after a failure they give it back after the decode)."""
        held = Held(grant)
        stop: tuple[int, int] | None = None  # (layer, top-k node)
        try:
            if not topk:
                raise RuntimeError(f"the routing weights of layer {layer} have no ids source: unexpected graph")
            stop = (layer, topk)
            if self.error is None and self._model.experts_pending():
                self._model.switch_experts(topk)
            if self.error is not None:
                # An earlier layer failed (the holds hand over no grant since). On the CPU:
                # stop this graph at its next stop, before any expert matmul could read pages
                # nobody acquired. Offloaded: the experts read zeros (open_zeros), and the
                # graph runs to its end.
                if self._offloaded:
                    self._bound.placement(layer).skip(*stop)
                return self._offloaded, held.grant
            acquired = self._cycle(layer, topk, status, held, ids)
            return True, held.grant, *self._lane_mapping(layer, held.grant if acquired else None)
        except BaseException as exc:  # noqa: BLE001 - must not unwind through C
            return self.fail(exc, stop), held.grant

    def _lane_mapping(self, layer: int, grant: Grant | None) -> tuple[list[int] | None, list[int] | None]:
        """A lane layer's new grant, as the holds map it: its experts and their slots."""
        holds = self._bound.holds
        if grant is None or holds is None or layer not in holds.layers:
            return None, None
        experts = list(grant.experts)
        return experts, [grant.slot(e) for e in experts]

    def fail(self, exc: BaseException, stop: tuple[int, int] | None = None) -> bool:
        """Store the decode's error; the callback's answer: stop (CPU) or go on over zeros
        (`stop`: the routed layer that failed, whose ids its placement keeps in range)."""
        self.error = exc
        bound = self._bound
        if bound.holds is not None:  # every later stop of this decode must reach here and stop
            bound.holds.fail()
        if not self._offloaded:
            return False
        try:
            for placement in bound.placements():
                placement.failed()
            if stop is not None:
                bound.placement(stop[0]).skip(*stop)
        except BaseException as again:  # noqa: BLE001 - must not unwind through C
            # No readable zeros: the process cannot go on safely (a later split's matmul
            # would fault on an expert nobody acquired). Say why before the fault would.
            log.critical("moed: could not map zero experts after %r: %r", exc, again)
            os.abort()
        return True

    def _observing(self, layer: int) -> bool:
        la = self._model.lookahead
        return la is not None and la.observing and layer in self._model.parts

    def _routed_ids(self, layer: int, tensor: int, read: bytes | None = None) -> np.ndarray:
        """The layer's routed ids, after the route hook and substitution; the observers see them.
        `read`: the holds' copy, where they read them (the ids were final: no hook, no
        substitution), so the node is not read twice (and a device hit rewrote it already)."""
        if read is not None:
            ids = np.frombuffer(read, np.int32).reshape(-1, int(ggml_api.GgmlTensor.from_address(tensor).ne[0]))
            for observer in self.observers:
                observer.route(layer, ids)
            return ids
        if self._route_hook is not None:
            self._route_hook(layer, ggml_tensor.topk_view(tensor))
        # A layer whose experts a table chose by token id (deepseek4's hash layers) is left
        # as it is: the model needs exactly those, and there is no ranking to substitute from.
        if self.substituter is not None and ggml_tensor.router_selected(tensor):
            ranked, probs, on_logits = ggml_tensor.router_arrays(tensor)
            if on_logits:  # llama4 selects on the logits: its probabilities are their gating
                probs = gate(probs, self._model.router.gating)
            elif self._model.router.probs_are_logits:
                probs = gate(probs, GATING_SOFTMAX)  # same ratios as exp(logit) differences: what r means
            self.substituter.rewrite(layer, ggml_tensor.topk_view(tensor), ranked, probs, self._source.resident)
        ids = ggml_tensor.topk_ids(tensor)
        for observer in self.observers:
            observer.route(layer, ids)
        return ids

    def _cycle(self, layer: int, topk: int, status: int, held: Held, read: bytes | None = None) -> bool:
        """Python's half of layer `layer`'s stop (`topk`: its top-k node): `status` from the
        holds; `held` the grant held until now, let go here (hidden, then released with this
        layer's acquire, or alone at a hit), or kept for the holds when this layer acquires
        nothing; `read`: the ids as the holds read them. True when `held` is now this layer's
        own grant (acquired here, for the holds to map on a lane layer)."""
        holds = self._bound.holds
        assert holds is not None, "install builds the layer holds"
        ids = self._routed_ids(layer, topk, read)
        if status == LOST:
            raise lost()
        if status == MAP_FAILED:
            raise holds.map_error()
        placement = self._bound.placement(layer)
        experts = placement.to_acquire(layer, ids) if status <= 0 else []
        la = self._model.lookahead
        if status > 0:  # a hit the holds took and hold: Python scores it and lets the grant go
            self.grants.swap(held.take())
            if la is not None:
                la.routed(layer, ids, status, 0.0)  # the holds count their own stall
            return False
        t0 = time.perf_counter()
        if experts:
            try_hit = status in (NOT_TRIED, DEVICE_MISSED)  # the holds tried no hit on the daemon's slots
            held.grant = self.grants.swap(held.take(), layer, experts, try_hit)
        t1 = time.perf_counter()
        grant = held.grant if experts else None  # else the one handed over, kept: released with a later acquire
        placement.show(grant, topk, layer)
        if grant is not None and placement.copies_grant:  # its bytes are copies now: it may go
            self.grants.swap(held.take())
        c = self.counts
        c.acquire_s += t1 - t0
        c.show_s += time.perf_counter() - t1
        c.layers += 1
        c.experts += len(experts)
        if la is not None:
            la.routed(layer, ids, len(experts), t1 - t0)
        return held.grant is not None and bool(experts)
