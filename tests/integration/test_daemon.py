"""The core daemon against real processes, real files and the real drive."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from moed.gguf.catalog import Catalog
from moed.protocol import errors
from moed.protocol.framing import HEADER, FrameReader, reply_decoder
from moed.testing import file_bytes


def expert_bytes(model_path, layer: int) -> int:
    cat = Catalog.open(model_path)
    return sum(-(-p.bytes_per_expert // 4096) * 4096 for p in cat.layers[layer].parts.values())


def check_lease(cat: Catalog, lease, layer, experts) -> None:
    for e in experts:
        for part in cat.parts:
            path, off, n = cat.extent(layer, e, part)
            assert lease.view(e, part).tobytes() == file_bytes(path, off, n), (layer, e, part)


def worker(*args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.client_proc", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_two_processes_heavy_eviction_every_byte_matches(start_daemon, model_factory):
    model = model_factory(layers=6, experts=16, used=4)
    slot = expert_bytes(model, 0)
    # room for 12 experts out of 96: nearly every acquire evicts
    d = start_daemon(str(12 * slot))
    procs = [worker("random", d.socket, model, 150, seed) for seed in (1, 2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    with d.client() as c:
        s = c.stats()
    assert s["misses"] > 100 and s["used_bytes"] <= s["budget_bytes"]
    assert s["bytes_read"] >= s["misses"] * slot // 2
    assert d.stop() == 0


def test_shared_model_and_hits(daemon, tiny_model):
    cat = Catalog.open(tiny_model)
    with daemon.client("a") as a, daemon.client("b") as b:
        ma, mb = a.open_model(tiny_model), b.open_model(tiny_model)
        assert ma.model_id == mb.model_id
        with ma.acquire(1, [0, 3]) as la:
            check_lease(cat, la, 1, [0, 3])
        with mb.acquire(1, [3, 0]) as lb:
            check_lease(cat, lb, 1, [3, 0])
        s = a.stats()
    assert (s["hits"], s["misses"]) == (2, 2)
    assert len(s["models"]) == 1


def test_killed_client_frees_its_leases(start_daemon, tiny_model):
    slot = expert_bytes(tiny_model, 0)
    d = start_daemon(str(4 * slot))
    holder = worker("hold", d.socket, tiny_model, 0, "0,1,2,3")
    assert holder.stdout.readline().startswith("held")
    with d.client() as c:
        m = c.open_model(tiny_model)
        with pytest.raises(errors.BudgetExhausted):
            m.acquire(1, [0], timeout_s=0.2)
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        # the kill frees the budget: an acquire that waits now succeeds
        with m.acquire(1, [0, 1, 2, 3], timeout_s=5) as lease:
            check_lease(Catalog.open(tiny_model), lease, 1, [0, 1, 2, 3])


def test_full_budget_waits_then_succeeds_when_released(start_daemon, tiny_model):
    slot = expert_bytes(tiny_model, 0)
    d = start_daemon(str(2 * slot))
    with d.client("a") as a, d.client("b") as b:
        ma, mb = a.open_model(tiny_model), b.open_model(tiny_model)
        held = ma.acquire(0, [0, 1])
        with pytest.raises(errors.RequestTooLarge):
            mb.acquire(0, [2, 3, 4])
        t0 = time.monotonic()
        with pytest.raises(errors.BudgetExhausted):
            mb.acquire(0, [2], timeout_s=0.3)
        assert time.monotonic() - t0 >= 0.25
        held.release()
        with mb.acquire(0, [2, 3], timeout_s=5):
            pass


def test_bad_requests_get_typed_errors(daemon, tiny_model, tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 100)
    with daemon.client() as c:
        m = c.open_model(tiny_model)
        with pytest.raises(errors.UnknownLayer):
            m.acquire(99, [0])
        with pytest.raises(errors.UnknownExpert):
            m.acquire(0, [8])
        with pytest.raises(errors.BadModelFile):
            c.open_model(junk)
        with pytest.raises(errors.BadModelFile):
            c.open_model(tmp_path / "missing.gguf")
        with pytest.raises(errors.UnknownLease):
            from moed.protocol import messages as msg

            c.request(msg.Release([12345]))
        with pytest.raises(errors.UnknownModel):
            c.request(__import__("moed.protocol.messages", fromlist=["Acquire"]).Acquire(77, 0, [0]))
        with m.acquire(0, [1]):
            pass  # still serving this connection


def _raw(sock_path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(sock_path)
    return s


def _read_reply(s: socket.socket, frames: FrameReader | None = None):
    """One reply off a raw socket, split by the same FrameReader the client uses; None at EOF."""
    frames = frames or FrameReader(reply_decoder)
    while True:
        chunk = s.recv(1 << 16)
        if not chunk:
            return None
        got = frames.feed(chunk)
        if got:
            return got[0]


def test_malformed_frames_get_errors_and_daemon_keeps_serving(daemon, tiny_model):
    from moed.protocol import messages as msg
    from moed.protocol.framing import encode

    s = _raw(daemon.socket)
    s.sendall(HEADER.pack(5) + b"\xc1\xc1\xc1\xc1\xc1")  # undecodable payload
    r = _read_reply(s)
    assert isinstance(r, msg.Error) and r.code == errors.ErrorCode.BAD_FRAME
    s.sendall(encode(msg.Ping()))  # before hello: refused and closed
    r = _read_reply(s)
    assert isinstance(r, msg.Error) and r.code == errors.ErrorCode.NOT_HELLO
    assert _read_reply(s) is None
    s2 = _raw(daemon.socket)
    s2.sendall(HEADER.pack(0xFFFFFFFF) + b"x")  # oversize: error, then closed
    r = _read_reply(s2)
    assert isinstance(r, msg.Error) and r.code == errors.ErrorCode.BAD_FRAME
    assert _read_reply(s2) is None
    s3 = _raw(daemon.socket)
    s3.sendall(encode(msg.Hello(999)))
    assert _read_reply(s3).code == errors.ErrorCode.VERSION_MISMATCH
    with daemon.client() as c:  # everyone else is served
        m = c.open_model(tiny_model)
        with m.acquire(0, [0]):
            pass
        assert c.stats()["bad_frames"] == 2


def _direct_io_refused(directory: str) -> bool:
    probe = os.path.join(directory, "probe")
    with open(probe, "wb") as f:
        f.write(b"\0" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return False
    except OSError:
        return True
    finally:
        os.unlink(probe)


@pytest.fixture
def no_direct_dir():
    """A directory on a filesystem that refuses O_DIRECT: /dev/shm on older kernels, else ramfs."""
    shm = tempfile.mkdtemp(prefix="moed-test-", dir="/dev/shm")
    if _direct_io_refused(shm):
        yield shm
        shutil.rmtree(shm)
        return
    shutil.rmtree(shm)  # tmpfs supports O_DIRECT since Linux 6.6; ramfs never does
    mnt = tempfile.mkdtemp(prefix="moed-ramfs-", dir="/tmp")
    if subprocess.run(["mount", "-t", "ramfs", "ramfs", mnt], capture_output=True).returncode != 0:
        os.rmdir(mnt)
        pytest.skip("no filesystem here refuses O_DIRECT (tmpfs accepts it, ramfs cannot be mounted)")
    try:
        assert _direct_io_refused(mnt)
        yield mnt
    finally:
        # lazy: the daemon (torn down after this fixture) may still hold the file open
        subprocess.run(["umount", "-l", mnt])
        os.rmdir(mnt)


def test_buffered_fallback_where_o_direct_is_refused(daemon, tiny_model, no_direct_dir):
    path = shutil.copy(tiny_model, no_direct_dir)
    cat = Catalog.open(path)
    with daemon.client() as c:
        m = c.open_model(path)
        with m.acquire(2, [5, 6]) as lease:
            check_lease(cat, lease, 2, [5, 6])
        s = c.stats()
    assert s["direct_io"] is False
    assert s["models"][0]["direct_io"] is False


def test_buffered_reads_when_configured_off(start_daemon, aligned_model, tiny_model):
    d = start_daemon("8MiB", "--direct-io", "off")
    with d.client() as c:
        for path in (aligned_model, tiny_model):
            cat = Catalog.open(path)
            m = c.open_model(path)
            with m.acquire(1, [2, 3]) as lease:
                check_lease(cat, lease, 1, [2, 3])
        assert c.stats()["direct_io"] is False


def test_direct_io_on_ext4(daemon, aligned_model):
    cat = Catalog.open(aligned_model)
    with daemon.client() as c:
        m = c.open_model(aligned_model)
        with m.acquire(3, [7, 0]) as lease:
            check_lease(cat, lease, 3, [7, 0])
        assert c.stats()["direct_io"] is True


def test_split_and_mixed_models(daemon, split_model, mixed_model):
    with daemon.client() as c:
        for path in (split_model, mixed_model):
            cat = Catalog.open(path)
            m = c.open_model(path)
            for layer in m.moe_layers:
                with m.acquire(layer, [0, 7]) as lease:
                    check_lease(cat, lease, layer, [0, 7])
        s = c.stats()
    assert len(s["models"]) == 2


def test_truncated_file_is_stale_and_daemon_serves(daemon, tiny_model, tmp_path, aligned_model):
    """A truncation is a change: no byte of the file is served again, even experts
    that are still inside it, and reopening it says why it cannot be used."""
    path = tmp_path / "t.gguf"
    shutil.copy(tiny_model, path)
    with daemon.client() as c:
        m = c.open_model(path)
        with m.acquire(0, [0]):
            pass
        cat = Catalog.open(path)
        _, off, _ = cat.extent(3, 7, "down")
        os.truncate(path, off)  # the last experts are gone now
        with pytest.raises(errors.ModelStale):
            m.acquire(3, [7])
        with pytest.raises(errors.ModelStale):
            m.acquire(0, [0])  # cached before the change: not served either
        with pytest.raises(errors.BadModelFile, match="truncated|past|end"):
            c.open_model(path)
        assert c.stats()["stale_detected"] >= 1
        m2 = c.open_model(aligned_model)
        with m2.acquire(0, [1]) as lease:
            check_lease(Catalog.open(aligned_model), lease, 0, [1])


def test_sigterm_exits_zero_and_leaves_nothing(start_daemon, tiny_model):
    d = start_daemon("8MiB")
    before = {n for n in os.listdir("/dev/shm")}
    c = d.client(reconnect_s=1)
    m = c.open_model(tiny_model)
    m.acquire(0, [0, 1])  # still held at shutdown
    assert d.stop() == 0
    assert not os.path.exists(d.socket)
    assert {n for n in os.listdir("/dev/shm")} <= before
    with pytest.raises(errors.DaemonUnavailable, match="did not answer for 1 s"):  # it stays gone
        c.stats()


def test_daemon_killed_clients_get_typed_error_and_restart_is_clean(start_daemon, tiny_model):
    d = start_daemon("8MiB")
    c = d.client(timeout_s=5, reconnect_s=0)  # no reconnect of its own (test_reconnect.py has those)
    m = c.open_model(tiny_model)
    with m.acquire(0, [0]):
        pass
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    t0 = time.monotonic()
    with pytest.raises(errors.DaemonUnavailable):
        m.acquire(0, [1])
    assert time.monotonic() - t0 < 1.0
    m.prefetch(0, [2])  # a hint: dropped without an error, as documented
    d2 = start_daemon("8MiB", socket_dir=str(d.dir))  # same socket path: the stale one is replaced
    c.reconnect()
    m = c.open_model(tiny_model)
    with m.acquire(0, [1]):
        pass
    c.close()
    assert d2.stop() == 0


def test_concurrent_acquires_of_one_missing_expert_share_one_read(daemon, model_factory):
    from concurrent.futures import ThreadPoolExecutor

    model = model_factory(layers=2, experts=4, used=2, embd=256, ff=512)
    clients = [daemon.client(f"c{i}") for i in range(4)]
    handles = [c.open_model(model) for c in clients]

    def grab(m):
        with m.acquire(1, [2]):
            return True

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(grab, handles))
    s = clients[0].stats()
    assert s["hits"] + s["misses"] == 4
    assert s["misses"] - s["joined_reads"] == 1
    assert s["bytes_read"] == Catalog.open(model).expert_bytes(1)
    for c in clients:
        c.close()


def test_acquire_timeout_keeps_its_old_name_as_a_deprecated_alias(daemon, tiny_model):
    with daemon.client() as c:
        m = c.open_model(tiny_model)
        with pytest.warns(DeprecationWarning, match="timeout_s"):
            lease = m.acquire(0, [1], timeout=5)
        lease.release()
        with m.acquire(0, [1], timeout_s=5):
            pass


def test_engines_that_start_together_all_open_their_model(start_daemon, model_factory):
    """More opens at once than the daemon runs per tenant (max_opens_per_tenant, 2): the
    daemon says TooBusy(busy="opens") to the rest, and the client waits for the others
    instead of failing an engine that merely started beside them (serve --workers)."""
    import threading

    d = start_daemon()
    paths = [model_factory(seed=100 + i) for i in range(8)]  # distinct files: each open parses its own
    clients = [d.client(f"engine{i}") for i in range(8)]
    start, failed, opened = threading.Barrier(8), [], []

    def open_one(c, path):
        start.wait(timeout=30)
        try:
            opened.append(c.open_model(path).model_id)
        except errors.MoedError as exc:
            failed.append(exc)

    threads = [threading.Thread(target=open_one, args=(c, p)) for c, p in zip(clients, paths)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for c in clients:
        c.close()
    assert failed == [] and len(opened) == 8
