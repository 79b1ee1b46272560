"""The client's side of hits without a round trip: its hold region and the model's tables.

Owns this connection's hold region (mapped read-write; only this process
writes it), the read-only residency table of each open model and the slot
states of each size class. The protocol and the argument for it are in
moed.protocol.residency_words; each hit is one call into moed._holds.

Invariants:
- a hold word is written only at an index this object handed out (`take`) and
  cleared before the index is handed out again (`give`);
- a local lease's bytes are read only between a successful `hit` and its
  release, which clears its holds;
- a region, its tables and its states belong to one connection: a reconnect
  (moed.client.client) maps the new daemon's as new objects, and a local lease of
  the old connection clears its holds in its own, old, region (never in the new
  one); the old one is unmapped once the last such lease is released;
- touches go into the ring before its head moves (a seq_cst store), so the
  daemon never reads a touch that is not written; the head is the region's
  word, and every recorder (this object, an engine's lane: moed/_hitproto.h)
  writes it holding the GIL.

`MOED_LOCAL_HITS=0` turns the fast path off (every acquire is a round trip).
"""

from __future__ import annotations

import mmap
import os
import threading
import types
from dataclasses import dataclass

import numpy as np

from moed.protocol import residency_words as rz

_holds: types.ModuleType | None
try:
    from moed import _holds
except ImportError:  # not built (a source checkout never installed): round trips only
    _holds = None


def enabled() -> bool:
    return _holds is not None and os.environ.get("MOED_LOCAL_HITS", "1") != "0"


class ReadOnlyWords:
    """A read-only mapping of a daemon memfd of uint64 words."""

    def __init__(self, fd: int):
        size = os.fstat(fd).st_size
        self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        os.close(fd)
        self.words = np.frombuffer(self.map, dtype=np.uint64)


def resident(table: ReadOnlyWords, row_base: int, experts: np.ndarray, states: ReadOnlyWords) -> np.ndarray:
    """Which of `experts` are READY now, by the table and the states (a hint: no holds taken,
    so it may be stale at once; a hit still goes through `HoldRegion.hit`)."""
    entries = table.words[row_base + experts]
    slots = rz.entry_slot(entries)
    ready = rz.ready_state(rz.entry_generation(entries))
    in_range = (entries != 0) & (slots >= 0) & (slots < len(states.words))
    out = np.zeros(len(experts), dtype=bool)
    out[in_range] = states.words[slots[in_range]] == ready[in_range]
    return out


@dataclass
class LocalHits:
    """One model's hit words on one connection (ModelHandle.local_hits)."""

    region: HoldRegion
    table: ReadOnlyWords
    rows: dict[int, int]  # layer -> its first table word
    states: dict[int, ReadOnlyWords]  # size class -> its slot states
    counter_word: int | None  # the region word counting the model's local hits
    model_id: int
    pin_word: int | None  # the table word saying every expert is pinned (whole steps), if any


class HoldRegion:
    def __init__(self, fd: int, region_words: int):
        if region_words != rz.REGION_WORDS:
            os.close(fd)
            raise ValueError(f"hold region of {region_words} words; this client knows {rz.REGION_WORDS}")
        self.map = mmap.mmap(fd, region_words * 8)
        os.close(fd)
        self.words = np.frombuffer(self.map, dtype=np.uint64)
        self._free = list(range(rz.HOLD_BASE + rz.HOLD_WORDS - 1, rz.HOLD_BASE - 1, -1))
        self._lock = threading.Lock()
        self._counters: dict[int, int] = {}  # model id -> its counter word
        self._closing = False  # the connection is gone: unmap once the last hold is let go
        self._mapped = True
        self._close_hooks: list = []  # told at close, before anything is let go (engine lanes)

    def take(self, n: int) -> list[int] | None:
        with self._lock:
            if len(self._free) < n:
                return None
            out = self._free[-n:]
            del self._free[-n:]
            return out

    def give(self, indexes: list[int]) -> None:
        with self._lock:
            self._free += indexes
            last = self._closing and len(self._free) == rz.HOLD_WORDS
        if last:
            self._unmap()

    def hit(
        self, table, row_base: int, experts: list[int], states, class_id: int, holds: list[int]
    ) -> list[int] | None:
        assert _holds is not None
        return _holds.hit(table.map, row_base, experts, states.map, self.map, holds, class_id)

    def release(self, states, holds: list[int]) -> bool:
        """Let a local lease go: False if one of its slots got a new residency while held
        (the daemon revoked this region and its grace ended: the bytes read may be wrong)."""
        assert _holds is not None
        ok = _holds.release(states.map, self.map, holds)
        self.give(holds)
        return ok

    def record(self, model_id: int, class_id: int, slots: list[int]) -> None:
        """Count the hit and leave its touches for the daemon's LRU (one C call; the ring's
        head lives in the region, so every recorder of this process shares it)."""
        assert _holds is not None
        with self._lock:
            word = self._counter(model_id)
            _holds.record(self.map, class_id, slots, -1 if word is None else word)

    def counter_word(self, model_id: int) -> int | None:
        """The region word counting `model_id`'s local hits (None: no counter word left)."""
        with self._lock:
            return self._counter(model_id)

    def on_close(self, hook) -> None:
        """Call `hook()` when the connection closes, before anything else: whoever takes hits
        outside this object (an engine's lane, moed/engines/_layer_holds.c) stops taking them then."""
        self._close_hooks.append(hook)

    def _counter(self, model_id: int) -> int | None:
        word = self._counters.get(model_id)
        if word is None and len(self._counters) < rz.MAX_MODEL_COUNTERS:
            word = rz.COUNTER_BASE + 2 * len(self._counters) + 1
            self.words[word - 1] = model_id
            self._counters[model_id] = word
        return word

    def close(self) -> None:
        """The connection closed: no more hits. Unmapped once every local lease is released,
        so a lease still open can clear its holds (a revoked region then ends early)."""
        hooks, self._close_hooks = self._close_hooks, []
        for hook in hooks:
            hook()
        with self._lock:
            self._closing = True
            idle = len(self._free) == rz.HOLD_WORDS
        if idle:
            self._unmap()

    def _unmap(self) -> None:
        with self._lock:
            if not self._mapped:
                return
            self._mapped = False
        del self.words
        try:
            self.map.close()
        except BufferError:
            pass  # a lease's view still holds it; the mapping goes with it
