"""The layer holds (moed/engines/_layer_holds.c) on real shared words and a real memfd, without llama.cpp.

The one owner of what a model's routed layers hold, driven through the C eval
callback itself (called through ctypes with fake nodes, as ggml's scheduler calls
it): each layer stops at its own node (its top-k, or a device layer's routing
weights); a lane layer's hit taken in C (the ids read through the node's strides,
holds and the state check of moed/_hitproto.h, the earlier hit grant released, touches
and the hit counter left in the region, each expert's slot mapped at its addresses),
done alone or told to Python; a device layer's hit taken in C over the device LRU's
arrays (last use bumped, the slot ids written over the top-k, in host memory or
through ggml's backend functions); a miss handed to Python once, with the grant to let
go and the ids read, and Python's grant held from the return of that call (its answer);
every stop counted
under exactly one outcome; a whole step on the region's pin hold; the release after a
decode. Anything but a plain hit changes nothing.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
import pytest

from moed import libc
from moed.engines import _layer_holds as lh
from moed.engines import ggml_api, holds
from moed.engines.device_lru import SlotLru, full_hit
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
        self.tensor = ggml_api.GgmlTensor()
        self.tensor.type = ggml_api.GGML_TYPE_I32
        self.tensor.name = f"ffn_moe_topk-{LAYER}".encode()
        self.tensor.data = self.ids.ctypes.data
        # Python's half of a stop: what it was told, and what it does (`act`, per call).
        self.calls: list[tuple[int, int, object, list[int]]] = []
        self.read: list[np.ndarray | None] = []  # the ids the holds handed Python at each call
        self.act = lambda layer, status, grant: None
        self.norms: list[int] = []
        words = (self.region, self.table) if region else (None, None)
        self.h = lh.new(self._route, *words, N_EXPERTS, HOLDS if region else [], COUNTER, ggml_api.HOLDS_LAYOUT)
        parts = [(self.addrs[p], PAGE, p * PAGE, 2 * PAGE) for p in range(2)]
        lh.lane_layer(self.h, LAYER, 0, CLASS, self.states if region else None, self.fd, parts)
        self.cfg = lh.callback_new(self._norm, ggml_api.NAME_OFFSET)
        lh.callback_holds(self.cfg, self.h)
        self.cb = CALLBACK(lh.callback_address())
        self.ud = lh.callback_user_data(self.cfg)

    def _route(self, topk: int, layer: int, status: int, grant, ids: bytes | None):
        assert topk == ctypes.addressof(self.tensor)  # the stop's top-k, whichever node the stop is
        self.calls.append((layer, status, grant, self.held()))  # what the region held during the call
        self.read.append(None if ids is None else np.frombuffer(ids, np.int32).reshape(-1, int(self.tensor.ne[0])))
        answer = self.act(layer, status, grant)
        return True if answer is None else answer

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
        """(stops, to_python, from_python, most_from_python) of one outcome (its ns aside)."""
        return lh.crossings(self.h)[outcome][:4]

    def give(self, grant: Grant) -> None:
        """The holds hold `grant` (outside a decode's stops, as a test sets up): one stop of
        layer 9 (no lane layer) whose answer is the grant; the call is not recorded."""
        act, name, calls = self.act, self.tensor.name, len(self.calls)
        self.act, self.tensor.name = (lambda layer, status, g: (True, grant)), b"ffn_moe_topk-9"
        try:
            lh.begin(self.h, False, False, False)
            assert self.stop([0])
        finally:
            self.act, self.tensor.name = act, name
            del self.calls[calls:], self.read[calls:]

    def close(self) -> None:
        lh.callback_holds(self.cfg, None)
        lh.free(self.h)
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


def test_the_status_constants_and_outcomes_are_the_extensions():
    assert (holds.NOT_TRIED, holds.LOST, holds.MAP_FAILED, holds.LANE_MISSED, holds.DEVICE_MISSED) == (
        lh.NOT_TRIED,
        lh.LOST,
        lh.MAP_FAILED,
        lh.LANE_MISSED,
        lh.DEVICE_MISSED,
    )
    assert holds.OUTCOMES == lh.OUTCOMES


def test_a_hit_with_nothing_for_python_is_the_whole_layer_in_c(rig):
    rig.resident(1, slot=2)
    rig.resident(4, slot=0)
    lh.begin(rig.h, True, True, True)
    assert rig.stop([4, 1], [1, -1])  # two tokens; -1 ids are not experts
    assert rig.calls == []  # Python never ran
    assert sorted(rig.held()) == sorted([hold_word(0), hold_word(2)])
    assert int(rig.r[rz.W_RING_HEAD]) == 2
    assert {int(w) for w in rig.r[rz.RING_BASE : rz.RING_BASE + 2]} == {rz.touch(CLASS, 0), rz.touch(CLASS, 2)}
    assert int(rig.r[COUNTER]) == 2
    assert rig.shows(1) == [bytes([33]) * 8, bytes([34]) * 8]  # slot 2's two parts
    assert rig.shows(4) == [bytes([1]) * 8, bytes([2]) * 8]
    stats = lh.stats(rig.h)
    assert (stats["layers"], stats["experts"], stats["maps"]) == (1, 2, 2)
    assert lh.held(rig.h) == ("hit", 2)
    assert rig.crossings("lane_hit") == (1, 0, 0, 0)
    assert lh.take_log(rig.h) == ([(LAYER, [1, 4])], False)
    assert lh.end(rig.h) == (None, True)  # after the decode: the hit grant let go
    assert rig.held() == [] and lh.held(rig.h) is None


def test_the_next_layer_releases_the_earlier_hit_grant_and_maps_only_a_changed_slot(rig):
    rig.resident(1, slot=2)
    lh.begin(rig.h, True, True, False)
    assert rig.stop([1])
    first = rig.held()
    rig.resident(5, slot=3)
    assert rig.stop([1, 5])
    assert len(rig.held()) == 2 and lh.stats(rig.h)["maps"] == 2  # expert 1 not mapped again
    assert set(first) <= set(rig.held())  # the same residency held again, in the other hold set
    assert lh.take_log(rig.h) == ([], False)  # not logging
    assert lh.end(rig.h) == (None, True) and rig.held() == []


def test_a_hit_python_must_see_is_told_once_and_needs_no_call_back(rig):
    rig.resident(1, slot=2)
    lh.begin(rig.h, True, False, True)  # e.g. the look-ahead predicts this step
    assert rig.stop([1])
    assert rig.calls == [(LAYER, 1, None, [hold_word(2)])]  # held before Python heard of it
    assert rig.crossings("lane_hit_python") == (1, 1, 0, 0)
    assert lh.take_log(rig.h) == ([], False)  # Python scored it itself


def answer(grant: Grant) -> tuple:
    """Python's answer at a lane layer's miss: go on, and hold `grant`, mapped at its slots."""
    return True, grant, grant.experts, grant.slots


def test_a_miss_is_one_call_into_python_and_none_back(rig):
    """The hit grant of the layer before is let go before Python asks the daemon; Python
    answers with its grant, which the holds hold and map from the return; the next stop
    hands it to Python to let go."""
    rig.resident(1, slot=2)
    lh.begin(rig.h, True, True, False)
    assert rig.stop([1])  # a hit: the holds' hit grant
    granted = Grant([6], [1])
    rig.act = lambda layer, status, grant: answer(granted) if status == holds.LANE_MISSED else None
    assert rig.stop([6])  # expert 6 is not resident
    assert rig.calls == [(LAYER, holds.LANE_MISSED, None, [])]  # the earlier hit grant released first
    assert lh.held(rig.h) == ("grant", granted)
    assert rig.shows(6) == [bytes([17]) * 8, bytes([18]) * 8]  # slot 1, mapped at the return
    assert rig.crossings("lane_miss") == (1, 1, 0, 0)
    assert lh.stats(rig.h)["misses"] == 1
    # A miss after a grant: the grant goes to Python (piggybacked on its acquire), and the
    # new one comes back with the answer.
    second = Grant([7], [3])
    rig.act = lambda layer, status, grant: answer(second)
    assert rig.stop([7])
    assert rig.calls[-1] == (LAYER, holds.LANE_MISSED, granted, [])
    assert lh.held(rig.h) == ("grant", second)
    assert rig.crossings("lane_miss") == (2, 2, 0, 0)  # each missed layer: one call, none back
    # The next layer's hit: the holds take it, and Python is told, with the grant to let go.
    rig.act = lambda layer, status, grant: None
    rig.resident(4, slot=0)
    assert rig.stop([4])
    assert rig.calls[-1] == (LAYER, 1, second, [hold_word(0)])
    assert lh.held(rig.h) == ("hit", 1)
    assert rig.crossings("lane_hit_python") == (1, 1, 0, 0)


def test_with_the_ids_not_final_nothing_is_tried_and_the_grant_comes_back_after_the_decode(rig):
    rig.resident(1, slot=2)
    lh.begin(rig.h, False, True, False)  # a route hook or substitution this decode
    granted = Grant([1], [2])
    rig.act = lambda layer, status, grant: answer(granted)
    assert rig.stop([1])
    assert rig.calls == [(LAYER, holds.NOT_TRIED, None, [])]
    assert int(rig.r[rz.W_RING_HEAD]) == 0 and lh.stats(rig.h)["misses"] == 0  # no hp_hit
    assert rig.shows(1) == [bytes([33]) * 8, bytes([34]) * 8]
    assert rig.crossings("not_tried") == (1, 1, 0, 0)
    assert lh.end(rig.h) == (granted, True)  # Python lets it go
    assert lh.held(rig.h) is None


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
        lh.disable(rig.h)
    else:
        ids = [1, N_EXPERTS]
    lh.begin(rig.h, True, True, False)
    assert rig.stop(ids)
    # MISSED: the hit itself was tried and missed, so Python asks the daemon without trying
    # again; NOT_TRIED: the holds did not try, and Python's acquire may.
    tried = how in ("not resident", "state moved", "region revoked")
    assert [c[1] for c in rig.calls] == [holds.LANE_MISSED if tried else holds.NOT_TRIED]
    assert rig.held() == [] and int(rig.r[rz.W_RING_HEAD]) == 0 and int(rig.r[COUNTER]) == 0
    assert lh.stats(rig.h)["maps"] == 0  # nothing mapped: still PROT_NONE


def test_a_refilled_slot_under_a_hit_grant_is_reported_lost(rig):
    rig.resident(1, slot=2)
    lh.begin(rig.h, True, True, False)
    assert rig.stop([1])
    rig.s[2] = ready(9)  # the daemon refilled it: only after a revoke whose grace ended
    rig.resident(5, slot=3)
    assert rig.stop([5])
    assert rig.calls[-1][1] == holds.LOST  # the new hit grant is held; the old was lost
    assert len(rig.held()) == 1
    rig.s[3] = ready(9)
    assert lh.end(rig.h) == (None, False)
    assert rig.held() == []


def test_after_a_failure_nothing_is_tried_or_handed_over_until_the_end(rig):
    rig.resident(1, slot=2)
    lh.begin(rig.h, False, False, False)
    granted = Grant([1], [2])
    rig.act = lambda layer, status, grant: answer(granted)
    assert rig.stop([1])
    rig.act = lambda layer, status, grant: None
    lh.fail(rig.h)
    assert rig.stop([1])
    assert rig.calls[-1] == (LAYER, holds.NOT_TRIED, None, [])  # the grant stays with the holds
    assert lh.end(rig.h) == (granted, True)


def test_a_whole_step_holds_the_pin_hold_and_makes_no_stop(rig):
    for e in range(N_EXPERTS):
        rig.resident(e, slot=e % SLOTS)
    lh.pins(rig.h, MODEL, PIN_WORD)
    assert lh.whole_begin(rig.h) is False  # the pin word says not every expert is pinned
    assert int(rig.r[rz.W_PIN_HOLD]) == 0
    rig.t[PIN_WORD] = 1
    granted = Grant([1], [1])
    rig.give(granted)  # a grant held: no whole step over it
    assert lh.whole_begin(rig.h) is False
    assert lh.end(rig.h) == (granted, True)
    assert lh.whole_begin(rig.h) is True
    assert int(rig.r[rz.W_PIN_HOLD]) == MODEL + 1 and lh.held(rig.h) == ("pin", MODEL)
    assert rig.shows(5) == [bytes([17]) * 8, bytes([18]) * 8]  # every expert mapped at its slot
    assert rig.stop([5]) is False and rig.calls == []  # the ask pass wants no node
    assert rig.held() == []  # no per-layer hold
    lh.whole_end(rig.h, 12)
    assert int(rig.r[rz.W_PIN_HOLD]) == 0 and int(rig.r[COUNTER]) == 12
    assert lh.held(rig.h) is None and lh.stats(rig.h)["whole_decodes"] == 1
    assert rig.stop([5]) is True  # stops again


def test_the_norm_stop_goes_to_the_node_function(rig):
    lh.callback_router_input(rig.cfg, True)
    rig.tensor.name = b"ffn_norm-3"
    assert rig.stop([1]) and rig.norms == [ctypes.addressof(rig.tensor)] and rig.calls == []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_exception_in_python_stops_the_graph(rig):
    def boom(layer, status, grant):
        raise RuntimeError("a bug")

    rig.act = boom
    lh.begin(rig.h, False, False, False)
    assert rig.stop([1]) is False


def test_without_a_region_every_stop_is_pythons_and_the_answer_maps():
    rig = Rig(region=False)
    try:
        rig.resident(1, slot=2)
        lh.begin(rig.h, True, True, False)
        granted = Grant([1], [2])
        rig.act = lambda layer, status, grant: answer(granted)
        assert rig.stop([1])
        assert rig.calls == [(LAYER, holds.NOT_TRIED, None, [])]
        assert rig.shows(1) == [bytes([33]) * 8, bytes([34]) * 8]
        assert lh.whole_begin(rig.h) is False
        assert lh.end(rig.h) == (granted, True)
    finally:
        rig.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_answer_whose_mapping_lists_are_wrong_is_a_bug_that_holds_nothing(rig):
    lh.begin(rig.h, False, False, False)
    a = Grant([1], [2])
    for bad in ((True, a, [1], [2, 3]), (True, a, [1], None), ("yes",)):
        rig.act = lambda layer, status, grant, bad=bad: bad
        assert rig.stop([1]) is False  # the graph stops: Python's side is broken
        assert lh.held(rig.h) is None


def test_place_maps_once_per_slot_and_free_ends_the_holds(rig):
    assert lh.place(rig.h, LAYER, 6, 1) is True
    assert lh.place(rig.h, LAYER, 6, 1) is False
    assert rig.shows(6) == [bytes([17]) * 8, bytes([18]) * 8]
    assert lh.place(rig.h, LAYER, 6, 1, True) is True  # populate maps it again
    with pytest.raises(ValueError, match="not a lane layer"):
        lh.place(rig.h, LAYER + 1, 6, 1)
    granted = Grant([1], [2])
    rig.give(granted)
    assert lh.free(rig.h) is granted  # given back, for Python to let go
    with pytest.raises(ValueError, match="freed"):
        lh.begin(rig.h, True, True, False)
    lh.disable(rig.h)  # a freed holds takes it: a no-op
    assert rig.stop([1]) is False  # freed: nobody may compute from these pages


def test_bad_holds_are_refused():
    region, table = mmap.mmap(-1, rz.REGION_WORDS * 8), mmap.mmap(-1, 64)
    layout = ggml_api.HOLDS_LAYOUT

    def route(*args):
        return True

    with pytest.raises(ValueError, match="even"):
        lh.new(route, region, table, 8, HOLDS[:3], -1, layout)
    with pytest.raises(ValueError, match="route callable"):
        lh.new(None, region, table, 8, HOLDS[:2], -1, layout)
    with pytest.raises(ValueError, match="hold index"):
        lh.new(route, region, table, 8, [0, 1], -1, layout)  # the region's header words
    with pytest.raises(ValueError, match="hold region"):
        lh.new(route, mmap.mmap(-1, 4096), table, 8, HOLDS[:2], -1, layout)
    h = lh.new(route, region, table, 8, HOLDS[:2], -1, layout)
    with pytest.raises(ValueError, match="page-aligned"):
        lh.lane_layer(h, 1, 0, 0, mmap.mmap(-1, 64), 0, [(4097, 4096, 0, 4096)])
    lh.free(h)


# ---------------------------------------------------------------------- stops and device layers

DEV = 5  # the device layer: it stops at its routing weights
F32 = 0


def node(name: str) -> ggml_api.GgmlTensor:
    t = ggml_api.GgmlTensor()
    t.type, t.name = F32, name.encode()
    return t


def asked(rig, name: str) -> bool:
    """The ask pass's answer for a node of this name."""
    t = node(name)
    return bool(rig.cb(ctypes.addressof(t), True, rig.ud))


class Device:
    """A device layer's LRU (moed.engines.device_lru's SlotLru: the policy's own arrays) and its
    routing-weights node, whose ids source (src[1]) is the rig's top-k."""

    def __init__(self, rig, n_slots: int = 4):
        self.rig = rig
        self.lru = SlotLru(N_EXPERTS, n_slots)
        self.slot_of, self.expert_of = self.lru.slot_of_expert, self.lru.expert_of_slot
        self.last_use, self.clock = self.lru.last_use, self.lru.clock
        lh.device_layer(rig.h, DEV, self.slot_of, self.expert_of, self.last_use, self.clock)
        self.weights = node(f"ffn_moe_weights-{DEV}")
        self.weights.src[1] = ctypes.addressof(rig.tensor)

    def put(self, expert: int, slot: int) -> None:
        self.slot_of[expert], self.expert_of[slot] = slot, expert

    def stop(self, *rows: list[int]) -> bool:
        """The device layer's stop as the scheduler makes it: its top-k is computed (and asked
        about: no stop there), then its routing weights."""
        rig, name = self.rig, self.rig.tensor.name
        rig.tensor.name = f"ffn_moe_topk-{DEV}".encode()
        try:
            topk = rig.route(*rows)
            assert not rig.cb(topk, True, rig.ud), "a device layer's top-k is not its stop"
            w = ctypes.addressof(self.weights)
            return bool(rig.cb(w, True, rig.ud)) and bool(rig.cb(w, False, rig.ud))
        finally:
            rig.tensor.name = name


def test_each_layer_stops_at_its_own_node(rig):
    lh.stop_at(rig.h, 7, True)  # layer 7 stops at its routing weights
    assert asked(rig, f"ffn_moe_topk-{LAYER}") and not asked(rig, f"ffn_moe_weights-{LAYER}")
    assert asked(rig, "ffn_moe_weights-7") and not asked(rig, "ffn_moe_topk-7")
    assert asked(rig, "ffn_moe_topk-9") and not asked(rig, "ffn_moe_weights-9")  # the default: its top-k
    assert not asked(rig, "ffn_moe_topk-") and not asked(rig, "ffn_moe_topk-3a") and not asked(rig, "ffn_norm-3")
    lh.stop_at(rig.h, 7, False)
    assert asked(rig, "ffn_moe_topk-7") and not asked(rig, "ffn_moe_weights-7")
    lh.callback_routed(rig.cfg, False)  # a benchmark's graph with no routed stop
    assert not asked(rig, f"ffn_moe_topk-{LAYER}") and not asked(rig, "ffn_moe_weights-7")
    lh.callback_routed(rig.cfg, True)
    with pytest.raises(ValueError, match="lane layer stops at its top-k"):
        lh.stop_at(rig.h, LAYER, True)
    dev = Device(rig)
    assert asked(rig, f"ffn_moe_weights-{DEV}") and not asked(rig, f"ffn_moe_topk-{DEV}")
    with pytest.raises(ValueError, match="device layer at its weights"):
        lh.stop_at(rig.h, DEV, False)
    with pytest.raises(ValueError, match="not a lane layer"):
        lh.device_layer(rig.h, LAYER, dev.slot_of, dev.expert_of, dev.last_use, dev.clock)


def test_a_device_hit_is_the_whole_layer_in_c(rig):
    dev = Device(rig)
    dev.put(1, 2)
    dev.put(4, 0)
    dev.put(6, 3)
    lh.begin(rig.h, True, True, True)
    assert dev.stop([4, 1], [1, 6])
    assert rig.calls == []  # Python never ran
    assert rig.ids[:2].tolist() == [[0, 2], [2, 3]]  # slot ids over the top-k, in place
    # The clock ticks once per expert, ascending: 1 (slot 2), 4 (slot 0), 6 (slot 3); 3 hits.
    assert dev.clock.tolist() == [3, 3] and dev.last_use.tolist() == [2, 0, 1, 3]
    assert dev.slot_of.tolist()[:7] == [-1, 2, -1, -1, 0, -1, 3]  # the policy's maps untouched
    assert rig.crossings("device_hit") == (1, 0, 0, 0)
    stats = lh.stats(rig.h)
    assert (stats["device_layers"], stats["device_experts"], stats["layers"]) == (1, 3, 0)
    assert lh.take_log(rig.h) == ([(DEV, [1, 4, 6])], False)
    assert lh.end(rig.h) == (None, True) and lh.held(rig.h) is None  # nothing was held


def test_a_device_hit_in_c_is_the_policys_full_hit(rig):
    """C's device hit over the policy's arrays is device_lru.full_hit step for step: the same
    slot ids, stamps, clock and hits, batch after batch (and the same misses, changing nothing)."""
    dev = Device(rig)
    twin = SlotLru(N_EXPERTS, 4)
    for lru in (dev.lru, twin):
        for e, slot in ((1, 2), (4, 0), (6, 3), (0, 1)):
            lru.assign(e, slot)
    lh.begin(rig.h, True, True, False)
    for rows in ([[4, 1], [1, 6]], [[0, 0]], [[6, 4], [0, 1]], [[5, 1]], [[1, 4]]):
        want = full_hit(twin, np.array(rows, np.int32))
        assert dev.stop(*rows)
        got = rig.ids[: len(rows), :2].tolist()
        assert got == (rows if want is None else want.tolist())
        for a, b in ((dev.slot_of, twin.slot_of_expert), (dev.last_use, twin.last_use), (dev.clock, twin.clock)):
            assert a.tolist() == b.tolist()
    assert dev.lru.hits == twin.hits == 10 and dev.lru.resident() == twin.resident()


def test_a_device_hit_leaves_the_argsorts_other_columns(rig):
    dev = Device(rig)
    dev.put(3, 1)
    rig.ids[:] = 99
    lh.begin(rig.h, True, True, False)
    assert dev.stop([3], [3])  # k = 1: a view of the first column, rows 8 bytes apart
    assert rig.ids[:2].tolist() == [[1, 99], [1, 99]]


def test_a_device_hit_python_must_see_hands_over_the_experts_not_the_slots(rig):
    dev = Device(rig)
    dev.put(1, 2)
    lh.begin(rig.h, True, False, False)  # e.g. the look-ahead predicts this step
    assert dev.stop([1])
    assert rig.calls == [(DEV, 1, None, [])]
    assert rig.read[-1].tolist() == [[1]] and int(rig.ids[0, 0]) == 2  # the node holds the slot now
    assert rig.crossings("device_hit_python") == (1, 1, 0, 0)


def test_a_device_miss_is_one_call_with_the_ids_read_and_changes_nothing(rig):
    dev = Device(rig)
    dev.put(1, 2)
    dev.put(5, 1)
    dev.slot_of[5] = 3  # the maps disagree: no slot of the layer holds 5 for sure
    lh.begin(rig.h, True, True, False)
    for ids in ([1, 6], [1, 5]):
        assert dev.stop(ids)
        assert rig.calls[-1] == (DEV, holds.DEVICE_MISSED, None, [])
        assert rig.read[-1].tolist() == [ids] and rig.ids[0, :2].tolist() == ids  # Python writes the slots
    assert dev.clock.tolist() == [0, 0] and not dev.last_use.any()
    assert rig.crossings("device_miss") == (2, 2, 0, 0)
    # Ids no expert has: not tried (Python's path raises), the ids still handed over.
    assert dev.stop([1, N_EXPERTS]) and dev.stop([-1, 1])
    assert [c[1] for c in rig.calls[-2:]] == [holds.NOT_TRIED] * 2 and rig.read[-1].tolist() == [[-1, 1]]
    # With the ids not final (a hook), nothing is read or tried.
    lh.begin(rig.h, False, False, False)
    assert dev.stop([1])
    assert rig.calls[-1] == (DEV, holds.NOT_TRIED, None, []) and rig.read[-1] is None


def test_a_device_hit_releases_the_earlier_lane_hit_grant(rig):
    dev = Device(rig)
    dev.put(1, 0)
    rig.resident(1, slot=2)
    lh.begin(rig.h, True, True, False)
    assert rig.stop([1])  # the lane layer's hit: held
    assert rig.held() == [hold_word(2)]
    assert dev.stop([1])  # the lane layer's matmuls have run: its hit grant goes
    assert rig.held() == [] and lh.held(rig.h) is None
    assert rig.crossings("lane_hit")[0] == rig.crossings("device_hit")[0] == 1


def test_a_grant_to_let_go_sends_a_device_hit_to_python(rig):
    dev = Device(rig)
    dev.put(1, 0)
    lh.begin(rig.h, True, True, False)
    granted = Grant([6], [1])
    rig.give(granted)  # a Python grant (an earlier layer's acquire)
    lh.begin(rig.h, True, True, False)
    assert dev.stop([1])
    assert rig.calls == [(DEV, 1, granted, [])]  # handed over to let go
    assert rig.crossings("device_hit_python") == (1, 1, 0, 0) and lh.held(rig.h) is None


GET_2D = ctypes.CFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_size_t] * 5
)  # (tensor, data, offset, size, n_copies, stride_tensor, stride_data)
IS_HOST = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p)
DEVICE_BUFFER = 0x5EED  # a device buffer: its data is read only through the backend


