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
    from moed.engines.streamer import _substituter

    with pytest.raises(ValueError, match="tells_residency"):
        _substituter(src, EngineOptions(subst=0.5))  # substitution needs residency it can read
    assert _substituter(src, EngineOptions()) is None


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
