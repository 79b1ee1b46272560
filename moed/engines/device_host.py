"""Zero copy on unified memory: the device reads the offloaded layers' routed experts in place, from moed's RAM tier.

`StreamedLlama(n_gpu_layers=N, gpu_slots=S, gpu_zero_copy=True)`. Off by default: the
reference page measured a real integrated GPU (Strix Halo) reading imported host
memory at about 1 GB/s (decode 0.1-0.3 tok/s), where the copying device slots
(moed.engines.device_slots) read the device's own memory. It is here to be measured
where a GPU is lent, and for a device whose imported memory is its own (unified memory
that the driver maps at full speed).

What this module owns, for one loaded model:
- importing each of the RAM tier's segments that an offloaded layer's experts live in
  (the client's read-only MAP_SHARED mapping of the daemon's memfd, moed.client.segments)
  into the layer's device, once per segment, with `ggml_backend_dev_buffer_from_host_ptr`
  (ggml-vulkan: VK_EXT_external_memory_host), page-aligned pointer and size; the buffer is
  marked WEIGHTS, the scheduler's cue to place a `MUL_MAT_ID` on the device;
- one device tensor per part and size class over that import: part k of every moed slot of
  the class, `ne[2]` = the segment's capacity (its slot count), `nb[2]` = `part_stride[k]`,
  at `part_off[k]` (design §2: part k of slot i is at part_off[k] + i * part_stride[k]);
  ggml-vulkan finds expert i at `i * nb[2] / type_size * block_size` elements
  (ggml_vk_batch_stride) in both the matrix-vector and the matrix-matrix paths, so the
  stride must be a whole number of the type's blocks: true where the part's size is a
  multiple of the page (no padding; Qwen3-30B-A3B's Q4_K and Q6_K parts are), refused
  otherwise (a q8_0 part of 4352 bytes in 8192-byte slots would be read 7680 elements
  apart: measured, NaN logits). The offloaded layers' expert tensors (`ffn_*_exps.weight`)
  point at those;
- the expert biases and scales (gpt-oss's `ffn_*_exps.bias`, gemma4's `.scale`): indexed by
  the same ids, so each layer gets a device tensor of as many rows as the class has slots,
  and a row is copied (a few KiB) when the moed slot it stands for holds another expert of
  the layer than last time; nothing else is ever copied;
- the per-layer cycle `route(layer, topk, grant)`: at `ffn_moe_weights-L` (after the routing
  weights were gathered by expert id, as for device slots) every distinct expert the batch
  routes to is held by moed's grant, and the top-k's ids are rewritten into moed slot
  indices (`grant.slot(expert)`), through the top-k's strides.

Why the grant held until the next layer's acquire is enough (the placement's `hide` does
nothing): the device reads a moed slot from the moment the layer's `MUL_MAT_ID` runs until
it has run, and the slot may be reused only once its lease is released. The streamer
hands layer L's grant to the layer holds (moed.engines.holds), which hand it back at the
next routed stop, where it is released in the round trip of that layer's acquire, made
inside the eval callback at its `ffn_moe_weights` node (or handed on, unreleased, when
that layer acquires nothing), or after `llama_decode` returned (`finish`). Every layer
this placement serves acquires (`needs` names every routed expert), and under an offload
every stop comes to Python (the holds take no hit: no lane layers). With an eval callback set, ggml's scheduler
(`ggml_backend_sched_compute_splits`) computes each split in pieces that end at a node the
callback asked for, and calls `ggml_backend_synchronize` on the split's backend after every
piece, before the callback sees the node; splits run one after the other. Layer L's expert
matmuls come before layer L+1's routing weights in the graph's order (L+1's router reads
L's output), so they have run to completion on the device before the callback that
releases L's grant; the last piece of a graph is synchronized the same way before
`llama_decode` returns and `finish` releases. Nothing of the device's reads is left in
flight at a release. (Without a callback, ggml computes a split asynchronously: this
placement is never used without one.)

Invariants:
- Every routed expert of the batch is acquired at every layer (`needs`: all distinct ids),
  as on the CPU; S (`gpu_slots`) bounds the distinct experts one batch may name in a layer,
  as it does for the copying slots (`SlotsExceeded`, on which the engine lowers `n_batch`),
  so both feeds split a prompt alike. The moed slots themselves are the whole class's.
- The tensors are switched before any context computes with the model (as for device slots:
  the scheduler places an op when it splits a graph), and freed only after the model is
  freed; the segments' mappings outlive the imports (the client is closed after).
- A failed route, and `skip` at a later stop of a failed decode, write k distinct moed slots
  a row (`device_slots.skip_ids`): in range of every class tensor, whatever the slot holds (the decode's outputs are thrown
  away). Reading a hole of the sparse segment there faults a zero page into the memfd.

Refused at load, with the reason (`HostImportUnavailable`):
- a device with no host-pointer import (`buffer_from_host_ptr` absent from its interface), or
  one that refuses this import (ggml-vulkan: no VK_EXT_external_memory_host, a pointer or size
  not aligned to the device's minImportedHostPointerAlignment, a segment larger than its
  largest buffer, or no host-visible, coherent, cached memory type for it). The device's
  caps report `buffer_from_host_ptr=false` on Vulkan, which only keeps llama.cpp's own loader
  from importing; the entry point works (checked on lavapipe, Mesa 22.3);
- a class tensor larger than the device binds in one tensor (ggml-vulkan's supports_op:
  maxStorageBufferRange unless the device has 64-bit indexing; measured on lavapipe: a
  1 GiB budget's 358 MB part is refused, where ggml's scheduler would abort at the first
  graph). A class tensor spans the daemon's whole budget for that class divided among its
  parts (a real GPU's limit is its driver's maxStorageBufferRange, often 4 GiB or less: not
  measured here); ids index one tensor, so the slots cannot be split across bindings;
- a slot stride that is not a whole number of the part's blocks (above: a part whose size
  is not a multiple of the page, in a type whose block does not divide the page: q8_0's 34
  bytes, MXFP4's 17, Q4_K's 144 where the size is not a page multiple; real gpt-oss-20b's
  MXFP4 parts, 4,406,400 bytes, are such); a mapping that is not page-aligned; a source that
  is not moed's (no segments);
- experts not in the plain layout: a file repacked for the CPU (`moectl align --repack`) is
  refused before the load (llama_cpp._slots_repack), and the daemon must serve the model plain.

What a real GPU may do differently (not measured here; lavapipe is a CPU and reads the
pointer as it is): a driver that pins the imported pages (get_user_pages) would fault the
whole segment in at import: a segment is budget-sized and sparse (moed.daemon.ramtier), so
that is the daemon's whole budget per class, and the pages the daemon gives back with
MADV_REMOVE when it drops a slot would stay pinned under the import until it is freed.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from moed.engines import vm
from moed.engines.device_slots import (
    _EXPERT_AXIS,
    ModelTensors,
    SlotsExceeded,
    _api,
    _topk_shape,
    _write_ids,
    skip_ids,
)
from moed.engines.ggml_tensor import GgmlTensor, loaded_library
from moed.engines.kernels import GGML_BACKEND_BUFFER_USAGE_WEIGHTS, GgmlInitParams
from moed.engines.placement import DevicePlacement
from moed.engines.sources import ExpertSource, Grant, LaneSource

if TYPE_CHECKING:
    from moed.client.segments import Segment

PAGE = mmap.PAGESIZE
# struct ggml_backend_device_i (ggml-backend-impl.h): buffer_from_host_ptr is its ninth pointer.
_IFACE_BUFFER_FROM_HOST_PTR = 8


class HostImportUnavailable(RuntimeError):
    """The device cannot read moed's RAM tier in place (why is in the message)."""


