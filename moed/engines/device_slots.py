"""Device expert slots: an offloaded layer's routed experts computed on the GPU, from S slots a layer.

The experts of a layer llama.cpp put on a GPU (`n_gpu_layers`) are not loaded there
(the engine keeps them in the CPU's buffer, `-ot exps=CPU`, where nothing reads them).
Instead each such layer gets S device slots, and the graph's own `MUL_MAT_ID` runs
over them with the ids turned from experts into slots: llama.cpp PR #25294's
`n_slots`, the reference page's `--moe-slots`, done with ggml's public API only.

What this module owns, for one loaded model:
- finding its expert tensors before any context computes with them (`probe`: a
  throwaway llama.cpp context whose first graph is read in the eval callback's ask
  pass and never computed: its CPU backend's abort callback stops it before the first
  node, so no expert byte is read), and each layer's device (`model_tensors`: the
  buffer type of the layer's other weights; a layer whose weights are all in host
  memory is the CPU's and gets no slots);
- one device tensor of S experts for each part of each slot layer (gate, up, down,
  gemma4's gate_up, and the expert biases `ffn_*_exps.bias` (gpt-oss, `add_id`) and
  scales `ffn_*_exps.scale` (gemma4, `get_rows`) a family has: both are indexed by the
  same ids), in the layer's device buffer type, marked WEIGHTS; the model's tensor is
  pointed at it (`buffer`, `data`, `ne`, `nb`), so ggml's scheduler places the
  layer's `MUL_MAT_ID` on the device when it splits a graph;
- host copies of the biases and scales (dense and small: 0.26% of gpt-oss-20b's expert
  bytes), the rows a slot upload copies;
- each layer's LRU of which expert each slot holds, and the counters (`SlotStats`);
- the per-layer cycle `route(layer, topk, fetch)`: read the top-k ids, upload the
  experts not in a slot (their bytes from `fetch`: moed's grant) into free or least
  recently used slots, and write the slot ids back over the top-k.

Invariants:
- The tensors are switched before any context that computes with them exists: the
  scheduler places an op when it splits a graph (by its weight's buffer), and a
  weight moved after that is computed where the split said (a CPU `MUL_MAT_ID` reading
  a device address: SIGSEGV, measured). `probe` and the constructor run between the
  model's load and the context's creation; graph reuse may then stay on.
- `route` runs at `ffn_moe_weights-<layer>`, not at `ffn_moe_topk-<layer>`: the routing
  weights are gathered from the probabilities by the same ids (`get_rows`, forced
  ahead of the expert matmuls by `ggml_build_forward_expand(gf, weights)` in
  llama-graph.cpp's build_moe_ffn); slot ids written at the top-k gather the wrong
  weights (measured: max |diff| 4.2 in the logits).
- The top-k is a strided view of the argsort (rows `nb[1]` apart): it is read and
  written row by row through those strides (ggml_backend_tensor_{get,set}_2d, one
  copy each), and the argsort's other columns are never written.
- A slot the batch in flight uses is never evicted. A batch naming more distinct
  experts in a layer than it has slots raises `SlotsExceeded` (a `RequestTooLarge`, on
  which the engine lowers `n_batch`; `missing` raises it before anything is acquired),
  and a failed `route`, like `skip` at a later stop of a failed decode, writes k distinct
  slots a row (`skip_ids`), so no matmul can read past a slot tensor.
- An expert enters a slot's LRU entry only once all its parts (and rows) are on the
  device; a failed upload leaves the slots it was filling free.
- Uploads use the plain layout (ggml's device kernels read the file's bytes): a file
  repacked for the CPU (`moectl align --repack`) cannot feed slots.
- Everything allocated here lives until `close()`, called after the model is freed.
"""

from __future__ import annotations

import ctypes
import functools
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from moed.engines.ggml_tensor import GGML_OBJECT_SIZE, GGML_TYPE_I32, NAME_OFFSET, GgmlTensor, loaded_library
from moed.engines.kernels import GGML_BACKEND_BUFFER_USAGE_WEIGHTS, GgmlInitParams, GgmlObject
from moed.engines.placement import DevicePlacement
from moed.engines.sources import Grant
from moed.protocol.errors import RequestTooLarge

