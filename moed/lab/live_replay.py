"""Replay a routing trace through a running moed, with real reads and simulated compute.

This measures moed itself: every expert a token's router chose is acquired from
the daemon (real O_DIRECT reads of the real model file into the RAM tier), and
compute is simulated per layer:

    1. attention runs for `attn_frac` of the layer's share of `compute_ms`;
    2. the layer's distinct experts are acquired, stalling on any read still in
       flight (the time spent in acquire is the stall);
    3. the next layers' prefetches are issued, as StreamedLlama issues them
       (right after this layer's acquire, from predictions made at this layer's
       ffn_norm): `gate`: ahead1[t, l + 1]; `gate2`: that and ahead2[t, l + 2];
       `oracle`: nothing here, every layer's real experts were queued at the
       start of the token; `none`: nothing. A prediction row is cut to its
       first `prefetch_width` (default top-k, the engine's default);
    4. the experts "compute" for the rest of the layer's share; the lease is
       released (fire-and-forget, no round trip).

So a gate prefetch has the rest of this layer and the next layer's attention as
lead time, as in the engine.

Warm-up: the last `warm` prompt tokens before the first decode token are
acquired (no compute, no prefetch, not counted); a trace without prompt tokens
(nvmoe) uses its first `warm` decode tokens instead. Then up to `tokens` decode
tokens are counted; prompt tokens between them (a later chat turn) are replayed
uncounted like the warm-up.

Counting comes from the daemon's own counters, as deltas over the counted
tokens, so it is exact only when the replay is the daemon's only client (a
private daemon, `moed.spawn.DaemonProcess`, which `moectl replay --budget` starts):

    accesses         distinct experts acquired per layer per counted token
    hit_rate         found READY at acquire (a finished prefetch included)
    prefetch_hit_rate  served by a prefetch, finished or still in flight
    demand_miss_rate   read started by the acquire itself (misses - joined reads)
    wasted_prefetch_rate  prefetched experts evicted or dropped before any use,
                     over prefetch reads started

hits + misses = accesses always; misses = demand misses + joins of reads already
in flight (a late prefetch).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from moed.badinput import BadInput
from moed.protocol.errors import RequestTooLarge
from moed.protocol.sizes import format_size
from moed.spawn import DaemonProcess

PREFETCH_MODES = ("none", "gate", "gate2", "oracle")
COUNTERS = ("hits", "misses", "joined_reads", "prefetches", "prefetch_hits", "wasted_prefetches", "bytes_read")


@dataclass(frozen=True)
class ReplayOptions:
    compute_ms: float = 12.0
    attn_frac: float = 0.5
    prefetch: str = "none"
    warm: int = 64
    tokens: int | None = None
    acquire_timeout_s: float = 60.0
    prefetch_width: int | None = None  # gate/gate2: first N predictions per token (None: top-k)

    def __post_init__(self) -> None:
        if self.prefetch not in PREFETCH_MODES:
            raise BadInput(f"--prefetch must be one of {', '.join(PREFETCH_MODES)}, not {self.prefetch!r}")
        if self.compute_ms < 0 or not 0 <= self.attn_frac <= 1:
            raise BadInput("--compute-ms must be >= 0 and --attn-frac in [0, 1]")
        if self.warm < 0 or (self.tokens is not None and self.tokens < 1):
            raise BadInput("--warm must be >= 0 and --tokens >= 1")
        if self.prefetch_width is not None and self.prefetch_width < 1:
            raise BadInput("--prefetch-width must be >= 1")


@dataclass
class LiveReplayResult:
    tok_s: float
    compute_tok_s: float
    stall_ms_per_token: float
    hit_rate: float
    prefetch_hit_rate: float
    demand_miss_rate: float
    prefetches: int
    wasted_prefetch_rate: float
    gb_read: float
    mb_per_token: float
    tokens: int = 0
    warm_tokens: int = 0
    accesses: int = 0
    hits: int = 0
    misses: int = 0
    demand_misses: int = 0
    prefetch_hits: int = 0
    wasted_prefetches: int = 0
    bytes_read: int = 0
    wall_s: float = 0.0
    prefetch_mode: str = "none"
    budget_bytes: int = 0
    budget_slots: int = 0
    token_slots: float = 0.0  # distinct experts a counted token needs, mean
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON: an unbounded rate (no compute time) becomes null, not Infinity."""
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


