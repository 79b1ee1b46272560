"""Fast GGUF header parsing: key/values and tensor infos, never tensor data.

Why not `gguf.GGUFReader` on the daemon's path: it builds a numpy view per array
element, so a real 150k-token vocabulary takes ~10 s to open (measured), and it
raises bare ValueErrors on truncated files. This parser walks the header with
`struct`, skips string arrays without decoding them, keeps each key/value's raw
bytes (so `moectl align` copies metadata byte for byte) and turns every problem
into `BadModelFile` naming the file. The tests check it against GGUFReader.

Invariants: only little-endian GGUF v2/v3; offsets in `TensorInfo.offset` are
absolute file offsets; `Header.data_offset` is aligned to `Header.alignment`.

Opening a model path never blocks and never reads anything but a regular file
(`open_regular`): the open is non-blocking (a FIFO or a device cannot hang the
caller) and the opened descriptor is checked with fstat before any read.
`Header.identity` is the parsed file's identity from that same descriptor
(device, inode, size, mtime, ctime): any later write, truncation or rename-over
changes it.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import mmap
import os
import re
import stat
import struct
from dataclasses import dataclass, field

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from moed.protocol.errors import BadModelFile
from moed.protocol.layout import round_up

GGUF_MAGIC = b"GGUF"
SHARD_RE = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4

# GGUF value types -> (struct format, size) for scalars.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
T_STRING, T_ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order: ne0 (contiguous) first
    ggml_type: int
    offset: int  # absolute file offset of the tensor's first byte
    n_bytes: int

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)


@dataclass(frozen=True)
class KV:
    key: str
    vtype: int
    raw: bytes = field(repr=False)  # the whole entry as stored: key, type, value
    value_at: int = field(repr=False)  # where the value starts inside `raw`

    @functools.cached_property
    def value(self):
        return _Cursor(self.raw, "<kv>", len(self.raw), self.value_at).value(self.vtype)


FileIdentity = tuple[int, int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns


def identity_of(st: os.stat_result) -> FileIdentity:
    """What says a file is still the one we read: a write changes mtime, a chmod or
    rename-over changes ctime or the inode, a truncation the size."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def open_regular(path: str, extra_flags: int = 0) -> tuple[int, os.stat_result]:
    """Open `path` read-only without blocking; (fd, fstat) if it is a regular file.

    O_NONBLOCK: opening a FIFO with no writer (or a tty, a device) returns at
    once instead of hanging the thread. For a regular file the flag changes
    nothing. Raises BadModelFile for anything else.
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY | extra_flags
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise BadModelFile(f"{path}: no such file") from None
    except IsADirectoryError:
        raise BadModelFile(f"{path}: is a directory") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP and extra_flags & os.O_NOFOLLOW:
            raise BadModelFile(f"{path}: became a symbolic link while being opened") from None
        try:  # a socket refuses open (ENXIO): say what it is, not the errno
            mode = os.stat(path).st_mode
        except OSError:
            mode = stat.S_IFREG
        if not stat.S_ISREG(mode):
            raise BadModelFile(f"{path}: {_kind(mode)}, not a regular file") from None
        raise BadModelFile(f"{path}: cannot open: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadModelFile(f"{path}: {_kind(st.st_mode)}, not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "is a directory"),
        (stat.S_ISFIFO, "is a FIFO"),
        (stat.S_ISSOCK, "is a socket"),
        (stat.S_ISCHR, "is a character device"),
        (stat.S_ISBLK, "is a block device"),
    ):
        if test(mode):
            return name
    return "is a special file"


@dataclass(frozen=True)
class Header:
    path: str
    version: int
    file_size: int
    kvs: dict[str, KV]
    tensors: tuple[TensorInfo, ...]
    alignment: int
    data_offset: int
    identity: FileIdentity = (0, 0, 0, 0, 0)

    def get(self, key: str, default=None):
        kv = self.kvs.get(key)
        return default if kv is None else kv.value


def type_name(ggml_type: int) -> str:
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type{ggml_type}"


def tensor_nbytes(path: str, name: str, dims: tuple[int, ...], ggml_type: int) -> int:
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise BadModelFile(f"{path}: tensor {name!r} has unknown ggml type {ggml_type}") from None
    n = 1
    for d in dims:
        n *= d
    if dims and dims[0] % block:
        raise BadModelFile(
            f"{path}: tensor {name!r} rows of {dims[0]} are not whole {type_name(ggml_type)} blocks of {block}"
        )
    return n // block * size


class _Cursor:
    """Bounds-checked little-endian reads over a buffer; overruns mean truncation."""

    def __init__(self, buf, path: str, size: int, pos: int = 0):
        self.buf, self.path, self.size, self.pos = buf, path, size, pos

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise BadModelFile(
                f"{self.path}: truncated or corrupt GGUF header (needs byte {self.pos + n}, file has {self.size})"
            )

    def scalar(self, fmt: str):
        n = struct.calcsize("<" + fmt)
        self.need(n)
        (v,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self) -> str:
        n = self.scalar("Q")
        self.need(n)
        s = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return s.decode("utf-8", errors="replace")

    def skip_value(self, vtype: int) -> None:
        if vtype in _SCALARS:
            n = struct.calcsize("<" + _SCALARS[vtype])
            self.need(n)
            self.pos += n
        elif vtype == T_STRING:
            n = self.scalar("Q")
            self.need(n)
            self.pos += n
        elif vtype == T_ARRAY:
            sub, count = self.scalar("I"), self.scalar("Q")
            if sub in _SCALARS:
                n = struct.calcsize("<" + _SCALARS[sub]) * count
                self.need(n)
                self.pos += n
            elif sub == T_STRING:
                # The hot loop for big vocabularies: lengths only, no decoding.
                # unpack_from raises past the end of the buffer: that is the bounds check.
                unpack, buf, pos = _U64.unpack_from, self.buf, self.pos
                try:
                    for _ in range(count):
                        pos += 8 + unpack(buf, pos)[0]
                except (struct.error, OverflowError):
                    self.pos = min(pos, self.size + 1)
                    self.need(8)
                self.pos = pos
                self.need(0)
            elif sub == T_ARRAY:
                for _ in range(count):
                    self.skip_value(T_ARRAY)
            else:
                raise BadModelFile(f"{self.path}: unknown GGUF array element type {sub}")
        else:
            raise BadModelFile(f"{self.path}: unknown GGUF value type {vtype}")

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == T_STRING:
            return self.string()
        if vtype == T_ARRAY:
            sub, count = self.scalar("I"), self.scalar("Q")
            return [self.value(sub) for _ in range(count)]
        raise BadModelFile(f"{self.path}: unknown GGUF value type {vtype}")


def read_header(path: str | os.PathLike) -> Header:
    """Parse `path`'s header; raises BadModelFile for anything that is not a sound GGUF."""
    path = os.fspath(path)
    fd, st = open_regular(path)
    try:
        size = st.st_size
        if size < 24:
            head = os.pread(fd, 4, 0)
            if head != GGUF_MAGIC:
                raise BadModelFile(f"{path}: not a GGUF file (no GGUF magic)")
            raise BadModelFile(f"{path}: truncated GGUF file ({size} bytes)")
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as buf:
            return dataclasses.replace(_parse(buf, path, size), identity=identity_of(st))
    finally:
        os.close(fd)


