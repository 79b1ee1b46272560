"""llama.cpp's repacked CPU kernels, reached from ctypes (llama-cpp-python 0.3.36).

Stock `llama_cpp.Llama` puts every weight its CPU backend can repack into the
CPU_REPACK buffer type at load: ggml interleaves the rows of Q4_0, Q4_K, IQ4_NL,
MXFP4 (and Q2_K with AVX-512) weights into blocks (`q4_0_8x8`, ...) whose kernels
are 1.2-1.5x faster than the plain ones. A streamed model cannot let llama.cpp do
that (a repacked tensor leaves its file offset, and loading would read every
expert), so moed does it itself, after the load, with ggml's own code.

What this module owns:
- the CPU device as ggml has it: its CPU_REPACK buffer type, the CPU feature
  probes (`CpuBackend`, one per process; every ggml call is moed.engines.ggml_api's);
- `layout_of(ggml_type, ne)`: the layout this CPU's ggml computes a weight on,
  "plain" or ggml's repack name ("q4_0_8x8"); ggml itself decides (a tensor
  allocated in CPU_REPACK gets repack traits in `extra` exactly when ggml would
  repack it), the name follows ggml's `ggml_repack_get_optimal_repack_type`;
- `Repacker`: ggml's repack of one expert's bytes (`moectl align --repack`);
- `DenseOverrides`: llama.cpp's own `tensor_buft_overrides` (llama.h) naming, at
  load, the dense matmul weights stock llama.cpp puts in CPU_REPACK: llama.cpp then
  allocates and repacks them itself, as stock's load does;
- `find_in_graph`: the loaded model's expert `struct ggml_tensor`s, reached from a
  graph node the eval callback hands over (its sources lead to a model weight; the
  weight's ggml context holds the experts), each checked by name and data address;
- `KernelSwitch`: pointing expert tensors whose bytes are already repacked
  (`moectl align --repack`) at the repacked kernels.

How the engine finds and switches tensors, and why it is deterministic (issue 30):
nothing here searches the process's memory. The dense weights are placed by
llama.cpp's loader from a list moed computes from the file's header alone. The
expert tensors are found from the first graph node Python sees in the first decode
(before any expert matmul of that decode), through pointers llama.cpp itself wrote.
Every ggml entry point is taken from the very library copy llama.cpp runs
(`ggml_api.loaded_library`): a second copy's CPU_REPACK buffer type is a
different pointer, which llama.cpp's scheduler rejects with an abort.

Invariants:
- No byte is repacked by moed's code: `ggml_backend_tensor_set` on a CPU_REPACK
  tensor runs ggml's repack, so every layout equals what stock llama.cpp builds.
- ggml's CPU backend chooses its repacked kernels from three fields of a weight:
  `buffer` (whose buffer type must be CPU_REPACK), `extra` (the repack traits) and
  `data` (repacked bytes). A switched tensor has all three set together.
- The repack keeps a tensor's size and groups rows within each expert (ggml
  interleaves runs of 4 or 8 rows and `ne[1]` is a multiple of them), so expert
  `e`'s repacked bytes are the same range `[e * nb[2], (e + 1) * nb[2])` as its
  plain ones (tests/unit/test_kernels.py checks it per type against a whole-tensor
  repack).
- The AMX buffer type is never used: moed's build has none (scripts/llama-build-flags:
  it crashes on K-quants), and with a build that has it moed still uses CPU_REPACK only.
- Everything allocated here lives until `KernelSwitch.close()`, called after the
  model is freed; a `DenseOverrides` lives until the load that reads it returns.
"""

from __future__ import annotations

import ctypes
import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass

from moed.engines.ggml_api import (
    GGML_BACKEND_BUFFER_USAGE_WEIGHTS,
    NAME_OFFSET,
    GgmlInitParams,
    GgmlTensor,
    api,
    context_tensors,
    reg_proc,
)
from moed.gguf.archs import DENSE_MATMUL

PLAIN = "plain"
REPACK_BUFT = b"CPU_REPACK"

# ggml types (ggml.h) that ggml's CPU backend may repack.
Q4_0, Q8_0, Q2_K, Q4_K, Q5_K, Q6_K, IQ4_NL, MXFP4, Q1_0 = 2, 8, 10, 12, 13, 14, 20, 39, 41
_FEATURES = ("avx2", "avx512", "neon", "dotprod", "matmul_int8", "sve", "vxe", "riscv_v")


