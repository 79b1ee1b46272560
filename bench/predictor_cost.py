"""The look-ahead's numpy cost per layer, against a layer's compute, outside the engine.

Times `Lookahead.observe` (the folded router matmul, top-k, the prefetch set) and
`Lookahead.routed` (recall, counts, sending the prefetch to a source that drops
it) for one decode token at a given geometry (default OLMoE-1B-7B: n_embd 2048,
64 experts, top-8, 16 layers), and for a prompt batch. Divide by the engine's own
compute per layer (bench/engine_vs_mmap.py: cpu_ms_per_token / layers) for the
share; the issue's bound is 5%.

    python bench/predictor_cost.py [--embd 2048 --experts 64 --used 8 --layers 16] [--batch 256]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from moed.engines.sources import ExpertSource  # noqa: E402


class DroppingSource(ExpertSource):
    """Serves nothing, holds nothing: the look-ahead's prefetches are dropped (the cost
    measured is the predictor's alone)."""

    def __init__(self, layers: list[int], used: int):
        self.moe_layers, self.n_expert_used = layers, used

    def capacity(self, layer: int) -> int:
        return 1 << 30

    def prefetch(self, layer: int, experts: list[int]) -> None:
        pass


def per_layer_us(la, x: np.ndarray, ids: np.ndarray, n: int) -> float:
    for _ in range(20):
        la.observe(3, x)
        la.routed(4, ids, ids.size, 0.0)
    t = time.perf_counter()
    for _ in range(n):
        la.observe(3, x)
        la.routed(4, ids, ids.size, 0.0)
    return 1e6 * (time.perf_counter() - t) / n


def main() -> int:
    from moed.engines.lookahead import Lookahead
    from moed.engines.predictor import GatePredictor, Router

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for k, v in (("embd", 2048), ("experts", 64), ("used", 8), ("layers", 16), ("batch", 256)):
        ap.add_argument(f"--{k}", type=int, default=v)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    layers = list(range(a.layers))
    routers = {
        l: Router(
            rng.standard_normal((a.experts, a.embd)).astype(np.float32),
            (1 + 0.1 * rng.standard_normal(a.embd)).astype(np.float32),
        )
        for l in layers
    }
    la = Lookahead(GatePredictor(routers, layers), DroppingSource(layers, a.used), "gate", a.used, adapt=False)
    out = {}
    for rows, n in ((1, 3000), (a.batch, 50)):
        x = rng.standard_normal((rows, a.embd)).astype(np.float32)
        ids = np.argsort(rng.random((rows, a.experts)), axis=1)[:, : a.used].astype(np.int32)
        out[f"us_per_layer_{rows}_tokens"] = round(per_layer_us(la, x, ids, n), 1)
    print(json.dumps({"geometry": vars(a), **out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
