"""Engines sharing the cores of one daemon: compute turns and thread counts (issue 46, item 3).

Every case runs N engines (StreamedLlama, each in a fresh process) on one daemon whose
budget holds the whole model, so the experts are resident and the figure is compute:
each engine loads, maps every expert (`warm="all"`), evaluates a short prompt and decodes
`--warmup` untimed tokens, then waits; all start decoding `--tokens` tokens at the same
instant. Aggregate tok/s = all engines' tokens / (last end - first start).

Cases (same run, same daemon settings; `cores` = len(sched_getaffinity(0))):
  per-core   `cores` engines at n_threads=1 each: the baseline aggregate B
  k=cores    two engines each given n_threads = n_threads_batch = cores (a user's count:
             the daemon makes them take turns)                       goal >= 0.8 x B
  defaults   cores + 2 engines created without thread counts        goal >= 0.8 x B
  all-cores  one engine at n_threads = n_threads_batch = cores: its speed on every core
  alone      one engine without thread counts                       goal >= 0.9 x all-cores
With `--without-turns`, k=cores, defaults and all-cores also run with MOED_TURNS=0 (no
turns, llama-cpp-python's default counts: how the box collapsed before, and what a turn
costs one engine alone), as `k=cores/no-turns`, `defaults/no-turns` and
`all-cores/no-turns`, for the record (no goal).

The model is the issue's resident one, written once (moectl make-model --layers 6
--experts 8 --used 2 --embd 2048 --ff 2048 --quant q4_0 --heads 16 --kv-heads 4) to
`--model` (default /tmp/moed-bench-threads/threads.gguf). `--rounds R` runs every case R
times, the cases' order reversed every other round, and reports each case's median
aggregate; the ratios are medians of the per-round ratios (drift slower than a round
cancels). Prints one JSON line per case run and a summary with the ratios and goals
(`--json`: the summary as one JSON object).

`--user-threads keep` runs the daemon with `turn_user_threads = "keep"`: a count a user
gave is then granted as given however many engines compute, so k=cores engines take turns
instead of computing side by side on a core each (the default, "ceiling"). Where one
engine is about as fast on one thread as on every core (the issue's 2-vCPU VM), turns
alone give k=cores about one engine's speed, 0.5x the per-core aggregate.

The issue's fourth goal (q30 in a 6 GiB cap: two engines at n_threads=2 against two at
n_threads=1 on 2 cores, >= 0.9x) is `--cases k=cores,per-core` on bench/real_size.py's
q30 file with `--budget 4GiB --warm off`, the daemon and engines run inside the cap by
the caller (e.g. `cgexec -g memory:cap`); not part of the default run.

Usage:
    .venv/bin/python bench/threads.py --quick          # smoke: a tiny model, a few tokens (about a minute)
    .venv/bin/python bench/threads.py                  # the figures: 48 tokens an engine, 3 rounds
    .venv/bin/python bench/threads.py --without-turns  # also the cases with turns off
    .venv/bin/python bench/threads.py --cases k=cores,per-core --rounds 5
    .venv/bin/python bench/threads.py --user-threads keep   # a user's count always as given (k=cores take turns)
    .venv/bin/python bench/threads.py --model /path/q30.gguf --budget 4GiB --warm off --random-tokens --cases k=cores,per-core
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CORES = len(os.sched_getaffinity(0))
DEFAULT_MODEL = "/tmp/moed-bench-threads/threads.gguf"
QUICK_MODEL = "/tmp/moed-bench-threads/quick.gguf"
GEOMETRY = dict(layers=6, experts=8, used=2, embd=2048, ff=2048, quant="q4_0", heads=16, kv_heads=4)
PROMPT = "the engines share the cores of one box"


@dataclass(frozen=True)
class Case:
    name: str
    engines: int
    threads: int | None  # n_threads and n_threads_batch of each engine; None: not given (the daemon's)
    turns: bool = True  # MOED_TURNS=0 when False


def cases(without_turns: bool) -> dict[str, Case]:
    out = [
        Case("per-core", CORES, 1),
        Case("k=cores", 2, CORES),
        Case("defaults", CORES + 2, None),
        Case("all-cores", 1, CORES),
        Case("alone", 1, None),
    ]
    if without_turns:
        out += [
            Case("k=cores/no-turns", 2, CORES, turns=False),
            Case("defaults/no-turns", CORES + 2, None, turns=False),
            Case("all-cores/no-turns", 1, CORES, turns=False),
        ]
    return {c.name: c for c in out}


GOALS = [("k=cores", "per-core", 0.8), ("defaults", "per-core", 0.8), ("alone", "all-cores", 0.9)]


# ---- one engine (a child process) -------------------------------------------------------


def engine_main(
    sock: str, model: str, name: str, threads: int | None, tokens: int, warmup: int, warm: str, random_tokens: bool
) -> int:
    """Load, warm, say ready; on a line from stdin decode `tokens` and print one JSON line."""
    from moed.client import Client
    from moed.engines.llama_cpp import StreamedLlama

    # room for the prompt (one token a byte at most) and every token decoded
    kw = dict(n_ctx=len(PROMPT) + warmup + tokens + 16, n_batch=64, n_ubatch=64, verbose=False, seed=0, warm=warm)
    if threads is not None:
        kw.update(n_threads=threads, n_threads_batch=threads)
    client = Client(sock, name)
    llm = StreamedLlama(model, client=client, **kw)
    llm.eval(llm.tokenize(PROMPT.encode()))
    pick = random.Random(name).randrange if random_tokens else None
    decode(llm, warmup, pick)
    print("ready", flush=True)
    sys.stdin.readline()
    start = time.monotonic()  # CLOCK_MONOTONIC: comparable between processes on one box
    decode(llm, tokens, pick)
    end = time.monotonic()
    st = llm.stream_stats()
    out = dict(start=start, end=end, tokens=tokens, n_threads=llm.n_threads, n_threads_batch=llm.n_threads_batch)
    print(json.dumps(out | {"turns": st["turns"], "turn_wait_s": st["turn_wait_s"]}), flush=True)
    llm.close()
    client.close()
    return 0


def decode(llm, n: int, pick=None) -> None:
    """`n` decode steps of one token each: the prompt's tokens over again (a decode's compute does
    not depend on which token; without logits_all llama-cpp-python keeps no logits to pick one
    by), or with `pick`, tokens drawn at random from the vocabulary: on a random-weight model
    they route as widely as tokens sampled at a high temperature, so the drive is in the figure."""
    prompt = llm.tokenize(PROMPT.encode(), add_bos=False)
    for i in range(n):
        llm.eval([pick(llm.n_vocab()) if pick else prompt[i % len(prompt)]])


# ---- the cases --------------------------------------------------------------------------


def spawn(sock: str, model: str, name: str, case: Case, args) -> subprocess.Popen:
    threads = "none" if case.threads is None else str(case.threads)
    env = dict(os.environ, MOED_TURNS="1" if case.turns else "0")
    cmd = [
        sys.executable,
        __file__,
        "--engine",
        sock,
        model,
        name,
        threads,
        str(args.tokens),
        str(args.warmup),
        args.warm,
        "random" if args.random_tokens else "prompt",
    ]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def read_line(proc: subprocess.Popen, deadline: float) -> str:
    assert proc.stdout is not None
    left = deadline - time.monotonic()
    if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
        raise TimeoutError("an engine did not answer in time")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"an engine exited early (rc {proc.wait()})")
    return line.strip()


def run_case(sock: str, model: str, case: Case, args) -> dict:
    procs = [spawn(sock, model, f"bench-{case.name}-{i}", case, args) for i in range(case.engines)]
    try:
        deadline = time.monotonic() + args.timeout_s
        for p in procs:
            while read_line(p, deadline) != "ready":
                pass
        for p in procs:  # all at once: the window starts when the last one reads its line
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        rows = [json.loads(read_line(p, deadline)) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.wait(timeout=args.timeout_s)
    return summarise(case, rows)


def summarise(case: Case, rows: list[dict]) -> dict:
    window = max(r["end"] for r in rows) - min(r["start"] for r in rows)
    per = [r["tokens"] / (r["end"] - r["start"]) for r in rows]
    return {
        "case": case.name,
        "engines": case.engines,
        "threads_given": case.threads,
        "turns": case.turns,
        "aggregate_tok_s": round(sum(r["tokens"] for r in rows) / window, 3),
        "engine_tok_s_min": round(min(per), 3),
        "engine_tok_s_max": round(max(per), 3),
        "n_threads": sorted({r["n_threads"] for r in rows}),
        "n_threads_batch": sorted({r["n_threads_batch"] for r in rows}),
        "turn_wait_s": round(sum(r["turn_wait_s"] for r in rows), 3),
    }


# ---- setup and report -------------------------------------------------------------------


def ensure_model(path: str, quick: bool) -> None:
    if os.path.exists(path):
        return
    from moed.modelgen.makemodel import make_model

    os.makedirs(os.path.dirname(path), exist_ok=True)
    print(f"writing {path} ...", file=sys.stderr)
    tmp = path + ".part.gguf"
    make_model(tmp, **({} if quick else GEOMETRY))
    os.rename(tmp, path)


def report(runs: dict[str, list[dict]], rounds: list[dict[str, dict]]) -> dict:
    summary: dict = {"cores": CORES, "cases": {}, "ratios": {}}
    for name, got in runs.items():
        summary["cases"][name] = {"aggregate_tok_s": statistics.median(r["aggregate_tok_s"] for r in got), **got[-1]}
    for case, base, goal in GOALS:
        ratios = [r[case]["aggregate_tok_s"] / r[base]["aggregate_tok_s"] for r in rounds if case in r and base in r]
        if ratios:
            ratio = statistics.median(ratios)
            summary["ratios"][f"{case} / {base}"] = {"ratio": round(ratio, 3), "goal": goal, "met": ratio >= goal}
    return summary


def print_summary(summary: dict) -> None:
    print(f"\n{summary['cores']} cores; aggregate tok/s (median over rounds):")
    for name, c in summary["cases"].items():
        print(
            f"  {name:18} {c['engines']:2} engines  {c['aggregate_tok_s']:8.2f} tok/s  per engine "
            f"{c['engine_tok_s_min']:.2f}-{c['engine_tok_s_max']:.2f}  threads {c['n_threads']}/{c['n_threads_batch']}"
            f"  waited {c['turn_wait_s']:.2f} s"
        )
    for name, r in summary["ratios"].items():
        print(f"  {name:24} {r['ratio']:.3f}x  (goal >= {r['goal']}x: {'met' if r['met'] else 'NOT met'})")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--engine"]:
        sock, model, name, threads, tokens, warmup, warm, feed = argv[1:9]
        count = None if threads == "none" else int(threads)
        return engine_main(sock, model, name, count, int(tokens), int(warmup), warm, feed == "random")
    args = parse(argv)
    model = args.model or (QUICK_MODEL if args.quick else DEFAULT_MODEL)
    ensure_model(model, args.quick)
    chosen = cases(args.without_turns)
    names = args.cases.split(",") if args.cases else list(chosen)
    if unknown := [n for n in names if n not in chosen]:
        raise SystemExit(f"unknown case(s) {unknown}: choose from {', '.join(chosen)}")
    from moed.protocol.sizes import parse_size
    from moed.testing import DaemonProcess

    # default: every expert resident (the figure is compute, not the drive)
    budget = parse_size(args.budget) if args.budget else os.path.getsize(model) + (64 << 20)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    rounds: list[dict[str, dict]] = []
    with DaemonProcess(budget, config={"turn_user_threads": args.user_threads}) as d:
        for i in range(args.rounds):
            got = {}
            for name in names if i % 2 == 0 else names[::-1]:
                got[name] = run_case(d.socket, model, chosen[name], args)
                runs[name].append(got[name])
                if not args.json:
                    print(json.dumps(got[name]), flush=True)
            rounds.append(got)
    summary = report(runs, rounds)
    if args.json:
        print(json.dumps(summary))
    else:
        print_summary(summary)
    return 0


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help=f"the model (default {DEFAULT_MODEL}, written if missing)")
    ap.add_argument("--tokens", type=int, default=48, help="timed decode tokens an engine (default 48)")
    ap.add_argument("--warmup", type=int, default=8, help="untimed decode tokens an engine first (default 8)")
    ap.add_argument("--rounds", type=int, default=3, help="times every case runs (default 3)")
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    ap.add_argument("--budget", default=None, help="the daemon's budget (default: the model's size, all resident)")
    ap.add_argument("--warm", default="all", choices=("all", "resident", "off"), help="StreamedLlama(warm=...)")
    ap.add_argument(
        "--user-threads",
        default="ceiling",
        choices=("keep", "ceiling"),
        help="the daemon's turn_user_threads: a user's count kept (engines given every core take turns) or a ceiling",
    )
    ap.add_argument("--without-turns", action="store_true", help="also the cases with MOED_TURNS=0")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="for each case (default 600)")
    ap.add_argument("--json", action="store_true", help="print only the summary, as one JSON object")
    ap.add_argument(
        "--random-tokens",
        action="store_true",
        help="decode tokens drawn at random (the drive in the figure, for --budget below the model)",
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: a tiny model, 6 tokens, 1 round")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.warmup, args.rounds = 6, 2, 1
    return args


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
