"""Hits without a round trip, against the real daemon: local leases, their holds, hostile regions."""

from __future__ import annotations

import os
import random
import signal
import time

import numpy as np
import pytest

from moed.client import local
from moed.gguf.catalog import Catalog
from moed.protocol import errors
from moed.protocol import residency_words as rz
from moed.testing import wait_for
from tests.integration.test_daemon import check_lease, expert_bytes, worker

pytestmark = pytest.mark.skipif(not local.enabled(), reason="moed._holds not built or MOED_LOCAL_HITS=0")


def test_a_resident_acquire_is_local_and_counted(daemon, tiny_model):
    cat = Catalog.open(tiny_model)
    with daemon.client() as c:
        h = c.open_model(tiny_model)
        with h.acquire(1, [2, 5]) as first:
            assert not first.local  # read in: the daemon granted it
        before = c.stats()
        with h.acquire(1, [5, 2, 5]) as lease:  # duplicates are one hold each expert
            assert lease.local and lease.lease_id == 0
            check_lease(cat, lease, 1, [2, 5])
            assert [r["local_holds"] for r in c.stats()["clients"]] == [2]
        s = c.stats()
        assert s["local_hits"] - before["local_hits"] == 2
        assert s["hits"] - before["hits"] == 2 and s["misses"] == before["misses"]
        assert [r["local_holds"] for r in s["clients"]] == [0]  # released with no round trip


def test_a_locally_held_slot_is_never_evicted_and_its_killed_holder_frees_it(start_daemon, model_factory):
    model = model_factory(layers=2, experts=8, used=2)
    cat = Catalog.open(model)
    slot = expert_bytes(model, 0)
    d = start_daemon(str(5 * slot))  # room for five: two held stay under the tenant's share
    holder = worker("hold-local", d.socket, model, 0, "0,1")
    try:
        line = holder.stdout.readline()
        assert "local=True" in line, line
        with d.client() as c:
            h = c.open_model(model)
            # the two held slots cannot be evicted: three more fit, a fourth pair never does
            with h.acquire(1, [3, 6, 7], timeout_s=5) as lease:
                check_lease(cat, lease, 1, [3, 6, 7])
            with pytest.raises(errors.BudgetExhausted):
                h.acquire(1, [2, 3, 4, 5], timeout_s=0.5)
            s = c.stats()
            assert s["adopted_slots"] == 2 and s["local_claims_refused"] >= 2
            holder.send_signal(signal.SIGKILL)
            holder.wait()
            t0 = time.monotonic()
            wait_for(lambda: c.stats()["adopted_slots"] == 0, 5, what="the killed holder's slots freed")
            assert time.monotonic() - t0 < 1.0
            with h.acquire(1, [2, 3, 4, 5], timeout_s=5) as lease:
                check_lease(cat, lease, 1, [2, 3, 4, 5])
    finally:
        holder.kill()
        holder.wait()