class _HostApi:
    def __init__(self) -> None:
        base = loaded_library("ggml-base")
        p, sz = ctypes.c_void_p, ctypes.c_size_t

        def bind(name: str, restype, *argtypes):
            fn = getattr(base, name)
            fn.restype, fn.argtypes = restype, list(argtypes)
            return fn

        self.buft_device = bind("ggml_backend_buft_get_device", p, p)
        self.dev_name = bind("ggml_backend_dev_name", ctypes.c_char_p, p)
        self.from_host_ptr = bind("ggml_backend_dev_buffer_from_host_ptr", p, p, p, sz, sz)
        self.buffer_base = bind("ggml_backend_buffer_get_base", p, p)
        self.buffer_size = bind("ggml_backend_buffer_get_size", sz, p)
        self.alloc_size = bind("ggml_backend_buffer_get_alloc_size", sz, p, p)
        self.tensor_alloc = bind("ggml_backend_tensor_alloc", ctypes.c_int, p, p, p)
        self.supports_op = bind("ggml_backend_dev_supports_op", ctypes.c_bool, p, p)
        self.type_size = bind("ggml_type_size", sz, ctypes.c_int)
        self.type_name = bind("ggml_type_name", ctypes.c_char_p, ctypes.c_int)


@functools.cache
def _host_api() -> _HostApi:
    return _HostApi()


