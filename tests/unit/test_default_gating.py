"""The gating a file that names none gets: the one llama.cpp's loader assumes for its family."""

from __future__ import annotations

from moed.gguf.archs import GATING_SIGMOID, GATING_SOFTMAX, gating_of


def test_glm_dsa_without_a_gating_key_is_sigmoid_as_llama_cpp_loads_it():
    # llama-model's glm-dsa loader: LLAMA_EXPERT_GATING_FUNC_TYPE_NONE -> SIGMOID
    assert gating_of({"general.architecture": "glm-dsa"}) == GATING_SIGMOID
    assert gating_of({"general.architecture": "glm-dsa", "glm-dsa.expert_gating_func": 1}) == GATING_SOFTMAX


def test_other_families_without_a_gating_key_stay_softmax():
    assert gating_of({"general.architecture": "qwen3moe"}) == GATING_SOFTMAX
    assert gating_of({"general.architecture": "deepseek2", "deepseek2.expert_gating_func": 2}) == GATING_SIGMOID