# The model tensors a slot layer replaces, by llama.cpp's names: (layer, part, kind).
EXPERT_TENSOR = re.compile(rb"blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.(weight|bias|scale)\Z")
_LAYER_WEIGHT = re.compile(rb"blk\.(\d+)\.")
# The node the per-layer cycle stops at: the routing weights, gathered by expert id.
WEIGHTS_PREFIX = b"ffn_moe_weights-"
_WEIGHTS_NODE = re.compile(rb"ffn_moe_weights-(\d+)\Z")
# The expert axis of each kind: weight [ne0, ne1, n_expert], bias [ne0, n_expert], scale [n_expert].
_EXPERT_AXIS = {"weight": 2, "bias": 1, "scale": 0}
GGML_OBJECT_TYPE_TENSOR = 0

# The bytes of one expert's part: fetch(experts) -> get(expert, part) -> uint8 array.
ExpertBytes = Callable[[int, str], np.ndarray]
Fetch = Callable[[list[int]], ExpertBytes]


class SlotsExceeded(RequestTooLarge):
    """A batch names more distinct experts in one layer than the layer has device slots."""


class _Api:
    """The ggml entry points this module calls, bound once, from the copies llama.cpp runs."""

    def __init__(self) -> None:
        base = loaded_library("ggml-base")
        p, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int

        def bind(name: str, restype, *argtypes):
            fn = getattr(base, name)
            fn.restype, fn.argtypes = restype, list(argtypes)
            return fn

        self.init = bind("ggml_init", p, GgmlInitParams)
        self.free = bind("ggml_free", None, p)
        self.new_tensor = bind("ggml_new_tensor", p, p, i, i, ctypes.POINTER(ctypes.c_int64))
        self.tensor_overhead = bind("ggml_tensor_overhead", sz)
        self.alloc_ctx_tensors = bind("ggml_backend_alloc_ctx_tensors_from_buft", p, p, p)
        self.buffer_free = bind("ggml_backend_buffer_free", None, p)
        self.buffer_set_usage = bind("ggml_backend_buffer_set_usage", None, p, i)
        self.buffer_clear = bind("ggml_backend_buffer_clear", None, p, ctypes.c_uint8)
        self.buffer_usage = bind("ggml_backend_buffer_get_usage", i, p)
        self.buffer_type = bind("ggml_backend_buffer_get_type", p, p)
        self.buffer_is_host = bind("ggml_backend_buffer_is_host", ctypes.c_bool, p)
        self.buft_name = bind("ggml_backend_buft_name", ctypes.c_char_p, p)
        self.tensor_set = bind("ggml_backend_tensor_set", None, p, p, sz, sz)
        self.tensor_get = bind("ggml_backend_tensor_get", None, p, p, sz, sz)
        # (tensor, data, offset, size, n_copies, stride_tensor, stride_data): rows of a strided view
        self.tensor_set_2d = bind("ggml_backend_tensor_set_2d", None, p, p, sz, sz, sz, sz, sz)
        self.tensor_get_2d = bind("ggml_backend_tensor_get_2d", None, p, p, sz, sz, sz, sz, sz)
        self.nbytes = bind("ggml_nbytes", sz, p)


@functools.cache
def _api() -> _Api:
    return _Api()


def _topk_shape(layer: int, topk: int) -> tuple[int, int, int]:
    """(rows, k, row stride in bytes) of a top-k tensor: int32 ids, contiguous within a row."""
    t = GgmlTensor.from_address(topk)
    if t.type != GGML_TYPE_I32 or int(t.nb[0]) != 4:
        raise RuntimeError(f"the top-k of layer {layer} has ggml type {t.type}, nb[0] {t.nb[0]}: expected I32 rows")
    if int(t.ne[2]) * int(t.ne[3]) != 1:
        raise RuntimeError(f"the top-k of layer {layer} has more than two dimensions: unexpected graph")
    return int(t.ne[1]), int(t.ne[0]), int(t.nb[1])


