"""Skeleton copies of a model: its bytes with every routed-expert range left as a hole.

Why: this llama.cpp maps every model file it loads with MAP_POPULATE, which reads
the whole file at load (3.71 GiB for a 3.70 GiB model, measured). For a model
larger than RAM that is one full read of the drive and a page cache churned end to
end, all for expert bytes the engine will never read through that mapping (they
come from the daemon); over a bad block the load does not return. A skeleton has the same
size, header and dense bytes at the same offsets, and holes where the experts
are: populating a hole reads nothing from the drive. llama.cpp loads the
skeleton; the daemon still serves the experts from the real file.

Invariants:
- Every byte outside the routed-expert extents equals the real file's byte, and
  the skeleton has the real file's size (checked by comparing dense ranges on
  creation, and by identity on reuse).
- A skeleton is reused only for the same (device, inode, size, mtime) of every
  shard of the real file: the cache directory is named after them all, so a file
  present there under the shard's name is that shard's skeleton.
- A published skeleton is never replaced: each writer writes its own temporary file
  and links it into place, and a writer that finds the name taken uses the file
  already there. Replacing it would pull the file out from under an engine that is
  loading it (its mapping would name a deleted file, and the engine could not find
  it in /proc/self/maps).
- Shards keep their file names, so llama.cpp finds the other shards of a split
  skeleton next to the first one.
- Each writer writes its own temporary file (pid and thread in the name) and links
  it into place, so engines starting together (serve workers, engines started at
  once on a box) never read a file another one is still writing.
- StreamedLlama's default cache is per user (`default_dir`). A skeleton's stamp is
  touched on every reuse, and writing a new one removes the cache's skeletons unused
  for `MAX_IDLE_S`, so the cache holds what is in use, not every model ever opened.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import pathlib
import shutil
import threading
import time

from moed.engines.expert_pages import gaps, merge
from moed.engines.sources import ExpertSource

MAX_IDLE_S = 14 * 86400  # a skeleton no engine loaded for two weeks is removed


def default_dir() -> pathlib.Path:
    """StreamedLlama's skeleton cache: $MOED_SKELETON_DIR, else $XDG_CACHE_HOME/moed/skeletons,
    else ~/.cache/moed/skeletons."""
    if given := os.environ.get("MOED_SKELETON_DIR"):
        return pathlib.Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "moed" / "skeletons"


def _identity(path: str) -> str:
    st = os.stat(path)
    return f"{st.st_dev:x}-{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"


def _key(files: list[str]) -> str:
    """The cache directory's name: every shard's identity (one shard: as it always was)."""
    ids = [_identity(f) for f in files]
    if len(ids) == 1:
        return ids[0]
    return f"{ids[0]}-{hashlib.sha256('/'.join(ids).encode()).hexdigest()[:16]}"


def expert_ranges(source: ExpertSource, shard: int) -> list[tuple[int, int]]:
    out = []
    for layer in source.moe_layers:
        for ext in source.extents(layer):
            if ext.shard == shard:
                out.append((ext.offset, ext.offset + ext.bytes_per_expert * source.n_experts))
    return merge(out)


def dense_ranges(size: int, holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The file's bytes outside the (sorted) expert holes."""
    return gaps(0, size, holes)


def skeleton_for(source: ExpertSource, cache_dir: str | os.PathLike) -> list[str]:
    """Paths of the skeleton shards for `source.files` under `cache_dir` (made if missing)."""
    out_dir = pathlib.Path(cache_dir) / _key(source.files)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths, wrote = [], False
    for shard, real in enumerate(source.files):
        dst = out_dir / os.path.basename(real)
        stamp = out_dir / (dst.name + ".src")
        if not dst.exists():
            _write(real, str(dst), expert_ranges(source, shard))
            wrote = True
        if stamp.exists():
            os.utime(stamp)  # in use: kept by prune()
        else:
            _write_text(stamp, _identity(real))
        paths.append(str(dst))
    if wrote:
        prune(pathlib.Path(cache_dir), keep=out_dir)
    return paths


def prune(cache_dir: pathlib.Path, keep: pathlib.Path, max_idle_s: float = MAX_IDLE_S) -> list[pathlib.Path]:
    """Remove the skeletons under `cache_dir` whose stamps were last touched over `max_idle_s` ago."""
    removed, now = [], time.time()
    for entry in cache_dir.iterdir():
        stamps = list(entry.glob("*.src")) if entry.is_dir() and entry != keep else []
        try:
            idle = stamps and now - max(st.stat().st_mtime for st in stamps) > max_idle_s
        except FileNotFoundError:  # another engine is pruning or rewriting it
            continue
        if idle:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _private(path: str) -> str:
    """A temporary name no other writer uses (engines may write the same skeleton at once)."""
    return f"{path}.partial-{os.getpid()}-{threading.get_ident()}"


def _write_text(path: pathlib.Path, text: str) -> None:
    tmp = _private(str(path))
    pathlib.Path(tmp).write_text(text)
    os.replace(tmp, path)


def _write(real: str, dst: str, holes: list[tuple[int, int]]) -> None:
    size = os.path.getsize(real)
    tmp = _private(dst)
    src_fd = os.open(real, os.O_RDONLY)
    dst_fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(dst_fd, size)  # everything a hole first
        for lo, hi in dense_ranges(size, holes):
            _copy(src_fd, dst_fd, lo, hi - lo)
        os.fsync(dst_fd)
        # Linked, not renamed: another writer's skeleton already there (same bytes) stays
        # the file every engine loads.
        _publish(tmp, dst)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        os.close(src_fd)
        os.close(dst_fd)


def _publish(tmp: str, dst: str) -> None:
    """Put `tmp` in place at `dst` unless a skeleton is there already."""
    try:
        os.link(tmp, dst)
    except FileExistsError:
        pass
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        # A filesystem without hard links: renamed only when no other writer got there first.
        if not os.path.exists(dst):
            os.replace(tmp, dst)


def _copy(src_fd: int, dst_fd: int, offset: int, length: int) -> None:
    done = 0
    while done < length:
        try:
            n = os.copy_file_range(src_fd, dst_fd, length - done, offset + done, offset + done)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
            # A skeleton on another filesystem than the model (btrfs to ext4 answers
            # EXDEV): copy through memory instead.
            _copy_plain(src_fd, dst_fd, offset + done, length - done)
            return
        if n <= 0:
            raise OSError(f"copy_file_range stopped at {offset + done} of {offset + length}")
        done += n


def _copy_plain(src_fd: int, dst_fd: int, offset: int, length: int, step: int = 8 << 20) -> None:
    pos, end = offset, offset + length
    while pos < end:
        data = os.pread(src_fd, min(step, end - pos), pos)
        if not data:
            raise OSError(f"the model ends at {pos}, before {end}")
        written = 0
        while written < len(data):
            written += os.pwrite(dst_fd, data[written:], pos + written)
        pos += len(data)