class FakeBackend:
    """ggml_backend_tensor_{get,set}_2d over the rig's ids (the "device memory"), recorded."""

    def __init__(self, rig):
        self.calls: list[tuple] = []

        def copy(tensor, data, offset, size, n, stride_tensor, stride_data, to_device):
            self.calls.append(("set" if to_device else "get", offset, size, n, stride_tensor, stride_data))
            base = ggml_api.GgmlTensor.from_address(tensor).data
            for r in range(n):
                dev, host = base + offset + r * stride_tensor, data + r * stride_data
                ctypes.memmove(dev if to_device else host, host if to_device else dev, size)

        self.get = GET_2D(lambda t, d, o, s, n, st, sd: copy(t, d, o, s, n, st, sd, False))
        self.set = GET_2D(lambda t, d, o, s, n, st, sd: copy(t, d, o, s, n, st, sd, True))
        self.is_host = IS_HOST(lambda buffer: buffer != DEVICE_BUFFER)
        addr = [ctypes.cast(f, ctypes.c_void_p).value for f in (self.get, self.set, self.is_host)]
        lh.backend(rig.h, *addr)
        rig.tensor.buffer = DEVICE_BUFFER


def test_a_node_in_device_memory_is_read_and_written_through_the_backend(rig):
    backend = FakeBackend(rig)
    dev = Device(rig)
    dev.put(4, 1)
    dev.put(2, 3)
    rig.resident(1, slot=2)
    lh.begin(rig.h, True, True, False)
    assert dev.stop([4, 2], [2, 4])
    stride = rig.ids.strides[0]
    assert backend.calls == [("get", 0, 8, 2, stride, 8), ("set", 0, 8, 2, stride, 8)]  # one copy each way
    assert rig.ids[:2].tolist() == [[1, 3], [3, 1]]
    assert rig.stop([1])  # a lane layer whose top-k sits on the device (an offloaded layer's)
    assert backend.calls[-1][0] == "get" and rig.shows(1) == [bytes([33]) * 8, bytes([34]) * 8]
    assert rig.crossings("lane_hit")[0] == rig.crossings("device_hit")[0] == 1 and rig.calls == []


