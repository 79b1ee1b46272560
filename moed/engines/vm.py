"""The process's own mappings: page arithmetic and /proc/self/maps.

The engine finds the model file's mapping here (by device and inode, never by
name); the calls that change mappings (mmap at a fixed address, mprotect,
madvise, mlock) are the one libc wrapper, `moed.libc`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from dataclasses import dataclass

PAGE = os.sysconf("SC_PAGE_SIZE")


def page_floor(addr: int) -> int:
    return addr - addr % PAGE


def page_ceil(addr: int) -> int:
    return page_floor(addr + PAGE - 1)


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
