"""The committed tiny trained MoE through llama.cpp: its tokenizer is the one trained on,
its held-out perplexity is far below a random model's, and it writes Python-looking text."""

from __future__ import annotations

import re

import numpy as np
import pytest

from moed.modelgen import tinydata

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")  # e2e needs the real llama.cpp (pyproject extra "llama")

WINDOWS = 8
DEF_SIGNATURE = re.compile(rb"[A-Za-z_][A-Za-z0-9_]*\([^\n]*\):\n    \S")


@pytest.fixture(scope="module")
def heldout():
    _, test_ids, info = tinydata.corpus()
    assert info["heldout_files"] > 10 and info["train_files"] > 10 * info["heldout_files"]
    return test_ids


def test_llama_cpp_tokenizes_source_into_the_trained_byte_ids(llama_cpp, trained_model, heldout):
    llm = llama_cpp.Llama(str(trained_model), vocab_only=True, verbose=False)
    try:
        samples = [tinydata.decode(w) for w in tinydata.eval_windows(heldout, 512, 6, seed=3)]
        samples.append("caf\u00e9 = '\u2603'\t\n    x  =  1\n".encode())  # UTF-8, tabs, runs of spaces
        for s in samples:
            ids = llm.tokenize(s, add_bos=False, special=False)
            assert ids == tinydata.encode(s).tolist()
            assert llm.detokenize(ids) == s
        assert llm.tokenize(b"x", add_bos=True)[0] == tinydata.BOS
    finally:
        llm.close()


def test_heldout_perplexity_through_llama_cpp_is_far_below_uniform(llama_cpp, trained_model, heldout):
    ctx = 128
    llm = llama_cpp.Llama(
        str(trained_model), n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, logits_all=True, n_threads=2, verbose=False, seed=0
    )
    nll = []
    try:
        for win in tinydata.eval_windows(heldout, ctx, WINDOWS, seed=4):
            llm.reset()
            llm.eval([int(t) for t in win[:-1]])
            logits = np.asarray(llm.scores[: ctx - 1], np.float64)
            logits -= logits.max(1, keepdims=True)
            logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
            nll.append(-logp[np.arange(ctx - 1), win[1:]].mean())
    finally:
        llm.close()
    ppl = float(np.exp(np.mean(nll)))
    assert ppl < 6.0, f"held-out perplexity {ppl:.2f} per byte (uniform is {tinydata.VOCAB})"


def test_sampled_text_looks_like_python(llama_cpp, trained_model):
    # Greedy decoding of a tiny byte model loops ("the string the string"); the demo samples.
    llm = llama_cpp.Llama(str(trained_model), n_ctx=128, n_threads=2, verbose=False, seed=0)
    texts = []
    try:
        for seed in (1, 2, 3):
            out = llm.create_completion("import os\n\n\ndef ", max_tokens=100, temperature=0.6, seed=seed)
            texts.append(out["choices"][0]["text"].encode())
    finally:
        llm.close()
    for text in texts:
        assert all(b == 0x0A or 0x20 <= b < 0x7F for b in text), text
    # "def " continues as a signature with an indented body: NAME(ARGS):\n    ...
    assert sum(DEF_SIGNATURE.match(t) is not None for t in texts) >= 2, texts


def test_the_demo_runs_the_trained_model_by_default(llama_cpp):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "moed.demo"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "moed tiny-stdlib-moe" in r.stdout and "tiny-stdlib-moe.gguf" in r.stdout
    assert "moed stopped (exit 0)" in r.stdout
    assert "self" in r.stdout or "return" in r.stdout  # the engines' generated Python
    # Both engines (the second as nobody, where root can) load a skeleton, none the whole file.
    assert "no skeleton" not in r.stderr, r.stderr[-2000:]
