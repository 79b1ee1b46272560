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
- the ids of a stop (`_slot_ids`, called by `show` at `ffn_moe_weights-L`, after the
  routing weights were gathered by expert id, as for device slots): every distinct expert
  the batch routes to is held by moed's grant, and the top-k's ids are rewritten into moed
  slot indices (`grant.slot(expert)`).

`ZeroCopyPlacement` is this strategy of moed.engines.device_placement's `DevicePlacement`
(which owns the stop, the top-k, the retargeting and the lifetime). It allocates no slots
of its own: the slots are moed's.

Why the grant held until the next layer's acquire is enough (the placement's `hide` does
nothing): the device reads a moed slot from the moment the layer's `MUL_MAT_ID` runs until
it has run, and the slot may be reused only once its lease is released. The streamer
hands layer L's grant to the layer holds (moed.engines.holds), which hand it back at the
next routed stop, where it is released in the round trip of that layer's acquire, made
inside the eval callback at its `ffn_moe_weights` node (or handed on, unreleased, when
that layer acquires nothing), or after `llama_decode` returned (`finish`). Every layer
this placement serves acquires (`to_acquire` names every routed expert), so every one of its
stops comes to Python (it gives the holds no LRU: `lru` is None, and `copies_grant` False:
its grant goes at the next stop). With an eval callback set, ggml's scheduler
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
- Every routed expert of the batch is acquired at every layer (`to_acquire`: all distinct ids),
  as on the CPU; S (`gpu_slots`) bounds the distinct experts one batch may name in a layer,
  as it does for the copying slots (`SlotsExceeded`, on which the engine lowers `n_batch`),
  so both feeds split a prompt alike. The moed slots themselves are the whole class's.
- The tensors are switched before any context computes with the model (as for device slots:
  the scheduler places an op when it splits a graph), and freed only after the model is
  freed; the segments' mappings outlive the imports (the client is closed after).
