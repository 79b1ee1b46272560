"""MiniMax-M3's sparse attention (MSA) through moed: llama.cpp runs it only with flash attention on.

The arch matrix runs every family with the e2e defaults (flash attention off), under
which llama.cpp's minimax-m3 graph takes its dense fallback and the indexers are loaded
but unused. Here the same model runs with flash attention on, so each query of the MoE
layers attends to its top-2 position blocks of 16 tokens plus the local one (the prompt
spans more blocks than that, so blocks are masked): the streamed engine at an evicting
budget must match the resident engine bit for bit. The run with flash attention on must
differ from the default one, which shows the setting reached llama.cpp (it does not by
itself show that blocks were masked; the prompt length does).
"""

from __future__ import annotations

import numpy as np
import pytest

from moed.modelgen.families import minimax_m3
from tests.e2e.conftest import LLAMA_KW, PROMPT, assert_bit_equal, greedy_logits

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")

FA_KW = {**LLAMA_KW, "flash_attn": True}


def resident(path, **kw) -> np.ndarray:
    from moed.engines.llama_cpp import UnpackedLlama

    llm = UnpackedLlama(str(path), repack="dense", **kw)
    try:
        return greedy_logits(llm, llm.tokenize(PROMPT))
    finally:
        llm.close()


def test_minimax_m3_sparse_attention_is_bit_exact_at_an_evicting_budget(start_daemon, minimax_m3_model):
    from moed.engines.llama_cpp import StreamedLlama

    want = resident(minimax_m3_model, **FA_KW)
    dense = resident(minimax_m3_model, **LLAMA_KW)
    n_prompt = want.shape[0] - 32
    assert n_prompt > (minimax_m3.INDEXER_TOP_K + minimax_m3.INDEXER_LOCAL) * minimax_m3.INDEXER_BLOCK
    assert not np.array_equal(want, dense), "flash_attn=True did not reach llama.cpp (MSA needs it)"

    daemon = start_daemon("256KiB")
    client = daemon.client("e2e")
    try:
        llm = StreamedLlama(str(minimax_m3_model), client=client, **FA_KW)
        try:
            got = greedy_logits(llm, llm.tokenize(PROMPT))
        finally:
            llm.close()
        stats = client.stats()
    finally:
        client.close()
    assert_bit_equal(got, want)
    assert stats["evictions"] > 0, "the budget did not force eviction"
