"""llama.cpp's repacked CPU kernels, reached from ctypes (llama-cpp-python 0.3.36).

Stock `llama_cpp.Llama` puts every weight its CPU backend can repack into the
CPU_REPACK buffer type at load: ggml interleaves the rows of Q4_0, Q4_K, IQ4_NL,
MXFP4 (and Q2_K with AVX-512) weights into blocks (`q4_0_8x8`, ...) whose kernels
are 1.2-1.5x faster than the plain ones. A streamed model cannot let llama.cpp do
that (a repacked tensor leaves its file offset, and loading would read every
expert), so moed does it itself, after the load, with ggml's own code.

What this module owns:
- the handles into ggml: the CPU device, its CPU_REPACK buffer type, the CPU
  feature probes (`Ggml`, one per process);
- `layout_of(ggml_type, ne)`: the layout this CPU's ggml computes a weight on,
  "plain" or ggml's repack name ("q4_0_8x8"); ggml itself decides (a tensor
  allocated in CPU_REPACK gets repack traits in `extra` exactly when ggml would
  repack it), the name follows ggml's `ggml_repack_get_optimal_repack_type`;
- `Repacker`: ggml's repack of one expert's bytes (`moectl align --repack`);
- `find_tensors`: the loaded model's `struct ggml_tensor`s, found by name and
  checked by data address;
- `KernelSwitch`: moving a loaded model's dense matmul weights into CPU_REPACK
  where stock llama.cpp puts them, and pointing expert tensors whose bytes are
  already repacked at the repacked kernels.

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
  model is freed.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from collections.abc import Iterable
from dataclasses import dataclass

from moed.engines.ggml_tensor import GGML_OBJECT_SIZE, NAME_OFFSET, GgmlTensor, loaded_library
from moed.gguf.archs import DENSE_MATMUL

PLAIN = "plain"
REPACK_BUFT = b"CPU_REPACK"
GGML_BACKEND_BUFFER_USAGE_WEIGHTS = 1
GGML_OBJECT_TYPE_TENSOR = 0

# ggml types (ggml.h) that ggml's CPU backend may repack.
Q4_0, Q8_0, Q2_K, Q4_K, Q5_K, Q6_K, IQ4_NL, MXFP4, Q1_0 = 2, 8, 10, 12, 13, 14, 20, 39, 41


class GgmlInitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class GgmlObject(ctypes.Structure):
    _fields_ = [
        ("offs", ctypes.c_size_t),
        ("size", ctypes.c_size_t),
        ("next", ctypes.c_void_p),
        ("type", ctypes.c_int),
        ("padding", ctypes.c_char * 4),
    ]


def _bind(lib: ctypes.CDLL, name: str, restype, *argtypes):
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


class Ggml:
    """The ggml entry points moed uses, bound once per process (`ggml()`)."""

    def __init__(self) -> None:
        base, cpu = loaded_library("ggml-base"), loaded_library("ggml-cpu")
        p, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        self.init = _bind(base, "ggml_init", p, GgmlInitParams)
        self.free = _bind(base, "ggml_free", None, p)
        self.new_tensor = _bind(base, "ggml_new_tensor", p, p, i, i, ctypes.POINTER(ctypes.c_int64))
        self.tensor_overhead = _bind(base, "ggml_tensor_overhead", sz)
        self.alloc_ctx_tensors = _bind(base, "ggml_backend_alloc_ctx_tensors_from_buft", p, p, p)
        self.buffer_free = _bind(base, "ggml_backend_buffer_free", None, p)
        self.buffer_set_usage = _bind(base, "ggml_backend_buffer_set_usage", None, p, i)
        self.buffer_base = _bind(base, "ggml_backend_buffer_get_base", p, p)
        self.buffer_size = _bind(base, "ggml_backend_buffer_get_size", sz, p)
        self.tensor_set = _bind(base, "ggml_backend_tensor_set", None, p, p, sz, sz)
        self.buft_name = _bind(base, "ggml_backend_buft_name", ctypes.c_char_p, p)
        self.buffer_type = _bind(base, "ggml_backend_buffer_get_type", p, p)
        proc = _bind(base, "ggml_backend_reg_get_proc_address", p, p, ctypes.c_char_p)
        dev_get = _bind(base, "ggml_backend_reg_dev_get", p, p, sz)
        reg = _bind(cpu, "ggml_backend_cpu_reg", p)()
        self.cpu_dev = dev_get(reg, 0)
        extra = proc(reg, b"ggml_backend_dev_get_extra_bufts")
        self.extra_bufts: dict[bytes, int] = {}
        if extra:
            arr = ctypes.CFUNCTYPE(ctypes.POINTER(p), p)(extra)(self.cpu_dev)
            k = 0
            while arr[k]:
                self.extra_bufts[self.buft_name(arr[k])] = arr[k]
                k += 1
        self.repack_buft = self.extra_bufts.get(REPACK_BUFT)
        has = {}
        for feat in ("avx2", "avx512", "neon", "dotprod", "matmul_int8", "sve", "vxe", "riscv_v"):
            has[feat] = bool(_bind(cpu, f"ggml_cpu_has_{feat}", i)())
        has["sve32"] = has["sve"] and _bind(cpu, "ggml_cpu_get_sve_cnt", i)() == 32
        self.has = has

    def features(self) -> str:
        """The CPU features ggml's repack choice depends on, as a short string."""
        import platform

        on = [f for f in ("avx2", "avx512", "neon", "dotprod", "matmul_int8", "sve", "vxe", "riscv_v") if self.has[f]]
        return " ".join([platform.machine(), *on])


