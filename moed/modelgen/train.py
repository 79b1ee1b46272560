"""Train a tiny qwen3moe-architecture byte-level model on the standard library's source.

`scripts/train-tiny-moe` drives this module; it needs PyTorch (the optional extra
`train`), which the daemon, the client and the engines never import. The model is
written as GGUF with the project's own generator (`moed.modelgen.makemodel`: its tensor
plan, metadata and vocabulary), so llama.cpp loads it exactly like a generated test
model, only with learned weights.

Invariants:
- The data and the byte-level vocabulary are moed.modelgen.tinydata's (torch-free).
- The torch model is qwen3moe as llama.cpp computes it: RMSNorm (eps 1e-6), per-head
  RMSNorm on q and k, NeoX rope (theta 10000), grouped-query attention, SwiGLU
  experts, a softmax router whose top-k weights are renormalised (norm_topk_prob).
  Torch's Linear weights are (out, in), which is GGUF's numpy order: no transposes.
- Seeds fix the data order, the initialisation and the held-out split (by file).
"""

from __future__ import annotations

import math
import pathlib
import time
from dataclasses import asdict, dataclass
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGUFWriter
from gguf.constants import Keys
from torch import nn

from moed.modelgen import makemodel
from moed.modelgen.tinydata import VOCAB, corpus, decode, encode, eval_windows, vocab

__all__ = ["VOCAB", "corpus", "decode", "encode", "eval_windows", "vocab"]

EPS = 1e-6
ROPE_THETA = 10000.0
NAME = "moed tiny-stdlib-moe"


@dataclass(frozen=True)
class TrainConfig:
    layers: int = 6
    experts: int = 16
    used: int = 2
    embd: int = 128
    ff: int = 128
    heads: int = 4
    kv_heads: int = 2
    ctx: int = 128
    steps: int = 1200
    batch: int = 16
    lr: float = 3e-3
    warmup: int = 100
    aux: float = 0.01  # load-balancing loss weight (Switch Transformer's)
    seed: int = 0
    holdout_every: int = 20  # one file in N (by a hash of its path) is held out

    @property
    def geometry(self) -> makemodel.Geometry:
        return makemodel.Geometry(
            self.layers, self.experts, self.used, self.embd, self.ff, self.heads, self.kv_heads, self.ctx
        )


# --------------------------------------------------------------------------- model


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * self.weight


