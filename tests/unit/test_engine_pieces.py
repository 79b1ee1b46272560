"""Pure pieces of the engine side: skeleton ranges, /proc maps parsing, moectl verbs."""

from __future__ import annotations

import mmap
import os

from moed.engines import vm
from moed.engines.skeleton import dense_ranges


def test_dense_ranges_are_the_complement_of_the_expert_holes():
    assert dense_ranges(100, [(10, 20), (20, 30), (50, 60)]) == [(0, 10), (30, 50), (60, 100)]
    assert dense_ranges(100, [(0, 100)]) == []
    assert dense_ranges(100, []) == [(0, 100)]


def test_file_mapping_base_finds_our_mapping_by_inode(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 3 * vm.PAGE)
    fd = os.open(path, os.O_RDONLY)
    try:
        before = vm.file_mapping_base(str(path))
        assert before is None
        m = mmap.mmap(fd, 2 * vm.PAGE, mmap.MAP_SHARED, mmap.PROT_READ, offset=vm.PAGE)
        import numpy as np

        addr = np.frombuffer(m, dtype=np.uint8).ctypes.data
        # the mapping starts at file offset PAGE, so offset 0 would sit one page lower
        assert vm.file_mapping_base(str(path)) == addr - vm.PAGE
        assert vm.file_mapping_base(str(path), {addr - vm.PAGE}) is None
        assert vm.mapped_ranges(addr - vm.PAGE, str(path)) == [(addr, addr + 2 * vm.PAGE)]
        del addr
        m.close()
    finally:
        os.close(fd)


def test_moectl_has_the_engine_verbs():
    from moed.ctl import build_parser

    parser = build_parser()
    for verb in ("generate", "chat", "trace"):
        args = parser.parse_args(
            [
                verb,
                "m.gguf",
                *(["--prompt", "x"] if verb == "generate" else []),
                *(["--prompt-file", "p", "-o", "t"] if verb == "trace" else []),
            ]
        )
        assert args.model == "m.gguf" and callable(args.func)


def test_skeleton_default_dir_follows_the_environment(monkeypatch, tmp_path):
    from moed.engines.skeleton import default_dir

    monkeypatch.setenv("MOED_SKELETON_DIR", str(tmp_path / "given"))
    assert default_dir() == tmp_path / "given"
    monkeypatch.delenv("MOED_SKELETON_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_dir() == tmp_path / "xdg" / "moed" / "skeletons"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_dir() == tmp_path / "home" / ".cache" / "moed" / "skeletons"


def test_skeleton_prune_removes_only_what_no_engine_loaded_lately(tmp_path):
    import os
    import time

    from moed.engines.skeleton import MAX_IDLE_S, prune

    def skeleton(name: str, age_s: float):
        d = tmp_path / name
        d.mkdir()
        (d / "m.gguf").write_bytes(b"x")
        stamp = d / "m.gguf.src"
        stamp.write_text("id")
        t = time.time() - age_s
        os.utime(stamp, (t, t))
        return d

    old = skeleton("old", MAX_IDLE_S + 60)
    recent = skeleton("recent", MAX_IDLE_S - 3600)
    kept = skeleton("just-written-but-old-stamp", MAX_IDLE_S + 60)
    other = tmp_path / "not-a-skeleton"
    other.mkdir()  # no stamp: not ours to judge
    assert prune(tmp_path, keep=kept) == [old]
    assert not old.exists() and recent.exists() and kept.exists() and other.exists()


def test_an_expert_source_declares_a_default_for_every_optional_step():
    """The engine never asks whether a source has a method: what a source leaves out is the
    base class's declared default."""
    import numpy as np
    import pytest

    from moed.engines.options import EngineOptions
    from moed.engines.sources import ExpertSource
    from moed.gguf.layouts import PLAIN

    class Bare(ExpertSource):
        files, moe_layers, n_experts, n_expert_used = ["m.gguf"], [0, 1], 8, 2

    src = Bare()
    assert src.hit(0, [1, 2]) is None  # no hits with no round trip: the cycle acquires
    assert src.capacity(0) is None and src.size_class(0) == src.capacity(0)
    assert src.lane() is None and src.expert_layout == PLAIN and not src.tells_residency
    np.testing.assert_array_equal(src.resident(0, [1, 2, 3]), np.zeros(3, bool))
    assert src.prefetch(0, [1]) is None
    for step in (lambda: src.extents(0), lambda: src.acquire(0, [1]), lambda: src.release(None)):
        with pytest.raises(NotImplementedError):
            step()
    pytest.importorskip("llama_cpp")
    from moed.engines.cycle import substituter_for

    with pytest.raises(ValueError, match="tells_residency"):
        substituter_for(src, EngineOptions(subst=0.5))  # substitution needs residency it can read
    assert substituter_for(src, EngineOptions()) is None


def test_a_second_skeleton_writer_never_replaces_the_published_file(tmp_path):
    """Engines started together each write a skeleton; the one published first stays, so an
    engine loading it never finds its mapping pointing at a deleted file (issue 46)."""
    from moed.engines.skeleton import _write

    real = tmp_path / "model.gguf"
    real.write_bytes(bytes(range(256)) * 64)
    dst = tmp_path / "skel.gguf"
    _write(str(real), str(dst), [(4096, 8192)])
    first = os.stat(dst)
    with open(dst, "rb") as loading:  # the first engine has it open
        _write(str(real), str(dst), [(4096, 8192)])
        assert os.fstat(loading.fileno()).st_ino == os.stat(dst).st_ino == first.st_ino
        assert os.fstat(loading.fileno()).st_nlink == 1  # not deleted under it
    body = dst.read_bytes()
    assert body[:4096] == real.read_bytes()[:4096] and body[4096:8192] == bytes(4096)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "skel.gguf"]  # no temporaries left


