"""The predictor's own RMS norm of a residual node: gemma4's (with 1/sqrt(n_embd)) and llama4's (without)."""

from __future__ import annotations

import numpy as np

from moed.engines.predictor import router_rms_input
from moed.gguf.archs import arch_of


def _reference(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + eps) * w


def test_llama4_norm_is_rms_norm_times_the_ffn_norm_weight():
    rng = np.random.default_rng(0)
    x = (3.0 * rng.standard_normal((5, 64))).astype(np.float32)
    w = (1.0 + 0.1 * rng.standard_normal(64)).astype(np.float32)
    got = router_rms_input(x, w, 1e-6, sqrt_n=False)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, _reference(x, w, 1e-6), rtol=1e-5, atol=1e-6)
    gemma = router_rms_input(x, w, 1e-6)  # gemma4's: the same rows divided by sqrt(n_embd)
    np.testing.assert_allclose(gemma * np.sqrt(64.0), got, rtol=1e-5, atol=1e-6)


def test_only_llama4_rebuilds_its_ffn_norm_from_the_residual():
    assert arch_of("llama4").rms_node and arch_of("llama4").router_input.node == "ffn_inp"
    assert not any(arch_of(a).rms_node for a in ("dots1", "ernie4_5-moe", "hunyuan-moe", "bailingmoe2", "minimax-m2"))
