"""Reading a computed graph node of the ggml inside llama-cpp-python 0.3.36, and the eval callback.

What this module owns: the node names the engine stops at (`ffn_moe_topk-<layer>`, the
routing weights `ffn_moe_weights-<layer>`, the router's input), reading a tensor's name
without building a Python string per node, reading the routed expert ids of an
`ffn_moe_topk-<layer>` tensor, viewing the float rows of an `ffn_norm-<layer>` tensor
(the normed FFN input the gate-ahead predictor reads; gpt-oss names it
`attn_post_norm-<layer>`, so the norm node's prefix is a parameter), and llama.cpp's
`cb_eval` (`EvalCallback`, its ask pass in C). The struct layout and every ggml call
are moed.engines.ggml_api's.

Invariants:
- The layout is that of ggml.h in the pinned llama-cpp-python; `layout_matches()`
  (ggml_api's) checks it against the library, and the engine refuses to run if it
  does not.
- `ffn_moe_topk` is a view (argsort, then the first k columns), so its rows are
  `nb[1]` bytes apart, not `k * 4`: ids are always read through the strides.
  Float rows are read through the strides too (any node may be a view).
- A node whose buffer is not host memory (a layer llama.cpp offloaded) is read through
  ggml's backend API (`_bytes_at`), never through its data pointer (the device's).
"""

from __future__ import annotations

import ctypes
import functools
import re
from collections.abc import Callable

import numpy as np

from moed.engines.ggml_api import GGML_TYPE_F32, GGML_TYPE_I32, NAME_OFFSET, GgmlTensor, api

TOPK_PREFIX = b"ffn_moe_topk-"
# The routing weights gathered by the top-k's ids (llama-graph.cpp: before any expert matmul,
# forced by ggml_build_forward_expand); its src[1] is the top-k. Device slots stop here.
WEIGHTS_PREFIX = b"ffn_moe_weights-"
# The router's input (moed.gguf.archs.RouterInput): ffn_norm-<n> unless the arch names its own.
ROUTER_INPUT_PREFIX = b"ffn_norm-"
_TOPK_NAME = re.compile(rb"ffn_moe_topk-(\d+)\Z")
# Kinds of node the streamer's callback acts on (see `node`).
TOPK = 1
ROUTER_INPUT = 2


class EvalCallback:
    """llama.cpp's `cb_eval` with the ask pass in C (moed.engines._layer_holds): `fn(tensor_address)`
    is called only for the router's input nodes (`ffn_norm-<n>` by default) while
    `stop_at_router_input(True)`, and for computed `ffn_moe_topk-<n>` nodes while no layer holds
    are set; its bool says whether the graph goes on. With layer holds set
    (moed.engines.holds), each routed layer's stop goes to them (its top-k, or the routing
    weights where the holds say so), and while they hold a whole step's pin hold the ask pass
    wants no node at all."""

    def __init__(self, fn: Callable[[int], bool]):
        import llama_cpp

        from moed.engines import _layer_holds

        self._c = _layer_holds
        self.handle = _layer_holds.callback_new(fn, NAME_OFFSET)
        self.function = ctypes.cast(_layer_holds.callback_address(), llama_cpp.ggml_backend_sched_eval_callback)
        self.user_data = ctypes.c_void_p(_layer_holds.callback_user_data(self.handle))

    def set_holds(self, holds) -> None:
        """Give the routed stops to `holds` (a moed.engines._layer_holds holds, or None: to `fn`)."""
        self._c.callback_holds(self.handle, holds)

    def stop_at_router_input(self, on: bool, prefix: bytes = ROUTER_INPUT_PREFIX) -> None:
        """Also stop at `<prefix><n>` nodes (the router's input) while `on`."""
        self._c.callback_router_input(self.handle, on, prefix)

    def routed_stops(self, on: bool) -> None:
        """Stop at the routed layers' stops (on by default); off, the ask pass wants none of them
        (bench/gpu_slots.py: a graph computed in one piece, to measure what a stop costs)."""
        self._c.callback_routed(self.handle, on)

    def install(self, params) -> None:
        """Put it in a llama_context_params (the object must outlive the context)."""
        params.cb_eval = self.function
        params.cb_eval_user_data = self.user_data


