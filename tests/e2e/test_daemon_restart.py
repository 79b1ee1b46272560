"""StreamedLlama across a daemon restart: SIGKILL mid-decode or idle, moed started again on the same socket.

What issue 46 asks and the engine promises (moed/engines/llama_cpp.py, `ensure_bound` in
moed/engines/streamer.py): the eval in flight raises `DaemonUnavailable`; the first eval
after the daemon answers again works with no user code, on the same model and KV cache,
bit-exact with stock llama.cpp; nothing of the dead daemon's tier stays mapped. Each body
runs in a fresh process (tests/forked.py), the engine in it.
"""

from __future__ import annotations

import gc
import os
import signal
import time

import numpy as np
import pytest

from moed.testing import DaemonProcess, wait_for
from tests.e2e.conftest import LLAMA_KW, assert_bit_equal

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")  # e2e needs the real llama.cpp (pyproject extra "llama")

STEPS = 8  # greedy decode steps compared with stock's (reference_logits has 32)


def moed_inodes() -> set[int]:
    """Inodes of the daemon memfds (segments, slot states, tables, hold region) this process maps."""
    with open("/proc/self/maps") as f:
        return {int(line.split()[4]) for line in f if "/memfd:moed-" in line}


def engine(daemon: DaemonProcess, path, **kw):
    from moed.engines.llama_cpp import StreamedLlama

    client = daemon.client("restart", timeout_s=10)
    return StreamedLlama(str(path), client=client, **{**LLAMA_KW, **kw}), client


def next_token(llm) -> int:
    return int(np.argmax(llm.scores[llm.n_tokens - 1]))


def killed(d: DaemonProcess) -> None:
    os.kill(d.proc.pid, signal.SIGKILL)
    wait_for(lambda: not d.running(), 10, what="the daemon to die")


def test_killed_mid_decode_the_eval_raises_and_the_first_after_the_restart_matches_stock(
    start_daemon, reference_logits, aligned_model, monkeypatch
):
    from moed.protocol.errors import DaemonUnavailable

    # Every acquire a round trip: the layer after the kill must ask the daemon (a local hit
    # reads the dead daemon's pages, still mapped and right, and could end the decode).
    monkeypatch.setenv("MOED_LOCAL_HITS", "0")
    tokens, want = reference_logits(aligned_model)
    d = start_daemon("2MiB")
    armed: list[DaemonProcess] = []

    def kill_in_layer(layer: int, _ids) -> None:
        if armed and layer > 0:  # inside the decode, after its first routed layer
            killed(armed.pop())

    llm, client = engine(d, aligned_model, route_hook=kill_in_layer)
    d2 = None
    try:
        llm.reset()
        llm.eval(tokens)
        rows = [llm.scores[: llm.n_tokens].copy()]
        for step in range(STEPS):
            tok = next_token(llm)
            if step == 3:
                estimate = llm.streamer.lookahead.cache  # what the dead daemon probably holds
                armed.append(d)
                with pytest.raises(DaemonUnavailable):
                    llm.eval([tok])
                assert not armed and llm.streamer.held is None
                d2 = DaemonProcess("2MiB", socket_dir=str(d.dir))  # as systemd restarts it
            llm.eval([tok])  # after the restart: the same token again, no user code
            rows.append(llm.scores[llm.n_tokens - 1 : llm.n_tokens].copy())
        got = np.concatenate(rows)
        assert_bit_equal(got, want[: len(got)])
        stats = llm.stream_stats()
        assert stats["rebinds"] == 1 and client.generation == 2
        assert llm.streamer.lookahead.cache is not estimate  # the new daemon holds none of it
    finally:
        llm.close()
        client.close()
        if d2 is not None:
            d2.stop()


def test_killed_while_idle_the_next_eval_runs_on_the_new_daemon_and_nothing_old_stays_mapped(
    start_daemon, reference_logits, aligned_model
):
    """Local hits and the C lane on (every layer zero copy): the engine maps the dead daemon's
    segments at its expert addresses and holds its region; the next eval must drop all of it."""
    tokens, want = reference_logits(aligned_model)
    d = start_daemon("64MiB")  # the whole model resident: the lane takes the layers in C
    llm, client = engine(d, aligned_model, prefetch="off")
    d2 = None
    try:
        llm.warm(everything=True)
        llm.reset()
        llm.eval(tokens)
        rows = [llm.scores[: llm.n_tokens].copy()]
        for _ in range(2):
            llm.eval([next_token(llm)])
            rows.append(llm.scores[llm.n_tokens - 1 : llm.n_tokens].copy())
        assert llm.stream_stats()["lane_layers"] > 0
        old = moed_inodes()
        assert old
        killed(d)
        d2 = DaemonProcess("64MiB", socket_dir=str(d.dir))
        for _ in range(STEPS - 2):
            llm.eval([next_token(llm)])  # the first of these binds the engine to the new daemon
            rows.append(llm.scores[llm.n_tokens - 1 : llm.n_tokens].copy())
        got = np.concatenate(rows)
        assert_bit_equal(got, want[: len(got)])
        assert llm.stream_stats()["rebinds"] == 1
        gc.collect()
        assert not moed_inodes() & old, "the dead daemon's tier is still mapped"
        with d2.client("check") as c:
            assert c.stats()["hits"] + c.stats()["misses"] > 0  # the new daemon served the experts
    finally:
        llm.close()
        client.close()
        if d2 is not None:
            d2.stop()


def test_a_daemon_that_never_comes_back_fails_each_eval_in_bounded_time_then_the_restart_works(
    start_daemon, reference_logits, aligned_model
):
    from moed.engines.llama_cpp import StreamedLlama
    from moed.protocol.errors import DaemonUnavailable

    tokens, want = reference_logits(aligned_model)
    d = start_daemon("2MiB")
    client = d.client("never", timeout_s=10, reconnect_s=0.5)
    llm = StreamedLlama(str(aligned_model), client=client, **LLAMA_KW)
    d2 = None
    try:
        llm.reset()
        llm.eval(tokens)
        rows = [llm.scores[: llm.n_tokens].copy()]
        killed(d)
        tok = next_token(llm)
        for _ in range(2):  # each eval waits reconnect_s for it, then says so; nothing hangs
            t0 = time.monotonic()
            with pytest.raises(DaemonUnavailable, match=r"did not answer for 0\.5 s.*the next request tries again"):
                llm.eval([tok])
            assert time.monotonic() - t0 < 5
        d2 = DaemonProcess("2MiB", socket_dir=str(d.dir))
        llm.eval([tok])
        rows.append(llm.scores[llm.n_tokens - 1 : llm.n_tokens].copy())
        got = np.concatenate(rows)
        assert_bit_equal(got, want[: len(got)])
    finally:
        llm.close()
        client.close()
        if d2 is not None:
            d2.stop()