def test_every_stop_is_counted_under_exactly_one_outcome(rig):
    dev = Device(rig)
    dev.put(1, 0)
    rig.resident(1, slot=2)
    granted = Grant([7], [3])
    rig.act = lambda layer, status, grant: answer(granted) if status == holds.LANE_MISSED else None
    lh.begin(rig.h, True, True, False)
    stops = [
        lambda: rig.stop([7]),  # lane_miss: Python answers with a grant
        lambda: rig.stop([1]),  # lane_hit_python: the grant to let go
        lambda: dev.stop([1]),  # device_hit
        lambda: dev.stop([3]),  # device_miss
        lambda: dev.stop([N_EXPERTS]),  # not_tried
        lambda: rig.stop([1]),  # lane_hit: its hit grant held
    ]
    for stop in stops:
        assert stop()
    rig.s[2] = ready(9)  # the daemon refilled the lane hit's slot (after a revoke's grace)
    rig.resident(5, slot=3)
    assert rig.stop([5])  # failed: the earlier hit grant was lost
    lh.begin(rig.h, True, False, False)
    assert dev.stop([1])  # device_hit_python
    cross = lh.crossings(rig.h)
    assert tuple(cross) == holds.OUTCOMES
    assert all(v[4] > 0 for v in cross.values())  # each outcome's stops timed
    assert {k: v[0] for k, v in cross.items()} == dict.fromkeys(holds.OUTCOMES, 1)
    assert sum(v[1] for v in cross.values()) == len(rig.calls) == 6  # every stop but the two in C alone
    assert sum(v[2] for v in cross.values()) == 0  # Python never calls back: its answers carry the grants


