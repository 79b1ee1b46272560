"""The layer holds (moed/_evalcb.c) on real shared words and a real memfd, without llama.cpp.

The one owner of what a model's routed layers hold, driven through the C eval
callback itself (called through ctypes with a fake top-k node, as ggml's scheduler
calls it): a lane layer's hit taken in C (the ids read through the node's strides,
holds and the state check of moed/_hitproto.h, the earlier hit grant released, touches
and the hit counter left in the region, each expert's slot mapped at its
addresses), done alone or told to Python; a miss handed to Python once, with the
grant to let go, and Python's grant handed back in one call; a whole step on the
region's pin hold; the release after a decode. Anything but a plain hit changes
nothing.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
import pytest

from moed import _evalcb, libc
from moed.engines import ggml_tensor, holds
from moed.protocol import residency_words as rz

N_EXPERTS, SLOTS, PAGE = 8, 4, mmap.PAGESIZE
LAYER, CLASS, COUNTER, MODEL = 3, 5, rz.COUNTER_BASE + 1, 7
HOLDS = list(range(rz.HOLD_BASE, rz.HOLD_BASE + 2 * N_EXPERTS))
PIN_WORD = N_EXPERTS  # the table word after the entries
CALLBACK = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)


def entry(gen: int, slot: int) -> int:
    return (gen << 24) | (slot + 1)


def ready(gen: int) -> int:
    return (gen << 2) | rz.READY


class Grant:
    """What Python's acquire hands the holds (any object: they only keep it)."""

    def __init__(self, experts: list[int], slots: list[int]):
        self.layer, self.experts, self.slots = LAYER, experts, slots


class Rig:
    """A hold region, a table, slot states, a segment memfd of 2 parts a slot, PROT_NONE expert
    ranges, and an eval-callback handle whose routed stops go to the holds."""

    def __init__(self, region: bool = True):
        self.region = mmap.mmap(-1, rz.REGION_WORDS * 8)
        self.table = mmap.mmap(-1, (N_EXPERTS + 1) * 8)
        self.states = mmap.mmap(-1, SLOTS * 8)
        self.r = np.frombuffer(self.region, dtype=np.uint64)
        self.t = np.frombuffer(self.table, dtype=np.uint64)
        self.s = np.frombuffer(self.states, dtype=np.uint64)
        self.fd = os.memfd_create("holds-test")
        os.ftruncate(self.fd, SLOTS * 2 * PAGE)
        for slot in range(SLOTS):  # slot s, part p: bytes of value 16*s + p + 1
            for part in range(2):
                os.pwrite(self.fd, bytes([16 * slot + part + 1]) * PAGE, (2 * slot + part) * PAGE)
        # Two parts' expert ranges, inaccessible until the holds map a slot there (as the
        # streamer leaves llama.cpp's model mapping).
        self.addrs = [libc.mmap(N_EXPERTS * PAGE, libc.PROT_NONE, libc.MAP_PRIVATE | libc.MAP_ANONYMOUS) for _ in "ab"]
        self.ids = np.zeros((4, 2), dtype=np.int32)
        self.tensor = ggml_tensor.GgmlTensor()
        self.tensor.type = ggml_tensor.GGML_TYPE_I32
        self.tensor.name = f"ffn_moe_topk-{LAYER}".encode()
        self.tensor.data = self.ids.ctypes.data
        # Python's half of a stop: what it was told, and what it does (`act`, per call).
        self.calls: list[tuple[int, int, object, list[int]]] = []
        self.act = lambda layer, status, grant: None
        self.norms: list[int] = []
        words = (self.region, self.table) if region else (None, None)
        self.h = _evalcb.holds_new(
            self._route, *words, N_EXPERTS, HOLDS if region else [], COUNTER, ggml_tensor.LANE_LAYOUT
        )
        parts = [(self.addrs[p], PAGE, p * PAGE, 2 * PAGE) for p in range(2)]
        _evalcb.holds_layer(self.h, LAYER, 0, CLASS, self.states if region else None, self.fd, parts)
        self.cfg = _evalcb.make(self._norm, ggml_tensor.NAME_OFFSET)
        _evalcb.set_holds(self.cfg, self.h)
        self.cb = CALLBACK(_evalcb.callback_address())
        self.ud = _evalcb.user_data(self.cfg)

    def _route(self, tensor: int, layer: int, status: int, grant) -> bool:
        assert tensor == ctypes.addressof(self.tensor)
        self.calls.append((layer, status, grant, self.held()))  # what the region held during the call
        self.act(layer, status, grant)
        return True

    def _norm(self, tensor: int) -> bool:
        self.norms.append(tensor)
        return True

    def route(self, *rows: list[int]) -> int:
        """Point the topk at these rows (tokens) of ids; its address."""
        k = len(rows[0])
        self.ids[: len(rows), :k] = rows
        t = self.tensor
        t.ne[0], t.ne[1], t.ne[2], t.ne[3] = k, len(rows), 1, 1
        t.nb[0], t.nb[1] = 4, self.ids.strides[0]  # a view: rows are nb[1] apart, not k * 4
        return ctypes.addressof(t)

    def stop(self, *rows: list[int]) -> bool:
        """The routed stop as ggml's scheduler makes it: the ask pass, then the computed node."""
        tensor = self.route(*rows)
        if not self.cb(tensor, True, self.ud):
            return False  # not wanted (a whole step): no stop at all
        return self.cb(tensor, False, self.ud)

    def resident(self, expert: int, slot: int, gen: int = 7) -> None:
        self.t[expert] = entry(gen, slot)
        self.s[slot] = ready(gen)

    def held(self) -> list[int]:
        return [int(w) for w in self.r[rz.HOLD_BASE : rz.HOLD_BASE + len(HOLDS)] if w]

    def shows(self, expert: int) -> list[bytes]:
        return [ctypes.string_at(self.addrs[p] + expert * PAGE, 8) for p in range(2)]

    def crossings(self, outcome: str) -> tuple[int, int, int, int]:
        return _evalcb.holds_crossings(self.h)[outcome]

    def hand(self, grant: Grant) -> None:
        """Python's one call back: the grant held, its slots mapped on the lane layer."""
        _evalcb.holds_hold(self.h, grant, LAYER, grant.experts, grant.slots)

    def close(self) -> None:
        _evalcb.set_holds(self.cfg, None)
        _evalcb.holds_free(self.h)
        os.close(self.fd)
        for addr in self.addrs:
            libc.munmap(addr, N_EXPERTS * PAGE)


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.close()