class CpuBackend:
    """ggml's CPU device as this process's llama.cpp has it, found once (`cpu_backend()`):
    the device, its own buffer type, its extra buffer types (CPU_REPACK) and the CPU
    features ggml's repack choice depends on."""

    def __init__(self) -> None:
        g = api()
        reg = g.ggml_backend_cpu_reg()
        self.cpu_dev = g.ggml_backend_reg_dev_get(reg, 0)
        self.cpu_buft = g.ggml_backend_dev_buffer_type(self.cpu_dev)
        p = ctypes.c_void_p
        extra = reg_proc(reg, b"ggml_backend_dev_get_extra_bufts", ctypes.POINTER(p), p)
        self.extra_bufts: dict[bytes, int] = {}
        if extra is not None:
            arr = extra(self.cpu_dev)
            k = 0
            while arr[k]:
                self.extra_bufts[g.ggml_backend_buft_name(arr[k])] = arr[k]
                k += 1
        self.repack_buft = self.extra_bufts.get(REPACK_BUFT)
        has = {feat: bool(getattr(g, f"ggml_cpu_has_{feat}")()) for feat in _FEATURES}
        has["sve32"] = has["sve"] and g.ggml_cpu_get_sve_cnt() == 32
        self.has = has

    def features(self) -> str:
        """The CPU features ggml's repack choice depends on, as a short string."""
        import platform

        return " ".join([platform.machine(), *(f for f in _FEATURES if self.has[f])])


@functools.cache
def cpu_backend() -> CpuBackend:
    return CpuBackend()


def _repack_name(ggml_type: int, ne1: int, has: dict[str, bool]) -> str | None:
    """ggml's `ggml_repack_get_optimal_repack_type` (ggml-cpu/repack.cpp), as names."""
    x86_or_sve = has["avx2"] or (has["sve"] and has["matmul_int8"] and has["sve32"])
    i8mm = has["neon"] and has["matmul_int8"]
    dot = has["neon"] and has["dotprod"]
    rules: dict[int, list[tuple[bool, int, str]]] = {
        Q4_0: [(x86_or_sve, 8, "q4_0_8x8"), (i8mm, 4, "q4_0_4x8"), (dot, 4, "q4_0_4x4"), (has["vxe"], 4, "q4_0_4x4")],
        Q4_K: [(has["avx2"], 8, "q4_K_8x8"), (i8mm, 8, "q4_K_8x8"), (dot, 8, "q4_K_8x4")],
        Q2_K: [(has["avx512"], 8, "q2_K_8x8")],
        Q5_K: [(i8mm, 8, "q5_K_8x8"), (dot, 8, "q5_K_8x4")],
        Q6_K: [(i8mm, 8, "q6_K_8x8"), (dot, 8, "q6_K_8x4")],
        IQ4_NL: [(has["avx2"], 8, "iq4_nl_8x8"), (dot, 4, "iq4_nl_4x4")],
        MXFP4: [(has["avx2"], 8, "mxfp4_8x8"), (dot, 4, "mxfp4_4x4")],
        Q8_0: [(i8mm, 4, "q8_0_4x8"), (dot, 4, "q8_0_4x4")],
        Q1_0: [(i8mm, 4, "q1_0_4x8"), (dot, 4, "q1_0_4x4")],
    }
    for ok, rows, name in rules.get(ggml_type, []):
        if ok and ne1 % rows == 0:
            return name
    return None


class _Context:
    """A ggml context of tensor headers (no data) plus the CPU_REPACK buffer behind them."""

    def __init__(self, shapes: list[tuple[int, tuple[int, ...]]]):
        g, repack_buft = api(), cpu_backend().repack_buft
        if repack_buft is None:
            raise RuntimeError("this llama.cpp build has no CPU_REPACK buffer type")
        self.ctx = g.ggml_init(GgmlInitParams(g.ggml_tensor_overhead() * (len(shapes) + 1), None, True))
        if not self.ctx:
            raise MemoryError("ggml_init failed")
        self.buffer = None
        self.tensors = []
        for ggml_type, ne in shapes:
            dims = (ctypes.c_int64 * 4)(*(list(ne) + [1] * (4 - len(ne))))
            self.tensors.append(g.ggml_new_tensor(self.ctx, ggml_type, 4, dims))
        self.buffer = g.ggml_backend_alloc_ctx_tensors_from_buft(self.ctx, repack_buft)
        if not self.buffer:
            g.ggml_free(self.ctx)
            raise MemoryError(f"could not allocate a CPU_REPACK buffer for {len(shapes)} tensors")
        g.ggml_backend_buffer_set_usage(self.buffer, GGML_BACKEND_BUFFER_USAGE_WEIGHTS)

    def view(self, k: int) -> GgmlTensor:
        return GgmlTensor.from_address(self.tensors[k])

    def close(self) -> None:
        g = api()
        if self.buffer:
            g.ggml_backend_buffer_free(self.buffer)
            self.buffer = None
        if self.ctx:
            g.ggml_free(self.ctx)
            self.ctx = None


