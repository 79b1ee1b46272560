"""The repack cache: a plain file's experts, once made in an engine's layout, kept on disk.

Repack on read (moed.daemon.onread) costs the reader threads CPU on every read of a
plain file's expert, and on a small box that CPU sits inside the engine's wait for
its misses (bench/RESULTS.md, issue 49: 26-30 ms of a 230 ms decode token on two
cores). This module keeps what the transform made: the first read of an expert is
transformed as before, then a copy of it is written to a cache file; every later read
of it (after an eviction, after a restart) is a plain O_DIRECT read of repacked
bytes, as from a `moectl align --repack` copy. The user's plain file stays the only
input: no step is added to their set-up.

What it owns:
- the cache directory (`repack_cache_dir`; systemd's CacheDirectory=, `$CACHE_DIRECTORY`):
  one data file and one index per (model files' identity, layouts made), and the
  directory's disk budget, shared by all of them (`RepackCaches`);
- per open model made on read, its `RepackCache`: which experts are on disk and where
  each part lies in the data file;
- the one writer thread and its bounded queue.

Invariants:
- An expert is read from the cache only once every part of it was written from a copy
  of its slot taken by the reader thread that made it, before the slot was READY (the
  transform of the file's bytes, read while the file was unchanged); the copy is the
  writer's, so no slot is held for the cache.
- A cache is keyed by the sha256 of the model's resolved path, its files' identity
  (device, inode, size, mtime, ctime of every shard), the layouts made and the expert
  geometry: a changed file gets a new key, and opening it deletes the caches of every
  other identity of that path (as does the scan at start, for files changed or gone).
- The index on disk lists only experts whose bytes were made durable before it
  (fdatasync, then the index replaced by rename): after a crash the cache holds a
  subset of what was written, never an expert it did not finish.
- The directory never holds more than `budget_bytes` (None: no fixed size), and no
  write leaves the filesystem's free space under `min_free_bytes`. A write that would
  pass either first deletes whole caches no open model uses, least recently used
  first, and is skipped if that is not enough (counted, `repack_cache_skipped`).
- At most `MAX_PENDING` experts' copies wait to be written: beyond that an expert is not
  cached this time, and the read that made it is not slowed.
- Two daemons never share a cache: each takes an exclusive flock on the data file, and
  one that cannot goes on without the cache for that model.
- Nothing here fails a read: a cache that cannot be opened or written is turned off
  for its model with one log line, and a failed read from it is read again from the
  file (moed.daemon.slots) and turns the cache off.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import mmap
import os
import queue
import threading
import time
from dataclasses import dataclass

import msgspec

from moed import libc
from moed.gguf.header import identity_of
from moed.protocol.layout import round_up

from .reader import ModelFile

log = logging.getLogger("moed.repackcache")

VERSION = 1
MAX_PENDING = 16  # experts' copies queued for writing
INDEX_EVERY = 32  # experts written between two index saves (and at most INDEX_EVERY_S apart)
INDEX_EVERY_S = 2.0


def default_dir() -> str:
    """Where the cache lives when the config names no directory: systemd's CacheDirectory=
    (`$CACHE_DIRECTORY`), else `$XDG_CACHE_HOME/moed`, else `~/.cache/moed`; `repack` in it."""
    base = os.environ.get("CACHE_DIRECTORY", "").split(":")[0]
    if not base:
        base = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "moed")
    return os.path.join(base, "repack")


def min_free_bytes(st: os.statvfs_result) -> int:
    """The free space a cache write never takes the filesystem under: 5% of it, at least 1 GiB."""
    return max(1 << 30, st.f_blocks * st.f_frsize // 20)


def _check_writable(directory: str) -> None:
    """OSError unless `directory` is, or could be made as, a folder this process writes in."""
    probe = os.path.abspath(directory)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise OSError(errno.ENOTDIR, f"{probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise OSError(errno.EACCES, f"{probe} is not writable")


class Index(msgspec.Struct, forbid_unknown_fields=True):
    """A cache's index file: what it was made from, and which experts are on disk."""

    version: int
    key: str
    path: str  # the model's resolved path
    files: list[str]  # every shard's resolved path, the first being `path`
    identity: list[list[int]]  # per shard: dev, ino, size, mtime_ns, ctime_ns
    layouts: list[list[str]]
    geometry: list[list[int]]  # per MoE layer, in order: layer, then each part's bytes
    n_experts: int
    present: bytes  # one byte per (layer position, expert): 1 once on disk
    used_s: float  # when an engine last opened it (the least recently used goes first)