def _parse(buf, path: str, size: int) -> Header:
    if buf[:4] != GGUF_MAGIC:
        raise BadModelFile(f"{path}: not a GGUF file (no GGUF magic)")
    c = _Cursor(buf, path, size, 4)
    version = c.scalar("I")
    if version not in (2, 3):
        if version & 0xFFFF == 0:
            raise BadModelFile(f"{path}: big-endian GGUF is not supported")
        raise BadModelFile(f"{path}: unsupported GGUF version {version}")
    n_tensors, n_kv = c.scalar("Q"), c.scalar("Q")
    # Each entry takes at least 8 bytes, so counts beyond the file size are corrupt.
    if n_tensors > size // 8 or n_kv > size // 8:
        raise BadModelFile(f"{path}: corrupt GGUF header (tensor/kv counts {n_tensors}/{n_kv})")
    kvs: dict[str, KV] = {}
    for _ in range(n_kv):
        start = c.pos
        key = c.string()
        vtype = c.scalar("I")
        value_at = c.pos - start
        c.skip_value(vtype)
        if key in kvs:
            raise BadModelFile(f"{path}: duplicate GGUF key {key!r}")
        kvs[key] = KV(key, vtype, bytes(buf[start : c.pos]), value_at)
    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in kvs:
        kv = kvs["general.alignment"]
        alignment = kv.value if kv.vtype == 4 else 0
        if alignment <= 0 or alignment & (alignment - 1):
            raise BadModelFile(f"{path}: bad general.alignment {kv.value!r} (must be a power of two u32)")
    raw_infos = [_tensor_info(c) for _ in range(n_tensors)]
    data_offset = round_up(c.pos, alignment)
    tensors = tuple(_place(path, size, alignment, data_offset, *info) for info in raw_infos)
    if len({t.name for t in tensors}) != len(tensors):
        raise BadModelFile(f"{path}: duplicate tensor names")
    return Header(path, version, size, kvs, tensors, alignment, data_offset)


