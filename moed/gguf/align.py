"""`moectl align`: rewrite a GGUF (split or not) with a larger data alignment.

With `general.alignment = 4096` every tensor starts on a page, so every routed
expert whose byte size is a multiple of 4096 is page-aligned in the file, and an
engine can map the daemon's slot pages straight over it (zero copy).

Invariants:
- Tensor bytes are copied, never re-encoded; key/values are copied byte for byte
  (only `general.alignment` is set, in every shard, because llama.cpp reads each
  shard's own alignment); tensor order, names, types and shapes are unchanged.
- Nothing appears under the output names until every shard has been written,
  flushed and (unless told not to) verified by comparing every tensor's bytes with
  the input: shards are written to `NAME.partial` and renamed at the end.
- A split input keeps its shard count; OUT names the first shard and the others
  follow llama.cpp's `PREFIX-0000i-of-0000N.gguf` naming.
- With a `Transform` (`moectl align --repack`), the tensors it names are rewritten
  unit by unit (one expert at a time) into bytes of the same size, its keys are
  added to every shard, and verification compares each rewritten unit with the
  transform of the input's: everything else is still copied byte for byte.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

from moed.gguf.header import KV, T_ARRAY, T_STRING, Header, TensorInfo, read_split, shard_names
from moed.protocol.layout import round_up

CHUNK_BYTES = 8 << 20

UnitFn = Callable[[bytes], bytes]


@dataclass(frozen=True)
class Transform:
    """Rewrite some tensors' bytes, one unit (an expert: n_bytes / ne2) at a time.

    `unit_of(tensor)`: None copies the tensor as it is; a function maps each unit's
    bytes to as many bytes. `kvs`: string or string-array keys added to every shard.
    """

    unit_of: Callable[[TensorInfo], UnitFn | None]
    kvs: dict[str, str | list[str]] = field(default_factory=dict)

    def unit(self, t: TensorInfo) -> tuple[int, UnitFn] | None:
        fn = self.unit_of(t)
        if fn is None:
            return None
        return t.n_bytes // t.dims[-1], fn

    def kv_entries(self) -> list[bytes]:
        return [_string_kv(k, v) for k, v in self.kvs.items()]


def _gguf_string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _string_kv(key: str, value: str | list[str]) -> bytes:
    if isinstance(value, str):
        return _gguf_string(key) + struct.pack("<I", T_STRING) + _gguf_string(value)
    items = b"".join(_gguf_string(v) for v in value)
    return _gguf_string(key) + struct.pack("<IIQ", T_ARRAY, T_STRING, len(value)) + items


def align_gguf(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    alignment: int = 4096,
    overwrite: bool = False,
    verify: bool = True,
    progress: bool = False,
    transform: Transform | None = None,
) -> list[str]:
    """Write `src` realigned to `dst`; returns the output shard paths (first to load)."""
    if alignment < 8 or alignment & (alignment - 1) or alignment > 1 << 30:
        raise ValueError(f"alignment must be a power of two between 8 and 1 GiB, got {alignment}")
    headers = read_split(src)
    outs = _output_names(headers, os.path.abspath(os.fspath(dst)), overwrite)
    partials = [o + ".partial" for o in outs]
    total = sum(t.n_bytes for h in headers for t in h.tensors)
    try:
        with _Progress(progress, total, verify) as bar:
            for h, part in zip(headers, partials):
                _write_shard(h, part, alignment, bar.copied, transform)
            if verify:
                verify_aligned(
                    headers, partials[0], alignment, on_bytes=bar.verified, names=partials, transform=transform
                )
        for part, out in zip(partials, outs):
            os.replace(part, out)
    finally:
        for part in partials:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(part)
    return outs


def _output_names(headers: list[Header], dst: str, overwrite: bool) -> list[str]:
    outs = shard_names(dst, len(headers))
    for out in outs:
        for h in headers:
            if os.path.exists(out) and os.path.samefile(out, h.path):
                raise ValueError(f"output {out} is the input file {h.path}")
        if os.path.exists(out) and not overwrite:
            raise FileExistsError(f"{out} exists (use --force to overwrite)")
        if not os.path.isdir(os.path.dirname(out)):
            raise FileNotFoundError(f"output directory {os.path.dirname(out)} does not exist")
    return outs


# ---------------------------------------------------------------------- writing


def _alignment_kv(alignment: int) -> bytes:
    key = b"general.alignment"
    return struct.pack("<Q", len(key)) + key + struct.pack("<II", 4, alignment)


def _kv_bytes(kvs: dict[str, KV], alignment: int, transform: Transform | None = None) -> tuple[int, bytes]:
    """(count, bytes) of the key/values with general.alignment set, in input order
    (then the transform's keys)."""
    out, replaced = [], False
    added = transform.kvs if transform else {}
    for key, kv in kvs.items():
        if key in added:
            continue
        if key == "general.alignment":
            out.append(_alignment_kv(alignment))
            replaced = True
        else:
            out.append(kv.raw)
    if not replaced:
        out.append(_alignment_kv(alignment))
    if transform:
        out += transform.kv_entries()
    return len(out), b"".join(out)


def _layout(h: Header, alignment: int, transform: Transform | None = None) -> tuple[bytes, list[int]]:
    """(header bytes padded to the data section, absolute offset of each tensor)."""
    n_kv, kv = _kv_bytes(h.kvs, alignment, transform)
    rel, infos = [], []
    pos = 0
    for t in h.tensors:
        rel.append(pos)
        name = t.name.encode()
        infos.append(
            struct.pack("<Q", len(name))
            + name
            + struct.pack("<I", len(t.dims))
            + struct.pack(f"<{len(t.dims)}Q", *t.dims)
            + struct.pack("<IQ", t.ggml_type, pos)
        )
        pos = round_up(pos + t.n_bytes, alignment)
    head = b"GGUF" + struct.pack("<IQQ", h.version, len(h.tensors), n_kv) + kv + b"".join(infos)
    head += bytes(round_up(len(head), alignment) - len(head))
    return head, [len(head) + r for r in rel]


def _write_shard(h: Header, out: str, alignment: int, on_bytes, transform: Transform | None = None) -> None:
    head, offsets = _layout(h, alignment, transform)
    end = round_up(offsets[-1] + h.tensors[-1].n_bytes, alignment) if h.tensors else len(head)
    src = os.open(h.path, os.O_RDONLY)
    try:
        dst = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwrite(dst, head, 0)
            os.ftruncate(dst, end)  # padding reads back as zeros
            for t, off in zip(h.tensors, offsets):
                unit = transform.unit(t) if transform else None
                if unit is None:
                    _copy_range(src, t.offset, dst, off, t.n_bytes, on_bytes)
                else:
                    _transform_range(src, t, dst, off, unit, on_bytes)
            os.fsync(dst)
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _copy_range(src: int, src_off: int, dst: int, dst_off: int, n: int, on_bytes) -> None:
    while n > 0:
        step = min(n, CHUNK_BYTES)
        try:
            done = os.copy_file_range(src, dst, step, src_off, dst_off)
        except OSError:
            done = 0  # not supported here (e.g. across filesystems)
        if done <= 0:
            data = os.pread(src, step, src_off)
            if len(data) != step:
                raise OSError(f"short read at byte {src_off} of the input")
            done = os.pwrite(dst, data, dst_off)
        src_off, dst_off, n = src_off + done, dst_off + done, n - done
        on_bytes(done)


def _transform_range(src: int, t: TensorInfo, dst: int, dst_off: int, unit: tuple[int, UnitFn], on_bytes) -> None:
    size, fn = unit
    for k in range(t.n_bytes // size):
        data = os.pread(src, size, t.offset + k * size)
        if len(data) != size:
            raise OSError(f"short read at byte {t.offset + k * size} of the input")
        out = fn(data)
        if len(out) != size:
            raise ValueError(f"tensor {t.name}: the transform changed a unit's size ({size} -> {len(out)})")
        os.pwrite(dst, out, dst_off + k * size)
        on_bytes(size)


# ---------------------------------------------------------------------- verification


def verify_aligned(
    src_headers: list[Header],
    dst_first: str,
    alignment: int,
    *,
    on_bytes=lambda n: None,
    names: list[str] | None = None,
    transform: Transform | None = None,
) -> None:
    """Raise ValueError unless the output has the input's metadata and tensor bytes."""
    if names is not None:
        # Partial names do not follow the shard naming; read each one directly.
        from moed.gguf.header import check_split, read_header

        out = [read_header(n) for n in names]
        check_split(out)
    else:
        out = read_split(dst_first)
    if len(out) != len(src_headers):
        raise ValueError(f"output has {len(out)} shards, input {len(src_headers)}")
    for a, b in zip(src_headers, out):
        _verify_meta(a, b, alignment, transform)
        for ta, tb in zip(a.tensors, b.tensors):
            unit = transform.unit(ta) if transform else None
            if unit is None:
                _compare_bytes(a.path, ta.offset, b.path, tb.offset, ta.n_bytes, ta.name, on_bytes)
            else:
                _compare_units(a.path, ta, b.path, tb.offset, unit, on_bytes)


def _compare_units(pa: str, ta: TensorInfo, pb: str, ob: int, unit: tuple[int, UnitFn], on_bytes) -> None:
    size, fn = unit
    with open(pa, "rb", buffering=0) as fa, open(pb, "rb", buffering=0) as fb:
        for k in range(ta.n_bytes // size):
            if fn(os.pread(fa.fileno(), size, ta.offset + k * size)) != os.pread(fb.fileno(), size, ob + k * size):
                raise ValueError(f"tensor {ta.name} differs after writing (unit {k})")
            on_bytes(size)


def _verify_meta(a: Header, b: Header, alignment: int, transform: Transform | None = None) -> None:
    if b.alignment != alignment:
        raise ValueError(f"{b.path}: alignment {b.alignment}, wanted {alignment}")
    added = dict(zip(transform.kvs, transform.kv_entries())) if transform else {}
    keys_a = {k: kv.raw for k, kv in a.kvs.items() if k != "general.alignment" and k not in added}
    keys_a.update(added)
    keys_b = {k: kv.raw for k, kv in b.kvs.items() if k != "general.alignment"}
    if keys_a != keys_b:
        diff = sorted(set(keys_a) ^ set(keys_b)) or [k for k in keys_a if keys_a[k] != keys_b.get(k)]
        raise ValueError(f"{b.path}: metadata differs from {a.path} ({', '.join(diff[:5])})")
    shape_a = [(t.name, t.dims, t.ggml_type) for t in a.tensors]
    shape_b = [(t.name, t.dims, t.ggml_type) for t in b.tensors]
    if shape_a != shape_b:
        raise ValueError(f"{b.path}: tensor list differs from {a.path}")
    for t in b.tensors:
        if t.offset % alignment:
            raise ValueError(f"{b.path}: tensor {t.name} at {t.offset} is not {alignment}-aligned")


def _compare_bytes(pa: str, oa: int, pb: str, ob: int, n: int, name: str, on_bytes) -> None:
    with open(pa, "rb", buffering=0) as fa, open(pb, "rb", buffering=0) as fb:
        done = 0
        while done < n:
            step = min(n - done, CHUNK_BYTES)
            if os.pread(fa.fileno(), step, oa + done) != os.pread(fb.fileno(), step, ob + done):
                raise ValueError(f"tensor {name} differs after writing (bytes {done}..{done + step})")
            done += step
            on_bytes(step)


# ---------------------------------------------------------------------- progress


class _Progress:
    """A rich progress bar on stderr, or nothing."""

    def __init__(self, enabled: bool, total: int, verify: bool):
        self.enabled, self.total, self.verify = enabled, total, verify
        self._bar = None

    def __enter__(self):
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._bar = Progress(
                TextColumn("{task.description:>7}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self._bar.__enter__()
            self._copy = self._bar.add_task("copy", total=self.total)
            if self.verify:
                self._check = self._bar.add_task("verify", total=self.total)
        return self

    def copied(self, n: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._copy, n)

    def verified(self, n: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._check, n)

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)
        return False
