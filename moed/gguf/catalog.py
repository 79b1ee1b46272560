"""Expert catalog: where every routed expert's bytes live in a (possibly split) GGUF.

API summary
-----------
    cat = Catalog.open(path)         # first shard of a split file, or a plain .gguf
    cat.files                        # tuple[str, ...] absolute shard paths, in order
    cat.identity                     # tuple[(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns), ...];
                                     #   hashable: two opens of one file compare equal
    cat.moe_layers                   # tuple[int, ...] block indices with routed experts
    cat.n_experts, cat.n_expert_used # experts per layer, top-k
    cat.parts                        # tuple[str, ...] e.g. ("gate", "up", "down") or ("gate_up", "down")
    cat.layers[l]                    # LayerEntry(layer, parts: {part: CatalogExtent}, size_class, ...)
    cat.layers[l].parts[p]           # CatalogExtent(shard, path, offset, bytes_per_expert, ggml_type,
                                     #            type_name, shape)  -- shape in ggml order (ne0, ne1, n_expert)
    cat.extent(l, e, p)              # (shard_path, absolute_offset, length) of expert e's part p
    cat.size_classes                 # {SizeClass: tuple[layer, ...]}; SizeClass = ((part, bytes), ...)
    cat.size_class(l)                # the layer's SizeClass
    cat.page_aligned                 # every part of every layer page-aligned (also per layer/part)
    cat.expert_bytes(l)              # sum of the parts' bytes for one expert of layer l
    cat.expert_layout                # "plain", or the repacked layout ("q4_0_8x8"; moed.gguf.layouts)
    cat.to_dict()                    # JSON-ready summary (moectl index --json)

`Catalog.open` raises `moed.protocol.errors.BadModelFile` (clear message naming the
file) for: a missing file, not GGUF, a truncated file (header or tensor data past
EOF), an architecture not in `SERVED_ARCHS` (moed.gguf.archs; named in the message), no routed experts, a missing shard, shards that disagree (split keys, expert
counts, part sets). Lookups raise UnknownLayer / UnknownExpert / BadRequest.

Invariants:
- Expert `e` of a part lives at `offset + e * bytes_per_expert`, `bytes_per_expert =
  n_bytes / n_expert`, entirely inside its shard (checked at open).
- Parts are the routed `ffn_*_exps.weight` tensors only. Per-expert bias rows
  (gpt-oss's `ffn_*_exps.bias`) are not parts: llama.cpp adds them from the whole
  tensor (add_id), they are ~0.3% of the expert bytes and not page-sized, so they
  stay dense and resident with every other non-expert tensor.
- Only headers are read (see moed.gguf.header): opening is fast even for big models
  with big vocabularies, and no tensor data is touched.
- `identity` is each shard's fstat identity on the descriptor its header was
  parsed from, so any later change to a shard changes `identity_of` its stat
  (the daemon checks its open descriptors against it: ModelFile.changed).
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field

from moed.gguf import layouts
from moed.gguf.archs import SERVED_ARCHS
from moed.gguf.header import FileIdentity, Header, check_split, read_header, split_files, type_name
from moed.protocol.errors import BadModelFile, BadRequest, UnknownExpert, UnknownLayer
from moed.protocol.layout import PAGE

PART_ORDER = ("gate", "up", "gate_up", "down")  # slot layout order
EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate_up|gate|up|down)_exps\.weight$")

SizeClass = tuple[tuple[str, int], ...]  # ((part, bytes_per_expert), ...) in part order


@dataclass(frozen=True)
class CatalogExtent:
    shard: int  # index into Catalog.files
    path: str
    offset: int  # absolute offset of expert 0 in the shard
    bytes_per_expert: int
    ggml_type: int
    type_name: str
    shape: tuple[int, ...]  # ggml order (ne0, ne1, n_expert)

    @property
    def page_aligned(self) -> bool:
        return self.offset % PAGE == 0 and self.bytes_per_expert % PAGE == 0

    def expert_offset(self, expert: int) -> int:
        return self.offset + expert * self.bytes_per_expert


@dataclass(frozen=True)
class LayerEntry:
    layer: int
    parts: dict[str, CatalogExtent]

    @property
    def size_class(self) -> SizeClass:
        return tuple((name, p.bytes_per_expert) for name, p in self.parts.items())

    @property
    def expert_bytes(self) -> int:
        return sum(p.bytes_per_expert for p in self.parts.values())

    @property
    def page_aligned(self) -> bool:
        return all(p.page_aligned for p in self.parts.values())


@dataclass(frozen=True)
class Catalog:
    path: str  # the first shard, absolute
    files: tuple[str, ...]
    identity: tuple[FileIdentity, ...]
    arch: str
    n_layers: int  # block_count (dense layers included)
    moe_layers: tuple[int, ...]
    n_experts: int
    n_expert_used: int
    parts: tuple[str, ...]
    layers: dict[int, LayerEntry]
    alignment: int  # general.alignment of the first shard
    # {expert ggml type name: repacked layout} (moed.gguf.layouts); empty: plain
    expert_layouts: dict[str, str] = field(default_factory=dict)

    # ------------------------------------------------------------------ open

    @classmethod
    def open(cls, path: str | os.PathLike) -> Catalog:
        first_path = os.path.abspath(os.fspath(path))
        first = read_header(first_path)
        files = split_files(first_path, first)
        headers = [first] + [read_header(f) for f in files[1:]]
        identity = tuple(h.identity for h in headers)
        check_split(headers)
        return _build(first_path, files, identity, headers)

    # ------------------------------------------------------------------ lookups

    def layer(self, layer: int) -> LayerEntry:
        entry = self.layers.get(layer)
        if entry is None:
            raise UnknownLayer(f"layer {layer} has no routed experts (MoE layers: {format_ranges(self.moe_layers)})")
        return entry

    def extent(self, layer: int, expert: int, part: str) -> tuple[str, int, int]:
        """(shard_path, absolute_offset, length) of one expert's part."""
        p = self.layer(layer).parts.get(part)
        if p is None:
            raise BadRequest(f"unknown part {part!r} (model has {', '.join(self.parts)})")
        if not 0 <= expert < self.n_experts:
            raise UnknownExpert(f"expert {expert} out of range 0..{self.n_experts - 1}")
        return p.path, p.expert_offset(expert), p.bytes_per_expert

    def size_class(self, layer: int) -> SizeClass:
        return self.layer(layer).size_class

    def expert_bytes(self, layer: int) -> int:
        return self.layer(layer).expert_bytes

    @functools.cached_property
    def size_classes(self) -> dict[SizeClass, tuple[int, ...]]:
        out: dict[SizeClass, list[int]] = {}
        for layer in self.moe_layers:
            out.setdefault(self.layers[layer].size_class, []).append(layer)
        return {k: tuple(v) for k, v in out.items()}

    @property
    def page_aligned(self) -> bool:
        return all(e.page_aligned for e in self.layers.values())

    @property
    def expert_bytes_total(self) -> int:
        return sum(e.expert_bytes for e in self.layers.values()) * self.n_experts

    @property
    def expert_types(self) -> set[str]:
        return {p.type_name for e in self.layers.values() for p in e.parts.values()}

    @property
    def expert_layout(self) -> str:
        """ "plain", or the repacked layout of the experts ("q4_0_8x8", "q4_K_8x8+plain")."""
        return layouts.summary(self.expert_layouts, self.expert_types)

    def to_dict(self) -> dict:
        return {
            "path": self.path,
            "files": list(self.files),
            "arch": self.arch,
            "n_layers": self.n_layers,
            "moe_layers": list(self.moe_layers),
            "n_experts": self.n_experts,
            "n_expert_used": self.n_expert_used,
            "parts": list(self.parts),
            "alignment": self.alignment,
            "page_aligned": self.page_aligned,
            "expert_layout": self.expert_layout,
            "expert_layouts": dict(self.expert_layouts),
            "expert_bytes_total": self.expert_bytes_total,
            "size_classes": [
                {
                    "parts": {p: b for p, b in key},
                    "expert_bytes": sum(b for _, b in key),
                    "layers": list(layers),
                    "page_aligned": all(self.layers[l].page_aligned for l in layers),
                    "types": sorted({self.layers[l].parts[p].type_name for l in layers for p, _ in key}),
                }
                for key, layers in self.size_classes.items()
            ],
            "layers": {
                str(l): {
                    p: {
                        "shard": x.shard,
                        "offset": x.offset,
                        "bytes_per_expert": x.bytes_per_expert,
                        "type": x.type_name,
                        "shape": list(x.shape),
                        "page_aligned": x.page_aligned,
                    }
                    for p, x in e.parts.items()
                }
                for l, e in self.layers.items()
            },
        }