def test_forget_maps_every_lane_expert_again_at_its_next_use(rig):
    rig.resident(1, slot=2)
    lh.begin(rig.h, True, True, False)
    assert rig.stop([1])
    assert lh.stats(rig.h)["maps"] == 1
    assert rig.stop([1]) and lh.stats(rig.h)["maps"] == 1  # the same slot: no mapping
    lh.forget(rig.h)  # e.g. zeros over every expert after a failed decode under an offload
    assert rig.stop([1]) and lh.stats(rig.h)["maps"] == 2


def test_bad_device_layers_are_refused(rig):
    ok = dict(
        slot_of_expert=np.full(N_EXPERTS, -1, np.int32),
        expert_of_slot=np.full(4, -1, np.int32),
        last_use=np.zeros(4, np.int64),
        clock=np.zeros(2, np.int64),
    )
    for key, bad in [
        ("slot_of_expert", np.full(N_EXPERTS, -1, np.int64)),  # int64: not the layout
        ("slot_of_expert", np.full(N_EXPERTS + 1, -1, np.int32)),  # not one a model expert
        ("last_use", np.zeros(3, np.int64)),  # not one a slot
        ("clock", np.zeros(2, np.float64)),
        ("clock", np.zeros(1, np.int64)),  # [0] the clock, [1] the hits
        ("expert_of_slot", np.full(8, -1, np.int32)[::2]),  # not contiguous
    ]:
        with pytest.raises(ValueError, match=key):
            lh.device_layer(rig.h, DEV, *{**ok, key: bad}.values())
    lh.device_layer(rig.h, DEV, *ok.values())
    with pytest.raises(ValueError, match="a new layer"):
        lh.device_layer(rig.h, DEV, *ok.values())