@functools.cache
def ggml() -> Ggml:
    return Ggml()


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
        g = ggml()
        if g.repack_buft is None:
            raise RuntimeError("this llama.cpp build has no CPU_REPACK buffer type")
        self.ctx = g.init(GgmlInitParams(g.tensor_overhead() * (len(shapes) + 1), None, True))
        if not self.ctx:
            raise MemoryError("ggml_init failed")
        self.buffer = None
        self.tensors = []
        for ggml_type, ne in shapes:
            dims = (ctypes.c_int64 * 4)(*(list(ne) + [1] * (4 - len(ne))))
            self.tensors.append(g.new_tensor(self.ctx, ggml_type, 4, dims))
        self.buffer = g.alloc_ctx_tensors(self.ctx, g.repack_buft)
        if not self.buffer:
            g.free(self.ctx)
            raise MemoryError(f"could not allocate a CPU_REPACK buffer for {len(shapes)} tensors")
        g.buffer_set_usage(self.buffer, GGML_BACKEND_BUFFER_USAGE_WEIGHTS)

    def view(self, k: int) -> GgmlTensor:
        return GgmlTensor.from_address(self.tensors[k])

    def close(self) -> None:
        g = ggml()
        if self.buffer:
            g.buffer_free(self.buffer)
            self.buffer = None
        if self.ctx:
            g.free(self.ctx)
            self.ctx = None


def _probe_shape(ne: Iterable[int]) -> tuple[int, int]:
    """A small (ne0, ne1) with the same choice as (ne0, ne1, ...): ggml looks at ne1 modulo 4, 8, 16."""
    ne0, ne1 = list(ne)[:2]
    return ne0, 64 + ne1 % 64


@functools.cache
def layout_of(ggml_type: int, ne: tuple[int, ...]) -> str:
    """The layout this CPU's llama.cpp computes a weight of this type and shape on."""
    g = ggml()
    if g.repack_buft is None:
        return PLAIN
    ctx = _Context([(ggml_type, _probe_shape(ne))])
    try:
        repacks = bool(ctx.view(0).extra)
    finally:
        ctx.close()
    if not repacks:
        return PLAIN
    return _repack_name(ggml_type, ne[1], g.has) or f"repacked-{ggml_type}"


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
        ggml().tensor_set(self._tensor, plain, 0, self.n_bytes)
        return ctypes.string_at(self._data, self.n_bytes)

    def close(self) -> None:
        self._ctx.close()


# ---------------------------------------------------------------------- the model's tensors


