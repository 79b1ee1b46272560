"""Engines on one daemon share the cores (moed.daemon.turns, moed.engines.turns): two engines
created without thread counts each compute with half of them, one alone with every one, a
count the user gave stays the user's, and the logits stay stock's bit for bit."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.e2e.conftest import LLAMA_KW, assert_bit_equal, greedy_steps

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")  # e2e needs the real llama.cpp (pyproject extra "llama")

CORES = len(os.sched_getaffinity(0))  # this host's, as the engines see it
AUTO_KW = {k: v for k, v in LLAMA_KW.items() if k != "n_threads"}  # no thread count: the daemon's


def run_in_turn(llms: list, tokens: list[int]) -> list[np.ndarray]:
    """Each engine's greedy logits, one eval of each in turn (so both stay active)."""
    got: list[list] = [[] for _ in llms]
    runs = [greedy_steps(llm, tokens, rows) for llm, rows in zip(llms, got)]
    while runs:
        runs = [r for r in runs if next(r, StopIteration) is not StopIteration]
    return [np.concatenate(rows) for rows in got]


def test_two_engines_split_the_cores_and_one_alone_takes_them_all(start_daemon, reference_logits, tiny_model):
    from moed.engines.llama_cpp import StreamedLlama

    tokens, want = reference_logits(tiny_model)
    daemon = start_daemon("64MiB")
    clients = [daemon.client(f"e2e-threads-{i}") for i in range(2)]
    llms = []
    try:
        llms = [StreamedLlama(str(tiny_model), client=c, **AUTO_KW) for c in clients]
        for got in run_in_turn(llms, tokens):
            assert_bit_equal(got, want)
        half = max(1, CORES // 2)
        for llm in llms:
            assert (llm.n_threads, llm.n_threads_batch) == (half, half)
            assert (llm.context_params.n_threads, llm.context_params.n_threads_batch) == (half, half)
            assert llm.stream_stats()["turns"] > 0 and llm.stream_stats()["threads_auto"]
        rows = {e["name"]: e for e in clients[0].stats()["engines"]}
        assert {rows[f"e2e-threads-{i}"]["threads"] for i in range(2)} == {half}

        llms.pop().close()
        clients.pop().close()  # its connection closes: it no longer counts
        (got,) = run_in_turn(llms, tokens)
        assert_bit_equal(got, want)
        assert (llms[0].n_threads, llms[0].n_threads_batch) == (CORES, CORES)
    finally:
        for llm in llms:
            llm.close()
        for c in clients:
            c.close()


def test_a_count_the_user_gave_stays_theirs(start_daemon, reference_logits, tiny_model):
    from moed.engines.llama_cpp import StreamedLlama

    tokens, want = reference_logits(tiny_model)
    daemon = start_daemon("64MiB")
    with daemon.client("e2e-mine") as c:
        llm = StreamedLlama(str(tiny_model), client=c, **{**AUTO_KW, "n_threads": 1, "n_threads_batch": 3})
        try:
            (got,) = run_in_turn([llm], tokens)
            assert (llm.n_threads, llm.n_threads_batch) == (1, 3)
            assert_bit_equal(got, want)
            (row,) = [e for e in c.stats()["engines"] if e["name"] == "e2e-mine"]
            assert (row["threads"], row["threads_batch"], row["auto"]) == (1, 3, False)
        finally:
            llm.close()
