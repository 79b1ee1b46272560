"""The slot layer: reads in flight, the pages of dropped slots, and waits for room.

Every room of the daemon above this one (models, pins, local holds, prefetch,
acquire) changes slots through the pure `Store` and then asks this layer for
the side effects: `start_read` for a slot the store reserved, `settle` after
the store dropped slots, `room_changed` after room was freed. It runs on the
event loop thread only; reader threads reach it through
`loop.call_soon_threadsafe`.

It owns:
- the reads in flight (`Loading` per slot): a slot has one exactly while it is
  LOADING, and every acquire or pin of that key awaits its `done`;
- the acquires waiting for room (their futures, and how many each tenant has
  waiting: local holds use that to tell starving another tenant from starving
  only itself).

What must happen before what:
- a slot's bytes are read (and transformed, chunk by chunk, when its model is
  made on read: moed.daemon.onread), its files fstat'ed unchanged, its pages
  locked and (in verify mode) hashed, all in the reader threads, before it is
  READY on the loop; only READY slots are ever granted (the store's rule);
- a failed read's slot goes back to the free list before any waiter hears of
  it; a read that found its file changed reports that through `on_stale`, and
  the layer above decides what retiring the model means;
- pages of a dropped slot go back to the kernel before anything else runs on
  the loop (`settle`), so locked memory follows the store's `used_bytes`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

from moed.cache.store import Slot, SlotState, Store, Want
from moed.protocol import errors

from .counters import Counters, Tenant
from .faults import DriveFaults
from .heat import Heat
from .models import Model
from .ramtier import RamTier
from .reader import ReaderPool, ReadJob
from .residency import Residency
from .verify import Verifier, digest

log = logging.getLogger("moed")


def wants(model: Model, layer: int, experts: list[int]) -> list[Want]:
    """The store's wants for `experts` of `layer` (duplicates once); typed errors for bad input."""
    table = model.wants.get(layer)
    if table is None:
        raise errors.UnknownLayer(
            f"model {model.model_id} has no routed experts in layer {layer} (MoE layers: {sorted(model.layers)})"
        )
    if not experts:
        raise errors.BadRequest("acquire needs at least one expert")
    try:
        found = [table[e] for e in experts]
    except (IndexError, TypeError):
        found = []
    if len(found) != len(experts) or min(experts) < 0:
        bad = next((e for e in experts if not 0 <= e < len(table)), experts[0])
        raise errors.UnknownExpert(f"expert {bad} out of range 0..{len(table) - 1} (layer {layer})")
    if len(set(experts)) != len(experts):
        found = list(dict.fromkeys(found))
    return found


@dataclass(eq=False)
class Loading:
    """A read in flight for one slot of `model`; every acquire of that key awaits `done`."""

    job: ReadJob
    model: Model  # open at least until this read ends: a LOADING slot keeps its model in the table
    done: asyncio.Future
    started_s: float = field(default_factory=time.perf_counter)


