"""Routing traces: one in-memory form, one native file format, two importers.

This module sits below the engines (which record traces, moed.engines.tracing) and
the lab (which studies them), so neither imports the other for the format.

A trace records, for every token an engine ran, which routed experts the router
chose in every MoE layer. Tokens come in steps: a prompt step ('P') is one batch
of prompt tokens, a decode step ('D') is usually one generated token. A trace may
also carry gate-ahead predictions for decode tokens: `ahead1[t, l]` is layer l's
router applied to layer l-1's output (known while layer l's attention runs),
`ahead2[t, l]` the same from layer l-2's output, both best first, usually 2 x
top-k wide. Predictions are stored at the layer they predict.

In memory (`Trace`), everything is a dense int array, token-major:

    ids[t, l, :]      top-k expert ids of token t in MoE layer l (router order);
                      -1 pads a row that has fewer than `top_k` ids
    ahead1, ahead2    None, or int arrays (tokens, layers, width), -1 = none
    step_kinds        one byte per step, ord('P') or ord('D')
    step_offsets      token index where each step starts (len = steps + 1)

Layers are numbered 0..moe_layers-1 in the order the model runs them;
`geometry.layer_ids` maps them back to the model's block numbers (a model whose
first block is dense has MoE layers 1..N).

Native file (`save`, `.npz` suffix by convention, any name works): an
uncompressed zip written by `numpy.savez` holding

    header      uint8 bytes of a JSON object {"format": "moed-trace",
                "version": 1, "geometry": {...}, "meta": {...}}
    ids         expert id + 1 (0 = none), uint8 when n_experts < 255, else
                uint16 (uint32 beyond 65534), shape (T, L, K)
    step_kind   uint8, shape (S,): ord('P') or ord('D')
    step_tokens int32, shape (S,): tokens per step
    ahead1, ahead2   optional, stored like ids, shape (N, L, W): only the N
                tokens that carry a prediction, listed in ahead1_tokens /
                ahead2_tokens (int32 token indices)

Readers check `format` and reject a `version` they do not know; new fields are
only ever added to the header or as new optional members.

Imported formats (auto-detected by `Trace.load`):
  * nvmoe JSONL: one JSON array per decoded token, `[[layer, expert], ...]` in
    layer order. Every token is a decode step; layers are the model's block
    numbers (renumbered densely, kept in `layer_ids`).
  * TSV (tools/moe_trace.cpp): `step <TAB> layer <TAB> kind <TAB> e1,e2,...
    [<TAB> gate-ahead ids <TAB> two-ahead ids]`, "-" for no prediction. The rows
    of one step appear layer by layer, token by token within a layer. The older
    3-column form `step <TAB> layer <TAB> ids` has no kind: step 0 is the prompt,
    every later step a decoded token. Lines starting with '#' are comments.

Invariants: every id is -1 or in [0, n_experts); every step has >= 1 token; the
arrays are never mutated after construction (views are handed out freely).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from moed.badinput import BadInput

FORMAT_NAME = "moed-trace"
FORMAT_VERSION = 1
PROMPT = "P"
DECODE = "D"
_KIND_CODE = {PROMPT: ord(PROMPT), DECODE: ord(DECODE)}
_ZIP_MAGIC = b"PK\x03\x04"


class BadTrace(BadInput):
    """A trace file or a step handed to TraceWriter is malformed."""


@dataclass(frozen=True)
class TraceGeometry:
    """The model's routing shape. `bytes_per_expert` is all parts of one expert."""

    moe_layers: int
    n_experts: int
    top_k: int
    bytes_per_expert: int | None = None
    layer_ids: tuple[int, ...] | None = None  # None means 0..moe_layers-1

    def __post_init__(self) -> None:
        if self.moe_layers < 1 or self.n_experts < 1 or self.top_k < 1:
            raise BadTrace(f"bad geometry: {self}")
        layer_ids = self.layer_ids
        if layer_ids is None:  # dense numbering unless the model says otherwise
            layer_ids = tuple(range(self.moe_layers))
            object.__setattr__(self, "layer_ids", layer_ids)
        if len(layer_ids) != self.moe_layers:
            raise BadTrace(f"layer_ids has {len(layer_ids)} entries for {self.moe_layers} layers")

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_ids"] = list(self.layer_ids or ())
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TraceGeometry:
        ids = d.get("layer_ids")
        return cls(
            int(d["moe_layers"]),
            int(d["n_experts"]),
            int(d["top_k"]),
            None if d.get("bytes_per_expert") is None else int(d["bytes_per_expert"]),
            None if ids is None else tuple(int(x) for x in ids),
        )