# ---------------------------------------------------------------------- the grant in route_fn's answer


def test_a_miss_answered_with_its_grant_is_held_from_the_return_with_no_call_back(rig):
    """route_fn returns the grant (and a lane layer's experts and slots): the holds own it from
    the moment the call returns, and map it, with no second crossing."""
    granted = Grant([6], [1])
    rig.act = lambda layer, status, grant: (True, granted, granted.experts, granted.slots)
    lh.begin(rig.h, True, True, False)
    assert rig.stop([6])
    assert rig.calls == [(LAYER, holds.LANE_MISSED, None, [])]
    assert lh.held(rig.h) == ("grant", granted) and rig.shows(6) == [bytes([17]) * 8, bytes([18]) * 8]
    assert rig.crossings("lane_miss") == (1, 1, 0, 0)  # one call in, none back
    # The next stop hands it to Python, which answers with nothing to hold: it let it go.
    rig.act = lambda layer, status, grant: (True, None)
    assert rig.stop([7])
    assert rig.calls[-1] == (LAYER, holds.LANE_MISSED, granted, []) and lh.held(rig.h) is None
    # A device layer's grant: held, nothing mapped.
    dev = Device(rig)
    second = Grant([3], [0])
    rig.act = lambda layer, status, grant: (False, second)  # False: the graph stops (a failure)
    assert not dev.stop([3])
    assert lh.held(rig.h) == ("grant", second) and lh.stats(rig.h)["maps"] == 1
    assert lh.end(rig.h) == (second, True)