# ---- the token schedule --------------------------------------------------------


def schedule(trace, warm: int, tokens: int | None) -> list[tuple[int, bool]]:
    """(token index, counted) in replay order: warm-up, then decode tokens counted."""
    kinds = trace.token_kinds
    decode = np.flatnonzero(kinds == ord("D"))
    if not len(decode):
        raise BadInput("the trace has no decode tokens to replay")
    d0 = int(decode[0])
    if d0 > 0:  # warm with the prompt's last tokens
        warm_ids = list(range(max(0, d0 - warm), d0))
        counted = decode
    else:  # no prompt: the first decode tokens warm
        warm_ids = [int(t) for t in decode[:warm]]
        counted = decode[warm:]
    if tokens is not None:
        counted = counted[:tokens]
    if not len(counted):
        raise BadInput(f"no decode tokens left to count after --warm {warm}")
    out = [(t, False) for t in warm_ids]
    last = int(counted[-1])
    counted_set = set(int(t) for t in counted)
    start = int(counted[0])
    out += [(t, t in counted_set) for t in range(start, last + 1) if t in counted_set or kinds[t] == ord("P")]
    return out


def _experts(row: np.ndarray) -> list[int]:
    """Distinct valid ids of one (token, layer) row, in router order."""
    return list(dict.fromkeys(int(e) for e in row if e >= 0))


def _wait_until(deadline: float) -> None:
    """Sleep most of the way, spin only the last quarter millisecond.

    A sleep overshoots by ~0.05-0.1 ms, so the tail is spun for accuracy; the
    sleep keeps the replay from burning a core the daemon may need.
    """
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            return
        if left > 0.0004:
            time.sleep(left - 0.00025)


# ---- the replay ----------------------------------------------------------------


