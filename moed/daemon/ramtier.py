"""The RAM tier: one shared-memory segment per size class, locked slot by slot.

Each segment is an anonymous memfd (it has no name, so nothing survives the
daemon, kill -9 included) mapped shared and read-write in the daemon only.
Clients get a read-only descriptor of it (reopened through /proc with O_RDONLY)
and can map it only PROT_READ.

The segment is sparse: a slot's pages exist only once it is filled, or once the
prefaulter (moed.daemon.prefault) made them ahead of the first fill. A slot is
mlocked right after its bytes are read in (by the reader thread, before the
slot is READY) and its pages are given back with MADV_REMOVE when the store
drops it, so locked memory follows the store's `used_bytes`, never the
segment's virtual size. `locked_bytes` counts each locked slot once, however
often it is re-read.

If mlock fails (RLIMIT_MEMLOCK too low, no CAP_IPC_LOCK), the tier keeps
serving unlocked and says so (`locked` is False, with the reason), unless the
daemon was told to require locking, in which case `MlockUnavailable` is raised
at startup by `probe_mlock`.
"""

from __future__ import annotations

import logging
import os
import threading

from moed import libc
from moed.protocol.layout import PAGE, slot_bytes, slot_layout
from moed.protocol.messages import SegmentInfo

log = logging.getLogger("moed.ramtier")


class MlockUnavailable(RuntimeError):
    pass


class TierSegment:
    def __init__(self, class_id: int, part_names: list[str], part_bytes: list[int], capacity: int):
        self.class_id = class_id
        self.part_names = list(part_names)
        self.part_bytes = list(part_bytes)
        self.capacity = capacity
        self.part_off, self.part_stride, self.size_bytes = slot_layout(part_bytes, capacity)
        self.slot_bytes = sum(self.part_stride)
        self.fd = os.memfd_create(f"moed-class-{class_id}", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, max(self.size_bytes, PAGE))
        self.addr = libc.mmap(max(self.size_bytes, PAGE), libc.PROT_READ | libc.PROT_WRITE, libc.MAP_SHARED, self.fd)
        # A memfd is created mode 0777, and /proc/<pid>/fd/N reopens by inode
        # permission: without this, a client of another uid could reopen its
        # read-only descriptor read-write and write every engine's experts.
        os.fchmod(self.fd, 0o400)

    def info(self) -> SegmentInfo:
        return SegmentInfo(
            self.class_id,
            self.capacity,
            self.part_names,
            self.part_bytes,
            self.part_off,
            self.part_stride,
            self.size_bytes,
        )

    def part_addr(self, index: int, k: int) -> int:
        return self.addr + self.part_off[k] + index * self.part_stride[k]

    def ranges(self, index: int):
        """(address, length) of every part of slot `index`."""
        return [(self.part_addr(index, k), self.part_stride[k]) for k in range(len(self.part_bytes))]

    def readonly_fd(self) -> int:
        """A new read-only descriptor of the segment, for one client."""
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        libc.munmap(self.addr, max(self.size_bytes, PAGE))
        os.close(self.fd)


class RamTier:
    def __init__(self, capacity_bytes: int):
        """`capacity_bytes`: the most any class may ever hold (budget plus pin budget)."""
        self.capacity_bytes = capacity_bytes
        self.segments: dict[int, TierSegment] = {}
        self.locked = True
        self.lock_error = ""
        self.locked_bytes = 0
        self._locked: set[tuple[int, int]] = set()  # (class id, slot index) now locked: counted once
        self._mutex = threading.Lock()
        self.on_remove: list = []  # called with a class id before its segment is unmapped (prefault)

    def add_segment(self, class_id: int, part_names: list[str], part_bytes: list[int]) -> TierSegment:
        capacity = max(1, self.capacity_bytes // slot_bytes(part_bytes))
        seg = TierSegment(class_id, part_names, part_bytes, capacity)
        self.segments[class_id] = seg
        return seg

    def lock_slot(self, seg: TierSegment, index: int) -> None:
        """Populate and lock a slot's pages (called from reader threads)."""
        if not self.locked:
            return
        try:
            for addr, length in seg.ranges(index):
                libc.mlock(addr, length)
        except OSError as exc:
            self._lock_failed(str(exc))
            return
        with self._mutex:
            if (seg.class_id, index) not in self._locked:  # a slot re-read in place is locked already
                self._locked.add((seg.class_id, index))
                self.locked_bytes += seg.slot_bytes

    def _lock_failed(self, why: str) -> None:
        with self._mutex:
            if self.locked:
                self.locked = False
                self.lock_error = why
                log.warning(
                    "mlock failed (%s): expert memory is NOT locked and may be swapped or "
                    "reclaimed; raise LimitMEMLOCK or grant CAP_IPC_LOCK",
                    why,
                )

    def release_slot(self, seg: TierSegment, index: int) -> None:
        """Unlock a slot and hand its pages back to the kernel."""
        for addr, length in seg.ranges(index):
            if self.locked:
                try:
                    libc.munlock(addr, length)
                except OSError:
                    pass
            libc.madvise(addr, length, libc.MADV_REMOVE)
        with self._mutex:
            if (seg.class_id, index) in self._locked:
                self._locked.discard((seg.class_id, index))
                self.locked_bytes -= seg.slot_bytes

    def remove_segment(self, class_id: int) -> None:
        """Unmap a class's segment once nothing in it is held (engines keep their own mappings)."""
        for hook in self.on_remove:
            hook(class_id)
        seg = self.segments.pop(class_id)
        with self._mutex:
            gone = {k for k in self._locked if k[0] == class_id}
            self._locked -= gone
            self.locked_bytes -= len(gone) * seg.slot_bytes
        seg.close()

    def close(self) -> None:
        for seg in self.segments.values():
            seg.close()
        self.segments.clear()


def probe_mlock(required: bool) -> tuple[bool, str]:
    """Lock one page to learn whether mlock works here; raise if required and it does not."""
    addr = libc.mmap(PAGE, libc.PROT_READ | libc.PROT_WRITE, libc.MAP_PRIVATE | libc.MAP_ANONYMOUS)
    try:
        libc.mlock(addr, PAGE)
        libc.munlock(addr, PAGE)
        return True, ""
    except OSError as exc:
        if required:
            raise MlockUnavailable(f"mlock is not permitted ({exc}); raise LimitMEMLOCK or grant CAP_IPC_LOCK") from exc
        return False, str(exc)
    finally:
        libc.munmap(addr, PAGE)