def test_two_processes_churn_with_local_hits_every_byte_matches(start_daemon, model_factory):
    model = model_factory(layers=4, experts=8, used=2)
    slot = expert_bytes(model, 0)
    d = start_daemon(str(10 * slot))  # 10 of 32 experts: hits and evictions both
    procs = [worker("random", d.socket, model, 400, seed) for seed in (3, 4)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    with d.client() as c:
        s = c.stats()
    assert s["local_hits"] > 50 and s["misses"] > 50 and s["evictions"] > 20
    assert d.stop() == 0


def test_a_hostile_region_hurts_nobody(daemon, tiny_model):
    """Random words in a client's own region: holds of slots it never had, a wild
    ring head, huge counters. The daemon keeps serving others exact bytes."""
    cat = Catalog.open(tiny_model)
    rng = random.Random(5)
    with daemon.client("hostile") as bad, daemon.client("good") as good:
        bh = bad.open_model(tiny_model)
        gh = good.open_model(tiny_model)
        words = bad._region.words
        for _ in range(20):
            words[:] = np.array([rng.getrandbits(64) for _ in range(rz.REGION_WORDS)], dtype=np.uint64)
            words[rz.W_RING_HEAD] = rng.choice([0, 2**63, rng.getrandbits(64)])
            for layer in cat.moe_layers:
                experts = rng.sample(range(cat.n_experts), 2)
                with gh.acquire(layer, experts, timeout_s=5) as lease:
                    check_lease(cat, lease, layer, experts)
            good.ping()
            s = good.stats()  # folds the hostile counters: clamped
            assert s["hits"] < 10**12
        with pytest.raises(errors.MoedError):
            bh.acquire(0, [cat.n_experts])  # bad input still gets a typed error
    assert daemon.proc.poll() is None


def test_local_hits_off_by_environment(start_daemon, tiny_model, monkeypatch):
    monkeypatch.setenv("MOED_LOCAL_HITS", "0")
    d = start_daemon()
    with d.client() as c:
        h = c.open_model(tiny_model)
        for _ in range(2):
            with h.acquire(0, [1]) as lease:
                assert not lease.local
        assert c.stats()["local_hits"] == 0 and os.environ["MOED_LOCAL_HITS"] == "0"


def _acquire_as_other_tenant(sock: str, model: str) -> bool:
    from moed.client import Client

    with Client(sock, "other") as c:
        o = c.open_model(model)
        with o.acquire(1, [0, 1, 2, 3], timeout_s=10) as lease:
            check_lease(Catalog.open(model), lease, 1, [0, 1, 2, 3])
    return True


def test_a_tenant_holding_over_its_share_locally_is_cut_off(start_shared, shared_dir, model_factory):
    """Local holds are bounded like everything else a tenant can make the daemon keep:
    past LOCAL_HOLD_SHARE of the budget, while another tenant waits for room, its
    connections are closed. Their regions are revoked, not dropped: the lease the
    cut-off engine still reads keeps its bytes, its next hit is refused, and the other
    tenant gets its room once the lease is released."""
    import shutil
    import threading

    from moed.daemon.bounds import LOCAL_HOLD_SHARE
    from tests.integration.peer import NOBODY, Outcome, as_peer

    model = os.path.join(shared_dir, "m.gguf")
    shutil.copy(model_factory(layers=2, experts=8, used=2), model)
    os.chmod(model, 0o644)
    cat = Catalog.open(model)
    slot = expert_bytes(model, 0)
    d = start_shared(str(8 * slot))
    greedy = d.client("greedy", reconnect_s=0)  # the cut-off connection stays cut off (no reconnect)
    g = greedy.open_model(model)
    mine = list(range(6))  # 6 of 8 slots > LOCAL_HOLD_SHARE
    assert 6 / 8 > LOCAL_HOLD_SHARE
    with g.acquire(0, mine):
        pass
    kept = g.acquire(0, mine)  # held locally while the other tenant waits
    assert kept.local
    outcome: list = []
    other = threading.Thread(
        target=lambda: outcome.append(as_peer(NOBODY, NOBODY, _acquire_as_other_tenant, d.socket, model))
    )
    other.start()
    try:
        wait_for(lambda: "over its share" in d.log(), 10, what="the warning")
        with d.client() as op:
            s = op.stats()
        assert s["revoked_regions"] == 1 and s["adopted_slots"] == 6  # still counted: nothing refilled
        check_lease(cat, kept, 0, mine)
        with pytest.raises(errors.DaemonUnavailable):  # a would-be local hit is refused: the socket says why
            g.acquire(0, mine[:2])
        kept.release()  # clears the holds with no round trip: the region can go
        other.join(20)
        assert outcome == [Outcome(result=True)]
        with d.client() as op:
            assert op.stats()["revoked_regions"] == 0
    finally:
        other.join(30)
    with pytest.raises(errors.DaemonUnavailable):
        greedy.ping()


def test_resident_reads_the_table_with_no_round_trip(start_daemon, model_factory):
    model = model_factory(layers=2, experts=8, used=2)
    slot = expert_bytes(model, 0)
    d = start_daemon(str(3 * slot))
    with d.client() as c:
        h = c.open_model(model)
        assert not h.resident(0, range(8)).any()
        with h.acquire(0, [1, 4]):
            pass
        assert h.resident(0, range(8)).tolist() == [i in (1, 4) for i in range(8)]
        with h.acquire(1, [0, 2]):  # evicts one of layer 0's
            pass
        assert h.resident(0, [1, 4]).sum() == 1 and h.resident(1, [0, 2]).all()
        with pytest.raises(errors.UnknownExpert):
            h.resident(0, [8])


def test_asking_for_a_second_hold_region_is_a_typed_error(daemon, tiny_model):
    from moed.protocol import messages as m

    with daemon.client() as c:
        c.open_model(tiny_model)  # maps the region
        with pytest.raises(errors.BadRequest, match="once"):
            c.request(m.MapHolds(), fds=True)
        c.ping()
    assert "Traceback" not in daemon.log()
