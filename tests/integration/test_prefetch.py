"""Prefetch through the real daemon: it queues behind demand reads, a demand read
takes it over, a newer prefetch of the same layer drops the older queued ones,
a closed connection's queued prefetches go, and it never evicts a held slot.

One reader thread keeps most of a prefetch batch queued long enough for the
next request to find it unstarted; whether a given read had started is timing,
so the checks are on what must hold either way (every prefetched expert is
resident or counted wasted, never both, never lost).
"""

from __future__ import annotations

import pytest

from moed.gguf.catalog import Catalog
from moed.protocol import messages as m
from moed.testing import file_bytes, wait_for


def slot_bytes(model) -> int:
    cat = Catalog.open(model)
    return sum(-(-p.bytes_per_expert // 4096) * 4096 for p in cat.layers[0].parts.values())


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from moed.modelgen.makemodel import make_model

    return make_model(
        tmp_path_factory.mktemp("pf") / "m.gguf", layers=2, experts=16, used=2, embd=256, ff=256, align=4096
    )[0]


def settled(c) -> dict:
    return wait_for(lambda: (s := c.stats())["reads_in_flight"] == 0 and s, what="reads to finish")


def check(cat, lease, layer, experts):
    for e in experts:
        for part in cat.parts:
            path, off, n = cat.extent(layer, e, part)
            assert lease.view(e, part).tobytes() == file_bytes(path, off, n)


def test_prefetched_expert_is_a_prefetch_hit(start_daemon, model):
    d = start_daemon("16MiB")
    cat = Catalog.open(model)
    with d.client() as c:
        h = c.open_model(model)
        h.prefetch(0, [3, 5])
        settled(c)
        with h.acquire(0, [3, 5]) as lease:
            check(cat, lease, 0, [3, 5])
        s = c.stats()
    assert (s["hits"], s["misses"], s["prefetches"], s["prefetch_hits"]) == (2, 0, 2, 2)
    assert s["wasted_prefetches"] == 0


def test_demand_read_takes_over_a_queued_prefetch(start_daemon, model):
    d = start_daemon("16MiB", "--reader-threads", "1")
    cat = Catalog.open(model)
    with d.client() as c:
        h = c.open_model(model)
        h.prefetch(0, list(range(16)))
        with h.acquire(0, [15]) as lease:  # last in the prefetch queue: promoted
            check(cat, lease, 0, [15])
        s = settled(c)
    assert s["prefetch_hits"] == 1 and s["hits"] + s["misses"] == 1
    assert s["resident_experts"] + s["wasted_prefetches"] == 16


def test_newer_prefetch_of_a_layer_drops_the_older_queued_ones(start_daemon, model):
    d = start_daemon("16MiB", "--reader-threads", "1")
    with d.client() as c:
        h = c.open_model(model)
        h.prefetch(0, list(range(16)))
        queued = c.request(m.Prefetch(h.model_id, 0, [15], ack=True)).queued
        assert queued == 0  # still queued or resident: not read twice
        s = settled(c)
        # every expert of the first batch either landed or was dropped unread
        assert s["resident_experts"] + s["wasted_prefetches"] == 16
        assert s["wasted_prefetches"] >= 1
        assert s["used_bytes"] == s["resident_experts"] * slot_bytes(model)
        h.prefetch(1, [0])  # another layer supersedes nothing
        s2 = settled(c)
    assert s2["wasted_prefetches"] == s["wasted_prefetches"]
    assert s2["resident_experts"] == s["resident_experts"] + 1


def test_closed_connection_drops_its_queued_prefetches(start_daemon, model):
    d = start_daemon("16MiB", "--reader-threads", "1")
    with d.client("gone") as c:
        c.open_model(model).prefetch(0, list(range(16)))
    with d.client() as c:
        s = settled(c)
        assert s["resident_experts"] + s["wasted_prefetches"] == 16
        assert s["used_bytes"] == s["resident_experts"] * slot_bytes(model)


def test_prefetch_never_evicts_a_held_slot(start_daemon, model):
    d = start_daemon(str(4 * slot_bytes(model)))
    cat = Catalog.open(model)
    with d.client() as c:
        h = c.open_model(model)
        with h.acquire(0, [0, 1, 2, 3]) as lease:
            assert c.request(m.Prefetch(h.model_id, 0, [4, 5, 6, 7], ack=True)).queued == 0
            check(cat, lease, 0, [0, 1, 2, 3])
        assert c.request(m.Prefetch(h.model_id, 0, [4, 5], ack=True)).queued == 2
        s = settled(c)
    assert s["resident_experts"] == 4 and s["used_bytes"] <= s["budget_bytes"]


def test_demand_acquire_is_not_blocked_by_prefetches_filling_the_budget(start_daemon, model):
    d = start_daemon(str(4 * slot_bytes(model)), "--reader-threads", "1")
    cat = Catalog.open(model)
    with d.client() as c:
        h = c.open_model(model)
        h.prefetch(0, [0, 1, 2, 3])  # the whole budget, reads queued
        with h.acquire(1, [8, 9], timeout_s=10) as lease:
            check(cat, lease, 1, [8, 9])
        s = settled(c)
    assert s["used_bytes"] <= s["budget_bytes"]
    assert s["misses"] == 2 and s["hits"] == 0
