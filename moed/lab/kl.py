"""What an approximation costs in quality: KL divergence of its next-token distributions
from the exact run's, as `llama-perplexity --kl-divergence` reports it.

What this module owns: running texts through two engines teacher-forced (both see
the same tokens, so every position compares like with like), and the figures:
mean and p99 KL(exact || approx) per position, the share of positions whose top
token is the same, and the perplexity of each on the texts' own next tokens.

The exact run is resident llama.cpp with the streamer's kernels (`UnpackedLlama`;
streamed with no output-changing option equals it bit for bit), so any option
that changes outputs is priced against the same baseline: the approximate engine
is built from keyword options (`subst=...` first). Against itself every figure
is exact: KL 0, top-1 100%, equal perplexities.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

PROBS_FLOOR = 1e-30


@dataclass
class KLReport:
    positions: int
    mean_kl: float
    p99_kl: float
    max_kl: float
    same_top_pct: float
    ppl_exact: float
    ppl_approx: float
    approx_stats: dict | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        return (
            f"{self.positions} positions: mean KL {self.mean_kl:.6f}, p99 KL {self.p99_kl:.6f}, "
            f"same top token {self.same_top_pct:.2f}%, perplexity exact {self.ppl_exact:.4f} / "
            f"approx {self.ppl_approx:.4f}"
        )


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@dataclass
class Scored:
    """Per position (predicting token i+1 from tokens 0..i): both runs' figures."""

    kl: np.ndarray
    same_top: np.ndarray
    nll_exact: np.ndarray
    nll_approx: np.ndarray


def score(exact: np.ndarray, approx: np.ndarray, tokens: Sequence[int]) -> Scored:
    """`exact`, `approx`: (n_tokens, n_vocab) logits of one text; positions 0..n-2 are scored."""
    if exact.shape != approx.shape or exact.shape[0] != len(tokens):
        raise ValueError(f"logits {exact.shape} / {approx.shape} for {len(tokens)} tokens")
    n = len(tokens) - 1
    lp, lq = log_softmax(exact[:n]), log_softmax(approx[:n])
    kl = (np.exp(lp) * (lp - lq)).sum(axis=1)
    kl = np.maximum(kl, 0.0)  # rounding can leave -1e-17 for equal distributions
    nxt = np.asarray(tokens[1:], dtype=np.int64)
    rows = np.arange(n)
    same = exact[:n].argmax(axis=1) == approx[:n].argmax(axis=1)
    return Scored(kl, same, -lp[rows, nxt], -lq[rows, nxt])


def summarize(parts: Iterable[Scored], approx_stats: dict | None = None) -> KLReport:
    parts = list(parts)
    if not parts or not sum(len(p.kl) for p in parts):
        raise ValueError("no positions to score (every text shorter than two tokens)")
    kl = np.concatenate([p.kl for p in parts])
    same = np.concatenate([p.same_top for p in parts])
    ne = np.concatenate([p.nll_exact for p in parts])
    na = np.concatenate([p.nll_approx for p in parts])
    return KLReport(
        positions=len(kl),
        mean_kl=float(kl.mean()),
        p99_kl=float(np.percentile(kl, 99)),
        max_kl=float(kl.max()),
        same_top_pct=100.0 * float(same.mean()),
        ppl_exact=float(np.exp(ne.mean())),
        ppl_approx=float(np.exp(na.mean())),
        approx_stats=approx_stats,
    )


def text_logits(llm, tokens: Sequence[int]) -> np.ndarray:
    """Every position's logits of one text, teacher-forced (the engine needs logits_all=True)."""
    llm.reset()
    llm.eval(list(tokens))
    return np.array(llm.scores[: llm.n_tokens], dtype=np.float32)


def tokenize_texts(llm, texts: Sequence[str], n_ctx: int) -> list[list[int]]:
    out = []
    for text in texts:
        toks = llm.tokenize(text.encode("utf-8"))[:n_ctx]
        if len(toks) >= 2:
            out.append(toks)
    return out


def compare(
    make_exact: Callable[[], Any],
    make_approx: Callable[[], Any],
    texts: Sequence[str],
    n_ctx: int,
    stats: Callable[[Any], dict] | None = None,
) -> KLReport:
    """Run `texts` through the exact engine, then the approximate one (one at a time: each
    is closed before the next loads), and score every position."""
    exact = make_exact()
    try:
        token_lists = tokenize_texts(exact, texts, n_ctx)
        if not token_lists:
            raise ValueError("no text of two tokens or more")
        want = [text_logits(exact, t) for t in token_lists]
    finally:
        exact.close()
    approx = make_approx()
    try:
        got = [text_logits(approx, t) for t in token_lists]
        extra = stats(approx) if stats is not None else None
    finally:
        approx.close()
    return summarize((score(w, g, t) for w, g, t in zip(want, got, token_lists)), extra)
