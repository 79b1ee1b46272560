"""ggml's repacked (interleaved) expert layouts, made with numpy: repack on read.

llama.cpp's CPU backend computes some quantized weights faster from a repacked
layout (ggml-cpu/repack.cpp): rows are taken `rows` at a time, and for each block
column the `rows` blocks become one interleaved block (their scales side by side,
their quants in chunks of `chunk` bytes, row after row; Q4_0 also flips each
nibble's sign bit). This module makes those bytes from a plain expert's, so the
daemon can place plain experts in its RAM tier in the layout an engine computes on
(design.md §9.1), without llama.cpp.

What this module owns:
- `LAYOUTS`: every layout ggml 0.3.36's repack makes outside RISC-V, by ggml's name
  (`q4_0_8x8` is ggml's `tensor_traits<block_q4_0, 8, 8>`: 8 rows, 8-byte chunks),
  with the plain type it is made from;
- `can_make(layout, ggml_type, ne)`: whether a part of that type and per-expert
  shape (ne0, ne1) can be made in that layout (ggml refuses a row count that is
  not a multiple of `rows`);
- `resolve(request, parts)`: the per-type layouts an engine's request
  names ("q4_K_8x8+plain": Q4_K repacked, every other type plain);
- `transform(layout, plain, out, ne0, ne1)`: one expert's part, plain -> repacked.

Invariants:
- The transform is ggml's repack, byte for byte: for every layout and shape
  `can_make` accepts, `transform` writes exactly what `ggml_backend_tensor_set`
  on a CPU_REPACK tensor of that layout writes (tests/e2e/test_repack_on_read.py
  checks each layout against ggml itself, random bytes, several shapes).
- An expert's repacked bytes are its plain range, of the same size: ggml groups
  rows within one expert (`ne1 % rows == 0`), never across two.
- No llama.cpp, no ggml, no CPU probe. Which layout an engine computes on is the
  engine's to say (its own ggml decides); this module only makes it.
- The byte moves run in moed's C extension `moed._interleave` when it is built
  (0.23-0.30 CPU-s a GB of cold bytes here, a plain copy 0.14: it knows no layout,
  only "this field of R rows, in pieces of n bytes, to there", and Q4_K's scale
  regrouping; a layout's whole plan of such moves runs block by block, in one pass over
  the bytes), and in numpy otherwise (0.5-0.8 CPU-s a GB); `transform(...,
  native=False)` forces numpy. Both are checked against ggml.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from moed.gguf.layouts import PLAIN, summary

try:
    import moed._interleave as native_moves
except ImportError:  # not built: numpy does every move
    native_moves = None  # type: ignore[assignment]

# ggml types (ggml.h) this repack takes, with their names and plain block size.
Q4_0, Q8_0, Q2_K, Q4_K, Q5_K, Q6_K, IQ4_NL, MXFP4, Q1_0 = 2, 8, 10, 12, 13, 14, 20, 39, 41


@dataclass(frozen=True)
class BlockType:
    name: str  # ggml's type name ("Q4_K")
    prefix: str  # its layouts' names begin with it ("q4_K")
    per_block: int  # elements a block holds
    block_bytes: int


TYPES = {
    Q4_0: BlockType("Q4_0", "q4_0", 32, 18),
    Q8_0: BlockType("Q8_0", "q8_0", 32, 34),
    Q2_K: BlockType("Q2_K", "q2_K", 256, 84),
    Q4_K: BlockType("Q4_K", "q4_K", 256, 144),
    Q5_K: BlockType("Q5_K", "q5_K", 256, 176),
    Q6_K: BlockType("Q6_K", "q6_K", 256, 210),
    IQ4_NL: BlockType("IQ4_NL", "iq4_nl", 32, 18),
    MXFP4: BlockType("MXFP4", "mxfp4", 32, 17),
    Q1_0: BlockType("Q1_0", "q1_0", 128, 18),
}


@dataclass(frozen=True)
class Field:
    """One field of the plain block, and how the interleaved block holds it.

    `kind`: "chunks" puts the `rows` blocks' field side by side in `chunk`-byte
    pieces (chunk k of every row, then chunk k + 1: for chunk == size, the rows'
    fields one after another); "kscales" is Q4_K's and Q5_K's 12-byte 6-bit scales
    and mins, regrouped per sub-block (96 bytes for 8 rows); "bits" is Q1_0's 4x4
    bit interleave. `xor`: a byte XORed into every byte written (Q4_0: 0x88).
    """

    offset: int
    size: int
    kind: str = "chunks"
    chunk: int = 0  # "chunks": bytes per piece (0: the layout's chunk)
    xor: int = 0


# The plain block's fields in the order the interleaved block holds them (repack.h's structs).
_D, _QS16 = Field(0, 2, chunk=2), Field(2, 16)
_FIELDS: dict[int, tuple[Field, ...]] = {
    Q4_0: (_D, Field(2, 16, xor=0x88)),
    Q8_0: (_D, Field(2, 32)),
    IQ4_NL: (_D, _QS16),
    MXFP4: (Field(0, 1, chunk=1), Field(1, 16)),
    Q4_K: (Field(0, 2, chunk=2), Field(2, 2, chunk=2), Field(4, 12, "kscales"), Field(16, 128)),
    Q5_K: (Field(0, 2, chunk=2), Field(2, 2, chunk=2), Field(4, 12, "kscales"), Field(16, 32), Field(48, 128)),
    Q6_K: (Field(208, 2, chunk=2), Field(192, 16, chunk=1), Field(0, 128), Field(128, 64)),
    Q2_K: (Field(80, 2, chunk=2), Field(82, 2, chunk=2), Field(0, 16, chunk=2), Field(16, 64)),
}


@dataclass(frozen=True)
class Layout:
    """One of ggml's repacked layouts: `rows` rows interleaved in `chunk`-byte pieces."""

    name: str
    ggml_type: int
    rows: int
    chunk: int

    @property
    def block(self) -> BlockType:
        return TYPES[self.ggml_type]

    @property
    def type_name(self) -> str:
        return self.block.name

    @property
    def fields(self) -> tuple[Field, ...]:
        if self.ggml_type == Q1_0:  # 4x8: bytes interleaved; 4x4: bits (make_block_q1_0x4)
            return (_D, Field(2, 16, chunk=1) if self.chunk == 8 else Field(2, 16, "bits"))
        return _FIELDS[self.ggml_type]


