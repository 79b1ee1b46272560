"""Repack on read, without llama.cpp: the layouts' names and rules, the transform against
a transliteration of ggml's own loops, and the daemon serving a plain file in a repacked
layout as a model of its own (in this process, on the real store, RAM tier and readers).

Against ggml itself, per layout: tests/e2e/test_repack_on_read.py.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from moed.daemon.core import Daemon
from moed.gguf import interleave
from moed.gguf.catalog import Catalog
from moed.protocol import errors
from moed.testing import file_bytes
from tests.unit.test_daemon_in_process import lease_of, run, slot_bytes_of

# ---- the layouts ------------------------------------------------------------------------


def test_every_layout_is_named_as_ggml_names_it():
    """`{type}_{rows}x{chunk}`: ggml's tensor_traits<block, chunk, rows>, as kernels.layout_of names them."""
    assert {"q4_0_8x8", "q4_0_4x8", "q4_0_4x4", "q4_K_8x8", "q2_K_8x8", "iq4_nl_4x4", "mxfp4_8x8"} <= set(
        interleave.LAYOUTS
    )
    lay = interleave.LAYOUTS["q4_0_4x8"]
    assert (lay.type_name, lay.rows, lay.chunk) == ("Q4_0", 4, 8)


def test_can_make_checks_type_and_rows():
    assert interleave.can_make("q4_0_8x8", interleave.Q4_0, (64, 16))
    assert not interleave.can_make("q4_0_8x8", interleave.Q4_0, (64, 12))  # rows not a multiple of 8
    assert interleave.can_make("q4_0_4x4", interleave.Q4_0, (64, 12))
    assert not interleave.can_make("q4_0_8x8", interleave.Q4_K, (256, 16))  # made from Q4_0 only
    assert not interleave.can_make("q9_9x9", interleave.Q4_0, (64, 16))


PARTS_Q4KM = [("Q4_K", interleave.Q4_K, (256, 256, 8)), ("Q6_K", interleave.Q6_K, (256, 256, 8))]


def test_resolve_reads_a_summary_type_by_type():
    assert interleave.resolve("q4_K_8x8+plain", PARTS_Q4KM) == {"Q4_K": "q4_K_8x8"}
    assert interleave.resolve("q4_K_8x8+q6_K_8x4", PARTS_Q4KM) == {"Q4_K": "q4_K_8x8", "Q6_K": "q6_K_8x4"}
    with pytest.raises(ValueError, match="'q4_K_8x8\\+plain' would"):
        interleave.resolve("q4_K_8x8", PARTS_Q4KM)  # Q6_K not named: the summary says +plain
    with pytest.raises(ValueError, match="no expert is Q4_0"):
        interleave.resolve("q4_0_8x8+plain", PARTS_Q4KM)
    with pytest.raises(ValueError, match="does not make"):
        interleave.resolve("q4_K_16x1+plain", PARTS_Q4KM)
    with pytest.raises(ValueError, match="multiples of 8"):
        interleave.resolve("q4_0_8x8", [("Q4_0", interleave.Q4_0, (64, 12, 8))])


# ---- the transform, against ggml's loops transliterated ----------------------------------


