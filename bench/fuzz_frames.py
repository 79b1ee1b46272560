"""Fuzz a real daemon with hostile frames and watch its memory.

Run: .venv/bin/python bench/fuzz_frames.py [--frames 100000] [--batch 50]

Frames come from the hypothesis strategies in tests/integration/frames.py (raw
bytes, random MessagePack maps, well-typed requests with hostile values,
truncated and bit-flipped encodings), sent in batches over one connection,
each batch followed by a Ping that must be answered; a connection the daemon
hangs up (a bad Hello) is reopened. Meanwhile a well-behaved client keeps
acquiring experts and checks their bytes.

Baseline, in the same run: the daemon's RSS after the first 10% of the frames
(everything is warm then). Prints RSS every 10% of the run, the ratio of the
final RSS to the baseline, frames per second, and whether the daemon and the
well-behaved client survived.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from moed.modelgen.makemodel import make_model  # noqa: E402
from moed.protocol import messages as m  # noqa: E402
from moed.testing import DaemonProcess, good_client, proc_status_bytes  # noqa: E402
from moed.testing.frames import RawConnection, frames  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frames", type=int, default=100_000)
    p.add_argument("--batch", type=int, default=50)
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="moed-fuzz-")
    atexit.register(shutil.rmtree, tmp, True)
    model = str(make_model(os.path.join(tmp, "m.gguf"), layers=4, experts=8, used=2)[0])
    d = DaemonProcess("8MiB")
    conn = RawConnection(d.socket)
    stop, good = threading.Event(), {}
    t = threading.Thread(target=good_client, args=(d.socket, model, stop, good), daemon=True)
    t.start()
    sent = [0]
    marks: list[tuple[int, int]] = []
    step = args.frames // 10
    t0 = time.perf_counter()

    @settings(
        max_examples=args.frames // args.batch + 1,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(batch=st.lists(frames, min_size=args.batch, max_size=args.batch))
    def fuzz(batch):
        if sent[0] >= args.frames:
            return
        conn.exchange(batch)
        sent[0] += len(batch)
        if d.proc.poll() is not None:
            raise SystemExit(f"moed died after {sent[0]} frames:\n{d.log()}")
        if sent[0] // step > len(marks) - 1 or not marks:
            marks.append((sent[0], proc_status_bytes(d.proc.pid, "VmRSS")))

    fuzz()
    elapsed = time.perf_counter() - t0
    stop.set()
    t.join(30)
    final = proc_status_bytes(d.proc.pid, "VmRSS")
    alive = d.proc.poll() is None
    with d.client() as c:
        c.request(m.SetMemFloor(0))
        s = c.stats()
    d.stop()
    print(
        f"{sent[0]} hostile frames in {elapsed:.1f} s ({sent[0] / elapsed:,.0f} frames/s), "
        f"{conn.reconnects} reconnects after the daemon hung up, {s['bad_frames']} answered BAD_FRAME"
    )
    print("daemon RSS (MiB) at frames: " + ", ".join(f"{n}: {r / 2**20:.1f}" for n, r in marks))
    base = next((r for n, r in marks if n >= step), marks[0][1])
    print(
        f"RSS final {final / 2**20:.1f} MiB, baseline (after {step} frames) {base / 2**20:.1f} MiB, "
        f"ratio {final / base:.3f}"
    )
    print(
        f"daemon alive: {alive}; well-behaved client: {good.get('acquires', 0)} acquires, "
        f"error: {good.get('error', 'none')}"
    )
    return 0 if alive and "error" not in good else 1


if __name__ == "__main__":
    sys.exit(main())