def skip_ids(n_rows: int, k: int, n_slots: int) -> np.ndarray:
    """In-range ids for a failed decode's top-k: k distinct slots a row, the rows spread over
    all `n_slots` (k <= n_slots, checked at load). Never one slot for every id: a token naming
    the same expert k times, the whole batch on one slot, is a top-k llama.cpp never makes, and
    ggml-vulkan's MUL_MAT_ID computed inf from it at >= 256 tokens (gpt-oss on lavapipe,
    measured: inf in the KV cache's freed cells, NaN in every later batch's masked attention)."""
    return (np.arange(n_rows * k, dtype=np.int32) % n_slots).reshape(n_rows, k)


def _write_ids(topk: int, ids: np.ndarray, nb1: int) -> None:
    """(rows, k) int32 ids into the top-k view: k ids a row, rows `nb1` bytes apart (the
    argsort's other columns untouched); one 2-D copy into the device's memory."""
    n_rows, k = ids.shape
    _api().tensor_set_2d(topk, ids.ctypes.data, 0, 4 * k, n_rows, nb1, 4 * k)


# ---------------------------------------------------------------------- finding the tensors


@dataclass(frozen=True)
class ModelTensors:
    """What `model_tensors` found: the expert tensors and each layer's device."""

    experts: dict[tuple[int, str, str], int]  # (layer, part, kind) -> struct ggml_tensor address
    layer_buft: dict[int, int]  # layer -> buffer type of its weights in a device's memory


def _context_tensors(tensor_addr: int) -> list[int]:
    """Every tensor of the ggml context that holds `tensor_addr` (ggml_get_next_tensor's walk)."""
    obj = GgmlObject.from_address(tensor_addr - GGML_OBJECT_SIZE)
    mem_buffer = tensor_addr - obj.offs
    out, addr = [], mem_buffer
    for _ in range(1 << 22):
        o = GgmlObject.from_address(addr)
        if o.type == GGML_OBJECT_TYPE_TENSOR:
            out.append(mem_buffer + o.offs)
        if not o.next:
            break
        addr = o.next
    return out


def model_tensors(nodes: Iterable[int]) -> ModelTensors:
    """The expert tensors a graph computes with, and each layer's device, from graph nodes.

    llama.cpp offers no handle on a model's tensors; a graph's nodes lead to them. Each
    node's ggml context (the graph's, or the scheduler's for its copies) is walked
    object by object, and every tensor met there or as a source is kept when it is a
    model weight (its buffer's usage is WEIGHTS) named `blk.<L>.ffn_<part>_exps.<kind>`.
    A layer's device is the buffer type of its weights that are not in host memory
    (the router's first: `ffn_gate_inp.weight`).
    """
    api = _api()
    experts: dict[tuple[int, str, str], int] = {}
    buft: dict[int, int] = {}
    router: set[int] = set()
    walked: set[int] = set()
    seen: set[int] = set()

    def visit(addr: int) -> None:
        if not addr or addr in seen:
            return
        seen.add(addr)
        t = GgmlTensor.from_address(addr)
        if not t.buffer or api.buffer_usage(t.buffer) != GGML_BACKEND_BUFFER_USAGE_WEIGHTS:
            return
        name = t.name
        m = EXPERT_TENSOR.match(name)
        if m is not None:
            key = (int(m.group(1)), m.group(2).decode(), m.group(3).decode())
            if experts.setdefault(key, addr) != addr:
                raise LookupError(f"two ggml tensors named {name.decode()!r}")
        m = _LAYER_WEIGHT.match(name)
        if m is not None and not api.buffer_is_host(t.buffer):
            layer = int(m.group(1))
            is_router = name.endswith(b".ffn_gate_inp.weight")
            if layer not in buft or (is_router and layer not in router):
                buft[layer] = api.buffer_type(t.buffer)
                if is_router:
                    router.add(layer)

    for node in nodes:
        for start in (node, *GgmlTensor.from_address(node).src):
            if not start:
                continue
            mem = start - GgmlObject.from_address(start - GGML_OBJECT_SIZE).offs
            if mem in walked:
                continue
            walked.add(mem)
            for addr in _context_tensors(start):
                t = GgmlTensor.from_address(addr)
                visit(addr)
                for src in (*t.src, t.view_src):
                    visit(src)
    return ModelTensors(experts, buft)


