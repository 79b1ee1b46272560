"""Decode through StreamedLlama with the drive throttled to a fraction of its rate: read-ahead
back-off on and off, paired in one run.

Run (root: a loop device and the cgroup v1 blkio controller):

    .venv/bin/python bench/drive_backoff.py [MODEL.gguf] [--tokens 48] [--fraction 0.25] [--budget 0.25] [--recall 0.86]

Without MODEL, a page-aligned Q4_0 model (8 layers x 64 experts, top-8, embd 1024,
ff 512) is written once under /tmp/moed-bench/. The model is copied onto a btrfs
image on a loop device (moed.testing.faultfs), so that its reads can be throttled
with `blkio.throttle.read_bps_device` for the daemon's process only (the engine
loads a skeleton, so its own load reads no expert).

1. The drive's rate R: moed's own reads, unthrottled (a cold pass over every
   expert through the daemon, bytes over seconds).
2. The throttle is set to `--fraction` x R.
3. Arms, alternated off, on, off, on (pairs cancel drift): a fresh daemon with a
   budget of `--budget` of the experts' bytes and `prefetch_backoff` off or on;
   StreamedLlama(prefetch="gate", prefetch_adapt=False) decodes `--tokens` tokens
   after a short prompt, every token routed as a real trace's next one and the
   gate-ahead predictor emulated at `--recall` (bench/trace_routes.py). A generated
   model left to its own router repeats one token, so one route, and after the
   prompt every expert hits: the drive would never be asked for anything (the
   first version of this bench measured exactly that, bimodally).

Prints per arm: tok/s, stall (s/token), prefetches issued and dropped, MiB read,
and the ratio on/off of the mean tok/s. The issue's bar: on no slower than off,
faster where the drive is the limit.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPT = b"the expert model reads memory pages from the drive, one token at a time"


def default_model() -> str:
    from moed.modelgen.makemodel import make_model

    path = "/tmp/moed-bench/backoff-q4_0-aligned.gguf"
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        print(f"generating {path} (once)", flush=True)
        make_model(path, layers=8, experts=64, used=8, embd=1024, ff=512, quant="q4_0", align=4096)
    return path


def expert_bytes(cat) -> int:
    return sum(cat.extent(layer, 0, p)[2] for layer in cat.moe_layers for p in cat.parts) * cat.n_experts


def drive_rate(model: str, fs) -> float:
    """Bytes/s of moed's own cold reads of every expert, unthrottled (in the blkio group)."""
    from moed.gguf.catalog import Catalog
    from moed.testing import DaemonProcess
    from moed.testing.faultfs import BlkioThrottle

    cat = Catalog.open(model)
    fs.remount()
    with DaemonProcess(expert_bytes(cat) + (64 << 20)) as d, BlkioThrottle(fs.major_minor) as t:
        t.add(d.proc.pid)
        with d.client("rate") as c:
            h = c.open_model(model)
            t0 = time.perf_counter()
            for layer in h.moe_layers:
                for first in range(0, h.n_experts, 8):
                    with h.acquire(layer, list(range(first, min(first + 8, h.n_experts)))):
                        pass
            seconds = time.perf_counter() - t0
            return c.stats()["bytes_read"] / seconds


def arm(model: str, fs, bps: int, budget: int, backoff: bool, tokens: int, skeleton: str, recall: float) -> dict:
    from trace_routes import DEFAULT_TRACE, TraceRoutes

    from moed.engines.llama_cpp import StreamedLlama
    from moed.testing import DaemonProcess
    from moed.testing.faultfs import BlkioThrottle

    fs.remount()  # nothing cached from the last arm
    with (
        DaemonProcess(budget, config={"prefetch_backoff": backoff}) as d,
        BlkioThrottle(fs.major_minor) as t,
        d.client("bench") as c,
    ):
        t.add(d.proc.pid)
        t.read_bps(bps)
        routes = TraceRoutes(str(DEFAULT_TRACE), recall)
        llm = StreamedLlama(
            model,
            client=c,
            route_hook=routes,
            predict_hook=routes.predict,
            prefetch="gate",
            prefetch_adapt=False,
            skeleton_dir=skeleton,
            n_ctx=256,
            n_threads=2,
            verbose=False,
        )
        try:
            prompt = llm.tokenize(PROMPT)
            routes.start(0)
            llm.eval(prompt)
            before = llm.stream_stats()["stall_s"]
            t0 = time.perf_counter()
            for i in range(tokens):
                routes.start(len(prompt) + i)  # the trace's tokens, in order
                llm.eval([int(llm.scores[llm.n_tokens - 1].argmax())])
            seconds = time.perf_counter() - t0
            st = llm.stream_stats()
        finally:
            llm.close()
        s = c.stats()
        return {
            "backoff": backoff,
            "tok_s": tokens / seconds,
            "stall_s_per_token": (st["stall_s"] - before) / tokens,
            "prefetches": s["prefetches"],
            "prefetch_dropped": s["prefetch_dropped"],
            "read_mib": s["bytes_read"] / (1 << 20),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--fraction", type=float, default=0.25, help="the throttle as a fraction of the drive's rate")
    ap.add_argument("--budget", type=float, default=0.25, help="RAM budget as a fraction of the experts' bytes")
    ap.add_argument("--recall", type=float, default=0.86, help="the emulated gate-ahead predictor's recall")
    args = ap.parse_args()

    from moed.gguf.catalog import Catalog
    from moed.testing.faultfs import LoopBtrfs, unavailable

    if why := unavailable(throttle=True):
        sys.exit(f"drive_backoff: {why}")
    src = args.model or default_model()
    size = os.path.getsize(src)
    with LoopBtrfs(size_bytes=max(256 << 20, 2 * size + (128 << 20))) as fs, tempfile.TemporaryDirectory() as skel:
        model = str(fs.copy_in(src, "model.gguf"))
        cat = Catalog.open(model)
        budget = int(expert_bytes(cat) * args.budget)
        rate = drive_rate(model, fs)
        bps = int(rate * args.fraction)
        print(f"drive: {rate / 1e6:.0f} MB/s unthrottled; throttled to {bps / 1e6:.0f} MB/s; budget {budget >> 20} MiB")
        rows = [arm(model, fs, bps, budget, on, args.tokens, skel, args.recall) for on in (False, True, False, True)]
    print(f"{'backoff':>8} {'tok/s':>8} {'stall s/tok':>12} {'prefetches':>11} {'dropped':>8} {'MiB read':>9}")
    for r in rows:
        print(
            f"{'on' if r['backoff'] else 'off':>8} {r['tok_s']:8.2f} {r['stall_s_per_token']:12.4f} "
            f"{r['prefetches']:11d} {r['prefetch_dropped']:8d} {r['read_mib']:9.1f}"
        )

    def mean(on: bool) -> float:
        return sum(r["tok_s"] for r in rows if r["backoff"] == on) / 2

    print(f"back-off on / off: {mean(True) / mean(False):.3f}x tok/s")


if __name__ == "__main__":
    main()
