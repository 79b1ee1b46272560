"""What every device placement shares: an offloaded layer's routed experts computed on the device from ids rewritten at its stop.

A device placement (moed.engines.placement's `Placement`, for the layers llama.cpp put
on a GPU) keeps the experts in the CPU's buffer where nothing reads them (`-ot
exps=CPU`) and points the model's expert tensors at device tensors of its own; at each
layer's stop (`ffn_moe_weights-L`) it rewrites the top-k's expert ids into indices of
those tensors. Two strategies subclass `DevicePlacement`: copied slots
(moed.engines.device_slots: S slots a layer, misses uploaded) and zero copy
(moed.engines.device_host: moed's RAM tier imported, ids become moed slots). A new one
(a CUDA one, say) implements `_build_layer`, `_distinct_to_acquire`, `_slot_ids` and `rebind`.

What this module owns:
- building a placement over `probe`'s find (moed.engines.device_probe), one layer at a time;
- retargeting a model tensor at ours (`retarget`: `buffer`, `data`, `ne`, `nb`), and our
  tensors shaped as the model's with another count on the expert axis, in the layer's
  device buffer type, marked WEIGHTS, zeroed (`_place_parts`), with host copies of the
  biases' and scales' rows (dense and small: 0.26% of gpt-oss-20b's expert bytes);
- the top-k, read and written through its strides (`TopK`), and a failed decode's ids
  (`skip_ids`);
- the Placement verbs (`to_acquire`, `show`, `hide`, `failed`, `skip`, `end_decode`, `stats`)
  and the lifetime: every ggml context and buffer made here is freed by `close()`.

Invariants:
- The tensors are switched before any context that computes with them exists: the
  scheduler places an op when it splits a graph (by its weight's buffer), and a weight
  moved after that is computed where the split said (a CPU `MUL_MAT_ID` reading a device
  address: SIGSEGV, measured). The builder (moed.engines.placement) runs between the
  model's load and the context's creation; graph reuse may then stay on.
- The stop is `ffn_moe_weights-<layer>`, not `ffn_moe_topk-<layer>`: the routing weights
  are gathered from the probabilities by the same ids (`get_rows`, forced ahead of the
  expert matmuls by `ggml_build_forward_expand(gf, weights)` in llama-graph.cpp's
  build_moe_ffn); slot ids written at the top-k gather the wrong weights (measured: max
  |diff| 4.2 in the logits). The top-k is the weights node's `src[1]`.
- The top-k is a strided view of the argsort (rows `nb[1]` apart): it is read and written
  row by row through those strides (ggml_backend_tensor_{get,set}_2d, one copy each), and
  the argsort's other columns are never written.
- A batch naming more distinct experts in a layer than S raises `SlotsExceeded` (a
  `RequestTooLarge`, on which the engine splits the call) from `to_acquire`, before anything
  is acquired. A failed `show`, and `skip` at every later stop of a failed decode, write k
  distinct in-range ids a row (`skip_ids`), so no matmul reads past one of our tensors;
  our tensors start zeroed, so nothing it computes is NaN from what the allocator left.
- The placement never holds a grant: `hide` and `failed` do nothing (a device layer's
  matmuls read memory that stays mapped whatever failed, and have run before the grant
  is released).
- Everything allocated here lives until `close()`, called after the model is freed.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from moed.engines.device_lru import SlotLru
from moed.engines.device_probe import ExpertTensor, ModelTensors
from moed.engines.ggml_api import (
    GGML_BACKEND_BUFFER_USAGE_WEIGHTS,
    GGML_TYPE_I32,
    GgmlInitParams,
    GgmlTensor,
    api,
)
from moed.engines.sources import Grant
from moed.protocol.errors import RequestTooLarge


class SlotsExceeded(RequestTooLarge):
    """A batch names more distinct experts in one layer than the layer has device slots."""


def skip_ids(n_rows: int, k: int, n_ids: int) -> np.ndarray:
    """In-range ids for a failed decode's top-k: k distinct ids a row, the rows spread over
    all `n_ids` (k <= n_ids, checked at load). Never one id for every slot of a row: a token
    naming the same expert k times, the whole batch on one slot, is a top-k llama.cpp never
    makes, and ggml-vulkan's MUL_MAT_ID computed inf from it at >= 256 tokens (gpt-oss on
    lavapipe, measured: inf in the KV cache's freed cells, NaN in every later batch's masked
    attention)."""
    return (np.arange(n_rows * k, dtype=np.int32) % n_ids).reshape(n_rows, k)


class TopK:
    """A layer's computed top-k (int32 ids, contiguous within a row, rows `nb1` bytes apart),
    read and written in the device's memory through its strides."""

    def __init__(self, addr: int, layer: int):
        t = GgmlTensor.from_address(addr)
        if t.type != GGML_TYPE_I32 or int(t.nb[0]) != 4:
            raise RuntimeError(f"the top-k of layer {layer} has ggml type {t.type}, nb[0] {t.nb[0]}: expected I32 rows")
        if int(t.ne[2]) * int(t.ne[3]) != 1:
            raise RuntimeError(f"the top-k of layer {layer} has more than two dimensions: unexpected graph")
        self.addr, self.layer = addr, layer
        self.n_rows, self.k, self.nb1 = int(t.ne[1]), int(t.ne[0]), int(t.nb[1])

    @property
    def empty(self) -> bool:
        return self.k == 0 or self.n_rows == 0

    def read(self) -> np.ndarray:
        ids = np.empty((self.n_rows, self.k), np.int32)
        api().ggml_backend_tensor_get_2d(self.addr, ids.ctypes.data, 0, 4 * self.k, self.n_rows, self.nb1, 4 * self.k)
        return ids

    def check(self, ids: np.ndarray) -> np.ndarray:
        """`ids` read earlier (one device read less), checked against this top-k's shape."""
        if ids.shape != (self.n_rows, self.k):
            raise ValueError(f"layer {self.layer}: ids of shape {ids.shape} for a top-k of ({self.n_rows}, {self.k})")
        return ids

    def write(self, ids: np.ndarray) -> None:
        """(rows, k) ids over the top-k: k a row, the argsort's other columns untouched."""
        ids = np.ascontiguousarray(ids, np.int32)
        api().ggml_backend_tensor_set_2d(self.addr, ids.ctypes.data, 0, 4 * self.k, self.n_rows, self.nb1, 4 * self.k)


