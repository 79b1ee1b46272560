"""Substitution priced: MB read per token, tok/s and KL for off and r values, at budgets of the experts.

    python bench/substitution.py [--model PATH] [--cap 2.2GB] [--budgets 25,50,75] [--modes off,0.9,0.5]
                                 [--tokens 24] [--warmup 8] [--rule plain]

The model routes itself (no forced trace): with random weights its routing is
the random model's, so the KL here says what substitution costs on this model,
not on a trained one. First the exact run (UnpackedLlama, resident, no cap)
greedy-decodes WARMUP + TOKENS steps after a fixed prompt and keeps every step's
logits. Then, per budget, one engine per mode, interleaved (off, r1, r2, ...):
each is a fresh process (daemon and engine inside the memory cgroup when the
budget fits the cap), fed the exact run's tokens teacher-forced, so every step
compares like with like. Timed: the last TOKENS steps. MB read per token: the
daemon's bytes_read over those steps. KL: mean / p99 over every decode step.
Prefetch off (it changes no logit, and it would blur what substitution saves).
Prints one JSON line per run and a table; bench/RESULTS.md records them.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "/tmp/moed-bench-engine/olmoe-geom-q4_0.gguf"
PROMPT = "the expert model reads memory pages from the drive, one token at a time, and"
KW = dict(n_ctx=512, n_batch=64, n_ubatch=64, n_threads=2, verbose=False, seed=0, logits_all=True)


def exact_run(model: str, steps: int, out: str) -> None:
    from moed.engines.llama_cpp import UnpackedLlama

    llm = UnpackedLlama(model, **KW)
    tokens = llm.tokenize(PROMPT.encode())
    llm.eval(tokens)
    rows = []
    for _ in range(steps):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        rows.append(llm.scores[llm.n_tokens - 1].copy())
        tokens.append(nxt)
        llm.eval([nxt])
    llm.close()
    np.savez(out, tokens=np.array(tokens), logits=np.array(rows, dtype=np.float32))


def worker(model: str, budget: str, mode: str, rule: str, ref: str, warmup: int) -> dict:
    from moed.engines.llama_cpp import StreamedLlama
    from moed.gguf.budget import parse_budget
    from moed.lab.kl import Scored, summarize
    from moed.spawn import DaemonProcess

    data = np.load(ref)
    tokens, want = [int(t) for t in data["tokens"]], data["logits"]
    steps = len(want)
    n_prompt = len(tokens) - steps
    d = DaemonProcess(parse_budget(budget, model), start_timeout_s=60)
    try:
        client = d.client("bench-subst")
        subst = None if mode == "off" else float(mode)
        llm = StreamedLlama(
            model,
            client=client,
            prefetch="off",
            subst=subst,
            subst_rule=rule,
            skeleton_dir=pathlib.Path(model).parent / "skeletons",
            **KW,
        )
        llm.eval(tokens[:n_prompt])
        got = []
        t0 = read0 = 0.0
        for i in range(steps):
            if i == warmup:
                t0, read0 = time.perf_counter(), client.stats()["bytes_read"]
            got.append(llm.scores[llm.n_tokens - 1].copy())
            llm.eval([tokens[n_prompt + i]])
        dt = time.perf_counter() - t0
        timed = steps - warmup
        read = client.stats()["bytes_read"] - read0
        st = llm.stream_stats()
        llm.close()
        client.close()
    finally:
        d.stop()
    from moed.lab.kl import log_softmax

    g = np.array(got, dtype=np.float32)
    lp, lq = log_softmax(want), log_softmax(g)
    kl = np.maximum((np.exp(lp) * (lp - lq)).sum(axis=1), 0.0)
    nxt = np.array(tokens[n_prompt:])
    rows = np.arange(steps)
    rep = summarize([Scored(kl, want.argmax(1) == g.argmax(1), -lp[rows, nxt], -lq[rows, nxt])])
    return {
        "budget": budget,
        "mode": mode,
        "rule": rule,
        "tok_s": round(timed / dt, 3),
        "mb_per_token": round(read / timed / 1e6, 2),
        "mean_kl": rep.mean_kl,
        "p99_kl": rep.p99_kl,
        "top1_pct": rep.same_top_pct,
        "subst_per_token": st.get("subst_per_token", 0.0),
        "subst_reads_avoided": st.get("subst_reads_avoided", 0),
        "subst_reads_needed": st.get("subst_reads_needed", 0),
        "subst_weight_share": st.get("subst_weight_share", 0.0),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--cap", default="2.2GB", help="memory cgroup limit for daemon + engine ('none': no cap)")
    ap.add_argument("--budgets", default="25,50,75", help="shares of all experts' bytes")
    ap.add_argument("--modes", default="off,0.9,0.5", help="off and r values, run interleaved")
    ap.add_argument("--rule", default="plain", choices=("plain", "cooc"))
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--worker", nargs=3, metavar=("BUDGET", "MODE", "REF"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        budget, mode, ref = args.worker
        print(json.dumps(worker(args.model, budget, mode, args.rule, ref, args.warmup)))
        return 0
    sys.path.insert(0, str(ROOT / "bench"))
    from engine_vs_mmap import Cgroup, _cap_bytes

    from moed.gguf.budget import all_experts_bytes

    cap = _cap_bytes(args.cap)
    experts = all_experts_bytes(args.model)
    ref = os.path.join(tempfile.mkdtemp(prefix="moed-subst-"), "exact.npz")
    exact_run(args.model, args.warmup + args.tokens, ref)
    print(f"# model {args.model}, experts {experts / 2**30:.2f} GiB, cap {args.cap}", flush=True)
    results = []
    for _ in range(args.rounds):
        for share in args.budgets.split(","):
            budget = f"{share}%"
            # Daemon budget + dense weights + engine must fit: else run uncapped and say so.
            capped = cap is not None and float(share) / 100 * experts + 0.6 * 2**30 < cap
            for mode in args.modes.split(","):
                group = Cgroup(f"moed-subst-{os.getpid()}", cap) if capped and cap is not None else None
                cmd = [sys.executable, __file__, "--model", args.model, "--rule", args.rule,
                       "--warmup", str(args.warmup), "--worker", budget, mode, ref]  # fmt: skip
                try:
                    out = subprocess.run((group.prefix() if group else []) + cmd, capture_output=True, text=True)
                finally:
                    if group:
                        group.remove()
                if out.returncode != 0:
                    print(json.dumps({"budget": budget, "mode": mode, "error": out.stderr[-600:]}), flush=True)
                    continue
                res = json.loads(out.stdout.strip().splitlines()[-1])
                res["capped"] = capped
                results.append(res)
                print(json.dumps(res), flush=True)
    print(
        "\n| budget | capped | mode | MB read/token | tok/s | mean KL | p99 KL | top-1 % | subst/token | weight moved |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['budget']} | {r['capped']} | {r['mode']} | {r['mb_per_token']} | {r['tok_s']} | "
              f"{r['mean_kl']:.4f} | {r['p99_kl']:.4f} | {r['top1_pct']:.1f} | {r['subst_per_token']:.2f} | "
              f"{100 * r['subst_weight_share']:.1f}% |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
