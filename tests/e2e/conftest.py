"""e2e fixtures: the real daemon (moed.testing.DaemonProcess) and llama.cpp reference runs."""

from __future__ import annotations

import numpy as np
import pytest

LLAMA_KW = dict(n_ctx=256, n_batch=64, n_ubatch=64, logits_all=True, n_threads=2, verbose=False, seed=0)
PROMPT = b"the expert model reads memory pages from the drive, one token at a time"


def greedy_logits(llm, tokens: list[int], steps: int = 32) -> np.ndarray:
    """Logits of every prompt position (one batch) and of `steps` greedy decode steps."""
    llm.reset()
    llm.eval(tokens)
    rows = [llm.scores[: llm.n_tokens].copy()]
    for _ in range(steps):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        rows.append(llm.scores[llm.n_tokens - 1 : llm.n_tokens].copy())
    return np.concatenate(rows)


def assert_bit_equal(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape
    differ = a.view(np.uint32) != b.view(np.uint32)
    assert not differ.any(), (
        f"{int(differ.any(axis=1).sum())} of {a.shape[0]} rows differ, max |diff| {float(np.abs(a - b).max())}"
    )


def resident_logits(path, repack: str) -> tuple[list[int], np.ndarray]:
    from moed.engines.llama_cpp import UnpackedLlama

    llm = UnpackedLlama(str(path), repack=repack, **LLAMA_KW)
    try:
        tokens = llm.tokenize(PROMPT)
        return tokens, greedy_logits(llm, tokens)
    finally:
        llm.close()


def plain_reference_logits(path) -> tuple[list[int], np.ndarray]:
    """Resident llama.cpp on the plain kernels: the reference of StreamedLlama(repack="off")."""
    return resident_logits(path, "off")


@pytest.fixture(scope="session")
def reference_logits(llama_cpp):
    """`reference_logits(path)`: resident llama.cpp on the same kernels as StreamedLlama's
    default on a plain file (dense weights on CPU_REPACK as stock puts them, experts
    plain: UnpackedLlama(repack="dense")), cached per model."""
    cache: dict[str, tuple[list[int], np.ndarray]] = {}

    def get(path) -> tuple[list[int], np.ndarray]:
        key = str(path)
        if key not in cache:
            cache[key] = resident_logits(key, "dense")
        return cache[key]

    return get
