"""Repack on read: a plain file's experts placed in the RAM tier in an engine's repacked layout.

An engine whose ggml computes a type on a repacked layout (`q4_0_8x8`, ...) opens a
plain file asking for that layout; the daemon then serves it as its own model whose
experts of that type are transformed as they are read (moed.gguf.interleave, numpy),
so the engine computes on ggml's repacked kernels without a second copy of the file
(`moectl align --repack`, which stays). design.md §9.1.

What this module owns:
- the decision, at open, of what layout a request gets (`served_layouts`): the file
  as it is, or its plain experts made in the layout asked for, type by type; or
  `LayoutUnavailable` naming why not;
- each part's transform (`PartRepack`), which the reader (moed.daemon.reader) runs on
  every chunk it reads of that part, from its bounce buffer into the slot.

Invariants:
- Every stored expert equals ggml's repack of the bytes read from the file: the
  transform is ggml's byte for byte (tests/e2e/test_repack_on_read.py, per layout,
  against ggml itself), and it runs as each chunk is read, before the file is found
  unchanged, the slot locked, hashed (verify mode) and READY; a slot is never granted
  in between (only READY slots are), and a transform that fails fails the read.
- The layout is part of a model's identity in the registry (path, file identity,
  layouts made on read): an engine asking for the plain layout of the same file gets
  another model and its own slots; two engines asking for the same layout share one.
- The daemon never asks what CPU it runs on: the engine names the layout its own ggml
  computes on (moed.engines.repack), the daemon makes it or refuses.
"""

from __future__ import annotations

from dataclasses import dataclass

from moed import libc
from moed.gguf import interleave
from moed.gguf.catalog import Catalog, LayerEntry
from moed.gguf.layouts import PLAIN, layout_refusal
from moed.protocol.errors import LayoutUnavailable


def served_layouts(catalog: Catalog, request: str) -> dict[str, str]:
    """{type name: layout} made on read for an engine asking `request` ("" takes the file as it
    is; a summary such as "q4_K_8x8+plain" names each expert type's layout). Empty: the file's
    own bytes are served. LayoutUnavailable when neither the file nor a transform gives it."""
    have = catalog.expert_layout
    if not request or request == have:
        return {}
    if have != PLAIN:
        raise LayoutUnavailable(layout_refusal(catalog.path, have, request))
    parts = [(p.type_name, p.ggml_type, p.shape) for e in catalog.layers.values() for p in e.parts.values()]
    try:
        return interleave.resolve(request, parts)
    except ValueError as exc:
        why = f"{catalog.path}: its experts are plain and cannot be made {request} on read: {exc}"
        raise LayoutUnavailable(why) from None


def layout_key(made: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The layouts made on read as part of a model's key in the registry (() for the file's own)."""
    return tuple(sorted(made.items()))


@dataclass(frozen=True)
class PartRepack:
    """One part's transform: every expert of it is `ne1` rows of `ne0`, made in `layout`.

    Rows are transformed `layout.rows` at a time, each group on its own and into its own
    byte range, so the reader transforms a part chunk by chunk (`group_bytes` at a time),
    straight from the bytes it read into the slot."""

    layout: interleave.Layout
    ne0: int
    ne1: int

    @property
    def row_bytes(self) -> int:
        return self.ne0 // self.layout.block.per_block * self.layout.block.block_bytes

    @property
    def group_bytes(self) -> int:
        return self.layout.rows * self.row_bytes

    def into(self, src, dest: int, n: int) -> None:
        """Write at `dest` the transform of `src`, `n` bytes of whole row groups of this part."""
        if n % self.group_bytes:
            raise ValueError(f"{n} bytes is not whole groups of {self.group_bytes}")
        interleave.transform(self.layout, src, libc.buffer_at(dest, n), self.ne0, n // self.row_bytes)


def repacks_for(entry: LayerEntry, made: dict[str, str]) -> list[PartRepack | None]:
    """Per part of the layer, in the catalog's part order: its transform, or None (served as read)."""
    out: list[PartRepack | None] = []
    for p in entry.parts.values():
        name = made.get(p.type_name)
        out.append(PartRepack(interleave.LAYOUTS[name], p.shape[0], p.shape[1]) if name else None)
    return out