@dataclass(frozen=True)
class Step:
    """One step: views into the trace's arrays, layer-major for convenience.

    `ids[l]` is an int array (n_tokens, top_k) of layer l's expert ids, -1 padded.
    """

    kind: str
    ids: np.ndarray
    ahead1: np.ndarray | None = None
    ahead2: np.ndarray | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.ids.shape[1])

    def experts(self, layer: int) -> np.ndarray:
        """Distinct experts layer `layer` needs for the whole step, ascending."""
        row = self.ids[layer].ravel()
        return np.unique(row[row >= 0])


def _id_dtype(n_experts: int) -> np.dtype:
    return np.dtype(np.int16 if n_experts <= np.iinfo(np.int16).max else np.int32)


class Trace:
    """An immutable routing trace; see the module docstring for the layout."""

    def __init__(
        self,
        geometry: TraceGeometry,
        ids: np.ndarray,
        step_kinds: np.ndarray,
        step_tokens: np.ndarray,
        ahead1: np.ndarray | None = None,
        ahead2: np.ndarray | None = None,
        meta: dict[str, Any] | None = None,
    ):
        self.geometry = geometry
        self.meta: dict[str, Any] = dict(meta or {})
        self.ids = np.ascontiguousarray(ids)
        self.step_kinds = np.asarray(step_kinds, dtype=np.uint8)
        tokens = np.asarray(step_tokens, dtype=np.int64)
        self.step_offsets = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64)
        self.ahead1 = ahead1
        self.ahead2 = ahead2
        self._steps: tuple[Step, ...] | None = None
        self._validate(tokens)
        for a in (self.ids, self.step_kinds, self.step_offsets, self.ahead1, self.ahead2):
            if a is not None:
                a.flags.writeable = False

    def _validate(self, tokens: np.ndarray) -> None:
        g = self.geometry
        if self.ids.ndim != 3 or self.ids.shape[1:] != (g.moe_layers, g.top_k):
            raise BadTrace(f"ids shape {self.ids.shape} does not match geometry {g}")
        if len(self.step_kinds) != len(tokens) or (tokens < 1).any():
            raise BadTrace("every step needs a kind and at least one token")
        if int(tokens.sum()) != self.ids.shape[0]:
            raise BadTrace(f"steps hold {int(tokens.sum())} tokens, ids has {self.ids.shape[0]}")
        if not np.isin(self.step_kinds, list(_KIND_CODE.values())).all():
            raise BadTrace("step kinds must be 'P' or 'D'")
        for name, a in (("ids", self.ids), ("ahead1", self.ahead1), ("ahead2", self.ahead2)):
            if a is None:
                continue
            if a.shape[:2] != self.ids.shape[:2]:
                raise BadTrace(f"{name} shape {a.shape} does not match ids {self.ids.shape}")
            if a.size and (a.min() < -1 or a.max() >= g.n_experts):
                raise BadTrace(f"{name} holds an expert id outside [0, {g.n_experts})")

    # ---- geometry shortcuts -------------------------------------------------
    @property
    def moe_layers(self) -> int:
        return self.geometry.moe_layers

    @property
    def n_experts(self) -> int:
        return self.geometry.n_experts

    @property
    def top_k(self) -> int:
        return self.geometry.top_k

    @property
    def bytes_per_expert(self) -> int | None:
        return self.geometry.bytes_per_expert

    @property
    def has_predictions(self) -> bool:
        return self.ahead1 is not None or self.ahead2 is not None

    # ---- steps and tokens ---------------------------------------------------
    @property
    def n_steps(self) -> int:
        return len(self.step_kinds)

    @property
    def n_tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def token_kinds(self) -> np.ndarray:
        """One byte per token: ord('P') or ord('D')."""
        return np.repeat(self.step_kinds, np.diff(self.step_offsets))

    @property
    def n_decode_tokens(self) -> int:
        return int((self.token_kinds == _KIND_CODE[DECODE]).sum())

    @property
    def n_prompt_tokens(self) -> int:
        return self.n_tokens - self.n_decode_tokens

    @property
    def steps(self) -> tuple[Step, ...]:
        if self._steps is None:
            self._steps = tuple(self._step(i) for i in range(self.n_steps))
        return self._steps

    def _step(self, i: int) -> Step:
        a, b = int(self.step_offsets[i]), int(self.step_offsets[i + 1])

        def view(arr):
            return None if arr is None else arr[a:b].transpose(1, 0, 2)

        return Step(chr(self.step_kinds[i]), view(self.ids), view(self.ahead1), view(self.ahead2))

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps)

    def __len__(self) -> int:
        return self.n_steps

    def __repr__(self) -> str:
        g = self.geometry
        return (
            f"Trace({self.n_steps} steps, {self.n_prompt_tokens} prompt + {self.n_decode_tokens} "
            f"decode tokens, {g.moe_layers} layers x {g.n_experts} experts, top-{g.top_k})"
        )

    def with_meta(self, **meta: Any) -> Trace:
        """A copy sharing the arrays, with `meta` merged in."""
        return Trace(
            self.geometry,
            self.ids,
            self.step_kinds,
            np.diff(self.step_offsets),
            self.ahead1,
            self.ahead2,
            {**self.meta, **meta},
        )

    def with_geometry(self, **changes: Any) -> Trace:
        """A copy with geometry fields replaced (e.g. bytes_per_expert once known)."""
        geometry = dataclasses.replace(self.geometry, **changes)
        return Trace(
            geometry, self.ids, self.step_kinds, np.diff(self.step_offsets), self.ahead1, self.ahead2, self.meta
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trace):
            return NotImplemented
        same = (
            self.geometry == other.geometry
            and self.meta == other.meta
            and np.array_equal(self.step_kinds, other.step_kinds)
            and np.array_equal(self.step_offsets, other.step_offsets)
            and np.array_equal(self.ids, other.ids)
        )
        return same and _same_optional(self.ahead1, other.ahead1) and _same_optional(self.ahead2, other.ahead2)

    __hash__ = None  # type: ignore[assignment]

    # ---- files --------------------------------------------------------------
    def save(self, path: str | os.PathLike[str], format: str | None = None) -> None:
        """Write the trace; format 'native' (default), 'tsv' or 'jsonl' (by suffix
        when not given). Written to a temporary name, then renamed into place."""
        path = Path(path)
        fmt = format or {".tsv": "tsv", ".jsonl": "jsonl"}.get(path.suffix.lower(), "native")
        writer = {"native": _write_native, "tsv": write_tsv, "jsonl": write_jsonl}.get(fmt)
        if writer is None:
            raise BadTrace(f"unknown trace format {fmt!r} (native, tsv, jsonl)")
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                writer(self, f)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: str | os.PathLike[str], **geometry: Any) -> Trace:
        """Read a native, nvmoe JSONL or TSV trace (detected from the content).

        `geometry` overrides what an importer infers (n_experts, top_k,
        bytes_per_expert); native files carry their own geometry, and overrides
        replace its fields.
        """
        path = Path(path)
        try:
            with open(path, "rb") as f:
                head = f.read(4096)
        except OSError as exc:
            raise BadTrace(f"cannot read trace {path}: {exc.strerror}") from exc
        if head.startswith(_ZIP_MAGIC):
            trace = _read_native(path)
            return trace.with_geometry(**geometry) if geometry else trace
        first = next(
            (ln for ln in head.decode("utf-8", "replace").splitlines() if ln.strip() and not ln.startswith("#")), ""
        )
        if first.lstrip().startswith("["):
            return read_nvmoe_jsonl(path, **geometry)
        if "\t" in first:
            return read_tsv(path, **geometry)
        raise BadTrace(f"{path}: not a moed trace, nvmoe JSONL or moe_trace TSV file")