def hold_word(slot: int, gen: int = 7) -> int:
    return (CLASS << 48) | (slot << 24) | gen


def test_the_status_constants_are_the_extensions():
    assert (holds.NOT_TRIED, holds.LOST, holds.MAP_FAILED, holds.MISSED) == (
        _evalcb.NOT_TRIED,
        _evalcb.LOST,
        _evalcb.MAP_FAILED,
        _evalcb.MISSED,
    )


def test_a_hit_with_nothing_for_python_is_the_whole_layer_in_c(rig):
    rig.resident(1, slot=2)
    rig.resident(4, slot=0)
    _evalcb.holds_begin(rig.h, True, True, True)
    assert rig.stop([4, 1], [1, -1])  # two tokens; -1 ids are not experts
    assert rig.calls == []  # Python never ran
    assert sorted(rig.held()) == sorted([hold_word(0), hold_word(2)])
    assert int(rig.r[rz.W_RING_HEAD]) == 2
    assert {int(w) for w in rig.r[rz.RING_BASE : rz.RING_BASE + 2]} == {rz.touch(CLASS, 0), rz.touch(CLASS, 2)}
    assert int(rig.r[COUNTER]) == 2
    assert rig.shows(1) == [bytes([33]) * 8, bytes([34]) * 8]  # slot 2's two parts
    assert rig.shows(4) == [bytes([1]) * 8, bytes([2]) * 8]
    stats = _evalcb.holds_stats(rig.h)
    assert (stats["layers"], stats["experts"], stats["maps"]) == (1, 2, 2)
    assert _evalcb.holds_held(rig.h) == ("hit", 2)
    assert rig.crossings("alone") == (1, 0, 0, 0)
    assert _evalcb.holds_take_log(rig.h) == ([(LAYER, [1, 4])], False)
    assert _evalcb.holds_end(rig.h) == (None, True)  # after the decode: the hit grant let go
    assert rig.held() == [] and _evalcb.holds_held(rig.h) is None


