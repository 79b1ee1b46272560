"""An engine process for e2e tests: StreamedLlama on a daemon, greedy text out.

python -m tests.e2e.engine_proc SOCKET MODEL PROMPT N            -> prints JSON {"text", "tokens"}
python -m tests.e2e.engine_proc SOCKET MODEL PROMPT N --forever  -> prints "tok" per token, forever
python -m tests.e2e.engine_proc SOCKET MODEL PROMPT N --touch-expert -> reads an unserved expert (must die)
python -m tests.e2e.engine_proc SOCKET MODEL PROMPT N --touch-released -> strict mode: reads a released one (must die)
python -m tests.e2e.engine_proc SOCKET MODEL PROMPT N --logits OUT.npy [--strict] -> loads, prints "ready", waits for a
    line on stdin, then saves the prompt batch's and N greedy steps' logits (the e2e reference's settings) and prints
    JSON; --strict: released experts fault again (a read of one kills the process)
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

import numpy as np

from moed.client import Client
from moed.engines.llama_cpp import StreamedLlama

LLAMA_KW = dict(n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1, verbose=False, seed=0)


def greedy(llm: StreamedLlama, prompt: str, n: int) -> list[int]:
    llm.reset()
    out = []
    for tok in llm.generate(llm.tokenize(prompt.encode()), top_k=1, temp=0.0, reset=True):
        out.append(int(tok))
        if len(out) >= n:
            break
    return out


def main(argv: list[str]) -> int:
    socket, model, prompt, n = argv[:4]
    mode = argv[4] if len(argv) > 4 else ""
    if mode == "--logits":
        return logits(socket, model, prompt, int(n), argv[5], strict=argv[6:] == ["--strict"])
    client = Client(socket, "e2e-worker")
    llm = StreamedLlama(model, client=client, strict=(mode == "--touch-released"), **LLAMA_KW)
    if mode == "--touch-released":
        greedy(llm, prompt, int(n))
        pages = llm.streamer.pages
        (layer, part, expert), _ = next((k, v) for k, v in pages._zc.items() if not v.visible)
        print("touching", flush=True)
        ctypes.string_at(pages.span(layer, part).expert_addr(expert), 1)  # released: must fault
        print("read a released expert", flush=True)
        return 0
    if mode == "--touch-expert":
        span = llm.streamer.pages.spans[0]
        print("touching", flush=True)
        ctypes.string_at(span.expert_addr(1), 1)  # no lease: must fault
        print("read an unserved expert", flush=True)
        return 0
    if mode == "--forever":
        while True:
            for _ in greedy_stream(llm, prompt):
                print("tok", flush=True)
    tokens = greedy(llm, prompt, int(n))
    print(json.dumps({"tokens": tokens, "text": llm.detokenize(tokens).decode(errors="replace")}), flush=True)
    llm.close()
    client.close()
    return 0


def logits(socket: str, model: str, prompt: str, steps: int, out: str, strict: bool = False) -> int:
    """One engine of a test that starts several at once: ready, then go, then logits to `out`."""
    from tests.e2e.conftest import LLAMA_KW as REFERENCE_KW
    from tests.e2e.conftest import greedy_logits, unsplit

    client = Client(socket, "e2e-worker")
    # One thread: engines started together share a small box, and llama.cpp's spinning
    # threads slow each other down many times over. The logits do not depend on it
    # (the tests compare them bit for bit with a two-thread resident run).
    llm = StreamedLlama(model, client=client, strict=strict, **{**REFERENCE_KW, "n_threads": 1})
    print("ready", flush=True)
    sys.stdin.readline()
    started_s = time.monotonic()  # CLOCK_MONOTONIC: comparable between processes on one box
    split: list[int] = []
    np.save(out, greedy_logits(llm, llm.tokenize(prompt.encode()), steps, split=split))
    ended_s = time.monotonic()
    s = llm.stream_stats()
    keys = ("decodes", "layers", "pages_maps", "pages_copies", "pages_reprotects")
    # n_batch: the asked one, or 0 where the prompt's call was split (its batches could not be held)
    n_batch = REFERENCE_KW["n_batch"] if split == unsplit(sum(split)) else 0
    print(json.dumps({"started_s": started_s, "ended_s": ended_s, "n_batch": n_batch, **{k: s[k] for k in keys}}))
    llm.close()
    client.close()
    return 0


def greedy_stream(llm: StreamedLlama, prompt: str):
    for i, tok in enumerate(llm.generate(llm.tokenize(prompt.encode()), top_k=1, temp=0.0, reset=True)):
        yield tok
        if i >= 200:
            return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
