"""Forced routes for benchmarks: every token routed as a real trace's next token.

Shared by bench/engine_vs_mmap.py and bench/drive_backoff.py. A generated model's own
router, decoding greedily, soon repeats one token and so one route: every expert hits
and the drive is never asked for anything. Forcing the trace's routes gives the
reuse a real model shows (OLMoE-1B-7B by default, 16 layers x 64 experts, top-8), and
`predict` emulates a gate-ahead predictor of a given recall on the same routes.
"""

from __future__ import annotations

import pathlib
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "nvmoe" / "olmoe-all.tokens.jsonl"


class TraceRoutes:
    """The route hook: every token of a graph is routed as the trace's next token after `cursor`.

    Also the predict hook (`predict`): the emulated gate-ahead predictor, see the
    module docstring. Both hooks see layers in order within a graph; a layer not
    above the last one seen starts the next graph (ubatch) of the same decode.
    """

    def __init__(self, trace_path: str, recall: float = 1.0, seed: int = 0):
        from moed.traces import Trace

        trace = Trace.load(trace_path)
        self.ids = np.asarray(trace.ids, dtype=np.int32)  # (tokens, layers, k), layers 0..L-1
        self.n_experts = trace.n_experts
        self.recall = recall
        self.rng = np.random.default_rng(seed)
        self.hook_s = 0.0  # time in the emulation, to tell the real predictor's cost apart
        self._orders = np.argsort(self.rng.random((4096, self.n_experts)), axis=1).astype(np.int32)
        self._order_i = 0
        self.start(0)

    def start(self, cursor: int) -> None:
        """The next decode's first token is trace token `cursor`."""
        self.cursor, self._next, self._base, self._layer = cursor, 0, 0, None

    def _tokens(self, layer: int, n_rows: int) -> np.ndarray:
        if self._layer is None or layer < self._layer:
            self._base, self._next = self._next, self._next + n_rows
        self._layer = layer
        return (self.cursor + self._base + np.arange(n_rows)) % len(self.ids)

    def __call__(self, layer: int, ids: np.ndarray) -> None:
        rows = self._tokens(layer, ids.shape[0])
        ids[:, :] = self.ids[rows, layer][:, : ids.shape[1]]

    def predict(self, target: int, lead: int, ids: np.ndarray) -> None:
        t0 = time.perf_counter()
        self._emulate(target, lead, ids)
        self.hook_s += time.perf_counter() - t0

    def _emulate(self, target: int, lead: int, ids: np.ndarray) -> None:
        n, width = ids.shape
        true = self.ids[self._tokens(target - lead, n), target]  # (n, k)
        if n == 1:
            self._emulate_row(true[0], ids[0])
            return
        k = true.shape[1]
        # a random order of the experts that are wrong for each row: true ones sort last
        noise = self.rng.random((n, self.n_experts))
        np.put_along_axis(noise, true, 2.0, axis=1)
        wrong = np.argsort(noise, axis=1)[:, :width].astype(np.int32)
        keep = self.rng.random((n, k)) < self.recall
        ids[:, : min(k, width)] = np.where(keep, true, wrong[:, :k])[:, :width]
        if width > k:
            ids[:, k:] = wrong[:, k:width]

    def _emulate_row(self, true: np.ndarray, out: np.ndarray) -> None:
        """One token, the same emulation without per-row sorting: a stored random order of the experts."""
        k, width = len(true), len(out)
        order = self._orders[self._order_i % len(self._orders)]
        self._order_i += 1
        is_true = np.zeros(self.n_experts, dtype=bool)
        is_true[true] = True
        wrong = order[~is_true[order]][:width]
        keep = self.rng.random(k) < self.recall
        out[: min(k, width)] = np.where(keep, true, wrong[:k])[:width]
        if width > k:
            out[k:] = wrong[k:width]