# ---------------------------------------------------------------------- the device slots' LRU


def _old_lru_step(lru: dict, free: list, want: list[int]) -> int:
    """The device slots' LRU as it was (an ordered dict of expert -> slot, oldest first, and a
    free list): one batch's distinct experts `want` (sorted); returns its evictions."""
    misses = []
    for e in want:
        if e in lru:
            lru[e] = lru.pop(e)  # the batch's hits go last
        else:
            misses.append(e)
    planned, evicted = [], 0
    for e in misses:
        if free:
            planned.append((e, free.pop()))
        else:
            oldest = next(iter(lru))
            planned.append((e, lru.pop(oldest)))
            evicted += 1
    for e, slot in planned:
        lru[e] = slot
    return evicted


def test_the_device_lru_evicts_as_the_ordered_dict_it_replaced():
    """SlotLru's arrays choose the same victims as the OrderedDict the slots kept before:
    free slots first, then the least recently used, the batch's hits stamped in ascending
    order, then its uploads (issue 48: the layout a full hit in C will read)."""
    import numpy as np

    from moed.engines.device_lru import SlotLru, full_hit

    rng = np.random.default_rng(7)
    n_expert, n_slots = 32, 8
    new, old, free = SlotLru(n_expert, n_slots), {}, list(range(n_slots))
    hits = 0
    for _ in range(400):
        ids = rng.integers(0, n_expert, (int(rng.integers(1, 4)), 2), dtype=np.int32)
        want = np.unique(ids)
        if len(want) > n_slots:
            continue
        hits += sum(int(e) in old for e in want)
        evicted = _old_lru_step(old, free, want.tolist())
        slot_ids = full_hit(new, ids)
        if slot_ids is None:
            misses, slots, got = new.admit(want)
            assert got == evicted
            for e, s in zip(misses, slots):
                new.assign(e, s)
            slot_ids = new.slot_of_expert[ids]
        else:
            assert evicted == 0
        assert new.resident() == list(old)  # the same experts, in the same order
        np.testing.assert_array_equal(new.expert_of_slot[slot_ids], ids)
        held = new.expert_of_slot >= 0
        np.testing.assert_array_equal(new.slot_of_expert[new.expert_of_slot[held]], np.flatnonzero(held))
    assert new.hits == hits


