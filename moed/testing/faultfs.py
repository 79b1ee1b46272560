"""A misbehaving drive on a real kernel path, for tests and benches (root only).

What this module owns: two real kernel facilities, set up and torn down whole.

- `LoopBtrfs`: a btrfs filesystem in a sparse image on a loop device. `corrupt()`
  overwrites 4 KiB of a file's data inside the image (found by content), so that
  btrfs's data checksum fails and every read of that block, O_DIRECT or
  buffered, gets EIO from the filesystem, while the rest of the file reads fine.
  Nothing of the drive is mocked: the error comes from the block layer and the
  filesystem, as a bad sector's would.
- `BlkioThrottle`: a cgroup v1 blkio group with `blkio.throttle.read_bps_device`
  (and `read_iops_device`) on one device. The throttle applies to the bios a task
  in the group submits to that device: for a loop device that is the reads of
  the filesystem on it (O_DIRECT and buffered readahead alike, both issued in
  the reader's context); the loop worker's own reads of the backing file are
  another device's and are not limited. Lifting the limit (writing 0) releases
  queued bios at once.

`unavailable()` says why these cannot run here (not root, no mkfs.btrfs, no loop
devices, no blkio controller), for a test's skip reason; `scripts/setup-system`
installs btrfs-progs where apt is available.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

BLOCK = 4096
BLKIO_ROOT = Path("/sys/fs/cgroup/blkio")


@functools.cache
def unavailable(throttle: bool = False) -> str:
    """'' if a loop btrfs (and, with `throttle`, a blkio throttle) can be made here, else why not.

    After the quick checks, one real trial (an image, a loop device, a mount; a blkio
    group), once per process: a container may have the tools but not the permission.
    """
    why = _missing(throttle)
    if why:
        return why
    try:
        LoopBtrfs().close()
        if throttle:
            os.rmdir(tempfile.mkdtemp(prefix="moed-probe-", dir=BLKIO_ROOT))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        return f"a btrfs loop image{' and a blkio group' if throttle else ''} cannot be set up here: {detail}"
    return ""


def _missing(throttle: bool) -> str:
    if os.geteuid() != 0:
        return "needs root (loop devices, mount, cgroups)"
    if shutil.which("mkfs.btrfs") is None:
        return "mkfs.btrfs not installed (apt-get install btrfs-progs; scripts/setup-system does it)"
    if shutil.which("losetup") is None or not os.path.exists("/dev/loop-control"):
        return "no loop devices (losetup, /dev/loop-control)"
    with open("/proc/filesystems") as f:
        if "btrfs" not in f.read():
            return "this kernel has no btrfs"
    if throttle and not (BLKIO_ROOT / "blkio.throttle.read_bps_device").exists():
        return "no cgroup v1 blkio controller with throttling at /sys/fs/cgroup/blkio"
    return ""


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


class LoopBtrfs:
    """A btrfs mounted at `self.mnt` from an image on a loop device; `close()` removes it all."""

    def __init__(self, size_bytes: int = 256 << 20, parent: str | None = None):
        self.dir = Path(tempfile.mkdtemp(prefix="moed-btrfs-", dir=parent))
        self.image = self.dir / "image"
        self.mnt = self.dir / "mnt"
        self.device = ""
        self.mounted = False
        try:
            with open(self.image, "wb") as f:
                f.truncate(size_bytes)
            _run("mkfs.btrfs", "-q", str(self.image))
            self.device = _run("losetup", "-f", "--show", str(self.image))
            self.mnt.mkdir()
            self.mount()
        except BaseException:
            self.close()
            raise
        os.chmod(self.dir, 0o755)

    @property
    def major_minor(self) -> str:
        """`MAJ:MIN` of the loop device, as the blkio throttle files want it."""
        st = os.stat(self.device)
        return f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"

    def mount(self) -> None:
        _run("mount", "-t", "btrfs", self.device, str(self.mnt))
        os.chmod(self.mnt, 0o755)
        self.mounted = True

    def unmount(self, lazy: bool = False) -> None:
        if self.mounted:
            _run("umount", *(["-l"] if lazy else []), str(self.mnt))
            self.mounted = False

    def copy_in(self, src: str | os.PathLike, name: str) -> Path:
        """Copy a file onto the filesystem (world-readable), flushed to the image.

        The filesystem is then mounted afresh with the caches dropped: pages the copy
        left cached are served to O_DIRECT reads without any I/O on this btrfs (seen
        here: a throttle then limits nothing), and a test means the device.
        """
        dst = self.mnt / name
        shutil.copyfile(src, dst)
        os.chmod(dst, 0o644)
        self.remount()
        return dst

    def remount(self) -> None:
        """Unmount, drop the caches, mount again: every read after this reaches the device."""
        self.unmount()
        try:
            drop_caches()
        finally:
            self.mount()

    def corrupt(self, path: str | os.PathLike, file_offset: int) -> int:
        """Overwrite the 4 KiB data block of `path` holding `file_offset` inside the image.

        The block is found by its content (so it must be unique in the image: random
        weights are); the filesystem is unmounted while the image is written and
        mounted again after the caches are dropped. Returns the image offset.
        """
        start = file_offset - file_offset % BLOCK
        with open(path, "rb") as f:
            f.seek(start)
            block = f.read(BLOCK)
        if len(block) != BLOCK or block.count(block[:1]) == BLOCK:
            raise ValueError(f"the block at {start} of {path} is short or uniform: it cannot be found by content")
        self.unmount()
        try:
            image = self.image.read_bytes()
            at = image.find(block)
            if at < 0 or image.find(block, at + 1) >= 0:
                raise ValueError(f"the block at {start} of {path} is not exactly once in the image")
            with open(self.image, "r+b") as f:
                f.seek(at)
                f.write(bytes(b ^ 0xFF for b in block))
            drop_caches()
        finally:
            self.mount()
        return at

    def close(self) -> None:
        try:
            self.unmount()
        except subprocess.CalledProcessError:
            self.unmount(lazy=True)  # still open somewhere (a daemon not yet reaped): detach it anyway
        finally:
            if self.device:
                subprocess.run(["losetup", "-d", self.device], capture_output=True)
                self.device = ""
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LoopBtrfs:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class BlkioThrottle:
    """A cgroup v1 blkio group that limits its tasks' reads of one device; `close()` removes it."""

    def __init__(self, major_minor: str):
        self.dev = major_minor
        self.path = Path(tempfile.mkdtemp(prefix="moed-test-", dir=BLKIO_ROOT))

    def add(self, pid: int) -> None:
        """Move a process (every thread of it) into the group."""
        (self.path / "cgroup.procs").write_text(f"{pid}\n")

    def read_bps(self, bps: int) -> None:
        """Limit reads to `bps` bytes a second (0 lifts the limit)."""
        (self.path / "blkio.throttle.read_bps_device").write_text(f"{self.dev} {bps}\n")

    def close(self) -> None:
        try:
            self.read_bps(0)
        except OSError:
            pass
        for pid in filter(None, (self.path / "cgroup.procs").read_text().split()):
            try:
                (BLKIO_ROOT / "cgroup.procs").write_text(f"{pid}\n")
            except OSError:
                pass  # the process exited meanwhile
        os.rmdir(self.path)

    def __enter__(self) -> BlkioThrottle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["BlkioThrottle", "LoopBtrfs", "drop_caches", "unavailable"]
