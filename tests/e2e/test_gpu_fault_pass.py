"""The GPU fault pass's subset CI runs (issue 47, item 5; every case: bench/gpu_faults.py).

Device-slot engines (`StreamedLlama(n_gpu_layers=-1, gpu_slots=S)`, copying and zero copy)
on lavapipe against stock `llama_cpp.Llama(n_gpu_layers=-1)`, case by case
(moed.testing.gpu_faults): each engine in a new interpreter reads its prompts in order,
each after `reset()`; a call whose experts exceed S is split for itself alone and must
equal stock fed the same sub-batches, a call S holds must equal stock's whole call at the
asked `n_batch`, and `n_batch` is the asked one after every call. A signal or an error in
an engine fails its cases by name.
"""

from __future__ import annotations

import pytest

from moed.testing import gpu_faults as gf

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("vulkan_device")]
pytest.importorskip("llama_cpp")


def check(cases: list[gf.Case], *, some_split: bool = True) -> None:
    table = "\n".join([gf.TABLE_HEAD, *(c.row() for c in cases)])
    assert all(c.ok for c in cases), table
    split = [c for c in cases if c.batches != gf.unsplit(c.length, c.config.n_batch)]
    if some_split:
        assert split, f"no call was split: the case does not reach the split path\n{table}"


@pytest.mark.parametrize("arch", gf.FAMILIES)
def test_a_family_at_twice_top_k_splits_only_the_calls_that_need_it(model_factory, start_daemon, tmp_path, arch):
    """S = 2x top-k at n_batch 8: a 1-token prompt fits, 5 and 40 tokens route to more
    experts a layer than S and are split; each equals stock on the same decodes."""
    model = model_factory(**gf.model_kwargs(arch, False))
    daemon = start_daemon(gf.COPY_BUDGET)
    config = gf.EngineSetup(arch, 2 * gf.USED, False, 8)
    check(gf.check_configs([config], str(model), daemon.socket, (1, 5, 40), tmp_path))


def test_zero_copy_at_top_k_then_a_300_token_prompt_at_the_expert_count(model_factory, start_daemon, tmp_path):
    """qwen3moe zero copy at n_batch 512: S = top-k splits a 5-token and a 40-token prompt to
    single tokens; S = the expert count holds a whole 300-token call at the asked n_batch,
    bit-exact with stock's whole call."""
    model = model_factory(**gf.model_kwargs("qwen3moe", True))
    daemon = start_daemon(gf.ZERO_COPY_BUDGET)
    top_k, every = (gf.EngineSetup("qwen3moe", s, True, 512) for s in (gf.USED, gf.EXPERTS))
    check(gf.check_configs([top_k], str(model), daemon.socket, (5, 40), tmp_path / "k"))
    whole = gf.check_configs([every], str(model), daemon.socket, (300,), tmp_path / "n")
    check(whole, some_split=False)
    assert whole[0].batches == [300], "S holds every expert: one decode at the asked n_batch"


def test_gpt_oss_300_token_prompt_split_after_failed_attempts_of_256_and_more(model_factory, start_daemon, tmp_path):
    """gpt-oss, copying slots at top-k, n_batch 512: the 300-token prompt fails whole and at
    256, 128, ... tokens before single tokens go through. The failed attempts compute on to
    their end over `skip`'s ids, whose values stay in the KV cache's freed cells; one slot for
    every id made inf there (ggml-vulkan's MUL_MAT_ID, >= 256 tokens) and NaN in 255 of the
    300 rows after. Bit-exact with stock fed the same 300 single tokens."""
    model = model_factory(**gf.model_kwargs("gpt-oss", False))
    daemon = start_daemon(gf.COPY_BUDGET)
    config = gf.EngineSetup("gpt-oss", gf.USED, False, 512)
    cases = gf.check_configs([config], str(model), daemon.socket, (300,), tmp_path)
    check(cases)
    assert cases[0].batches == [1] * 300, cases[0].row()


def test_gemma4_zero_copy_loads_with_its_routers_on_the_device(model_factory, start_daemon, tmp_path):
    """gemma4's page-aligned model, every layer offloaded: llama.cpp unmaps the pages of the
    tensors it put in the device's memory, and the router scale (`ffn_gate_inp.scale`) sits
    on such pages alone; the look-ahead read it through the mapping (SIGSEGV at load). It
    reads the routers from the file: the engine loads, splits a 5-token prompt at S = 2x
    top-k, bit-exact with stock on the same decodes."""
    model = model_factory(**gf.model_kwargs("gemma4", True))
    daemon = start_daemon(gf.ZERO_COPY_BUDGET)
    config = gf.EngineSetup("gemma4", 2 * gf.USED, True, 8)
    check(gf.check_configs([config], str(model), daemon.socket, (1, 5, 40), tmp_path))
