"""Whole steps: with every expert pinned, a decode runs with no per-layer stop, bit for bit.

The engine takes its connection's pin hold instead of per-layer holds
(moed.protocol.residency_words), so ggml computes each graph in one piece as stock
llama.cpp does with no callback. An unpin waits while a step holds the model, and
once it is done the engine goes back to stopping at each layer.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from moed.protocol import messages as m
from moed.testing import wait_for
from tests.e2e.conftest import LLAMA_KW, PROMPT, assert_bit_equal, greedy_logits

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")


def _engine(daemon, path, **kw):
    from moed.engines.llama_cpp import StreamedLlama

    client = daemon.client("e2e")
    return StreamedLlama(str(path), client=client, **{**LLAMA_KW, **kw}), client


@pytest.mark.parametrize("prefetch", ["off", "gate"])
def test_every_expert_pinned_decodes_with_no_stop_bit_exact(start_daemon, reference_logits, aligned_model, prefetch):
    _, want = reference_logits(aligned_model)
    d = start_daemon("16MiB", "--pin-budget", "64MiB")  # the mirror pins the model whole at open
    llm, client = _engine(d, aligned_model, prefetch=prefetch)
    try:
        handle = llm.streamer.source.model
        wait_for(handle.all_pinned, what="the pin word to say every expert is pinned")
        got = greedy_logits(llm, llm.tokenize(PROMPT))
        assert_bit_equal(got, want)
        s = llm.stream_stats()
        n_prompt, batch = len(llm.tokenize(PROMPT)), LLAMA_KW["n_batch"]
        batches = [min(batch, n_prompt - i) for i in range(0, n_prompt, batch)] + [1] * 32
        assert s["decodes"] == len(batches) and s["whole_decodes"] == s["decodes"], s
        assert s["layers"] == 0 and s["lane_layers"] == 0  # no layer stopped for its experts
        # Each step's uses are counted as the model's local hits, as the lane counts a layer's
        # distinct experts: k a token (exact for one-token steps), at most all of them.
        src = llm.streamer.source
        k, n_layers = src.n_expert_used, len(src.moe_layers)
        want_hits = sum(n_layers * min(n * k, src.n_experts) for n in batches)
        client.close()  # the region's counters are folded when its connection closes
        with d.client("probe") as c:
            assert c.stats()["local_hits"] == want_hits
    finally:
        llm.close()
        client.close()


def test_an_unpin_waits_for_the_step_that_holds_the_model(start_daemon, reference_logits, aligned_model):
    """A step holds the pin hold (taken here as a decode takes it): the operator's unpin
    leaves every expert pinned until the hold is let go, then goes ahead; the engine's
    next steps stop per layer again, still bit for bit."""
    _, want = reference_logits(aligned_model)
    d = start_daemon("64MiB", "--pin-budget", "64MiB")
    llm, client = _engine(d, aligned_model, prefetch="off")
    try:
        src, holds = llm.streamer.source, llm.streamer.holds
        handle = src.model
        total = len(src.moe_layers) * src.n_experts
        wait_for(handle.all_pinned, what="every expert pinned")
        with d.client("probe") as c:
            assert c.stats()["models"][0]["all_pinned"] is True
        assert holds is not None and holds.whole_begin()  # a step under way
        with d.client("operator") as op:
            mine = op.open_model(str(aligned_model))
            assert op.request(m.Unpin(mine.model_id, all=True)).unpinned == total
            assert not handle.all_pinned()  # no new whole step from now on
            s = op.stats()
            assert s["pinned_experts"] == s["unpins_held"] == total  # waiting on the step's hold
            assert s["models"][0]["all_pinned"] is False
            holds.whole_end(0)
            wait_for(lambda: op.stats()["pinned_experts"] == 0, what="the unpin once the step let go")
            assert op.stats()["unpins_held"] == 0
        got = greedy_logits(llm, llm.tokenize(PROMPT))
        assert_bit_equal(got, want)
        s = llm.stream_stats()
        # the holds count whole steps: the one taken here by hand, none by the decodes
        assert s["whole_decodes"] == 1 and s["lane_layers"] > 0
    finally:
        llm.close()
        client.close()


def test_the_daemon_shows_what_each_engine_computes_where(start_daemon, aligned_model):
    """`moectl stats` lists the connected engines: whose, which model, what computes where."""
    d = start_daemon("16MiB")
    llm, client = _engine(d, aligned_model, prefetch="off")
    try:
        mid = llm.streamer.source.model.model_id
        with d.client("probe") as c:
            rows = [r for r in c.stats()["clients"] if r["engines"]]
        assert [(r["pid"], [tuple(e) for e in r["engines"]]) for r in rows] == [
            (os.getpid(), [(mid, "experts and dense layers on the CPU")])
        ]
        out = subprocess.run(
            [sys.executable, "-m", "moed.ctl", "--socket", d.socket, "stats"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and "engines" in out.stdout and "dense layers on the" in out.stdout, out.stdout
    finally:
        llm.close()
        client.close()