def _probe_shape(ne: Iterable[int]) -> tuple[int, int]:
    """A small (ne0, ne1) with the same choice as (ne0, ne1, ...): ggml looks at ne1 modulo 4, 8, 16."""
    ne0, ne1 = list(ne)[:2]
    return ne0, 64 + ne1 % 64


@functools.cache
def layout_of(ggml_type: int, ne: tuple[int, ...]) -> str:
    """The layout this CPU's llama.cpp computes a weight of this type and shape on."""
    cpu = cpu_backend()
    if cpu.repack_buft is None:
        return PLAIN
    ctx = _Context([(ggml_type, _probe_shape(ne))])
    try:
        repacks = bool(ctx.view(0).extra)
    finally:
        ctx.close()
    if not repacks:
        return PLAIN
    return _repack_name(ggml_type, ne[1], cpu.has) or f"repacked-{ggml_type}"


class Repacker:
    """ggml's own repack of one expert of a weight of `ggml_type`, `(ne0, ne1)` per expert."""

    def __init__(self, ggml_type: int, ne0: int, ne1: int):
        self.layout = layout_of(ggml_type, (ne0, ne1))
        if self.layout == PLAIN:
            raise ValueError(f"this CPU's llama.cpp does not repack ggml type {ggml_type} of shape {ne0}x{ne1}")
        self._ctx = _Context([(ggml_type, (ne0, ne1))])
        t = self._ctx.view(0)
        self.n_bytes = t.nb[3]
        self._data = t.data
        self._tensor = self._ctx.tensors[0]

    def __call__(self, plain: bytes) -> bytes:
        if len(plain) != self.n_bytes:
            raise ValueError(f"one expert is {self.n_bytes} bytes, got {len(plain)}")
        api().ggml_backend_tensor_set(self._tensor, plain, 0, self.n_bytes)
        return ctypes.string_at(self._data, self.n_bytes)

    def close(self) -> None:
        self._ctx.close()


# ---------------------------------------------------------------------- the model's tensors


def _walk_context(tensor_addr: int) -> dict[bytes, list[int]]:
    """Every tensor of the ggml context holding `tensor_addr`, by name."""
    out: dict[bytes, list[int]] = {}
    for t in context_tensors(tensor_addr):
        out.setdefault(ctypes.string_at(t + NAME_OFFSET), []).append(t)
    return out


def find_in_graph(node: int, anchors: dict[bytes, int], wanted: dict[bytes, int]) -> dict[bytes, int]:
    """name -> address of each `wanted` model tensor (name -> its data address).

    llama.cpp gives no handle on a model's tensors, but every graph node's sources
    lead back to the model's weights: from `node` (a node the eval callback handed
    over), the sources are followed, breadth first, to the first tensor that is one
    of `anchors` (a model weight, checked by its data address); the ggml context that
    holds it (llama.cpp keeps one per buffer type) is walked object by object, and
    each wanted tensor is taken from it, checked by data address. Raises
    LookupError naming what was not found.
    """
    seen: set[int] = set()
    queue = [node]
    anchor = None
    while queue and anchor is None and len(seen) < 1 << 16:
        addr = queue.pop(0)
        if not addr or addr in seen:
            continue
        seen.add(addr)
        t = GgmlTensor.from_address(addr)
        if anchors.get(t.name) == t.data:
            anchor = addr
            break
        queue.extend(s for s in t.src if s)
        if t.view_src:
            queue.append(t.view_src)
    if anchor is None:
        raise LookupError("no model weight among the graph node's sources")
    found: dict[bytes, int] = {}
    for name, addrs in _walk_context(anchor).items():
        want = wanted.get(name)
        for t_addr in addrs:
            if want is not None and GgmlTensor.from_address(t_addr).data == want:
                found[name] = t_addr
                break
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise LookupError(f"ggml tensor {missing[0].decode()!r} not in the model's context ({len(missing)} missing)")
    return found


# ---------------------------------------------------------------------- switching kernels


@dataclass
class Switched:
    """What `KernelSwitch` did, for stream_stats and the logs."""

    dense_tensors: int = 0
    dense_bytes: int = 0
    dense_layouts: tuple[str, ...] = ()
    expert_tensors: int = 0
    expert_layout: str = PLAIN


