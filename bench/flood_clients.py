"""Eight connections that flood the daemon with requests and never read the replies.

Run: .venv/bin/python bench/flood_clients.py [--flooders 8] [--seconds 20]

Each flooder says Hello, optionally opens a model (its reply, carrying
descriptors, is never read either), then sends GetStats frames (13 bytes that
each ask for a ~2 KB reply) as fast as the kernel takes them, for the whole
run. Meanwhile a well-behaved client pings and acquires experts, checking
every byte against the file.

Baseline, in the same run: the daemon's RSS after the good client has warmed
it up, before any flooder connects. Prints the peak RSS during the flood and
the RSS once the flooders have closed, both as growth over the baseline, the
good client's worst ping, and the bytes each flooder got the daemon to hold
(from `moectl stats --json`, key `clients`). Goal (issue "One tenant must never
hurt another"): growth at most 64 MiB, back near the baseline after they close,
every ping under a second.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time

from moed.client import Client
from moed.modelgen.makemodel import make_model
from moed.protocol import messages as m
from moed.protocol.framing import encode
from moed.spawn import DaemonProcess
from moed.testing import good_client


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def flooder(sock_path: str, model: str, open_first: bool, stop: threading.Event, sent: list) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sock_path)
    s.sendall(encode(m.Hello(m.PROTOCOL_VERSION, "flooder")))
    if open_first:
        s.sendall(encode(m.OpenModel(model)))
    s.setblocking(False)
    chunk = encode(m.GetStats()) * 300
    n = 0
    while not stop.is_set():
        try:
            n += s.send(chunk)
        except BlockingIOError:
            time.sleep(0.01)  # the daemon stopped reading us: keep the pressure, politely
    sent.append((s, n))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flooders", type=int, default=8)
    p.add_argument("--seconds", type=float, default=20.0)
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="moed-flood-")
    atexit.register(shutil.rmtree, tmp, True)
    model = str(make_model(os.path.join(tmp, "m.gguf"), layers=4, experts=8, used=2)[0])
    d = DaemonProcess("8MiB")
    warm_stop, warm = threading.Event(), {}
    t = threading.Thread(target=good_client, args=(d.socket, model, warm_stop, warm, 0.002))
    t.start()
    time.sleep(2.0)  # warm-up: the good client's working set is resident
    base = rss_bytes(d.proc.pid)
    stop, sent = threading.Event(), []
    floods = [
        threading.Thread(target=flooder, args=(d.socket, model, i % 2 == 1, stop, sent)) for i in range(args.flooders)
    ]
    for f in floods:
        f.start()
    peak, deadline = base, time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        peak = max(peak, rss_bytes(d.proc.pid))
        time.sleep(0.1)
    with Client(d.socket, "ops") as c:
        held = [r for r in c.stats()["clients"] if r["queued_bytes"] or r["buffered_out_bytes"]]
    stop.set()
    for f in floods:
        f.join()
    for s, _ in sent:
        s.close()
    with Client(d.socket, "ops") as c:
        t_end = time.monotonic() + 10
        while c.stats()["connections"] > 2 and time.monotonic() < t_end:
            time.sleep(0.05)
    time.sleep(1.0)
    after = rss_bytes(d.proc.pid)
    warm_stop.set()
    t.join()
    code = d.stop()
    mib = 1 << 20
    result = {
        "flooders": args.flooders,
        "seconds": args.seconds,
        "bytes_sent_by_flooders": sum(n for _, n in sent),
        "baseline_rss_mib": round(base / mib, 1),
        "peak_rss_mib": round(peak / mib, 1),
        "after_close_rss_mib": round(after / mib, 1),
        "peak_growth_mib": round((peak - base) / mib, 1),
        "after_growth_mib": round((after - base) / mib, 1),
        "peak_ratio": round(peak / base, 3),
        "after_ratio": round(after / base, 3),
        "max_queued_bytes_per_flooder": max((r["queued_bytes"] for r in held), default=0),
        "max_buffered_out_bytes_per_flooder": max((r["buffered_out_bytes"] for r in held), default=0),
        "good_client": warm,
        "daemon_exit": code,
    }
    print(json.dumps(result, indent=1))
    ok = peak - base < 64 * mib and warm.get("worst_ping_s", 9) < 1.0 and "error" not in warm and code == 0
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