def probe(model: int, n_nodes: int = 64) -> ModelTensors:
    """`model_tensors` of a loaded llama.cpp model (`llama_model *`), from a throwaway context.

    The context decodes one token with an eval callback that asks for no node but keeps
    the first `n_nodes` the scheduler asks about, and an abort callback that stops the
    CPU backend before its first node: the scheduler has split and allocated the graph
    (so the nodes are real), and no CPU split computes (the experts, in the CPU's
    buffer, are never read). The context is freed before this returns.
    """
    import llama_cpp

    nodes: list[int] = []

    def ask(tensor, want, _user_data) -> bool:
        if want and len(nodes) < n_nodes:
            nodes.append(int(tensor))
        return False

    callback = llama_cpp.ggml_backend_sched_eval_callback(ask)
    abort = llama_cpp.ggml_abort_callback(lambda _data: True)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 256, 1, 1, 1
    params.n_threads = params.n_threads_batch = 1
    params.op_offload = False
    params.no_perf = True
    params.cb_eval, params.cb_eval_user_data = callback, None
    params.abort_callback, params.abort_callback_data = abort, None
    ctx = llama_cpp.llama_init_from_model(model, params)
    if not ctx:
        raise RuntimeError("llama.cpp could not create the probe context")
    try:
        token = (llama_cpp.llama_token * 1)(0)
        llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(token, 1))  # 2: aborted, as meant
        if not nodes:
            raise LookupError("the probe's graph showed no node")
        return model_tensors(nodes)
    finally:
        llama_cpp.llama_free(ctx)


def weights_layer(node: int) -> int | None:
    """The layer of an `ffn_moe_weights-<layer>` node, else None."""
    m = _WEIGHTS_NODE.match(ctypes.string_at(node + NAME_OFFSET))
    return int(m.group(1)) if m else None


def topk_of(weights_node: int) -> int:
    """The top-k ids an `ffn_moe_weights-<layer>` node gathered by (its `src[1]`)."""
    topk = GgmlTensor.from_address(weights_node).src[1]
    if not topk:
        raise RuntimeError("ffn_moe_weights has no ids source: unexpected graph")
    return int(topk)


# ---------------------------------------------------------------------- the slots


@dataclass
class SlotStats:
    slots: int = 0  # device slots a layer (the largest, where a layer has fewer experts)
    layers: int = 0  # layers with slots
    device_bytes: int = 0  # the slot tensors' bytes in device memory
    hits: int = 0  # (layer, expert) a batch used that was in a slot already
    uploads: int = 0  # (layer, expert) uploaded into a slot
    upload_bytes: int = 0
    evictions: int = 0  # uploads into a slot that held another expert
    upload_s: float = 0.0  # time in ggml_backend_tensor_set for expert bytes
    cycles: int = 0  # route calls
    cycle_s: float = 0.0  # time in route, uploads included


@dataclass
class _Part:
    part: str  # gate, up, down, gate_up
    kind: str  # weight, bias, scale
    model: int  # the model's tensor (now pointing at the slots)
    slots: int  # our tensor of S experts
    stride: int  # bytes of one expert
    rows: np.ndarray | None  # kind != weight: the original tensor's bytes, one row an expert


@dataclass
class _SlotLayer:
    n_expert: int
    n_slots: int
    parts: list[_Part]
    ctx: int = 0
    buffer: int = 0
    lru: OrderedDict[int, int] = field(default_factory=OrderedDict)  # expert -> slot, oldest first
    free: list[int] = field(default_factory=list)


