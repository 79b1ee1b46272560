"""The daemon: its rooms wired together, and the operations sessions call.

Runs on the event loop thread only. `Daemon` builds the parts and the rooms
and orchestrates acquire and release on top of them; each room owns its
state and states its invariants:

    slots.py       reads in flight, the pages of dropped slots, waits for room
    registry.py    open models, size classes, tenants; retiring and dropping models
    pins.py        the pinned partition (host mirror)
    localholds.py  hits engines take without a round trip, folded into the books
    prefetch.py    read-ahead per source, and when it is dropped

Each room is given the rooms below it, never the one above: a read that finds
a changed file reports it through a callback (`on_stale`), the registry
mirrors a new model into the pins through one (`on_added`), and only this
module decides when a model that changed on disk is retired.

What must happen before what, for an acquire:
- its model's files are fstat'ed unchanged before a grant (otherwise the
  model is retired here, explicitly, and the acquire gets ModelStale);
- its references are taken in one `Store.acquire` call, and given back
  exactly once: by `release` for a lease, by `PendingAcquire.cancel` for an
  acquire that did not finish, however it ended;
- local hits are folded into the eviction order before the store picks a
  victim, and a demand acquire that finds no room drops queued prefetches
  first (demand goes before read-ahead).

A failed read fails only the acquires waiting on that expert (the slot layer
frees it before they learn of it, moed.daemon.faults quarantines it), and an
acquire's wait for reads ends at its deadline (`ReadTimeout`) while the read
itself runs on and frees or fills the slot.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from moed import __version__
from moed.cache.eviction import make_policy
from moed.cache.store import Slot, Store, Want
from moed.protocol import errors
from moed.protocol.sizes import format_size

from . import repackcache
from .access import Peer
from .config import Config
from .counters import Counters, Tenant
from .faults import DriveFaults
from .heat import Heat
from .localholds import LocalHolds
from .memguard import MemGuard
from .models import Model
from .opener import Opener
from .pins import Pins
from .prefault import Prefaulter
from .prefetch import Prefetches
from .ramtier import RamTier
from .reader import ReaderPool
from .registry import Registry
from .residency import Residency
from .slots import Slots, wants
from .tasks import stop_task
from .turndesk import TurnDesk
from .verify import Verifier

log = logging.getLogger("moed")


@dataclass(eq=False)
class LeaseRecord:
    lease_id: int
    model: Model
    layer: int
    slots: list[Slot]
    generations: list[int]
    tenant: Tenant


class PendingAcquire:
    """One acquire that could not be granted at once, from reservation to grant or cancel.

    It owns the references its plan took (or will take, once there is room):
    `wait()` turns them into a LeaseRecord through `finish` (the daemon's wait for
    room and reads), and any failure or cancellation gives them back through
    `cancel()`, which is idempotent, so whoever ends it first (the waiting task,
    or the connection closing before that task ever ran) ends it exactly once.
    """

    def __init__(
        self,
        finish: Callable[[PendingAcquire], Awaitable[LeaseRecord]],
        give_back: Callable[[list, list], None],
        model: Model,
        layer: int,
        wants: list[Want],
        plan,
        tenant: Tenant,
        deadline: float,
        started_s: float,
    ):
        self._finish, self._give_back = finish, give_back
        self.model, self.layer, self.wants = model, layer, wants
        self.plan, self.tenant, self.deadline = plan, tenant, deadline
        self.ended = False
        self.started_s = started_s  # when the acquire arrived (its service time is recorded at the grant)

    async def wait(self) -> LeaseRecord:
        try:
            lease = await self._finish(self)
        except BaseException:
            self.cancel()
            raise
        self.ended = True  # the references are the lease's now
        return lease

    def cancel(self) -> None:
        if self.ended:
            return
        self.ended = True
        if self.plan is not None:
            self._give_back(self.plan.slots, self.plan.generations)


class Daemon:
    def __init__(self, config: Config, loop: asyncio.AbstractEventLoop):
        self.config = config
        self.started_at = time.time()
        self.pid = os.getpid()
        self.version = __version__
        self.loop = loop
        # The parts, each the owner of its own state (docs/design.md section 3).
        self.counters = Counters()
        # Local holds: the store asks the residency tables before a READY slot leaves.
        self.residency = Residency()
        self.store = Store(config.ram_budget_bytes, make_policy(config.policy), config.pin_budget_bytes, self.residency)
        self.ramtier = RamTier(config.ram_budget_bytes + config.pin_budget_bytes)
        self.reader = ReaderPool(
            config.reader_threads, config.chunk_bytes, config.read_retries, config.read_retry_backoff_s
        )
        self.faults = DriveFaults(config, self.reader)
        self.verifier = Verifier() if config.verify else None
        # decayed access counts per expert, for `moectl pin --from-stats` (only with a pin budget)
        heat = Heat() if config.pin_budget_bytes else None
        # The rooms, lowest first: each is given the rooms below it, never one above.
        self.slots = s = Slots(
            loop,
            self.store,
            self.ramtier,
            self.reader,
            self.residency,
            self.faults,
            self.counters,
            verifier=self.verifier,
            heat=heat,
            on_stale=self._read_found_stale,
        )
        self.prefault = Prefaulter(self.store, self.ramtier, config.prefault)
        self.ramtier.on_remove.append(self.prefault.forget)
        self.memguard = MemGuard(
            self.store,
            config.mem_floor_bytes,
            config.mem_sample_s,
            settle=s.settle,
            room_changed=s.room_changed,
            trim=self.prefault.trim,
        )
        self.pins = Pins(s, self.memguard)
        opener = Opener(config.max_opens_per_tenant, config.open_timeout_s)
        self.repack_caches = repackcache.from_config(
            config.repack_cache_dir, config.repack_cache_bytes, config.direct_io
        )
        self.registry = Registry(
            config, s, opener, self.counters, self._models_in_use, self._model_added, self.repack_caches
        )
        self.holds = LocalHolds(config, s, self.registry, self.counters)
        self.prefetches = Prefetches(s)
        # Compute turns: which engines compute now, with how many threads (moed.daemon.turns)
        self.turns = TurnDesk(loop, config.turn_idle_s, config.turn_max_s, config.turn_user_threads)
        self.sessions: set = set()
        self._lease_ids = itertools.count(1)
        self._maintain_task: asyncio.Task | None = None
        self._wake = asyncio.Event()  # set when a session arrives: the maintenance loop runs again

    # ---- what the rooms hold, as stats and sessions read it ----------------------

    @property
    def models(self) -> dict[int, Model]:
        return self.registry.models

    @property
    def tenants(self) -> dict[int, Tenant]:
        return self.registry.tenants

    @property
    def reads_in_flight(self) -> int:
        return self.slots.reads_in_flight

    def mem_available_bytes(self) -> int:
        return self.memguard.available_bytes()

    def _model_added(self, model: Model) -> None:
        """A new model is in: the pinned partition may mirror it, its classes' pages are made."""
        self.pins.mirror(model)
        self.prefault.plan_model(model)

    def _models_in_use(self) -> set[int]:
        return {mid for s in self.sessions for mid in s.models}

    # ---- models --------------------------------------------------------------

    async def open_model(
        self, path: str, peer: Peer | None = None, tenant: Tenant | None = None, layout: str = ""
    ) -> Model:
        return await self.registry.open_model(path, peer, tenant, layout)

    def model_for(self, model_id: int) -> Model:
        return self.registry.model_for(model_id)

    def tenant(self, uid: int, name: str = "") -> Tenant:
        return self.registry.tenant(uid, name)

    def _retire_if_changed(self, model: Model) -> None:
        """Raise ModelStale, retiring the model, if any of its files changed since it was opened.

        One fstat per shard, before every grant: a cached expert of the old
        content is never served next to a freshly read one of the new.
        """
        changed = model.changed_file()
        if changed is not None:
            raise self.registry.retire_stale(model, f"{changed.path} changed on disk")

    def _read_found_stale(self, model: Model, why: str) -> None:
        self.registry.retire_stale(model, why)

    # ---- acquire -------------------------------------------------------------

    def acquire(
        self, model: Model, layer: int, experts: list[int], tenant: Tenant, timeout_s: float | None = None
    ) -> LeaseRecord | PendingAcquire:
        """A lease if everything is resident now; else a PendingAcquire that owns the wait."""
        started_s = time.perf_counter()
        want = wants(model, layer, experts)
        self._retire_if_changed(model)
        self.faults.refuse_marked(want)  # a quarantined expert fails at once, before any reference
        plan = self._plan(model, want, tenant)
        if plan is not None and not plan.to_load and not plan.loading:
            lease = self._grant(model, layer, plan, tenant)
            self.counters.acquire_latency_s.observe(time.perf_counter() - started_s)
            return lease
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.config.acquire_timeout_s)
        return PendingAcquire(self.finish, self.slots.unref, model, layer, want, plan, tenant, deadline, started_s)

    def _plan(self, model: Model, want: list[Want], tenant: Tenant):
        if self.residency.regions:
            self.holds.fold()  # local hits reach the LRU before it picks a victim
        try:
            plan = self.store.acquire(want, owner=tenant)
            while plan is None and self.prefetches.cancel_newest():
                plan = self.store.acquire(want, owner=tenant)  # demand goes before read-ahead
        except ValueError as exc:
            raise errors.RequestTooLarge(str(exc)) from None
        if plan is not None:
            self._count(plan, tenant)
            if plan.to_load:  # the store drops slots only to reserve new ones: a hit settles nothing
                self.slots.settle()
            for slot in plan.to_load:
                self.slots.start_read(model, slot, demand=True)
            for slot in plan.loading:
                self.slots.promote(slot)
            if plan.to_load and self.faults.behind():
                self.prefetches.drop_queued()
        return plan

    def _count(self, plan, tenant: Tenant) -> None:
        # A key whose read is already in flight is a miss that costs no read.
        c = self.counters
        misses = plan.misses + len(plan.loading)
        c.hits += plan.hits
        c.misses += misses
        c.joined_reads += len(plan.loading)
        tenant.hits += plan.hits
        tenant.misses += misses
        use = tenant.use(plan.slots[0].key.model_id)
        use.hits += plan.hits
        use.misses += misses
        self.slots.count_access(plan.slots, tenant, any_ready=plan.hits > 0)

    async def finish(self, p: PendingAcquire) -> LeaseRecord:
        """Wait for room, then for the reads; the references stay p's until granted."""
        while p.plan is None:
            left = p.deadline - time.monotonic()
            if left <= 0:
                raise errors.BudgetExhausted(self._no_room_message(len(p.wants), p.layer))
            await self.slots.wait_for_room(p.tenant, left)
            p.plan = self._plan(p.model, p.wants, p.tenant)
        plan = p.plan
        pending = self.slots.done(plan.to_load + plan.loading)
        if pending:
            results = await self._wait_reads(pending, p)
            failures = [r for r in results if isinstance(r, BaseException)]
            if failures:
                raise failures[0] if isinstance(failures[0], errors.MoedError) else errors.ReadError(str(failures[0]))
        self._retire_if_changed(p.model)  # the file may have changed while this acquire waited
        lease = self._grant(p.model, p.layer, plan, p.tenant)
        self.counters.acquire_latency_s.observe(time.perf_counter() - p.started_s)
        return lease

    async def _wait_reads(self, pending: list, p: PendingAcquire) -> list:
        """The reads' outcomes, or ReadTimeout at p's deadline (the reads run on: a stalled
        read still ends in the slot layer, which fills or frees its slot)."""
        # shielded: this acquire's end must not cancel a read others wait on
        gathered = asyncio.gather(*map(asyncio.shield, pending), return_exceptions=True)
        try:
            return await asyncio.wait_for(gathered, max(0.0, p.deadline - time.monotonic()))
        except TimeoutError:
            waited = time.perf_counter() - p.started_s
            raise errors.ReadTimeout(
                f"reads of {len(pending)} experts of layer {p.layer} (model {p.model.model_id}) did not "
                f"finish within this acquire's {waited:.1f}s: the drive is slow or stalled"
            ) from None

    def _no_room_message(self, n: int, layer: int) -> str:
        st = self.store
        why = (
            f"the budget is held by leases ({format_size(st.used_bytes)} of {format_size(st.budget_bytes)} used)"
            if st.effective_budget_bytes >= st.budget_bytes
            else self.memguard.why_held()
        )
        return f"no room for {n} experts of layer {layer} before the timeout: {why}"

    def _grant(self, model: Model, layer: int, plan, tenant: Tenant) -> LeaseRecord:
        model.leases += 1
        tenant.use(model.model_id).leases += 1
        return LeaseRecord(next(self._lease_ids), model, layer, plan.slots, plan.generations, tenant)

    # ---- release, prefetch, pins, read errors ------------------------------------

    def release(self, lease: LeaseRecord) -> None:
        """Give a lease's references back (exactly once: its owner forgets it first)."""
        lease.model.leases -= 1
        lease.tenant.use(lease.model.model_id).leases -= 1
        self.slots.unref(lease.slots, lease.generations)
        if lease.model.stale:
            self.registry.drop_if_drained(lease.model)

    def prefetch(self, model: Model, layer: int, experts: list[int], tenant: Tenant, source: object = None) -> int:
        """Queue reads of the experts not resident (moed.daemon.prefetch); returns how many were queued."""
        want = self.faults.unmarked(wants(model, layer, experts))
        self._retire_if_changed(model)
        return self.prefetches.queue(model, layer, want, tenant, source)

    async def pin(self, model: Model, experts, all_experts: bool = False, from_stats: bool = False) -> tuple[int, int]:
        return await self.pins.pin(model, experts, all_experts, from_stats)

    def unpin(self, model: Model, experts, all_experts: bool = False) -> int:
        return self.pins.unpin(model, experts, all_experts)

    def clear_read_errors(self, model: Model | None = None) -> int:
        """Operator: end the quarantine of one model's experts (or all); how many marks went."""
        n = self.faults.quarantine.clear(model.model_id if model is not None else None)
        log.info("cleared %d quarantined experts%s", n, f" of model {model.model_id}" if model else "")
        return n

    # ---- stats and lifecycle -----------------------------------------------------

    def stats(self) -> dict:
        from .counters import snapshot

        self.holds.fold(counters=True)
        return snapshot(self)

    def start(self) -> None:
        self._maintain_task = asyncio.ensure_future(self._maintain())

    def wake(self) -> None:
        """A session arrived: the maintenance loop has work again."""
        self._wake.set()

    def idle(self) -> bool:
        """Nothing for the maintenance loop until a client comes: no session, no hold region
        (live, revoked or adopted) and no read queued or running (a stuck one is watched)."""
        return not self.sessions and not self._holds_to_keep() and not self.reader.busy()

    def _holds_to_keep(self) -> bool:
        """Hold regions (live or revoked), adopted slots or unpins waiting on a whole step:
        what the local-hold maintenance of each period looks after."""
        res, st = self.residency, self.store
        return bool(res.regions or res.revoked or st.adopted or st.unpin_waiting)

    async def _maintain(self, period_s: float = 0.02) -> None:
        """Every `period_s`: fold touches, sweep adopted slots; every 50 periods, counters.
        An idle daemon (`idle`) sleeps until a session arrives: 50 wake-ups a second with
        no client to serve cost a shared box CPU for nothing (issue 30: 0.8% of a core)."""
        n = 0
        while True:
            if self.idle():
                self._wake.clear()
                await self._wake.wait()
            await asyncio.sleep(period_s)
            n += 1
            if n % 25 == 0:
                try:
                    self.faults.watch()  # reads that do not return (twice a second is plenty)
                    if self.faults.behind():  # queued read-ahead would only deepen the stall
                        self.prefetches.drop_queued()
                except Exception:  # noqa: BLE001 - the next period tries again; never lose the loop
                    log.exception("read watch failed")
            try:
                if self.residency.revoked:  # first, and on its own: a failure elsewhere must not keep them
                    self.holds.sweep_revoked()
            except Exception:  # noqa: BLE001 - the next period tries again; never lose the loop
                log.exception("revoked-region sweep failed")
            try:
                if self._holds_to_keep():
                    self.holds.fold(counters=n % 50 == 0)
                    self.holds.sweep_adopted()
                    self.holds.refresh_pins()
                    # Local hits check no file: find changes here, so a changed model stops
                    # being hit locally within one period (its table is zeroed when it retires).
                    self.registry.retire_changed()
            except Exception:  # noqa: BLE001 - the next period tries again; never lose the loop
                log.exception("local-hold maintenance failed")

    async def stop(self) -> None:
        await stop_task(self._maintain_task)
        self._maintain_task = None

    def close(self) -> None:
        self.turns.close()
        self.prefault.close()
        self.reader.close()
        if self.repack_caches is not None:
            self.repack_caches.close()  # what is queued is written, every index saved
        self.registry.close()
        self.ramtier.close()
        self.residency.close()


__all__ = ["Daemon", "LeaseRecord", "PendingAcquire"]