def retarget(model: int, ours: int) -> None:
    """Point the model's tensor struct at our tensor: its buffer (the scheduler's cue for where
    the op runs), its data and its shape and strides (the expert axis now ours)."""
    t, m = GgmlTensor.from_address(model), GgmlTensor.from_address(ours)
    t.buffer, t.data = m.buffer, m.data
    for d in range(4):
        t.ne[d], t.nb[d] = m.ne[d], m.nb[d]


@dataclass
class DevicePart:
    """One of a layer's expert tensors and ours in its place."""

    source: ExpertTensor  # the model's (now pointing at `ours`)
    ours: int  # our tensor: `n` experts (or rows) on the expert axis
    stride: int  # bytes of one expert (one row) in the model's tensor, as it was loaded
    rows: np.ndarray | None  # a bias's or scale's host copy, one row an expert; None for a weight


@dataclass
class DeviceStats:
    """stream_stats()["gpu_slots"]: the keys both strategies report."""

    slots: int = 0  # device slots a layer (the largest, where a layer has fewer experts)
    layers: int = 0  # layers this placement computes
    device_bytes: int = 0  # our tensors' bytes in device memory
    hits: int = 0  # (layer, expert) a batch used that was on the device already
    uploads: int = 0  # (layer, expert) uploaded into a slot
    upload_bytes: int = 0
    evictions: int = 0  # uploads into a slot that held another expert
    upload_s: float = 0.0  # time in ggml_backend_tensor_set for expert bytes
    cycles: int = 0  # layers shown (a stop's ids rewritten)
    cycle_s: float = 0.0  # time in show, uploads included


@dataclass
class DeviceLayer:
    """A layer's facts every strategy has: its experts, the bound on a batch's distinct
    experts (`n_slots`), and the ids our tensors take (`n_ids`: [0, n_ids))."""

    n_expert: int
    n_slots: int
    n_ids: int


