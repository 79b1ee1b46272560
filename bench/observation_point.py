"""Where to read the hidden state for gate-ahead prediction: `ffn_norm-L` or `l_out-L`.

Both points predict layer L+1 (and L+2) by applying its router to the residual
stream, normed with L+1's FFN norm weight:

  ffn_norm-L  layer L's normed FFN input, with the norm-weight ratio folded in
              (moed.engines.predictor); lead time: L's expert matmuls + L+1's attention
  l_out-L     layer L's output (after its experts), RMS-normed with L+1's weight;
              lead time: L+1's attention only

For each, this prints the recall (routed (token, expert) pairs the prediction's
first top-k named) one and two layers ahead, and the measured lead time: the
wall time from the callback at the observation point to the callback at the
predicted layer's `ffn_moe_topk`, where the engine has to have the experts.

Runs resident llama.cpp (UnpackedLlama) on a model written by moed's generator:
RANDOM WEIGHTS, so the recalls say how the two points compare on this model, not
what a trained model gives (74-89% one ahead in public measurements).

    python bench/observation_point.py [--layers 8 --experts 32 --used 4 --embd 512 --ff 256] [--tokens 48]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import pathlib
import re
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
_NAME = re.compile(rb"(ffn_norm|l_out|ffn_moe_topk)-(\d+)\Z")


class Observer:
    """An eval callback that keeps ffn_norm, l_out and topk of every layer, with their times."""

    def __init__(self):

        from moed.engines import ggml_tensor

        self.gt = ggml_tensor
        self.rows: dict[tuple[str, int], np.ndarray] = {}
        self.at: dict[tuple[str, int], float] = {}
        self.steps: list[tuple[dict, dict]] = []
        self.c_callback = ggml_tensor.PythonEvalCallback(self._callback)  # it stops at l_out too

    def _callback(self, tensor: int, ask: bool, _user) -> bool:
        name = ctypes.string_at(tensor + self.gt.NAME_OFFSET)
        m = _NAME.match(name)
        if m is None:
            return False
        if ask:
            return True
        key = (m.group(1).decode(), int(m.group(2)))
        self.at[key] = time.perf_counter()
        if key[0] == "ffn_moe_topk":
            self.rows[key] = self.gt.topk_ids(tensor)
        else:
            self.rows[key] = np.array(self.gt.rows_f32(tensor))
        return True

    def end_step(self) -> None:
        self.steps.append((self.rows, self.at))
        self.rows, self.at = {}, {}


def rms_norm(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps)


def recall(pred: np.ndarray, ids: np.ndarray) -> tuple[int, int]:
    got = sum(len(set(p.tolist()) & set(r.tolist())) for p, r in zip(pred, ids))
    return got, ids.size


def measure(model: str, tokens: int, eps: float) -> dict:
    from moed.engines.llama_cpp import UnpackedLlama, _constructing, _unpacked_internals
    from moed.engines.predictor import GatePredictor, load_routers, top
    from moed.gguf.header import read_split

    obs = Observer()
    with _constructing(_unpacked_internals(obs)):
        llm = UnpackedLlama.__mro__[1](
            model_path=model, n_ctx=tokens + 64, n_batch=1, n_ubatch=1, n_threads=1, verbose=False, logits_all=True
        )
    headers = read_split(model)
    layers = list(range(int(headers[0].get(f"{headers[0].get('general.architecture')}.block_count"))))
    routers, gating = load_routers(headers, [model], layers)
    pred = GatePredictor(routers, layers, gating)
    llm.eval(llm.tokenize(b"the expert model reads memory pages from the drive"))
    obs.steps.clear()
    obs.rows, obs.at = {}, {}
    for _ in range(tokens):  # decode steps: one token a graph
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        obs.end_step()
    k = routers[layers[0]].weight.shape[0] and int(obs.steps[0][0][("ffn_moe_topk", 0)].shape[1])
    out = {}
    for point in ("ffn_norm", "l_out"):
        for lead in (1, 2):
            got = total = 0
            lead_s = []
            for rows, at in obs.steps:
                for L in layers[:-lead]:
                    M = L + lead
                    x = rows[(point, L)]
                    if point == "ffn_norm":
                        scores = pred.scores(x, L, M)
                    else:
                        scores = (rms_norm(x, eps) * routers[M].norm) @ routers[M].weight.T
                    g, t = recall(top(scores, k), rows[("ffn_moe_topk", M)])
                    got, total = got + g, total + t
                    lead_s.append(at[("ffn_moe_topk", M)] - at[(point, L)])
            out[f"{point} +{lead}"] = {
                "recall": round(got / total, 3),
                "lead_ms_median": round(1e3 * float(np.median(lead_s)), 3),
            }
    llm.close()
    return out


def main() -> int:
    from moed.modelgen.makemodel import make_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for key, default in (("layers", 8), ("experts", 32), ("used", 4), ("embd", 512), ("ff", 256)):
        ap.add_argument(f"--{key}", type=int, default=default)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--model", default=None, help="a GGUF to measure instead of a generated one")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        model = a.model or str(
            make_model(
                pathlib.Path(d) / "m.gguf",
                layers=a.layers,
                experts=a.experts,
                used=a.used,
                embd=a.embd,
                ff=a.ff,
                ctx=512,
            )[0]
        )
        from moed.gguf.header import read_header

        h = read_header(model)
        eps = float(h.get(f"{h.get('general.architecture')}.attention.layer_norm_rms_epsilon", 1e-6))
        res = measure(model, a.tokens, eps)
    print(
        json.dumps(
            {
                "model": a.model
                or f"generated (random weights) {a.layers}x{a.experts} top-{a.used} embd {a.embd} ff {a.ff}",
                "tokens": a.tokens,
                "points": res,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
