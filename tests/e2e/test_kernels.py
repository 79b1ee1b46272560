"""ggml's repacked layouts as moed uses them: one expert's repacked bytes are its own range.

`moectl align --repack` repacks expert by expert, and the engine serves expert `e`
at `e * nb[2]`: both hold only if ggml's repack of a whole [ne0, ne1, n_expert]
tensor is the concatenation of its per-expert repacks. Checked here for every type
this CPU's llama.cpp repacks (skipped, with the reason, for those it does not).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")

# (ggml type, block values, block bytes)
TYPES = {
    "Q4_0": (2, 32, 18),
    "Q4_K": (12, 256, 144),
    "Q2_K": (10, 256, 84),
    "IQ4_NL": (20, 32, 18),
    "MXFP4": (39, 32, 17),
}


@pytest.mark.parametrize("name", list(TYPES))
def test_an_experts_repacked_bytes_are_its_own_range(name):
    from moed.engines import kernels
    from moed.engines.ggml_api import api

    ggml_type, per_block, block_bytes = TYPES[name]
    ne0, ne1, n_expert = 512, 64, 4
    layout = kernels.layout_of(ggml_type, (ne0, ne1))
    if layout == kernels.PLAIN:
        pytest.skip(f"this CPU's llama.cpp does not repack {name} ({kernels.cpu_backend().features()})")
    one = ne0 * ne1 // per_block * block_bytes
    plain = np.random.default_rng(ggml_type).integers(0, 256, one * n_expert, dtype=np.uint8).tobytes()
    whole = kernels._Context([(ggml_type, (ne0, ne1, n_expert))])
    try:
        api().ggml_backend_tensor_set(whole.tensors[0], plain, 0, len(plain))
        want = ctypes.string_at(whole.view(0).data, len(plain))
    finally:
        whole.close()
    rp = kernels.Repacker(ggml_type, ne0, ne1)
    try:
        got = b"".join(rp(plain[e * one : (e + 1) * one]) for e in range(n_expert))
    finally:
        rp.close()
    assert got == want
    assert got != plain  # it is a different layout, not a copy
    assert rp.layout == layout and layout.startswith(name.lower()[:2])


def test_layout_of_is_plain_for_types_nothing_repacks():
    from moed.engines import kernels

    assert kernels.layout_of(0, (512, 64)) == kernels.PLAIN  # F32
    assert kernels.layout_of(1, (512, 64)) == kernels.PLAIN  # F16
    assert kernels.layout_of(kernels.Q4_0, (512, 63)) == kernels.PLAIN  # rows not a multiple of 4 or 8