def _tensor_info(c: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = c.string()
    n_dims = c.scalar("I")
    if not 1 <= n_dims <= MAX_DIMS:
        raise BadModelFile(f"{c.path}: tensor {name!r} has {n_dims} dimensions")
    dims = tuple(c.scalar("Q") for _ in range(n_dims))
    return name, dims, c.scalar("I"), c.scalar("Q")


def _place(
    path: str, size: int, alignment: int, data_offset: int, name: str, dims: tuple[int, ...], ggml_type: int, rel: int
) -> TensorInfo:
    n_bytes = tensor_nbytes(path, name, dims, ggml_type)
    if rel % alignment:
        raise BadModelFile(f"{path}: tensor {name!r} offset {rel} is not aligned to {alignment}")
    offset = data_offset + rel
    if offset + n_bytes > size:
        raise BadModelFile(
            f"{path}: truncated: tensor {name!r} ends at byte {offset + n_bytes} but the file has {size} bytes"
        )
    return TensorInfo(name, dims, ggml_type, offset, n_bytes)


# ---------------------------------------------------------------------- split files


def shard_names(first: str | os.PathLike, count: int) -> list[str]:
    """llama.cpp's names for `count` shards; `first` is `X.gguf` or `X-00001-of-0000N.gguf`."""
    first = os.fspath(first)
    if count <= 1:
        return [first]
    m = SHARD_RE.match(first)
    prefix = m.group(1) if m else (first[:-5] if first.endswith(".gguf") else first)
    return [f"{prefix}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def split_files(path: str, first: Header) -> list[str]:
    """Every shard of the model whose first shard is `path` (just `[path]` if not split)."""
    count = first.get("split.count", 1)
    number = first.get("split.no", 0)
    if not isinstance(count, int) or count <= 1:
        return [path]
    if number != 0:
        raise BadModelFile(f"{path}: this is shard {number + 1} of {count}; open the first shard")
    m = SHARD_RE.match(path)
    if not m or int(m.group(2)) != 1 or int(m.group(3)) != count:
        raise BadModelFile(
            f"{path}: split into {count} shards, but the name does not follow "
            f"llama.cpp's PREFIX-00001-of-{count:05d}.gguf naming"
        )
    files = shard_names(path, count)
    missing = [f for f in files if not os.path.exists(f)]
    if missing:
        raise BadModelFile(f"{path}: missing shard(s) of {count}: {', '.join(missing)}")
    return files


def check_split(headers: list[Header]) -> None:
    """Shards must number themselves 0..N-1 of N and hold split.tensors.count tensors."""
    count = len(headers)
    if count == 1:
        return
    for i, h in enumerate(headers):
        if h.get("split.no") != i or h.get("split.count") != count:
            raise BadModelFile(
                f"{h.path}: split keys say shard {h.get('split.no')} of "
                f"{h.get('split.count')}, expected shard {i} of {count}"
            )
    expected = headers[0].get("split.tensors.count")
    found = sum(len(h.tensors) for h in headers)
    if expected is not None and expected != found:
        raise BadModelFile(
            f"{headers[0].path}: split.tensors.count is {expected} but the {count} shards hold {found} tensors"
        )


def read_split(path: str | os.PathLike) -> list[Header]:
    """Headers of every shard, checked to agree, first shard first."""
    path = os.path.abspath(os.fspath(path))
    first = read_header(path)
    headers = [first] + [read_header(f) for f in split_files(path, first)[1:]]
    check_split(headers)
    return headers