# ---------------------------------------------------------------------- helpers


def _build(path: str, files, identity, headers: list[Header]) -> Catalog:
    first = headers[0]
    arch = first.get("general.architecture")
    if not isinstance(arch, str):
        raise BadModelFile(f"{path}: no general.architecture key")
    found: dict[int, dict[str, CatalogExtent]] = {}
    for shard, h in enumerate(headers):
        for t in h.tensors:
            m = EXPERT_RE.match(t.name)
            if m:
                found.setdefault(int(m.group(1)), {})[m.group(2)] = _extent(shard, h, t)
    if not found:
        raise BadModelFile(
            f"{path}: no routed expert tensors (blk.N.ffn_*_exps.weight); not a mixture-of-experts model"
        )
    if arch not in SERVED_ARCHS:
        raise BadModelFile(
            f"{path}: architecture {arch!r} is not one moed serves (it serves {', '.join(SERVED_ARCHS)}: "
            "those llama.cpp runs whose routed experts moed's streaming is checked on)"
        )
    n_experts = _expert_count(path, arch, first, found)
    n_used = first.get(f"{arch}.expert_used_count")
    if not isinstance(n_used, int) or not 1 <= n_used <= n_experts:
        raise BadModelFile(f"{path}: {arch}.expert_used_count is {n_used!r}; expected 1..{n_experts}")
    layers = {l: LayerEntry(l, {p: parts[p] for p in PART_ORDER if p in parts}) for l, parts in sorted(found.items())}
    part_sets = {tuple(e.parts) for e in layers.values()}
    if len(part_sets) != 1:
        detail = "; ".join(f"layer {l}: {'+'.join(e.parts)}" for l, e in layers.items())
        raise BadModelFile(f"{path}: MoE layers have different expert parts ({detail})")
    n_layers = first.get(f"{arch}.block_count", max(layers) + 1)
    try:
        expert_layouts = layouts.parse_layouts(first.get(layouts.KEY_LAYOUTS))
    except ValueError as exc:
        raise BadModelFile(f"{path}: {exc}") from None
    return Catalog(
        path,
        tuple(files),
        tuple(identity),
        arch,
        int(n_layers),
        tuple(layers),
        n_experts,
        n_used,
        part_sets.pop(),
        layers,
        first.alignment,
        expert_layouts,
    )