class DeviceSlots:
    """The device slots of one loaded model: `gpu_slots` a layer, in each device layer.

    `found`: `probe(model)` (or `model_tensors`), before any context of the model exists.
    `layers`: the layers to give slots (default: every layer whose weights are on a device).
    """

    def __init__(self, found: ModelTensors, gpu_slots: int, layers: Iterable[int] | None = None):
        if gpu_slots < 1:
            raise ValueError(f"gpu_slots must be at least 1, not {gpu_slots}")
        api = _api()
        by_layer: dict[int, list[tuple[str, str, int]]] = {}
        for (layer, part, kind), addr in sorted(found.experts.items()):
            by_layer.setdefault(layer, []).append((part, kind, addr))
        wanted = set(found.layer_buft) & set(by_layer) if layers is None else set(layers)
        for layer in sorted(wanted):
            if layer not in by_layer or layer not in found.layer_buft:
                raise ValueError(f"layer {layer} has no expert tensors on a device: no slots there")
        self._layers: dict[int, _SlotLayer] = {}
        self.stats = SlotStats()
        try:
            for layer in sorted(wanted):
                self._layers[layer] = self._build(layer, by_layer[layer], found.layer_buft[layer], gpu_slots)
        except BaseException:
            self.close()
            raise
        self.stats.layers = len(self._layers)
        self.stats.slots = max((L.n_slots for L in self._layers.values()), default=0)
        self.stats.device_bytes = sum(api.nbytes(p.slots) for L in self._layers.values() for p in L.parts)

    @staticmethod
    def _build(layer: int, tensors: list[tuple[str, str, int]], buft: int, gpu_slots: int) -> _SlotLayer:
        """Allocate the layer's slot tensors in `buft` and point the model's tensors at them."""
        api = _api()
        n_expert = {int(GgmlTensor.from_address(a).ne[_EXPERT_AXIS[kind]]) for _, kind, a in tensors}
        if len(n_expert) != 1:
            raise ValueError(f"layer {layer}: its expert tensors disagree on the expert count {sorted(n_expert)}")
        n = n_expert.pop()
        s = min(gpu_slots, n)
        ctx = api.init(GgmlInitParams(api.tensor_overhead() * (len(tensors) + 1), None, True))
        if not ctx:
            raise MemoryError("ggml_init failed")
        out = _SlotLayer(n, s, [], ctx=ctx, free=list(range(s)))
        try:
            made = []
            for part, kind, addr in tensors:
                t = GgmlTensor.from_address(addr)
                axis = _EXPERT_AXIS[kind]
                ne = [int(x) for x in t.ne]
                if any(ne[k] != 1 for k in range(axis + 1, 4)):
                    raise ValueError(f"{t.name.decode()}: {ne} has dimensions past the expert axis")
                ne[axis] = s
                made.append((part, kind, addr, api.new_tensor(ctx, t.type, 4, (ctypes.c_int64 * 4)(*ne))))
            out.buffer = api.alloc_ctx_tensors(ctx, buft)
            if not out.buffer:
                raise MemoryError(
                    f"layer {layer}: no {s} device slots in {api.buft_name(buft).decode()} "
                    f"({sum(api.nbytes(m) for *_, m in made)} bytes)"
                )
            api.buffer_set_usage(out.buffer, GGML_BACKEND_BUFFER_USAGE_WEIGHTS)  # the scheduler's cue
            # Zeros, never what the allocator left: a failed decode computes on to its end over
            # `skip_ids`' slots, and NaN there would stay in the KV cache's freed cells, where a
            # later batch's masked attention multiplies it by 0 (NaN; measured: wrong logits
            # after a split batch). Zero quantized blocks decode to zero weights.
            api.buffer_clear(out.buffer, 0)
            for part, kind, addr, mine in made:
                t, m = GgmlTensor.from_address(addr), GgmlTensor.from_address(mine)
                stride = int(t.nb[_EXPERT_AXIS[kind]])
                rows = None
                if kind != "weight":  # dense rows the graph indexes by id: keep them to copy into slots
                    rows = np.empty(n * stride, np.uint8)
                    api.tensor_get(addr, rows.ctypes.data, 0, rows.nbytes)
                out.parts.append(_Part(part, kind, addr, mine, stride, rows))
                t.buffer, t.data = m.buffer, m.data
                for k in range(4):
                    t.ne[k], t.nb[k] = m.ne[k], m.nb[k]
        except BaseException:
            if out.buffer:
                api.buffer_free(out.buffer)
            api.free(ctx)
            raise
        return out

    # ---- what the engine asks

    @property
    def layers(self) -> list[int]:
        return sorted(self._layers)

    def n_slots(self, layer: int) -> int:
        """The layer's device slots: gpu_slots, or its expert count where that is fewer."""
        return self._layers[layer].n_slots

    def __contains__(self, layer: int) -> bool:
        return layer in self._layers

    def part_bytes(self, layer: int) -> dict[str, int]:
        """Bytes of one expert's part, for each part moed serves (`weight` kinds) of the layer."""
        return {p.part: p.stride for p in self._layers[layer].parts if p.kind == "weight"}

    def resident(self, layer: int) -> list[int]:
        """The experts in the layer's slots, least recently used first."""
        return list(self._layers[layer].lru)

    def grant_reader(self, layer: int, grant: Grant) -> ExpertBytes:
        """Each (expert, part)'s bytes in moed's read-only mapping of `grant`'s slots (valid
        while the grant is held)."""
        sizes = self.part_bytes(layer)

        def read(expert: int, part: str) -> np.ndarray:
            n = sizes[part]
            return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(grant.address(expert, part)))

        return read

    # ---- the per-layer cycle

    def missing(self, layer: int, experts) -> list[int]:
        """Which of `experts` (a batch's distinct experts of `layer`) no slot holds: the ones a
        cycle must acquire from moed before `route`. Raises SlotsExceeded, before any
        acquire, when they are more than the layer's slots."""
        L = self._layers[layer]
        want = self._checked(layer, L, np.unique(np.asarray(experts, np.int64)))
        return [e for e in want.tolist() if e not in L.lru]

    def route(self, layer: int, topk: int, fetch: Fetch, ids: np.ndarray | None = None) -> np.ndarray:
        """Make every expert `topk` names resident in the layer's slots and rewrite its ids
        into slot ids, in the device's memory; returns the (n_tokens, k) expert ids.

        `topk`: the graph's top-k tensor (`topk_of(ffn_moe_weights node)`), computed, its
        readers not yet; `fetch(misses)`: called once, only when some expert is not in a
        slot, with those experts; returns their bytes (e.g. `grant_reader` of moed's
        acquire of them), read before `route` returns. `ids`: the top-k's ids where the
        caller read them already (one device read less).
        """
        t0 = time.perf_counter()
        L = self._layers[layer]
        n_rows, k, nb1 = _topk_shape(layer, topk)
        if k == 0 or n_rows == 0:
            return np.empty((n_rows, k), np.int32)
        if ids is None:
            ids = np.empty((n_rows, k), np.int32)
            _api().tensor_get_2d(topk, ids.ctypes.data, 0, 4 * k, n_rows, nb1, 4 * k)
        elif ids.shape != (n_rows, k):
            raise ValueError(f"layer {layer}: ids of shape {ids.shape} for a top-k of ({n_rows}, {k})")
        try:
            slot_of = self._place(layer, L, ids, fetch)
            _write_ids(topk, np.ascontiguousarray(slot_of[ids], np.int32), nb1)
        except BaseException:
            self.skip(layer, topk)  # in range of every slot tensor, whatever computes before the graph stops
            raise
        self.stats.cycles += 1
        self.stats.cycle_s += time.perf_counter() - t0
        return np.array(ids, np.int32)

    def skip(self, layer: int, topk: int) -> None:
        """In-range slots for every id of `topk` (`skip_ids`): a decode that failed (nothing
        placed for this layer) computes on to its end over them, never past a slot tensor."""
        n_rows, k, nb1 = _topk_shape(layer, topk)
        if k and n_rows:
            _write_ids(topk, skip_ids(n_rows, k, self._layers[layer].n_slots), nb1)

    def _checked(self, layer: int, L: _SlotLayer, want: np.ndarray) -> np.ndarray:
        """`want` (sorted distinct experts), checked against the layer's expert count and slots."""
        if len(want) and (want[0] < 0 or want[-1] >= L.n_expert):
            raise RuntimeError(f"layer {layer}: expert id {int(want[0] if want[0] < 0 else want[-1])} out of range")
        if len(want) > L.n_slots:
            raise SlotsExceeded(
                f"layer {layer}: the batch routes to {len(want)} experts, the layer has {L.n_slots} device slots"
            )
        return want

    def _place(self, layer: int, L: _SlotLayer, ids: np.ndarray, fetch: Fetch) -> np.ndarray:
        """Every expert of `ids` in a slot (uploading the misses); returns expert -> slot."""
        want = self._checked(layer, L, np.unique(ids))
        lru, misses = L.lru, []
        for e in want.tolist():
            if e in lru:
                lru.move_to_end(e)  # the batch's own hits go last: never a victim below
            else:
                misses.append(e)
        self.stats.hits += len(want) - len(misses)
        if misses:
            self._upload(L, misses, fetch)
        slot_of = np.zeros(L.n_expert, np.int32)
        for e in want.tolist():
            slot_of[e] = lru[e]
        return slot_of

    def _upload(self, L: _SlotLayer, misses: list[int], fetch: Fetch) -> None:
        api = _api()
        planned: list[tuple[int, int]] = []
        for e in misses:
            if L.free:
                planned.append((e, L.free.pop()))
            else:  # the oldest entry: not one of this batch's (they were moved last)
                _, slot = L.lru.popitem(last=False)
                planned.append((e, slot))
                self.stats.evictions += 1
        done = 0
        try:
            get = fetch(misses)
            t0 = time.perf_counter()
            for e, slot in planned:
                for p in L.parts:
                    if p.rows is None:
                        data = get(e, p.part)
                        if data.dtype != np.uint8 or data.nbytes != p.stride or not data.flags.c_contiguous:
                            raise ValueError(
                                f"expert {e} {p.part}: {data.nbytes} bytes of {data.dtype}, expected {p.stride} uint8"
                            )
                        ptr = data.ctypes.data
                    else:
                        ptr = p.rows.ctypes.data + e * p.stride
                    api.tensor_set(p.slots, ptr, slot * p.stride, p.stride)
                    self.stats.upload_bytes += p.stride
                L.lru[e] = slot
                done += 1
            self.stats.upload_s += time.perf_counter() - t0
            self.stats.uploads += done
        except BaseException:
            self.stats.uploads += done
            L.free.extend(slot for _, slot in planned[done:])  # their bytes are partial or stale
            raise

    # ---- counters and lifetime

    def totals(self) -> dict:
        """The counters, for stream_stats()["gpu_slots"]."""
        return dict(vars(self.stats))

    def rebind(self) -> None:
        """The daemon came back (moed.engines.streamer, `ensure_bound`): nothing to do. The
        slots hold copies of the file's bytes, uploaded from grants long released, and read
        nothing of the daemon's; they stay valid, and their LRU with them."""

    def close(self) -> None:
        """Free the slot tensors; only once llama.cpp will never compute with the model again."""
        api = _api()
        for L in self._layers.values():
            if L.buffer:
                api.buffer_free(L.buffer)
                L.buffer = 0
            if L.ctx:
                api.free(L.ctx)
                L.ctx = 0
        self._layers.clear()