def ggml_q4_0_8x8(plain: bytes, ne0: int, ne1: int) -> bytes:
    """repack_q4_0_to_q4_0_8_bl + make_block_q4_0x8 (ggml-cpu/repack.cpp), loop for loop."""
    nb, bb = ne0 // 32, 18
    src = [plain[i * bb : (i + 1) * bb] for i in range(ne1 * nb)]
    out = bytearray()
    for b in range(0, ne1, 8):
        for x in range(nb):
            blocks = [src[(b + i) * nb + x] for i in range(8)]
            out += b"".join(blk[0:2] for blk in blocks)
            for i in range(16 * 8 // 8):
                src_id, src_off = i % 8, (i // 8) * 8
                out += bytes(v ^ 0x88 for v in blocks[src_id][2 + src_off : 2 + src_off + 8])
    return bytes(out)


def ggml_q4_K_8x8(plain: bytes, ne0: int, ne1: int) -> bytes:
    """repack_q4_K_to_q4_K_8_bl + make_block_q4_Kx8, loop for loop."""
    nb, bb = ne0 // 256, 144
    src = [plain[i * bb : (i + 1) * bb] for i in range(ne1 * nb)]
    out = bytearray()
    for b in range(0, ne1, 8):
        for x in range(nb):
            blk = [src[(b + i) * nb + x] for i in range(8)]
            d = b"".join(k[0:2] for k in blk)
            dmin = b"".join(k[2:4] for k in blk)
            sc = [k[4:16] for k in blk]
            qs = [k[16:144] for k in blk]
            scales = bytearray(96)
            for i in range(4):
                s = [sc[j][i] & 63 for j in range(8)]
                m = [sc[j][i + 4] & 63 for j in range(8)]
                _pack(scales, i * 12, s, m)
            for i in range(4):
                s = [((sc[j][i] & 192) >> 2) | (sc[j][i + 8] & 15) for j in range(8)]
                m = [((sc[j][i + 4] & 192) >> 2) | ((sc[j][i + 8] & 240) >> 4) for j in range(8)]
                _pack(scales, 48 + i * 12, s, m)
            q = b"".join(qs[i % 8][(i // 8) * 8 : (i // 8) * 8 + 8] for i in range(256 * 4 // 8))
            out += d + dmin + scales + q
    return bytes(out)


def _pack(out: bytearray, at: int, s: list[int], m: list[int]) -> None:
    for c in range(4):
        out[at + c] = ((s[c] & 63) + ((s[c + 4] & 48) << 2)) & 255
        out[at + 4 + c] = ((m[c] & 63) + ((m[c + 4] & 48) << 2)) & 255
        out[at + 8 + c] = ((s[c + 4] & 15) + ((m[c + 4] & 15) << 4)) & 255


@pytest.mark.parametrize("native", [True, False], ids=["c", "numpy"])
@pytest.mark.parametrize(
    "layout, reference, ne0, ne1",
    [("q4_0_8x8", ggml_q4_0_8x8, 128, 16), ("q4_0_8x8", ggml_q4_0_8x8, 64, 24), ("q4_K_8x8", ggml_q4_K_8x8, 512, 16)],
)
def test_transform_is_ggmls_loops(layout, reference, ne0, ne1, native):
    if native and interleave.native_moves is None:
        pytest.skip("moed._interleave is not built (scripts/setup-venv builds it)")
    lay = interleave.LAYOUTS[layout]
    n = ne1 * ne0 // lay.block.per_block * lay.block.block_bytes
    plain = np.random.default_rng(ne0 + ne1).integers(0, 256, n, dtype=np.uint8).tobytes()
    out = bytearray(n)
    interleave.transform(layout, plain, out, ne0, ne1, native=native)
    assert bytes(out) == reference(plain, ne0, ne1)


@pytest.mark.parametrize("layout", sorted(interleave.LAYOUTS))
def test_native_moves_are_numpys_for_every_layout(layout):
    """The C moves (their general loop and the 8-row, 16-byte-word path most x86 layouts
    take) write what numpy writes, for every layout, on odd block counts and several groups."""
    if interleave.native_moves is None:
        pytest.skip("moed._interleave is not built")
    lay = interleave.LAYOUTS[layout]
    ne0, ne1 = lay.block.per_block * 5, lay.rows * 3
    n = ne1 * ne0 // lay.block.per_block * lay.block.block_bytes
    plain = np.random.default_rng(len(layout)).integers(0, 256, n, dtype=np.uint8).tobytes()
    got, want = bytearray(n), bytearray(n)
    interleave.transform(layout, plain, got, ne0, ne1)
    interleave.transform(layout, plain, want, ne0, ne1, native=False)
    assert bytes(got) == bytes(want)


@pytest.mark.parametrize("layout", ["q4_0_8x8", "q4_K_8x8"])
def test_native_moves_field_by_field_touch_only_their_field(layout):
    """`chunks` and `kscales` called one field at a time (a layout with a field only numpy
    moves) write their field alone: the bytes of the other fields stay as they were."""
    if interleave.native_moves is None:
        pytest.skip("moed._interleave is not built")
    lay = interleave.LAYOUTS[layout]
    ne0, ne1 = lay.block.per_block * 4, 16
    n = ne1 * ne0 // lay.block.per_block * lay.block.block_bytes
    plain = np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8).tobytes()
    want = bytearray(n)
    interleave.transform(layout, plain, want, ne0, ne1)
    got = bytearray(n)
    src, dst = np.frombuffer(plain, np.uint8), np.frombuffer(got, np.uint8)
    geo = interleave._Native(src, dst, ne1 // lay.rows, 4, lay.rows, lay.block.block_bytes)
    offsets = np.cumsum([0] + [lay.rows * f.size for f in lay.fields])
    for f, o in reversed(list(zip(lay.fields, offsets))):  # last field first: none is written twice
        if f.kind == "chunks":
            geo.chunks(f, f.chunk or lay.chunk, int(o))
        else:
            geo.kscales(f, int(o))
    assert bytes(got) == bytes(want)


def test_native_moves_check_every_bound():
    """moed._interleave never reads or writes past its buffers: a geometry or field that does not
    fit them is a ValueError, before any byte moves."""
    m = interleave.native_moves
    if m is None:
        pytest.skip("moed._interleave is not built")
    src, dst = bytes(18 * 8), bytearray(18 * 8)  # one group of 8 rows of one Q4_0 block
    m.chunks(src, dst, 1, 1, 8, 18, 2, 16, 8, 16, 0)
    for bad in (
        (2, 1, 8, 18, 2, 16, 8, 16, 0),  # two groups: past both buffers
        (1, 1, 8, 18, 2, 17, 8, 16, 0),  # field not whole pieces
        (1, 1, 8, 18, 4, 16, 8, 16, 0),  # field past its block
        (1, 1, 8, 18, 2, 16, 8, 24, 0),  # written past the interleaved block
        (1, 1, 8, 18, 2, 16, 3, 16, 0),  # a piece of 3 bytes
        (-1, 1, 8, 18, 2, 16, 8, 16, 0),
    ):
        with pytest.raises(ValueError):
            m.chunks(src, dst, *bad)
    m.kscales(bytes(144 * 8), bytearray(144 * 8), 1, 1, 144, 4, 32)  # one group of 8 rows of one Q4_K block
    for bad in ((1, 1, 144, 136, 32), (1, 1, 144, 4, 1100), (2, 1, 144, 4, 32)):  # scales, output, rows past
        with pytest.raises(ValueError):
            m.kscales(bytes(144 * 8), bytearray(144 * 8), *bad)
    with pytest.raises(BufferError):
        m.chunks(src, bytes(18 * 8), 1, 1, 8, 18, 2, 16, 8, 16, 0)  # a read-only destination
    # A whole plan (one pass, block by block) is checked move by move before any byte moves.
    good = (0, 0, 2, 2, 0, 0)
    m.moves(src, dst, 1, 1, 8, 18, [good, (0, 2, 16, 8, 16, 0x8888888888888888)])
    for plan in (
        [],  # no move
        [good] * 9,  # more moves than a layout has
        [good, (0, 2, 16, 8, 24, 0)],  # the second writes past the interleaved block
        [good, (1, 4, 12, 1, 64, 0)],  # 96 bytes of regrouped scales written past the 144
        [good, (2, 0, 2, 2, 0, 0)],  # no such kind
    ):
        with pytest.raises(ValueError):
            m.moves(src, dst, 1, 1, 8, 18, plan)
    with pytest.raises(TypeError):
        m.moves(src, dst, 1, 1, 8, 18, [(0, 0, 2)])  # not a move


def test_transform_refuses_wrong_sizes():
    with pytest.raises(ValueError, match="not a multiple of 8"):
        interleave.transform("q4_0_8x8", bytes(18 * 4), bytearray(18 * 4), 32, 4)
    with pytest.raises(ValueError, match="bytes; got"):
        interleave.transform("q4_0_8x8", bytes(18 * 8), bytearray(18 * 7), 32, 8)


# ---- the daemon ---------------------------------------------------------------------------


def stored(daemon: Daemon, lease, k: int, part: str) -> bytes:
    slot = lease.slots[k]
    seg = daemon.ramtier.segments[slot.class_id]
    j = seg.part_names.index(part)
    return ctypes.string_at(seg.part_addr(slot.index, j), seg.part_bytes[j])


def made_on_read(model, layer: int, expert: int, part: str) -> bytes:
    """What the daemon must store: the transform of the file's bytes (plain types: the bytes)."""
    ext = model.catalog.layers[layer].parts[part]
    n = ext.bytes_per_expert
    plain = file_bytes(ext.path, ext.offset + expert * n, n)
    layout = model.layouts.get(ext.type_name)
    if layout is None:
        return plain
    out = bytearray(n)
    interleave.transform(layout, plain, out, ext.shape[0], ext.shape[1])
    return bytes(out)


def test_a_plain_file_in_a_repacked_layout_is_a_model_of_its_own(model_factory):
    path = str(model_factory(quant="q4_0"))
    budget = 6 * slot_bytes_of(path)  # evicts: 32 experts

    async def body(daemon: Daemon):
        fast = await daemon.open_model(path, layout="q4_0_8x8")
        again = await daemon.open_model(path, layout="q4_0_8x8")
        plain = await daemon.open_model(path, layout="plain")
        assert fast is again and plain is not fast and plain is await daemon.open_model(path)
        assert (fast.expert_layout, fast.info.expert_layout, plain.expert_layout) == ("q4_0_8x8", "q4_0_8x8", "plain")
        for layer in sorted(fast.catalog.layers):
            for e in range(fast.catalog.n_experts):
                lease = await lease_of(daemon, fast, layer, [e])
                for part in fast.catalog.parts:
                    assert stored(daemon, lease, 0, part) == made_on_read(fast, layer, e, part), (layer, e, part)
                daemon.release(lease)
        lease = await lease_of(daemon, plain, 0, [1])  # separate slots: the file's bytes
        for part in plain.catalog.parts:
            assert stored(daemon, lease, 0, part) == made_on_read(plain, 0, 1, part)
        daemon.release(lease)
        stats = daemon.stats()
        rows = {r["model_id"]: r for r in stats["models"]}
        assert rows[fast.model_id]["expert_layout"] == "q4_0_8x8" and rows[fast.model_id]["repack_on_read"]
        assert rows[plain.model_id]["expert_layout"] == "plain" and not rows[plain.model_id]["repack_on_read"]
        assert stats["repacked_bytes"] > 0 and stats["repack_cpu_s"] > 0
        assert stats["evictions"] > 0

    run(body, budget_bytes=budget)


def test_a_mixed_file_repacks_only_the_types_asked(q4_k_m_model):
    """q4_k_m: Q4_K gate/up (and down in two layers) repacked, Q6_K down parts as read."""
    path = str(q4_k_m_model)

    async def body(daemon: Daemon):
        model = await daemon.open_model(path, layout="q4_K_8x8+plain")
        assert model.layouts == {"Q4_K": "q4_K_8x8"}
        kinds = set()
        for layer in sorted(model.catalog.layers):
            lease = await lease_of(daemon, model, layer, [3])
            for part in model.catalog.parts:
                ext = model.catalog.layers[layer].parts[part]
                kinds.add(ext.type_name)
                want = made_on_read(model, layer, 3, part)
                assert stored(daemon, lease, 0, part) == want
                plain = file_bytes(ext.path, ext.offset + 3 * ext.bytes_per_expert, ext.bytes_per_expert)
                assert (want == plain) == (ext.type_name == "Q6_K")
            daemon.release(lease)
        assert kinds == {"Q4_K", "Q6_K"}

    run(body, budget_bytes=64 << 20)


@pytest.mark.parametrize(
    "layout, why",
    [
        ("q4_0_8x8", "no expert is Q4_0"),
        ("q4_K_8x8", "'q4_K_8x8\\+plain' would"),
        ("q9_9x9", "does not make"),
    ],
)
def test_a_layout_the_daemon_cannot_make_is_refused_and_leaves_no_model(q4_k_m_model, layout, why):
    async def body(daemon: Daemon):
        with pytest.raises(errors.LayoutUnavailable, match=why):
            await daemon.open_model(str(q4_k_m_model), layout=layout)
        assert not daemon.models

    run(body)


def test_a_repacked_file_is_served_as_it_is_or_refused(tmp_path, model_factory):
    """A file `align --repack` made holds its layout: asked for it, its bytes as they are; asked for
    any other (plain included), refused: the daemon never un-repacks nor repacks twice."""
    from moed.gguf.align import Transform, align_gguf
    from moed.gguf.layouts import KEY_LAYOUTS

    src = str(model_factory(quant="q4_0"))
    done = str(tmp_path / "repacked.gguf")
    align_gguf(src, done, transform=Transform(lambda t: None, {KEY_LAYOUTS: ["Q4_0=q4_0_8x8"]}))

    async def body(daemon: Daemon):
        model = await daemon.open_model(done, layout="q4_0_8x8")
        assert not model.layouts and model.expert_layout == "q4_0_8x8"
        assert model is await daemon.open_model(done)
        for other in ("plain", "q4_0_4x8"):
            with pytest.raises(errors.LayoutUnavailable, match="its experts are q4_0_8x8"):
                await daemon.open_model(done, layout=other)

    run(body)


def test_a_changed_file_retires_every_layout_of_it(tmp_path, model_factory):
    path = tmp_path / "m.gguf"
    path.write_bytes(model_factory(quant="q4_0").read_bytes())

    async def body(daemon: Daemon):
        fast = await daemon.open_model(str(path), layout="q4_0_8x8")
        plain = await daemon.open_model(str(path))
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        newer = await daemon.open_model(str(path), layout="q4_0_8x8")
        assert fast.stale and plain.stale and not newer.stale
        assert set(daemon.models) == {newer.model_id}

    run(body)


def test_verify_mode_hashes_what_is_stored(model_factory):
    path = str(model_factory(quant="q4_0"))

    async def body(daemon: Daemon):
        model = await daemon.open_model(path, layout="q4_0_8x8")
        for _ in range(2):  # the second read (after eviction) must hash as the first
            for e in range(model.catalog.n_experts):
                daemon.release(await lease_of(daemon, model, 0, [e]))
        s = daemon.stats()
        assert s["verified_reads"] > 0 and s["verify_mismatches"] == 0

    run(body, budget_bytes=2 * slot_bytes_of(path), verify=True)


def test_catalog_shapes_are_what_resolve_reads(model_factory):
    cat = Catalog.open(str(model_factory(quant="q4_0")))
    part = next(iter(cat.layers.values())).parts["gate"]
    assert len(part.shape) == 3 and part.shape[2] == cat.n_experts  # (ne0, ne1, n_expert)


def test_a_part_larger_than_a_chunk_is_transformed_chunk_by_chunk(model_factory):
    """The reader splits a repacked part into chunks of whole row groups (36 KiB parts of 1152-byte
    groups in 4 KiB chunks: 3456 bytes each, none page-aligned) and transforms each as it is read."""
    path = str(model_factory(quant="q4_0", embd=256, ff=256))

    async def body(daemon: Daemon):
        model = await daemon.open_model(path, layout="q4_0_8x8")
        part = model.catalog.layers[0].parts["down"]
        assert part.bytes_per_expert > 4096 * 8
        lease = await lease_of(daemon, model, 0, [0, 5])
        for k, e in enumerate((0, 5)):
            for name in model.catalog.parts:
                assert stored(daemon, lease, k, name) == made_on_read(model, 0, e, name), (e, name)
        daemon.release(lease)
        assert daemon.stats()["repacked_bytes"] == 2 * sum(
            p.bytes_per_expert for p in model.catalog.layers[0].parts.values()
        )

    run(body, budget_bytes=8 << 20, chunk_bytes=4096)


def test_a_transform_that_fails_fails_the_read_and_serves_nothing(model_factory, monkeypatch):
    from moed.daemon.onread import PartRepack

    def broken(self, src, dest, n):
        raise RuntimeError("a bug")

    monkeypatch.setattr(PartRepack, "into", broken)
    path = str(model_factory(quant="q4_0"))

    async def body(daemon: Daemon):
        model = await daemon.open_model(path, layout="q4_0_8x8")
        with pytest.raises(errors.InternalError, match="repacking on read failed: RuntimeError: a bug"):
            await lease_of(daemon, model, 0, [1])
        assert daemon.stats()["read_errors"] == 1 and daemon.store.used_bytes == 0
        plain = await daemon.open_model(path)  # the plain model has no transform: served
        daemon.release(await lease_of(daemon, plain, 0, [1]))

    run(body)