def _extent(shard: int, h: Header, t) -> CatalogExtent:
    if len(t.dims) != 3 or t.dims[2] == 0:
        raise BadModelFile(
            f"{h.path}: expert tensor {t.name!r} has shape {list(t.dims)}, expected [ne0, ne1, n_expert]"
        )
    return CatalogExtent(
        shard, h.path, t.offset, t.n_bytes // t.dims[2], t.ggml_type, type_name(t.ggml_type), tuple(t.dims)
    )


def _expert_count(path: str, arch: str, first: Header, found) -> int:
    counts = {p.shape[2] for parts in found.values() for p in parts.values()}
    declared = first.get(f"{arch}.expert_count")
    if len(counts) != 1:
        detail = "; ".join(
            f"{p.path} layer {l} {name}: {p.shape[2]}"
            for l, parts in sorted(found.items())
            for name, p in parts.items()
        )
        raise BadModelFile(f"{path}: expert tensors disagree on the number of experts ({detail})")
    n = counts.pop()
    if declared is not None and declared != n:
        raise BadModelFile(f"{path}: {arch}.expert_count is {declared} but expert tensors hold {n}")
    return n


def format_ranges(values) -> str:
    values = sorted(values)
    if not values:
        return "none"
    out, start, prev = [], values[0], values[0]
    for v in values[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(out)