class PythonEvalCallback:
    """A `cb_eval` whose ask pass runs in Python too: for tools that stop at nodes the
    C filter does not know (bench/observation_point.py reads l_out). `fn(tensor, ask, user_data)`."""

    def __init__(self, fn: Callable[[int, bool, object], bool]):
        import llama_cpp

        self.function = llama_cpp.ggml_backend_sched_eval_callback(fn)

    def stop_at_router_input(self, on: bool, prefix: bytes = ROUTER_INPUT_PREFIX) -> None:
        """The Python callback decides every node itself."""

    def install(self, params) -> None:
        params.cb_eval = self.function
        params.cb_eval_user_data = None


def topk_layer(tensor_ptr: int) -> int | None:
    """The layer of an `ffn_moe_topk-<layer>` tensor, else None.

    Called for every graph node on the ask pass, so it first compares the fixed
    prefix with one `string_at` and only then parses.
    """
    head = ctypes.string_at(tensor_ptr + NAME_OFFSET, len(TOPK_PREFIX))
    if head != TOPK_PREFIX:
        return None
    match = _TOPK_NAME.match(ctypes.string_at(tensor_ptr + NAME_OFFSET))
    return int(match.group(1)) if match else None


def node(
    tensor_ptr: int, router_input_prefix: bytes = ROUTER_INPUT_PREFIX, route_prefix: bytes = TOPK_PREFIX
) -> tuple[int, int] | None:
    """(TOPK or ROUTER_INPUT, layer) for `<route_prefix><layer>` (`ffn_moe_topk-`, or
    `ffn_moe_weights-` whose src[1] is the top-k) / `<router_input_prefix><layer>`, else None.

    One `string_at` of the longer prefix per graph node; parsing only on a match.
    """
    head = ctypes.string_at(tensor_ptr + NAME_OFFSET, max(len(route_prefix), len(router_input_prefix)))
    if head[: len(route_prefix)] == route_prefix:
        kind, pattern = TOPK, _TOPK_NAME if route_prefix == TOPK_PREFIX else _layer_name(route_prefix)
    elif head[: len(router_input_prefix)] == router_input_prefix:
        kind, pattern = ROUTER_INPUT, _layer_name(router_input_prefix)
    else:
        return None
    match = pattern.match(ctypes.string_at(tensor_ptr + NAME_OFFSET))
    return (kind, int(match.group(1))) if match else None


@functools.cache
def _layer_name(prefix: bytes) -> re.Pattern[bytes]:
    return re.compile(re.escape(prefix) + rb"(\d+)\Z")


def rows_f32(tensor_ptr: int) -> np.ndarray:
    """The (n_rows, ne0) float32 rows of a computed tensor, as a read-only strided view.

    A 3-D tensor [ne0, ne1, n_rows] whose ne0 x ne1 slabs are contiguous (qwen4exp's
    hyper-connection residual `hc_combine-L`: a token's hc streams) gives rows of
    ne0 * ne1 values, the streams side by side: one row a token, as in the 2-D case.
    Valid only inside the callback that received the tensor (the buffer is reused).
    """
    t = GgmlTensor.from_address(tensor_ptr)
    if t.type != GGML_TYPE_F32:
        raise RuntimeError(f"ffn_norm has ggml type {t.type}, expected F32")
    slab_contiguous = int(t.nb[0]) == 4 and int(t.nb[1]) == 4 * int(t.ne[0])
    if int(t.ne[3]) != 1 or (int(t.ne[2]) != 1 and not slab_contiguous):
        raise RuntimeError("ffn_norm with more than two dimensions: unexpected graph")
    if int(t.ne[2]) != 1:  # the slabs as rows: [ne0 * ne1, ne2] with ne2's stride
        n0, n_rows, nb0, nb1 = int(t.ne[0]) * int(t.ne[1]), int(t.ne[2]), 4, int(t.nb[2])
    else:
        n0, n_rows, nb0, nb1 = int(t.ne[0]), int(t.ne[1]), int(t.nb[0]), int(t.nb[1])
    if n_rows == 0:
        return np.empty((0, n0), dtype=np.float32)
    span = (n_rows - 1) * nb1 + n0 * nb0
    raw = _bytes_at(t, span)
    view = np.ndarray((n_rows, n0), dtype=np.float32, buffer=raw, strides=(nb1, nb0))
    view.flags.writeable = False
    return view