def test_the_next_layer_releases_the_earlier_hit_grant_and_maps_only_a_changed_slot(rig):
    rig.resident(1, slot=2)
    _evalcb.holds_begin(rig.h, True, True, False)
    assert rig.stop([1])
    first = rig.held()
    rig.resident(5, slot=3)
    assert rig.stop([1, 5])
    assert len(rig.held()) == 2 and _evalcb.holds_stats(rig.h)["maps"] == 2  # expert 1 not mapped again
    assert set(first) <= set(rig.held())  # the same residency held again, in the other hold set
    assert _evalcb.holds_take_log(rig.h) == ([], False)  # not logging
    assert _evalcb.holds_end(rig.h) == (None, True) and rig.held() == []


def test_a_hit_python_must_see_is_told_once_and_needs_no_call_back(rig):
    rig.resident(1, slot=2)
    _evalcb.holds_begin(rig.h, True, False, True)  # e.g. the look-ahead predicts this step
    assert rig.stop([1])
    assert rig.calls == [(LAYER, 1, None, [hold_word(2)])]  # held before Python heard of it
    assert rig.crossings("hit") == (1, 1, 0, 0)
    assert _evalcb.holds_take_log(rig.h) == ([], False)  # Python scored it itself


def test_a_miss_is_one_call_into_python_and_one_back(rig):
    """The hit grant of the layer before is let go before Python asks the daemon; Python hands
    its grant back in one call, which maps it; the next stop hands it to Python to let go."""
    rig.resident(1, slot=2)
    _evalcb.holds_begin(rig.h, True, True, False)
    assert rig.stop([1])  # a hit: the holds' hit grant
    granted = Grant([6], [1])
    rig.act = lambda layer, status, grant: rig.hand(granted) if status == holds.MISSED else None
    assert rig.stop([6])  # expert 6 is not resident
    assert rig.calls == [(LAYER, holds.MISSED, None, [])]  # the earlier hit grant released first
    assert _evalcb.holds_held(rig.h) == ("grant", granted)
    assert rig.shows(6) == [bytes([17]) * 8, bytes([18]) * 8]  # slot 1, mapped by the hand-back
    assert rig.crossings("missed") == (1, 1, 1, 1)
    assert _evalcb.holds_stats(rig.h)["misses"] == 1
    # A miss after a grant: the grant goes to Python (piggybacked on its acquire), and the
    # new one comes back.
    second = Grant([7], [3])
    rig.act = lambda layer, status, grant: rig.hand(second)
    assert rig.stop([7])
    assert rig.calls[-1] == (LAYER, holds.MISSED, granted, [])
    assert _evalcb.holds_held(rig.h) == ("grant", second)
    assert rig.crossings("missed") == (2, 2, 2, 1)  # each missed layer: one call each way
    # The next layer's hit: the holds take it, and Python is told, with the grant to let go.
    rig.act = lambda layer, status, grant: None
    rig.resident(4, slot=0)
    assert rig.stop([4])
    assert rig.calls[-1] == (LAYER, 1, second, [hold_word(0)])
    assert _evalcb.holds_held(rig.h) == ("hit", 1)
    assert rig.crossings("hit") == (1, 1, 0, 0)


def test_with_the_ids_not_final_nothing_is_tried_and_the_grant_comes_back_after_the_decode(rig):
    rig.resident(1, slot=2)
    _evalcb.holds_begin(rig.h, False, True, False)  # a route hook or substitution this decode
    granted = Grant([1], [2])
    rig.act = lambda layer, status, grant: rig.hand(granted)
    assert rig.stop([1])
    assert rig.calls == [(LAYER, holds.NOT_TRIED, None, [])]
    assert int(rig.r[rz.W_RING_HEAD]) == 0 and _evalcb.holds_stats(rig.h)["misses"] == 0  # no hp_hit
    assert rig.shows(1) == [bytes([33]) * 8, bytes([34]) * 8]
    assert rig.crossings("not_tried") == (1, 1, 1, 1)
    assert _evalcb.holds_end(rig.h) == (granted, True)  # Python lets it go
    assert _evalcb.holds_held(rig.h) is None


