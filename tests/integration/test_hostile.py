"""Hostile tenants and careless operators against the real daemon.

Every case ends the same way: another, well-behaved client is still served
with the file's exact bytes, its ping answers within a second, and SIGTERM
ends the daemon within its grace period with exit code 0.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import msgspec
import pytest

from moed.client import local
from moed.gguf.catalog import Catalog
from moed.protocol import errors
from moed.protocol import messages as m
from moed.protocol import residency_words as rz
from moed.protocol.framing import HEADER, FrameReader, encode, reply_decoder
from moed.spawn import DaemonProcess
from moed.testing import wait_for
from tests.integration.test_daemon import check_lease
from tests.integration.test_robustness import _can_connect

PING_WITHIN_S = 1.0
GRACE_S = 2.0


def well_behaved(d, model) -> None:
    """A fresh client: ping within a second, then correct bytes for two experts."""
    with d.client("good", timeout_s=10) as c:
        t0 = time.monotonic()
        c.ping()
        assert time.monotonic() - t0 < PING_WITHIN_S
        h = c.open_model(model)
        with h.acquire(1, [2, 5], timeout_s=5) as lease:
            check_lease(Catalog.open(model), lease, 1, [2, 5])


def stops_in_grace(d) -> None:
    t0 = time.monotonic()
    assert d.stop(timeout_s=GRACE_S + 3) == 0
    assert time.monotonic() - t0 < GRACE_S + 3


@pytest.fixture
def hostile_daemon():
    made = []

    def start(budget: str = "16MiB", **config):
        d = DaemonProcess(budget, config={"shutdown_grace_s": GRACE_S, **config})
        made.append(d)
        return d

    yield start
    for d in made:
        d.close()


def raw(d, hello: bool = True) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(d.socket)
    if hello:
        s.sendall(encode(m.Hello(m.PROTOCOL_VERSION, "hostile")))
    return s


def flood(s: socket.socket, frame: bytes, total_bytes: int) -> int:
    """Send `frame` repeatedly without reading, until the daemon stops reading us."""
    s.setblocking(False)
    sent = 0
    deadline = time.monotonic() + 10
    chunk = frame * max(1, 4096 // len(frame))
    while sent < total_bytes and time.monotonic() < deadline:
        try:
            sent += s.send(chunk)
        except BlockingIOError:
            # the kernel buffers are full: the daemon stopped reading us, as it should
            break
    return sent


# ---- flooding without reading ----------------------------------------------------


@pytest.mark.parametrize("after_open", [False, True])
def test_a_client_that_floods_and_never_reads_freezes_nobody(hostile_daemon, tiny_model, after_open):
    d = hostile_daemon()
    s = raw(d)
    if after_open:
        s.sendall(encode(m.OpenModel(str(tiny_model))))  # its reply (with fds) is never read
    sent = flood(s, encode(m.GetStats()), 8 << 20)
    assert sent > 40 << 10, "the flood should exceed what froze the old daemon"
    well_behaved(d, tiny_model)
    with d.client() as c:
        rows = [r for r in c.stats()["clients"] if r["queued_bytes"] or r["buffered_out_bytes"]]
        lim = c.stats()["limits"]
    assert rows, "the flooding connection shows in stats"
    for r in rows:  # what it makes the daemon hold is bounded
        assert r["queued_bytes"] <= lim["max_queued_bytes"] + lim["max_request_frame_bytes"]
        assert r["buffered_out_bytes"] <= lim["write_high_bytes"] + (64 << 10)
    stops_in_grace(d)


def test_an_open_model_reply_is_passed_when_the_flooder_finally_reads(hostile_daemon, tiny_model):
    """Descriptors wait behind queued output, then go out in order with their frame."""
    d = hostile_daemon()
    s = raw(d)
    assert isinstance(_reply(s), m.HelloReply)
    s.sendall(encode(m.GetStats()) * 200 + encode(m.OpenModel(str(tiny_model))) + encode(m.Ping()))
    seen: list = []
    fds: list[int] = []
    s.settimeout(10)
    frames = FrameReader(reply_decoder)
    while not seen or not isinstance(seen[-1], m.Pong):
        data, got, _, _ = socket.recv_fds(s, 1 << 16, 16)
        assert data, "closed early"
        fds += got
        seen += frames.feed(data)
    kinds = [type(r).__name__ for r in seen]
    assert kinds.count("StatsReply") == 200 and kinds[-2:] == ["ModelInfo", "Pong"]
    # segments, then each segment's slot states, then the residency table
    assert len(fds) == 2 * len(seen[-2].segments) + 1 >= 3
    for fd in fds:
        os.close(fd)
    s.close()
    well_behaved(d, tiny_model)
    stops_in_grace(d)


def _reply(s: socket.socket):
    s.settimeout(10)
    frames = FrameReader(reply_decoder)
    while True:
        got = frames.feed(s.recv(1 << 16))
        if got:
            return got[0]


def test_requests_over_the_list_bounds_are_bad_frames(hostile_daemon, tiny_model):
    d = hostile_daemon()
    s = raw(d)
    assert isinstance(_reply(s), m.HelloReply)
    huge = {"t": "acquire", "model_id": 1, "layer": 0, "experts": [1] * (m.MAX_IDS + 1)}
    payload = msgspec.msgpack.encode(huge)
    s.sendall(HEADER.pack(len(payload)) + payload)
    r = _reply(s)
    assert isinstance(r, m.Error) and r.code == errors.ErrorCode.BAD_FRAME
    s.close()
    well_behaved(d, tiny_model)
    stops_in_grace(d)


def test_eight_flooders_leave_the_daemon_small(hostile_daemon, tiny_model):
    from moed.testing import proc_status_bytes

    d = hostile_daemon()
    well_behaved(d, tiny_model)
    base = proc_status_bytes(d.proc.pid, "VmRSS")
    socks = [raw(d) for _ in range(8)]
    for s in socks:
        flood(s, encode(m.GetStats()), 8 << 20)
    well_behaved(d, tiny_model)
    grown = proc_status_bytes(d.proc.pid, "VmRSS") - base
    assert grown < 64 << 20, f"RSS grew {grown >> 20} MiB with eight flooders"
    for s in socks:
        s.close()
    with d.client() as c:
        wait_for(lambda: c.stats()["connections"] == 1, 10, what="flooders gone")
    stops_in_grace(d)


# ---- silent connections ---------------------------------------------------------------


def test_silent_connections_are_closed_at_the_hello_deadline(hostile_daemon, tiny_model):
    d = hostile_daemon(max_clients=4, hello_timeout_s=0.5)
    silent = [raw(d, hello=False) for _ in range(4 + 8)]  # max_clients, and root's reserve too
    for s in silent:
        s.settimeout(10)
    # each is told why and closed: the server sends TIMED_OUT, then EOF
    for s in silent:
        r = _reply(s)
        assert isinstance(r, m.Error) and r.code == errors.ErrorCode.TIMED_OUT and "hello" in r.message
    well_behaved(d, tiny_model)
    with d.client() as c:
        assert c.stats()["timed_out_connections"] >= 12
    stops_in_grace(d)


def test_idle_limit_closes_quiet_connections_that_hold_nothing_and_spares_engines(hostile_daemon, tiny_model):
    d = hostile_daemon(idle_timeout_s=0.5)
    engine = d.client("engine", timeout_s=5)
    engine.open_model(tiny_model)  # maps a hold region: it may hit locally, never idle
    quiet = d.client("quiet", timeout_s=5)
    holder = d.client("holder", timeout_s=5)
    h = holder.open_model(tiny_model)
    lease = h.acquire(0, [1])
    with d.client() as c:
        wait_for(lambda: c.stats()["timed_out_connections"] >= 1, 10, what="the quiet one closed")
    with pytest.raises(errors.MoedError):
        quiet.ping()
    holder.ping()  # held a lease: not idle
    engine.ping()
    lease.release()
    well_behaved(d, tiny_model)
    stops_in_grace(d)


def test_one_tenant_cannot_take_every_connection(hostile_daemon, tiny_model):
    d = hostile_daemon(max_clients_per_tenant=3)
    held = [d.client(f"c{i}") for i in range(3)]
    with pytest.raises(errors.TooManyClients, match="max_clients_per_tenant"):
        d.client("fourth")
    held.pop().close()
    wait_for(lambda: _can_connect(d), 5, what="a freed per-tenant slot")
    for c in held:
        c.close()
    stops_in_grace(d)


@pytest.mark.skipif(not local.enabled(), reason="moed._holds not built or MOED_LOCAL_HITS=0")
def test_breaking_the_protocol_with_a_hold_region_leaves_nothing_behind(hostile_daemon, tiny_model):
    """A peer that holds a slot locally (or writes junk into its region) and then sends
    a broken frame has left: its region is dropped, not revoked, so looping on it piles
    up nothing (no revoked regions, no descriptors) in the daemon."""
    d = hostile_daemon()
    fds_before = len(os.listdir(f"/proc/{d.proc.pid}/fd"))
    kept = []
    for i in range(100):
        c = d.client("junk")
        h = c.open_model(tiny_model)  # maps the region
        with h.acquire(1, [2]):
            pass
        kept.append(h.acquire(1, [2]))  # a live local hold, never released before the break
        assert kept[-1].local and c._region is not None
        c._region.words[rz.HOLD_BASE + rz.HOLD_WORDS - 1 - i % 8] = 1  # and junk beside it
        assert c._sock is not None
        c._sock.sendall(HEADER.pack(0x7FFFFFFF))  # over the frame bound: the stream is broken
        c._sock.settimeout(5)
        while c._sock.recv(4096):  # the error reply, then the daemon's close
            pass
        c.close()
    with d.client() as op:
        wait_for(lambda: op.stats()["revoked_regions"] == 0, 5, what="no revoked regions")
    assert len(os.listdir(f"/proc/{d.proc.pid}/fd")) < fds_before + 20
    for lease in kept:
        lease.release()  # the connections are gone; letting go still works here
    well_behaved(d, tiny_model)
    stops_in_grace(d)


# ---- bad files at model paths -----------------------------------------------------------


@pytest.fixture
def odd_files(tmp_path):
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    sock_path = f"/tmp/moed-odd-{os.getpid()}.gguf"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    directory = tmp_path / "dir.gguf"
    directory.mkdir()
    yield {"FIFO": str(fifo), "socket": sock_path, "character device": "/dev/zero", "directory": str(directory)}
    listener.close()
    os.unlink(sock_path)


def test_odd_files_as_model_paths_are_refused_at_once(hostile_daemon, tiny_model, odd_files):
    d = hostile_daemon()
    with d.client(timeout_s=10) as c:
        for _ in range(3):  # more than max_opens_per_tenant: nothing stays tied up
            for kind, path in odd_files.items():
                t0 = time.monotonic()
                with pytest.raises(errors.BadModelFile, match=kind.split()[-1]):
                    c.open_model(path)
                assert time.monotonic() - t0 < 2
    well_behaved(d, tiny_model)
    stops_in_grace(d)


def test_moectl_index_of_a_fifo_fails_at_once(odd_files):
    out = subprocess.run(
        [sys.executable, "-m", "moed.ctl", "index", odd_files["FIFO"]], capture_output=True, text=True, timeout=20
    )
    assert out.returncode != 0 and "FIFO" in out.stderr


# ---- files changed under an open model ---------------------------------------------------


def test_overwrite_in_place_while_acquiring_never_mixes(hostile_daemon, model_factory, tmp_path):
    """Two versions of a model of one geometry: whatever the reader sees is entirely one of them."""
    import shutil

    v1 = model_factory(seed=1)
    v2 = model_factory(seed=2)
    path = tmp_path / "m.gguf"
    shutil.copy(v1, path)
    cat = Catalog.open(v1)
    d = hostile_daemon("64KiB")  # a few slots: reads keep happening
    stop = threading.Event()
    outcomes: list = []

    def reader() -> None:
        with d.client("reader", timeout_s=10) as c:
            h = c.open_model(path)
            while not stop.is_set():
                for layer in cat.moe_layers:
                    try:
                        with h.acquire(layer, [0, 3], timeout_s=5) as lease:
                            check_lease(cat, lease, layer, [0, 3])  # v1's bytes, exactly
                            outcomes.append("v1")
                    except errors.ModelStale:
                        outcomes.append("stale")
                        return

    t = threading.Thread(target=reader)
    t.start()
    wait_for(lambda: len(outcomes) >= 8, 10, what="reads of v1")
    with open(path, "r+b") as f:  # same inode, new content
        f.write(v2.read_bytes())
    t.join(20)
    stop.set()
    assert not t.is_alive() and outcomes[-1] == "stale" and set(outcomes) == {"v1", "stale"}
    with d.client() as c:  # reopened: v2's bytes
        h = c.open_model(path)
        with h.acquire(1, [2]) as lease:
            check_lease(Catalog.open(v2), lease, 1, [2])
    well_behaved(d, v1)
    stops_in_grace(d)


def test_rename_over_a_private_model_gets_new_segments(hostile_daemon, model_factory, tmp_path):
    import shutil

    a, b = model_factory(seed=3), model_factory(seed=4)
    path = tmp_path / "private.gguf"
    shutil.copy(a, path)
    os.chmod(path, 0o600)  # not world-readable: segments of its own
    d = hostile_daemon()
    with d.client() as c:
        h1 = c.open_model(path)
        with h1.acquire(0, [1]):
            pass
        tmp = tmp_path / "new.gguf"
        shutil.copy(b, tmp)
        os.chmod(tmp, 0o640)
        os.rename(tmp, path)  # same path, another file
        h2 = c.open_model(path)
        assert h2.model_id != h1.model_id
        assert {s.class_id for s in h1.info.segments}.isdisjoint({s.class_id for s in h2.info.segments})
        with h2.acquire(0, [1]) as lease:
            check_lease(Catalog.open(b), lease, 0, [1])
        with pytest.raises(errors.ModelStale):
            h1.acquire(0, [1])
    stops_in_grace(d)


# ---- careless operators: where the socket goes ------------------------------------------------


def _moed(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moed.daemon.main", "--ram-budget", "8MiB", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_socket_at_a_regular_file_is_refused_and_the_file_kept(tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("do not delete")
    out = _moed("--socket", str(precious))
    assert out.returncode == 2 and "not a socket" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert precious.read_text() == "do not delete"


def test_socket_at_a_directory_is_refused(tmp_path):
    out = _moed("--socket", str(tmp_path))
    assert out.returncode == 2 and "directory" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and tmp_path.is_dir()


def test_socket_path_too_long_is_one_line(tmp_path):
    out = _moed("--socket", "/tmp/" + "x" * 120)
    assert out.returncode == 2 and "at most 107" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "config, words",
    [
        ('socket_group = "no-such-group-here"\n', "no group"),
        ("reader_threads = 100000\n", "reader_threads"),
    ],
)
def test_bad_start_up_settings_are_one_line_and_leave_nothing(tmp_path, config, words):
    conf = tmp_path / "moed.toml"
    conf.write_text(config)
    sock = tmp_path / "s"
    out = _moed("--socket", str(sock), "--config", str(conf))
    assert out.returncode == 2 and words in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert not sock.exists()


def test_a_stale_socket_of_a_dead_daemon_is_replaced(tmp_path, tiny_model):
    d = DaemonProcess("8MiB")
    d.proc.kill()
    d.proc.wait()
    assert os.path.exists(d.socket)  # left behind by kill -9
    with DaemonProcess("8MiB", socket_dir=str(d.dir)) as again:
        well_behaved(again, tiny_model)


def test_sizes_larger_than_ram_are_warned_about(tmp_path):
    import psutil

    ram = psutil.virtual_memory().total
    with DaemonProcess(str(ram * 2), "--mem-floor", str(ram + 1)) as d:
        wait_for(lambda: "larger than this machine's RAM" in d.log(), 10, what="the warning")
        log = d.log()
        assert "ram budget" in log and "memory floor" in log