def can_import(device: int) -> bool:
    """Whether the device's interface has a host-pointer import at all (a NULL entry would be
    called as it is by `ggml_backend_dev_buffer_from_host_ptr`)."""
    slot = device + _IFACE_BUFFER_FROM_HOST_PTR * ctypes.sizeof(ctypes.c_void_p)
    return bool(ctypes.c_void_p.from_address(slot).value)


def mapping_perms(addr: int) -> str:
    """The permissions (/proc/self/maps: `r--s`) of the mapping holding `addr` ('' if none)."""
    for v in vm.read_maps():
        if v.start <= addr < v.end:
            return v.perms
    return ""


@dataclass
class HostStats:
    """stream_stats()["gpu_slots"] under zero copy: the copying slots' keys (nothing uploaded,
    nothing evicted on the device) and the imports'."""

    slots: int = 0  # S: the distinct experts one batch may name in a layer
    layers: int = 0  # layers whose experts the device reads in place
    device_bytes: int = 0  # device memory of its own: the bias and scale rows only
    hits: int = 0  # (layer, expert) a batch used, every one read in place from a moed slot
    uploads: int = 0
    upload_bytes: int = 0
    evictions: int = 0
    upload_s: float = 0.0
    cycles: int = 0  # route calls
    cycle_s: float = 0.0  # time in route (bias and scale rows included)
    zero_copy: bool = True
    segments: int = 0  # segments imported (one per size class an offloaded layer uses)
    imported_bytes: int = 0
    read_only: bool = True  # every imported mapping is read-only (PROT_READ, MAP_SHARED: r--s)
    row_uploads: int = 0  # bias and scale rows copied into a moed slot's row
    row_bytes: int = 0


@dataclass
class _Import:
    class_id: int
    segment: Segment
    device: int  # the ggml device it is imported into
    buffer: int  # the imported ggml buffer
    base: int  # its ggml base address (a device's own, not the host pointer)
    size: int
    tensors: dict[tuple, int] = field(default_factory=dict)  # (part, type, ne0, ne1, nb1) -> tensor


@dataclass
class _Rows:
    part: str
    kind: str  # bias, scale
    tensor: int  # our device tensor of `capacity` rows
    stride: int  # bytes of one row
    rows: np.ndarray  # the model's rows (one an expert), host copy
    owner: np.ndarray  # moed slot -> the expert of this layer whose row it holds (-1: none)


@dataclass
class _HostLayer:
    class_id: int
    n_expert: int
    capacity: int
    rows: list[_Rows] = field(default_factory=list)
    ctx: int = 0
    buffer: int = 0