def _same_optional(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b))


# ---- building step by step --------------------------------------------------


class TraceWriter:
    """Builds a trace one step at a time (engines tracing, replays recording).

        w = TraceWriter(moe_layers=48, n_experts=128, top_k=8)
        w.append_step("P", ids_per_layer)        # ids_per_layer[l]: (n_tokens, k) ints
        w.append_step("D", [[3, 7, ...], ...])   # one token: a flat list per layer
        trace = w.finish(); trace.save("run.npz")

    A row with fewer than top_k ids is padded with -1; more than top_k is an error.
    Predictions (ahead1/ahead2) are optional per step; a step without them gets -1.
    """

    def __init__(
        self,
        moe_layers: int,
        n_experts: int,
        top_k: int,
        bytes_per_expert: int | None = None,
        layer_ids: Sequence[int] | None = None,
        meta: dict[str, Any] | None = None,
        ahead_width: int | None = None,
    ):
        self.geometry = TraceGeometry(
            moe_layers,
            n_experts,
            top_k,
            bytes_per_expert,
            None if layer_ids is None else tuple(int(x) for x in layer_ids),
        )
        self.meta: dict[str, Any] = dict(meta or {})
        self.ahead_width = ahead_width or 2 * top_k
        self._dtype = _id_dtype(n_experts)
        self._ids: list[np.ndarray] = []
        self._ahead: dict[str, list[np.ndarray | None]] = {"ahead1": [], "ahead2": []}
        self._kinds: list[int] = []
        self._tokens: list[int] = []

    @property
    def n_tokens(self) -> int:
        return sum(self._tokens)

    def append_step(self, kind: str, ids_per_layer: Any, ahead1: Any = None, ahead2: Any = None) -> None:
        if kind not in _KIND_CODE:
            raise BadTrace(f"step kind must be 'P' or 'D', not {kind!r}")
        ids = self._rows(ids_per_layer, self.geometry.top_k, "ids")
        n = ids.shape[0]
        self._ids.append(ids)
        for name, value in (("ahead1", ahead1), ("ahead2", ahead2)):
            rows = None if value is None else self._rows(value, self.ahead_width, name)
            if rows is not None and rows.shape[0] != n:
                raise BadTrace(f"{name} has {rows.shape[0]} tokens, ids has {n}")
            self._ahead[name].append(rows)
        self._kinds.append(_KIND_CODE[kind])
        self._tokens.append(n)

    def _rows(self, per_layer: Any, width: int, name: str) -> np.ndarray:
        """(n_tokens, layers, width) padded with -1 from a per-layer sequence."""
        layers = self.geometry.moe_layers
        if len(per_layer) != layers:
            raise BadTrace(f"{name}: {len(per_layer)} layers given, the trace has {layers}")
        rows = [np.atleast_2d(np.asarray(r, dtype=np.int64)) if np.size(r) else np.full((1, 0), -1) for r in per_layer]
        n = max(r.shape[0] for r in rows)
        out = np.full((n, layers, width), -1, dtype=self._dtype)
        for layer, r in enumerate(rows):
            if r.shape[1] > width or (r.shape[0] != n and r.size):
                raise BadTrace(f"{name}: layer {layer} has shape {r.shape}, expected ({n}, <={width})")
            if r.size and (r.min() < -1 or r.max() >= self.geometry.n_experts):
                raise BadTrace(f"{name}: layer {layer} has an expert id outside [0, {self.geometry.n_experts})")
            out[: r.shape[0], layer, : r.shape[1]] = r
        return out

    def finish(self) -> Trace:
        g = self.geometry
        if not self._ids:
            raise BadTrace("a trace needs at least one step")
        ids = np.concatenate(self._ids)
        aheads = {name: self._join(parts) for name, parts in self._ahead.items()}
        return Trace(g, ids, np.array(self._kinds, np.uint8), np.array(self._tokens), meta=self.meta, **aheads)

    def _join(self, parts: list[np.ndarray | None]) -> np.ndarray | None:
        if all(p is None for p in parts):
            return None
        shape = (self.geometry.moe_layers, self.ahead_width)
        return np.concatenate(
            [p if p is not None else np.full((n, *shape), -1, self._dtype) for p, n in zip(parts, self._tokens)]
        )