def _layouts(*rows: tuple[int, int, int]) -> dict[str, Layout]:
    made = (Layout(f"{TYPES[t].prefix}_{n}x{chunk}", t, n, chunk) for t, n, chunk in rows)
    return {lay.name: lay for lay in made}


# ggml's tensor_traits<block, INTER_SIZE, NB_COLS> instances (ggml_repack_get_optimal_repack_type),
# named `{type}_{NB_COLS}x{INTER_SIZE}` as kernels.layout_of names them: (type, rows, chunk).
LAYOUTS: dict[str, Layout] = _layouts(
    (Q4_0, 4, 4),
    (Q4_0, 4, 8),
    (Q4_0, 8, 8),
    (Q4_K, 8, 4),
    (Q4_K, 8, 8),
    (Q5_K, 8, 4),
    (Q5_K, 8, 8),
    (Q6_K, 8, 4),
    (Q6_K, 8, 8),
    (Q2_K, 8, 8),
    (IQ4_NL, 4, 4),
    (IQ4_NL, 8, 8),
    (MXFP4, 4, 4),
    (MXFP4, 8, 8),
    (Q8_0, 4, 4),
    (Q8_0, 4, 8),
    (Q1_0, 4, 4),
    (Q1_0, 4, 8),
)


def can_make(layout: str, ggml_type: int, ne: Iterable[int]) -> bool:
    """Whether a part of `ggml_type` and per-expert shape (ne0, ne1) can be made in `layout`."""
    lay = LAYOUTS.get(layout)
    ne0, ne1 = list(ne)[:2]
    if lay is None or lay.ggml_type != ggml_type:
        return False
    return ne1 % lay.rows == 0 and ne0 % lay.block.per_block == 0 and ne0 % 8 == 0