def test_a_mapping_that_fails_keeps_the_grant_and_tells_python_once_more(rig):
    granted = Grant([6], [2**50])  # an offset past any file: mmap refuses it
    answers = iter([(True, granted, granted.experts, granted.slots), False])
    rig.act = lambda layer, status, grant: next(answers)
    lh.begin(rig.h, True, True, False)
    assert rig.stop([6]) is False  # Python's answer to MAP_FAILED: the graph stops
    assert [c[1:3] for c in rig.calls] == [(holds.LANE_MISSED, None), (holds.MAP_FAILED, None)]
    assert lh.held(rig.h) == ("grant", granted)  # still the holds', given back after the decode
    assert lh.stats(rig.h)["map_errno"] != 0
    assert rig.crossings("lane_miss") == (1, 2, 0, 0)  # one stop, two calls
    assert lh.end(rig.h) == (granted, True)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_grant_answered_over_one_held_is_a_bug_that_stops_the_graph(rig):
    held, second = Grant([1], [2]), Grant([5], [3])
    rig.give(held)
    lh.begin(rig.h, True, True, False)
    lh.fail(rig.h)  # after a failure the holds keep their grant at a stop
    rig.act = lambda layer, status, grant: (True, second)
    assert rig.stop([5]) is False
    assert lh.held(rig.h) == ("grant", held)
