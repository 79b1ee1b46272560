"""The reader pool's failures on a real file: end of file, retries counted, the piece named.

(The kernel's EIO itself comes from a corrupted btrfs block in
tests/integration/test_drive_faults.py; a unit test cannot make one.)
"""

from __future__ import annotations

import ctypes
import mmap
import threading

from moed.daemon.reader import ModelFile, ReaderPool, ReadFailure, ReadJob


def _run(pool: ReaderPool, pieces) -> BaseException | None:
    done = threading.Event()
    got: list = []

    def on_done(job, err):
        got.append(err)
        done.set()

    pool.submit(ReadJob(pieces, on_done))
    assert done.wait(10)
    return got[0]


def test_a_range_past_the_end_fails_with_end_of_file_naming_the_piece(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 64)  # 16 KiB
    f = ModelFile(str(path), direct_io="off")
    dest = mmap.mmap(-1, 3 * 4096)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(dest))
    pool = ReaderPool(threads=2, chunk_bytes=4096, retries=2, retry_backoff_s=0.001)
    try:
        assert _run(pool, [(f, 0, 4096, addr), (f, 4096, 4096, addr + 4096)]) is None
        assert dest[:4096] == path.read_bytes()[:4096]
        err = _run(pool, [(f, 0, 4096, addr), (f, 14 * 1024, 4096, addr + 4096)])
        assert isinstance(err, ReadFailure) and err.errno == 0 and err.piece == 1
        assert "end of file reading 4096 bytes at offset 14336" in str(err)
        assert pool.retried == 0  # end of file is never retried
        assert pool.health.samples >= 3
    finally:
        pool.close()
        f.close()
        dest.close()


def test_the_message_names_the_errno_and_the_attempts():
    err = ReadFailure(5, "/m.gguf", 8192, 69632, piece=2, attempts=3)
    assert str(err) == "[Errno 5] EIO (Input/output error) reading 69632 bytes at offset 8192 of /m.gguf, 3 attempts"


def test_a_read_errors_facts_travel_in_the_error_reply():
    import msgspec

    from moed.protocol import errors
    from moed.protocol import messages as m

    exc = errors.ReadError("reading ... failed", model="/m.gguf", model_id=1, layer=1, expert=5, part="down", errno=5)
    wire = msgspec.msgpack.encode(m.Error(int(exc.code), exc.message, exc.detail))
    reply = msgspec.msgpack.decode(wire, type=m.Reply)
    again = errors.error_for(reply.code, reply.message, reply.detail)
    assert type(again) is errors.ReadError and again.detail == exc.detail
    assert (again.layer, again.expert, again.part, again.errno) == (1, 5, "down", 5)
    assert errors.error_for(reply.code, "no detail").expert is None  # an older daemon sends none
    assert errors.error_for(int(errors.ErrorCode.BAD_REQUEST), "x", {"expert": 5}).detail == {}