# ---- native format ------------------------------------------------------------


def _write_native(trace: Trace, f: Any) -> None:
    header = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "geometry": trace.geometry.to_json(),
        "meta": trace.meta,
    }
    disk = np.uint8 if trace.n_experts < 255 else np.uint16 if trace.n_experts < 65535 else np.uint32
    arrays: dict[str, np.ndarray] = {
        "header": np.frombuffer(json.dumps(header).encode(), dtype=np.uint8),
        "step_kind": trace.step_kinds,
        "step_tokens": np.diff(trace.step_offsets).astype(np.int32),
    }
    arrays["ids"] = (trace.ids + 1).astype(disk)  # 0 = no expert
    for name in ("ahead1", "ahead2"):
        ahead = getattr(trace, name)
        if ahead is not None:  # only the tokens that carry a prediction (decode tokens)
            rows = np.flatnonzero((ahead >= 0).any(axis=(1, 2)))
            arrays[name + "_tokens"] = rows.astype(np.int32)
            arrays[name] = (ahead[rows] + 1).astype(disk)
    # Uncompressed: ids are near-random bytes that zlib barely shrinks, and a
    # 30,000-token trace must load in well under a second.
    np.savez(f, allow_pickle=True, **arrays)  # savez's default, spelled out: mypy then matches **arrays only to arrays