class DevicePlacement:
    """The base of the device placements: the Placement verbs, the top-k, the lifetime.

    `found`: `probe(model)`, before any context of the model exists; `gpu_slots`: S, the
    most distinct experts one batch may name in a layer; `layers`: default every layer on a
    device. A strategy builds each layer (`_build_layer`), says what a batch must acquire
    (`_distinct_to_acquire`), and turns a batch's ids into ids of its tensors (`_slot_ids`).
    """

    what = "a device placement"  # names the placement in its errors
    copies_grant = False  # the Placement's: a strategy that copies what its tensors read says True

    def __init__(self, found: ModelTensors, gpu_slots: int, layers=None):
        if gpu_slots < 1:
            raise ValueError(f"gpu_slots must be at least 1, not {gpu_slots}")
        self.gpu_slots = gpu_slots
        self.counts = self._new_counts()
        self._layers: dict[int, DeviceLayer] = {}
        self._contexts: list[int] = []
        self._buffers: list[int] = []
        # What `to_acquire` read of the layer at the stop, for `show` of the same layer:
        # (layer, ids, slot ids where a full hit found them all on the device).
        self._pending: tuple[int, np.ndarray, np.ndarray | None] | None = None
        try:
            for layer in found.device_layers(layers):
                self._layers[layer] = self._build_layer(found, layer)
        except BaseException:
            self.close()
            raise
        self.counts.layers = len(self._layers)
        self.counts.slots = max((L.n_slots for L in self._layers.values()), default=0)

    # ---- what a strategy implements

    def _new_counts(self) -> DeviceStats:
        return DeviceStats()

    def _build_layer(self, found: ModelTensors, layer: int) -> DeviceLayer:
        raise NotImplementedError

    def _full_hit(self, layer: int, ids: np.ndarray) -> np.ndarray | None:
        """The batch's slot ids where nothing need be acquired or moved (default: never)."""
        return None

    def lru(self, layer: int) -> SlotLru | None:
        """The layer's device LRU, whose full hits the layer holds take in C (default: none)."""
        return None

    def _distinct_to_acquire(self, layer: int, want: np.ndarray) -> list[int]:
        """Which of `want` (the batch's distinct experts, checked) to acquire from moed."""
        raise NotImplementedError

    def _slot_ids(self, layer: int, ids: np.ndarray, grant: Grant | None) -> np.ndarray:
        """The batch's ids as ids of our tensors, every expert made readable there."""
        raise NotImplementedError

    def rebind(self) -> None:
        """The daemon came back (moed.engines.streamer, `ensure_bound`)."""
        raise NotImplementedError

    # ---- the Placement verbs

    @property
    def layers(self) -> list[int]:
        return sorted(self._layers)

    def __contains__(self, layer: int) -> bool:
        return layer in self._layers

    def to_acquire(self, layer: int, ids: np.ndarray) -> list[int]:
        """The experts of the batch's `ids` ((n_tokens, k), read at the stop) to acquire."""
        self._pending = None
        hit = self._full_hit(layer, ids)
        self._pending = (layer, ids, hit)
        return [] if hit is not None else self._distinct_to_acquire(layer, self.distinct(layer, ids))

    def show(self, grant: Grant | None, node: int | None, layer: int | None = None) -> None:
        """Make the layer's experts readable on the device and rewrite the ids of `node`, its
        top-k (`grant`: what `to_acquire` named, None when it named none)."""
        layer = grant.layer if grant is not None else layer
        if layer is None or node is None:
            raise ValueError(f"{self.what} needs the layer's top-k node (and the layer, without a grant)")
        pending, self._pending = self._pending, None
        ids, hit = pending[1:] if pending is not None and pending[0] == layer else (None, None)
        t0 = time.perf_counter()
        top = TopK(node, layer)
        if top.empty:
            return
        ids = top.read() if ids is None else top.check(ids)
        try:
            top.write(hit if hit is not None else self._slot_ids(layer, ids, grant))
        except BaseException:
            self.skip(layer, node)  # in range of our tensors, whatever computes before the graph stops
            raise
        self.counts.cycles += 1
        self.counts.cycle_s += time.perf_counter() - t0

    def hide(self, grant: Grant) -> None:
        """Nothing: the device has run what it reads before the grant is released."""

    def failed(self) -> None:
        """Nothing: a device layer's matmuls read memory that stays mapped whatever failed."""

    def skip(self, layer: int, topk: int) -> None:
        """In-range ids for every id of `topk` (`skip_ids`): a decode that failed computes on to
        its end over them, never past one of our tensors."""
        self._pending = None
        top = TopK(topk, layer)
        if not top.empty:
            top.write(skip_ids(top.n_rows, top.k, self._layers[layer].n_ids))

    def end_decode(self) -> None:
        self._pending = None

    def totals(self) -> dict[str, Any]:
        """The counters, for stream_stats()["gpu_slots"] (and the daemon's DeviceReport)."""
        return dict(vars(self.counts))

    def stats(self) -> dict[str, Any]:
        return {"gpu_slots": self.totals()}

    # ---- what a strategy builds with

    def distinct(self, layer: int, ids: np.ndarray) -> np.ndarray:
        """The batch's distinct experts of `layer`, sorted, checked against its expert count
        and its slots (SlotsExceeded, before anything is acquired)."""
        L = self._layers[layer]
        want = np.unique(np.asarray(ids, np.int64))
        if len(want) and (want[0] < 0 or want[-1] >= L.n_expert):
            raise RuntimeError(f"layer {layer}: expert id {int(want[0] if want[0] < 0 else want[-1])} out of range")
        if len(want) > L.n_slots:
            raise SlotsExceeded(
                f"layer {layer}: the batch routes to {len(want)} experts, the layer has {L.n_slots} device slots"
            )
        return want

    def _context(self, n_tensors: int) -> int:
        """A ggml context for `n_tensors` tensor headers (no data), freed by close()."""
        g = api()
        ctx = g.ggml_init(GgmlInitParams(g.ggml_tensor_overhead() * (n_tensors + 1), None, True))
        if not ctx:
            raise MemoryError("ggml_init failed")
        self._contexts.append(ctx)
        return ctx

    def _own_buffer(self, buffer: int) -> None:
        """`buffer` is this placement's, marked WEIGHTS (the scheduler's cue to place an op
        reading it on its device), freed by close()."""
        self._buffers.append(buffer)
        api().ggml_backend_buffer_set_usage(buffer, GGML_BACKEND_BUFFER_USAGE_WEIGHTS)

    def _place_parts(self, layer: int, tensors: list[ExpertTensor], n: int, buft: int) -> list[DevicePart]:
        """Our tensor for each of the layer's `tensors`, `n` on its expert axis, in `buft`,
        zeroed, with the model's tensor pointed at it; a bias's or scale's rows kept on the host."""
        g = api()
        ctx = self._context(len(tensors))
        ours = [g.ggml_new_tensor(ctx, GgmlTensor.from_address(t.addr).type, 4, _shape(t, n)) for t in tensors]
        buffer = g.ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft)
        n_bytes = sum(g.ggml_nbytes(m) for m in ours)
        if not buffer:
            raise MemoryError(
                f"layer {layer}: no {n} device slots in {g.ggml_backend_buft_name(buft).decode()} ({n_bytes} bytes)"
            )
        self._own_buffer(buffer)
        # Zeros, never what the allocator left: a failed decode computes on to its end over
        # `skip_ids`' slots, and NaN there would stay in the KV cache's freed cells, where a
        # later batch's masked attention multiplies it by 0 (NaN; measured: wrong logits
        # after a split batch). Zero quantized blocks decode to zero weights.
        g.ggml_backend_buffer_clear(buffer, 0)
        self.counts.device_bytes += n_bytes
        parts = []
        for t, mine in zip(tensors, ours):
            part = DevicePart(t, mine, t.stride, None if t.kind == "weight" else _host_rows(t))
            retarget(t.addr, mine)  # last: the model's shape and bytes are read above
            parts.append(part)
        return parts

    def close(self) -> None:
        """Free our buffers, then the contexts of our tensors; only once llama.cpp will never
        compute with the model again (and, for imported memory, before its mapping goes)."""
        g = api()
        self._layers.clear()
        while self._buffers:
            g.ggml_backend_buffer_free(self._buffers.pop())
        while self._contexts:
            g.ggml_free(self._contexts.pop())


def _shape(t: ExpertTensor, n: int):
    """`t`'s shape with `n` on its expert axis, as ggml_new_tensor takes it."""
    ne = [int(x) for x in GgmlTensor.from_address(t.addr).ne]
    if any(ne[d] != 1 for d in range(t.axis + 1, 4)):
        raise ValueError(f"{GgmlTensor.from_address(t.addr).name.decode()}: {ne} has dimensions past the expert axis")
    ne[t.axis] = n
    return (ctypes.c_int64 * 4)(*ne)


def _host_rows(t: ExpertTensor) -> np.ndarray:
    """The model's rows of `t` (one an expert), copied to the host while the model has them."""
    rows = np.empty(api().ggml_nbytes(t.addr), np.uint8)
    api().ggml_backend_tensor_get(t.addr, rows.ctypes.data, 0, rows.nbytes)
    return rows


__all__ = [
    "DeviceLayer",
    "DevicePart",
    "DevicePlacement",
    "DeviceStats",
    "SlotsExceeded",
    "TopK",
    "retarget",
    "skip_ids",
]
