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
