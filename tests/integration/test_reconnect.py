"""A daemon killed under a client and started again on the same socket: the client comes back on its own.

What the client promises (moed/client/client.py's module docstring): the request in
flight when the daemon dies raises `DaemonUnavailable`; the next one reconnects within
`reconnect_s` (retrying from 50 ms, doubling to 1 s), re-opens the models and re-binds
their handles; nothing of the dead daemon's tier stays mapped once its leases are let
go, and none of its leases is released into the new daemon. A daemon that never comes
back gives a clear `DaemonUnavailable` after the bounded wait.
"""

from __future__ import annotations

import gc
import signal
import time

import pytest

from moed.client import local
from moed.gguf.catalog import Catalog
from moed.protocol import errors
from moed.testing import DaemonProcess, wait_for
from tests.integration.test_daemon import check_lease


def moed_inodes() -> set[int]:
    """Inodes of the daemon memfds (segments, slot states, tables, hold region) this process maps."""
    out = set()
    with open("/proc/self/maps") as f:
        for line in f:
            if "/memfd:moed-" in line:
                out.add(int(line.split()[4]))
    return out


def kill(d: DaemonProcess) -> None:
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()


def leases_on(d: DaemonProcess) -> int:
    with d.client("check") as c:
        return sum(t["leases"] for t in c.stats()["tenants"])


def test_a_killed_daemon_restarted_on_the_same_socket_serves_the_same_client_again(start_daemon, tiny_model):
    cat = Catalog.open(tiny_model)
    d = start_daemon("8MiB")
    c = d.client("survivor", timeout_s=5)
    m = c.open_model(tiny_model)
    old = m.acquire(0, [0, 1])  # held by the daemon that dies
    check_lease(cat, old, 0, [0, 1])
    kept = m.acquire(1, [2])
    before = moed_inodes()
    assert before and c.generation == 1
    kill(d)
    d2 = start_daemon("4MiB", socket_dir=str(d.dir))  # another budget: other capacities
    lease = m.acquire(0, [3])  # no user code: reconnected, the model re-opened and re-bound
    assert c.generation == 2
    check_lease(cat, lease, 0, [3])
    with pytest.raises(errors.LeaseLost, match="connection to moed that was lost"):
        old.view(0, "gate")
    assert leases_on(d2) == 1
    old.release()  # a lease of the dead daemon: nothing reaches the new one
    kept.release()
    assert leases_on(d2) == 1
    lease.release()
    wait_for(lambda: leases_on(d2) == 0, 5, what="the new lease released")
    del old, kept
    gc.collect()
    assert not moed_inodes() & before, "a mapping of the dead daemon's tier is still there"
    assert moed_inodes()  # the new daemon's
    c.close()


def test_an_idle_client_whose_daemon_restarted_gets_its_next_answer_with_no_error(start_daemon, tiny_model):
    """Killed with nothing in flight: the next request finds the connection gone before it
    leaves (nobody saw it), so it is sent to the daemon that came back."""
    cat = Catalog.open(tiny_model)
    d = start_daemon("8MiB")
    c = d.client("idle", timeout_s=5)
    m = c.open_model(tiny_model)
    with m.acquire(1, [0]):
        pass
    kill(d)
    start_daemon("8MiB", socket_dir=str(d.dir))
    assert c.ping() > 0
    with m.acquire(1, [4, 5]) as lease:
        check_lease(cat, lease, 1, [4, 5])
    assert c.generation == 2
    c.close()


@pytest.mark.skipif(not local.enabled(), reason="moed._holds not built or MOED_LOCAL_HITS=0")
def test_local_hits_come_back_on_the_new_daemons_tables(start_daemon, tiny_model):
    cat = Catalog.open(tiny_model)
    d = start_daemon("8MiB")
    c = d.client("local", timeout_s=5)
    m = c.open_model(tiny_model)
    with m.acquire(0, [2]):
        pass
    held = m.acquire(0, [2])
    assert held.local  # held in the dead daemon's hold region
    kill(d)
    d2 = start_daemon("8MiB", socket_dir=str(d.dir))
    with m.acquire(0, [2, 6]) as first:  # a round trip (read in again by the new daemon)
        assert not first.local

    def local_holds() -> list[int]:
        with d2.client("check") as op:
            return [r["local_holds"] for r in op.stats()["clients"] if r["name"] == "local"]

    with m.acquire(0, [6, 2]) as hit:
        assert hit.local
        check_lease(cat, hit, 0, [2, 6])
        assert local_holds() == [2]
        held.release()  # its holds are cleared in the old region, never in the new one
        assert local_holds() == [2]
        check_lease(cat, hit, 0, [2, 6])
    assert local_holds() == [0]
    c.close()


def test_a_daemon_that_never_comes_back_is_a_bounded_clear_error(start_daemon, tiny_model):
    d = start_daemon("8MiB")
    c = d.client("waiting", timeout_s=5, reconnect_s=0.5)
    m = c.open_model(tiny_model)
    kill(d)
    t0 = time.monotonic()
    with pytest.raises(errors.DaemonUnavailable, match=r"did not answer for 0\.5 s"):
        m.acquire(0, [1])  # found gone before it left: reconnect tries for 0.5 s
    with pytest.raises(errors.DaemonUnavailable, match=r"did not answer for 0\.5 s"):
        c.stats()
    assert time.monotonic() - t0 < 5
    c.close()
    with pytest.raises(errors.DaemonUnavailable, match="this Client was closed"):
        c.ping()


def test_reconnect_s_0_turns_it_off(start_daemon, tiny_model):
    d = start_daemon("8MiB")
    c = d.client("off", timeout_s=5, reconnect_s=0)
    m = c.open_model(tiny_model)
    kill(d)
    start_daemon("8MiB", socket_dir=str(d.dir))
    with pytest.raises(errors.DaemonUnavailable):
        m.acquire(0, [1])
    with pytest.raises(errors.DaemonUnavailable, match=r"reconnect_s=0: Client\.reconnect\(\) connects again"):
        c.ping()
    c.reconnect()  # what the message names: it exists, and re-binds the model
    with m.acquire(0, [1]):
        pass
    c.close()


def test_threads_sharing_a_client_all_come_back_on_one_reconnect(start_daemon, tiny_model):
    """Four threads find the connection gone at once: one reconnects, the others wait for it
    and ask again with the new ids (a request built with the old ones is sent once more)."""
    from concurrent.futures import ThreadPoolExecutor

    cat = Catalog.open(tiny_model)
    d = start_daemon("8MiB")
    c = d.client("shared", timeout_s=5)
    m = c.open_model(tiny_model)
    kill(d)
    start_daemon("8MiB", socket_dir=str(d.dir))

    def grab(expert: int) -> bool:
        with m.acquire(expert % 2, [expert]) as lease:
            check_lease(cat, lease, expert % 2, [expert])
        return True

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(grab, range(4)))
    assert c.generation == 2
    c.close()
