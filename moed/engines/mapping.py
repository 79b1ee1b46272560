"""The model's mapping: a source's experts installed into llama.cpp's mapping of the model.

What this module owns (install time, once per loaded model): the expert pages
(moed.engines.expert_pages: every expert address inaccessible until a layer acquires
it) and each routed layer's part spans; the dense pages locked; the expert pages
dropped from the page cache; the repacked kernels (moed.engines.repack) and their
expert switch; the router's facts read from the header (its input node, its gating)
and the look-ahead built over the router weights (moed.engines.lookahead).

Invariants:
- Install runs after llama.cpp mapped the model and before the first decode, in two
  steps: `install_experts` (the addresses made inaccessible) and, once the layer holds
  are bound over them (moed.engines.binding), `install_dense`.
- The dense weights every token reads are locked, so they are never re-read from disk.
  Three kinds stay unlocked, page-rounded inward: the tables llama.cpp reads lazily
  (archs.LAZY_TENSORS), the weights a GPU offload copied into the device's memory,
  and those its load placed in CPU_REPACK (read once at load).
- llama.cpp populated the whole mapping at load; the expert pages are given back to
  the kernel at install, so only what the layers acquire is ever resident.
- Repacked experts run on their kernels only once switched (`switch_experts`, at the
  first graph node Python sees, before any expert matmul of the first decode): while
  `experts_pending`, no routed stop may be done alone in C (moed.engines.steps).
- Everything here is fixed after install; a daemon restart changes none of it (the
  binding resets the pages' mappings, not the spans).
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass

from moed import libc
from moed.engines import ggml_tensor, vm
from moed.engines.expert_pages import ExpertPages, PartSpan, gaps
from moed.engines.kernels import KernelSwitch
from moed.engines.lookahead import Lookahead
from moed.engines.options import EngineHooks, EngineOptions
from moed.engines.predictor import GATING_SOFTMAX
from moed.engines.repack import LayoutPlan, dense_offloaded, prepare
from moed.engines.skeleton import expert_ranges
from moed.engines.sources import ExpertSource
from moed.gguf.archs import LAZY_TENSORS
from moed.gguf.header import read_split

log = logging.getLogger("moed.engine")


def snapshot_bases(files: list[str]) -> set[int]:
    """Mapping bases of `files` that exist before a load (so they are not mistaken for ours)."""
    return set().union(*(vm.mapping_bases(path) for path in files))


@dataclass
class InstallStats:
    dense_locked_bytes: int = 0
    dense_lock_error: str = ""
    dropped_expert_cache_bytes: int = 0


@dataclass(frozen=True)
class RouterFacts:
    """The router as the cycle reads it: its input node `<input_prefix><layer>`
    (moed.gguf.archs.RouterInput: ffn_norm-, or the arch's own) and its gating. With
    SOFTMAX_WEIGHT gating (gpt-oss) `ffn_moe_probs-L` holds the logits
    (`probs_are_logits`), so the substituter is given their softmax."""

    input_prefix: bytes = ggml_tensor.ROUTER_INPUT_PREFIX
    gating: int = GATING_SOFTMAX
    probs_are_logits: bool = False


class ModelMapping:
    """One loaded model's mapping as moed installed it, and what install read from it."""

    def __init__(self, source: ExpertSource, options: EngineOptions, hooks: EngineHooks, layout: LayoutPlan | None):
        self.source = source
        self.strict = options.strict
        self._options, self._predict_hook = options, hooks.predict
        self._prefetch, self._prefetch_width = options.prefetch, options.prefetch_width or source.n_expert_used
        # The files llama.cpp maps: the model's own, or its skeleton (same layout), set before the load.
        self.mapped_files: list[str] = list(source.files)
        self.layout = layout
        # Which weights run on ggml's repacked kernels (moed.engines.repack); None: all plain.
        self.kernels: KernelSwitch | None = prepare(read_split(self.mapped_files[0]), layout) if layout else None
        self.stats = InstallStats()
        self.pages: ExpertPages | None = None
        self.parts: dict[int, list[PartSpan]] = {}  # each routed layer's expert spans
        self.zero_copy_layers: set[int] = set()  # relaxed mode, every part zero copy: the lane's candidates
        self.router = RouterFacts()
        self.lookahead: Lookahead | None = None  # built at install (it reads the mapped routers)
        self._headers: list = []  # for the expert switch at the first node
        self._bases: list[int] = []

    def install_experts(self, bases_before: set[int]) -> list[int]:
        """Every expert address of the mapped files inaccessible; returns the files' mapping bases
        (`bases_before`: mappings that existed before the load, so they are not taken for ours)."""
        bases = self._find_bases(bases_before)
        spans = [
            PartSpan(layer, ext.part, bases[ext.shard] + ext.offset, ext.bytes_per_expert, self.source.n_experts)
            for layer in self.source.moe_layers
            for ext in self.source.extents(layer)
        ]
        self.pages = ExpertPages(spans, strict=self.strict)
        self.pages.install()
        for span in spans:
            self.parts.setdefault(span.layer, []).append(span)
        if not self.strict:
            self.zero_copy_layers = {layer for layer, ss in self.parts.items() if all(s.zero_copy for s in ss)}
        return bases

    def install_dense(self, bases: list[int]) -> None:
        """The expert pages out of the page cache, the dense ones locked, the routers read."""
        self._drop_expert_cache()
        headers = read_split(self.mapped_files[0])  # one header read serves the three steps below
        self._lock_dense(bases, headers)
        self._install_lookahead(headers)
        if self.kernels is not None:
            self._unlock_placed_dense(headers, bases)
            self._headers, self._bases = headers, bases

    def experts_pending(self) -> bool:
        return self.kernels is not None and self.kernels.experts_pending

    def switch_experts(self, node: int) -> None:
        """The repacked experts onto their kernels, found from `node`: the first graph node
        Python sees, before any expert matmul of the first decode."""
        from moed.engines.repack import switch_experts

        assert self.kernels is not None and self.layout is not None
        switch_experts(self.kernels, node, self._headers, self._bases, self.layout)

    def _find_bases(self, bases_before: set[int]) -> list[int]:
        bases = []
        for path in self.mapped_files:
            base = vm.file_mapping_base(path, bases_before)
            if base is None:
                raise RuntimeError(f"llama.cpp did not mmap {path}: load with use_mmap=True")
            bases.append(base)
        return bases

    def _drop_expert_cache(self) -> None:
        for shard, path in enumerate(self.mapped_files):
            fd = os.open(path, os.O_RDONLY)
            try:
                for lo, hi in expert_ranges(self.source, shard):
                    os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)
                    self.stats.dropped_expert_cache_bytes += hi - lo
            finally:
                os.close(fd)

    def _lock_dense(self, bases: list[int], headers: list) -> None:
        """mlock what is left of the mapping but the lazy tables (a few rows a token: locking
        them would pin gigabytes, Gemma 4's and Qwen3.8's per-layer token embeddings, for rows
        the page cache serves) and the weights a GPU offload computes from its own copy."""
        assert self.pages is not None, "install_experts builds the pages before locking"
        vmas = []
        for base, path in zip(bases, self.mapped_files):
            vmas += vm.mapped_ranges(base, path)
        offloaded = {t.name for _, t in dense_offloaded(headers, self.layout)} if self.layout else set()
        holes = sorted(
            (vm.page_ceil(bases[shard] + t.offset), vm.page_floor(bases[shard] + t.offset + t.n_bytes))
            for shard, h in enumerate(headers)
            for t in h.tensors
            if t.name in LAZY_TENSORS or t.name in offloaded
        )
        runs = [run for lo, hi in self.pages.dense_runs(vmas) for run in gaps(lo, hi, holes)]
        for lo, hi in runs:
            self._lock(lo, hi)

    def _lock(self, lo: int, hi: int) -> None:
        try:
            libc.mlock(lo, hi - lo)
            self.stats.dense_locked_bytes += hi - lo
        except OSError as exc:
            if not self.stats.dense_lock_error:  # one warning: the first range says it for all
                self.stats.dense_lock_error = str(exc)
                warnings.warn(
                    f"moed: could not lock the dense weights ({exc}); under memory "
                    "pressure they will be re-read from disk (raise RLIMIT_MEMLOCK)",
                    RuntimeWarning,
                    stacklevel=2,
                )

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

    def _install_lookahead(self, headers: list) -> None:
        """Read the routers from the model's files (predictor.load_routers: not through the mapping,
        whose offloaded pages llama.cpp unmaps); fold nothing until first use."""
        from moed.engines.predictor import (
            GATING_SOFTMAX_WEIGHT,
            GatePredictor,
            gating_of,
            graph_moe_layers,
            load_routers,
            router_input,
        )

        arch = str(headers[0].get("general.architecture", ""))
        gating = gating_of(headers[0])
        self.router = RouterFacts(router_input(arch).prefix, gating, gating == GATING_SOFTMAX_WEIGHT)
        layers = graph_moe_layers(headers[0], self.source.moe_layers)  # no prefetch into MTP layers
        try:
            routers, router_gating = load_routers(headers, self.mapped_files, layers)
            predictor = GatePredictor(routers, layers, router_gating)
        except (ValueError, KeyError, NotImplementedError) as exc:
            if self._prefetch != "off":
                raise
            log.info("no gate-ahead predictor for this model: %s", exc)
            predictor = None
        self.lookahead = Lookahead(
            predictor,
            self.source,
            self._prefetch,
            self._prefetch_width,
            adapt=self._options.prefetch_adapt,
            predict_hook=self._predict_hook,
            layers=layers,
        )
