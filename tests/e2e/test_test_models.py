"""The test-model generator's every flavour loads and runs in llama.cpp."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")  # e2e needs the real llama.cpp (pyproject extra "llama")


def test_llama_cpp_loads_and_runs(llama_cpp, tiny_model, split_model, aligned_model, mixed_model, model_factory):
    """Every flavour loads in llama.cpp and gives finite logits; split == unsplit bit for bit."""
    q4k = model_factory(embd=256, ff=256, quant="q4_k", layers=2)
    fast = model_factory(embd=256, ff=256, layer_quants="q4_k,q4_0,q8_0", layers=3, random_experts=True)
    q4km = model_factory(embd=256, ff=256, recipe="q4_k_m")
    q4km_random = model_factory(embd=256, ff=256, recipe="q4_k_m", random_experts=True)
    gpt_oss, gpt_oss_random = model_factory(arch="gpt-oss"), model_factory(arch="gpt-oss", random_experts=True)
    glm4moe = model_factory(arch="glm4moe")
    logits = {}
    for name, path in [
        ("tiny", tiny_model),
        ("split", split_model),
        ("aligned", aligned_model),
        ("mixed", mixed_model),
        ("q4k", q4k),
        ("random", fast),
        ("q4_k_m", q4km),
        ("q4_k_m random", q4km_random),
        ("gpt-oss", gpt_oss),  # MXFP4 experts with biases, attention sinks, sliding-window layers
        ("gpt-oss random", gpt_oss_random),
        ("glm4moe", glm4moe),  # a leading dense layer, partial rope, q/k norms, shared expert
    ]:
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=1, logits_all=True, verbose=False)
        tokens = llm.tokenize("Hello, wörld! the expert 42".encode())
        assert tokens[0] == 1 and len(tokens) > 10
        llm.eval(tokens)
        scores = np.array(llm.scores[: len(tokens)])
        assert np.isfinite(scores).all() and scores.std() > 0.1, name
        logits[name] = scores
        text = llm.create_completion("the", max_tokens=4, temperature=0)["choices"][0]["text"]
        assert isinstance(text, str)
        del llm
    np.testing.assert_array_equal(logits["tiny"], logits["split"])
