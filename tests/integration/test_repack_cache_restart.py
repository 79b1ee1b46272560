"""The repack cache across a daemon killed and started again (issue 49): a daemon killed with
SIGKILL while it writes its cache leaves only whole experts listed, and the next daemon on the
same directory serves every expert as the transform of the file's bytes, most from the cache."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile

import msgspec
import numpy as np

from moed.daemon.repackcache import Index
from moed.gguf import interleave
from moed.gguf.catalog import Catalog
from moed.testing import DaemonProcess, file_bytes, wait_for

LAYOUT = "q4_0_8x8"


def made_on_read(cat: Catalog, layer: int, expert: int, part: str) -> bytes:
    ext = cat.layers[layer].parts[part]
    n = ext.bytes_per_expert
    plain = file_bytes(ext.path, ext.offset + expert * n, n)
    out = bytearray(n)
    interleave.transform(LAYOUT, plain, out, ext.shape[0], ext.shape[1])
    return bytes(out)


def listed(cache_dir: str) -> int:
    """How many experts the index on disk lists (0 while there is none)."""
    for name in os.listdir(cache_dir) if os.path.isdir(cache_dir) else []:
        if name.endswith(".index"):
            with open(os.path.join(cache_dir, name), "rb") as f:
                return sum(msgspec.msgpack.decode(f.read(), type=Index).present)
    return 0


def read_every_expert(d: DaemonProcess, path: str, cat: Catalog, check: bool) -> None:
    with d.client() as c:
        m = c.open_model(path, expert_layout=LAYOUT)
        for layer in sorted(cat.layers):
            for e in range(cat.n_experts):
                with m.acquire(layer, [e]) as lease:
                    if check:
                        for part in cat.parts:
                            got = np.asarray(lease.view(e, part)).tobytes()
                            assert got == made_on_read(cat, layer, e, part), (layer, e, part)


def test_a_daemon_killed_while_writing_its_cache_leaves_only_whole_experts(model_factory, tmp_path):
    path = str(tmp_path / "m.gguf")
    shutil.copy(model_factory(quant="q4_0", ff=512), path)
    cat = Catalog.open(path)
    sock_dir = tempfile.mkdtemp(prefix="moed-", dir="/tmp")  # kept: the cache lives in it
    try:
        first = DaemonProcess("4MiB", socket_dir=sock_dir)
        try:
            read_every_expert(first, path, cat, check=False)
            cache = os.path.join(sock_dir, "cache", "repack")
            wait_for(lambda: listed(cache) > 0, 30, what="an index listing experts")
            read_every_expert(first, path, cat, check=False)  # evicted ones read again: more writes
            first.proc.send_signal(signal.SIGKILL)  # writes may be under way: nothing is flushed
            first.proc.wait()
        finally:
            first.close()
        second = DaemonProcess("4MiB", socket_dir=sock_dir)
        try:
            read_every_expert(second, path, cat, check=True)
            with second.client() as c:
                s = c.stats()
            assert s["repack_cache_reads"] > 0  # what the first listed was read back
            assert s["read_errors"] == 0
        finally:
            second.close()
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