def _scan_regions(limit_bytes: int = 256 << 20) -> list[tuple[int, int]]:
    """Writable private anonymous regions (and the heap): where ggml contexts live."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo_hi, perms = fields[0], fields[1]
            path = fields[5] if len(fields) > 5 else ""
            if perms != "rw-p" or path not in ("", "[heap]"):
                continue
            lo, hi = (int(x, 16) for x in lo_hi.split("-"))
            if hi - lo <= limit_bytes:
                out.append((lo, hi))
    return out


def _walk_context(tensor_addr: int) -> dict[bytes, list[int]]:
    """Every tensor of the ggml context holding `tensor_addr`, by name (ggml_get_next_tensor's walk)."""
    obj = GgmlObject.from_address(tensor_addr - GGML_OBJECT_SIZE)
    mem_buffer = tensor_addr - obj.offs
    out: dict[bytes, list[int]] = {}
    addr = mem_buffer
    for _ in range(1 << 20):
        o = GgmlObject.from_address(addr)
        if o.type == GGML_OBJECT_TYPE_TENSOR:
            t = mem_buffer + o.offs
            out.setdefault(ctypes.string_at(t + NAME_OFFSET), []).append(t)
        if not o.next:
            break
        addr = o.next
    return out


def find_tensors(expected: dict[bytes, int]) -> dict[bytes, int]:
    """name -> address of the `ggml_tensor` named so whose `data` is `expected[name]`.

    llama.cpp gives no handle on a model's tensors, so they are found in memory:
    the first expected name is searched for in the process's anonymous regions, a
    hit is a tensor only if its `data` is the expected address, and the ggml
    context around it is walked object by object. Names not in that context are
    searched for the same way. Raises RuntimeError naming what was not found.
    """
    found: dict[bytes, int] = {}
    missing = dict(expected)
    regions = _scan_regions()
    while missing:
        name, data = next(iter(missing.items()))
        hit = _search(regions, name, data)
        if hit is None:
            raise RuntimeError(f"ggml tensor {name.decode()!r} not found in this process")
        for n, addrs in _walk_context(hit).items():
            want = missing.get(n)
            for t in addrs:
                if want is not None and GgmlTensor.from_address(t).data == want:
                    found[n] = t
                    del missing[n]
                    break
    return found


def _search(regions: list[tuple[int, int]], name: bytes, data: int) -> int | None:
    """The first `ggml_tensor` named `name` whose data is `data`: smallest regions first
    (a model's ggml context is small), read in 4 MiB windows so the search never holds
    more than that (engines load inside memory caps)."""
    needle = name + b"\0"
    window = 4 << 20
    for lo, hi in sorted(regions, key=lambda r: r[1] - r[0]):
        start = lo
        while start < hi:
            end = min(hi, start + window + NAME_OFFSET + len(needle))
            try:
                blob = ctypes.string_at(start, end - start)
            except (OSError, ValueError):
                break
            at = blob.find(needle)
            while at >= 0:
                t = start + at - NAME_OFFSET
                if t >= lo and GgmlTensor.from_address(t).data == data:
                    return t
                at = blob.find(needle, at + 1)
            start += window
    return None


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


class KernelSwitch:
    """Put a loaded model's weights on the kernels stock llama.cpp would use.

    `repack_dense`: struct addresses of dense weights stock would repack
    (`stock_repacks_dense`), copied into one CPU_REPACK buffer by ggml's repack and
    switched to it; their old ranges are returned by `moved_ranges` (the file
    bytes, no longer read).
    `experts`: struct addresses of expert tensors whose bytes will be served in
    this CPU's repacked layout: they keep their `data` (the expert pages) and get
    a CPU_REPACK `buffer` and the repack traits in `extra`.
    """

    def __init__(self) -> None:
        self._contexts: list[_Context] = []
        self.done = Switched()
        self.moved_ranges: list[tuple[int, int]] = []

    def repack_dense(self, tensors: Iterable[int]) -> None:
        """Move these dense weights (each one `stock_repacks_dense` picked) into CPU_REPACK."""
        views = [GgmlTensor.from_address(a) for a in tensors]
        if not views:
            return
        ctx = _Context([(v.type, tuple(v.ne)) for v in views])
        self._contexts.append(ctx)
        layouts = set()
        for k, v in enumerate(views):
            new = ctx.view(k)
            n_bytes = v.nb[3]
            ggml().tensor_set(ctx.tensors[k], v.data, 0, n_bytes)
            self.moved_ranges.append((v.data, v.data + n_bytes))
            layouts.add(layout_of(v.type, (v.ne[0], v.ne[1])))
            v.data, v.buffer, v.extra = new.data, new.buffer, new.extra
            self.done.dense_bytes += n_bytes
        self.done.dense_tensors = len(views)
        self.done.dense_layouts = tuple(sorted(layouts))
        assert ctx.buffer is not None
        _lock_buffer(ctx.buffer)

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

    def close(self) -> None:
        """Free what was allocated; only once llama.cpp will never compute with these tensors again."""
        for ctx in self._contexts:
            ctx.close()
        self._contexts.clear()


def _lock_buffer(buffer: int) -> None:
    """mlock the repacked dense weights, as the dense pages of the mapping are (best effort)."""
    from moed import libc

    g = ggml()
    base, size = g.buffer_base(buffer), g.buffer_size(buffer)
    lo = base // mmap.PAGESIZE * mmap.PAGESIZE
    try:
        libc.mlock(lo, base + size - lo)
    except OSError:
        pass  # the dense lock of the mapping already warned about RLIMIT_MEMLOCK


def buffer_buft_name(tensor_addr: int) -> str:
    """The buffer type name of a tensor's buffer ("CPU_REPACK", "CPU", ...), for tests."""
    t = GgmlTensor.from_address(tensor_addr)
    if not t.buffer:
        return ""
    return (ggml().buft_name(ggml().buffer_type(t.buffer)) or b"").decode()
