"""The reader pool: positioned reads of expert bytes from model files into slots.

Owns the open model files and the reader threads. Each file is opened with
O_DIRECT and probed with one aligned read; if the filesystem refuses (tmpfs
answers EINVAL) the file falls back to buffered reads and says so
(`ModelFile.direct`).

A job (one expert's parts) is split into chunks of `chunk_bytes` so several
reads are in flight per expert. Two queues: demand chunks always go before
prefetch chunks, and a prefetch job is promoted when a demand read wants it.
A chunk whose file range and length are 4096-aligned is read straight into
the slot; any other goes through the thread's aligned bounce buffer. A piece
with a transform (repack on read, moed.daemon.onread) is split into chunks of
whole row groups, each read into the bounce buffer and transformed from there
into the slot: the bytes cross memory once, as a copy would.

Failures (docs/design.md, "When the drive misbehaves"): a short read is read on
from where it stopped, so what fails is what the kernel said (an O_DIRECT read
over a bad block returns the bytes before it, and the next read gets the EIO);
end of file is its own failure. A chunk that fails is read again up to
`retries` times after `retry_backoff_s`, x4 each time, then fails its job with a
`ReadFailure` naming the piece (part), file, offset and errno: never wrong bytes.
`on_done(job, error)` is called exactly once per job, from a reader thread.

The pool also reports how the drive does: every chunk's service time goes to
`health` (moed.daemon.drivehealth), and `in_progress_jobs()` lists the reads running
now with their age, so a read that never returns is seen (core warns, and
`add_spare()` starts a thread in its place, at most `threads` in all).

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
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from moed import libc
from moed.gguf.header import FileIdentity, identity_of, open_regular
from moed.protocol.errors import BadModelFile, InternalError
from moed.protocol.layout import PAGE

from .drivehealth import DriveHealth

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


class ReadFailure(Exception):
    """A chunk that could not be read, after its retries: where, and what the kernel said.

    `errno` is the kernel's error (0 for end of file: the file is shorter than
    the catalog says); `piece` indexes the job's pieces (core: the part).
    """

    def __init__(self, err: int, path: str, offset: int, length: int, piece: int, attempts: int = 1):
        super().__init__(err, path, offset, length, piece, attempts)
        self.errno, self.path, self.offset, self.length = err, path, offset, length
        self.piece, self.attempts = piece, attempts

    def __str__(self) -> str:
        where = f"{self.length} bytes at offset {self.offset} of {self.path}"
        if not self.errno:
            return f"end of file reading {where} (the file is shorter than its header says)"
        name = errno.errorcode.get(self.errno, "?")
        tries = f", {self.attempts} attempts" if self.attempts > 1 else ""
        return f"[Errno {self.errno}] {name} ({os.strerror(self.errno)}) reading {where}{tries}"


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
    submitted_s: float = 0.0  # monotonic, at submit (how long its chunks have queued)
    # per piece, its transform (repack on read, moed.daemon.onread: `group_bytes`, and
    # `into(src, dest, n)` writing n transformed bytes at dest), or None; and what the
    # transforms cost, summed over the job's chunks: bytes, the reader threads' CPU seconds
    repacks: list | None = None
    # the files whose change fails the read (None: the pieces' files): a read from the repack
    # cache (moed.daemon.repackcache) answers for its model's files, not for the cache's own
    watch: list | None = None
    from_cache: bool = False  # its pieces are the repack cache's, not the model file's
    write_back: tuple | None = None  # (repack cache, layer, expert): offered a copy once read
    repacked_bytes: int = 0
    repack_cpu_s: float = 0.0
    _left: int = 0
    _error: BaseException | None = None
    _chunks: list = field(default_factory=list)
    cancelled: bool = False


class ReaderPool:
    def __init__(
        self,
        threads: int = 8,
        chunk_bytes: int = 1 << 20,
        retries: int = 2,
        retry_backoff_s: float = 0.01,
        health: DriveHealth | None = None,
    ):
        if chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes must be a multiple of {ALIGN}")
        self.chunk_bytes = chunk_bytes
        self.retries, self.retry_backoff_s = retries, retry_backoff_s
        self.health = health if health is not None else DriveHealth()
        self.retried = 0  # chunk reads that failed and were tried again
        self._demand: collections.deque = collections.deque()
        self._prefetch: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._stop = False
        # thread name -> (started_s, job, path, offset, length) of the read it runs now
        self._active: dict[str, tuple] = {}
        self._threads = [
            threading.Thread(target=self._run, name=f"moed-reader-{i}", daemon=True) for i in range(threads)
        ]
        self._base, self._spares = threads, 0
        for t in self._threads:
            t.start()

    # ---- submission (event loop thread) --------------------------------

    def submit(self, job: ReadJob) -> None:
        chunks = []
        for k, (f, off, length, dest) in enumerate(job.pieces):
            repack = job.repacks[k] if job.repacks else None
            step = self.chunk_bytes
            if repack is not None:  # whole row groups: each chunk transforms on its own
                step = max(1, self.chunk_bytes // repack.group_bytes) * repack.group_bytes
            for pos in range(0, length, step):
                n = min(step, length - pos)
                chunks.append((job, k, f, off + pos, n, dest + pos, repack))
        job._left = len(chunks)
        job.bytes_total = sum(p[2] for p in job.pieces)
        job.submitted_s = time.monotonic()
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

    def queued_prefetches(self) -> list[ReadJob]:
        """Prefetch jobs with chunks still queued, newest first (candidates to drop)."""
        with self._cv:
            jobs = dict.fromkeys(c[0] for c in self._prefetch)
        return list(reversed(jobs))

    def busy(self) -> bool:
        """Whether any chunk is queued or being read."""
        with self._cv:
            return bool(self._demand or self._prefetch or self._active)

    def oldest_demand_wait_s(self, now: float) -> float:
        """How long the oldest queued demand chunk has waited for a reader (0: none queued)."""
        with self._cv:
            return now - self._demand[0][0].submitted_s if self._demand else 0.0

    def in_progress_jobs(self, now: float) -> list[tuple[float, ReadJob, str, int, int]]:
        """The reads running now: (age_s, job, path, offset, length), oldest first."""
        rows = [(now - t0, job, path, off, n) for t0, job, path, off, n in list(self._active.values())]
        return sorted(rows, key=lambda row: -row[0])

    def add_spare(self) -> bool:
        """Start one more reader in place of one stuck in a read (at most `threads` spares)."""
        if self._spares >= self._base or self._stop:
            return False
        self._spares += 1
        t = threading.Thread(target=self._run, name=f"moed-reader-spare-{self._spares}", daemon=True)
        self._threads.append(t)
        t.start()
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the readers; wait `timeout_s` in all (a thread stuck in a read of a hung drive
        cannot be interrupted: it is a daemon thread and goes with the process)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))

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
        me = threading.current_thread().name
        while (chunk := self._next()) is not None:
            job, k, f, off, n, dest, repack = chunk
            err, cpu_s = None, 0.0
            if job._error is None:
                if n + 2 * ALIGN > len(bounce):  # a row group larger than a chunk
                    bounce.close()
                    bounce = mmap.mmap(-1, n + 2 * ALIGN)
                self._active[me] = (time.monotonic(), job, f.path, off, n)
                try:
                    cpu_s = self._read_retrying(k, f, off, n, dest, bounce, repack)
                except BaseException as exc:  # noqa: BLE001 - any failure fails the job, not the thread
                    err = exc
                finally:
                    del self._active[me]
            self._finish(job, err, n if repack is not None and err is None else 0, cpu_s)
        bounce.close()

    def _read_retrying(self, k: int, f: ModelFile, off: int, n: int, dest: int, bounce: mmap.mmap, repack) -> float:
        """Read one chunk (and transform it, with `repack`); a failing read is tried again
        `retries` times, end of file never. The transform's CPU seconds."""
        for attempt in range(1, self.retries + 2):
            t0 = time.perf_counter()
            try:
                if repack is None:
                    self._read(f, off, n, dest, bounce)
                else:
                    view = self._read_bounced(f, off, n, bounce)
            except OSError as exc:
                err = exc.errno or errno.EIO
            else:
                self.health.observe(time.perf_counter() - t0, n)
                if repack is None:
                    return 0.0
                try:
                    return _transform(repack, view, dest, n)
                finally:
                    view.release()  # the bounce buffer exports nothing once the chunk is done
            if err == _EOF or attempt > self.retries:
                raise ReadFailure(0 if err == _EOF else err, f.path, off, n, k, attempt) from None
            self.retried += 1
            # Short: a transient fault (a path failover, a bus reset) is often over in
            # milliseconds, and a bad sector fails every retry the same way anyway.
            time.sleep(self.retry_backoff_s * 4 ** (attempt - 1))
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _read(self, f: ModelFile, off: int, n: int, dest: int, bounce: mmap.mmap) -> None:
        if not f.direct or (off % ALIGN == 0 and n % ALIGN == 0 and dest % ALIGN == 0):
            _fill(f.fd, libc.buffer_at(dest, n), off, n)
            return
        libc.buffer_at(dest, n)[:] = self._read_bounced(f, off, n, bounce)

    def _read_bounced(self, f: ModelFile, off: int, n: int, bounce: mmap.mmap) -> memoryview:
        """The `n` bytes at `off`, read into the bounce buffer by aligned reads."""
        start = off - off % ALIGN
        end = -(-(off + n) // ALIGN) * ALIGN
        view = memoryview(bounce)[: end - start]
        _fill(f.fd, view, start, off + n - start)
        return view[off - start : off - start + n]

    def _finish(self, job: ReadJob, err: BaseException | None, repacked: int = 0, cpu_s: float = 0.0) -> None:
        with self._cv:
            if err is not None and job._error is None:
                job._error = err
            job.repacked_bytes += repacked
            job.repack_cpu_s += cpu_s
            job._left -= 1
            done = job._left == 0
        if done:
            try:
                job.on_done(job, job._error)
            except BaseException:  # noqa: BLE001
                log.exception("read completion callback failed")


_EOF = -1  # not an errno: the file ended before the range did


def _transform(repack, src: memoryview, dest: int, n: int) -> float:
    """`repack.into` one chunk read; its CPU seconds. A transform that fails fails the read
    (InternalError): bytes that could not be transformed are never served."""
    t0 = time.thread_time()
    try:
        repack.into(src, dest, n)
    except Exception as exc:  # noqa: BLE001 - a bug in a transform, never wrong bytes
        log.exception("repacking %d bytes on read failed", n)
        why = f"repacking on read failed: {type(exc).__name__}: {exc}"
    else:
        return time.thread_time() - t0
    # Raised here, not in the handler: the error the job keeps must not hold the transform's
    # frames, whose arrays still view the thread's bounce buffer.
    raise InternalError(why)


def _fill(fd: int, buf: memoryview, off: int, need: int) -> None:
    """Read at least `need` bytes of `buf` from `off`, reading on after short reads.

    A short read is not an error by itself: reading on from where it stopped gets
    either the rest, the kernel's error for the failing block, or end of file.
    """
    pos = 0
    while pos < need:
        got = os.preadv(fd, [buf[pos:]], off + pos)
        if got == 0:
            raise OSError(_EOF, f"end of file at {off + pos}")
        pos += got
