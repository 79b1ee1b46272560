"""Type stubs for the C extension moed/_interleave.c (repack on read's byte moves, moed.gguf.interleave's)."""

from numpy import ndarray
from typing_extensions import Buffer

def chunks(
    src: Buffer | ndarray,
    dst: Buffer | ndarray,
    G: int,
    nb: int,
    R: int,
    bb: int,
    foff: int,
    fsize: int,
    chunk: int,
    o: int,
    xor: int,
    /,
) -> None: ...
def kscales(src: Buffer | ndarray, dst: Buffer | ndarray, G: int, nb: int, bb: int, foff: int, o: int, /) -> None: ...
def moves(
    src: Buffer | ndarray,
    dst: Buffer | ndarray,
    G: int,
    nb: int,
    R: int,
    bb: int,
    plan: tuple[tuple[int, int, int, int, int, int], ...] | list[tuple[int, int, int, int, int, int]],
    /,
) -> None: ...
