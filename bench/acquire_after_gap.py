"""Acquire latency on a hit after the engine computed for a while (the daemon sat idle).

Run: .venv/bin/python bench/acquire_after_gap.py

An engine acquires once per MoE layer, a few milliseconds apart; in between the
daemon idles. Back-to-back acquires (gap 0) are what bench/acquire_latency.py
measures; here the client busy-computes for `gap` ms before each acquire, as an
engine does, and the p50/p90 round trip is printed per gap. On a VM the idle
vCPU halts and its wake-up goes through the host, which this shows directly.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tempfile  # noqa: E402

from moed.modelgen.makemodel import make_model  # noqa: E402
from moed.spawn import DaemonProcess  # noqa: E402

d = DaemonProcess("256MiB")
model = make_model(os.path.join(tempfile.mkdtemp(prefix="moedbench-", dir="/tmp"), "m.gguf"), experts=64, used=8)[0]
c = d.client()
h = c.open_model(model)
prev = h.acquire(0, range(8))
for gap_ms in (0, 0.5, 1, 3):
    ts = []
    for _i in range(2000 if gap_ms < 1 else 600):
        if gap_ms:
            t = time.perf_counter() + gap_ms / 1e3
            while time.perf_counter() < t:
                pass  # the engine computes (busy), the daemon idles
        t0 = time.perf_counter_ns()
        prev = h.acquire(0, range(8), release=[prev])
        ts.append(time.perf_counter_ns() - t0)
    ts.sort()
    print(f"gap {gap_ms} ms: p50 {ts[len(ts) // 2] / 1e3:.0f} us p90 {ts[int(len(ts) * 0.9)] / 1e3:.0f} us")
c.close()
d.stop()