def resolve(request: str, parts: Iterable[tuple[str, int, tuple[int, ...]]]) -> dict[str, str]:
    """{type name: layout} an engine's request names, for a plain file whose expert parts are
    `parts` (type name, ggml type, shape). `request` is the summary the engine computes on
    (moed.gguf.layouts.summary: "q4_0_8x8", "q4_K_8x8+plain"). ValueError says why not."""
    parts = list(parts)
    types = {name for name, _, _ in parts}
    want: dict[str, str] = {}
    for name in request.split("+"):
        if name == PLAIN:
            continue
        lay = LAYOUTS.get(name)
        if lay is None:
            raise ValueError(f"the daemon does not make {name!r} (it makes {', '.join(LAYOUTS)})")
        if lay.type_name not in types:
            raise ValueError(f"{name} is made from {lay.type_name}, and no expert is {lay.type_name}")
        if want.setdefault(lay.type_name, name) != name:
            raise ValueError(f"{lay.type_name} asked in two layouts ({want[lay.type_name]}, {name})")
    for type_name, ggml_type, shape in parts:
        layout = want.get(type_name)
        if layout is not None and not can_make(layout, ggml_type, shape):
            raise ValueError(
                f"{layout} needs rows in multiples of {LAYOUTS[layout].rows}; a {type_name} "
                f"part is {shape[0]}x{shape[1]}"
            )
    if summary(want, types) != request:
        raise ValueError(
            f"{request!r} does not name this model's expert types ({', '.join(sorted(types))}) "
            f"as one layout each; {summary(want, types)!r} would"
        )
    return want


# ---------------------------------------------------------------------- the transform


def transform(layout: str | Layout, plain, out, ne0: int, ne1: int, native: bool = True) -> None:
    """Write the repacked bytes of one expert's part (`ne1` rows of `ne0` elements) into
    `out` from its plain bytes `plain` (both buffers of the same size, not overlapping).
    `native`: the C moves where built (False: numpy's, the same bytes)."""
    lay = layout if isinstance(layout, Layout) else LAYOUTS[layout]
    bb, nblocks, R = lay.block.block_bytes, ne0 // lay.block.per_block, lay.rows
    src = np.frombuffer(plain, np.uint8)
    dst = np.frombuffer(out, np.uint8)
    if src.size != ne1 * nblocks * bb or dst.size != src.size:
        raise ValueError(f"{lay.name}: {ne1} rows of {ne0} are {ne1 * nblocks * bb} bytes; got {src.size}, {dst.size}")
    if ne1 % R:
        raise ValueError(f"{lay.name}: {ne1} rows is not a multiple of {R}")
    G = ne1 // R
    # plain: row r of group g, block x at g*R*nblocks*bb + r*nblocks*bb + x*bb
    # repacked: group g, block x at (g*nblocks + x)*R*bb; its fields in order, R rows' worth each
    plan = _plan(lay) if native and native_moves is not None else None
    if plan is not None:  # every field in one pass over the bytes (moed/_interleave.c, `moves`)
        native_moves.moves(src, dst, G, nblocks, R, bb, plan)
        return
    geo = (_Native if native and native_moves is not None else _Geometry)(src, dst, G, nblocks, R, bb)
    o = 0
    for f in lay.fields:
        if f.kind == "chunks":
            geo.chunks(f, f.chunk or lay.chunk, o)
        elif f.kind == "kscales":
            geo.kscales(f, o)
        else:
            geo.bits(f, o)
        o += R * f.size
    geo.xor(lay)


_MOVE_KINDS = {"chunks": 0, "kscales": 1}  # moed/_interleave.c's MOVE_CHUNKS, MOVE_KSCALES


def _xor_word(byte: int, chunk: int) -> int:
    """`byte` in every byte of a `chunk`-byte piece: the word moed._interleave XORs it with."""
    return int.from_bytes(bytes([byte]) * chunk, "little")


