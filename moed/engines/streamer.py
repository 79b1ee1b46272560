"""The per-layer expert cycle inside llama.cpp's eval callback.

What this module owns: installing a source's experts into a loaded model's
mapping (inaccessible until acquired, dense pages locked, expert pages dropped
from the page cache), and Python's half of each routed layer's cycle. At every
`ffn_moe_topk-<layer>` the layer holds (moed.engines.holds, in C) go first: a lane
layer's hit, and with nothing for Python to do, the whole layer. Otherwise they call
`_on_route` once, saying what they did and handing over the grant held until then;
Python reads the routed ids, acquires this layer's distinct experts (the earlier
grant released in the same round trip), hands the grant to the holds in one call
and makes the experts visible through the layer's placement (moed.engines.placement).
When the look-ahead is on (prefetch or
a trace recording predictions), the callback also stops at the router's input
(`moed.gguf.archs.RouterInput`: `ffn_norm-<layer>`; gpt-oss's is
`attn_post_norm-<layer>`, glm4moe's `post_attn_norm-<layer>`, and for gemma4,
llama4 and qwen4exp it is a residual) and hands its rows to `moed.engines.lookahead`,
which predicts later layers and, after this layer's acquire, prefetches them.

Invariants (what must happen before what):
- `install` runs after llama.cpp mapped the model and before the first decode.
- Every decode starts bound to the source's live connection (`ensure_bound`): after
  the daemon died, the layer holds built over its region, tables and segments are
  let go and every expert address is PROT_NONE again before the source reconnects,
  and the holds are built again over the new connection before anything is read.
- At the topk of layer L every expert matmul of earlier layers has run (the CPU
  graph is one split in layer order), so the previous grant is hidden and then
  released in the same round trip as L's acquire.
- What a layer holds has one owner, the layer holds: at most one of their own
  hit grant, a Python grant and the pin hold. A grant Python acquired is handed to them
  (`LayerHolds.hold`) and handed back at the next stop or after the decode.
- Pages are hidden before their grant is released: once the daemon may reuse a
  slot, this process can no longer read it.
- `finish` (after llama_decode returns) hides and releases what is still held
  (`LayerHolds.end`), so an idle engine holds nothing.
- A whole step (every expert pinned: `begin` took the holds' pin hold) makes no
  stop at all and holds nothing per layer; `finish` lets the pin hold go. Only a
  quiet engine (no hook, substitution or trace) takes one.
- The look-ahead only reads the graph's tensors and sends prefetches; it never
  writes a tensor, so prefetch cannot change what llama.cpp computes.
- Substitution (off unless a `Substituter` is given; moed.engines.substitute)
  rewrites the ids in place at the topk, reading the router's ranking and
  probabilities through the topk's sources (both still live there; with
  SOFTMAX_WEIGHT gating they are logits, and it is given their softmax), after the
  route hook and before the acquire, the observers and the look-ahead see them;
  off, nothing of it runs.
- An exception in the callback is stored, and the decode wrapper re-raises it even
  though llama_decode reports success. Nothing is swallowed. On the CPU alone the
  callback then answers False, which stops the graph (one split: nothing after the
  failing node runs, and every later graph of that decode stops at its first routed
  layer). Under a GPU offload, False would only leave the current split (ggml's
  scheduler), and a later split's expert matmul would read pages nobody acquired: so
  every expert address reads zeros from the failure to the end of the decode
  (`ExpertPages.open_zeros`), the callback answers True to the end (every top-k is
  computed, so every id a CPU matmul reads is in range), and `finish` hides them all.
  The holds try no hit and hand over no grant after a failure (`LayerHolds.fail`);
  what they hold is let go by `finish`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np

from moed import libc
from moed.engines import ggml_tensor, vm
from moed.engines.expert_pages import ExpertPages, PartSpan, gaps
from moed.engines.holds import LOST, MAP_FAILED, NOT_TRIED, HoldStats, LayerHolds, lost
from moed.engines.kernels import KernelSwitch
from moed.engines.lookahead import AheadObserver, Lookahead
from moed.engines.options import NO_HOOKS, EngineHooks, EngineOptions
from moed.engines.placement import CpuPages, Placement
from moed.engines.predictor import GATING_SOFTMAX, gate
from moed.engines.repack import LayoutPlan, dense_offloaded, prepare
from moed.engines.skeleton import expert_ranges
from moed.engines.sources import ExpertSource, Grant
from moed.engines.substitute import Substituter
from moed.gguf.archs import LAZY_TENSORS
from moed.gguf.header import read_split

if TYPE_CHECKING:
    from moed.engines.device_host import HostSlots
    from moed.engines.device_slots import DeviceSlots

log = logging.getLogger("moed.engine")
SlotsT = TypeVar("SlotsT", "DeviceSlots", "HostSlots")


class RouteObserver(Protocol):
    """Sees every routed layer's ids (a copy) and the end of every decode (traces)."""

    def route(self, layer: int, ids: np.ndarray) -> None: ...

    def decoded(self) -> None: ...


