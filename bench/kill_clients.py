"""Clients SIGKILLed while holding leases: how fast does the daemon reclaim their pins?

Run: .venv/bin/python bench/kill_clients.py [--rounds 1000]

Each round forks a client that connects, opens the model, acquires four
experts (the whole budget) and reports "held"; the bench then SIGKILLs it and
times, from the kill, until the daemon reports every slot unreferenced again
(`evictable_bytes == used_bytes`, polled over a second connection). Baseline,
in the same run, alternating with the kills: a client that releases its lease
cleanly (fire-and-forget Release) when told to, timed the same way.

Prints p50/p99/max reclaim time for both, the ratio of the p50s, how many
kills took over 100 ms, and checks the budget is whole at the end.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moed.client import Client  # noqa: E402
from moed.gguf import budget  # noqa: E402
from moed.gguf.catalog import Catalog  # noqa: E402
from moed.modelgen.makemodel import make_model  # noqa: E402
from moed.testing import DaemonProcess  # noqa: E402


def slot_bytes(model: str) -> int:
    cat = Catalog.open(model)
    return budget.slot_bytes(cat.layers[0])


def spawn_holder(sock: str, model: str, layer: int) -> tuple[int, int, int]:
    """Fork a client holding 4 experts; returns (pid, fd to read 'held' from, fd to tell it to release)."""
    held_r, held_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(held_r)
            os.close(go_w)
            c = Client(sock, "holder")
            lease = c.open_model(model).acquire(layer, [0, 1, 2, 3], timeout_s=10)
            os.write(held_w, b"h")
            os.read(go_r, 1)  # wait to be told (or killed)
            lease.release()
            os.read(go_r, 1)  # stay connected until the parent is done timing
            code = 0
        finally:
            os._exit(code)
    os.close(held_w)
    os.close(go_r)
    return pid, held_r, go_w


def time_until_free(obs: Client, t0: float, timeout_s: float = 5.0) -> float:
    while True:
        s = obs.stats()
        if s["evictable_bytes"] == s["used_bytes"] and s["used_bytes"] > 0:
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError("pins not reclaimed within 5 s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=1000)
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="moed-kill-")
    atexit.register(shutil.rmtree, tmp, True)
    model = str(make_model(os.path.join(tmp, "m.gguf"), layers=4, experts=8, used=2)[0])
    slot = slot_bytes(model)
    d = DaemonProcess(str(4 * slot))
    kills, releases = [], []
    with Client(d.socket, "observer") as obs:
        obs.open_model(model)
        for i in range(args.rounds):
            for kill in (True, False) if i % 10 == 0 else (True,):
                pid, held, go = spawn_holder(d.socket, model, i % 4)
                assert os.read(held, 1) == b"h"
                t0 = time.perf_counter()
                if kill:
                    os.kill(pid, signal.SIGKILL)
                else:
                    os.write(go, b"r")
                (kills if kill else releases).append(time_until_free(obs, t0))
                if not kill:
                    os.write(go, b"x")
                os.waitpid(pid, 0)
                os.close(held)
                os.close(go)
        s = obs.stats()
    alive = d.proc.poll() is None
    d.stop()
    ms = lambda xs, q: 1e3 * sorted(xs)[max(0, -(-q * len(xs) // 100) - 1)]  # noqa: E731 - nearest rank
    print(
        f"{len(kills)} SIGKILLed holders: reclaim p50 {ms(kills, 50):.2f} ms, p99 {ms(kills, 99):.2f} ms, "
        f"max {1e3 * max(kills):.2f} ms; over 100 ms: {sum(k > 0.1 for k in kills)}"
    )
    print(
        f"{len(releases)} clean releases (baseline): p50 {ms(releases, 50):.2f} ms, "
        f"p99 {ms(releases, 99):.2f} ms, max {1e3 * max(releases):.2f} ms"
    )
    print(f"ratio kill/release p50: {ms(kills, 50) / ms(releases, 50):.2f}")
    print(
        f"daemon alive: {alive}; at the end {s['connections']} connection(s), "
        f"{s['used_bytes'] // slot} slots used, all unreferenced: {s['evictable_bytes'] == s['used_bytes']}"
    )
    return 0 if alive and max(kills) <= 0.1 else 1


if __name__ == "__main__":
    sys.exit(main())