def rope(x, cos, sin):
    """NeoX rope (llama.cpp's LLAMA_ROPE_TYPE_NEOX, qwen3's): the two halves rotate."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Block(nn.Module):
    def __init__(self, c: TrainConfig):
        super().__init__()
        hd = c.embd // c.heads
        self.c, self.hd = c, hd
        self.attn_norm = RMSNorm(c.embd)
        self.q = nn.Linear(c.embd, c.heads * hd, bias=False)
        self.k = nn.Linear(c.embd, c.kv_heads * hd, bias=False)
        self.v = nn.Linear(c.embd, c.kv_heads * hd, bias=False)
        self.o = nn.Linear(c.heads * hd, c.embd, bias=False)
        self.q_norm = RMSNorm(hd)
        self.k_norm = RMSNorm(hd)
        self.ffn_norm = RMSNorm(c.embd)
        self.router = nn.Linear(c.embd, c.experts, bias=False)
        s = 1 / math.sqrt(c.embd)
        self.gate = nn.Parameter(torch.randn(c.experts, c.ff, c.embd) * s)
        self.up = nn.Parameter(torch.randn(c.experts, c.ff, c.embd) * s)
        self.down = nn.Parameter(torch.randn(c.experts, c.embd, c.ff) / math.sqrt(c.ff) / 2)

    def attention(self, x, cos, sin):
        b, t, _ = x.shape
        c = self.c
        q = self.q_norm(self.q(x).view(b, t, c.heads, self.hd)).transpose(1, 2)
        k = self.k_norm(self.k(x).view(b, t, c.kv_heads, self.hd)).transpose(1, 2)
        v = self.v(x).view(b, t, c.kv_heads, self.hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        rep = c.heads // c.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, c.heads * self.hd))

    def moe(self, x):
        """SwiGLU experts behind a softmax router, top-k renormalised; returns (y, aux, ids)."""
        c = self.c
        flat = x.reshape(-1, c.embd)
        probs = F.softmax(self.router(flat).float(), dim=-1)
        w, ids = probs.topk(c.used, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        # One gather and one scatter per layer: rows sorted by expert, cut into runs.
        flat_ids = ids.reshape(-1)
        order = flat_ids.argsort(stable=True)
        tok = order // c.used
        counts = torch.bincount(flat_ids, minlength=c.experts).tolist()
        runs = flat[tok].split(counts)
        ys = [(F.silu(h @ self.gate[e].T) * (h @ self.up[e].T)) @ self.down[e].T for e, h in enumerate(runs)]
        y = torch.cat(ys) * w.reshape(-1)[order, None]
        out = torch.zeros_like(flat).index_add(0, tok, y)
        frac = F.one_hot(ids, c.experts).float().sum(1).mean(0) / c.used
        aux = c.experts * (frac * probs.mean(0)).sum()
        return out.view_as(x), aux, ids

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attn_norm(x), cos, sin)
        y, aux, ids = self.moe(self.ffn_norm(x))
        return x + y, aux, ids


class TinyMoE(nn.Module):
    def __init__(self, c: TrainConfig):
        super().__init__()
        self.c = c
        self.embd = nn.Embedding(VOCAB, c.embd)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.embd)
        self.out = nn.Linear(c.embd, VOCAB, bias=False)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=1 / math.sqrt(m.in_features))
        nn.init.normal_(self.embd.weight, std=1.0)
        hd = c.embd // c.heads
        inv = ROPE_THETA ** (-torch.arange(0, hd, 2).float() / hd)
        ang = torch.arange(c.ctx).float()[:, None] * inv[None, :]
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, ids):
        t = ids.shape[1]
        x = self.embd(ids)
        aux = x.new_zeros(())
        for blk in self.blocks:
            x, a, _ = blk(x, self.cos[:t], self.sin[:t])
            aux = aux + a
        return self.out(self.norm(x)), aux / len(self.blocks)


def evaluate(model: TinyMoE, windows: np.ndarray, batch: int = 16) -> float:
    """Mean next-token NLL (nats) over `windows`."""
    model.eval()
    total = n = 0.0
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            x = torch.from_numpy(windows[i : i + batch])
            logits, _ = model(x[:, :-1])
            total += F.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1), reduction="sum").item()
            n += x[:, 1:].numel()
    model.train()
    return total / n


def train(c: TrainConfig, log=print) -> tuple[TinyMoE, dict]:
    """Train from seed `c.seed`; returns the model and a report (loss curve, timings)."""
    torch.manual_seed(c.seed)
    train_ids, test_ids, info = corpus(c.holdout_every)
    windows = eval_windows(test_ids, c.ctx + 1, 64)
    model = TinyMoE(c)
    opt = torch.optim.AdamW(model.parameters(), lr=c.lr, betas=(0.9, 0.95), weight_decay=0.05)
    rng = np.random.default_rng(c.seed)
    init_nll = evaluate(model, windows)
    log(
        f"train: {info['train_files']} files, {info['train_tokens']:,} tokens; held out "
        f"{info['heldout_files']} files, {info['heldout_tokens']:,} tokens; untrained held-out "
        f"loss {init_nll:.3f} nats/token"
    )
    curve, evals = [], [(0, init_nll)]
    t0 = time.monotonic()
    for step in range(1, c.steps + 1):
        lr = c.lr * min(1.0, step / c.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / c.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = rng.integers(0, train_ids.size - c.ctx - 1, size=c.batch)
        x = torch.from_numpy(np.stack([train_ids[s : s + c.ctx + 1] for s in starts]).astype(np.int64))
        logits, aux = model(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        (loss + c.aux * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        curve.append((step, loss.item(), aux.item()))
        if step % 50 == 0 or step == c.steps:
            el = time.monotonic() - t0
            msg = (
                f"step {step:5d}  loss {np.mean([v for _, v, _ in curve[-50:]]):.3f}  "
                f"balance {aux.item():.3f}  lr {lr:.2e}  {el:6.0f}s"
            )
            if step % 250 == 0 or step == c.steps:
                evals.append((step, evaluate(model, windows)))
                msg += f"  held-out {evals[-1][1]:.3f}"
            log(msg, flush=True)
    report = {
        "config": asdict(c),
        "data": info,
        "train_s": round(time.monotonic() - t0, 1),
        "untrained_nll": init_nll,
        "heldout_nll": evals[-1][1],
        "curve": curve,
        "evals": evals,
    }
    return model, report


# --------------------------------------------------------------------------- GGUF


def gguf_tensors(model: TinyMoE) -> dict[str, np.ndarray]:
    """The model's weights under makemodel's GGUF tensor names, float32, numpy order."""

    def a(t) -> np.ndarray:
        return t.detach().float().cpu().numpy()

    out = {
        "token_embd.weight": a(model.embd.weight),
        "output_norm.weight": a(model.norm.weight),
        "output.weight": a(model.out.weight),
    }
    for i, block in enumerate(model.blocks):
        b = cast(Block, block)
        p = f"blk.{i}."
        out.update(
            {
                p + "attn_norm.weight": a(b.attn_norm.weight),
                p + "attn_q.weight": a(b.q.weight),
                p + "attn_k.weight": a(b.k.weight),
                p + "attn_v.weight": a(b.v.weight),
                p + "attn_output.weight": a(b.o.weight),
                p + "attn_q_norm.weight": a(b.q_norm.weight),
                p + "attn_k_norm.weight": a(b.k_norm.weight),
                p + "ffn_norm.weight": a(b.ffn_norm.weight),
                p + "ffn_gate_inp.weight": a(b.router.weight),
                p + "ffn_gate_exps.weight": a(b.gate),
                p + "ffn_up_exps.weight": a(b.up),
                p + "ffn_down_exps.weight": a(b.down),
            }
        )
    return out


def write_gguf(
    path: str | pathlib.Path,
    g: makemodel.Geometry,
    tensors: dict[str, np.ndarray],
    quant: str = "q8_0",
    align: int = 32,
    description: str = "",
) -> pathlib.Path:
    """Write learned weights in makemodel's tensor plan and metadata (one shard)."""
    lq = [quant] * g.layers
    makemodel._check(g, lq, 1, align)
    tokens, scores, types = vocab()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(path, makemodel.ARCH)
    makemodel._add_metadata(w, g, tokens, scores, types)
    w.add_bool(Keys.Tokenizer.ADD_PREFIX, False)  # a space is "\u2581", never a prefix
    w.add_description(description or NAME)
    if align != 32:
        w.add_custom_alignment(align)
    specs = makemodel._plan(g, makemodel._part_quants(lq, None, False), len(tokens))
    if set(tensors) != {s.name for s in specs}:
        raise ValueError(f"tensors differ from the plan: {sorted(set(tensors) ^ {s.name for s in specs})}")
    for s in specs:
        if tensors[s.name].shape != s.shape:
            raise ValueError(f"{s.name}: shape {tensors[s.name].shape}, the plan says {s.shape}")
        w.add_tensor_info(s.name, s.byte_shape, np.dtype(s.dtype), s.nbytes, raw_dtype=s.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for s in specs:
        t = tensors[s.name]
        if s.qtype is not None:
            data = np.stack([makemodel.quantize(t[e], s.qtype) for e in range(t.shape[0])])
        else:
            data = t.astype(s.dtype)
        w.write_tensor_data(np.ascontiguousarray(data))
    w.close()
    return path


# --------------------------------------------------------------------------- llama.cpp checks


def llama_cpp_nll(path: str | pathlib.Path, windows: np.ndarray, threads: int = 2) -> float:
    """Mean next-token NLL (nats) of `windows` as llama.cpp computes it (logits_all)."""
    import llama_cpp

    ctx = windows.shape[1]
    llm = llama_cpp.Llama(
        str(path), n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, logits_all=True, n_threads=threads, verbose=False, seed=0
    )
    total = n = 0.0
    try:
        for win in windows:
            llm.reset()
            llm.eval([int(t) for t in win[:-1]])
            logits = np.asarray(llm.scores[: ctx - 1], np.float64)
            logp = logits - logits.max(1, keepdims=True)
            logp -= np.log(np.exp(logp).sum(1, keepdims=True))
            total -= logp[np.arange(ctx - 1), win[1:]].sum()
            n += ctx - 1
    finally:
        llm.close()
    return total / n


def check_tokenizer(path: str | pathlib.Path, samples: list[bytes]) -> int:
    """llama.cpp tokenizes and detokenizes each sample exactly as `encode`/`decode`; returns the count."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    try:
        for s in samples:
            got = llm.tokenize(s, add_bos=False, special=False)
            want = encode(s).tolist()
            if got != want:
                raise AssertionError(f"llama.cpp tokenizes {s[:40]!r} differently: {got[:20]} vs {want[:20]}")
            if llm.detokenize(got) != s:
                raise AssertionError(f"llama.cpp detokenizes {s[:40]!r} differently")
    finally:
        llm.close()
    return len(samples)


def plot_curve(report: dict, path: str | pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, loss, _ = zip(*report["curve"])
    k = 25
    smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, loss, alpha=0.3, label="train (per step)")
    ax.plot(steps[k - 1 :], smooth, label=f"train ({k}-step mean)")
    es, ev = zip(*report["evals"])
    ax.plot(es, ev, "o-", label="held-out")
    ax.axhline(math.log(VOCAB), ls=":", c="gray", label=f"uniform (ln {VOCAB})")
    ax.set_xlabel("step")
    ax.set_ylabel("nats / token (byte)")
    ax.set_title(NAME)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