def test_a_full_hit_changes_nothing_unless_every_expert_is_in_a_slot():
    import numpy as np

    from moed.engines.device_lru import SlotLru, full_hit

    lru = SlotLru(8, 4)
    for e, s in ((1, 0), (5, 3)):
        lru.assign(e, s)
    before = (lru.last_use.copy(), lru.clock.copy())
    for ids in ([[1, 2]], [[1, 8]], [[-1, 5]]):  # a miss, past the experts, below them
        assert full_hit(lru, np.array(ids, np.int32)) is None
        np.testing.assert_array_equal(lru.last_use, before[0])
        np.testing.assert_array_equal(lru.clock, before[1])
    got = full_hit(lru, np.array([[5, 1], [1, 5]], np.int32))
    assert got is not None and got.tolist() == [[3, 0], [0, 3]]
    assert lru.hits == 2 and lru.clock[0] == before[1][0] + 2  # one tick a distinct expert
    assert lru.resident() == [1, 5]  # stamped in ascending expert order


def test_skip_ids_are_k_distinct_slots_a_row_spread_over_all():
    import numpy as np

    from moed.engines.device_placement import skip_ids

    ids = skip_ids(5, 4, 6)
    assert ids.shape == (5, 4) and ids.dtype == np.int32
    assert all(len(set(row)) == 4 for row in ids.tolist()) and set(ids.ravel().tolist()) == set(range(6))


# ---- the streamer: a composition root over parts with one job each (issue 48, item 1)

STREAMER_PARTS = ("streamer", "mapping", "binding", "cycle", "steps", "grants", "report")


def _engine_module(name: str):
    import ast
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "moed" / "engines" / f"{name}.py"
    return ast.parse(path.read_text(), str(path))


def _engine_imports(tree) -> set[str]:
    """The moed.engines modules `tree` imports, type-only imports included."""
    import ast

    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "moed.engines":
            found |= {f"moed.engines.{a.name}" for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moed.engines."):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("moed.engines.")}
    return found


def test_the_streamer_is_a_small_root_that_names_no_concrete_placement():
    """streamer.py imports at most 8 engine modules, none of them a device placement (not even
    for types); no class of the streamer's parts is over 300 lines, and the root at most 250."""
    import ast

    imported = _engine_imports(_engine_module("streamer"))
    assert len(imported) <= 8, sorted(imported)
    for name in STREAMER_PARTS:
        tree = _engine_module(name)
        assert not {m for m in _engine_imports(tree) if m.startswith("moed.engines.device")}, name
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                assert lines <= (250 if node.name == "ExpertStreamer" else 300), (name, node.name, lines)


def test_every_release_of_a_grant_by_the_cycle_is_a_route_of_grants():
    """The streamer's parts let a grant go only through moed.engines.grants (GrantRoutes): no
    other part calls a `release` but the routes' own or passes one to an acquire, so who
    releases a grant is decided in one place."""
    import ast

    for name in STREAMER_PARTS:
        if name == "grants":
            continue
        for node in ast.walk(_engine_module(name)):
            if not isinstance(node, ast.Call):
                continue
            if isinstance(node.func, ast.Attribute) and node.func.attr == "release":
                assert ast.unparse(node.func.value).endswith("grants"), (name, ast.unparse(node))
            assert all(k.arg != "release" for k in node.keywords), (name, ast.unparse(node))


def test_no_class_in_the_engine_room_is_over_300_lines():
    """Every class of moed/engines (the streamer's parts, the placements, StreamedLlama, the
    look-ahead, the option table) at most 300 lines, docstring included."""
    import ast
    import pathlib

    room = pathlib.Path(__file__).resolve().parents[2] / "moed" / "engines"
    big = []
    for path in sorted(room.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 300:
                big.append((path.name, node.name, node.end_lineno - node.lineno + 1))
    assert big == []
