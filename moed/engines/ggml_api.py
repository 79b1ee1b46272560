"""ggml's C API as moed reaches it: every ggml and ggml-backend symbol, and every struct layout, bound once.

For the ggml inside llama-cpp-python 0.3.36. What this module owns:
- `loaded_library(stem)`: the very copy of `lib<stem>` (ggml-base, ggml-cpu, ggml) that
  llama.cpp runs, never a second one;
- the struct layouts moed reads and writes in place: `GgmlTensor` (ggml.h's `struct
  ggml_tensor`), `GgmlObject` (a ggml context's object header), `GgmlInitParams`, and the
  one field of `struct ggml_backend_device` read (`has_host_ptr_import`); `layout_matches()`
  checks the tensor layout against the library;
- `SIGNATURES`, one row per C function (its library, result and argument types), and one
  binder, `api()`: `api().ggml_backend_tensor_set(...)` is that C function, typed by its
  row, bound on first use; a backend's own entry points reached by name (`reg_proc`);
- walking a ggml context's tensors (`context_tensors`), which llama.cpp offers no call for.

Invariants:
- No other module of moed binds a ggml symbol or declares a ggml struct (the engines
  import these; tests/unit/test_layering.py checks that no other module sets a
  foreign function's `argtypes`). A symbol is typed in exactly one row, so two callers
  can never disagree on its types (ctypes keeps one `restype` per function object, and
  the last binder would win).
- Python names are the C names, so a call here reads as the C it will become.
- Every symbol is taken from the library copy llama.cpp runs (`loaded_library`): a second
  copy's buffer types are other pointers, which llama.cpp's scheduler rejects (abort).
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from typing import Any

from moed import libc

GGML_MAX_DIMS = 4
GGML_MAX_OP_PARAMS = 64
GGML_MAX_SRC = 10
GGML_MAX_NAME = 64
GGML_TYPE_F32 = 0
GGML_TYPE_I32 = 26
GGML_OBJECT_TYPE_TENSOR = 0
GGML_BACKEND_BUFFER_USAGE_WEIGHTS = 1  # the scheduler's cue: an op runs where its weight's buffer is
GGML_BACKEND_DEVICE_TYPE_GPU, GGML_BACKEND_DEVICE_TYPE_IGPU = 1, 2
# sizeof(struct ggml_object): offs, size (size_t), next (ptr), type (enum), padding[4].
GGML_OBJECT_SIZE = 32
# struct ggml_backend_device_i (ggml-backend-impl.h): buffer_from_host_ptr is its ninth pointer.
_IFACE_BUFFER_FROM_HOST_PTR = 8


class GgmlTensor(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


NAME_OFFSET = GgmlTensor.name.offset
# What the layer holds (moed/engines/_layer_holds.c) read of a node, as offsets: (name, type,
# buffer, ne, nb, src, data).
HOLDS_LAYOUT = tuple(getattr(GgmlTensor, f).offset for f in ("name", "type", "buffer", "ne", "nb", "src", "data"))


class GgmlObject(ctypes.Structure):
    _fields_ = [
        ("offs", ctypes.c_size_t),
        ("size", ctypes.c_size_t),
        ("next", ctypes.c_void_p),
        ("type", ctypes.c_int),
        ("padding", ctypes.c_char * 4),
    ]


class GgmlInitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


# ---------------------------------------------------------------------- the libraries

BASE, CPU, GGML = "ggml-base", "ggml-cpu", "ggml"
# One symbol each library defines, to find it through libllama's own dependency tree.
_LIBRARY_SYMBOL = {BASE: "ggml_init", CPU: "ggml_backend_cpu_reg", GGML: "ggml_backend_dev_count"}


class LibraryMismatch(RuntimeError):
    """moed could not reach the copy of a ggml library that llama.cpp runs."""


@functools.cache
def loaded_library(stem: str) -> ctypes.CDLL:
    """The very copy of llama-cpp-python's `lib<stem>` that llama.cpp itself runs.

    Why not open it by path: the wheel holds `libggml-cpu.so`, `.so.0` and `.so.0.25.3`
    as three separate files (wheels keep no symlinks), libllama links the `.so.0` one,
    and a path that names the same file another way (the venv's `lib64 -> lib` link on
    sys.path, a symlinked checkout) is a different file to the dynamic loader. Any such
    open loads a second ggml with its own CPU device and buffer types, and a tensor
    given that copy's CPU_REPACK buffer makes llama.cpp abort at context creation
    ("pre-allocated tensor ... in a buffer (CPU_REPACK) that cannot run the operation";
    issue 30: it happened or not depending on how the process had imported llama_cpp).

    So the library is found from libllama's own handle, whatever sys.path says: dlsym
    through that handle searches libllama's dependency tree, which holds exactly the
    copies llama.cpp runs; dladdr names the file that symbol lives in; dlopen with
    RTLD_NOLOAD returns that already loaded copy and never loads a new one. The
    handle's symbol is then checked against llama.cpp's own (LibraryMismatch if not).
    """
    from llama_cpp import llama_cpp as bindings

    symbol = _LIBRARY_SYMBOL[stem]
    want = ctypes.cast(getattr(bindings._lib, symbol), ctypes.c_void_p).value
    path = libc.file_of_address(want) if want else None
    if path is None:
        raise LibraryMismatch(f"llama.cpp's {symbol} could not be located (lib{stem})")
    lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    got = ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value
    if got != want:
        raise LibraryMismatch(f"{path}: {symbol} at {got:#x}, llama.cpp runs it at {want:#x}")
    return lib


# ---------------------------------------------------------------------- the functions

_P, _SZ, _I, _B, _STR = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_bool, ctypes.c_char_p
_CPU_FEATURES = ("avx2", "avx512", "neon", "dotprod", "matmul_int8", "sve", "vxe", "riscv_v")

# name -> (library, result type, argument types): ggml.h, ggml-backend.h, ggml-cpu.h.
SIGNATURES: dict[str, tuple[str, Any, tuple[Any, ...]]] = {
    # contexts and tensors (ggml.h)
    "ggml_init": (BASE, _P, (GgmlInitParams,)),
    "ggml_free": (BASE, None, (_P,)),
    "ggml_new_tensor": (BASE, _P, (_P, _I, _I, ctypes.POINTER(ctypes.c_int64))),
    "ggml_tensor_overhead": (BASE, _SZ, ()),
    "ggml_nbytes": (BASE, _SZ, (_P,)),
    "ggml_type_size": (BASE, _SZ, (_I,)),
    "ggml_type_name": (BASE, _STR, (_I,)),
    # buffers and buffer types
    "ggml_backend_alloc_ctx_tensors_from_buft": (BASE, _P, (_P, _P)),
    "ggml_backend_buffer_free": (BASE, None, (_P,)),
    "ggml_backend_buffer_clear": (BASE, None, (_P, ctypes.c_uint8)),
    "ggml_backend_buffer_set_usage": (BASE, None, (_P, _I)),
    "ggml_backend_buffer_get_usage": (BASE, _I, (_P,)),
    "ggml_backend_buffer_get_type": (BASE, _P, (_P,)),
    "ggml_backend_buffer_get_base": (BASE, _P, (_P,)),
    "ggml_backend_buffer_get_size": (BASE, _SZ, (_P,)),
    "ggml_backend_buffer_get_alloc_size": (BASE, _SZ, (_P, _P)),
    "ggml_backend_buffer_is_host": (BASE, _B, (_P,)),
    "ggml_backend_buft_name": (BASE, _STR, (_P,)),
    "ggml_backend_buft_get_device": (BASE, _P, (_P,)),
    # a tensor's bytes in whatever memory its buffer is: (tensor, data, offset, size);
    # the _2d forms copy rows of a strided view: (tensor, data, offset, size, n_copies,
    # stride_tensor, stride_data)
    "ggml_backend_tensor_set": (BASE, None, (_P, _P, _SZ, _SZ)),
    "ggml_backend_tensor_get": (BASE, None, (_P, _P, _SZ, _SZ)),
    "ggml_backend_tensor_set_2d": (BASE, None, (_P, _P, _SZ, _SZ, _SZ, _SZ, _SZ)),
    "ggml_backend_tensor_get_2d": (BASE, None, (_P, _P, _SZ, _SZ, _SZ, _SZ, _SZ)),
    "ggml_backend_tensor_alloc": (BASE, _I, (_P, _P, _P)),
    # devices and registries
    "ggml_backend_dev_count": (GGML, _SZ, ()),
    "ggml_backend_dev_get": (GGML, _P, (_SZ,)),
    "ggml_backend_dev_type": (BASE, _I, (_P,)),
    "ggml_backend_dev_name": (BASE, _STR, (_P,)),
    "ggml_backend_dev_description": (BASE, _STR, (_P,)),
    "ggml_backend_dev_buffer_type": (BASE, _P, (_P,)),
    "ggml_backend_dev_buffer_from_host_ptr": (BASE, _P, (_P, _P, _SZ, _SZ)),
    "ggml_backend_dev_supports_op": (BASE, _B, (_P, _P)),
    "ggml_backend_reg_dev_get": (BASE, _P, (_P, _SZ)),
    "ggml_backend_reg_get_proc_address": (BASE, _P, (_P, _STR)),
    # the CPU backend (ggml-cpu.h)
    "ggml_backend_cpu_reg": (CPU, _P, ()),
    "ggml_cpu_get_sve_cnt": (CPU, _I, ()),
    **{f"ggml_cpu_has_{feature}": (CPU, _I, ()) for feature in _CPU_FEATURES},
}


class Api:
    """Every function of SIGNATURES as an attribute of its C name, bound on first use."""

    def __getattr__(self, name: str) -> Any:
        row = SIGNATURES.get(name)
        if row is None:
            raise AttributeError(f"{name}: not a ggml function moed binds (add its row to SIGNATURES)")
        stem, restype, argtypes = row
        fn = getattr(loaded_library(stem), name)
        fn.restype, fn.argtypes = restype, list(argtypes)
        setattr(self, name, fn)  # later lookups skip __getattr__
        return fn


@functools.cache
def api() -> Api:
    return Api()


def address(name: str) -> int:
    """The address of C function `name` (a row of SIGNATURES), for C that calls it itself (the
    layer holds read and write nodes in a device's memory through ggml's backend)."""
    return ctypes.cast(getattr(api(), name), ctypes.c_void_p).value or 0


def reg_proc(reg: int, name: bytes, restype: Any, *argtypes: Any) -> Callable[..., Any] | None:
    """A backend registry's own entry point by name (ggml_backend_reg_get_proc_address),
    typed; None where the backend has none."""
    address = api().ggml_backend_reg_get_proc_address(reg, name)
    return ctypes.CFUNCTYPE(restype, *argtypes)(address) if address else None


# ---------------------------------------------------------------------- the structs, read


def layout_matches() -> bool:
    """True when our struct has the size the library allocates per tensor."""
    return api().ggml_tensor_overhead() == GGML_OBJECT_SIZE + ctypes.sizeof(GgmlTensor)


def context_tensors(tensor_addr: int) -> list[int]:
    """Every tensor of the ggml context that holds `tensor_addr`, in order
    (ggml_get_next_tensor's walk over the context's objects)."""
    mem_buffer = context_of(tensor_addr)
    out, addr = [], mem_buffer
    for _ in range(1 << 22):
        o = GgmlObject.from_address(addr)
        if o.type == GGML_OBJECT_TYPE_TENSOR:
            out.append(mem_buffer + o.offs)
        if not o.next:
            break
        addr = o.next
    return out


def context_of(tensor_addr: int) -> int:
    """The memory buffer of the ggml context holding `tensor_addr` (one per context)."""
    return tensor_addr - GgmlObject.from_address(tensor_addr - GGML_OBJECT_SIZE).offs


def has_host_ptr_import(device: int) -> bool:
    """Whether the device's interface has a host-pointer import at all (a NULL entry would be
    called as it is by `ggml_backend_dev_buffer_from_host_ptr`)."""
    entry = device + _IFACE_BUFFER_FROM_HOST_PTR * ctypes.sizeof(ctypes.c_void_p)
    return bool(ctypes.c_void_p.from_address(entry).value)


__all__ = [
    "GGML_BACKEND_BUFFER_USAGE_WEIGHTS",
    "GGML_OBJECT_SIZE",
    "GGML_TYPE_F32",
    "GGML_TYPE_I32",
    "HOLDS_LAYOUT",
    "NAME_OFFSET",
    "SIGNATURES",
    "Api",
    "address",
    "GgmlInitParams",
    "GgmlObject",
    "GgmlTensor",
    "LibraryMismatch",
    "api",
    "context_of",
    "context_tensors",
    "has_host_ptr_import",
    "layout_matches",
    "loaded_library",
    "reg_proc",
]
