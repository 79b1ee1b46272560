"""Substitution against the real daemon and llama.cpp: exact when it never fires, and when it
does, a rewrite that a resident engine replaying it reproduces bit for bit."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.e2e.conftest import LLAMA_KW, PROMPT, assert_bit_equal, greedy_logits, unsplit

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")  # e2e needs the real llama.cpp (pyproject extra "llama")

# 32 experts, top-4: the router's next 4 choices are real candidates. At 768 KiB the
# daemon holds about one layer's experts (a whole prompt batch fits one acquire), so
# layers evict each other and most choices are missing when routed.
MODEL = dict(experts=32, used=4)
BUDGET = "768KiB"
GPT_OSS_BUDGET = "384KiB"  # its MXFP4 parts are one page each: 12 KiB slots, 32 of them


@pytest.fixture(scope="module")
def subst_model(model_factory):
    return model_factory(**MODEL)


@pytest.fixture(scope="module")
def gpt_oss_subst_model(model_factory):
    return model_factory(arch="gpt-oss", **MODEL)  # SOFTMAX_WEIGHT: ffn_moe_probs holds logits


def streamed(daemon, path, **kw):
    from moed.engines.llama_cpp import StreamedLlama

    client = daemon.client("e2e")
    return StreamedLlama(str(path), client=client, prefetch="off", **{**LLAMA_KW, **kw}), client


class ResidencySpy:
    """Keeps every residency read the engine makes (the real table, passed through)."""

    def __init__(self, source):
        self.real = source.resident
        self.reads: list[tuple[int, np.ndarray]] = []
        source.resident = self

    def __call__(self, layer, experts):
        got = self.real(layer, experts)
        self.reads.append((layer, np.asarray(got).copy()))
        return got


class Replay:
    """A resident engine's eval callback that applies the streamed run's rewrites.

    At each `ffn_moe_topk-L` it checks the rewrite against the router's own arrays
    (the missing id is the one there, the stand-in is among the next k, its
    probability passes r), writes it, and at `ffn_moe_weights-L` checks that the
    gathered weight of every slot is the probability of the id now in it. With
    `softmax_weight` (gpt-oss) the arrays hold logits: r is checked on their softmax,
    and the gathered weights are the chosen ids' logits (llama.cpp's softmax over
    those k comes after, in `ffn_moe_weights_softmax-L`).
    """

    def __init__(self, rewrites, r: float, k: int, softmax_weight: bool = False):
        import llama_cpp

        self.rewrites = list(rewrites)
        self.r, self.k = r, k
        self.softmax_weight = softmax_weight
        self.fn = llama_cpp.ggml_backend_sched_eval_callback(self._cb)
        self.c_callback = self
        self.errors: list[str] = []
        self.pending: tuple[int, np.ndarray, np.ndarray] | None = None
        self.weights_checked = 0
        self.standin_weights_checked = 0

    def install(self, params) -> None:
        params.cb_eval = self.fn
        params.cb_eval_user_data = None

    def _cb(self, tensor, ask, _ud) -> bool:
        from moed.engines import ggml_tensor

        name = ggml_tensor.name(tensor)
        m = re.fullmatch(rb"ffn_moe_(topk|weights)-(\d+)", name)
        if ask or m is None:
            return m is not None
        try:
            layer = int(m.group(2))
            if m.group(1) == b"topk":
                self._topk(layer, tensor)
            else:
                self._weights(layer, tensor)
        except Exception as exc:  # noqa: BLE001 - must not unwind through C
            self.errors.append(repr(exc))
            return False
        return True

    def _topk(self, layer, tensor) -> None:
        from moed.engines import ggml_tensor

        rec = self.rewrites.pop(0)
        from moed.engines.predictor import GATING_SOFTMAX, gate

        ids = ggml_tensor.topk_view(tensor)
        ranked, raw, _ = ggml_tensor.router_arrays(tensor)
        probs = gate(raw, GATING_SOFTMAX) if self.softmax_weight else raw
        assert rec.layer == layer and rec.n_tokens == ids.shape[0], "the two runs route different graphs"
        for s in rec.swaps:
            assert ids[s.token, s.slot] == s.missing
            assert s.standin in ranked[s.token, self.k : 2 * self.k], "a stand-in outside the router's next k"
            assert s.p_standin == probs[s.token, s.standin] and s.p_missing == probs[s.token, s.missing]
            assert probs[s.token, s.standin] >= self.r * probs[s.token, s.missing]
            ids[s.token, s.slot] = s.standin
        for row in ids:
            assert len(set(row.tolist())) == len(row), f"an expert twice in one token: {row}"
        self.pending = (layer, ids.copy(), raw.copy())

    def _weights(self, layer, tensor) -> None:
        from moed.engines import ggml_tensor

        assert self.pending is not None and self.pending[0] == layer
        _, ids, raw = self.pending
        w = ggml_tensor.matrix(tensor)  # (n_tokens, k)
        want = raw[np.arange(ids.shape[0])[:, None], ids]
        assert w.shape == want.shape
        assert (w.view(np.uint32) == want.view(np.uint32)).all(), "a weight is not its expert's probability"
        self.weights_checked += w.size
        self.pending = None


def test_r_above_one_never_substitutes_and_is_bit_exact(start_daemon, reference_logits, subst_model):
    _, want = reference_logits(subst_model)
    llm, client = streamed(start_daemon(BUDGET), subst_model, subst=1.01)
    try:
        got = greedy_logits(llm, llm.tokenize(PROMPT))
        st = llm.stream_stats()
        daemon_stats = client.stats()
    finally:
        llm.close()
        client.close()
    assert_bit_equal(got, want)
    assert daemon_stats["evictions"] > 0
    assert st["subst_missing"] > 0, "no missing expert: the test would not test anything"
    assert st["subst_substitutions"] == 0 and st["subst_reads_avoided"] == 0 and st["subst_weight_share"] == 0


@pytest.mark.parametrize(
    "model, budget, rule",
    [
        ("subst_model", BUDGET, "plain"),
        ("subst_model", BUDGET, "cooc"),
        ("gpt_oss_subst_model", GPT_OSS_BUDGET, "plain"),  # r on the softmax of the logits
    ],
)
def test_substitutes_are_resident_next_k_and_a_resident_replay_is_bit_exact(request, start_daemon, model, budget, rule):
    from llama_cpp import Llama

    from moed.engines.llama_cpp import _constructing, _unpacked_internals

    subst_model = request.getfixturevalue(model)
    r = 0.5
    llm, client = streamed(start_daemon(budget), subst_model, subst=r, subst_rule=rule)
    try:
        sub = llm.streamer.substituter
        sub.log = []
        spy = ResidencySpy(llm.streamer.source)
        split: list[int] = []
        got = greedy_logits(llm, llm.tokenize(PROMPT), split=split)
        st = llm.stream_stats()
        assert split == unsplit(sum(split))  # no split prompt: one record per graph layer
        k = llm.streamer.source.n_expert_used
        softmax_weight = llm.streamer.probs_are_logits
    finally:
        llm.close()
        client.close()
    log = sub.log
    swaps = [(rec, s) for rec in log for s in rec.swaps]
    assert len(swaps) > 5, f"only {len(swaps)} substitutions: the budget does not force any"
    assert st["subst_substitutions"] == len(swaps)
    assert 0 < st["subst_reads_avoided"] <= st["subst_reads_needed"]
    assert 0 < st["subst_weight_share"] < 1
    assert st["subst_per_token"] == pytest.approx(len(swaps) / st["tokens"])
    # Resident when chosen: the read the choice was made from is the table's, as the spy saw it.
    assert len(spy.reads) == len(log)
    for (layer, read), rec in zip(spy.reads, log):
        assert layer == rec.layer and np.array_equal(read, rec.resident)
        for s in rec.swaps:
            assert read[s.standin] and not read[s.missing]
            assert k <= s.rank < 2 * k

    assert softmax_weight == (model == "gpt_oss_subst_model")
    replay = Replay(log, r, k, softmax_weight)
    with _constructing(_unpacked_internals(replay)):  # type: ignore[arg-type]  # a callback with install()
        ref = Llama(model_path=str(subst_model), **LLAMA_KW)
    try:
        want = greedy_logits(ref, ref.tokenize(PROMPT))
    finally:
        ref.close()
    assert not replay.errors, replay.errors[:3]
    assert not replay.rewrites, "the resident run routed fewer layers than the streamed one"
    assert replay.weights_checked >= sum(rec.n_tokens for rec in log) * k
    assert_bit_equal(got, want)


def moectl(socket: str, *args: str):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "moed.ctl", "--socket", socket, *args], capture_output=True, text=True, timeout=180
    )


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "texts.txt"
    path.write_text(PROMPT.decode() + "\n\nhello world and again the model reads pages\n")
    return path


def test_moectl_kl_of_the_exact_run_against_itself_is_zero(start_daemon, subst_model, prompt_file):
    import json

    d = start_daemon(BUDGET)
    base = ["kl", str(subst_model), "--prompt-file", str(prompt_file), "--ctx", "256", "--batch", "64", "--json"]
    r = moectl(d.socket, *base)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["positions"] > 20
    assert got["mean_kl"] == 0 and got["p99_kl"] == 0 and got["max_kl"] == 0
    assert got["same_top_pct"] == 100 and got["ppl_exact"] == got["ppl_approx"]
    # The same tool prices substitution: a private daemon at a budget that forces misses.
    r = moectl(d.socket, *base, "--subst", "0.1", "--budget", "50%")
    assert r.returncode == 0, r.stderr
    sub = json.loads(r.stdout)
    assert sub["positions"] == got["positions"] and sub["ppl_exact"] == got["ppl_exact"]
    assert sub["approx_stats"]["subst_substitutions"] > 0
    assert sub["mean_kl"] > 0 and sub["max_kl"] >= sub["p99_kl"]


def test_generate_subst_flag_reports_its_counters(start_daemon, subst_model):
    d = start_daemon(BUDGET)
    r = moectl(
        d.socket, "generate", str(subst_model), "--prompt", "hello world", "-n", "12", "--ctx", "256", "--subst", "0.5"
    )
    assert r.returncode == 0, r.stderr
    assert "subst r=0.5 (plain):" in r.stderr and "reads avoided" in r.stderr
