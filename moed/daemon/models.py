"""Open models: catalog plus open files plus each layer's size class.

A model is identified by its files' identity (device, inode, size, mtime and
ctime of every shard, `moed.gguf.header.identity_of`), so two engines opening the
same file share one `Model`, one set of slots and one set of file descriptors.
A file that changed since it was opened (overwritten in place included: every
grant and every read checks with fstat) is a new identity: the old model goes
stale, refuses new acquires with ModelStale, and its slots are dropped once its
last lease is released. At most `max_models` are open; beyond that the least
recently opened one no connection uses is closed the same way.

Size classes are keyed by their parts' names and byte sizes and shared across
models: two models with the same expert geometry share a segment, provided
both are readable by everyone (a client maps whole segments; a model that is
not gets segments of its own, see access.world_readable).

A plain file opened in a repacked layout (`layouts`: made on read, moed.daemon.onread)
is a model of its own beside the file's plain one: same files and catalog, its own
id and slots (the store keys slots by model id), the same size classes (a repacked
expert is as large as its plain bytes).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moed.gguf.catalog import Catalog
from moed.gguf.header import identity_of
from moed.gguf.layouts import summary
from moed.protocol import errors
from moed.protocol.messages import LayerInfo, ModelInfo, PartExtent

from .onread import PartRepack, layout_key
from .reader import ModelFile

if TYPE_CHECKING:
    from .ramtier import TierSegment
    from .repackcache import RepackCache


@dataclass(eq=False)
class LayerPlan:
    class_id: int
    # per part, in the segment's part order: (file, offset of expert 0, bytes per expert)
    parts: list[tuple[ModelFile, int, int]]
    # per part, the same order: its transform on read (moed.daemon.onread), or None
    repacks: list[PartRepack | None] = field(default_factory=list)


@dataclass(eq=False)
class Model:
    model_id: int
    path: str
    catalog: Catalog
    identity: tuple
    files: list[ModelFile]
    layers: dict[int, LayerPlan]
    info: ModelInfo | None = None
    wants: dict = field(default_factory=dict)  # layer -> [Want per expert], built once: the hit path indexes it
    stale: bool = False
    domain: object = None  # None: shares segments by geometry; else its files' identity (private)
    leases: int = 0  # leases held on it now, by every connection (kept by core)
    read_errors: int = 0  # reads of its experts that failed (after their retries)
    layouts: dict[str, str] = field(default_factory=dict)  # {type: layout} made on read; empty: the file's bytes
    repack_cache: RepackCache | None = None  # made on read: its experts kept on disk (moed.daemon.repackcache)

    @property
    def key(self) -> tuple:
        """What the registry knows it by: one model per (path, file identity, layouts made on read)."""
        return (self.path, self.identity, layout_key(self.layouts))

    @property
    def expert_layout(self) -> str:
        """The layout its experts are served in: the file's, or the one made on read."""
        if not self.layouts:
            return self.catalog.expert_layout
        return summary(self.layouts, self.catalog.expert_types)

    @property
    def direct_io(self) -> bool:
        return all(f.direct for f in self.files)

    def changed_file(self) -> ModelFile | None:
        """The first shard no longer the file opened (one fstat each), or None.

        Only a question: what a changed file means (the model retires) is the
        registry's to decide, and its caller's to ask for."""
        return next((f for f in self.files if f.changed()), None)

    def close(self) -> None:
        if self.repack_cache is not None:
            self.repack_cache.close()
        for f in self.files:
            f.close()


def file_identity(path: str) -> tuple:
    return identity_of(os.stat(path))


def open_catalog(path: str) -> Catalog:
    try:
        return Catalog.open(path)
    except errors.MoedError:
        raise
    except FileNotFoundError:
        raise errors.BadModelFile(f"{path}: no such file") from None
    except OSError as exc:
        raise errors.BadModelFile(f"{path}: {exc.strerror or exc}") from None
    except Exception as exc:  # noqa: BLE001 - a parser bug on odd input is still bad input
        raise errors.BadModelFile(f"{path}: cannot read as GGUF ({exc})") from None


def model_info(model: Model, class_segments: Mapping[int, TierSegment]) -> ModelInfo:
    cat = model.catalog
    layers = []
    for layer in sorted(model.layers):
        entry = cat.layers[layer]
        key = entry.size_class
        parts = [
            PartExtent(
                p,
                entry.parts[p].shard,
                entry.parts[p].offset,
                size,
                entry.parts[p].ggml_type,
                list(entry.parts[p].shape),
            )
            for p, size in key
        ]
        layers.append(LayerInfo(layer, model.layers[layer].class_id, parts))
    used = sorted({plan.class_id for plan in model.layers.values()})
    return ModelInfo(
        model_id=model.model_id,
        path=model.path,
        files=[str(f) for f in cat.files],
        moe_layers=sorted(model.layers),
        n_experts=cat.n_experts,
        n_expert_used=cat.n_expert_used,
        parts=list(dict.fromkeys(p for L in layers for p in (x.part for x in L.parts))),
        layers=layers,
        segments=[class_segments[c].info() for c in used],
        expert_layout=model.expert_layout,
    )
