"""Drive ceilings and MTP grouping: what decode rate a cache lets the drive allow.

Ceiling (as on the reference page): with a policy's misses on counted decode
tokens, each generated token reads `reads_per_token` experts of
`bytes_per_expert` bytes from a drive of `drive_gbps` GB/s (10^9 bytes per
second), and computes for `compute_ms`:

    io_ms           = reads_per_token * bytes_per_expert / (drive_gbps * 1e9) * 1e3
    serial_tok_s    = 1000 / (compute_ms + io_ms)        reads after compute, no overlap
    overlapped_tok_s = 1000 / max(compute_ms, io_ms)      reads fully hidden behind compute

These are ceilings from the trace alone: no latency, no queueing, no noise.

MTP (`mtp_accesses`): a verification step routes a window of n + 1 consecutive
decode tokens at once, so a layer needs the union of their experts; the window
then advances by `accept` tokens (fractional: positions accumulate, the window
starts at floor(position)). Windows never cross a prompt step; rejected drafts
are approximated by the real next tokens. Uncounted tokens (prompt, warm-up) are
replayed token by token as usual. Within a step the accesses go layer by layer,
each layer's union in order of first use. Reads per generated token are the
misses divided by the counted decode tokens, the same denominator as without MTP.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from moed.badinput import BadInput
from moed.lab import policies
from moed.lab.policies import Accesses, ReplayResult
from moed.traces import Trace


@dataclass(frozen=True)
class Ceiling:
    policy: str
    size: float | None
    slots: int
    reads_per_token: float
    bytes_per_token: float
    io_ms: float
    compute_ms: float
    serial_tok_s: float
    overlapped_tok_s: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def ceiling(
    result: ReplayResult, counted_tokens: int, bytes_per_expert: float, drive_gbps: float, compute_ms: float
) -> Ceiling:
    if drive_gbps <= 0 or compute_ms < 0 or bytes_per_expert <= 0:
        raise BadInput("drive rate and bytes per expert must be > 0, compute time >= 0")
    reads = (result.accesses - result.hits) / counted_tokens if counted_tokens else 0.0
    per_token = reads * bytes_per_expert
    io_ms = per_token / (drive_gbps * 1e9) * 1e3
    serial = 1000.0 / (compute_ms + io_ms) if compute_ms + io_ms > 0 else float("inf")
    overlapped = 1000.0 / max(compute_ms, io_ms) if max(compute_ms, io_ms) > 0 else float("inf")
    return Ceiling(result.policy, result.size, result.slots, reads, per_token, io_ms, compute_ms, serial, overlapped)


def mtp_accesses(trace: Trace, n_draft: int, accept: float, warm: int = 0) -> tuple[Accesses, int]:
    """(access stream with decode tokens grouped into verification steps, steps)."""
    if n_draft < 0 or not 0 < accept <= n_draft + 1:
        raise BadInput(f"--mtp must be >= 0 and --accept in (0, n+1], not {n_draft}, {accept}")
    acc = policies.accesses(trace, warm)
    counted_tok = policies.counted_tokens(trace, warm)
    starts = np.searchsorted(acc.token, np.arange(trace.n_tokens + 1))
    layer = acc.layer
    parts_keys: list[np.ndarray] = []
    parts_tok: list[np.ndarray] = []
    parts_cnt: list[np.ndarray] = []
    steps = 0
    for lo, hi, counted in _runs(counted_tok):
        if not counted:
            sl = slice(starts[lo], starts[hi])
            parts_keys.append(acc.keys[sl])
            parts_tok.append(acc.token[sl])
            parts_cnt.append(np.zeros(starts[hi] - starts[lo], bool))
            continue
        pos = 0.0
        while lo + int(pos) < hi:
            i0 = lo + int(pos)
            i1 = min(hi, i0 + n_draft + 1)
            sl = slice(starts[i0], starts[i1])
            keys = _union_by_layer(acc.keys[sl], layer[sl])
            parts_keys.append(keys)
            parts_tok.append(np.full(len(keys), i0, np.int64))
            parts_cnt.append(np.ones(len(keys), bool))
            steps += 1
            pos += accept
    grouped = Accesses(
        np.concatenate(parts_keys),
        np.concatenate(parts_tok),
        np.concatenate(parts_cnt),
        acc.moe_layers,
        acc.n_experts,
        acc.n_counted_tokens,
    )
    return grouped, steps


def _runs(flags: np.ndarray) -> list[tuple[int, int, bool]]:
    """Maximal runs of equal flags as (start, end, flag)."""
    if len(flags) == 0:
        return []
    cuts = np.flatnonzero(np.diff(flags.astype(np.int8))) + 1
    bounds = [0, *cuts.tolist(), len(flags)]
    return [(a, b, bool(flags[a])) for a, b in zip(bounds[:-1], bounds[1:])]


def _union_by_layer(keys: np.ndarray, layer: np.ndarray) -> np.ndarray:
    """Each key once, layer by layer, in order of first use within the layer."""
    _, first = np.unique(keys, return_index=True)
    first.sort()
    order = np.argsort(layer[first], kind="stable")
    return keys[first[order]]


@dataclass(frozen=True)
class MtpReads:
    policy: str
    size: float | None
    slots: int
    n_draft: int
    accept: float
    steps: int
    reads_per_token: float  # with MTP, per generated (counted decode) token
    reads_per_token_plain: float  # the same policy and size without MTP
    reads_per_step: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def mtp_reads(
    trace: Trace,
    policy: str,
    n_draft: int,
    accept: float,
    size: float | None = None,
    slots: int | None = None,
    warm: int = 0,
    grouped: tuple[Accesses, int] | None = None,
) -> MtpReads:
    """Reads per generated token with and without MTP grouping, for one policy and
    size. `grouped` reuses a `mtp_accesses` result across policies and sizes."""
    stream, steps = grouped or mtp_accesses(trace, n_draft, accept, warm)
    plain = policies.replay(policies.accesses(trace, warm), policy, size, slots)
    with_mtp = policies.replay(stream, policy, size, slots)
    tokens = stream.n_counted_tokens or 1
    misses = with_mtp.accesses - with_mtp.hits
    return MtpReads(
        policy,
        size,
        with_mtp.slots,
        n_draft,
        accept,
        steps,
        misses / tokens,
        (plain.accesses - plain.hits) / tokens,
        misses / steps if steps else 0.0,
    )
