"""The daemon's state and the operations sessions call: open, acquire, release, prefetch.

Runs on the event loop thread only; reader threads reach it through
`loop.call_soon_threadsafe`. It drives the pure `Store`, starts reads for the
slots the store reserves, and resolves the futures acquires wait on.

What must happen before what:
- a slot's bytes are read and its pages locked before the slot is READY, and
  only READY slots are ever granted;
- a lease's references are taken in one `Store.acquire` call, and given back
  exactly once (release, a failed read, or the connection closing);
- pages of a dropped slot go back to the kernel before anything else runs on
  the loop (`settle`), so locked memory never exceeds the budget for long.

Prefetch: a prefetch only reserves a slot the store can make room for without
touching a held one, and its read queues behind every demand read. A demand
acquire of a key being prefetched joins that read and promotes it. A queued
prefetch whose read has not started is dropped (its slot goes back, counted as
wasted) when it is no longer wanted: the same source prefetches the same
(model, layer) again without it, the source's connection closes, a demand
acquire finds no room while unreferenced prefetches hold the budget, or the
drive is behind (then no new prefetch is issued either: `faults.DriveFaults`).

A failed read fails only the acquires waiting on that expert: the slot goes
back to the free list before they learn of it, the expert is quarantined
(`faults.DriveFaults`), and an acquire's wait for reads ends at its deadline
(`ReadTimeout`) while the read itself runs on and frees or fills the slot.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import weakref
from dataclasses import dataclass, field
from typing import cast

from moed import __version__
from moed.cache.eviction import make_policy
from moed.cache.store import ExpertKey, Slot, SlotState, Store, Want
from moed.protocol import errors
from moed.protocol.sizes import format_size

from .access import Peer, check_open_files, check_readable, check_roots, world_readable
from .bounds import LOCAL_HOLD_SHARE, REVOKE_GRACE_S
from .config import Config, resolve_tenants
from .faults import DriveFaults
from .heat import Heat
from .memguard import MemGuard
from .models import LayerPlan, Model, file_identity, model_info, open_catalog
from .opener import Opener
from .ramtier import RamTier
from .reader import ModelFile, ReaderPool, ReadJob
from .residency import Residency
from .stats import Counters, Tenant
from .tasks import stop_task
from .verify import Verifier, digest

log = logging.getLogger("moed")


@dataclass(eq=False)
class Lease:
    lease_id: int
    model: Model
    layer: int
    slots: list[Slot]
    generations: list[int]
    tenant: Tenant


class PendingAcquire:
    """One acquire that could not be granted at once, from reservation to grant or cancel.

    It owns the references its plan took (or will take, once there is room):
    `wait()` turns them into a Lease, and any failure or cancellation gives them
    back through `cancel()`, which is idempotent, so whoever ends it first (the
    waiting task, or the connection closing before that task ever ran) ends it
    exactly once.
    """

    def __init__(
        self,
        daemon: Daemon,
        model: Model,
        layer: int,
        wants: list[Want],
        plan,
        tenant: Tenant,
        deadline: float,
        started_s: float,
    ):
        self.daemon, self.model, self.layer, self.wants = daemon, model, layer, wants
        self.plan, self.tenant, self.deadline = plan, tenant, deadline
        self.ended = False
        self.started_s = started_s  # when the acquire arrived (its service time is recorded at the grant)

    async def wait(self) -> Lease:
        try:
            lease = await self.daemon._complete(self)
        except BaseException:
            self.cancel()
            raise
        self.ended = True  # the references are the lease's now
        self.daemon.counters.acquire_latency_s.observe(time.perf_counter() - self.started_s)
        return lease

    def cancel(self) -> None:
        if self.ended:
            return
        self.ended = True
        if self.plan is not None:
            self.daemon._unref(self.plan.slots, self.plan.generations)


@dataclass(eq=False)
class Loading:
    """A read in flight for one slot; every acquire of that key awaits `done`."""

    job: ReadJob
    done: asyncio.Future
    started_s: float = field(default_factory=time.perf_counter)


class Daemon:
    def __init__(self, config: Config, loop: asyncio.AbstractEventLoop):
        self.config = config
        self.started_at = time.time()
        self.pid = os.getpid()
        self.version = __version__
        self.loop = loop
        self.store = Store(config.ram_budget_bytes, make_policy(config.policy), config.pin_budget_bytes)
        # Local holds: the store asks the residency tables before a READY slot leaves.
        self.residency = Residency()
        self.store.claim = self.residency.claim
        self.store.unclaim = self.residency.unclaim
        self._maintain_task: asyncio.Task | None = None
        self.ramtier = RamTier(config.ram_budget_bytes + config.pin_budget_bytes)
        self.reader = ReaderPool(
            config.reader_threads, config.chunk_bytes, config.read_retries, config.read_retry_backoff_s
        )
        self.faults = DriveFaults(config, self.reader)
        self.opener = Opener(config.max_opens_per_tenant, config.open_timeout_s)
        self.memguard = MemGuard(
            self.store, config.mem_floor_bytes, config.mem_sample_s, settle=self.settle, room_changed=self.room_changed
        )
        self.tenant_quotas = resolve_tenants(config.tenants)
        self.verifier = Verifier() if config.verify else None
        # decayed access counts per expert, for `moectl pin --from-stats` (only with a pin budget)
        self.heat = Heat() if config.pin_budget_bytes else None
        self.counters = Counters()
        self.tenants: dict[int, Tenant] = {}
        self.models: dict[int, Model] = {}
        self._by_identity: dict[tuple, Model] = {}
        self._classes: dict[tuple, int] = {}  # (domain, size class) -> class id
        self._class_ids = itertools.count(1)
        self._loading: dict[Slot, Loading] = {}
        # source (a session) -> (model_id, layer) -> [(slot, generation)] of its prefetches
        self._prefetched: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._room_waiters: list[asyncio.Future] = []
        self._waiting: dict[Tenant, int] = {}  # tenant -> its acquires waiting for room now
        self._model_ids = itertools.count(1)
        self._retired: set[int] = set()  # ids of stale models already dropped
        self._lease_ids = itertools.count(1)
        self.sessions: set = set()

    # ---- models ----------------------------------------------------------

    async def open_model(self, path: str, peer: Peer | None = None, tenant: Tenant | None = None) -> Model:
        """Open (or share) a model; with `peer`, only if that peer could read every file itself.

        The header parse runs in the opener (bounded per `tenant`, deadlined). The
        model's identity is that of the descriptors its headers were parsed from,
        and the files the reader opens must still be those same files.
        """
        if not os.path.isabs(path):
            raise errors.BadRequest(f"model path must be absolute (the daemon has its own cwd): {path!r}")
        if "\0" in path:
            raise errors.BadRequest("model path contains a NUL byte")
        real = os.path.realpath(path)
        check_roots(real, path, self.config.model_roots)
        if peer is not None:
            check_readable(peer, real, path)
        try:
            identity = file_identity(real)
        except FileNotFoundError:
            raise errors.BadModelFile(f"{path}: no such file") from None
        except OSError as exc:
            raise errors.BadModelFile(f"{path}: {exc.strerror}") from None
        model = self._by_identity.get((real, identity))
        if model is not None and not model.stale:
            self._check_files(model, path, peer)
            return model
        catalog = await self.opener.run(tenant, path, open_catalog, real)
        if catalog.identity[0] != identity:
            raise errors.BadModelFile(f"{path}: the file changed while it was being opened; try again")
        model = self._by_identity.get((real, identity))  # someone else opened it meanwhile
        if model is None or model.stale:
            model = self._add_model(real, identity, catalog)
        self._check_files(model, path, peer)
        return model

    def _check_files(self, model: Model, shown: str, peer: Peer | None) -> None:
        """Every shard under the roots and readable by the peer, judged on the inodes we read."""
        for f in model.files[1:]:
            check_roots(os.path.realpath(f.path), f.path, self.config.model_roots)
            if peer is not None:
                check_readable(peer, os.path.realpath(f.path), f.path)
        if peer is None:
            return
        check_open_files(peer, [(f.fd, f.path) for f in model.files])
        st = os.fstat(model.files[0].fd)
        if (st.st_dev, st.st_ino) != tuple(model.identity[:2]):
            raise errors.PermissionDenied(f"{shown}: the file changed while it was being opened")

    def _add_model(self, path: str, identity: tuple, catalog) -> Model:
        self._retire_older(path)
        self._make_room_for_model(path)
        files = self._open_files(path, catalog)
        layers = {}
        # Models anyone may read share segments by geometry; any other model gets
        # its own, keyed by the files' identity (never by path: a file renamed
        # over a private one must not see its segments), since a client maps
        # whole segments (security: see access.py).
        domain = None if all(world_readable(f.path) for f in files) else catalog.identity
        for layer, entry in catalog.layers.items():
            key = entry.size_class  # parts in catalog order, with sizes
            class_id = self._class_for(key, domain)
            parts = [(files[entry.parts[p].shard], entry.parts[p].offset, size) for p, size in key]
            layers[layer] = LayerPlan(class_id, parts)
        model = Model(next(self._model_ids), path, catalog, identity, files, layers, domain=domain)
        model.wants = {
            layer: [Want(ExpertKey(model.model_id, layer, e), plan.class_id) for e in range(catalog.n_experts)]
            for layer, plan in layers.items()
        }
        self.residency.add_model(model.model_id, list(layers), catalog.n_experts)
        model.info = model_info(model, self.ramtier.segments)
        self.models[model.model_id] = model
        self._by_identity[(path, identity)] = model
        log.info(
            "opened model %d: %s (%d MoE layers, %d experts, top-%d, direct_io=%s)",
            model.model_id,
            path,
            len(layers),
            catalog.n_experts,
            catalog.n_expert_used,
            model.direct_io,
        )
        if self.store.pin_budget_bytes and self._model_fits_pins(model):
            self._pin_keys(model, self._all_experts(model))  # the whole model fits: mirror it
        return model

    def _open_files(self, path: str, catalog) -> list[ModelFile]:
        """The reader's descriptors: the resolved shard paths, each still the file parsed."""
        files: list[ModelFile] = []
        try:
            for shard, expected in zip(catalog.files, catalog.identity):
                files.append(ModelFile(os.path.realpath(shard), self.config.direct_io))
                if files[-1].identity != expected:
                    raise errors.BadModelFile(f"{shard}: the file changed while it was being opened; try again")
        except OSError as exc:
            raise errors.BadModelFile(f"{path}: {exc.strerror or exc}") from None
        except BaseException:
            for f in files:
                f.close()
            raise
        return files

    def _make_room_for_model(self, path: str) -> None:
        """Keep at most max_models open: close the least recently opened one no connection uses."""
        live = [mdl for mdl in self.models.values() if not mdl.stale]
        if len(live) < self.config.max_models:
            return
        in_use = {mid for s in self.sessions for mid in s.models}
        idle = [mdl for mdl in live if mdl.model_id not in in_use]
        if not idle:
            raise errors.TooBusy(
                f"{path}: {len(live)} models are open and in use (max_models is {self.config.max_models})"
            )
        oldest = min(idle, key=lambda mdl: mdl.model_id)
        log.info(
            "model %d: %s closed to make room (max_models is %d; no connection uses it)",
            oldest.model_id,
            oldest.path,
            self.config.max_models,
        )
        self._retire(oldest)

    def _retire(self, model: Model) -> None:
        """The model takes no new acquires; its slots go once its last lease is released."""
        model.stale = True
        self.residency.retire_model(model.model_id)  # no new local hits on it
        self._maybe_drop_stale(model)

    def went_stale(self, model: Model, why: str) -> errors.ModelStale:
        """A file of an open model changed on disk: retire it; the error to raise."""
        if not model.stale:
            self.counters.stale_detected += 1
            log.warning("model %d: %s; no byte of it is served again (open it again)", model.model_id, why)
            self._retire(model)
        return errors.ModelStale(f"{why}; open it again")

    def check_current(self, model: Model) -> None:
        """Raise ModelStale (retiring the model) if any of its files changed since it was opened.

        One fstat per shard, before every grant: a cached expert of the old
        content is never served next to a freshly read one of the new.
        """
        for f in model.files:
            if f.changed():
                raise self.went_stale(model, f"{f.path} changed on disk")

    def _retire_older(self, path: str) -> None:
        """A changed file is a new model; the old one drains and goes."""
        for (p, _), old in list(self._by_identity.items()):
            if p == path and not old.stale:
                log.info("model %d: %s changed on disk; draining the old version", old.model_id, path)
                self._retire(old)

    def _maybe_drop_stale(self, model: Model) -> None:
        if not model.stale or model.leases:
            return
        self.unpin(model, [], all_experts=True)
        self.store.drop_model(model.model_id)
        self.settle()
        if not any(key.model_id == model.model_id for key in self.store.table):
            self._retired.add(model.model_id)
            self.models.pop(model.model_id, None)
            self._by_identity.pop((model.path, model.identity), None)
            model.close()
            self.residency.drop_model(model.model_id)
            if self.verifier is not None:
                self.verifier.forget(model.model_id)
            if model.domain is not None:
                self._drop_domain(model.domain)

    def _drop_domain(self, domain) -> None:
        """A private model's segments go with it (no other model can use them)."""
        if any(mdl.domain == domain for mdl in self.models.values()):
            return
        for (dom, key), class_id in list(self._classes.items()):
            if dom == domain and self.store.remove_class(class_id):
                del self._classes[(dom, key)]
                self.ramtier.remove_segment(class_id)
                self.residency.remove_class(class_id)

    def _class_for(self, key: tuple, domain=None) -> int:
        class_id = self._classes.get((domain, key))
        if class_id is None:
            class_id = next(self._class_ids)
            names = [p for p, _ in key]
            seg = self.ramtier.add_segment(class_id, names, [b for _, b in key])
            self.store.add_class(class_id, seg.slot_bytes, seg.capacity)
            self.residency.add_class(class_id, seg.capacity)
            self._classes[(domain, key)] = class_id
        return class_id

    def model_for(self, model_id: int) -> Model:
        model = self.models.get(model_id)
        if model is None:
            if model_id in self._retired:
                raise errors.ModelStale(f"model {model_id} changed on disk and was retired; open it again")
            raise errors.UnknownModel(f"no open model with id {model_id}")
        if model.stale:
            raise errors.ModelStale(f"{model.path} changed on disk (or was closed); open it again")
        return model

    def tenant(self, uid: int, name: str = "") -> Tenant:
        t = self.tenants.get(uid)
        if t is None:
            t = self.tenants[uid] = Tenant(uid)
            quota = self.tenant_quotas.get(uid)
            if quota is not None:
                t.floor_bytes, t.ceiling_bytes = quota.floor_bytes, quota.ceiling_bytes
                self.store.set_quota(t, quota.floor_bytes, quota.ceiling_bytes)
        if name:
            t.names.add(name)
        return t

    # ---- acquire -----------------------------------------------------------

    def _wants(self, model: Model, layer: int, experts: list[int]) -> list[Want]:
        table = model.wants.get(layer)
        if table is None:
            raise errors.UnknownLayer(
                f"model {model.model_id} has no routed experts in layer {layer} (MoE layers: {sorted(model.layers)})"
            )
        if not experts:
            raise errors.BadRequest("acquire needs at least one expert")
        try:
            wants = [table[e] for e in experts]
        except (IndexError, TypeError):
            wants = []
        if len(wants) != len(experts) or min(experts) < 0:
            bad = next((e for e in experts if not 0 <= e < len(table)), experts[0])
            raise errors.UnknownExpert(f"expert {bad} out of range 0..{len(table) - 1} (layer {layer})")
        if len(set(experts)) != len(experts):
            wants = list(dict.fromkeys(wants))
        return wants

    def acquire(
        self, model: Model, layer: int, experts: list[int], tenant: Tenant, timeout_s: float | None = None
    ) -> Lease | PendingAcquire:
        """A lease if everything is resident now; else a PendingAcquire that owns the wait."""
        started_s = time.perf_counter()
        wants = self._wants(model, layer, experts)
        self.check_current(model)
        self.faults.refuse_marked(wants)  # a quarantined expert fails at once, before any reference
        plan = self._plan(wants, tenant)
        if plan is not None and not plan.to_load and not plan.loading:
            lease = self._grant(model, layer, plan, tenant)
            self.counters.acquire_latency_s.observe(time.perf_counter() - started_s)
            return lease
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.config.acquire_timeout_s)
        return PendingAcquire(self, model, layer, wants, plan, tenant, deadline, started_s)

    def _plan(self, wants, tenant):
        if self.residency.regions:
            self.fold_local()  # local hits reach the LRU before it picks a victim
        try:
            plan = self.store.acquire(wants, owner=tenant)
            while plan is None and self._cancel_newest_prefetch():
                plan = self.store.acquire(wants, owner=tenant)  # demand goes before read-ahead
        except ValueError as exc:
            raise errors.RequestTooLarge(str(exc)) from None
        if plan is not None:
            self._count(plan, tenant)
            if plan.to_load:  # the store drops slots only to reserve new ones: a hit settles nothing
                self.settle()
            for slot in plan.to_load:
                self._start_read(slot, demand=True)
            for slot in plan.loading:
                self.reader.promote(self._loading[slot].job)
            if plan.to_load and self.faults.behind():
                self._drop_queued_prefetches()
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
        self._count_slots(plan.slots, tenant, any_ready=plan.hits > 0)

    def _count_slots(self, slots, tenant: Tenant, any_ready: bool) -> None:
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

    async def _complete(self, p: PendingAcquire) -> Lease:
        """Wait for room, then for the reads; the references stay p's until granted."""
        while p.plan is None:
            left = p.deadline - time.monotonic()
            if left <= 0:
                raise errors.BudgetExhausted(self._no_room_message(len(p.wants), p.layer))
            self._waiting[p.tenant] = self._waiting.get(p.tenant, 0) + 1
            try:
                await self._wait_for_room(left)
            finally:
                self._waiting[p.tenant] -= 1
                if not self._waiting[p.tenant]:
                    del self._waiting[p.tenant]
            p.plan = self._plan(p.wants, p.tenant)
        plan = p.plan
        pending = [self._loading[s].done for s in plan.to_load + plan.loading if s in self._loading]
        if pending:
            results = await self._wait_reads(pending, p)
            failures = [r for r in results if isinstance(r, BaseException)]
            if failures:
                raise failures[0] if isinstance(failures[0], errors.MoedError) else errors.ReadError(str(failures[0]))
        self.check_current(p.model)  # the file may have changed while this acquire waited
        return self._grant(p.model, p.layer, plan, p.tenant)

    async def _wait_reads(self, pending: list, p: PendingAcquire) -> list:
        """The reads' outcomes, or ReadTimeout at p's deadline (the reads run on: a stalled
        read still ends in `_read_done`, which fills or frees its slot)."""
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

    def _grant(self, model: Model, layer: int, plan, tenant: Tenant) -> Lease:
        model.leases += 1
        tenant.use(model.model_id).leases += 1
        return Lease(next(self._lease_ids), model, layer, plan.slots, plan.generations, tenant)

    async def _wait_for_room(self, timeout_s: float) -> None:
        fut = self.loop.create_future()
        self._room_waiters.append(fut)
        try:
            await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            pass
        finally:
            if fut in self._room_waiters:
                self._room_waiters.remove(fut)

    def room_changed(self) -> None:
        waiters, self._room_waiters = self._room_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    # ---- reads -------------------------------------------------------------

    def _start_read(self, slot: Slot, demand: bool) -> None:
        key = slot.key
        assert key is not None  # a reserved (LOADING) slot always has its key
        plan = self.models[key.model_id].layers[key.layer]
        seg = self.ramtier.segments[slot.class_id]
        pieces = [
            (f, off + key.expert * size, size, seg.part_addr(slot.index, k))
            for k, (f, off, size) in enumerate(plan.parts)
        ]
        job = ReadJob(
            pieces,
            self._read_done_thread,
            demand=demand,
            tag=slot,
            what=f"model {key.model_id} layer {key.layer} expert {key.expert}",
        )
        self._loading[slot] = Loading(job, self.loop.create_future())
        if not demand and not slot.pinned:
            self.counters.prefetches += 1
        self.reader.submit(job)

    def _read_done_thread(self, job: ReadJob, err: BaseException | None) -> None:
        """Reader thread: lock the filled pages, then hand over to the loop."""
        slot = cast(Slot, job.tag)
        if err is None:
            # Bytes read after the file changed (or while it changed) are never served.
            changed = next((f for f in {p[0] for p in job.pieces} if f.changed()), None)
            if changed is not None:
                err = errors.ModelStale(f"{changed.path} changed on disk while {job.what} was read")
        if err is None:
            self.ramtier.lock_slot(self.ramtier.segments[slot.class_id], slot.index)
            if self.verifier is not None:
                job.digest = digest(job.pieces)  # hashed here, off the event loop
        self.loop.call_soon_threadsafe(self._read_done, slot, job, err)

    def _read_done(self, slot: Slot, job: ReadJob, err: BaseException | None) -> None:
        loading = self._loading.get(slot)
        if loading is None or loading.job is not job:
            return
        del self._loading[slot]
        self.counters.read_latency_s.observe(time.perf_counter() - loading.started_s)
        self.counters.bytes_read += job.bytes_total
        key, owner = slot.key, cast("Tenant | None", slot.owner)
        assert key is not None  # still LOADING: nothing vacated it (cancel removes _loading first)
        if owner is not None:
            owner.bytes_read += job.bytes_total
            owner.use(key.model_id).bytes_read += job.bytes_total
        if err is None and self.verifier is not None:
            err = self.verifier.check(key, job.digest, job.what)
        if err is None:
            self.store.loaded(slot)
            self.residency.publish(slot)
            loading.done.set_result(None)
        else:
            self.counters.read_errors += 1
            model = self.models.get(key.model_id)
            if model is not None:
                model.read_errors += 1
            parts = self.ramtier.segments[slot.class_id].part_names
            failure = self.faults.failed(key, job.what, err, parts, model.path if model is not None else "")
            log.error("%s", failure)
            self.store.failed(slot)  # back to the free list before any waiter hears of it
            self.settle()
            if isinstance(err, errors.ModelStale) and model is not None:
                self.went_stale(model, str(err))
            loading.done.set_exception(failure)
            loading.done.exception()  # mark retrieved: a prefetch has no awaiter
        self.room_changed()

    def settle(self) -> None:
        """Give the pages of dropped slots back to the kernel."""
        for slot in self.store.take_dropped():
            self.ramtier.release_slot(self.ramtier.segments[slot.class_id], slot.index)

    # ---- release / prefetch --------------------------------------------------

    def release(self, lease: Lease) -> None:
        """Give a lease's references back (exactly once: its owner forgets it first)."""
        lease.model.leases -= 1
        lease.tenant.use(lease.model.model_id).leases -= 1
        self._unref(lease.slots, lease.generations)
        if lease.model.stale:
            self._maybe_drop_stale(lease.model)

    def _unref(self, slots, generations) -> None:
        release = self.store.release
        for slot, gen in zip(slots, generations):
            release(slot, gen)
        if self._room_waiters:
            self.room_changed()

    def prefetch(self, model: Model, layer: int, experts: list[int], tenant: Tenant, source: object = None) -> int:
        """Queue reads of the experts not resident; returns how many were queued.

        `source` (the session) supersedes its own earlier prefetches of this layer.
        """
        wants = self.faults.unmarked(self._wants(model, layer, experts))
        self.check_current(model)
        mine = self._supersede(source, (model.model_id, layer), {w.key for w in wants})
        if self.faults.behind():  # read-ahead would only deepen the drive's queue
            self.faults.prefetch_dropped += sum(1 for w in wants if w.key not in self.store.table)
            self._drop_queued_prefetches()
            return 0
        queued = 0
        for want in wants:
            slot = self.store.prefetch(want, owner=tenant)
            if slot is not None:
                self.settle()
                self._start_read(slot, demand=False)
                mine.append((slot, slot.generation))
                queued += 1
        return queued

    def _supersede(self, source, where: tuple, keep: set) -> list:
        """Cancel `source`'s queued prefetches at `where` not in `keep`; returns the list to extend."""
        if source is None:
            return []
        by_layer = self._prefetched.setdefault(source, {})
        alive = []
        for slot, gen in by_layer.get(where, ()):
            if slot.generation != gen or slot.state != SlotState.LOADING:
                continue  # its read finished or failed: nothing to drop
            if slot.key in keep or not self._cancel_prefetch(slot):
                alive.append((slot, gen))
        by_layer[where] = alive
        return alive

    def forget_prefetches(self, source) -> None:
        """The source went away: its prefetches whose reads have not started are dropped."""
        for entries in self._prefetched.pop(source, {}).values():
            for slot, gen in entries:
                if slot.generation == gen and slot.state == SlotState.LOADING:
                    self._cancel_prefetch(slot)

    def _drop_queued_prefetches(self) -> None:
        """The drive is behind: drop every prefetch whose read has not started (counted)."""
        for job in self.reader.queued_prefetches():
            slot = cast(Slot, job.tag)
            if slot in self._loading and not slot.pinned and self._cancel_prefetch(slot):
                self.faults.prefetch_dropped += 1

    def clear_read_errors(self, model: Model | None = None) -> int:
        """Operator: end the quarantine of one model's experts (or all); how many marks went."""
        n = self.faults.quarantine.clear(model.model_id if model is not None else None)
        log.info("cleared %d quarantined experts%s", n, f" of model {model.model_id}" if model else "")
        return n

    def _cancel_newest_prefetch(self) -> bool:
        """Drop the newest queued, unreferenced prefetch; False if there is none."""
        for slot in reversed(list(self._loading)):
            if slot.prefetched and not slot.refs and self._cancel_prefetch(slot):
                return True
        return False

    def _cancel_prefetch(self, slot: Slot) -> bool:
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

    # ---- the pinned partition (host mirror) -------------------------------------

    async def pin(self, model: Model, experts, all_experts: bool = False, from_stats: bool = False) -> tuple[int, int]:
        """Pin experts hottest first until the pin budget is full; wait for their reads.

        Returns (newly pinned, skipped for want of pin budget).
        """
        if not self.store.pin_budget_bytes:
            raise errors.BadRequest("this daemon has no pin budget (start it with --pin-budget)")
        if all_experts or self._model_fits_pins(model):
            order = self._all_experts(model)
        elif from_stats:
            if self.heat is None:
                raise errors.BadRequest("no access counts kept (no pin budget at start)")
            order = self.heat.ranked(model.model_id)
        else:
            order = [tuple(p) for p in experts]
        pinned, skipped, slots = self._pin_keys(model, order)
        waits = [self._loading[s].done for s in slots if s in self._loading]
        if waits:
            results = await asyncio.gather(*waits, return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                raise errors.ReadError(f"{len(failed)} pinned experts could not be read: {failed[0]}")
        log.info(
            "pinned %d experts of model %d (%d skipped); pinned partition %d of %d bytes",
            pinned,
            model.model_id,
            skipped,
            self.store.pinned_bytes,
            self.store.pin_budget_bytes,
        )
        return pinned, skipped

    def _pin_keys(self, model: Model, order) -> tuple[int, int, list[Slot]]:
        pinned, skipped, slots = 0, 0, []
        growing_refused = self.memguard.active  # reading new experts in is growth
        for layer, expert in order:
            (want,) = self._wants(model, layer, [expert])
            if growing_refused and want.key not in self.store.table:
                skipped += 1
                continue
            got = self.store.pin(want)
            if got is None:
                skipped += 1
                continue
            slot, new, must_read = got
            pinned += new
            slots.append(slot)
            if must_read:
                self._start_read(slot, demand=False)
        self.room_changed()  # pinning resident keys freed room in the shared budget
        return pinned, skipped, slots

    def unpin(self, model: Model, experts, all_experts: bool = False) -> int:
        if all_experts:
            keys = [k for k, s in self.store.table.items() if k.model_id == model.model_id and s.pinned]
        else:
            keys = [w.key for layer, e in experts for w in self._wants(model, layer, [e])]
        n = sum(1 for k in keys if self.store.unpin(k))
        self.settle()
        return n

    def _all_experts(self, model: Model) -> list[tuple[int, int]]:
        return [(layer, e) for layer in sorted(model.layers) for e in range(model.catalog.n_experts)]

    def _model_fits_pins(self, model: Model) -> bool:
        st = self.store
        mine = sum(s.slot_bytes for k, s in st.table.items() if k.model_id == model.model_id and s.pinned)
        whole = sum(st.classes[p.class_id].slot_bytes for p in model.layers.values()) * model.catalog.n_experts
        return whole <= st.pin_budget_bytes - st.pinned_bytes + mine

    # ---- stats ---------------------------------------------------------------

    def stats(self) -> dict:
        from .stats import snapshot

        self.fold_local(counters=True)
        return snapshot(self)

    @property
    def reads_in_flight(self) -> int:
        return len(self._loading)

    def mem_available_bytes(self) -> int:
        return self.memguard.available_bytes()

    def close(self) -> None:
        self.reader.close()
        for model in self.models.values():
            model.close()
        self.ramtier.close()
        self.residency.close()

    # ---- local holds (hits without a round trip) ---------------------------------

    def close_local(self, session, revoke: bool = False) -> None:
        """A connection with a hold region closed: count what it recorded, then its holds
        end: at once if its peer left, once released (or the grace ends) if we closed it."""
        self.fold_local(counters=True, only=session)
        if revoke:
            cap = self.config.max_clients_per_tenant
            ended = self.residency.revoke(session, time.monotonic(), session.tenant, cap, self._fold_ending)
            self._warn_ended(ended)
        else:
            self.residency.close_region(session)
        self.sweep_adopted()

    def sweep_revoked(self) -> None:
        """Revoked regions that hold nothing live (or outlived the grace) stop counting;
        what their engines recorded is counted first."""
        self._warn_ended(self.residency.sweep_revoked(time.monotonic(), self._fold_ending))

    def _fold_ending(self, session) -> None:
        self.fold_local(counters=True, only=session)

    @staticmethod
    def _warn_ended(ended: list) -> None:
        for session, holds in ended:
            log.warning(
                "pid %d (uid %d) kept %d local holds after the daemon closed its connection "
                "(past the %.0fs grace, or past its tenant's revoked regions); "
                "they no longer keep slots from eviction",
                session.pid,
                session.uid,
                holds,
                REVOKE_GRACE_S,
            )

    def fold_local(self, counters: bool = False, only=None) -> None:
        """Fold what engines recorded in their regions: recency (touches) into the
        eviction order, so the shared LRU sees local hits; with `counters`, local hit
        counts into the stats."""
        res, store = self.residency, self.store
        for session in [only] if only is not None else [*res.regions, *res.revoked]:
            for class_id, index in res.touches(session):
                cls = store.classes.get(class_id)
                slot = cls.slots.get(index) if cls is not None else None
                if slot is not None and slot.state is SlotState.READY and slot.key is not None:
                    self._count_local(slot, session.tenant)
            if counters:
                for model_id, hits in res.local_hits(session).items():
                    if model_id in self.models:
                        self.counters.local_hits += hits
                        self.counters.hits += hits
                        session.tenant.hits += hits
                        session.tenant.use(model_id).hits += hits

    def _count_local(self, slot: Slot, tenant: Tenant) -> None:
        """One local hit on `slot`: recency and the per-slot counts a daemon hit keeps
        (hit totals come from the regions' counters, which cannot overflow)."""
        self.store.touch_local(slot)
        self._count_slots([slot], tenant, any_ready=True)

    def sweep_adopted(self) -> None:
        """Give back the references the store took for local holds that are gone."""
        released = False
        for slot in list(self.store.adopted):
            if not self.residency.held(slot.class_id, slot.index, slot.generation):
                key = slot.key
                self.store.release_adopted(slot)
                released = True
                model = self.models.get(key.model_id) if key is not None else None
                if model is not None and model.stale:
                    self._maybe_drop_stale(model)
        if released:
            self.settle()
            self.room_changed()
        if self.store.adopted:
            self._bound_local_holds()

    def _bound_local_holds(self) -> None:
        """No tenant keeps another from room by holding more than LOCAL_HOLD_SHARE of the
        budget locally: while another tenant's acquire waits for room, the connections
        of one that does are closed and their regions revoked (their holds count until
        released, at most REVOKE_GRACE_S). A tenant starving only itself is left alone,
        as with socket leases."""
        if not self._waiting:
            return
        cap = int(self.store.budget_bytes * LOCAL_HOLD_SHARE)
        by_tenant: dict[Tenant, int] = {}
        holders: dict[Tenant, set] = {}
        for slot in self.store.adopted:
            for session in self.residency.holders(slot.class_id, slot.index, slot.generation):
                by_tenant[session.tenant] = by_tenant.get(session.tenant, 0) + slot.slot_bytes
                holders.setdefault(session.tenant, set()).add(session)
            # A cut-off tenant's revoked holds still count against it: a new connection
            # holding the same slots again is over the share too.
            for tenant in self.residency.revoked_owners(slot.class_id, slot.index, slot.generation):
                by_tenant[tenant] = by_tenant.get(tenant, 0) + slot.slot_bytes
        for tenant, held in by_tenant.items():
            if held > cap and holders.get(tenant) and any(t is not tenant for t in self._waiting):
                log.warning(
                    "uid %d holds %s locally, over its share %s of the budget: closing %d connection(s)",
                    tenant.uid,
                    format_size(held),
                    format_size(cap),
                    len(holders[tenant]),
                )
                for session in holders[tenant]:  # only open ones: revoked ones run out their grace
                    session.transport.abort()

    def _check_files_changed(self) -> None:
        """Local hits check no file: find changes here, so a changed model stops being
        hit locally within one period (its table is zeroed when it is retired)."""
        for model in list(self.models.values()):
            if not model.stale:
                try:
                    self.check_current(model)
                except errors.ModelStale:
                    pass

    def start(self) -> None:
        self._maintain_task = asyncio.ensure_future(self._maintain())

    async def _maintain(self, period_s: float = 0.02) -> None:
        """Every `period_s`: fold touches, sweep adopted slots; every 50 periods, counters."""
        n = 0
        while True:
            await asyncio.sleep(period_s)
            n += 1
            if n % 25 == 0:
                try:
                    self.faults.watch()  # reads that do not return (twice a second is plenty)
                    if self.faults.behind():  # queued read-ahead would only deepen the stall
                        self._drop_queued_prefetches()
                except Exception:  # noqa: BLE001 - the next period tries again; never lose the loop
                    log.exception("read watch failed")
            try:
                if self.residency.revoked:  # first, and on its own: a failure elsewhere must not keep them
                    self.sweep_revoked()
            except Exception:  # noqa: BLE001 - the next period tries again; never lose the loop
                log.exception("revoked-region sweep failed")
            try:
                if self.residency.regions or self.residency.revoked or self.store.adopted:
                    self.fold_local(counters=n % 50 == 0)
                    self.sweep_adopted()
                    self._check_files_changed()
            except Exception:  # noqa: BLE001 - the next period tries again; never lose the loop
                log.exception("local-hold maintenance failed")

    async def stop(self) -> None:
        await stop_task(self._maintain_task)
        self._maintain_task = None


__all__ = ["Daemon", "Lease", "PendingAcquire"]
