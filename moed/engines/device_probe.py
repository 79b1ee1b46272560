"""Finding a loaded model's routed expert tensors, and each layer's device, before any context computes.

What this module owns: `probe(model)` (a throwaway llama.cpp context whose first graph
is read in the eval callback's ask pass and never computed), `model_tensors(nodes)` (from
graph nodes to the model's `blk.L.ffn_*_exps.{weight,bias,scale}` tensors and each layer's
device buffer type), and `ModelTensors`, what they found grouped by layer for a device
placement (moed.engines.device_placement): which layers are on a device, each layer's
expert tensors, its expert count and the bytes of one expert's part.

Invariants:
- Nothing here reads an expert byte or computes a node: the probe's CPU backend is
  stopped by its abort callback before its first node (the input embeddings' `get_rows`),
  and the experts stay in the CPU's buffer, PROT_NONE.
- A layer is a device layer when some weight of it is not in host memory; its buffer
  type is the router's (`ffn_gate_inp.weight`) where that is on the device.
- An expert tensor's expert axis is the last of its kind (`EXPERT_AXIS`): weight
  [ne0, ne1, n_expert], bias [ne0, n_expert], scale [n_expert]; all of a layer's agree
  on the expert count (checked by `n_expert`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from moed.engines.ggml_api import GGML_BACKEND_BUFFER_USAGE_WEIGHTS, GgmlTensor, api, context_of, context_tensors

# The model tensors a device placement replaces, by llama.cpp's names: (layer, part, kind).
EXPERT_TENSOR = re.compile(rb"blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.(weight|bias|scale)\Z")
_LAYER_WEIGHT = re.compile(rb"blk\.(\d+)\.")
# The expert axis of each kind: weight [ne0, ne1, n_expert], bias [ne0, n_expert], scale [n_expert].
EXPERT_AXIS = {"weight": 2, "bias": 1, "scale": 0}


@dataclass(frozen=True)
class ExpertTensor:
    """One of a layer's expert tensors: `part` (gate, up, down, gate_up), `kind` (weight,
    bias, scale) and the model's `struct ggml_tensor` address."""

    part: str
    kind: str
    addr: int

    @property
    def axis(self) -> int:
        return EXPERT_AXIS[self.kind]

    @property
    def stride(self) -> int:
        """Bytes of one expert (one row, for a bias or a scale), as loaded: read it before a
        placement points the tensor at its own (moed.engines.device_placement.retarget)."""
        return int(GgmlTensor.from_address(self.addr).nb[self.axis])


@dataclass(frozen=True)
class ModelTensors:
    """What `model_tensors` found: the expert tensors and each layer's device."""

    experts: dict[tuple[int, str, str], int]  # (layer, part, kind) -> struct ggml_tensor address
    layer_buft: dict[int, int]  # layer -> buffer type of its weights in a device's memory

    def device_layers(self, layers: Iterable[int] | None = None) -> list[int]:
        """`layers` (default: every layer whose experts and weights are on a device), checked
        to be such layers; ValueError naming the first that is not."""
        with_experts = {layer for layer, _, _ in self.experts}
        wanted = sorted(with_experts & set(self.layer_buft) if layers is None else set(layers))
        for layer in wanted:
            if layer not in with_experts or layer not in self.layer_buft:
                raise ValueError(f"layer {layer} has no expert tensors on a device")
        return wanted

    def tensors(self, layer: int) -> list[ExpertTensor]:
        """The layer's expert tensors, by part then kind."""
        return [ExpertTensor(p, k, a) for (L, p, k), a in sorted(self.experts.items()) if L == layer]

    def n_expert(self, layer: int) -> int:
        """The layer's expert count, which all its expert tensors must agree on."""
        counts = {int(GgmlTensor.from_address(t.addr).ne[t.axis]) for t in self.tensors(layer)}
        if len(counts) != 1:
            raise ValueError(f"layer {layer}: its expert tensors disagree on the expert count {sorted(counts)}")
        return counts.pop()

    def part_bytes(self, layer: int) -> dict[str, int]:
        """Bytes of one expert's part, for each part moed serves (the `weight` kinds)."""
        return {t.part: t.stride for t in self.tensors(layer) if t.kind == "weight"}


def model_tensors(nodes: Iterable[int]) -> ModelTensors:
    """The expert tensors a graph computes with, and each layer's device, from graph nodes.

    llama.cpp offers no handle on a model's tensors; a graph's nodes lead to them. Each
    node's ggml context (the graph's, or the scheduler's for its copies) is walked
    object by object, and every tensor met there or as a source is kept when it is a
    model weight (its buffer's usage is WEIGHTS) named `blk.<L>.ffn_<part>_exps.<kind>`.
    A layer's device is the buffer type of its weights that are not in host memory
    (the router's first: `ffn_gate_inp.weight`).
    """
    found = _Found()
    walked: set[int] = set()
    for node in nodes:
        for start in (node, *GgmlTensor.from_address(node).src):
            if not start or context_of(start) in walked:
                continue
            walked.add(context_of(start))
            for addr in context_tensors(start):
                found.visit(addr)
                t = GgmlTensor.from_address(addr)
                for src in (*t.src, t.view_src):
                    found.visit(src)
    return ModelTensors(found.experts, found.buft)


class _Found:
    """What `model_tensors` has met so far."""

    def __init__(self) -> None:
        self.experts: dict[tuple[int, str, str], int] = {}
        self.buft: dict[int, int] = {}
        self._router: set[int] = set()
        self._seen: set[int] = set()

    def visit(self, addr: int) -> None:
        g = api()
        if not addr or addr in self._seen:
            return
        self._seen.add(addr)
        t = GgmlTensor.from_address(addr)
        if not t.buffer or g.ggml_backend_buffer_get_usage(t.buffer) != GGML_BACKEND_BUFFER_USAGE_WEIGHTS:
            return
        name = t.name
        m = EXPERT_TENSOR.match(name)
        if m is not None:
            key = (int(m.group(1)), m.group(2).decode(), m.group(3).decode())
            if self.experts.setdefault(key, addr) != addr:
                raise LookupError(f"two ggml tensors named {name.decode()!r}")
        m = _LAYER_WEIGHT.match(name)
        if m is not None and not g.ggml_backend_buffer_is_host(t.buffer):
            layer = int(m.group(1))
            is_router = name.endswith(b".ffn_gate_inp.weight")
            if layer not in self.buft or (is_router and layer not in self._router):
                self.buft[layer] = g.ggml_backend_buffer_get_type(t.buffer)
                if is_router:
                    self._router.add(layer)


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


__all__ = ["EXPERT_AXIS", "EXPERT_TENSOR", "ExpertTensor", "ModelTensors", "model_tensors", "probe"]
