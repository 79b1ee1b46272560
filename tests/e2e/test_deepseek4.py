"""DeepSeek V4's hash-routed layers through the real daemon and llama.cpp.

The first `hash_layer_count` layers select their experts by token id (`ffn_gate_tid2eid`),
not with the router; llama.cpp still names the gather `ffn_moe_topk-L`, where moed serves
them. These tests check that moed serves exactly those experts (the logits are bit-exact
at an evicting budget) and that the predictor's `token_experts` is llama.cpp's choice,
row for row, from the token ids alone.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.e2e.conftest import LLAMA_KW, PROMPT, assert_bit_equal

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")  # e2e needs the real llama.cpp (pyproject extra "llama")

LLAMA_TOP_K = 2  # make_model's `used`


class Routes:
    """Every routed layer's ids, in decode order."""

    def __init__(self):
        self.ids: dict[int, list[np.ndarray]] = {}

    def route(self, layer: int, ids: np.ndarray) -> None:
        self.ids.setdefault(layer, []).append(ids.copy())

    def decoded(self) -> None:
        pass


def greedy_fed(llm, tokens: list[int], steps: int = 32) -> tuple[np.ndarray, list[int]]:
    """tests.e2e.conftest.greedy_logits, also returning every token fed, in order."""
    llm.reset()
    llm.eval(tokens)
    fed, rows = list(tokens), [llm.scores[: llm.n_tokens].copy()]
    for _ in range(steps):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        fed.append(nxt)
        llm.eval([nxt])
        rows.append(llm.scores[llm.n_tokens - 1 : llm.n_tokens].copy())
    return np.concatenate(rows), fed


def test_hash_layers_route_by_token_id_and_stream_bit_exact(start_daemon, reference_logits, deepseek4_model):
    from moed.engines.llama_cpp import StreamedLlama
    from moed.modelgen.families.deepseek4 import HASH_LAYERS

    _, want = reference_logits(deepseek4_model)
    client = start_daemon("256KiB").client("e2e")
    llm = StreamedLlama(str(deepseek4_model), client=client, prefetch="off", **LLAMA_KW)
    try:
        routes = Routes()
        llm.streamer.observers.append(routes)
        got, fed = greedy_fed(llm, llm.tokenize(PROMPT))
        predictor = llm.streamer.lookahead.predictor
        moe_layers = list(llm.streamer.source.moe_layers)
        daemon_stats = client.stats()
    finally:
        llm.close()
        client.close()
    assert_bit_equal(got, want)
    assert daemon_stats["evictions"] > 0, "the budget did not force eviction"
    assert predictor.hashed == frozenset(range(HASH_LAYERS)) and set(moe_layers) > predictor.hashed
    for layer in moe_layers:
        ids = np.concatenate(routes.ids[layer])
        assert ids.shape == (len(fed), LLAMA_TOP_K)  # every row is an output (logits_all): none dropped
        if layer in predictor.hashed:  # the token's table row, exactly and in order
            np.testing.assert_array_equal(ids, predictor.token_experts(layer, fed))
        else:  # the router chose: the table of layer 0 does not say it
            assert not np.array_equal(ids, predictor.token_experts(0, fed))
    with pytest.raises(ValueError, match="token id"):
        predictor.scores(np.zeros((1, predictor.routers[0].weight.shape[1]), np.float32), 0, 0)


def test_hash_layers_are_prefetched_exactly_from_the_batch_token_ids(start_daemon, deepseek4_model):
    """Their experts are known before the graph runs: sent at the start of every decode,
    each one then routed (issued == hits), so the layer never waits for a read it could
    have started earlier."""
    from moed.engines.llama_cpp import StreamedLlama

    client = start_daemon("256KiB").client("e2e")
    llm = StreamedLlama(str(deepseek4_model), client=client, prefetch="gate", **LLAMA_KW)
    try:
        greedy_fed(llm, llm.tokenize(PROMPT), steps=8)
        stats = llm.stream_stats()
        hashed = llm.streamer.lookahead.predictor.hashed
    finally:
        llm.close()
        client.close()
    for layer in hashed:
        look = stats["per_layer"][layer]
        assert look["issued"] > 0 and look["hits"] == look["issued"] and look["wasted"] == 0, look


def test_substitution_leaves_the_hash_layers_as_the_table_chose(start_daemon, deepseek4_model):
    """Substitution rewrites a router's choice; a hash layer's experts are the token's table
    row, with no ranking to choose stand-ins from: they are served as chosen, and the
    routed layers after them are substituted as usual."""
    from moed.engines.llama_cpp import StreamedLlama

    client = start_daemon("256KiB").client("e2e")
    llm = StreamedLlama(str(deepseek4_model), client=client, prefetch="off", subst=1e-6, **LLAMA_KW)
    try:
        routes = Routes()
        llm.streamer.observers.append(routes)
        _, fed = greedy_fed(llm, llm.tokenize(PROMPT), steps=8)
        predictor = llm.streamer.lookahead.predictor
        stats = llm.stream_stats()
    finally:
        llm.close()
        client.close()
    for layer in predictor.hashed:
        np.testing.assert_array_equal(np.concatenate(routes.ids[layer]), predictor.token_experts(layer, fed))
    assert stats["subst_per_token"] > 0  # the routed layers were substituted (r = 1e-6: nearly any resident expert)
