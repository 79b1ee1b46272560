"""Client-side mappings of the daemon's segments: read-only, one per size class.

The descriptor arrives over SCM_RIGHTS opened O_RDONLY, so the mapping can
only ever be PROT_READ: an engine cannot write another engine's experts.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from moed.protocol.messages import SegmentInfo


class Segment:
    def __init__(self, info: SegmentInfo, fd: int):
        self.info = info
        self.fd = fd
        self.class_id = info.class_id
        self._parts = {name: k for k, name in enumerate(info.part_names)}
        self._map = mmap.mmap(fd, max(info.segment_bytes, mmap.PAGESIZE), mmap.MAP_SHARED, mmap.PROT_READ)
        self._array = np.frombuffer(self._map, dtype=np.uint8)
        self.base = self._array.ctypes.data

    def part_index(self, part: str) -> int:
        try:
            return self._parts[part]
        except KeyError:
            raise KeyError(f"no part {part!r}; parts are {list(self._parts)}") from None

    def part_offset(self, slot: int, part: str) -> int:
        k = self.part_index(part)
        return self.info.part_off[k] + slot * self.info.part_stride[k]

    def part_stride(self, part: str) -> int:
        return self.info.part_stride[self.part_index(part)]

    def view(self, slot: int, part: str) -> np.ndarray:
        """Read-only bytes of one part of one slot (valid while its lease is held)."""
        k = self.part_index(part)
        off = self.info.part_off[k] + slot * self.info.part_stride[k]
        return self._array[off : off + self.info.part_bytes[k]]

    def close(self) -> None:
        self.__dict__.pop("_array", None)  # a view after close raises AttributeError, never reads freed memory
        try:
            self._map.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with it
        os.close(self.fd)
