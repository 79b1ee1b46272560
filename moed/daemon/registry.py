"""The registry: the open models, their size classes, and the tenants.

It owns:
- the open models (`models`, by id, and by path and file identity), the ids of
  retired ones (so a stale id gets ModelStale, not UnknownModel), and which
  size class each (domain, geometry) has;
- the tenants, by uid, with their quotas set in the store when first seen.

Invariants:
- one `Model` per (path, file identity, layouts made on read) that is not stale
  (`Model.key`); a changed file is a new identity, so a new model, and the old
  one drains (every layout of it); a layout is decided before any model is made
  for it (moed.daemon.onread.served_layouts: a refused layout leaves nothing);
- a model retires only when asked (`retire_stale`, `retire_changed`, the
  max_models bound, a newer version opened): asking whether a file changed
  (`Model.changed_file`) changes nothing;
- a retired model takes no new acquires nor local hits at once; it leaves the
  registry (its files closed, its residency table and private segments gone)
  only once it holds no lease and no slot of it is left in the store
  (`drop_if_drained`, asked again whenever a lease or a local hold of it goes).
  Its pins go with it, through the store, before its slots are dropped.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable

from moed.cache.store import ExpertKey, Store, Want
from moed.protocol import errors

from .access import Peer, check_open_files, check_readable, check_roots, world_readable
from .config import Config, resolve_tenants
from .counters import Counters, Tenant
from .models import LayerPlan, Model, file_identity, model_info, open_catalog
from .onread import layout_key, repacks_for, served_layouts
from .opener import Opener
from .ramtier import RamTier
from .reader import ModelFile
from .repackcache import CacheGeometry, RepackCaches
from .residency import Residency
from .slots import Slots
from .verify import Verifier

log = logging.getLogger("moed")


class Registry:
    def __init__(
        self,
        config: Config,
        slots: Slots,
        opener: Opener,
        counters: Counters,
        models_in_use: Callable[[], set[int]],
        on_added: Callable[[Model], object],
        repack_caches: RepackCaches | None = None,
    ):
        self.config, self.slots, self.opener, self.counters = config, slots, opener, counters
        self.store: Store = slots.store
        self.ramtier: RamTier = slots.ramtier
        self.residency: Residency = slots.residency
        self.verifier: Verifier | None = slots.verifier
        self._models_in_use = models_in_use  # ids of the models some connection opened
        self._on_added = on_added  # a new model is in: the pinned partition may mirror it
        self.repack_caches = repack_caches  # a made-on-read model's experts kept on disk
        self.tenant_quotas = resolve_tenants(config.tenants)
        self.tenants: dict[int, Tenant] = {}
        self.models: dict[int, Model] = {}
        self._by_identity: dict[tuple, Model] = {}  # Model.key -> the live model
        self._classes: dict[tuple, int] = {}  # (domain, size class) -> class id
        self._class_ids = itertools.count(1)
        self._model_ids = itertools.count(1)
        self._retired: set[int] = set()  # ids of stale models already dropped

    # ---- opening -------------------------------------------------------------

    async def open_model(
        self, path: str, peer: Peer | None = None, tenant: Tenant | None = None, layout: str = ""
    ) -> Model:
        """Open (or share) a model; with `peer`, only if that peer could read every file itself.

        `layout`: the expert layout the caller computes on ("" takes the file as it is); a
        plain file asked for a repacked layout is served as its own model, transformed on
        read (moed.daemon.onread), and anything else not in the file is LayoutUnavailable.
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
        catalog = self._open_catalog(real, identity)
        if catalog is None:
            catalog = await self.opener.run(tenant, path, open_catalog, real)
            if catalog.identity[0] != identity:
                raise errors.BadModelFile(f"{path}: the file changed while it was being opened; try again")
        made = served_layouts(catalog, layout)
        model = self._by_identity.get((real, identity, layout_key(made)))  # someone may have opened it meanwhile
        if model is None or model.stale:
            model = self._add_model(real, identity, catalog, made)
        self._check_files(model, path, peer)
        return model

    def _open_catalog(self, path: str, identity: tuple):
        """The catalog of a live model of this very file (any layout), or None: parse it."""
        for (p, ident, _), model in self._by_identity.items():
            if p == path and ident == identity and not model.stale:
                return model.catalog
        return None

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

    def _add_model(self, path: str, identity: tuple, catalog, made: dict[str, str]) -> Model:
        self._retire_older(path, identity)
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
            layers[layer] = LayerPlan(class_id, parts, repacks_for(entry, made) if made else [])
        model = Model(next(self._model_ids), path, catalog, identity, files, layers, domain=domain, layouts=made)
        if made and self.repack_caches is not None:
            model.repack_cache = self.repack_caches.open_cache(
                [f.path for f in files],
                [list(i) for i in catalog.identity],
                [list(kv) for kv in layout_key(made)],
                CacheGeometry(
                    sorted(layers),
                    [[size for _, _, size in layers[k].parts] for k in sorted(layers)],
                    catalog.n_experts,
                ),
            )
        model.wants = {
            layer: [Want(ExpertKey(model.model_id, layer, e), plan.class_id) for e in range(catalog.n_experts)]
            for layer, plan in layers.items()
        }
        self.residency.add_model(model.model_id, list(layers), catalog.n_experts)
        model.info = model_info(model, self.ramtier.segments)
        self.models[model.model_id] = model
        self._by_identity[model.key] = model
        log.info(
            "opened model %d: %s (%d MoE layers, %d experts, top-%d, direct_io=%s, experts %s%s)",
            model.model_id,
            path,
            len(layers),
            catalog.n_experts,
            catalog.n_expert_used,
            model.direct_io,
            model.expert_layout,
            " made on read" if made else "",
        )
        self._on_added(model)
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
        in_use = self._models_in_use()
        idle = [mdl for mdl in live if mdl.model_id not in in_use]
        if not idle:
            raise errors.TooBusy(
                f"{path}: {len(live)} models are open and in use (max_models is {self.config.max_models})",
                busy="models",
            )
        oldest = min(idle, key=lambda mdl: mdl.model_id)
        log.info(
            "model %d: %s closed to make room (max_models is %d; no connection uses it)",
            oldest.model_id,
            oldest.path,
            self.config.max_models,
        )
        self._retire(oldest)

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

    # ---- retiring ------------------------------------------------------------

    def _retire(self, model: Model) -> None:
        """The model takes no new acquires; its slots go once its last lease is released."""
        model.stale = True
        self.residency.retire_model(model.model_id)  # no new local hits on it
        self.drop_if_drained(model)

    def retire_stale(self, model: Model, why: str) -> errors.ModelStale:
        """A file of an open model changed on disk: retire it; the error to raise."""
        if not model.stale:
            self.counters.stale_detected += 1
            log.warning("model %d: %s; no byte of it is served again (open it again)", model.model_id, why)
            self._retire(model)
        return errors.ModelStale(f"{why}; open it again")

    def retire_changed(self) -> None:
        """Retire every open model whose files changed (one fstat per shard each)."""
        for model in list(self.models.values()):
            changed = None if model.stale else model.changed_file()
            if changed is not None:
                self.retire_stale(model, f"{changed.path} changed on disk")

    def _retire_older(self, path: str, identity: tuple) -> None:
        """A changed file is a new model; the old one drains and goes (each of its layouts)."""
        for (p, ident, _), old in list(self._by_identity.items()):
            if p == path and ident != identity and not old.stale:
                log.info("model %d: %s changed on disk; draining the old version", old.model_id, path)
                self._retire(old)

    def drop_if_drained(self, model: Model) -> None:
        """A stale model with no lease left: unpin and drop its slots; once none is left, it goes."""
        if not model.stale or model.leases:
            return
        for key in [k for k, s in self.store.table.items() if k.model_id == model.model_id and s.pinned]:
            self.store.unpin(key)
        self.slots.settle()
        self.store.drop_model(model.model_id)
        self.slots.settle()
        if not any(key.model_id == model.model_id for key in self.store.table):
            self._retired.add(model.model_id)
            self.models.pop(model.model_id, None)
            if self._by_identity.get(model.key) is model:
                del self._by_identity[model.key]
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

    # ---- lookups -------------------------------------------------------------

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

    def close(self) -> None:
        for model in self.models.values():
            model.close()


__all__ = ["Registry"]