def topk_ids(tensor_ptr: int) -> np.ndarray:
    """The (n_tokens, k) int32 expert ids of a computed topk tensor, copied out.

    The returned array is a copy: the graph's buffer is reused by later nodes.
    """
    t = GgmlTensor.from_address(tensor_ptr)
    if t.type != GGML_TYPE_I32:
        raise RuntimeError(f"ffn_moe_topk has ggml type {t.type}, expected I32: ggml layout mismatch")
    k, n_rows = int(t.ne[0]), int(t.ne[1]) * int(t.ne[2]) * int(t.ne[3])
    if n_rows == 0 or k == 0:
        return np.empty((0, k), dtype=np.int32)
    return _rows_view(t, n_rows, k).copy()


def topk_view(tensor_ptr: int) -> np.ndarray:
    """A writable strided view of the ids in place (benchmarks force routes through it)."""
    t = GgmlTensor.from_address(tensor_ptr)
    return _rows_view(t, int(t.ne[1]), int(t.ne[0]), writable=True)


def _bytes_at(t: GgmlTensor, span: int, writable: bool = False):
    """The `span` bytes of a computed tensor: its host buffer in place, or, for a tensor in a
    device's memory (a GPU layer's router, norm or top-k), a copy read through ggml's
    backend API (ggml_backend_tensor_get: the data pointer is the device's, never readable
    here). `span` is the tensor's ggml_nbytes for the views this module reads."""
    if not t.buffer or api().ggml_backend_buffer_is_host(t.buffer):
        return (ctypes.c_char * span).from_address(t.data)
    if writable:
        raise RuntimeError("a node in a device's memory cannot be rewritten in place (route_hook with n_gpu_layers)")
    out = (ctypes.c_char * span)()
    api().ggml_backend_tensor_get(ctypes.addressof(t), out, 0, span)
    return out


def _rows_view(t: GgmlTensor, n_rows: int, k: int, writable: bool = False) -> np.ndarray:
    """The tensor's first `n_rows` rows of `k` int32 ids, as a strided view of its buffer
    (of a copy, for a tensor on a device: `_bytes_at`)."""
    nb0, nb1 = int(t.nb[0]), int(t.nb[1])
    span = (n_rows - 1) * nb1 + k * nb0
    raw = _bytes_at(t, span, writable)
    return np.ndarray((n_rows, k), dtype=np.int32, buffer=raw, strides=(nb1, nb0))


def name(tensor_ptr: int) -> bytes:
    return ctypes.string_at(tensor_ptr + NAME_OFFSET)


