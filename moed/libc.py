"""The few libc calls Python does not expose: mmap, mprotect, madvise, mlock at raw addresses, prctl, dladdr.

Python's `mmap` module cannot map at a given address nor lock or protect a
range, so these go through libc with ctypes; the daemon (RAM tier, reader,
verify) and the engines (expert pages, dense locking) share this one wrapper.
Standard library only, so every layer may import it. Every failure raises
OSError with errno; nothing is silently ignored. ctypes releases the GIL around
each call, so reader threads can lock and fill slots concurrently.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS = 0x01, 0x02, 0x10, 0x20
MADV_DONTNEED, MADV_REMOVE = 4, 9
MAP_FAILED = ctypes.c_void_p(-1).value

_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
for _name in ("munmap", "mlock", "munlock"):
    getattr(_libc, _name).argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    getattr(_libc, _name).restype = ctypes.c_int
for _name in ("mprotect", "madvise"):
    getattr(_libc, _name).argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    getattr(_libc, _name).restype = ctypes.c_int


PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int) -> None:
    """Have the kernel send `sig` to this process when the thread that started it exits
    (prctl PR_SET_PDEATHSIG); for a child, called in it before exec (a preexec_fn)."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mmap(length: int, prot: int, flags: int, fd: int = -1, offset: int = 0, addr: int = 0) -> int:
    """Map `length` bytes and return the address (`addr` is a hint unless `flags` has MAP_FIXED)."""
    ptr = _libc.mmap(addr or None, length, prot, flags, fd, offset)
    if ptr in (None, MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap({addr:#x}, {length}, fd={fd}, off={offset}): {os.strerror(err)}")
    return ptr


def map_fixed(addr: int, length: int, prot: int, fd: int = -1, offset: int = 0) -> None:
    """Replace [addr, addr+length) with a new mapping: shared from `fd`, or private anonymous."""
    flags = MAP_FIXED | (MAP_SHARED if fd >= 0 else MAP_PRIVATE | MAP_ANONYMOUS)
    ptr = mmap(length, prot, flags, fd, offset, addr)
    if ptr != addr:
        raise OSError(0, f"MAP_FIXED returned {ptr:#x}, wanted {addr:#x}")


def munmap(addr: int, length: int) -> None:
    _check(_libc.munmap(addr, length), f"munmap({addr:#x}, {length})")


def mprotect(addr: int, length: int, prot: int) -> None:
    _check(_libc.mprotect(addr, length, prot), f"mprotect({addr:#x}, {length})")


def madvise(addr: int, length: int, advice: int) -> None:
    _check(_libc.madvise(addr, length, advice), f"madvise({addr:#x}, {length})")


def mlock(addr: int, length: int) -> None:
    _check(_libc.mlock(addr, length), f"mlock({addr:#x}, {length})")


def munlock(addr: int, length: int) -> None:
    _check(_libc.munlock(addr, length), f"munlock({addr:#x}, {length})")


def buffer_at(addr: int, length: int) -> memoryview:
    """A writable memoryview over raw memory (caller keeps the mapping alive)."""
    return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


_libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
_libc.dladdr.restype = ctypes.c_int


def file_of_address(addr: int) -> str | None:
    """The path of the loaded object (library) holding `addr` (dladdr), or None if none does."""
    info = _DlInfo()
    if not _libc.dladdr(addr, ctypes.byref(info)) or not info.dli_fname:
        return None
    return info.dli_fname.decode()
