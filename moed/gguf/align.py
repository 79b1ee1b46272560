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
"""

from __future__ import annotations

import contextlib
import os
import struct

from moed.gguf.header import KV, Header, read_split, shard_names
from moed.protocol.layout import round_up

CHUNK_BYTES = 8 << 20


def align_gguf(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    alignment: int = 4096,
    overwrite: bool = False,
    verify: bool = True,
    progress: bool = False,
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
                _write_shard(h, part, alignment, bar.copied)
            if verify:
                verify_aligned(headers, partials[0], alignment, on_bytes=bar.verified, names=partials)
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


def _kv_bytes(kvs: dict[str, KV], alignment: int) -> tuple[int, bytes]:
    """(count, bytes) of the key/values with general.alignment set, in input order."""
    out, replaced = [], False
    for key, kv in kvs.items():
        if key == "general.alignment":
            out.append(_alignment_kv(alignment))
            replaced = True
        else:
            out.append(kv.raw)
    if not replaced:
        out.append(_alignment_kv(alignment))
    return len(out), b"".join(out)


def _layout(h: Header, alignment: int) -> tuple[bytes, list[int]]:
    """(header bytes padded to the data section, absolute offset of each tensor)."""
    n_kv, kv = _kv_bytes(h.kvs, alignment)
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


def _write_shard(h: Header, out: str, alignment: int, on_bytes) -> None:
    head, offsets = _layout(h, alignment)
    end = round_up(offsets[-1] + h.tensors[-1].n_bytes, alignment) if h.tensors else len(head)
    src = os.open(h.path, os.O_RDONLY)
    try:
        dst = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwrite(dst, head, 0)
            os.ftruncate(dst, end)  # padding reads back as zeros
            for t, off in zip(h.tensors, offsets):
                _copy_range(src, t.offset, dst, off, t.n_bytes, on_bytes)
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


# ---------------------------------------------------------------------- verification


def verify_aligned(
    src_headers: list[Header],
    dst_first: str,
    alignment: int,
    *,
    on_bytes=lambda n: None,
    names: list[str] | None = None,
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
        _verify_meta(a, b, alignment)
        for ta, tb in zip(a.tensors, b.tensors):
            _compare_bytes(a.path, ta.offset, b.path, tb.offset, ta.n_bytes, ta.name, on_bytes)


def _verify_meta(a: Header, b: Header, alignment: int) -> None:
    if b.alignment != alignment:
        raise ValueError(f"{b.path}: alignment {b.alignment}, wanted {alignment}")
    keys_a = {k: kv.raw for k, kv in a.kvs.items() if k != "general.alignment"}
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
