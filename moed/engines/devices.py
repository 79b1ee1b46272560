"""Where llama.cpp computes a model: the GPU devices ggml sees and the layers it offloads.

What this module owns: `gpu_devices()` (the GPU and integrated-GPU devices of the
llama.cpp build in this process, by name) and `Offload`, the placement llama.cpp makes
for `n_gpu_layers` (llama-model.cpp's rule: N counts the output layer first, then the
blocks from the last: the output layer and the last N-1 blocks; the input embeddings
always on the CPU), which the
engine needs before the load to keep the routed experts on the CPU (the `-ot exps=CPU`
of llama.cpp's `--n-cpu-moe`) and the dense weights where stock puts them.

Invariants:
- `n_gpu_layers` means what llama-cpp-python and llama.cpp mean: N > 0 the output layer
  and the last N-1 blocks (1: the output layer alone), 0 nothing, a negative value (-1, as people write it) every layer
  (llama-cpp-python passes 0x7FFFFFFF for -1; llama.cpp's `n_gpu_layers()` reads any other
  negative value as every layer too).
- `offload_for` is None unless a GPU device exists and `n_gpu_layers` != 0: a CPU-only
  build or host computes as before, whatever `n_gpu_layers` says (llama.cpp ignores it
  there too).
- A software Vulkan device (lavapipe, type CPU) is not a GPU to ggml unless
  GGML_VK_VISIBLE_DEVICES names it; ggml then reports it as a GPU and it counts here.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from moed.engines.ggml_api import GGML_BACKEND_DEVICE_TYPE_GPU, GGML_BACKEND_DEVICE_TYPE_IGPU, api

_BLOCK = re.compile(r"blk\.(\d+)\.")
_INPUT = ("token_embd.", "per_layer_token_embd.")  # the input layer: always the CPU's


@functools.cache
def gpu_devices() -> tuple[str, ...]:
    """'name (description)' of every GPU or integrated-GPU device ggml enumerates."""
    g = api()
    out = []
    for i in range(g.ggml_backend_dev_count()):
        dev = g.ggml_backend_dev_get(i)
        if g.ggml_backend_dev_type(dev) in (GGML_BACKEND_DEVICE_TYPE_GPU, GGML_BACKEND_DEVICE_TYPE_IGPU):
            out.append(f"{g.ggml_backend_dev_name(dev).decode()} ({g.ggml_backend_dev_description(dev).decode()})")
    return tuple(out)


@dataclass(frozen=True)
class Offload:
    """llama.cpp's placement of a model of `n_layer` blocks with `n_gpu_layers` on `devices`."""

    n_layer: int
    n_gpu_layers: int
    devices: tuple[str, ...]
    # Device expert slots a layer (moed.engines.device_slots): the offloaded layers' routed
    # experts computed on the GPU; 0: every routed expert on the CPU (`--n-cpu-moe`).
    gpu_slots: int = 0

    @property
    def first_gpu_layer(self) -> int:
        """The first block on the GPU (blocks before it, and the input layer, are the CPU's)."""
        return max(self.n_layer + 1 - self.n_gpu_layers, 0)

    def on_gpu(self, tensor: str) -> bool:
        """Is this weight in a GPU's memory after the load? Block weights by their block;
        the input embeddings never; every other model-level weight with the output layer
        (block n_layer in llama.cpp's count, the first to be offloaded)."""
        m = _BLOCK.match(tensor)
        if m is not None:
            return int(m.group(1)) >= self.first_gpu_layer
        if tensor.startswith(_INPUT):
            return False
        return self.n_layer >= self.first_gpu_layer

    def describe(self) -> dict:
        """What computes where, for stream_stats: the dense layers' device, and the experts'."""
        first = self.first_gpu_layer
        gpu_layers = [first, self.n_layer - 1] if first < self.n_layer else []
        out = {
            "gpu": ", ".join(self.devices),
            "gpu_layers": gpu_layers,
            "output_on_gpu": self.n_layer >= first,
            "experts": "CPU",
        }
        if self.gpu_slots and gpu_layers:
            out["experts"] = "GPU slots" if first == 0 else "GPU slots and CPU"
            out["gpu_slots"] = self.gpu_slots
        return out


def compute_line(offload: Offload | None) -> str:
    """One line of what computes where, for the daemon's stats (`moectl stats`)."""
    if offload is None:
        return "experts and dense layers on the CPU"
    d = offload.describe()
    if not d["gpu_layers"]:
        return (
            f"experts on the CPU; output layer on {d['gpu']}"
            if d["output_on_gpu"]
            else "experts and dense layers on the CPU"
        )
    first, last = d["gpu_layers"]
    output = " and the output layer" if d["output_on_gpu"] else ""
    if "gpu_slots" in d:
        cpu = f"; layers 0-{first - 1}'s experts on the CPU" if first else ""
        return (
            f"layers {first}-{last}{output} on {d['gpu']}, their experts in {d['gpu_slots']} device slots a layer{cpu}"
        )
    return f"experts on the CPU; layers {first}-{last}{output} on {d['gpu']}"


def offload_for(headers, n_gpu_layers: int, gpu_slots: int = 0) -> Offload | None:
    """The model's offload with `n_gpu_layers` (negative: every layer) and `gpu_slots` device
    expert slots a layer, or None where nothing would be offloaded."""
    if n_gpu_layers == 0:
        return None
    devices = gpu_devices()
    if not devices:
        return None
    arch = str(headers[0].get("general.architecture", ""))
    n_layer = int(headers[0].get(f"{arch}.block_count", 0))
    return Offload(n_layer, every_layer(n_layer) if n_gpu_layers < 0 else n_gpu_layers, devices, gpu_slots)


def every_layer(n_layer: int) -> int:
    """llama.cpp's count for "every layer": the blocks and the output layer."""
    return n_layer + 1