@dataclass(frozen=True)
class CacheGeometry:
    """Where each part of each expert lies in the data file: per layer, per part, a region of
    `n_experts` page-rounded strides (so every part is read and written page-aligned)."""

    layers: list[int]  # MoE layers, in order
    sizes: list[list[int]]  # per layer position, each part's bytes
    n_experts: int

    @property
    def rows(self) -> list[list[int]]:
        return [[layer, *sizes] for layer, sizes in zip(self.layers, self.sizes)]

    def bases(self) -> tuple[list[list[int]], int]:
        """(per layer position, per part: the region's start), and the data file's size."""
        out, pos = [], 0
        for sizes in self.sizes:
            row = []
            for size in sizes:
                row.append(pos)
                pos += round_up(size) * self.n_experts
            out.append(row)
        return out, pos

    def expert_bytes(self, li: int) -> int:
        """Disk bytes one expert of layer position `li` takes."""
        return sum(round_up(s) for s in self.sizes[li])


def cache_key(path: str, identity: list[list[int]], layouts: list[list[str]], geo: CacheGeometry) -> str:
    blob = msgspec.json.encode([VERSION, path, identity, layouts, geo.rows, geo.n_experts])
    return hashlib.sha256(blob).hexdigest()[:32]


class RepackCache:
    """One model's cache: its data file, which experts are on it, and where."""

    def __init__(
        self, owner: RepackCaches, index: Index, geo: CacheGeometry, data_fd: int, write_fd: int, direct: bool
    ):
        self.owner, self.index, self.geo = owner, index, geo
        self.key, self.path = index.key, index.path
        self._pos = {layer: i for i, layer in enumerate(geo.layers)}
        self._bases, _ = geo.bases()
        self.present = bytearray(index.present)  # written by the writer thread, read on the loop
        self._fd, self._write_fd, self._direct_write = data_fd, write_fd, direct
        self.reader = ModelFile(owner.data_path(self.key), owner.direct_io)
        self.on = True
        self.bytes_on_disk = sum(geo.expert_bytes(i // geo.n_experts) for i, p in enumerate(self.present) if p)
        self._dirty, self._saved_s = 0, time.monotonic()
        self._queued: set[int] = set()  # experts queued for writing, not yet on disk

    def _slot_of(self, layer: int, expert: int) -> int:
        return self._pos[layer] * self.geo.n_experts + expert

    def has(self, layer: int, expert: int) -> bool:
        return self.on and self.present[self._slot_of(layer, expert)] == 1

    def pieces(self, layer: int, expert: int, dests: list[int]) -> list[tuple[ModelFile, int, int, int]]:
        """The read job's pieces of an expert on disk: (file, offset, bytes, destination) per part."""
        li = self._pos[layer]
        return [
            (self.reader, base + expert * round_up(size), size, dest)
            for base, size, dest in zip(self._bases[li], self.geo.sizes[li], dests)
        ]

    def wants(self, layer: int, expert: int) -> bool:
        """Whether this expert is worth offering for writing (not on disk, not queued)."""
        i = self._slot_of(layer, expert)
        return self.on and not self.present[i] and i not in self._queued

    def offer(self, layer: int, expert: int, parts: list[tuple[int, int]]) -> bool:
        """Queue a copy of an expert just made on read, its parts `(address, bytes)` in a slot
        still LOADING (a reader thread, before the slot is READY: nothing else writes it), for
        writing. False: not queued (on disk or queued already, the cache off, or MAX_PENDING
        waiting). The copy costs a memcpy once per expert; it leaves the slot to the store."""
        i = self._slot_of(layer, expert)
        if not self.wants(layer, expert):
            return False
        li = self._pos[layer]
        strides = [round_up(size) for size in self.geo.sizes[li]]
        buf = mmap.mmap(-1, sum(strides))  # page-aligned: written with O_DIRECT as it is
        pos = 0
        for (addr, size), stride in zip(parts, strides):
            buf[pos : pos + size] = libc.buffer_at(addr, size)
            pos += stride
        if not self.owner.enqueue((self, i, buf)):
            buf.close()
            return False
        self._queued.add(i)
        return True

    # ---- the writer thread ----------------------------------------------------

    def write(self, i: int, buf: mmap.mmap) -> None:
        """Write one expert's copy (writer thread) and mark it on disk; the index follows in batches."""
        li, expert = divmod(i, self.geo.n_experts)
        try:
            if self.on and not self.present[i]:
                need = self.geo.expert_bytes(li)
                if not self.owner.take(need, self):
                    return
                view, pos = memoryview(buf), 0
                for base, size in zip(self._bases[li], self.geo.sizes[li]):
                    n = round_up(size) if self._direct_write else size  # the copy's parts are page-strided
                    _pwrite_all(self._write_fd, view[pos : pos + n], base + expert * round_up(size))
                    pos += round_up(size)
                view.release()
                self.present[i] = 1
                self.bytes_on_disk += need
                self.owner.counts["written"] += 1
                self._dirty += 1
                if self._dirty >= INDEX_EVERY or time.monotonic() - self._saved_s > INDEX_EVERY_S:
                    self.save()
        except OSError as exc:
            self.turn_off(f"writing it failed: {exc}")
        finally:
            self._queued.discard(i)
            buf.close()

    def save(self) -> None:
        """Make the written experts durable, then list them in the index (writer thread, or close)."""
        if not self._dirty or self._fd < 0:
            return
        try:
            os.fdatasync(self._fd)
            self.index.present = bytes(self.present)
            self.owner.write_index(self.index)
        except OSError as exc:
            self.turn_off(f"saving its index failed: {exc}")
            return
        self._dirty, self._saved_s = 0, time.monotonic()

    def turn_off(self, why: str) -> None:
        if self.on:
            self.on = False
            log.warning("repack cache of %s turned off: %s; its experts are read from the file", self.path, why)

    def close(self) -> None:
        """Save what was written and let the data file go (the model closed, or the daemon)."""
        if self._fd < 0:
            return
        self.save()
        self.reader.close()
        if self._write_fd != self._fd:
            os.close(self._write_fd)
        os.close(self._fd)  # its flock goes with it
        self._fd = self._write_fd = -1
        self.owner.closed(self)


def _pwrite_all(fd: int, buf: memoryview, off: int) -> None:
    pos = 0
    while pos < len(buf):
        n = os.pwrite(fd, buf[pos:], off + pos)
        if n <= 0:
            raise OSError(errno.EIO, f"short write at {off + pos}")
        pos += n


class RepackCaches:
    """The cache directory: its caches, its disk budget, and the writer thread."""

    def __init__(self, directory: str, budget_bytes: int | None, direct_io: str = "auto"):
        self.dir = directory
        self.budget_bytes = budget_bytes
        self.direct_io = direct_io
        # Made at the first model made on read (a daemon that never repacks leaves no trace);
        # here only found usable: the directory, or the nearest folder above it, is writable.
        _check_writable(directory)
        # each key is counted by one thread: read and busy on the loop, the others by the writer
        self.counts = {"read": 0, "written": 0, "busy": 0, "full": 0, "dropped": 0}
        self.open: dict[str, RepackCache] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(MAX_PENDING)
        self._stop = False
        self._closed: dict[str, tuple[str, list[list[int]], int, float]] = {}  # key -> path, identity, bytes, used
        self._made = os.path.isdir(directory)
        if self._made:
            self._scan()
        self._thread = threading.Thread(target=self._run, name="moed-repack-cache", daemon=True)
        self._thread.start()

    def data_path(self, key: str) -> str:
        return os.path.join(self.dir, key + ".data")

    def index_path(self, key: str) -> str:
        return os.path.join(self.dir, key + ".index")

    # ---- the directory ---------------------------------------------------------

    def _scan(self) -> None:
        """Learn the caches on disk; delete those whose file changed or is gone, and strays."""
        names = sorted(os.listdir(self.dir))
        keys = {n[: -len(".index")] for n in names if n.endswith(".index")}
        for name in names:
            key, _, ext = name.partition(".")
            if ext not in ("index", "data") or key not in keys:
                self._remove_files(key)  # a data file without its index, a temporary index
        for key in keys:
            index = self._read_index(key)
            if index is None or not _same_files(index):
                self._remove_files(key)
                continue
            self._closed[key] = (index.path, index.identity, self._disk_bytes(key), index.used_s)

    def _read_index(self, key: str) -> Index | None:
        try:
            with open(self.index_path(key), "rb") as f:
                index = msgspec.msgpack.decode(f.read(), type=Index)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            return None
        return index if index.version == VERSION and index.key == key else None

    def write_index(self, index: Index) -> None:
        tmp = self.index_path(index.key) + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with open(fd, "wb") as f:
            f.write(msgspec.msgpack.encode(index))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.index_path(index.key))

    def _disk_bytes(self, key: str) -> int:
        try:
            return os.stat(self.data_path(key)).st_blocks * 512
        except OSError:
            return 0

    def _remove_files(self, key: str) -> None:
        for path in (self.data_path(key), self.index_path(key), self.index_path(key) + ".tmp"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._closed.pop(key, None)

    def used_bytes(self) -> int:
        """What the directory's caches take on disk now."""
        with self._lock:
            return self._used()

    def _used(self) -> int:  # with the lock held
        return sum(c.bytes_on_disk for c in self.open.values()) + sum(v[2] for v in self._closed.values())

    # ---- opening -----------------------------------------------------------------

    def open_cache(
        self, files: list[str], identity: list[list[int]], layouts: list[list[str]], geo: CacheGeometry
    ) -> RepackCache | None:
        """The cache of one model made on read, from its shards' resolved paths and identity
        (made empty if none is on disk), or None (logged)."""
        path = files[0]
        key = cache_key(path, identity, layouts, geo)
        with self._lock:
            if not self._made:
                try:
                    os.makedirs(self.dir, mode=0o700, exist_ok=True)
                except OSError as exc:
                    log.warning("repack cache of %s not used: %s: %s", path, self.dir, exc.strerror)
                    return None
                self._made = True
            for other, (p, ident, _, _) in list(self._closed.items()):
                if p == path and ident != identity:  # the file changed since: that cache is void
                    self._remove_files(other)
                    self.counts["dropped"] += 1
            if key in self.open:
                return None  # the same model twice in one daemon cannot happen (registry)
            try:
                return self._open(key, files, identity, layouts, geo)
            except OSError as exc:
                log.warning("repack cache of %s not used: %s", path, exc)
                return None

    def _open(self, key: str, files: list[str], identity, layouts, geo: CacheGeometry) -> RepackCache | None:
        path, n = files[0], len(geo.layers) * geo.n_experts
        index = self._read_index(key)
        if index is None or index.geometry != geo.rows or len(index.present) != n:
            self._remove_files(key)
            index = Index(VERSION, key, path, files, identity, layouts, geo.rows, geo.n_experts, bytes(n), 0.0)
        fd = os.open(self.data_path(key), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            log.warning("repack cache of %s not used: another daemon holds %s", path, self.data_path(key))
            return None
        _, size = geo.bases()
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)  # sparse: the disk is taken as experts are written
        write_fd, direct = fd, False
        if self.direct_io != "off":
            try:
                write_fd, direct = os.open(self.data_path(key), os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC), True
            except OSError:  # tmpfs: buffered writes into the same file
                pass
        index.used_s = time.time()
        self._closed.pop(key, None)
        cache = RepackCache(self, index, geo, fd, write_fd, direct)
        self.open[key] = cache
        cache._dirty = 1
        cache.save()  # the index exists (with its use time) from the first open on
        return cache

    def closed(self, cache: RepackCache) -> None:
        """A cache let go: kept for the next open of its model, or deleted if its file changed
        (a model retired for that: its cache could never be used again)."""
        with self._lock:
            if self.open.get(cache.key) is cache:
                del self.open[cache.key]
                self._closed[cache.key] = (cache.path, cache.index.identity, cache.bytes_on_disk, cache.index.used_s)
                if not _same_files(cache.index):
                    self._remove_files(cache.key)
                    self.counts["dropped"] += 1

    # ---- the disk budget ------------------------------------------------------------

    def take(self, need: int, cache: RepackCache) -> bool:
        """Room for `need` more bytes of `cache` (writer thread): whole caches no open model
        uses go first, least recently used first. False: skipped, counted."""
        with self._lock:
            while not self._fits(need):
                victims = sorted(self._closed, key=lambda k: self._closed[k][3])
                if not victims:
                    self.counts["full"] += 1
                    return False
                self._remove_files(victims[0])
                self.counts["dropped"] += 1
        return True

    def _fits(self, need: int) -> bool:
        if self.budget_bytes is not None and self._used() + need > self.budget_bytes:
            return False
        st = os.statvfs(self.dir)
        return st.f_bavail * st.f_frsize - need >= min_free_bytes(st)

    # ---- the writer thread --------------------------------------------------------

    def enqueue(self, item) -> bool:
        if self._stop:
            return False
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.counts["busy"] += 1
            return False
        return True

    def _run(self) -> None:
        while True:
            # Timed only while an index is behind what was written: an idle daemon sleeps.
            dirty = any(c._dirty for c in list(self.open.values()))
            try:
                item = self._queue.get(timeout=INDEX_EVERY_S if dirty else None)
            except queue.Empty:
                for cache in list(self.open.values()):
                    cache.save()  # what was written while idle is listed within INDEX_EVERY_S
                continue
            if item is None:
                return
            cache, i, buf = item
            try:
                cache.write(i, buf)
            except Exception:  # noqa: BLE001 - a bug here must not stop the writer
                log.exception("repack cache write failed")
                cache.turn_off("a write failed")

    def close(self) -> None:
        """Write what is queued, then close every cache (saving its index)."""
        self._stop = True
        self._queue.put(None)
        self._thread.join(timeout=30)
        for cache in list(self.open.values()):
            cache.close()


def stats_row(caches: RepackCaches | None) -> dict:
    """The repack cache's keys of `moectl stats` (moed.protocol.stats); zeros when it is off."""
    counts = caches.counts if caches is not None else dict.fromkeys(("read", "written", "busy", "full", "dropped"), 0)
    return {
        "repack_cache_reads": counts["read"],
        "repack_cache_writes": counts["written"],
        "repack_cache_skipped": counts["busy"] + counts["full"],
        "repack_cache_dropped": counts["dropped"],
        "repack_cache_bytes": caches.used_bytes() if caches is not None else 0,
        "repack_cache_dir": caches.dir if caches is not None else "",
    }


def from_config(directory: str, budget_bytes: int | None, direct_io: str = "auto") -> RepackCaches | None:
    """The daemon's repack cache, or None when it is off (`budget_bytes` 0). A directory the
    config names that cannot be used is an OSError naming it (the daemon does not start); the
    default one is logged and the daemon runs without a cache."""
    if budget_bytes == 0:
        return None
    path = directory or default_dir()
    try:
        return RepackCaches(path, budget_bytes, direct_io)
    except OSError as exc:
        if directory:
            raise OSError(exc.errno, f"repack_cache_dir {path}: {exc.strerror or exc}") from None
        log.warning("repack cache off: %s: %s", path, exc.strerror or exc)
        return None


def _same_files(index: Index) -> bool:
    """Whether the files a cache was made from are still those files (one stat a shard)."""
    try:
        return [list(identity_of(os.stat(p))) for p in index.files] == index.identity
    except OSError:
        return False


__all__ = ["CacheGeometry", "RepackCache", "RepackCaches", "default_dir", "from_config", "stats_row"]
