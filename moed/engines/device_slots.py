"""Copied device slots: an offloaded layer's routed experts computed on the GPU, from S slots a layer fed from moed.

The experts of a layer llama.cpp put on a GPU (`n_gpu_layers`) are not loaded there
(the engine keeps them in the CPU's buffer, `-ot exps=CPU`, where nothing reads them).
Instead each such layer gets S device slots, and the graph's own `MUL_MAT_ID` runs
over them with the ids turned from experts into slots: llama.cpp PR #25294's
`n_slots`, the reference page's `--moe-slots`, done with ggml's public API only.
`SlotPlacement` is this strategy of moed.engines.device_placement's `DevicePlacement`
(which owns the stop, the top-k, the retargeting and the lifetime).

What this module owns, for one loaded model:
- one device tensor of S experts for each part of each slot layer (gate, up, down,
  gemma4's gate_up, and the expert biases `ffn_*_exps.bias` (gpt-oss, `add_id`) and
  scales `ffn_*_exps.scale` (gemma4, `get_rows`) a family has: both are indexed by the
  same ids);
- the transfer: a miss's bytes from moed's grant (the engine's read-only mapping of
  moed's slots; a bias's or scale's from the host copy) into its slot
  (`ggml_backend_tensor_set`), each part of each expert;
- each layer's `SlotLru` (moed.engines.device_lru: the policy, which slot goes next) and
  the counters.

Invariants:
- `to_acquire` names only the experts no slot holds: a full hit (`device_lru.full_hit`)
  acquires nothing and `show` only writes the slot ids it found.
- A slot the batch in flight uses is never evicted; an expert enters its slot's LRU
  entry only once all its parts are on the device, and a failed upload leaves the slots
  it was filling free.
- The grant's bytes are on the device when `show` returns: the grant may go at once, and
  the cycle lets it go then (`copies_grant`), so the holds hold nothing of a copied-slot
  layer's and the next layer's hit may be C's alone.
- A full hit is C's (moed.engines.holds, `device_layer` over each layer's `lru`): Python
  sees only the misses, and its own `full_hit` only where the holds did not try.
- Uploads use the plain layout (ggml's device kernels read the file's bytes): a file
  repacked for the CPU (`moectl align --repack`) cannot feed slots.
- The slots hold copies of the file's bytes and read nothing of the daemon's after an
  upload, so they survive a daemon restart (`rebind` does nothing).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moed.engines.device_lru import SlotLru, full_hit
from moed.engines.device_placement import DeviceLayer, DevicePart, DevicePlacement
from moed.engines.device_probe import ModelTensors
from moed.engines.ggml_api import api
from moed.engines.sources import Grant

# The bytes of one expert's part: reader(expert, part) -> uint8 array.
ExpertBytes = Callable[[int, str], np.ndarray]


@dataclass
class _SlotLayer(DeviceLayer):
    parts: list[DevicePart]
    lru: SlotLru


class SlotPlacement(DevicePlacement):
    """The copied device slots of one loaded model: `gpu_slots` a layer (fewer where a layer
    has fewer experts), in each device layer, as the engine's placement of those layers.

    `found`: `probe(model)`, before any context of the model exists; `layers`: the layers
    to give slots (default: every layer whose weights are on a device).
    """

    what = "device slots"
    copies_grant = True  # the misses' bytes are on the device when show returns: the grant goes then

    def _build_layer(self, found: ModelTensors, layer: int) -> _SlotLayer:
        """The layer's slot tensors in its device buffer type, the model's tensors pointed at them."""
        n = found.n_expert(layer)
        s = min(self.gpu_slots, n)
        parts = self._place_parts(layer, found.tensors(layer), s, found.layer_buft[layer])
        return _SlotLayer(n, s, s, parts, SlotLru(n, s))

    # ---- what the engine asks

    def n_slots(self, layer: int) -> int:
        """The layer's device slots: gpu_slots, or its expert count where that is fewer."""
        return self._layers[layer].n_slots

    def part_bytes(self, layer: int) -> dict[str, int]:
        """Bytes of one expert's part, for each part moed serves (`weight` kinds) of the layer."""
        return {p.source.part: p.stride for p in self._slots(layer).parts if p.rows is None}

    def resident(self, layer: int) -> list[int]:
        """The experts in the layer's slots, least recently used first."""
        return self._slots(layer).lru.resident()

    def totals(self) -> dict:
        self._count_hits()
        return super().totals()

    def close(self) -> None:
        self._count_hits()  # the LRUs go with the layers; their hits stay in the totals
        super().close()

    def _count_hits(self) -> None:
        """The hits, counted by each layer's LRU (a full hit counts its own, as C will)."""
        if self._layers:
            self.counts.hits = sum(L.lru.hits for L in self._each())

    def rebind(self) -> None:
        """Nothing to do: the slots hold copies of the file's bytes, uploaded from grants long
        released, and read nothing of the daemon's; they stay valid, and their LRU with them."""

    # ---- the per-layer cycle

    def _full_hit(self, layer: int, ids: np.ndarray) -> np.ndarray | None:
        return full_hit(self._slots(layer).lru, np.asarray(ids))

    def lru(self, layer: int) -> SlotLru:
        """The layer's LRU: the layer holds take its full hits in C, over these very arrays."""
        return self._slots(layer).lru

    def _distinct_to_acquire(self, layer: int, want: np.ndarray) -> list[int]:
        return self._slots(layer).lru.misses(want)

    def _slot_ids(self, layer: int, ids: np.ndarray, grant: Grant | None) -> np.ndarray:
        L = self._slots(layer)
        want = self.distinct(layer, ids)
        if grant is None and L.lru.misses(want):
            raise RuntimeError(f"layer {layer}: experts {L.lru.misses(want)} are in no slot and nothing was acquired")
        misses, slots, evicted = L.lru.admit(want)
        self.counts.evictions += evicted
        if misses:
            assert grant is not None
            self._upload(L, misses, slots, _grant_reader(grant, self.part_bytes(layer)))
        return L.lru.slot_of_expert[ids]

    def _upload(self, L: _SlotLayer, misses: list[int], slots: list[int], read: ExpertBytes) -> None:
        """Each miss's parts into the slot chosen for it, committed to the LRU once whole."""
        g, c = api(), self.counts
        t0 = time.perf_counter()
        for e, slot in zip(misses, slots):
            for p in L.parts:
                g.ggml_backend_tensor_set(p.ours, _bytes_of(p, e, read), slot * p.stride, p.stride)
                c.upload_bytes += p.stride
            L.lru.assign(e, slot)
            c.uploads += 1
        c.upload_s += time.perf_counter() - t0

    def _slots(self, layer: int) -> _SlotLayer:
        L = self._layers[layer]
        assert isinstance(L, _SlotLayer)
        return L

    def _each(self) -> list[_SlotLayer]:
        return [self._slots(layer) for layer in self._layers]


def _bytes_of(p: DevicePart, expert: int, read: ExpertBytes) -> int:
    """The address of `expert`'s bytes of part `p`: moed's (a weight) or the host copy's row."""
    if p.rows is not None:
        return p.rows.ctypes.data + expert * p.stride
    data = read(expert, p.source.part)
    if data.dtype != np.uint8 or data.nbytes != p.stride or not data.flags.c_contiguous:
        raise ValueError(
            f"expert {expert} {p.source.part}: {data.nbytes} bytes of {data.dtype}, expected {p.stride} uint8"
        )
    return data.ctypes.data


def _grant_reader(grant: Grant, sizes: dict[str, int]) -> ExpertBytes:
    """Each (expert, part)'s bytes in moed's read-only mapping of `grant`'s slots (valid while
    the grant is held)."""

    def read(expert: int, part: str) -> np.ndarray:
        n = sizes[part]
        return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(grant.address(expert, part)))

    return read


__all__ = ["ExpertBytes", "SlotPlacement"]