class HostSlots:
    """The offloaded layers' expert tensors over moed's imported segments, for one loaded model.

    `found`: `device_slots.probe(model)`, before any context of the model exists; `source`:
    an ExpertSource whose `lane()` gives its segments (`layer_segment(layer)` -> (class id,
    Segment)); `gpu_slots`: S, the bound on a
    batch's distinct experts in one layer; `layers`: default every layer on a device.
    """

    def __init__(self, found: ModelTensors, source: ExpertSource, gpu_slots: int, layers=None):
        if gpu_slots < 1:
            raise ValueError(f"gpu_slots must be at least 1, not {gpu_slots}")
        segments = source.lane()
        if segments is None:
            raise HostImportUnavailable("gpu_zero_copy reads moed's RAM-tier segments: this source has none")
        by_layer: dict[int, list[tuple[str, str, int]]] = {}
        for (layer, part, kind), addr in sorted(found.experts.items()):
            by_layer.setdefault(layer, []).append((part, kind, addr))
        wanted = set(found.layer_buft) & set(by_layer) if layers is None else set(layers)
        for layer in sorted(wanted):
            if layer not in by_layer or layer not in found.layer_buft:
                raise ValueError(f"layer {layer} has no expert tensors on a device: nothing to read in place")
        self.gpu_slots = gpu_slots
        self.stats = HostStats(slots=gpu_slots)
        self._imports: dict[int, _Import] = {}
        self._layers: dict[int, _HostLayer] = {}
        self._ctx = _api().init(GgmlInitParams(_api().tensor_overhead() * (len(found.experts) + 1), None, True))
        if not self._ctx:
            raise MemoryError("ggml_init failed")
        try:
            for layer in sorted(wanted):
                self._layers[layer] = self._build(layer, by_layer[layer], found.layer_buft[layer], segments)
        except BaseException:
            self.close()
            raise
        self.stats.layers = len(self._layers)
        self.stats.segments = len(self._imports)
        self.stats.imported_bytes = sum(i.size for i in self._imports.values())
        self.stats.device_bytes = sum(_api().nbytes(r.tensor) for L in self._layers.values() for r in L.rows)

    # ---- load

    def _import(self, class_id: int, segment: Segment, buft: int) -> _Import:
        """The segment imported into `buft`'s device (once per class)."""
        imp = self._imports.get(class_id)
        if imp is not None:
            return imp
        api, host = _api(), _host_api()
        device = host.buft_device(buft)
        name = host.dev_name(device).decode() if device else "?"
        if not device or not can_import(device):
            raise HostImportUnavailable(
                f"gpu_zero_copy: device {name} has no host-pointer import (buffer_from_host_ptr): "
                "use the copying device slots (gpu_zero_copy=False)"
            )
        ptr, size = segment.base, -(-max(segment.info.segment_bytes, 1) // PAGE) * PAGE
        if ptr % PAGE:
            raise HostImportUnavailable(f"gpu_zero_copy: segment {class_id} is mapped at {ptr:#x}, not page-aligned")
        perms = mapping_perms(ptr)
        self.stats.read_only = self.stats.read_only and perms.startswith("r") and "w" not in perms
        buffer = host.from_host_ptr(device, ptr, size, size)
        if not buffer:
            raise HostImportUnavailable(
                f"gpu_zero_copy: device {name} refused to import moed's segment {class_id} ({size} bytes at "
                f"{ptr:#x}, mapping {perms or '?'}): ggml-vulkan needs VK_EXT_external_memory_host, a pointer and "
                "size aligned to the device's minImportedHostPointerAlignment, a size within its largest buffer "
                "and a host-visible coherent cached memory type; use gpu_zero_copy=False"
            )
        api.buffer_set_usage(buffer, GGML_BACKEND_BUFFER_USAGE_WEIGHTS)  # the scheduler's cue
        imp = _Import(
            class_id, segment, device, buffer, int(host.buffer_base(buffer) or 0), int(host.buffer_size(buffer))
        )
        self._imports[class_id] = imp
        return imp

    def _class_tensor(self, imp: _Import, part: str, model: GgmlTensor) -> int:
        """Our tensor of part `part` over every slot of the import's class, shaped as `model`'s."""
        key = (part, int(model.type), int(model.ne[0]), int(model.ne[1]), int(model.nb[1]))
        addr = imp.tensors.get(key)
        if addr is not None:
            return addr
        api, host = _api(), _host_api()
        info = imp.segment.info
        k = imp.segment.part_index(part)
        capacity, stride, off = info.capacity, info.part_stride[k], info.part_off[k]
        block = int(host.type_size(int(model.type)))
        if stride % block:
            raise HostImportUnavailable(
                f"gpu_zero_copy: moed's slots of part {part} are {stride} bytes apart ({info.part_bytes[k]} rounded "
                f"up to a page), not a whole number of {host.type_name(int(model.type)).decode()} blocks "
                f"({block} bytes): ggml-vulkan finds an expert at a whole number of blocks (nb[2] / block size); "
                "a part whose size is a multiple of the page has no padding (use gpu_zero_copy=False)"
            )
        ne = (ctypes.c_int64 * 4)(int(model.ne[0]), int(model.ne[1]), capacity, 1)
        addr = api.new_tensor(self._ctx, int(model.type), 4, ne)
        if not addr:
            raise MemoryError("ggml_new_tensor failed")
        t = GgmlTensor.from_address(addr)
        t.nb[2], t.nb[3] = stride, stride * capacity
        if not host.supports_op(imp.device, addr):  # else ggml's scheduler aborts at the first graph
            raise HostImportUnavailable(
                f"gpu_zero_copy: part {part} of moed's {capacity} slots of segment {imp.class_id} is "
                f"{_api().nbytes(addr)} bytes, more than device {host.dev_name(imp.device).decode()} binds in one "
                "tensor (ggml-vulkan: maxStorageBufferRange without 64-bit indexing, or its largest buffer): "
                "a smaller daemon budget, or gpu_zero_copy=False"
            )
        end = off + host.alloc_size(imp.buffer, addr)
        if off % PAGE or end > imp.size:
            raise HostImportUnavailable(
                f"gpu_zero_copy: part {part} of segment {imp.class_id} spans {off}-{end}, outside its "
                f"{imp.size}-byte import"
            )
        if host.tensor_alloc(imp.buffer, addr, imp.base + off) != 0:
            raise HostImportUnavailable(f"gpu_zero_copy: ggml could not place part {part} in the import")
        imp.tensors[key] = addr
        return addr

    def _build(self, layer: int, tensors: list[tuple[str, str, int]], buft: int, segments: LaneSource) -> _HostLayer:
        class_id, segment = segments.layer_segment(layer)
        n_expert = {int(GgmlTensor.from_address(a).ne[_EXPERT_AXIS[kind]]) for _, kind, a in tensors}
        if len(n_expert) != 1:
            raise ValueError(f"layer {layer}: its expert tensors disagree on the expert count {sorted(n_expert)}")
        imp = self._import(class_id, segment, buft)
        capacity = segment.info.capacity
        out = _HostLayer(class_id, n_expert.pop(), capacity)
        weights: list[tuple[str, str, int]] = []
        others: list[tuple[str, str, int]] = []
        for part, kind, addr in tensors:
            (weights if kind == "weight" else others).append((part, kind, addr))
        for part, _, addr in weights:
            t = GgmlTensor.from_address(addr)
            if part not in segment.info.part_names:
                raise ValueError(f"layer {layer}: moed's segment {class_id} has no part {part!r}")
            k = segment.part_index(part)
            if int(t.ne[3]) != 1 or int(t.nb[2]) != int(t.nb[1]) * int(t.ne[1]):
                raise ValueError(f"{t.name.decode()}: not one contiguous block an expert ({list(t.ne)}, {list(t.nb)})")
            if int(t.nb[2]) != segment.info.part_bytes[k]:
                raise ValueError(
                    f"{t.name.decode()}: {int(t.nb[2])} bytes an expert, moed's segment {class_id} part {part} "
                    f"holds {segment.info.part_bytes[k]}"
                )
            mine = GgmlTensor.from_address(self._class_tensor(imp, part, t))
            t.buffer, t.data = mine.buffer, mine.data
            for d in range(4):
                t.ne[d], t.nb[d] = mine.ne[d], mine.nb[d]
        if others:
            self._rows(layer, out, others, buft)
        return out

    def _rows(self, layer: int, out: _HostLayer, tensors: list[tuple[str, str, int]], buft: int) -> None:
        """Device tensors of `capacity` rows for the layer's biases and scales."""
        api = _api()
        out.ctx = api.init(GgmlInitParams(api.tensor_overhead() * (len(tensors) + 1), None, True))
        if not out.ctx:
            raise MemoryError("ggml_init failed")
        made = []
        for part, kind, addr in tensors:
            t = GgmlTensor.from_address(addr)
            axis = _EXPERT_AXIS[kind]
            ne = [int(x) for x in t.ne]
            if any(ne[d] != 1 for d in range(axis + 1, 4)):
                raise ValueError(f"{t.name.decode()}: {ne} has dimensions past the expert axis")
            ne[axis] = out.capacity
            made.append((part, kind, addr, api.new_tensor(out.ctx, t.type, 4, (ctypes.c_int64 * 4)(*ne))))
        out.buffer = api.alloc_ctx_tensors(out.ctx, buft)
        if not out.buffer:
            raise MemoryError(f"layer {layer}: no device memory for {out.capacity} bias/scale rows")
        api.buffer_set_usage(out.buffer, GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
        api.buffer_clear(out.buffer, 0)  # zero rows, never NaN, under ids `skip` wrote
        for part, kind, addr, mine in made:
            t, m = GgmlTensor.from_address(addr), GgmlTensor.from_address(mine)
            stride = int(t.nb[_EXPERT_AXIS[kind]])
            rows = np.empty(out.n_expert * stride, np.uint8)
            api.tensor_get(addr, rows.ctypes.data, 0, rows.nbytes)
            out.rows.append(_Rows(part, kind, mine, stride, rows, np.full(out.capacity, -1, np.int64)))
            t.buffer, t.data = m.buffer, m.data
            for d in range(4):
                t.ne[d], t.nb[d] = m.ne[d], m.nb[d]

    # ---- what the engine asks

    @property
    def layers(self) -> list[int]:
        return sorted(self._layers)

    def __contains__(self, layer: int) -> bool:
        return layer in self._layers

    def capacity(self, layer: int) -> int:
        """The moed slots the layer's class tensors cover (its segment's capacity)."""
        return self._layers[layer].capacity

    def needed(self, layer: int, ids) -> list[int]:
        """Every distinct expert of `ids` (all are acquired: the device reads them in moed's
        slots); SlotsExceeded, before any acquire, when they are more than S."""
        L = self._layers[layer]
        want = np.unique(np.asarray(ids, np.int64))
        if len(want) and (want[0] < 0 or want[-1] >= L.n_expert):
            raise RuntimeError(f"layer {layer}: expert id {int(want[0] if want[0] < 0 else want[-1])} out of range")
        if len(want) > self.gpu_slots:
            raise SlotsExceeded(
                f"layer {layer}: the batch routes to {len(want)} experts, gpu_slots={self.gpu_slots} a layer"
            )
        return [int(e) for e in want]

    def route(self, layer: int, topk: int, grant: Grant | None, ids: np.ndarray | None = None) -> np.ndarray:
        """Rewrite `topk`'s expert ids into the moed slots `grant` holds them in (device memory,
        through the top-k's strides); returns the (n_tokens, k) expert ids. `grant` must hold
        every expert `topk` names, until the layer's matmuls have run (the module docstring)."""
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
            want = np.asarray(self.needed(layer, ids), np.int64)
            if grant is None:
                raise RuntimeError(f"layer {layer}: experts {want.tolist()} routed and nothing was acquired")
            slots = np.fromiter((grant.slot(int(e)) for e in want), np.int64, len(want))
            if len(slots) and (slots.min() < 0 or slots.max() >= L.capacity):
                raise RuntimeError(f"layer {layer}: moed slot {int(slots.max())} outside the {L.capacity} imported")
            self._rows_for(L, want, slots)
            lut = np.zeros(L.n_expert, np.int32)
            lut[want] = slots
            _write_ids(topk, np.ascontiguousarray(lut[ids], np.int32), nb1)
        except BaseException:
            self.skip(layer, topk)  # in range of every class tensor, whatever computes before the graph stops
            raise
        self.stats.hits += len(want)
        self.stats.cycles += 1
        self.stats.cycle_s += time.perf_counter() - t0
        return np.array(ids, np.int32)

    def _rows_for(self, L: _HostLayer, want: np.ndarray, slots: np.ndarray) -> None:
        """Each bias and scale row the batch's moed slots stand for, where the slot last stood
        for another expert of the layer."""
        api = _api()
        for r in L.rows:
            stale = r.owner[slots] != want
            for e, s in zip(want[stale].tolist(), slots[stale].tolist()):
                api.tensor_set(r.tensor, r.rows.ctypes.data + e * r.stride, s * r.stride, r.stride)
                r.owner[s] = e
                self.stats.row_uploads += 1
                self.stats.row_bytes += r.stride

    def skip(self, layer: int, topk: int) -> None:
        """In-range moed slots for every id of `topk` (`skip_ids`): a decode that failed computes
        on to its end over them."""
        n_rows, k, nb1 = _topk_shape(layer, topk)
        if k and n_rows:
            _write_ids(topk, skip_ids(n_rows, k, self._layers[layer].capacity), nb1)

    def totals(self) -> dict:
        return dict(vars(self.stats))

    def rebind(self) -> None:
        """The daemon this engine imported died (moed.engines.streamer, `ensure_bound`): its
        segments are the device's class tensors, which the model's expert tensors point at, and
        llama.cpp's context was built over them. Not imported again into a running context:
        the engine fails, clearly, and keeps the old segments mapped until it is closed (the
        imports read them)."""
        raise HostImportUnavailable(
            "gpu_zero_copy: moed restarted, and this engine's device imported the old daemon's RAM tier "
            "(its expert tensors are built over those segments): close the engine and load it again "
            "(device slots without gpu_zero_copy survive a restart)"
        )

    def close(self) -> None:
        """Free the imports and the rows; only once llama.cpp will never compute with the model
        again, and before the segments' mappings go (the client closes them)."""
        api = _api()
        for L in self._layers.values():
            if L.buffer:
                api.buffer_free(L.buffer)
                L.buffer = 0
            if L.ctx:
                api.free(L.ctx)
                L.ctx = 0
        self._layers.clear()
        for imp in self._imports.values():
            api.buffer_free(imp.buffer)
        self._imports.clear()
        if self._ctx:
            api.free(self._ctx)
            self._ctx = 0


class HostPlacement(DevicePlacement):
    """Zero copy as the engine's placement (moed.engines.placement.Placement) of its layers.

    `needs` names every distinct routed expert, so every layer acquires; `show` rewrites the
    ids into the grant's moed slots. `hide` has nothing to do: the grant stays held until
    the streamer releases it at the next layer's acquire or after the decode, when the
    device has run this layer's matmuls (the module docstring says why). A failed decode's
    matmuls read the imported segments, always mapped (`failed`: nothing), over ids `skip`
    keeps in range.
    """

    what = "zero copy"

    def _needed(self, layer: int, ids: np.ndarray) -> list[int]:
        return self.slots.needed(layer, ids)

    def _route(self, layer: int, node: int, grant: Grant | None, ids: np.ndarray | None) -> None:
        self.slots.route(layer, node, grant, ids)


__all__ = ["HostImportUnavailable", "HostPlacement", "HostSlots", "HostStats", "can_import", "mapping_perms"]