def _from_disk(stored: np.ndarray, dtype: np.dtype) -> np.ndarray:
    out = stored.astype(dtype)
    out -= 1
    return out


def _read_native(path: Path) -> Trace:
    try:
        with np.load(path, allow_pickle=False) as z:
            header = json.loads(bytes(z["header"]).decode())
            if header.get("format") != FORMAT_NAME:
                raise BadTrace(f"{path}: not a moed trace (format {header.get('format')!r})")
            if header.get("version") != FORMAT_VERSION:
                raise BadTrace(
                    f"{path}: trace format version {header.get('version')} is not supported "
                    f"(this moed reads version {FORMAT_VERSION})"
                )
            geometry = TraceGeometry.from_json(header["geometry"])
            dtype = _id_dtype(geometry.n_experts)
            ids = _from_disk(z["ids"], dtype)
            aheads = {}
            for name in ("ahead1", "ahead2"):
                if name in z.files:  # stored for the predicted tokens only
                    full = np.full((ids.shape[0], *z[name].shape[1:]), -1, dtype)
                    full[z[name + "_tokens"]] = _from_disk(z[name], dtype)
                    aheads[name] = full
            return Trace(geometry, ids, z["step_kind"], z["step_tokens"], meta=header.get("meta") or {}, **aheads)
    except (KeyError, ValueError, zipfile.BadZipFile, json.JSONDecodeError) as exc:
        raise BadTrace(f"{path}: damaged trace file ({exc})") from exc


# ---- nvmoe JSONL --------------------------------------------------------------


def read_nvmoe_jsonl(path: str | os.PathLike[str], **geometry: Any) -> Trace:
    """Import an nvmoe trace: one decoded token per line, `[[layer, expert], ...]`."""
    decoder = msgspec.json.Decoder(list[tuple[int, int]])
    token_of: list[np.ndarray] = []
    pairs: list[np.ndarray] = []
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = decoder.decode(line)
            except msgspec.DecodeError as exc:
                raise BadTrace(f"{path}:{lineno}: not an nvmoe token line ({exc})") from exc
            token_of.append(np.full(len(row), len(token_of), np.int64))
            pairs.append(np.asarray(row, dtype=np.int64).reshape(-1, 2))
    if not pairs:
        raise BadTrace(f"{path}: no tokens")
    tok, lp = np.concatenate(token_of), np.concatenate(pairs)
    layer_ids, dense_layer = np.unique(lp[:, 0], return_inverse=True)
    trace = _from_triples(tok, dense_layer, lp[:, 1], len(token_of), layer_ids, geometry)
    return trace.with_meta(source=str(path), source_format="nvmoe-jsonl", **trace.meta)