@pytest.mark.parametrize("how", ["not resident", "state moved", "region revoked", "disabled", "id too large"])
def test_anything_but_a_plain_hit_changes_nothing(rig, how):
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
        _evalcb.holds_disable(rig.h)
    else:
        ids = [1, N_EXPERTS]
    _evalcb.holds_begin(rig.h, True, True, False)
    assert rig.stop(ids)
    # MISSED: the hit itself was tried and missed, so Python asks the daemon without trying
    # again; NOT_TRIED: the holds did not try, and Python's acquire may.
    tried = how in ("not resident", "state moved", "region revoked")
    assert [c[1] for c in rig.calls] == [holds.MISSED if tried else holds.NOT_TRIED]
    assert rig.held() == [] and int(rig.r[rz.W_RING_HEAD]) == 0 and int(rig.r[COUNTER]) == 0
    assert _evalcb.holds_stats(rig.h)["maps"] == 0  # nothing mapped: still PROT_NONE


def test_a_refilled_slot_under_a_hit_grant_is_reported_lost(rig):
    rig.resident(1, slot=2)
    _evalcb.holds_begin(rig.h, True, True, False)
    assert rig.stop([1])
    rig.s[2] = ready(9)  # the daemon refilled it: only after a revoke whose grace ended
    rig.resident(5, slot=3)
    assert rig.stop([5])
    assert rig.calls[-1][1] == holds.LOST  # the new hit grant is held; the old was lost
    assert len(rig.held()) == 1
    rig.s[3] = ready(9)
    assert _evalcb.holds_end(rig.h) == (None, False)
    assert rig.held() == []


def test_after_a_failure_nothing_is_tried_or_handed_over_until_the_end(rig):
    rig.resident(1, slot=2)
    _evalcb.holds_begin(rig.h, False, False, False)
    granted = Grant([1], [2])
    rig.act = lambda layer, status, grant: rig.hand(granted)
    assert rig.stop([1])
    rig.act = lambda layer, status, grant: None
    _evalcb.holds_fail(rig.h)
    assert rig.stop([1])
    assert rig.calls[-1] == (LAYER, holds.NOT_TRIED, None, [])  # the grant stays with the holds
    assert _evalcb.holds_end(rig.h) == (granted, True)


def test_a_whole_step_holds_the_pin_hold_and_makes_no_stop(rig):
    for e in range(N_EXPERTS):
        rig.resident(e, slot=e % SLOTS)
    _evalcb.holds_pins(rig.h, MODEL, PIN_WORD)
    assert _evalcb.holds_whole_begin(rig.h) is False  # the pin word says not every expert is pinned
    assert int(rig.r[rz.W_PIN_HOLD]) == 0
    rig.t[PIN_WORD] = 1
    _evalcb.holds_begin(rig.h, False, False, False)
    granted = Grant([1], [1])
    rig.hand(granted)  # a grant held (outside a stop, as a test may): no whole step over it
    assert _evalcb.holds_whole_begin(rig.h) is False
    assert _evalcb.holds_end(rig.h) == (granted, True)
    assert _evalcb.holds_whole_begin(rig.h) is True
    assert int(rig.r[rz.W_PIN_HOLD]) == MODEL + 1 and _evalcb.holds_held(rig.h) == ("pin", MODEL)
    assert rig.shows(5) == [bytes([17]) * 8, bytes([18]) * 8]  # every expert mapped at its slot
    assert rig.stop([5]) is False and rig.calls == []  # the ask pass wants no node
    assert rig.held() == []  # no per-layer hold
    _evalcb.holds_whole_end(rig.h, 12)
    assert int(rig.r[rz.W_PIN_HOLD]) == 0 and int(rig.r[COUNTER]) == 12
    assert _evalcb.holds_held(rig.h) is None and _evalcb.holds_stats(rig.h)["whole_decodes"] == 1
    assert rig.stop([5]) is True  # stops again