- A failed `show`, and `skip` at a later stop of a failed decode, write k distinct moed slots
  a row (`device_placement.skip_ids`): in range of every class tensor, whatever the slot
  holds (the decode's outputs are thrown away). Reading a hole of the sparse segment there
  faults a zero page into the memfd.

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
import mmap
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from moed.engines import vm
from moed.engines.device_placement import DeviceLayer, DevicePart, DevicePlacement, DeviceStats, retarget
from moed.engines.device_probe import ExpertTensor, ModelTensors
from moed.engines.ggml_api import GgmlTensor, api, has_host_ptr_import
from moed.engines.sources import ExpertSource, Grant

if TYPE_CHECKING:
    from moed.client.segments import Segment

PAGE = mmap.PAGESIZE


class HostImportUnavailable(RuntimeError):
    """The device cannot read moed's RAM tier in place (why is in the message)."""


def mapping_perms(addr: int) -> str:
    """The permissions (/proc/self/maps: `r--s`) of the mapping holding `addr` ('' if none)."""
    for v in vm.read_maps():
        if v.start <= addr < v.end:
            return v.perms
    return ""


@dataclass
class ZeroCopyStats(DeviceStats):
    """stream_stats()["gpu_slots"] under zero copy: the copying slots' keys (nothing uploaded,
    nothing evicted on the device; `hits` is ZeroCopyPlacement.uses: every (layer, expert) a
    batch used, each read in place from a moed slot; `device_bytes` the bias and scale rows only) and the imports'."""

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
class _ZeroCopyLayer(DeviceLayer):
    class_id: int
    rows: list[DevicePart]  # the biases and scales: `n_ids` rows, one a moed slot
    owner: np.ndarray  # moed slot -> the expert of this layer whose rows it holds (-1: none)


class ZeroCopyPlacement(DevicePlacement):
    """The offloaded layers' expert tensors over moed's imported segments, for one loaded model,
    as the engine's placement of those layers.

    `found`: `probe(model)`, before any context of the model exists; `source`: an
    ExpertSource whose `lane()` gives its segments (`layer_segment(layer)` -> (class id,
    Segment)); `gpu_slots`: S, the bound on a batch's distinct experts in one layer;
    `layers`: default every layer on a device.

    `to_acquire` names every distinct routed expert, so every layer acquires; `show` rewrites the
    ids into the grant's moed slots. `hide` has nothing to do: the grant stays held until
    the streamer releases it at the next layer's acquire or after the decode, when the
    device has run this layer's matmuls (the module docstring says why).
    """

    what = "zero copy"
    counts: ZeroCopyStats

    def __init__(self, found: ModelTensors, source: ExpertSource, gpu_slots: int, layers=None):
        segments = source.lane()
        if segments is None:
            raise HostImportUnavailable("gpu_zero_copy reads moed's RAM-tier segments: this source has none")
        self._segments = segments
        self._imports: dict[int, _Import] = {}
        self._class_ctx = 0  # the class tensors' headers (their data: the imports)
        # Every (layer, expert) a batch used, each read in place from a moed slot: reported
        # under the copying slots' key `hits` (totals), though nothing here can miss.
        self.uses = 0
        super().__init__(found, gpu_slots, layers)
        self.counts.segments = len(self._imports)
        self.counts.imported_bytes = sum(i.size for i in self._imports.values())

    def _new_counts(self) -> ZeroCopyStats:
        return ZeroCopyStats()

    def totals(self) -> dict:
        return {**super().totals(), "hits": self.uses}

    # ---- load

    def _build_layer(self, found: ModelTensors, layer: int) -> _ZeroCopyLayer:
        """The layer's weights pointed at its class's tensors over the import, and its biases'
        and scales' rows in device tensors of our own."""
        class_id, segment = self._segments.layer_segment(layer)
        n = found.n_expert(layer)
        buft = found.layer_buft[layer]
        imp = self._import(class_id, segment, buft)
        if not self._class_ctx:
            self._class_ctx = self._context(len(found.experts))
        tensors = found.tensors(layer)
        for t in tensors:
            if t.kind == "weight":
                self._check_served(layer, t, class_id, segment)
                retarget(t.addr, self._class_tensor(imp, t))
        others = [t for t in tensors if t.kind != "weight"]
        capacity = segment.info.capacity
        rows = self._place_parts(layer, others, capacity, buft) if others else []
        return _ZeroCopyLayer(n, min(self.gpu_slots, n), capacity, class_id, rows, np.full(capacity, -1, np.int64))

    def _import(self, class_id: int, segment: Segment, buft: int) -> _Import:
        """The segment imported into `buft`'s device (once per class)."""
        imp = self._imports.get(class_id)
        if imp is not None:
            return imp
        g = api()
        device = g.ggml_backend_buft_get_device(buft)
        name = g.ggml_backend_dev_name(device).decode() if device else "?"
        if not device or not has_host_ptr_import(device):
            raise HostImportUnavailable(
                f"gpu_zero_copy: device {name} has no host-pointer import (buffer_from_host_ptr): "
                "use the copying device slots (gpu_zero_copy=False)"
            )
        ptr, size = segment.base, -(-max(segment.info.segment_bytes, 1) // PAGE) * PAGE
        if ptr % PAGE:
            raise HostImportUnavailable(f"gpu_zero_copy: segment {class_id} is mapped at {ptr:#x}, not page-aligned")
        perms = mapping_perms(ptr)
        self.counts.read_only = self.counts.read_only and perms.startswith("r") and "w" not in perms
        buffer = g.ggml_backend_dev_buffer_from_host_ptr(device, ptr, size, size)
        if not buffer:
            raise HostImportUnavailable(
                f"gpu_zero_copy: device {name} refused to import moed's segment {class_id} ({size} bytes at "
                f"{ptr:#x}, mapping {perms or '?'}): ggml-vulkan needs VK_EXT_external_memory_host, a pointer and "
                "size aligned to the device's minImportedHostPointerAlignment, a size within its largest buffer "
                "and a host-visible coherent cached memory type; use gpu_zero_copy=False"
            )
        self._own_buffer(buffer)
        base, got = int(g.ggml_backend_buffer_get_base(buffer) or 0), int(g.ggml_backend_buffer_get_size(buffer))
        imp = self._imports[class_id] = _Import(class_id, segment, device, buffer, base, got)
        return imp

    @staticmethod
    def _check_served(layer: int, t: ExpertTensor, class_id: int, segment: Segment) -> None:
        """The model's weight `t` is one contiguous block an expert, of the bytes moed serves."""
        m = GgmlTensor.from_address(t.addr)
        if t.part not in segment.info.part_names:
            raise ValueError(f"layer {layer}: moed's segment {class_id} has no part {t.part!r}")
        k = segment.part_index(t.part)
        if int(m.ne[3]) != 1 or int(m.nb[2]) != int(m.nb[1]) * int(m.ne[1]):
            raise ValueError(f"{m.name.decode()}: not one contiguous block an expert ({list(m.ne)}, {list(m.nb)})")
        if int(m.nb[2]) != segment.info.part_bytes[k]:
            raise ValueError(
                f"{m.name.decode()}: {int(m.nb[2])} bytes an expert, moed's segment {class_id} part {t.part} "
                f"holds {segment.info.part_bytes[k]}"
            )

    def _class_tensor(self, imp: _Import, t: ExpertTensor) -> int:
        """Our tensor of part `t.part` over every slot of the import's class, shaped as `t`."""
        model = GgmlTensor.from_address(t.addr)
        key = (t.part, int(model.type), int(model.ne[0]), int(model.ne[1]), int(model.nb[1]))
        addr = imp.tensors.get(key)
        if addr is None:
            addr = imp.tensors[key] = self._new_class_tensor(imp, t.part, model)
        return addr

    def _new_class_tensor(self, imp: _Import, part: str, model: GgmlTensor) -> int:
        g = api()
        info = imp.segment.info
        k = imp.segment.part_index(part)
        capacity, stride, off = info.capacity, info.part_stride[k], info.part_off[k]
        block = int(g.ggml_type_size(int(model.type)))
        if stride % block:
            raise HostImportUnavailable(
                f"gpu_zero_copy: moed's slots of part {part} are {stride} bytes apart ({info.part_bytes[k]} rounded "
                f"up to a page), not a whole number of {g.ggml_type_name(int(model.type)).decode()} blocks "
                f"({block} bytes): ggml-vulkan finds an expert at a whole number of blocks (nb[2] / block size); "
                "a part whose size is a multiple of the page has no padding (use gpu_zero_copy=False)"
            )
        ne = (ctypes.c_int64 * 4)(int(model.ne[0]), int(model.ne[1]), capacity, 1)
        addr = g.ggml_new_tensor(self._class_ctx, int(model.type), 4, ne)
        if not addr:
            raise MemoryError("ggml_new_tensor failed")
        t = GgmlTensor.from_address(addr)
        t.nb[2], t.nb[3] = stride, stride * capacity
        if not g.ggml_backend_dev_supports_op(imp.device, addr):  # else ggml's scheduler aborts at the first graph
            raise HostImportUnavailable(
                f"gpu_zero_copy: part {part} of moed's {capacity} slots of segment {imp.class_id} is "
                f"{g.ggml_nbytes(addr)} bytes, more than device {g.ggml_backend_dev_name(imp.device).decode()} "
                "binds in one tensor (ggml-vulkan: maxStorageBufferRange without 64-bit indexing, or its largest "
                "buffer): a smaller daemon budget, or gpu_zero_copy=False"
            )
        end = off + g.ggml_backend_buffer_get_alloc_size(imp.buffer, addr)
        if off % PAGE or end > imp.size:
            raise HostImportUnavailable(
                f"gpu_zero_copy: part {part} of segment {imp.class_id} spans {off}-{end}, outside its "
                f"{imp.size}-byte import"
            )
        if g.ggml_backend_tensor_alloc(imp.buffer, addr, imp.base + off) != 0:
            raise HostImportUnavailable(f"gpu_zero_copy: ggml could not place part {part} in the import")
        return addr

    # ---- the per-layer cycle

    def capacity(self, layer: int) -> int:
        """The moed slots the layer's class tensors cover (its segment's capacity)."""
        return self._layers[layer].n_ids

    def _distinct_to_acquire(self, layer: int, want: np.ndarray) -> list[int]:
        return want.tolist()  # all: the device reads them in moed's slots

    def _slot_ids(self, layer: int, ids: np.ndarray, grant: Grant | None) -> np.ndarray:
        """`ids` as the moed slots `grant` holds them in; `grant` must hold every expert they
        name until the layer's matmuls have run (the module docstring)."""
        L = self._zero_copy(layer)
        want = self.distinct(layer, ids)
        if grant is None:
            raise RuntimeError(f"layer {layer}: experts {want.tolist()} routed and nothing was acquired")
        slots = np.fromiter((grant.slot(int(e)) for e in want), np.int64, len(want))
        if len(slots) and (slots.min() < 0 or slots.max() >= L.n_ids):
            raise RuntimeError(f"layer {layer}: moed slot {int(slots.max())} outside the {L.n_ids} imported")
        self._rows_for(L, want, slots)
        lut = np.zeros(L.n_expert, np.int32)
        lut[want] = slots
        self.uses += len(want)
        return lut[ids]

    def _rows_for(self, L: _ZeroCopyLayer, want: np.ndarray, slots: np.ndarray) -> None:
        """Each bias and scale row the batch's moed slots stand for, where the slot last stood
        for another expert of the layer."""
        g, c = api(), self.counts
        stale = L.owner[slots] != want
        for e, s in zip(want[stale].tolist(), slots[stale].tolist()):
            for r in L.rows:
                assert r.rows is not None  # rows parts only: the weights are moed's
                g.ggml_backend_tensor_set(r.ours, r.rows.ctypes.data + e * r.stride, s * r.stride, r.stride)
                c.row_uploads += 1
                c.row_bytes += r.stride
            L.owner[s] = e

    def _zero_copy(self, layer: int) -> _ZeroCopyLayer:
        L = self._layers[layer]
        assert isinstance(L, _ZeroCopyLayer)
        return L

    # ---- lifetime

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
        """Free the imports and the rows (the base's close); only once llama.cpp will never
        compute with the model again, and before the segments' mappings go (the client closes
        them)."""
        self._imports.clear()
        self._class_ctx = 0
        super().close()


__all__ = ["HostImportUnavailable", "ZeroCopyPlacement", "ZeroCopyStats", "mapping_perms"]