def _from_triples(
    tok: np.ndarray,
    layer: np.ndarray,
    expert: np.ndarray,
    n_tokens: int,
    layer_ids: np.ndarray,
    geometry: dict[str, Any],
) -> Trace:
    """Decode-only trace from (token, dense layer, expert) triples in row order."""
    if expert.min() < 0:
        raise BadTrace("negative expert id")
    n_layers = len(layer_ids)
    row = tok * n_layers + layer
    order = np.argsort(row, kind="stable")
    row_sorted = row[order]
    starts = np.searchsorted(row_sorted, row_sorted, side="left")
    col = np.arange(len(row_sorted)) - starts  # position within its (token, layer) row
    top_k = int(geometry.pop("top_k", None) or col.max() + 1)
    n_experts = int(geometry.pop("n_experts", None) or expert.max() + 1)
    if col.max() >= top_k or expert.max() >= n_experts:
        raise BadTrace(f"trace has rows wider than top_k={top_k} or ids >= n_experts={n_experts}")
    g = TraceGeometry(
        n_layers, n_experts, top_k, geometry.pop("bytes_per_expert", None), tuple(int(x) for x in layer_ids)
    )
    if geometry:
        raise BadTrace(f"unknown geometry override(s): {sorted(geometry)}")
    ids = np.full((n_tokens * n_layers, top_k), -1, dtype=_id_dtype(n_experts))
    ids[row_sorted, col] = expert[order]
    return Trace(
        g, ids.reshape(n_tokens, n_layers, top_k), np.full(n_tokens, ord(DECODE), np.uint8), np.ones(n_tokens, np.int64)
    )


def write_jsonl(trace: Trace, f: Any) -> None:
    """nvmoe JSONL; every token becomes one line (the format has no prompt kind)."""
    layer_ids = trace.geometry.layer_ids or tuple(range(trace.moe_layers))
    for t in range(trace.n_tokens):
        pairs = [[layer_ids[l], int(e)] for l in range(trace.moe_layers) for e in trace.ids[t, l] if e >= 0]
        f.write(json.dumps(pairs).encode() + b"\n")


# ---- moe_trace TSV ------------------------------------------------------------


def read_tsv(path: str | os.PathLike[str], **geometry: Any) -> Trace:
    """Import a tools/moe_trace.cpp TSV trace (6-, 4- or the old 3-column form).

    Rows are split in Python, everything after that is vectorised: a row's token
    within its step is its rank among the step's rows of the same layer.
    """
    meta: dict[str, Any] = {}
    steps: list[str] = []
    layers: list[str] = []
    kinds: list[str | None] = []
    fields: tuple[list[str], list[str], list[str]] = ([], [], [])
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.startswith("#"):
                _comment_meta(line.rstrip("\r\n"), meta)
                continue
            col = line.rstrip("\r\n").split("\t")
            if len(col) < 3:
                if line.strip():
                    raise BadTrace(f"{path}:{lineno}: bad trace row (fewer than 3 columns)")
                continue
            old = len(col) == 3  # step, layer, ids: step 0 is the prompt
            kind = col[2].strip() if not old else None
            if kind is not None and kind not in _KIND_CODE:
                raise BadTrace(f"{path}:{lineno}: bad trace row (kind {kind!r})")
            steps.append(col[0])
            layers.append(col[1])
            kinds.append(kind)
            for j, text in enumerate(col[2:5] if old else col[3:6]):
                fields[j].append(text)
            for j in range(len(col) - (2 if old else 3), 3):
                fields[j].append("-")
    if not steps:
        raise BadTrace(f"{path}: no trace rows")
    try:
        return _tsv_trace(steps, layers, kinds, fields, geometry, meta).with_meta(source=str(path), source_format="tsv")
    except ValueError as exc:
        raise BadTrace(f"{path}: bad trace row ({exc})") from exc