def test_the_norm_stop_goes_to_the_node_function(rig):
    _evalcb.set_router_input(rig.cfg, True)
    rig.tensor.name = b"ffn_norm-3"
    assert rig.stop([1]) and rig.norms == [ctypes.addressof(rig.tensor)] and rig.calls == []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_exception_in_python_stops_the_graph(rig):
    def boom(layer, status, grant):
        raise RuntimeError("a bug")

    rig.act = boom
    _evalcb.holds_begin(rig.h, False, False, False)
    assert rig.stop([1]) is False


def test_without_a_region_every_stop_is_pythons_and_the_hand_back_maps():
    rig = Rig(region=False)
    try:
        rig.resident(1, slot=2)
        _evalcb.holds_begin(rig.h, True, True, False)
        granted = Grant([1], [2])
        rig.act = lambda layer, status, grant: rig.hand(granted)
        assert rig.stop([1])
        assert rig.calls == [(LAYER, holds.NOT_TRIED, None, [])]
        assert rig.shows(1) == [bytes([33]) * 8, bytes([34]) * 8]
        assert _evalcb.holds_whole_begin(rig.h) is False
        assert _evalcb.holds_end(rig.h) == (granted, True)
    finally:
        rig.close()


def test_hold_takes_one_grant_at_a_time(rig):
    a = Grant([1], [2])
    _evalcb.holds_hold(rig.h, a)
    with pytest.raises(ValueError, match="already"):
        _evalcb.holds_hold(rig.h, Grant([2], [3]))
    assert _evalcb.holds_end(rig.h) == (a, True)
    with pytest.raises(ValueError, match="not a lane layer"):
        _evalcb.holds_hold(rig.h, a, LAYER + 1, [1], [2])
    assert _evalcb.holds_held(rig.h) is None


def test_place_maps_once_per_slot_and_free_ends_the_holds(rig):
    assert _evalcb.holds_place(rig.h, LAYER, 6, 1) is True
    assert _evalcb.holds_place(rig.h, LAYER, 6, 1) is False
    assert rig.shows(6) == [bytes([17]) * 8, bytes([18]) * 8]
    assert _evalcb.holds_place(rig.h, LAYER, 6, 1, True) is True  # populate maps it again
    with pytest.raises(ValueError, match="not a lane layer"):
        _evalcb.holds_place(rig.h, LAYER + 1, 6, 1)
    granted = Grant([1], [2])
    _evalcb.holds_hold(rig.h, granted)
    assert _evalcb.holds_free(rig.h) is granted  # given back, for Python to let go
    with pytest.raises(ValueError, match="freed"):
        _evalcb.holds_begin(rig.h, True, True, False)
    _evalcb.holds_disable(rig.h)  # a freed holds takes it: a no-op
    assert rig.stop([1]) is False  # freed: nobody may compute from these pages


def test_bad_holds_are_refused():
    region, table = mmap.mmap(-1, rz.REGION_WORDS * 8), mmap.mmap(-1, 64)
    layout = ggml_tensor.LANE_LAYOUT

    def route(*args):
        return True

    with pytest.raises(ValueError, match="even"):
        _evalcb.holds_new(route, region, table, 8, HOLDS[:3], -1, layout)
    with pytest.raises(ValueError, match="route callable"):
        _evalcb.holds_new(None, region, table, 8, HOLDS[:2], -1, layout)
    with pytest.raises(ValueError, match="hold index"):
        _evalcb.holds_new(route, region, table, 8, [0, 1], -1, layout)  # the region's header words
    with pytest.raises(ValueError, match="hold region"):
        _evalcb.holds_new(route, mmap.mmap(-1, 4096), table, 8, HOLDS[:2], -1, layout)
    h = _evalcb.holds_new(route, region, table, 8, HOLDS[:2], -1, layout)
    with pytest.raises(ValueError, match="page-aligned"):
        _evalcb.holds_layer(h, 1, 0, 0, mmap.mmap(-1, 64), 0, [(4097, 4096, 0, 4096)])
    _evalcb.holds_free(h)