class Slots:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        store: Store,
        ramtier: RamTier,
        reader: ReaderPool,
        residency: Residency,
        faults: DriveFaults,
        counters: Counters,
        verifier: Verifier | None,
        heat: Heat | None,
        on_stale: Callable[[Model, str], object],
    ):
        self.loop, self.store, self.ramtier, self.reader = loop, store, ramtier, reader
        self.residency, self.faults, self.counters = residency, faults, counters
        self.verifier, self.heat = verifier, heat
        self._on_stale = on_stale  # a read found its model's file changed
        self._loading: dict[Slot, Loading] = {}
        self._room_waiters: list[asyncio.Future] = []
        self.waiting: dict[Tenant, int] = {}  # tenant -> its acquires waiting for room now

    def settle(self) -> None:
        """Give the pages of dropped slots back to the kernel."""
        for slot in self.store.take_dropped():
            self.ramtier.release_slot(self.ramtier.segments[slot.class_id], slot.index)

    # ---- reads ---------------------------------------------------------------

    @property
    def reads_in_flight(self) -> int:
        return len(self._loading)

    def reading(self) -> list[Slot]:
        """The slots with a read in flight, oldest first."""
        return list(self._loading)

    def done(self, slots) -> list[asyncio.Future]:
        """The futures of the reads in flight among `slots` (a slot READY already has none)."""
        return [self._loading[s].done for s in slots if s in self._loading]

    def promote(self, slot: Slot) -> None:
        """A demand acquire joined this read: it goes before read-ahead."""
        self.reader.promote(self._loading[slot].job)

    def start_read(self, model: Model, slot: Slot, demand: bool) -> None:
        job = self._job(model, slot, demand, model.repack_cache is not None)
        self._loading[slot] = Loading(job, model, self.loop.create_future())
        if not demand and not slot.pinned:
            self.counters.prefetches += 1
        self.reader.submit(job)

    def _job(self, model: Model, slot: Slot, demand: bool, cached: bool) -> ReadJob:
        """The read of a slot's expert: from the repack cache when it has it (and `cached`),
        else from the model's files, each part transformed as it is read when made on read."""
        key = slot.key
        assert key is not None  # a reserved (LOADING) slot always has its key
        plan = model.layers[key.layer]
        seg = self.ramtier.segments[slot.class_id]
        dests = [seg.part_addr(slot.index, k) for k in range(len(plan.parts))]
        what = f"model {key.model_id} layer {key.layer} expert {key.expert}"
        cache = model.repack_cache
        if cached and cache is not None and cache.has(key.layer, key.expert):
            pieces = cache.pieces(key.layer, key.expert, dests)
            return ReadJob(pieces, self._read_done_thread, demand, slot, what, watch=model.files, from_cache=True)
        pieces = [(f, off + key.expert * size, size, dest) for (f, off, size), dest in zip(plan.parts, dests)]
        job = ReadJob(pieces, self._read_done_thread, demand, slot, what, repacks=plan.repacks or None)
        if cache is not None and cached:
            job.write_back = (cache, key.layer, key.expert)
        return job

    def _read_done_thread(self, job: ReadJob, err: BaseException | None) -> None:
        """Reader thread: lock the filled pages, then hand over to the loop."""
        slot = cast(Slot, job.tag)
        if err is None:
            # Bytes read after the file changed (or while it changed) are never served.
            watch = job.watch if job.watch is not None else {p[0] for p in job.pieces}
            changed = next((f for f in watch if f.changed()), None)
            if changed is not None:
                err = errors.ModelStale(f"{changed.path} changed on disk while {job.what} was read")
        if err is None:
            self.ramtier.lock_slot(self.ramtier.segments[slot.class_id], slot.index)
            if self.verifier is not None:
                job.digest = digest(job.pieces)  # hashed here, off the event loop
            if job.write_back is not None:  # made on read: a copy of its bytes goes to the repack cache
                cache, layer, expert = job.write_back
                cache.offer(layer, expert, [(p[3], p[2]) for p in job.pieces])
        self.loop.call_soon_threadsafe(self._read_done, slot, job, err)

    def _read_done(self, slot: Slot, job: ReadJob, err: BaseException | None) -> None:
        loading = self._loading.get(slot)
        if loading is None or loading.job is not job:
            return
        key = slot.key
        assert key is not None  # still LOADING: nothing vacated it (cancel removes _loading first)
        if err is None and self.verifier is not None:
            err = self.verifier.check(key, job.digest, job.what)
        cache = loading.model.repack_cache
        if job.from_cache and cache is not None:
            if err is not None and not isinstance(err, errors.ModelStale):
                # The cache failed, not the file: read the file instead, and stop using the cache.
                cache.turn_off(f"reading {job.what} from it failed: {err}")
                loading.job = self._job(loading.model, slot, job.demand, cached=False)
                self.reader.submit(loading.job)
                return
            cache.owner.counts["read"] += 1
        del self._loading[slot]
        self.counters.read_latency_s.observe(time.perf_counter() - loading.started_s)
        self.counters.bytes_read += job.bytes_total
        self.counters.repacked_bytes += job.repacked_bytes
        self.counters.repack_cpu_s += job.repack_cpu_s
        if job.demand:  # an engine waited on it: the transform sat inside that wait
            self.counters.repack_wait_cpu_s += job.repack_cpu_s
        owner = cast("Tenant | None", slot.owner)
        if owner is not None:
            owner.bytes_read += job.bytes_total
            owner.use(key.model_id).bytes_read += job.bytes_total
        if err is None:
            self.store.loaded(slot)
            self.residency.publish(slot)
            loading.done.set_result(None)
        else:
            self._read_failed(slot, loading, err)
        self.room_changed()

    def _read_failed(self, slot: Slot, loading: Loading, err: BaseException) -> None:
        key, model = slot.key, loading.model
        self.counters.read_errors += 1
        model.read_errors += 1
        parts = self.ramtier.segments[slot.class_id].part_names
        failure = self.faults.failed(key, loading.job.what, err, parts, model.path)
        log.error("%s", failure)
        self.store.failed(slot)  # back to the free list before any waiter hears of it
        self.settle()
        if isinstance(err, errors.ModelStale):
            self._on_stale(model, str(err))
        loading.done.set_exception(failure)
        loading.done.exception()  # mark retrieved: a prefetch has no awaiter

    def cancel_prefetch(self, slot: Slot) -> bool:
        """Drop an unreferenced prefetch if none of its reads has started."""
        loading = self._loading.get(slot)
        if loading is None or slot.refs or not slot.prefetched or not self.reader.cancel(loading.job):
            return False
        del self._loading[slot]
        self.store.cancel_prefetch(slot)
        self.settle()
        loading.done.cancel()
        self.room_changed()
        return True

    # ---- room ------------------------------------------------------------------

    async def wait_for_room(self, tenant: Tenant, timeout_s: float) -> None:
        """Until room may have been freed (or `timeout_s`), counted as `tenant` waiting."""
        self.waiting[tenant] = self.waiting.get(tenant, 0) + 1
        fut = self.loop.create_future()
        self._room_waiters.append(fut)
        try:
            await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            pass
        finally:
            if fut in self._room_waiters:
                self._room_waiters.remove(fut)
            self.waiting[tenant] -= 1
            if not self.waiting[tenant]:
                del self.waiting[tenant]

    def room_changed(self) -> None:
        """Room may have been freed: every acquire waiting for it plans again."""
        waiters, self._room_waiters = self._room_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def unref(self, slots, generations) -> None:
        """Give references back (each exactly once; the caller's to keep)."""
        release = self.store.release
        for slot, gen in zip(slots, generations):
            release(slot, gen)
        if self._room_waiters:
            self.room_changed()

    # ---- counting ---------------------------------------------------------------

    def count_access(self, slots, tenant: Tenant, any_ready: bool) -> None:
        """What an access to these slots adds beyond hits and misses (a daemon acquire's
        plan, or one local hit): shared and pinned hits on the READY ones, heat, prefetch hits."""
        c = self.counters
        if any_ready:
            # One copy serving several tenants is the point of the daemon: count it.
            shared = sum(
                1 for s in slots if s.owner is not tenant and s.owner is not None and s.state is SlotState.READY
            )
            c.shared_hits += shared
            tenant.shared_hits += shared
        if self.store.pinned_bytes:
            c.pinned_hits += sum(1 for s in slots if s.pinned and s.state is SlotState.READY)
        if self.heat is not None:
            self.heat.add(slots)
        if c.prefetches:
            for slot in slots:
                if self.store.use_prefetched(slot):
                    c.prefetch_hits += 1


__all__ = ["Loading", "Slots", "wants"]
