"""A plain client standing in for an engine in the demo: random routes, bytes checked."""

from __future__ import annotations

import random
import sys

from moed.client import Client
from moed.gguf.catalog import Catalog


def main(sock: str, model: str, name: str, tokens: int = 64) -> int:
    cat = Catalog.open(model)
    rng = random.Random(name)
    with Client(sock, name) as c:
        m = c.open_model(model)
        checked = 0
        for _ in range(tokens):
            for layer in m.moe_layers:
                experts = rng.sample(range(m.n_experts), m.n_expert_used)
                with m.acquire(layer, experts) as lease:
                    for e in experts:
                        for part in m.parts:
                            path, off, n = cat.extent(layer, e, part)
                            with open(path, "rb") as f:
                                f.seek(off)
                                if f.read(n) != lease.view(e, part).tobytes():
                                    print(f"{name}: WRONG BYTES layer {layer} expert {e} {part}")
                                    return 1
                            checked += 1
    print(f"{name}: {tokens} tokens x {len(m.moe_layers)} layers, {checked} expert parts checked against the file")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3]))