def stock_repacks_dense(name: bytes, ggml_type: int, ne: tuple[int, ...]) -> bool:
    """Whether stock llama.cpp puts this dense weight in CPU_REPACK: a 2-D MUL_MAT weight
    (DENSE_MATMUL) of a type and shape this CPU repacks (llama.cpp's select_weight_buft)."""
    dims = tuple(ne) + (1,) * (4 - len(ne))
    if not DENSE_MATMUL.match(name.decode() if isinstance(name, bytes) else name) or dims[2] != 1 or dims[3] != 1:
        return False
    return layout_of(ggml_type, dims[:2]) != PLAIN


class BuftOverride(ctypes.Structure):
    """llama.h's `struct llama_model_tensor_buft_override`."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


# The routed experts, by llama.cpp's tensor names: what `--n-cpu-moe` / `-ot exps=CPU` keep
# on the CPU while the rest of a layer is offloaded.
EXPERTS_PATTERN = rb"\.ffn_(?:gate|up|down|gate_up)_exps\.weight$"


class DenseOverrides:
    """llama.cpp's `tensor_buft_overrides` putting exactly `names` in CPU_REPACK at load,
    and, with `experts_on_cpu` (a GPU offload), the routed experts in the CPU's own buffer
    type (EXPERTS_PATTERN), so they stay in the mapping at their file offsets.

    The loader takes an override's buffer type as given unless it is the plain CPU
    one, so each of these tensors is allocated in CPU_REPACK and repacked by ggml as
    llama.cpp reads it, as in stock's load. One pattern per weight kind (`attn_q`,
    `output`, ...), naming its layers, so the loader's per-tensor regex work stays
    small on a real model's hundreds of weights.
    """

    def __init__(self, names: Iterable[str], experts_on_cpu: bool = False):
        kinds: dict[str, list[str]] = {}
        for name in names:
            m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
            layer, kind = (m.group(1), m.group(2)) if m else ("", name)
            kinds.setdefault(kind, []).append(layer)
        patterns = []
        for kind, layers in sorted(kinds.items()):
            if layers == [""]:
                patterns.append(f"^{re.escape(kind)}$")
            else:
                patterns.append(rf"^blk\.(?:{'|'.join(layers)})\.{re.escape(kind)}$")
        buft = cpu_backend().repack_buft
        if patterns and buft is None:
            raise RuntimeError("this llama.cpp build has no CPU_REPACK buffer type")
        placed = [(p.encode(), buft) for p in patterns]
        if experts_on_cpu:  # first: the loader takes the first pattern that matches
            placed.insert(0, (EXPERTS_PATTERN, cpu_backend().cpu_buft))
        self.patterns = [p for p, _ in placed]
        self.array = (BuftOverride * (len(placed) + 1))()
        for k, (pattern, target) in enumerate(placed):
            self.array[k].pattern, self.array[k].buft = pattern, target

    def install(self, params) -> None:
        """Set on a `llama_model_params` before the load (a NULL-terminated list; none: NULL)."""
        params.tensor_buft_overrides = ctypes.cast(self.array, ctypes.c_void_p) if self.patterns else None


class KernelSwitch:
    """What moed set up so a loaded model computes on the kernels stock llama.cpp would use.

    `dense`: the `DenseOverrides` the load placed in CPU_REPACK (stock's choice);
    `repack_experts(tensors)`: struct addresses of expert tensors whose bytes will be
    served in this CPU's repacked layout: they keep their `data` (the expert pages)
    and get a CPU_REPACK `buffer` and the repack traits in `extra`.
    """

    def __init__(self, dense: DenseOverrides | None = None) -> None:
        self._contexts: list[_Context] = []
        self.done = Switched()
        self.dense = dense
        self.experts_pending = False  # set by the plan: repack_experts must run before any expert matmul

    def repack_experts(self, tensors: Iterable[int]) -> None:
        probes: dict[tuple[int, int, int], _Context] = {}
        for addr in tensors:
            t = GgmlTensor.from_address(addr)
            key = (t.type, t.ne[0], t.ne[1])
            if key not in probes:
                probes[key] = _Context([(t.type, _probe_shape((t.ne[0], t.ne[1])))])
                self._contexts.append(probes[key])
            probe = probes[key].view(0)
            if not probe.extra:
                raise RuntimeError(f"ggml does not repack type {t.type} of shape {t.ne[0]}x{t.ne[1]}")
            t.buffer, t.extra = probe.buffer, probe.extra
            self.done.expert_tensors += 1
        self.experts_pending = False

    def close(self) -> None:
        """Free what was allocated; only once llama.cpp will never compute with these tensors again."""
        for ctx in self._contexts:
            ctx.close()
        self._contexts.clear()