@functools.cache
def _plan(lay: Layout) -> tuple[tuple[int, int, int, int, int, int], ...] | None:
    """The layout's moves for moed._interleave.moves: (kind, field offset, field size, piece
    size, offset in the interleaved block, XOR word); None if a field is numpy's alone."""
    plan, o = [], 0
    for f in lay.fields:
        if f.kind not in _MOVE_KINDS:
            return None
        chunk = (f.chunk or lay.chunk) if f.kind == "chunks" else 1
        plan.append((_MOVE_KINDS[f.kind], f.offset, f.size, chunk, o, _xor_word(f.xor, chunk)))
        o += lay.rows * f.size
    return tuple(plan)


@functools.cache
def _xor_mask(lay: Layout) -> np.ndarray | None:
    """The bytes XORed into one interleaved block (Q4_0's 0x88 on its quants), as wide words."""
    fields = lay.fields
    if not any(f.xor for f in fields):
        return None
    mask = np.zeros(lay.rows * lay.block.block_bytes, np.uint8)
    o = 0
    for f in fields:
        mask[o : o + lay.rows * f.size] = f.xor
        o += lay.rows * f.size
    return mask.view("<u8") if mask.size % 8 == 0 else mask


_DTYPES = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}


@dataclass
class _Geometry:
    src: np.ndarray
    dst: np.ndarray
    G: int
    nblocks: int
    R: int
    bb: int

    def _src(self, offset: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.ndarray(shape, dtype, self.src, offset, strides)

    def _dst(self, offset: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.ndarray(shape, dtype, self.dst, offset, strides)

    def chunks(self, f: Field, chunk: int, o: int) -> None:
        """Field `f` of the R rows in `chunk`-byte pieces: piece k of row r at o + (k*R + r)*chunk.
        One numpy copy per row, over (group, block, piece), each piece one wide element."""
        G, nb, R, bb = self.G, self.nblocks, self.R, self.bb
        dtype, nk = _DTYPES[chunk], f.size // chunk
        row_bytes, group_out = nb * bb, R * bb
        for r in range(R):
            s = self._src(r * row_bytes + f.offset, (G, nb, nk), (R * row_bytes, bb, chunk), dtype)
            d = self._dst(o + r * chunk, (G, nb, nk), (nb * group_out, group_out, R * chunk), dtype)
            d[...] = s

    def _rows(self, f: Field) -> np.ndarray:
        """Field `f` of every block as (group, block, row, byte), a copy."""
        G, nb, R, bb = self.G, self.nblocks, self.R, self.bb
        return self._src(f.offset, (G, nb, R, f.size), (R * nb * bb, bb, nb * bb, 1), "<u1").copy()

    def _put(self, o: int, values: np.ndarray) -> None:
        """(group, block, n) bytes at o of each interleaved block."""
        group_out = self.R * self.bb
        self._dst(o, values.shape, (self.nblocks * group_out, group_out, 1), "<u1")[...] = values

    def kscales(self, f: Field, o: int) -> None:
        """Q4_K/Q5_K: 8 rows' 6-bit scales and mins (12 bytes a row) as make_block_q4_Kx8 regroups
        them: for each sub-block i, 12 bytes (a, b, c) x (4 rows), then the same for sub-blocks 4-7.

        Computed four sub-blocks at a time in the byte lanes of one integer (every operation
        keeps to its lane), then each lane put at its own sub-block's place."""
        G, nb, R, bb = self.G, self.nblocks, self.R, self.bb
        where = (R * nb * bb, bb, nb * bb)  # group, block, row
        W = self._src(f.offset, (G, nb, R), where, "<u8").astype(np.uint64, order="C")  # scale bytes 0-7 of a row
        H = self._src(f.offset + 8, (G, nb, R), where, "<u4").astype(np.uint64, order="C")  # bytes 8-11
        lo_s, lo_m = W & _L[0x3F], (W >> _L[32]) & _L[0x3F]
        hi_s = ((W & _L[0xC0]) >> _L[2]) | (H & _L[0x0F])
        hi_m = (((W >> _L[32]) & _L[0xC0]) >> _L[2]) | ((H & _L[0xF0]) >> _L[4])
        for half, (s, m) in enumerate(((lo_s, lo_m), (hi_s, hi_m))):
            words = _pack_scales(s, m).astype("<u4", order="C").view(np.uint8)  # (G, nb, 3 * 4 words, 4 lanes)
            at = o + half * 48  # sub-block i's 12 bytes at at + 12 * i
            d = self._dst(at, (G, nb, 12, 4), (nb * R * bb, R * bb, 1, 12), "<u1")
            d[...] = words.reshape(G, nb, 12, 4)

    def xor(self, lay: Layout) -> None:
        """The layout's XOR (Q4_0's 0x88 on its quants) over whole interleaved blocks: one
        pass, far faster in numpy than XOR per piece."""
        mask = _xor_mask(lay)
        if mask is not None:
            blocks = self.dst.view(mask.dtype).reshape(-1, mask.size)
            np.bitwise_xor(blocks, mask, out=blocks)

    def bits(self, f: Field, o: int) -> None:
        """Q1_0 4x4 (make_block_q1_0x4): for each 32-weight block k and 4-weight tile t, a byte of
        rows 0 and 1's four bits and a byte of rows 2 and 3's."""
        Q = self._rows(f)  # (G, nb, 4, 16)
        bits = np.unpackbits(Q, axis=-1, bitorder="little")  # (G, nb, row, 128 weights)
        bits = bits.reshape(self.G, self.nblocks, 2, 2, 4, 8, 4)  # half, row in half, k, tile, pos
        bits = bits.transpose(0, 1, 4, 5, 2, 3, 6)  # k, tile, half (lo/hi byte), row in half, pos
        packed = np.packbits(bits.reshape(self.G, self.nblocks, 64, 8), axis=-1, bitorder="little")
        self._put(o, packed.reshape(self.G, self.nblocks, 64))


class _Native(_Geometry):
    """The same moves in moed._interleave (C): a field's pieces, with their XOR, in one call."""

    def chunks(self, f: Field, chunk: int, o: int) -> None:
        xor = _xor_word(f.xor, chunk)
        native_moves.chunks(self.src, self.dst, self.G, self.nblocks, self.R, self.bb, f.offset, f.size, chunk, o, xor)

    def kscales(self, f: Field, o: int) -> None:
        native_moves.kscales(self.src, self.dst, self.G, self.nblocks, self.bb, f.offset, o)

    def xor(self, lay: Layout) -> None:
        pass  # done with each piece


def _lanes(byte: int) -> np.uint64:
    return np.uint64(int.from_bytes(bytes([byte]) * 4, "little"))


_L = {**{k: _lanes(k) for k in (0x0F, 0x30, 0x3F, 0xC0, 0xF0)}, **{k: np.uint64(k) for k in (2, 4, 32)}}


def _pack_scales(s: np.ndarray, m: np.ndarray) -> np.ndarray:
    """make_block_q4_Kx8's packing of 8 rows' 6-bit scales `s` and mins `m` (..., 8 rows), four
    sub-blocks in the byte lanes of each: (..., 12) words, a[0..3], b[0..3], c[0..3], whose lane i
    is that byte of sub-block i: rows 0-3's six bits under rows 4-7's top two (a: scales, b:
    mins), and rows 4-7's low four bits of scale and min (c)."""
    top = _L[0x30]
    a = s[..., 0:4] | ((s[..., 4:8] & top) << _L[2])
    b = m[..., 0:4] | ((m[..., 4:8] & top) << _L[2])
    c = (s[..., 4:8] & _L[0x0F]) | ((m[..., 4:8] & _L[0x0F]) << _L[4])
    return np.concatenate((a, b, c), axis=-1)


def part_shapes(parts: Mapping) -> list[tuple[str, int, tuple[int, ...]]]:
    """(type name, ggml type, shape) of catalog extents, for `resolve`."""
    return [(p.type_name, p.ggml_type, tuple(p.shape)) for p in parts.values()]
