"""Raw virtual-memory calls the engine needs on fixed addresses (mmap, mprotect, madvise, mlock).

Python's `mmap` module cannot map at a given address, so these go through libc
with ctypes. Every failure raises OSError with errno; nothing is silently ignored.
The engine keeps its own copy rather than sharing the daemon's: an engine
process never imports the daemon package.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
from collections.abc import Collection
from dataclasses import dataclass

PAGE = os.sysconf("SC_PAGE_SIZE")
PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS = 0x01, 0x02, 0x10, 0x20
MADV_DONTNEED = 4

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
for _name in ("munmap", "mlock", "munlock"):
    getattr(_libc, _name).argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    getattr(_libc, _name).restype = ctypes.c_int
for _name in ("mprotect", "madvise"):
    getattr(_libc, _name).argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    getattr(_libc, _name).restype = ctypes.c_int
_MAP_FAILED = ctypes.c_void_p(-1).value


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def page_floor(addr: int) -> int:
    return addr - addr % PAGE


def page_ceil(addr: int) -> int:
    return page_floor(addr + PAGE - 1)


def map_fixed(addr: int, length: int, prot: int, fd: int = -1, offset: int = 0) -> None:
    """Replace [addr, addr+length) with a new mapping: shared from `fd`, or private anonymous."""
    flags = MAP_FIXED | (MAP_SHARED if fd >= 0 else MAP_PRIVATE | MAP_ANONYMOUS)
    ptr = _libc.mmap(addr, length, prot, flags, fd, offset)
    if ptr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap({addr:#x}, {length}, fd={fd}, off={offset}): {os.strerror(err)}")
    if ptr != addr:
        raise OSError(0, f"MAP_FIXED returned {ptr:#x}, wanted {addr:#x}")


def mprotect(addr: int, length: int, prot: int) -> None:
    _check(_libc.mprotect(addr, length, prot), f"mprotect({addr:#x}, {length})")


def madvise(addr: int, length: int, advice: int) -> None:
    _check(_libc.madvise(addr, length, advice), f"madvise({addr:#x}, {length})")


def mlock(addr: int, length: int) -> None:
    _check(_libc.mlock(addr, length), f"mlock({addr:#x}, {length})")


@dataclass(frozen=True)
class Vma:
    start: int
    end: int
    perms: str
    offset: int
    dev: tuple[int, int]
    inode: int
    path: str


_MAPS_LINE = re.compile(r"([0-9a-f]+)-([0-9a-f]+) (\S+) ([0-9a-f]+) ([0-9a-f]+):([0-9a-f]+) (\d+)\s*(.*)")


def read_maps(pid: int | str = "self") -> list[Vma]:
    """Parse /proc/<pid>/maps."""
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            m = _MAPS_LINE.match(line.rstrip("\n"))
            if m:
                out.append(
                    Vma(
                        int(m[1], 16),
                        int(m[2], 16),
                        m[3],
                        int(m[4], 16),
                        (int(m[5], 16), int(m[6], 16)),
                        int(m[7]),
                        m[8],
                    )
                )
    return out


def _of_file(path: str) -> list[Vma]:
    """Our VMAs of `path`, matched by (device, inode), not by name."""
    st = os.stat(path)
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    return [v for v in read_maps() if (v.dev[0], v.dev[1], v.inode) == want]


def mapping_bases(path: str) -> set[int]:
    """Addresses where offset 0 of `path` is (or would be) in each of our mappings of it.

    llama.cpp maps each file whole and later unmaps the head and tail it does not
    use, so a VMA may start past offset 0: the base is `start - offset`.
    """
    return {v.start - v.offset for v in _of_file(path)}


def file_mapping_base(path: str, exclude_bases: Collection[int] = frozenset()) -> int | None:
    """The one base of `path` (see `mapping_bases`) not in `exclude_bases`, or None.

    Bases in `exclude_bases` (mappings that existed before we loaded) are skipped,
    so two models of the same file in one process are told apart.
    """
    bases = mapping_bases(path) - set(exclude_bases)
    if len(bases) > 1:
        raise RuntimeError(f"{path} is mapped {len(bases)} times by this load; cannot tell which is the model")
    return bases.pop() if bases else None


def mapped_ranges(base: int, path: str) -> list[tuple[int, int]]:
    """The VMAs (start, end) of `path` whose base is `base`."""
    return [(v.start, v.end) for v in _of_file(path) if v.start - v.offset == base]
