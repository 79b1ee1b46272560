"""moectl align through llama.cpp: a realigned copy (whole or split) gives identical logits."""

from __future__ import annotations

import numpy as np
import pytest

from moed.gguf.align import align_gguf

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")  # e2e needs the real llama.cpp (pyproject extra "llama")


def test_aligned_copy_gives_identical_logits(llama_cpp, model_factory, split_model, tmp_path):
    src = model_factory(embd=256, ff=256, layers=2)
    out = tmp_path / "aligned.gguf"
    align_gguf(src, out)
    split_out = align_gguf(split_model, tmp_path / "split.gguf")[0]

    def logits(path):
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=1, logits_all=True, verbose=False)
        tokens = llm.tokenize(b"the page-aligned expert model")
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)])

    np.testing.assert_array_equal(logits(src), logits(out))
    np.testing.assert_array_equal(logits(split_model), logits(split_out))
