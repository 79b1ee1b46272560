"""The daemon survives hostile clients: fuzzed frames, floods, disconnects mid-acquire,
killed holders, files truncated or replaced under it."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moed.daemon.bounds import OPERATOR_RESERVE
from moed.gguf.catalog import Catalog
from moed.protocol import errors
from moed.protocol import messages as m
from moed.protocol.framing import encode
from moed.testing import DaemonProcess, proc_status_bytes, wait_for
from moed.testing.frames import RawConnection, frames
from tests.integration.test_daemon import check_lease, expert_bytes, worker


@pytest.fixture(scope="module")
def fuzz_daemon():
    d = DaemonProcess("8MiB")
    yield d
    d.close()


@pytest.fixture(scope="module")
def fuzz_conn(fuzz_daemon):
    c = RawConnection(fuzz_daemon.socket)
    yield c
    c.close()


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(batch=st.lists(frames, min_size=1, max_size=8))
def test_fuzzed_frames_never_hurt_the_daemon(fuzz_daemon, fuzz_conn, batch):
    replies = fuzz_conn.exchange(batch)
    assert all(isinstance(r, m.Message) for r in replies)
    assert fuzz_daemon.proc.poll() is None, fuzz_daemon.log()


def test_after_fuzzing_the_daemon_serves_and_logged_no_crash(fuzz_daemon, fuzz_conn, tiny_model):
    with fuzz_daemon.client() as c:
        c.request(m.SetMemFloor(0))  # a fuzzed frame may have been a valid control request
        h = c.open_model(tiny_model)
        with h.acquire(0, [1, 2], timeout_s=5) as lease:
            check_lease(Catalog.open(tiny_model), lease, 0, [1, 2])
        assert c.stats()["bad_frames"] > 0
    assert "Traceback" not in fuzz_daemon.log()


def test_peer_that_never_reads_its_replies_is_paused_not_buffered(daemon):
    pid = daemon.proc.pid
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(daemon.socket)
    s.sendall(encode(m.Hello(m.PROTOCOL_VERSION)))
    base = proc_status_bytes(pid, "VmRSS")
    burst = encode(m.GetStats()) * 2000
    s.settimeout(0.5)
    sent = 0
    try:
        for _ in range(200):  # 400,000 stats requests, none of the replies read
            s.sendall(burst)
            sent += 2000
    except (TimeoutError, BlockingIOError):
        pass  # the daemon stopped reading us: flow control
    grown = proc_status_bytes(pid, "VmRSS") - base
    assert sent < 400_000 or grown < 64 << 20
    assert grown < 64 << 20, f"daemon grew {grown >> 20} MiB buffering replies"
    with daemon.client() as c:  # others are served meanwhile
        c.ping()
    s.close()


def test_oversize_prefix_and_garbage_close_only_that_connection(daemon):
    for junk in (b"\xff\xff\xff\xff" + b"x" * 100, b"\x10\x00\x00\x01" + os.urandom(64)):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(daemon.socket)
        s.sendall(encode(m.Hello(m.PROTOCOL_VERSION)) + junk)
        s.close()
    with daemon.client() as c:
        c.ping()


def test_max_clients_refuses_extra_connections_with_a_typed_error(start_daemon, tmp_path):
    conf = tmp_path / "moed.toml"
    conf.write_text("max_clients = 3\n")
    d = start_daemon("8MiB", "--config", str(conf))
    # root is an operator: it may use the reserve kept for moectl on a full daemon
    reserve = OPERATOR_RESERVE if os.getuid() == 0 else 0
    held = [d.client(f"c{i}") for i in range(3 + reserve)]
    with pytest.raises(errors.TooManyClients):
        d.client("one too many")
    held.pop().close()
    wait_for(lambda: _can_connect(d), 5, what="a freed connection slot")
    for c in held:
        c.close()


def _can_connect(d) -> bool:
    try:
        d.client("again").close()
        return True
    except errors.TooManyClients:
        return False


# ---- clients that go away at the worst moment ----------------------------------------


def _leak_free(c, budget_slots: int, slot: int) -> bool:
    s = c.stats()
    return (
        s["evictable_bytes"] == s["used_bytes"]
        and s["reads_in_flight"] == 0
        and all(t["leases"] == 0 for t in s["tenants"] if "checker" not in t["names"])
    )


def test_disconnect_mid_read_and_mid_wait_leaks_nothing(start_daemon, model_factory):
    # 3.4 MiB experts read by one thread: an acquire of 4 misses takes milliseconds
    model = model_factory(layers=4, experts=16, used=4, embd=1024, ff=1024, random_experts=True)
    slot = expert_bytes(model, 0)
    d = start_daemon(str(8 * slot), "--reader-threads", "1")
    for round_ in range(30):  # mid-read: acquire misses, hang up at once
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(d.socket)
        s.sendall(
            encode(m.Hello(m.PROTOCOL_VERSION))
            + encode(m.OpenModel(str(model)))
            + encode(m.Acquire(1, 1 + round_ % 3, [(round_ + i) % 16 for i in range(4)]))
        )
        time.sleep(0.001 * (round_ % 4))  # vary where in the read the hang-up lands
        s.close()
    with d.client("checker") as c:
        h_model = c.open_model(model)
        wait_for(lambda: _leak_free(c, 8, slot), 5, what="every reference given back")
        holder = h_model.acquire(0, list(range(8)))  # the whole budget, held
        for _ in range(10):  # mid-wait: no room, hang up
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(d.socket)
            s.sendall(
                encode(m.Hello(m.PROTOCOL_VERSION))
                + encode(m.OpenModel(str(model)))
                + encode(m.Acquire(h_model.model_id, 2, [1, 2], 30.0))
            )
            time.sleep(0.01)
            s.close()
        holder.release()
        with h_model.acquire(3, list(range(8, 16)), timeout_s=5) as lease:  # all 8 slots free again
            check_lease(Catalog.open(model), lease, 3, list(range(8, 16)))
        wait_for(lambda: _leak_free(c, 8, slot), 5, what="every reference given back")
    assert d.stop() == 0


def test_killed_holders_free_their_pins_fast(start_daemon, tiny_model):
    slot = expert_bytes(tiny_model, 0)
    d = start_daemon(str(4 * slot))
    with d.client() as c:
        for round_ in range(5):
            holder = worker("hold", d.socket, tiny_model, round_ % 4, "0,1,2,3")
            assert holder.stdout.readline().startswith("held")
            assert c.stats()["evictable_bytes"] == 0
            holder.send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            holder.wait()
            wait_for(lambda: c.stats()["evictable_bytes"] == 4 * slot, 2, interval_s=0.002, what="pins reclaimed")
            assert time.monotonic() - t0 < 0.5


# ---- files changing under the daemon --------------------------------------------------


def test_truncation_under_concurrent_readers_and_replacement_makes_a_new_model(daemon, tiny_model, tmp_path):
    path = tmp_path / "m.gguf"
    shutil.copy(tiny_model, path)
    cat = Catalog.open(path)
    clients = [daemon.client(f"r{i}") for i in range(3)]
    handles = [c.open_model(path) for c in clients]  # opened before the truncation
    _, cut, _ = cat.extent(2, 0, "gate")
    os.truncate(path, cut)  # layers 2 and 3 are gone
    outcomes: list = []

    def reader(i: int) -> None:
        for layer in (2, 3, 0, 1):
            for e in range(i, 8, 3):
                try:
                    with handles[i].acquire(layer, [e], timeout_s=5) as lease:
                        check_lease(cat, lease, layer, [e])  # never wrong bytes
                        outcomes.append(("ok", layer))
                except errors.ModelStale:
                    outcomes.append(("ModelStale", layer))

    ts = [threading.Thread(target=reader, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    # A truncated file is a changed file: nothing of it is served, not even the
    # layers that are still inside it (that would mix versions).
    assert {o for o, _ in outcomes} == {"ModelStale"} and len(outcomes) == 4 * 8
    c = clients[0]
    assert c.stats()["stale_detected"] >= 1
    shutil.copy(tiny_model, path)  # a whole file again: a new identity
    h2 = c.open_model(path)
    assert h2.model_id != handles[0].model_id
    with h2.acquire(3, [7]) as lease:
        check_lease(Catalog.open(path), lease, 3, [7])
    with pytest.raises(errors.ModelStale):
        handles[1].acquire(0, [0])
    for cl in clients:
        cl.close()