def _tsv_trace(
    steps: list[str],
    layers: list[str],
    kinds: list[str | None],
    fields: tuple[list[str], list[str], list[str]],
    geometry: dict[str, Any],
    meta: dict[str, Any],
) -> Trace:
    n_rows = len(steps)
    new_step = np.ones(n_rows, dtype=bool)
    new_step[1:] = [a != b for a, b in zip(steps[1:], steps[:-1])]
    step_of = np.cumsum(new_step) - 1
    firsts = np.flatnonzero(new_step)
    step_kind = np.array([ord(kinds[i] or (PROMPT if int(steps[i]) == 0 else DECODE)) for i in firsts], dtype=np.uint8)
    layer_ids, layer = np.unique(np.array([int(x) for x in layers], dtype=np.int64), return_inverse=True)
    n_layers = len(layer_ids)
    # a row's token within its step: its rank among the step's rows of its layer
    group = step_of * n_layers + layer
    order = np.argsort(group, kind="stable")
    g_sorted = group[order]
    tok_in_step = np.empty(n_rows, dtype=np.int64)
    tok_in_step[order] = np.arange(n_rows) - np.searchsorted(g_sorted, g_sorted, side="left")
    step_tokens = np.zeros(len(firsts), dtype=np.int64)
    np.maximum.at(step_tokens, step_of, tok_in_step + 1)
    token = np.concatenate([[0], np.cumsum(step_tokens)])[step_of] + tok_in_step
    parsed = [_parse_ids(col) for col in fields]
    widest = [int(counts.max(initial=0)) for _, _, counts in parsed]
    max_id = max(int(vals.max(initial=0)) for _, vals, _ in parsed)
    if any(int(vals.min(initial=0)) < 0 for _, vals, _ in parsed):
        raise ValueError("negative expert id")
    top_k = int(geometry.pop("top_k", None) or widest[0])
    n_experts = int(geometry.pop("n_experts", None) or max_id + 1)
    g = TraceGeometry(
        n_layers, n_experts, top_k, geometry.pop("bytes_per_expert", None), tuple(int(x) for x in layer_ids)
    )
    if geometry:
        raise BadTrace(f"unknown geometry override(s): {sorted(geometry)}")
    if widest[0] > top_k or max_id >= n_experts:
        raise BadTrace(f"trace has rows wider than top_k={top_k} or ids >= n_experts={n_experts}")
    n_tok, dtype = int(step_tokens.sum()), _id_dtype(n_experts)
    width = max(widest[1], widest[2], 2 * top_k)
    grids = []
    for (rows, vals, _), w in zip(parsed, (top_k, width, width)):
        grid = np.full((n_tok, n_layers, w), -1, dtype=dtype)
        grid[token[rows], layer[rows], _column(rows)] = vals
        grids.append(grid)
    aheads = [grid if widest[j] else None for j, grid in ((1, grids[1]), (2, grids[2]))]
    return Trace(g, grids[0], step_kind, step_tokens, aheads[0], aheads[1], meta)


def _parse_ids(texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row of each id, the ids, ids per row) from comma-separated fields, '-' = none."""
    stripped = [t.strip() for t in texts]
    counts = np.array([0 if t in ("-", "") else t.count(",") + 1 for t in stripped], dtype=np.int64)
    joined = ",".join(t for t in stripped if t not in ("-", ""))
    vals = np.fromiter(map(int, joined.split(",")), dtype=np.int64) if joined else np.zeros(0, np.int64)
    rows = np.repeat(np.arange(len(texts), dtype=np.int64), counts)
    return rows, vals, counts


def _column(rows: np.ndarray) -> np.ndarray:
    """Position of each entry within its row (rows are non-decreasing)."""
    return np.arange(len(rows)) - np.searchsorted(rows, rows, side="left")


def _comment_meta(line: str, meta: dict[str, Any]) -> None:
    """`# key=value` comment lines become metadata (ignored otherwise)."""
    body = line.lstrip("#").strip()
    if "=" in body and " " not in body.split("=", 1)[0]:
        key, value = body.split("=", 1)
        meta[key.strip()] = value.strip()


def write_tsv(trace: Trace, f: Any) -> None:
    """The 6-column moe_trace TSV (4 columns when the trace has no predictions)."""
    layer_ids = trace.geometry.layer_ids or tuple(range(trace.moe_layers))
    out = io.StringIO()
    for s, step in enumerate(trace.steps):
        for layer in range(trace.moe_layers):
            for t in range(step.n_tokens):
                cols = [str(s), str(layer_ids[layer]), step.kind, _fmt(step.ids[layer, t])]
                if trace.has_predictions:
                    cols += [_fmt(None if a is None else a[layer, t]) for a in (step.ahead1, step.ahead2)]
                out.write("\t".join(cols) + "\n")
        if out.tell() > 1 << 20:
            f.write(out.getvalue().encode())
            out = io.StringIO()
    f.write(out.getvalue().encode())


def _fmt(ids: np.ndarray | None) -> str:
    if ids is None:
        return "-"
    vals = [str(int(x)) for x in ids if x >= 0]
    return ",".join(vals) if vals else "-"
