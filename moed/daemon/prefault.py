"""Prefault: the RAM tier's pages made before the first read that needs them.

What this module owns: one background thread that populates the slot indices each
size class will fill first, up to the class's share of the budget, and the trim that
gives those pages back when the memory guard needs memory.

Why: the RAM tier's segments are sparse (moed.daemon.ramtier), so a slot's first fill
made the kernel allocate and zero its shmem pages inside the O_DIRECT read, in the
reader threads, on the cores ggml computes on. Measured on the Qwen3-30B geometry
(bench/RESULTS.md, issue 41): 0.66-0.83 CPU-s a GB for a first fill (clear_page and
shmem_get_folio_gfp were 36% of the daemon's CPU) against 0.07-0.11 for a fill into
pages a slot had before, and a fresh daemon's first prompt fills its whole budget.
Made here, once, in the background after a model is opened, that cost leaves the
prompt. A slot's pages are never given back per fill (a refill reuses them), so this
is the only allocation a slot index ever pays, unless the guard trims it.

Invariants:
- Only indices in the order the store hands them out are populated (index 0 first:
  moed.cache.records.SlotClass.take_free), from the first not yet populated, so the
  pages made are the ones the next fills use. Populating never changes a byte a slot
  holds (MADV_POPULATE_WRITE on a shared mapping faults in missing pages only;
  fallocate on the memfd allocates missing pages only), so a race with a read into
  the same index is harmless.
- At most the budget (RAM plus pin budget) is ever populated, over all classes, and
  nothing while the memory guard holds the store below its budget. `trim` (on the
  event loop, under the same lock as every step) gives back the populated indices no
  slot was made for yet and cancels what was still to do, so populated memory never
  stands between the box and its floor.
- The thread runs at the lowest CPU priority (nice 19), in steps of `step_bytes`, and
  stops at `close`.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from dataclasses import dataclass

from moed import libc

from .ramtier import TierSegment

log = logging.getLogger("moed.prefault")

MADV_POPULATE_WRITE = 23  # Linux 5.14; older kernels answer EINVAL and fallocate is used
STEP_BYTES = 64 << 20


@dataclass
class _Class:
    seg: TierSegment
    target: int = 0  # slot indices [0, target) are to be populated
    done: int = 0  # [0, done) are populated (or were handed out before this got to them)


class Prefaulter:
    """Populates each class's first slot indices in the background (module docstring)."""

    def __init__(self, store, ramtier, enabled: bool = True, step_bytes: int = STEP_BYTES):
        self.store = store
        self.ramtier = ramtier
        self.enabled = enabled
        self.step_bytes = step_bytes
        self.cap_bytes = store.budget_bytes + store.pin_budget_bytes
        self.populated_bytes = 0  # populated by this, less what trim gave back
        self.trimmed_bytes = 0
        self.error = ""
        self._classes: dict[int, _Class] = {}
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._stopping = False
        self._populate = self._madvise
        self._thread: threading.Thread | None = None

    # ---- what the daemon asks (the event loop) ----------------------------------

    def plan_model(self, model) -> None:
        """A model was opened: its classes' first slots, each class's share of the budget by
        the model's expert bytes in it (at most one slot per expert it has)."""
        if not self.enabled:
            return
        experts: dict[int, int] = {}
        for plan in model.layers.values():
            experts[plan.class_id] = experts.get(plan.class_id, 0) + model.catalog.n_experts
        total = sum(n * self.store.classes[c].slot_bytes for c, n in experts.items())
        with self._lock:
            for class_id, n in experts.items():
                slot_bytes = self.store.classes[class_id].slot_bytes
                share = self.cap_bytes * n * slot_bytes // max(total, 1)
                cls = self._classes.setdefault(class_id, _Class(self.ramtier.segments[class_id]))
                cls.target = max(cls.target, min(n, share // slot_bytes, cls.seg.capacity))
            self._work.notify()
        self._start()

    def trim(self) -> int:
        """Give back every populated index no slot was made for yet, and stop populating until
        the next plan; returns the bytes given back (the memory guard calls this first)."""
        freed = 0
        with self._lock:
            for class_id, cls in self._classes.items():
                made = len(self.store.classes[class_id].slots)
                if cls.done > made:
                    for k in range(len(cls.seg.part_stride)):
                        start = cls.seg.part_off[k] + made * cls.seg.part_stride[k]
                        libc.madvise(cls.seg.addr + start, (cls.done - made) * cls.seg.part_stride[k], libc.MADV_REMOVE)
                    freed += (cls.done - made) * cls.seg.slot_bytes
                    cls.done = made
                cls.target = min(cls.target, cls.done)
            self.populated_bytes -= freed
            self.trimmed_bytes += freed
        if freed:
            log.info("prefault: gave back %d bytes of populated, unused RAM-tier pages", freed)
        return freed

    def forget(self, class_id: int) -> None:
        """A class's segment is going (its last model closed)."""
        with self._lock:
            cls = self._classes.pop(class_id, None)
            if cls is not None:
                made = len(self.store.classes[class_id].slots) if class_id in self.store.classes else 0
                self.populated_bytes -= max(0, cls.done - made) * cls.seg.slot_bytes

    def stats(self) -> dict:
        return {"prefaulted_bytes": self.populated_bytes, "prefault_error": self.error}

    def close(self) -> None:
        with self._lock:
            self._stopping = True
            self._work.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    # ---- the thread -------------------------------------------------------------

    def _start(self) -> None:
        if self._thread is None and not self._stopping:
            self._thread = threading.Thread(target=self._run, name="moed-prefault", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass  # not permitted: it still yields to the readers, just less
        while True:
            with self._lock:
                while not self._stopping and self._next() is None:
                    self._work.wait()
                if self._stopping:
                    return
                try:
                    self._step()
                except OSError as exc:  # never the daemon's end: reads still fault pages in
                    self.error = str(exc)
                    log.warning("prefault stopped: %s", exc)
                    for cls in self._classes.values():
                        cls.target = cls.done
            # the lock is let go between steps: trim and the loop's plans never wait long

    def _next(self) -> _Class | None:
        """A class with work left, while the budget and the guard allow it."""
        if self.store.effective_budget_bytes < self.store.budget_bytes or self.populated_bytes >= self.cap_bytes:
            return None
        return next((c for c in self._classes.values() if c.done < c.target), None)

    def _step(self) -> None:
        cls = self._next()
        assert cls is not None, "_run steps only when there is work"
        seg = cls.seg
        begin = max(cls.done, len(self.store.classes[seg.class_id].slots))  # made slots fault their own
        n = max(1, self.step_bytes // seg.slot_bytes)
        end = min(cls.target, begin + n, begin + (self.cap_bytes - self.populated_bytes) // seg.slot_bytes)
        if end <= begin:
            cls.done = max(cls.done, begin)
            return
        for k in range(len(seg.part_stride)):
            start = seg.part_off[k] + begin * seg.part_stride[k]
            self._populate(seg, start, (end - begin) * seg.part_stride[k])
        self.populated_bytes += (end - begin) * seg.slot_bytes
        cls.done = end

    def _madvise(self, seg: TierSegment, offset: int, length: int) -> None:
        try:
            libc.madvise(seg.addr + offset, length, MADV_POPULATE_WRITE)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            log.info("prefault: no MADV_POPULATE_WRITE on this kernel; fallocate instead")
            self._populate = self._fallocate
            self._fallocate(seg, offset, length)

    @staticmethod
    def _fallocate(seg: TierSegment, offset: int, length: int) -> None:
        os.posix_fallocate(seg.fd, offset, length)
