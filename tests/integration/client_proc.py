"""A client process for integration tests: `python -m tests.integration.client_proc MODE SOCKET MODEL ...`.

Modes:
- random N SEED: N acquires of random experts, each checked against the file's
  bytes; prints "ok <checked>" or exits 1 naming the first mismatch.
- hold LAYER E1,E2,..: acquire, print "held ... local=False", then sleep until killed;
- hold-local LAYER E1,E2,..: the same, held locally (acquired a second time, with
  no round trip, when the first read them in).
"""

from __future__ import annotations

import random
import sys
import time

from moed.client import Client
from moed.gguf.catalog import Catalog


def check_random(sock: str, model_path: str, n: int, seed: int) -> int:
    rng = random.Random(seed)
    cat = Catalog.open(model_path)
    files = {p: open(p, "rb") for p in cat.files}
    checked = 0
    with Client(sock, f"worker{seed}") as c:
        m = c.open_model(model_path)
        for _ in range(n):
            layer = rng.choice(m.moe_layers)
            experts = rng.sample(range(m.n_experts), m.n_expert_used)
            with m.acquire(layer, experts, timeout_s=30) as lease:
                for e in experts:
                    for part in m.parts:
                        path, off, length = cat.extent(layer, e, part)
                        f = files[path]
                        f.seek(off)
                        if lease.view(e, part).tobytes() != f.read(length):
                            print(f"mismatch layer {layer} expert {e} part {part}", flush=True)
                            return 1
                        checked += 1
    print(f"ok {checked}", flush=True)
    return 0


def hold(sock: str, model_path: str, layer: int, experts: list[int], local: bool = False) -> int:
    c = Client(sock, "holder")
    m = c.open_model(model_path)
    lease = m.acquire(layer, experts)
    if local and not lease.local:  # read in by this acquire: hold it again, now without a round trip
        again = m.acquire(layer, experts)
        lease.release()
        lease = again
    print(f"held {lease.lease_id} local={lease.local}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    mode, sock, model = sys.argv[1:4]
    if mode == "random":
        sys.exit(check_random(sock, model, int(sys.argv[4]), int(sys.argv[5])))
    if mode in ("hold", "hold-local"):
        sys.exit(hold(sock, model, int(sys.argv[4]), [int(x) for x in sys.argv[5].split(",")], mode == "hold-local"))
    sys.exit(f"unknown mode {mode}")