class SlotPlacement(DevicePlacement):
    """Device slots as the engine's placement (moed.engines.placement.Placement) of their layers.

    The cycle may ask `needs(layer, ids)` first and acquire only what it names (the
    experts no slot holds; none on a full hit, which then needs no grant: `show(None,
    node, layer)`); `show` uploads from the grant and writes the slot ids over the top-k
    `node`. The grant's bytes are on the device when `show` returns, so `hide` has nothing
    to do and the grant may go at once; a failed decode's expert matmuls read device
    slots, always mapped (`failed`: nothing), over ids `skip` keeps in range.
    """

    what = "device slots"

    def _needed(self, layer: int, ids: np.ndarray) -> list[int]:
        return self.slots.missing(layer, ids)

    def _route(self, layer: int, node: int, grant: Grant | None, ids: np.ndarray | None) -> None:
        def fetch(misses: list[int]) -> ExpertBytes:
            if grant is None:
                raise RuntimeError(f"layer {layer}: experts {misses} are in no slot and nothing was acquired")
            return self.slots.grant_reader(layer, grant)

        self.slots.route(layer, node, fetch, ids)


__all__ = [
    "DeviceSlots",
    "ModelTensors",
    "SlotStats",
    "SlotPlacement",
    "SlotsExceeded",
    "WEIGHTS_PREFIX",
    "model_tensors",
    "probe",
    "topk_of",
    "weights_layer",
]