class Replayer:
    """Drives one trace through one open model on one client connection."""

    def __init__(self, client, model_path: str | os.PathLike, trace, opts: ReplayOptions):
        self.client = client
        self.trace = trace
        self.opts = opts
        self.model = client.open_model(model_path)
        self.budget_bytes = 0
        self._check_geometry()
        self.layer_ids = sorted(self.model.moe_layers)
        need = {"gate": "ahead1", "gate2": "ahead2"}.get(opts.prefetch)
        if need and getattr(trace, need) is None:
            raise BadInput(
                f"--prefetch {opts.prefetch} needs the trace's {need} predictions, "
                f"and this trace has none (use oracle or none)"
            )

    def _check_geometry(self) -> None:
        t, m = self.trace, self.model
        if t.moe_layers != len(m.moe_layers) or t.n_experts > m.n_experts:
            raise BadInput(
                f"trace geometry ({t.moe_layers} MoE layers, {t.n_experts} experts) does not "
                f"fit the model ({len(m.moe_layers)} MoE layers, {m.n_experts} experts); "
                f"make one with `moectl make-model --like TRACE`"
            )

    def run(self, progress: Callable[[int, int], None] | None = None) -> LiveReplayResult:
        plan = schedule(self.trace, self.opts.warm, self.opts.tokens)
        n_counted = sum(1 for _, c in plan if c)
        totals = dict.fromkeys(COUNTERS, 0)
        accesses = stall_s = wall_s = 0.0
        before, counting, done = None, False, 0
        for t, counted in plan:
            if counted != counting:  # segment boundary: fold the daemon's counters
                snap = self._counters(settle=counting)
                if counting:
                    _add_delta(totals, before, snap)
                before, counting = snap, counted
            if counted:
                t0 = time.perf_counter()
                stall_s += self._decode_token(t)
                wall_s += time.perf_counter() - t0
                accesses += sum(len(_experts(self.trace.ids[t, l])) for l in range(self.trace.moe_layers))
                done += 1
                if progress is not None:
                    progress(done, n_counted)
            else:
                self._warm_token(t)
        _add_delta(totals, before, self._counters(settle=True))
        return self._result(totals, int(accesses), n_counted, stall_s, wall_s, sum(1 for _, c in plan if not c))

    def _counters(self, settle: bool) -> dict[str, int]:
        """The daemon's counters; with `settle`, after every read in flight has landed."""
        deadline = time.monotonic() + 60
        while True:
            s = self.client.stats()
            if not settle or s.get("reads_in_flight", 0) == 0 or time.monotonic() > deadline:
                self.budget_bytes = s["budget_bytes"]
                return {k: int(s.get(k, 0)) for k in COUNTERS}
            time.sleep(0.002)

    def _warm_token(self, t: int) -> None:
        ids = self.trace.ids[t]
        for l, layer in enumerate(self.layer_ids):
            experts = _experts(ids[l])
            if experts:
                self._acquire(layer, experts).release()

    def _decode_token(self, t: int) -> float:
        """One counted token; returns the seconds spent stalled in acquire."""
        o, tr, m = self.opts, self.trace, self.model
        layer_s = o.compute_ms / 1e3 / tr.moe_layers
        attn_s, rest_s = o.attn_frac * layer_s, (1 - o.attn_frac) * layer_s
        if o.prefetch == "oracle":
            for l, layer in enumerate(self.layer_ids):
                m.prefetch(layer, _experts(tr.ids[t, l]))
        stall = 0.0
        for l, layer in enumerate(self.layer_ids):
            _wait_until(time.perf_counter() + attn_s)
            experts = _experts(tr.ids[t, l])
            if not experts:
                self._issue_prefetch(t, l)
                continue
            t0 = time.perf_counter()
            lease = self._acquire(layer, experts)
            t1 = time.perf_counter()
            stall += t1 - t0
            self._issue_prefetch(t, l)
            _wait_until(t1 + rest_s)
            lease.release()
        return stall

    def _issue_prefetch(self, t: int, l: int) -> None:
        """After layer l's acquire: the predictions made at l for l + 1 (and l + 2 in gate2)."""
        mode, tr = self.opts.prefetch, self.trace
        wanted = []
        if mode == "gate" or (mode == "gate2" and tr.ahead1 is not None):
            wanted.append((tr.ahead1, l + 1))
        if mode == "gate2":
            wanted.append((tr.ahead2, l + 2))
        width = self.opts.prefetch_width or tr.top_k
        for ahead, target in wanted:
            if target < tr.moe_layers:
                ids = _experts(ahead[t, target][:width])
                if ids:
                    self.model.prefetch(self.layer_ids[target], ids)

    def _acquire(self, layer: int, experts: list[int]):
        try:
            return self.model.acquire(layer, experts, timeout_s=self.opts.acquire_timeout_s)
        except RequestTooLarge as exc:
            raise RequestTooLarge(
                f"the budget cannot hold one layer's experts ({len(experts)} of layer {layer}): {exc}"
            ) from None

    def _result(
        self, d: dict, accesses: int, tokens: int, stall_s: float, wall_s: float, warm_tokens: int
    ) -> LiveReplayResult:
        o = self.opts

        def rate(n):
            return n / accesses if accesses else 0.0

        demand = d["misses"] - d["joined_reads"]
        slot = self._mean_slot_bytes()
        budget_slots = int(self.budget_bytes // slot) if slot else 0
        token_slots = accesses / tokens if tokens else 0.0
        warnings = []
        if budget_slots < token_slots:
            warnings.append(
                f"zero headroom: the budget holds {budget_slots} experts, a token needs "
                f"{token_slots:.0f}; every token re-reads experts it used a token ago"
            )
        if d["hits"] + d["misses"] != accesses:
            warnings.append(
                f"daemon counted {d['hits'] + d['misses']} accesses, the replay made "
                f"{accesses}: another client is using this daemon"
            )
        return LiveReplayResult(
            tok_s=tokens / wall_s if wall_s else 0.0,
            compute_tok_s=1e3 / o.compute_ms if o.compute_ms else float("inf"),
            stall_ms_per_token=stall_s * 1e3 / tokens,
            hit_rate=rate(d["hits"]),
            prefetch_hit_rate=rate(d["prefetch_hits"]),
            demand_miss_rate=rate(demand),
            prefetches=d["prefetches"],
            wasted_prefetch_rate=d["wasted_prefetches"] / d["prefetches"] if d["prefetches"] else 0.0,
            gb_read=d["bytes_read"] / 1e9,
            mb_per_token=d["bytes_read"] / 1e6 / tokens,
            tokens=tokens,
            warm_tokens=warm_tokens,
            accesses=accesses,
            hits=d["hits"],
            misses=d["misses"],
            demand_misses=demand,
            prefetch_hits=d["prefetch_hits"],
            wasted_prefetches=d["wasted_prefetches"],
            bytes_read=d["bytes_read"],
            wall_s=wall_s,
            prefetch_mode=o.prefetch,
            budget_bytes=self.budget_bytes,
            budget_slots=budget_slots,
            token_slots=token_slots,
            warnings=warnings,
        )

    def _mean_slot_bytes(self) -> float:
        sizes = []
        for layer in self.layer_ids:
            info = self.model.segment(self.model.layer(layer).class_id).info
            sizes.append(sum(info.part_stride))
        return sum(sizes) / len(sizes) if sizes else 0.0


def _add_delta(totals: dict, before: dict | None, after: dict) -> None:
    for k in COUNTERS:
        totals[k] += after[k] - (before or {}).get(k, 0)


def replay(
    client, model_path, trace, opts: ReplayOptions | None = None, progress: Callable[[int, int], None] | None = None
) -> LiveReplayResult:
    """Replay `trace` (a `moed.traces.Trace`) through `client`'s daemon."""
    return Replayer(client, model_path, trace, opts or ReplayOptions()).run(progress)


def replay_private(
    model_path,
    trace,
    budget_bytes: int,
    opts: ReplayOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
    daemon_args: tuple = (),
) -> LiveReplayResult:
    """Start a private daemon with `budget_bytes`, replay through it, stop it."""
    from moed.client import Client

    with DaemonProcess(budget_bytes, *daemon_args) as d:
        with Client(d.socket, "moectl-replay") as c:
            return replay(c, model_path, trace, opts, progress)


def like_trace(trace) -> dict[str, int]:
    """make_model arguments for a model with `trace`'s routing geometry."""
    return {"layers": trace.moe_layers, "experts": trace.n_experts, "used": trace.top_k}


def describe(r: LiveReplayResult) -> list[str]:
    """Human lines for a result (the CLI prints them)."""
    return [
        f"decode {r.tok_s:.1f} tok/s (compute alone {r.compute_tok_s:.1f}), stall "
        f"{r.stall_ms_per_token:.2f} ms/token over {r.tokens} tokens (+{r.warm_tokens} warm-up)",
        f"hits {100 * r.hit_rate:.1f}%, prefetch hits {100 * r.prefetch_hit_rate:.1f}%, "
        f"demand misses {100 * r.demand_miss_rate:.1f}% of {r.accesses} accesses",
        f"prefetches {r.prefetches} ({100 * r.wasted_prefetch_rate:.1f}% wasted), read "
        f"{r.gb_read:.3f} GB, {r.mb_per_token:.2f} MB/token",
        f"budget {format_size(r.budget_bytes)} = {r.budget_slots} experts; a token needs {r.token_slots:.0f}",
    ] + [f"warning: {w}" for w in r.warnings]
