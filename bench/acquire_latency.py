"""Acquire round trip on a hit, against a bare cross-process round trip floor.

Run: .venv/bin/python bench/acquire_latency.py [--clients 1,4] [--n 20000]

Baseline, measured in the same run: an echo server process over a Unix
stream socket answering frames of the same sizes as an Acquire and its
Granted reply (blocking Python on both ends: the cheapest cross-process round
trip Python can do). moed: a real daemon; each client process acquires the
same resident experts again and again, releasing each lease by piggybacking
it on the next acquire (the engine's path: no second round trip).
Each client count runs twice against the daemon: with local hits (the
residency table: a hit is one call into moed._holds, no syscall) and with them
off (MOED_LOCAL_HITS=0: every acquire a socket round trip).
Prints p50/p99 in µs per client count and the ratios against the floor.
`--strace` also counts the syscalls of 1,000 local hits with strace -c.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import struct
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moed.protocol import messages as m  # noqa: E402
from moed.protocol.framing import encode  # noqa: E402

HEADER = struct.Struct("<I")


def echo_server(path: str, reply: bytes, ready) -> None:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(16)
    ready.set()
    import threading

    def serve(conn):
        buf = b""
        while True:
            data = conn.recv(65536)
            if not data:
                return
            buf += data
            while len(buf) >= 4:
                (n,) = HEADER.unpack_from(buf)
                if len(buf) < 4 + n:
                    break
                buf = buf[4 + n :]
                conn.sendall(reply)

    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def floor_client(path: str, request: bytes, n: int, out) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        s.sendall(request)
        got = s.recv(65536)
        while len(got) < 4 or len(got) < 4 + HEADER.unpack_from(got)[0]:
            got += s.recv(65536)
        times.append(time.perf_counter_ns() - t0)
    out.put(times)


def moed_client(sock: str, model: str, n: int, experts: list[int], local_hits: bool, out) -> None:
    os.environ["MOED_LOCAL_HITS"] = "1" if local_hits else "0"
    from moed.client import Client

    c = Client(sock, f"bench{os.getpid()}")
    h = c.open_model(model)
    prev = h.acquire(0, experts)  # warm: experts are resident after this
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        prev = h.acquire(0, experts, release=[prev])
        times.append(time.perf_counter_ns() - t0)
    prev.release()
    out.put(times)


def count_syscalls(sock: str, model: str, experts: list[int]) -> dict:
    """strace -c -f of a process doing 1,000 local hits after its warm-up, minus one doing none."""
    import subprocess

    code = (
        "import sys,os; from moed.client import Client; c=Client(sys.argv[1]); h=c.open_model(sys.argv[2]); "
        "p=h.acquire(0, list(range(8))); p=h.acquire(0, list(range(8)), release=[p]); n=int(sys.argv[3]); "
        "os.write(2, b'MARK');\nfor _ in range(n): p=h.acquire(0, list(range(8)), release=[p])\n"
        "os.write(2, b'MARK')"
    )
    counts = {}
    for n in (0, 1000):
        out = subprocess.run(
            ["strace", "-f", "-c", "-o", "/dev/stdout", sys.executable, "-c", code, sock, model, str(n)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        total = [line for line in out.stdout.splitlines() if line.strip().endswith("total")]
        counts[n] = int(total[-1].split()[3]) if total else -1
    return {
        "calls_with_0_hits": counts[0],
        "calls_with_1000_hits": counts[1000],
        "per_hit": (counts[1000] - counts[0]) / 1000,
    }


def run_clients(target, args_for, k: int) -> list[int]:
    q = mp.Queue()
    procs = [mp.Process(target=target, args=(*args_for(i), q)) for i in range(k)]
    for p in procs:
        p.start()
    times = []
    for _ in procs:
        times.extend(q.get())
    for p in procs:
        p.join()
    return times


def pct(times: list[int], p: float) -> float:
    s = sorted(times)
    return s[min(len(s) - 1, int(p * len(s)))] / 1000


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--strace", action="store_true", help="count syscalls of 1,000 local hits")
    args = ap.parse_args()

    from moed.modelgen.makemodel import make_model
    from moed.testing import DaemonProcess

    tmp = tempfile.mkdtemp(prefix="moedbench-", dir="/tmp")
    model = str(make_model(os.path.join(tmp, "m.gguf"), layers=4, experts=64, used=8)[0])
    experts = list(range(8))
    request = encode(m.Acquire(1, 0, experts, None, [123456]))
    reply = encode(m.Granted(123457, 1, experts))

    floor_path = os.path.join(tmp, "echo")
    ready = mp.Event()
    srv = mp.Process(target=echo_server, args=(floor_path, reply, ready), daemon=True)
    srv.start()
    ready.wait(10)
    d = DaemonProcess("256MiB")
    rows = []
    try:
        for k in [int(x) for x in args.clients.split(",")]:
            floor = run_clients(floor_client, lambda i: (floor_path, request, args.n), k)
            moed = run_clients(moed_client, lambda i: (d.socket, model, args.n, experts, False), k)
            loc = run_clients(moed_client, lambda i: (d.socket, model, args.n, experts, True), k)
            row = {
                "clients": k,
                "floor_p50_us": pct(floor, 0.5),
                "floor_p99_us": pct(floor, 0.99),
                "moed_p50_us": pct(moed, 0.5),
                "moed_p99_us": pct(moed, 0.99),
                "local_p50_us": pct(loc, 0.5),
                "local_p99_us": pct(loc, 0.99),
            }
            row["ratio_p50"] = row["moed_p50_us"] / row["floor_p50_us"]
            row["local_ratio_p50"] = row["local_p50_us"] / row["floor_p50_us"]
            rows.append(row)
        if args.strace:
            rows.append({"syscalls_per_1000_local_hits": count_syscalls(d.socket, model, experts)})
    finally:
        d.stop()
        srv.terminate()
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"acquire on a hit (8 experts, release piggybacked), {args.n} acquires per client")
    print(
        f"{'clients':>7} {'floor p50':>10} {'floor p99':>10} {'socket p50':>10} {'socket p99':>10} "
        f"{'local p50':>10} {'local p99':>10} {'sock/floor':>10} {'local/floor':>11}"
    )
    for r in rows:
        if "clients" not in r:
            print(r)
            continue
        print(
            f"{r['clients']:>7} {r['floor_p50_us']:>9.1f}µ {r['floor_p99_us']:>9.1f}µ "
            f"{r['moed_p50_us']:>9.1f}µ {r['moed_p99_us']:>9.1f}µ {r['local_p50_us']:>9.1f}µ "
            f"{r['local_p99_us']:>9.1f}µ {r['ratio_p50']:>10.2f} {r['local_ratio_p50']:>11.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