@dataclass
class StreamStats:
    layers: int = 0  # acquires
    experts: int = 0  # experts acquired, summed over acquires
    acquire_s: float = 0.0  # time inside acquire (round trip + daemon reads)
    show_s: float = 0.0  # time mapping / copying pages
    decodes: int = 0
    whole_decodes: int = 0  # decodes with no per-layer stop (every expert pinned: the holds count them)
    tokens: int = 0  # tokens in all decodes (prompt and generated)
    dense_locked_bytes: int = 0
    dense_lock_error: str = ""
    dropped_expert_cache_bytes: int = 0
    rebinds: int = 0  # times the engine was bound again to a daemon that came back (ensure_bound)


def snapshot_bases(files: list[str]) -> set[int]:
    """Mapping bases of `files` that exist before a load (so they are not mistaken for ours)."""
    return set().union(*(vm.mapping_bases(path) for path in files))


def _substituter(source: ExpertSource, options: EngineOptions) -> Substituter | None:
    """The options' substitution (None: `subst` off, the exact path)."""
    if options.subst is None:
        return None
    if not source.tells_residency:
        raise ValueError("subst needs a source that knows what is resident (ExpertSource.tells_residency)")
    return Substituter(options.subst, source.n_experts, source.n_expert_used, options.subst_window, options.subst_rule)


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
        if not ggml_tensor.layout_matches():
            raise RuntimeError(
                "struct ggml_tensor layout does not match this llama.cpp; moed supports llama-cpp-python==0.3.36"
            )
        # What the streamer owns is let go here, in the reverse order (close): the holds,
        # the device slots, then the kernels; all after llama.cpp's model is freed.
        self._teardown = contextlib.ExitStack()
        self.source = source
        self.options = options
        self.hooks = hooks
        self.strict = options.strict
        self.observers: list[RouteObserver] = []
        self.stats = StreamStats()
        self.pages: ExpertPages | None = None
        # The files llama.cpp maps: the model's own, or its skeleton (same layout).
        self.mapped_files: list[str] = list(source.files)
        self.prefetch = options.prefetch
        self.prefetch_width = options.prefetch_width or source.n_expert_used
        self.lookahead: Lookahead | None = None  # built at install (it reads the mapped routers)
        self.error: BaseException | None = None
        # Substitution (moed.engines.substitute): None is the exact path, untouched.
        self.substituter = _substituter(source, options)
        self._parts: dict[int, list[PartSpan]] = {}
        # Where each layer's experts are made computable (moed.engines.placement): the CPU's
        # pages unless a device placement took the layer at load. Fixed after install.
        self.cpu: CpuPages | None = None
        self._placements: dict[int, Placement] = {}
        # Relaxed mode on all-zero-copy layers: the lane layers, whose hits the layer holds
        # take in C and whose expert addresses they alone map.
        self._zero_copy_layers: set[int] = set()
        # The one owner of what the routed layers hold (moed.engines.holds): built at install.
        self.holds: LayerHolds | None = None
        # The eval callback: its ask pass (every graph node) runs in C; the routed stops go to
        # the layer holds (then `_on_route`), the router-input stops to `_on_node`. Kept
        # referenced for as long as llama.cpp may call it.
        self.c_callback = ggml_tensor.EvalCallback(self._on_node)
        # The router's input node (moed.gguf.archs.RouterInput), `<prefix><layer>`: ffn_norm-,
        # or the arch's own (set at install).
        self.router_input_prefix = ggml_tensor.ROUTER_INPUT_PREFIX
        # Each routed layer's stop: its top-k, or (device slots) the routing weights after it.
        self.route_prefix = ggml_tensor.TOPK_PREFIX
        # SOFTMAX_WEIGHT gating (gpt-oss): `ffn_moe_probs-L` holds the logits, so the
        # substituter is given their softmax, the probabilities its `r` compares.
        self.probs_are_logits = False
        self.router_gating = GATING_SOFTMAX
        # Which weights run on ggml's repacked kernels (moed.engines.repack); None: all plain.
        self.layout = layout
        self.kernels: KernelSwitch | None = prepare(read_split(self.mapped_files[0]), layout) if layout else None
        if self.kernels is not None:
            self._teardown.callback(self.kernels.close)  # after the model: nothing computes with them
        self._headers: list = []
        self._bases: list[int] = []
        self._whole_tokens = 0  # tokens of the whole step under way (0: none)
        # The toggle: MOED_WHOLE_STEPS=0 stops at every layer even with every expert pinned
        # (to measure them). Whether one can be taken is the holds' (`has_pin_word`); how
        # many were is their counter (`whole_decodes`).
        self.whole_steps_allowed = os.environ.get("MOED_WHOLE_STEPS", "1") != "0"
        # Device expert slots a layer for the offloaded layers (moed.engines.device_slots, or
        # device_host's zero copy): made by the load, between llama.cpp's model and its
        # context (`adopt_slots`); None without.
        offload = layout.offload if layout is not None else None
        self.gpu_slots = offload.gpu_slots if offload is not None else 0
        self.slots: DeviceSlots | HostSlots | None = None
        # A device computes part of the graph: a failed decode runs on to its end (_fail).
        self._offloaded = offload is not None
        # The source's connection the holds are bound to (ensure_bound), and why the engine
        # cannot be bound again (None: it can).
        self._generation = 0
        self.dead: BaseException | None = None
        # The counters of layer holds let go at a rebind, so the engine's totals run on.
        self._past_holds = HoldStats()
        self._past_layer_s: dict[int, float] = {}

    # ---- install ---------------------------------------------------------

    def install(self, bases_before: set[int]) -> None:
        bases = self._find_bases(bases_before)
        spans = []
        for layer in self.source.moe_layers:
            for ext in self.source.extents(layer):
                spans.append(
                    PartSpan(
                        layer, ext.part, bases[ext.shard] + ext.offset, ext.bytes_per_expert, self.source.n_experts
                    )
                )
        self.pages = ExpertPages(spans, strict=self.strict)
        self.pages.install()
        for span in spans:
            self._parts.setdefault(span.layer, []).append(span)
        if not self.strict:
            self._zero_copy_layers = {layer for layer, ss in self._parts.items() if all(s.zero_copy for s in ss)}
        self._placements = {}
        self._bind()
        self._teardown.callback(self._close_holds)  # first at close: nothing else is let go before
        self._drop_expert_cache()
        headers = read_split(self.mapped_files[0])  # one header read serves the three steps below
        self._lock_dense(bases, headers)
        self._install_lookahead(headers, bases)
        if self.kernels is not None:
            self._unlock_placed_dense(headers, bases)
            self._headers, self._bases = headers, bases  # for the expert switch at the first node

    def _bind(self) -> None:
        """The layer holds and the CPU placement over the source's connection as it is now (at
        install, and again after the daemon came back: `ensure_bound`)."""
        # MOED_LANE=0: no lane layers, every layer through Python's path (to measure the lane,
        # or to rule it out). With a GPU offload the top-k may be in a device's memory, which
        # the holds (C, raw pointers) do not read: Python reads it through ggml's backend API.
        assert self.pages is not None, "install builds the pages first"
        self._generation = self.source.generation()
        lane = self._zero_copy_layers if os.environ.get("MOED_LANE") != "0" and not self._offloaded else set()
        lane_source = self.source.lane() if lane else None
        lane_parts = {layer: self._parts[layer] for layer in lane} if lane_source is not None else {}
        self.holds = LayerHolds(self._on_route, self.source.n_experts, lane_source, lane_parts)
        self.c_callback.set_holds(self.holds.handle)  # the path is chosen per decode (begin)
        old, self.cpu = self.cpu, CpuPages(self.pages, self._parts, self.holds)
        for layer in self._parts:  # a device placement keeps its layers (chosen at load)
            if self._placements.get(layer, old) is old:
                self._placements[layer] = self.cpu

    def ensure_bound(self) -> None:
        """Before a decode (and `warm`): the engine's experts come through a live connection.

        When the source's connection was lost (the daemon died; `ExpertSource.connected`) or
        replaced (`generation`), nothing of the old one may be read or mapped any more: the
        layer holds are let go (their hit grant released into its own, old, region; the C
        lane's pointers to the old tables and segments freed with them), every expert address
        goes back to PROT_NONE (ExpertPages.reset: the old segments' pages unmapped, the
        "which slot is behind which address" memory cleared), then the source reconnects
        (bounded: DaemonUnavailable when the daemon does not come back, and the engine stays
        unbound until a later decode succeeds) and the holds and CPU placement are built
        again over the new connection. llama.cpp's model and context (the KV cache) are kept.
        Device slots that copied their experts keep them (the bytes are the file's); slots
        that imported the old daemon's segments are not imported again into a running
        context (HostSlots.rebind raises, before the old segments are dropped, and every
        later decode raises the same: the engine must be built again).
        """
        if self.dead is not None:
            raise self.dead
        src = self.source
        if self.holds is not None and src.generation() == self._generation and src.connected():
            return
        self._unbind()
        if self.slots is not None:
            try:
                self.slots.rebind()  # before the client drops the old segments: an import reads them
            except BaseException as exc:
                self.dead = exc
                raise
        src.reconnect()
        self._bind()
        if self.lookahead is not None:
            self.lookahead.forget_cache()
        self.stats.rebinds += 1

    def _unbind(self) -> None:
        """Let go of everything bound to the old connection (ensure_bound)."""
        self._close_holds()
        self._whole_tokens = 0
        if self.pages is not None:
            self.pages.reset()

    def _experts_pending(self) -> bool:
        return self.kernels is not None and self.kernels.experts_pending

    def _unlock_placed_dense(self, headers: list, bases: list[int]) -> None:
        """The dense weights llama.cpp's load placed in CPU_REPACK (moed.engines.repack.prepare)
        were read from the mapping once; their file ranges need not stay locked."""
        from moed.engines.repack import dense_repacked

        assert self.layout is not None
        for shard, t in dense_repacked(headers, self.layout):
            lo, hi = vm.page_ceil(bases[shard] + t.offset), vm.page_floor(bases[shard] + t.offset + t.n_bytes)
            if hi > lo:
                libc.munlock(lo, hi - lo)
                self.stats.dense_locked_bytes -= hi - lo

    def _switch_experts(self, node: int) -> None:
        """The repacked experts onto their kernels, found from `node`: the first graph node
        Python sees, before any expert matmul of the first decode (until then `begin` lets
        the holds do no stop alone)."""
        from moed.engines.repack import switch_experts

        assert self.kernels is not None and self.layout is not None
        switch_experts(self.kernels, node, self._headers, self._bases, self.layout)

    def _install_lookahead(self, headers: list, bases: list[int]) -> None:
        """Read the routers from the (now locked) dense pages; fold nothing until first use."""
        from moed.engines.predictor import (
            GATING_SOFTMAX_WEIGHT,
            GatePredictor,
            gating_of,
            graph_moe_layers,
            load_routers,
            router_input,
        )

        arch = str(headers[0].get("general.architecture", ""))
        self.router_input_prefix = router_input(arch).prefix
        self.router_gating = gating_of(headers[0])
        self.probs_are_logits = self.router_gating == GATING_SOFTMAX_WEIGHT
        layers = graph_moe_layers(headers[0], self.source.moe_layers)  # no prefetch into MTP layers
        try:
            routers, gating = load_routers(headers, bases, layers)
            predictor = GatePredictor(routers, layers, gating)
        except (ValueError, KeyError, NotImplementedError) as exc:
            if self.prefetch != "off":
                raise
            log.info("no gate-ahead predictor for this model: %s", exc)
            predictor = None
        self.lookahead = Lookahead(
            predictor,
            self.source,
            self.prefetch,
            self.prefetch_width,
            adapt=self.options.prefetch_adapt,
            predict_hook=self.hooks.predict,
            layers=layers,
        )

    def record_predictions(self, observer: AheadObserver, width: int) -> None:
        """Also predict one and two layers ahead, `width` per token, for `observer` (traces)."""
        if self.lookahead is None:
            raise RuntimeError("this model has no gate-ahead predictor: no predictions to record")
        self.lookahead.record(observer, width)

    def stop_recording(self, observer: AheadObserver) -> None:
        assert self.lookahead is not None, "stop_recording follows record_predictions, which needs the look-ahead"
        self.lookahead.stop_recording(observer)

    def _find_bases(self, bases_before: set[int]) -> list[int]:
        bases = []
        for path in self.mapped_files:
            base = vm.file_mapping_base(path, bases_before)
            if base is None:
                raise RuntimeError(f"llama.cpp did not mmap {path}: load with use_mmap=True")
            bases.append(base)
        return bases

    def _drop_expert_cache(self) -> None:
        """llama.cpp populated the whole mapping at load; give the expert pages back to the kernel."""
        for shard, path in enumerate(self.mapped_files):
            fd = os.open(path, os.O_RDONLY)
            try:
                for lo, hi in expert_ranges(self.source, shard):
                    os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)
                    self.stats.dropped_expert_cache_bytes += hi - lo
            finally:
                os.close(fd)

    def _lock_dense(self, bases: list[int], headers: list) -> None:
        """mlock what is left of the mapping: the dense weights must never be re-read per token.
        The tables llama.cpp reads lazily (archs.LAZY_TENSORS: a few rows a token, loaded
        with LLAMA_LAZY_MODE_ON) stay unlocked, page-rounded inward: locking them would
        pin gigabytes (Gemma 4's and Qwen3.8's per-layer token embeddings) for rows the
        page cache serves; so do the weights a GPU offload copied into the device's memory."""
        assert self.pages is not None, "install builds the pages before locking"
        vmas = []
        for base, path in zip(bases, self.mapped_files):
            vmas += vm.mapped_ranges(base, path)
        offloaded = {t.name for _, t in dense_offloaded(headers, self.layout)} if self.layout else set()
        holes = sorted(
            (vm.page_ceil(bases[shard] + t.offset), vm.page_floor(bases[shard] + t.offset + t.n_bytes))
            for shard, h in enumerate(headers)
            for t in h.tensors
            if t.name in LAZY_TENSORS or t.name in offloaded  # the GPU's copy is the one computed on
        )
        runs = [run for lo, hi in self.pages.dense_runs(vmas) for run in gaps(lo, hi, holes)]
        for lo, hi in runs:
            try:
                libc.mlock(lo, hi - lo)
                self.stats.dense_locked_bytes += hi - lo
            except OSError as exc:
                if not self.stats.dense_lock_error:
                    self.stats.dense_lock_error = str(exc)
                    warnings.warn(
                        f"moed: could not lock the dense weights ({exc}); under memory "
                        "pressure they will be re-read from disk (raise RLIMIT_MEMLOCK)",
                        RuntimeWarning,
                        stacklevel=2,
                    )

    # ---- the eval callback -----------------------------------------------

    def _on_node(self, tensor: int) -> bool:
        """A computed router-input node (moed.gguf.archs.RouterInput: `ffn_norm-<n>` or the
        arch's own, while observing; the routed stops go to the layer holds, then
        `_on_route`); False stops the graph."""
        try:
            found = ggml_tensor.node(tensor, self.router_input_prefix, self.route_prefix)
            if found is None or found[0] != ggml_tensor.ROUTER_INPUT:
                return True
            if self.error is not None:
                return self._offloaded  # see _on_route
            if self._experts_pending():
                self._switch_experts(tensor)
            layer = found[1]
            if self._observing(layer):
                assert self.lookahead is not None  # _observing requires the look-ahead
                self.lookahead.observe(layer, ggml_tensor.rows_f32(tensor))
            return True
        except BaseException as exc:  # noqa: BLE001 - must not unwind through C
            return self._fail(exc)

    def _on_route(self, tensor: int, layer: int, status: int, grant: Grant | None) -> bool:
        """A computed routed stop (`ffn_moe_topk-<n>`, or `ffn_moe_weights-<n>` for device
        slots), from the layer holds: `status` says what they did (moed.engines.holds: a hit
        of that many experts, MISSED, NOT_TRIED, LOST, MAP_FAILED) and `grant` is the grant
        they held until now, Python's to let go (None: none). False stops the graph."""
        stop: tuple[int, int] | None = None  # (layer, top-k node)
        try:
            try:
                stop = (layer, ggml_tensor.topk_of(tensor, self.route_prefix))
                if self.error is None and self._experts_pending():
                    self._switch_experts(tensor)
            except BaseException:
                if grant is not None:
                    self._let_go_quietly(grant)
                raise
            if self.error is not None:
                # An earlier layer failed (the holds hand over no grant since). On the CPU:
                # stop this graph at its next stop, before any expert matmul could read pages
                # nobody acquired. Offloaded: the experts read zeros (open_zeros), and the
                # graph runs to its end.
                if grant is not None:
                    self._let_go_quietly(grant)
                if self._offloaded:
                    self._placements[layer].skip(*stop)
                return self._offloaded
            self._cycle(layer, stop[1], status, grant)
            return True
        except BaseException as exc:  # noqa: BLE001 - must not unwind through C
            return self._fail(exc, stop)

    def _fail(self, exc: BaseException, stop: tuple[int, int] | None = None) -> bool:
        """Store the decode's error; the callback's answer: stop (CPU) or go on over zeros
        (`stop`: the routed layer that failed, whose ids its placement keeps in range)."""
        self.error = exc
        if self.holds is not None:  # every later stop of this decode must reach here and stop
            self.holds.fail()
        if not self._offloaded:
            return False
        try:
            for placement in self.placements():
                placement.failed()
            if stop is not None:
                self._placements[stop[0]].skip(*stop)
        except BaseException as again:  # noqa: BLE001 - must not unwind through C
            # No readable zeros: the process cannot go on safely (a later split's matmul
            # would fault on an expert nobody acquired). Say why before the fault would.
            log.critical("moed: could not map zero experts after %r: %r", exc, again)
            os.abort()
        return True

    def _observing(self, layer: int) -> bool:
        la = self.lookahead
        return la is not None and la.observing and layer in self._parts

    def _route(self, layer: int, tensor: int) -> np.ndarray:
        if self.hooks.route is not None:
            self.hooks.route(layer, ggml_tensor.topk_view(tensor))
        # A layer whose experts a table chose by token id (deepseek4's hash layers) is left
        # as it is: the model needs exactly those, and there is no ranking to substitute from.
        if self.substituter is not None and ggml_tensor.router_selected(tensor):
            ranked, probs, on_logits = ggml_tensor.router_arrays(tensor)
            if on_logits:  # llama4 selects on the logits: its probabilities are their gating
                probs = gate(probs, self.router_gating)
            elif self.probs_are_logits:
                probs = gate(probs, GATING_SOFTMAX)  # same ratios as exp(logit) differences: what r means
            self.substituter.rewrite(layer, ggml_tensor.topk_view(tensor), ranked, probs, self.source.resident)
        ids = ggml_tensor.topk_ids(tensor)
        for observer in self.observers:
            observer.route(layer, ids)
        return ids

    def _cycle(self, layer: int, topk: int, status: int, prev: Grant | None) -> None:
        """Python's half of layer `layer`'s stop (`topk`: its top-k node): `status` from the
        holds, `prev` the grant held until now, let go here (hidden, then released with this
        layer's acquire, or handed back to the holds when it acquires nothing)."""
        holds = self.holds
        assert holds is not None, "install builds the layer holds"
        try:
            ids = self._route(layer, topk)
            if status == LOST:
                raise lost()
            if status == MAP_FAILED:
                raise holds.map_error()
            placement = self._placements[layer]
            experts = placement.needs(layer, ids) if status <= 0 else []
        except BaseException:
            if prev is not None:
                self._let_go_quietly(prev)
            raise
        la = self.lookahead
        if status > 0:  # a hit the holds took and hold: Python scores it and lets `prev` go
            if prev is not None:
                self._let_go(prev)
            if la is not None:
                la.routed(layer, ids, status, 0.0)  # the holds count their own stall
            return
        t0 = time.perf_counter()
        grant = None
        if experts:
            if prev is not None:
                self._hide(prev)
            try:
                grant = self._acquire(layer, experts, prev, try_hit=status == NOT_TRIED)
            except BaseException:
                if prev is not None:
                    self._release_quietly(prev)
                raise
        t1 = time.perf_counter()
        if grant is not None:
            holds.hold(grant)  # held by the holds (a lane layer's slots mapped): the one call back
        elif prev is not None:
            holds.hold(prev, show=False)  # nothing acquired: released with a later acquire
        placement.show(grant, topk, layer)
        self.stats.acquire_s += t1 - t0
        self.stats.show_s += time.perf_counter() - t1
        self.stats.layers += 1
        self.stats.experts += len(experts)
        if la is not None:
            la.routed(layer, ids, len(experts), t1 - t0)

    def _acquire(self, layer: int, experts: list[int], prev: Grant | None, try_hit: bool) -> Grant:
        """`experts` of `layer`, `prev` released in the same step: the source's hit first when
        the holds did not try one (NOT_TRIED), else (or when it misses) the source's acquire."""
        grant = self.source.hit(layer, experts, release=prev) if try_hit else None
        return grant if grant is not None else self.source.acquire(layer, experts, release=prev)

    def _let_go(self, grant: Grant) -> None:
        """Hide `grant`, then release it (its layer's matmuls have run)."""
        self._hide(grant)
        self.source.release(grant)

    def _let_go_quietly(self, grant: Grant) -> None:
        try:
            self._hide(grant)
        finally:
            self._release_quietly(grant)

    @property
    def held(self) -> tuple[str, object] | None:
        """What the layer holds hold now: None (an idle engine holds nothing), ("hit", n),
        ("grant", grant) or ("pin", model_id)."""
        return self.holds.held() if self.holds is not None else None

    def warm(self, everything: bool = False) -> int:
        """Map the experts the daemon holds now (`everything`: every expert, reading what it
        lacks) at their addresses with their page-table entries made; returns how many.

        Without it an expert's first use costs a mapping and ~19 minor faults a part
        inside the matmuls (and, for one the daemon lacks, a read): a resident engine
        pays that at load instead. Only the lane layers keep experts mapped (strict
        mode and copy layers hide every released expert). Each acquire is a lease like
        a decode's, released at once; none is held after.
        """
        self.ensure_bound()
        holds, src, n = self.holds, self.source, 0
        if holds is None or not holds.layers or holds.held() is not None:
            return 0
        every = np.arange(src.n_experts)
        for layer in sorted(holds.layers):
            experts = [int(e) for e in (every if everything else every[src.resident(layer, every.tolist())])]
            for i in range(0, len(experts), src.n_expert_used):
                grant = self._acquire(layer, experts[i : i + src.n_expert_used], None, try_hit=True)
                try:
                    for expert in grant.experts:
                        holds.place(layer, expert, grant.slot(expert), populate=True)
                finally:
                    src.release(grant)
                n += len(grant.experts)
        return n

    def _hide(self, grant: Grant) -> None:
        self._placements[grant.layer].hide(grant)

    def placements(self) -> list[Placement]:
        """Every placement the model's layers use, each once."""
        return list({id(p): p for p in self._placements.values()}.values())

    def place_on(self, placement: Placement, layers: list[int], stop: bytes | None = None) -> None:
        """`layers`' experts are made computable by `placement` (at load, before any decode);
        `stop`: every routed layer's stop becomes `<stop><n>` (ggml_tensor.WEIGHTS_PREFIX: a
        placement that rewrites the ids after the routing weights were gathered by them)."""
        if stop is not None:
            if self.holds is not None and self.holds.layers:
                raise RuntimeError("the layer holds read top-k nodes on lane layers: no other stop with them")
            self.route_prefix = stop
            self.c_callback.set_route(stop)
        for layer in layers:
            if layer not in self._placements:
                raise ValueError(f"layer {layer} has no routed experts")
            self._placements[layer] = placement

    def _release_quietly(self, grant: Grant) -> None:
        try:
            self.source.release(grant)
        except Exception as exc:  # noqa: BLE001 - the grant may already be gone with the failed acquire
            log.debug("release after failed acquire: %s", exc)

    def begin(self, n_tokens: int, tokens: np.ndarray | None = None) -> None:
        """Before llama_decode of a batch of `n_tokens` (`tokens`: their ids, None for embeddings)."""
        self.stats.tokens += n_tokens
        if self._begin_whole(n_tokens):
            return
        la = self.lookahead
        if la is not None:
            la.begin_decode(n_tokens, tokens)
        observing = la is not None and la.observing
        self.c_callback.stop_at_router_input(observing, self.router_input_prefix)
        if self.holds is not None:
            # With no hook and no substitution the ids are final at the stop, so the holds
            # try a lane layer's hit before Python sees it; with nothing for Python to do at
            # a stop either (no trace, no prediction this step: prefetch off, or the governor
            # has it off) a hit is the whole layer, in C, and the look-ahead's cache estimate
            # hears the layers done alone from the holds' log at the end of the decode
            # (`finish`). Repacked experts not yet switched to their kernels: Python must see
            # this decode's first stop (`_on_route` switches them there, before the layer's
            # expert matmuls; a hit only maps pages, which the switch does not move), so no
            # stop is done alone.
            final = self.hooks.route is None and self.substituter is None
            alone = final and self._quiet() and not observing and not self._experts_pending()
            self.holds.begin(final, alone, alone and la is not None and la.mode != "off")

    def _quiet(self) -> bool:
        """Nothing for Python to do at a topk: no hook, no substitution, no trace."""
        la = self.lookahead
        return (
            self.hooks.route is None
            and self.substituter is None
            and not self.observers
            and (la is None or not la.observers)
        )

    def _begin_whole(self, n_tokens: int) -> bool:
        """A whole step: every expert of the model pinned and now held by the region's pin
        hold (moed.engines.holds), so the graph runs with no stop at all, as with no callback.
        Nothing to predict or prefetch either: the look-ahead sits the step out. Only when
        every routed layer is a lane layer (the pin hold maps and checks those)."""
        holds = self.holds
        if holds is None or not holds.has_pin_word or not self.whole_steps_allowed or not self._quiet():
            return False
        if self._experts_pending() or holds.layers != set(self._parts):
            return False
        if not holds.whole_begin():  # nothing else held, the pin word 1, every expert mapped
            return False
        self._whole_tokens = n_tokens
        return True

    def _finish_whole(self) -> None:
        assert self.holds is not None, "a whole step runs on the holds' pin hold"
        n, k = self._whole_tokens, self.source.n_expert_used
        self._whole_tokens = 0
        # What the step used, as a hit would have counted it: each layer's distinct
        # experts, at most k a token and at most all of them.
        self.holds.whole_end(len(self.holds.layers) * min(n * k, self.source.n_experts))

    def finish(self) -> None:
        """After llama_decode: hide and release what the last layer holds."""
        self.stats.decodes += 1
        if self._whole_tokens:
            self._finish_whole()
            return
        la = self.lookahead
        if la is not None:
            la.end_decode()
        grant, hit_ok = self.holds.end() if self.holds is not None else (None, True)
        try:
            if grant is not None:
                self._let_go(grant)
        finally:
            for placement in self.placements():
                placement.end_decode()  # after a failure under an offload: all hidden again
        if not hit_ok:
            raise lost()
        if la is not None and self.holds is not None:
            for layer, experts in self.holds.take_log():
                la.cache.touch(layer, experts)
        for observer in self.observers:
            observer.decoded()

    def totals(self) -> StreamStats:
        """This engine's counters, the layers the holds took in C included."""
        out = StreamStats(**vars(self.stats))
        if self.holds is not None or self._past_holds.layers:
            hs = self._hold_stats()
            out.layers += hs.layers
            out.experts += hs.experts
            out.acquire_s += hs.acquire_s
            out.show_s += hs.show_s
            out.whole_decodes = hs.whole_decodes
        return out

    def report(self) -> dict:
        """This engine's counters as `StreamedLlama.stream_stats()` gives them (its docstring
        says what each means): the cycle's, every placement's, the look-ahead's, the
        substituter's, the kernels' and where the layers compute."""
        s = self.totals()
        out = dict(vars(s))
        out["stall_s"] = s.acquire_s
        out["stall_s_per_token"] = s.acquire_s / s.tokens if s.tokens else 0.0
        out.update(self.placement_stats())
        holds = self.holds
        out["lane_layers"] = self._hold_stats().layers
        if self.lookahead is not None:
            out.update(self.lookahead.totals())
            if holds is not None or self._past_layer_s:  # the hits taken in C, per layer (their own stall)
                for layer, d in out["per_layer"].items():
                    now = holds.layer_acquire_s(layer) if holds is not None else 0.0
                    d["stall_s"] += now + self._past_layer_s.get(layer, 0.0)
                    d["stall_s_per_token"] = d["stall_s"] / s.tokens if s.tokens else 0.0
        if self.substituter is not None:
            out.update(self.substituter.totals(s.tokens))
        k = self.kernels
        out["expert_layout"] = k.done.expert_layout if k else "plain"
        out["dense_repacked_tensors"] = k.done.dense_tensors if k else 0
        out["dense_repacked_bytes"] = k.done.dense_bytes if k else 0
        out["dense_layouts"] = list(k.done.dense_layouts) if k else []
        off = self.layout.offload if self.layout else None
        out["devices"] = off.describe() if off is not None else {"gpu": "", "gpu_layers": [], "experts": "CPU"}
        return out

    def placement_stats(self) -> dict:
        """Every placement's counters (the CPU pages', the holds' mappings included)."""
        out: dict = {}
        for placement in self.placements():
            out.update(placement.stats())
        if "pages_maps" in out:
            out["pages_maps"] += self._past_holds.maps  # mapped by layer holds let go at a rebind
        return out

    def _hold_stats(self) -> HoldStats:
        """The layer holds' counters, those let go at a rebind included."""
        now = self.holds.stats() if self.holds is not None else HoldStats()
        past = self._past_holds
        return HoldStats(*(a + b for a, b in zip(vars(past).values(), vars(now).values())))

    def adopt_slots(self, slots: SlotsT) -> SlotsT:
        """`slots` (the offloaded layers' device slots, made by the load) are the streamer's
        from now: closed with it, after the model and before the source's segments go."""
        self.slots = slots
        self._teardown.callback(self._close_slots)
        return slots

    def _close_slots(self) -> None:
        slots, self.slots = self.slots, None
        if slots is not None:
            slots.close()

    def _close_holds(self) -> None:
        """Give back what the layer holds hold, their buffers and hold indexes."""
        if self.holds is not None:
            self._past_holds = self._hold_stats()
            for layer in self.holds.layers:
                self._past_layer_s[layer] = self._past_layer_s.get(layer, 0.0) + self.holds.layer_acquire_s(layer)
        holds, self.holds = self.holds, None
        if holds is not None:
            self.c_callback.set_holds(None)
            grant = holds.close()
            if grant is not None:
                self._release_quietly(grant)

    def close(self) -> None:
        """Let go of what the streamer owns, after llama.cpp's model is freed (nothing reads
        the experts or computes with the kernels any more): the layer holds' grants, buffers
        and hold indexes, then the device slots, then the kernels. Idempotent."""
        self._teardown.close()

    def take_error(self) -> BaseException | None:
        err, self.error = self.error, None
        return err
