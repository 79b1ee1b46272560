"""The engine's lane (moed/_evalcb.c) on real shared words and a real memfd, without llama.cpp.

A layer's whole hit cycle in C: the topk ids read through the tensor's strides,
holds and the state check (moed/_hitproto.h, the protocol of moed._holds), the
previous lease released, touches and the hit counter left in the region, and
each expert's slot mapped at its addresses. Anything but a plain hit declines and
changes nothing.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
import pytest

from moed import _evalcb, libc
from moed.engines import ggml_tensor
from moed.protocol import residency_words as rz

N_EXPERTS, SLOTS, PAGE = 8, 4, mmap.PAGESIZE
LAYER, CLASS, COUNTER = 3, 5, rz.COUNTER_BASE + 1
HOLDS = list(range(rz.HOLD_BASE, rz.HOLD_BASE + 2 * N_EXPERTS))


def entry(gen: int, slot: int) -> int:
    return (gen << 24) | (slot + 1)


def ready(gen: int) -> int:
    return (gen << 2) | rz.READY


class Rig:
    """A hold region, a table, slot states, a segment memfd of 2 parts a slot, and PROT_NONE expert ranges."""

    def __init__(self):
        self.region = mmap.mmap(-1, rz.REGION_WORDS * 8)
        self.table = mmap.mmap(-1, N_EXPERTS * 8)
        self.states = mmap.mmap(-1, SLOTS * 8)
        self.r = np.frombuffer(self.region, dtype=np.uint64)
        self.t = np.frombuffer(self.table, dtype=np.uint64)
        self.s = np.frombuffer(self.states, dtype=np.uint64)
        self.fd = os.memfd_create("lane-test")
        os.ftruncate(self.fd, SLOTS * 2 * PAGE)
        for slot in range(SLOTS):  # slot s, part p: bytes of value 16*s + p + 1
            for part in range(2):
                os.pwrite(self.fd, bytes([16 * slot + part + 1]) * PAGE, (2 * slot + part) * PAGE)
        # Two parts' expert ranges, inaccessible until the lane maps a slot there (as the
        # streamer leaves llama.cpp's model mapping).
        self.addrs = [libc.mmap(N_EXPERTS * PAGE, libc.PROT_NONE, libc.MAP_PRIVATE | libc.MAP_ANONYMOUS) for _ in "ab"]
        self.ids = np.zeros((4, 2), dtype=np.int32)
        self.tensor = ggml_tensor.GgmlTensor()
        self.tensor.type = ggml_tensor.GGML_TYPE_I32
        self.tensor.name = f"ffn_moe_topk-{LAYER}".encode()
        self.tensor.data = self.ids.ctypes.data
        self.lane = _evalcb.lane_new(self.region, self.table, N_EXPERTS, HOLDS, COUNTER, ggml_tensor.LANE_LAYOUT)
        parts = [(self.addrs[p], PAGE, p * PAGE, 2 * PAGE) for p in range(2)]
        _evalcb.lane_layer(self.lane, LAYER, 0, CLASS, self.states, self.fd, parts)

    def route(self, *rows: list[int]) -> int:
        """Point the topk at these rows (tokens) of ids; its address, for lane_step."""
        k = len(rows[0])
        self.ids[: len(rows), :k] = rows
        t = self.tensor
        t.ne[0], t.ne[1], t.ne[2], t.ne[3] = k, len(rows), 1, 1
        t.nb[0], t.nb[1] = 4, self.ids.strides[0]  # a view: rows are nb[1] apart, not k * 4
        return ctypes.addressof(t)

    def resident(self, expert: int, slot: int, gen: int = 7) -> None:
        self.t[expert] = entry(gen, slot)
        self.s[slot] = ready(gen)

    def held(self) -> list[int]:
        return [int(w) for w in self.r[rz.HOLD_BASE : rz.HOLD_BASE + len(HOLDS)] if w]

    def shows(self, expert: int) -> list[bytes]:
        return [ctypes.string_at(self.addrs[p] + expert * PAGE, 8) for p in range(2)]

    def close(self) -> None:
        _evalcb.lane_free(self.lane)
        os.close(self.fd)
        for addr in self.addrs:
            libc.munmap(addr, N_EXPERTS * PAGE)


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.close()


def test_a_hit_holds_records_and_maps_the_slots(rig):
    rig.resident(1, slot=2)
    rig.resident(4, slot=0)
    tensor = rig.route([4, 1], [1, -1])  # two tokens; -1 ids are not experts
    assert _evalcb.lane_step(rig.lane, tensor) == 2
    assert sorted(rig.held()) == sorted([(CLASS << 48) | (0 << 24) | 7, (CLASS << 48) | (2 << 24) | 7])
    assert int(rig.r[rz.W_RING_HEAD]) == 2
    touches = {int(w) for w in rig.r[rz.RING_BASE : rz.RING_BASE + 2]}
    assert touches == {rz.touch(CLASS, 0), rz.touch(CLASS, 2)}
    assert int(rig.r[COUNTER]) == 2
    assert rig.shows(1) == [bytes([33]) * 8, bytes([34]) * 8]  # slot 2's two parts
    assert rig.shows(4) == [bytes([1]) * 8, bytes([2]) * 8]
    stats = _evalcb.lane_stats(rig.lane)
    assert (stats["layers"], stats["experts"], stats["maps"], stats["held"]) == (1, 2, 2, 2)


def test_the_next_layer_releases_the_previous_lease_and_maps_only_a_changed_slot(rig):
    rig.resident(1, slot=2)
    assert _evalcb.lane_step(rig.lane, rig.route([1])) == 1
    first = rig.held()
    rig.resident(1, slot=2)
    rig.resident(5, slot=3)
    assert _evalcb.lane_step(rig.lane, rig.route([1, 5])) == 2
    assert len(rig.held()) == 2 and _evalcb.lane_stats(rig.lane)["maps"] == 2  # expert 1 not mapped again
    assert set(first) <= set(rig.held())  # the same residency held again, in the other hold set
    assert _evalcb.lane_release(rig.lane) is True
    assert rig.held() == []


@pytest.mark.parametrize("how", ["not resident", "state moved", "region revoked", "disabled", "id too large"])
def test_anything_but_a_plain_hit_declines_and_changes_nothing(rig, how):
    rig.resident(1, slot=2)
    rig.resident(4, slot=0)
    ids = [1, 4]
    if how == "not resident":
        rig.t[4] = 0
    elif how == "state moved":
        rig.s[0] = ready(8)  # slot 0 refilled since the entry was written
    elif how == "region revoked":
        rig.r[rz.W_CLOSED] = 1
    elif how == "disabled":
        _evalcb.lane_disable(rig.lane)
    else:
        ids = [1, N_EXPERTS]
    # -4 (MISSED): the hit itself was tried and missed, so Python asks the daemon without
    # trying again; -1 (DECLINED): the lane did not try, and Python may.
    tried = how in ("not resident", "state moved", "region revoked")
    assert _evalcb.lane_step(rig.lane, rig.route(ids)) == (-4 if tried else -1)
    assert rig.held() == [] and int(rig.r[rz.W_RING_HEAD]) == 0 and int(rig.r[COUNTER]) == 0
    assert _evalcb.lane_stats(rig.lane)["maps"] == 0  # nothing mapped: still PROT_NONE


def test_a_declined_layer_keeps_the_previous_lease(rig):
    rig.resident(1, slot=2)
    assert _evalcb.lane_step(rig.lane, rig.route([1])) == 1
    held = rig.held()
    assert _evalcb.lane_step(rig.lane, rig.route([6])) == -4  # expert 6 is not resident: tried, missed
    assert rig.held() == held  # Python's path releases it (lane_release) before it asks


def test_a_refilled_slot_under_a_lease_is_reported_lost(rig):
    rig.resident(1, slot=2)
    assert _evalcb.lane_step(rig.lane, rig.route([1])) == 1
    rig.s[2] = ready(9)  # the daemon refilled it: only after a revoke whose grace ended
    rig.resident(5, slot=3)
    assert _evalcb.lane_step(rig.lane, rig.route([5])) == -2  # the new lease is held; the old was lost
    assert len(rig.held()) == 1
    rig.s[3] = ready(9)
    assert _evalcb.lane_release(rig.lane) is False
    assert rig.held() == []


def test_place_maps_once_per_slot_and_free_ends_the_lane(rig):
    assert _evalcb.lane_place(rig.lane, LAYER, 6, 1) is True
    assert _evalcb.lane_place(rig.lane, LAYER, 6, 1) is False
    assert rig.shows(6) == [bytes([17]) * 8, bytes([18]) * 8]
    assert _evalcb.lane_place(rig.lane, LAYER, 6, 1, True) is True  # populate maps it again
    with pytest.raises(ValueError, match="not the lane's"):
        _evalcb.lane_place(rig.lane, LAYER + 1, 6, 1)
    _evalcb.lane_free(rig.lane)
    with pytest.raises(ValueError, match="freed"):
        _evalcb.lane_step(rig.lane, rig.route([1]))
    _evalcb.lane_disable(rig.lane)  # flags on a freed lane are no-ops


def test_bad_lanes_are_refused():
    region, table = mmap.mmap(-1, rz.REGION_WORDS * 8), mmap.mmap(-1, 64)
    with pytest.raises(ValueError, match="even"):
        _evalcb.lane_new(region, table, 8, HOLDS[:3], -1, ggml_tensor.LANE_LAYOUT)
    with pytest.raises(ValueError, match="hold index"):
        _evalcb.lane_new(region, table, 8, [0, 1], -1, ggml_tensor.LANE_LAYOUT)  # the region's header words
    with pytest.raises(ValueError, match="hold region"):
        _evalcb.lane_new(mmap.mmap(-1, 4096), table, 8, HOLDS[:2], -1, ggml_tensor.LANE_LAYOUT)
    lane = _evalcb.lane_new(region, table, 8, HOLDS[:2], -1, ggml_tensor.LANE_LAYOUT)
    with pytest.raises(ValueError, match="page-aligned"):
        _evalcb.lane_layer(lane, 1, 0, 0, mmap.mmap(-1, 64), 0, [(4097, 4096, 0, 4096)])
    _evalcb.lane_free(lane)


def test_the_log_lists_the_layers_taken_for_the_cache_estimate(rig):
    rig.resident(1, slot=2)
    rig.resident(4, slot=0)
    assert _evalcb.lane_step(rig.lane, rig.route([1])) == 1  # not logging yet
    _evalcb.lane_log(rig.lane, True)
    assert _evalcb.lane_step(rig.lane, rig.route([4, 1])) == 2
    assert _evalcb.lane_step(rig.lane, rig.route([7])) == -4  # missed: Python's path tells the estimate
    assert _evalcb.lane_step(rig.lane, rig.route([4])) == 1
    assert _evalcb.lane_take_log(rig.lane) == ([(LAYER, [1, 4]), (LAYER, [4])], False)
    assert _evalcb.lane_take_log(rig.lane) == ([], False)
    _evalcb.lane_log(rig.lane, False)
    assert _evalcb.lane_step(rig.lane, rig.route([1])) == 1
    assert _evalcb.lane_take_log(rig.lane) == ([], False)