def matrix(tensor_ptr: int, dtype=np.float32) -> np.ndarray:
    """A 2-D tensor (ne0 columns, ne1*ne2*ne3 rows with ne2*ne3 == 1, or ne0 == 1: a (1, k, n) one)
    as an (n_rows, n_cols) strided view of its buffer; valid only inside its callback."""
    t = GgmlTensor.from_address(tensor_ptr)
    want = GGML_TYPE_F32 if np.dtype(dtype) == np.float32 else GGML_TYPE_I32
    if t.type != want:
        raise RuntimeError(f"{name(tensor_ptr)!r} has ggml type {t.type}, expected {want}")
    ne = [int(x) for x in t.ne]
    nb = [int(x) for x in t.nb]
    if ne[0] == 1 and ne[3] == 1:  # (1, k, n): the gathered weights
        ne, nb = [ne[1], ne[2], 1, 1], [nb[1], nb[2], nb[3], nb[3]]
    if ne[2] * ne[3] != 1:
        raise RuntimeError(f"{name(tensor_ptr)!r} has more than two dimensions: unexpected graph")
    n_cols, n_rows = ne[0], ne[1]
    if n_rows == 0 or n_cols == 0:
        return np.empty((n_rows, n_cols), dtype=dtype)
    span = (n_rows - 1) * nb[1] + (n_cols - 1) * nb[0] + np.dtype(dtype).itemsize
    raw = _bytes_at(t, span)
    return np.ndarray((n_rows, n_cols), dtype=dtype, buffer=raw, strides=(nb[1], nb[0]))


def router_selected(topk_ptr: int) -> bool:
    """Whether the router chose this `ffn_moe_topk-<n>` (a view of `ffn_moe_argsort-<n>`), not
    a table (deepseek4's hash layers gather `ffn_gate_tid2eid` rows by token id): only a
    router's choice has the ranking and probabilities `router_arrays` reads."""
    t = GgmlTensor.from_address(topk_ptr)
    return bool(t.view_src) and t.view_offs == 0 and name(t.view_src).startswith(b"ffn_moe_argsort")


def router_arrays(topk_ptr: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """(ranked, scores, on_logits) of a computed `ffn_moe_topk-<n>`: every expert best first
    (`ffn_moe_argsort-<n>`) and the scores it ranked, each (n_tokens, n_experts),
    read-only strided views, valid only inside the callback. The scores are the routing
    probabilities (`ffn_moe_probs-<n>`), or, where the graph selects on the router's
    logits (llama4: `ffn_moe_logits-<n>`, `on_logits` True), the logits: the caller
    gates them with the model's gating to get probabilities.

    The topk is the first k columns of the argsort (its `view_src`, offset 0); the
    argsort sorts the selection scores (`src[0]`: the probabilities, or
    `ffn_moe_probs_biased-<n>` whose `src[0]` they are, or the logits). Both are still
    live at the topk: the argsort is the topk's own data, and the scores are an input
    of what follows (the routing-weight gather, or llama4's sigmoid of the chosen).
    """
    t = GgmlTensor.from_address(topk_ptr)
    src = t.view_src
    if not src or t.view_offs != 0 or not name(src).startswith(b"ffn_moe_argsort"):
        raise RuntimeError(f"{name(topk_ptr)!r} is not a view of ffn_moe_argsort: unexpected graph")
    n_rows = int(t.ne[1])
    ranked = matrix(src, np.int32)[:n_rows]
    probs_ptr = GgmlTensor.from_address(src).src[0]
    for _ in range(3):
        if not probs_ptr or name(probs_ptr).startswith((b"ffn_moe_probs-", b"ffn_moe_logits-")):
            break
        probs_ptr = GgmlTensor.from_address(probs_ptr).src[0]
    if not probs_ptr or not name(probs_ptr).startswith((b"ffn_moe_probs-", b"ffn_moe_logits-")):
        raise RuntimeError(f"no ffn_moe_probs behind {name(topk_ptr)!r}: unexpected graph")
    probs = matrix(probs_ptr, np.float32)[:n_rows]
    if probs.shape != ranked.shape:
        raise RuntimeError(f"ffn_moe_probs {probs.shape} and ffn_moe_argsort {ranked.shape} differ")
    ranked.flags.writeable = False
    probs.flags.writeable = False
    return ranked, probs, name(probs_ptr).startswith(b"ffn_moe_logits-")
