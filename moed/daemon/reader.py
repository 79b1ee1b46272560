"""The reader pool: positioned reads of expert bytes from model files into slots.

Owns the open model files and the reader threads. Each file is opened with
O_DIRECT and probed with one aligned read; if the filesystem refuses (tmpfs
answers EINVAL) the file falls back to buffered reads and says so
(`ModelFile.direct`).

A job (one expert's parts) is split into chunks of `chunk_bytes` so several
reads are in flight per expert. Two queues: demand chunks always go before
prefetch chunks, and a prefetch job is promoted when a demand read wants it.
A chunk whose file range and length are 4096-aligned is read straight into
the slot; any other goes through the thread's aligned bounce buffer. A short
read or an OSError fails the job (never wrong bytes); `on_done(job, error)`
is called exactly once per job, from a reader thread.

Files are opened with `open_regular` (non-blocking, regular files only, no
symbolic link followed: the caller passes the resolved path) and remember the
identity they were opened with; `ModelFile.changed()` is one fstat, cheap
enough to run before every grant and after every read.
"""

from __future__ import annotations

import collections
import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from moed.gguf.header import FileIdentity, identity_of, open_regular
from moed.protocol.errors import BadModelFile
from moed.protocol.layout import PAGE

from . import libc

log = logging.getLogger("moed.reader")

ALIGN = PAGE


class ModelFile:
    """One open shard: an O_DIRECT descriptor if the filesystem allows it."""

    def __init__(self, path: str, direct_io: str = "auto"):
        self.path = path
        self.direct = False
        self.fd = -1
        self.identity: FileIdentity = (0, 0, 0, 0, 0)
        if direct_io != "off":
            self.direct = self._open_direct()
            if not self.direct and direct_io == "on":
                raise OSError(errno.EINVAL, f"O_DIRECT is not supported for {path}")
        if not self.direct:
            self.fd, st = open_regular(path, os.O_NOFOLLOW)
            self.identity = identity_of(st)
            log.info("%s: O_DIRECT unavailable, using buffered reads", path)

    def changed(self) -> bool:
        """Whether the file is no longer the one opened (written, truncated, replaced in place)."""
        return identity_of(os.fstat(self.fd)) != self.identity

    def _open_direct(self) -> bool:
        try:
            fd, st = open_regular(path := self.path, os.O_NOFOLLOW | os.O_DIRECT)
        except BadModelFile:
            # tmpfs refuses O_DIRECT at open; anything else fails the buffered open the same way
            return False
        self.identity = identity_of(st)
        probe = mmap.mmap(-1, ALIGN)
        try:
            os.preadv(fd, [probe], 0)
        except OSError as exc:
            os.close(fd)
            if exc.errno == errno.EINVAL:
                return False
            raise OSError(exc.errno, f"probe read of {path} failed: {exc.strerror}") from exc
        finally:
            probe.close()
        self.fd = fd
        return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass(eq=False)
class ReadJob:
    """Read `pieces` [(file, file_offset, length, dest_addr)] then call `on_done(job, err)`."""

    pieces: list[tuple[ModelFile, int, int, int]]
    on_done: Callable[[ReadJob, BaseException | None], None]
    demand: bool = True
    tag: object = None
    what: str = "expert"  # names the expert in errors and logs
    digest: int = 0  # verify mode: xxh3 of the bytes read (set by the completion callback)
    bytes_total: int = 0
    _left: int = 0
    _error: BaseException | None = None
    _chunks: list = field(default_factory=list)
    cancelled: bool = False


class ReaderPool:
    def __init__(self, threads: int = 8, chunk_bytes: int = 256 << 10):
        if chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes must be a multiple of {ALIGN}")
        self.chunk_bytes = chunk_bytes
        self._demand: collections.deque = collections.deque()
        self._prefetch: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._stop = False
        self._threads = [
            threading.Thread(target=self._run, name=f"moed-reader-{i}", daemon=True) for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    # ---- submission (event loop thread) --------------------------------

    def submit(self, job: ReadJob) -> None:
        chunks = []
        for f, off, length, dest in job.pieces:
            for pos in range(0, length, self.chunk_bytes):
                n = min(self.chunk_bytes, length - pos)
                chunks.append((job, f, off + pos, n, dest + pos))
        job._left = len(chunks)
        job.bytes_total = sum(p[2] for p in job.pieces)
        if not chunks:
            job.on_done(job, None)
            return
        job._chunks = chunks
        with self._cv:
            (self._demand if job.demand else self._prefetch).extend(chunks)
            self._cv.notify(len(chunks))

    def promote(self, job: ReadJob) -> None:
        """A demand read now waits on this prefetch: move its queued chunks ahead."""
        with self._cv:
            if job.demand:
                return
            job.demand = True
            mine = [c for c in self._prefetch if c[0] is job]
            if mine:
                self._prefetch = collections.deque(c for c in self._prefetch if c[0] is not job)
                self._demand.extend(mine)

    def cancel(self, job: ReadJob) -> bool:
        """Drop a prefetch none of whose chunks has started; True if it was dropped."""
        with self._cv:
            if job.demand or job.cancelled:
                return False
            queued = sum(1 for c in self._prefetch if c[0] is job)
            if queued != len(job._chunks) or job._left != len(job._chunks):
                return False
            self._prefetch = collections.deque(c for c in self._prefetch if c[0] is not job)
            job.cancelled = True
        return True

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=5)

    # ---- reader threads --------------------------------------------------

    def _next(self):
        with self._cv:
            while not self._stop and not self._demand and not self._prefetch:
                self._cv.wait()
            if self._stop:
                return None
            return self._demand.popleft() if self._demand else self._prefetch.popleft()

    def _run(self) -> None:
        bounce = mmap.mmap(-1, self.chunk_bytes + 2 * ALIGN)
        while (chunk := self._next()) is not None:
            job, f, off, n, dest = chunk
            err = None
            if job._error is None:
                try:
                    self._read(f, off, n, dest, bounce)
                except BaseException as exc:  # noqa: BLE001 - any failure fails the job, not the thread
                    err = exc
            self._finish(job, err)
        bounce.close()

    def _read(self, f: ModelFile, off: int, n: int, dest: int, bounce: mmap.mmap) -> None:
        if not f.direct or (off % ALIGN == 0 and n % ALIGN == 0 and dest % ALIGN == 0):
            got = os.preadv(f.fd, [libc.buffer_at(dest, n)], off)
            if got != n:
                raise OSError(errno.EIO, f"short read of {f.path} at {off}: {got} of {n} bytes (file truncated?)")
            return
        start = off - off % ALIGN
        end = -(-(off + n) // ALIGN) * ALIGN
        view = memoryview(bounce)[: end - start]
        got = os.preadv(f.fd, [view], start)
        if got < off + n - start:
            raise OSError(errno.EIO, f"short read of {f.path} at {off}: file ends before {off + n}")
        libc.buffer_at(dest, n)[:] = view[off - start : off - start + n]

    def _finish(self, job: ReadJob, err: BaseException | None) -> None:
        with self._cv:
            if err is not None and job._error is None:
                job._error = err
            job._left -= 1
            done = job._left == 0
        if done:
            try:
                job.on_done(job, job._error)
            except BaseException:  # noqa: BLE001
                log.exception("read completion callback failed")
