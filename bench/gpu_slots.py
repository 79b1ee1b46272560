"""Experts on the GPU from moed (issue 40): device slots against the CPU-experts hybrid and stock, on the device ggml sees.

Run (lavapipe, the software Vulkan device, counts as a GPU only when named):

    GGML_VK_VISIBLE_DEVICES=0 GGML_VK_DISABLE_FUSION=1 .venv/bin/python bench/gpu_slots.py [--rounds 5] [--tokens 32]

One generated model (`--layers 8 --experts 32 --used 4 --embd 512 --ff 512`, q8_0: its
expert parts are 68 pages, so zero copy applies), every layer offloaded
(`n_gpu_layers=-1`), each engine in its own process with its own new daemon, the engines
alternated round by round (the order rotates), medians over rounds. A run evaluates a
4-token prompt, `--warmup` tokens, then times `--tokens` tokens fed one at a time from a
fixed pseudo-random sequence (the same for every engine; a random-weight model decoded
greedily repeats one token, so every expert would hit).

Engines:
- `stock`: llama_cpp.Llama(n_gpu_layers=-1): every expert loaded into the device's own
  memory, no stop in the graph: the baseline every ratio is against, same round;
- `hybrid`: StreamedLlama(n_gpu_layers=-1, gpu_slots=0): dense layers on the device, the
  routed experts on the CPU from moed (llama.cpp's --n-cpu-moe), daemon budget `--budget`;
- `slots`: StreamedLlama(gpu_slots=S), S = `--slots` device slots a layer, same budget:
  the device cache evicts, and so does moed;
- `zero-copy`: StreamedLlama(gpu_slots=S, gpu_zero_copy=True), same budget: the device
  reads moed's RAM tier in place (moed.engines.device_host);
- `stop`, `stop-zero-copy`: the per-layer stop isolated. StreamedLlama(gpu_slots=n_expert)
  (resp. with gpu_zero_copy) with a budget that holds the model, warmed until every expert
  of every layer is in a device slot (resp. resident in moed); then `--tokens` pairs of
  tokens, one with the stop at every routed layer and one without any (the eval
  callback's routed stops off, `EvalCallback.routed_stops(False)`: the ask
  pass wants no node, and ggml computes each split of the graph in one piece, as with no
  callback), in ABBA order. Without the
  stop the ids are not remapped: the same work over the wrong slots (finite weights:
  every slot holds a real expert), whose outputs are thrown away. (stop - no stop) /
  layers, the median over pairs, is what a stop costs a layer: the graph split there and
  the device's synchronize, the eval callback, reading the ids and writing the slot ids
  back; with zero copy also moed's acquire and release every layer (local hits). The
  reference page's "host round trip at each layer" is 0.37 ms on a real GPU. With copied
  slots a full hit is the layer holds' own, in C; `stop` then also prints the host time
  an offloaded layer costs at a full hit, in C against Python's path (the same engine,
  `hits_in_c` toggled, MOED_HITS_IN_C=0's path, tokens alternated ABBA), as the holds
  time the whole stop (`stream_stats()["crossings"]`' `host_s`).

`--after-split` runs one `slots` engine instead (issue 47): a call too large for its slots
(`--n-batch` pseudo-random tokens, more distinct experts a layer than S), then, after
`reset()`, a 300-token prompt of one token repeated (every row routes alike: top-k experts
a layer, within S at any batch size). It prints the `n_batch` asked, the too-large call's
decodes (`eval_batches`) and the warning, `n_batch` after it, and the 300-token prompt's
decodes, which must be ceil(300 / n_batch) at the asked `n_batch`, with its time.

Prints one JSON line per run, then per engine the median decode tok/s and its median
per-round ratio to stock, the per-layer stop (from slots-all against stock, and the
engine's own time in acquire and in the slot cycle), the upload bandwidth (upload_bytes /
upload_s of stream_stats()["gpu_slots"], the whole run), and the hit rates over the timed
tokens: the device cache's (hits / (hits + uploads)) against moed's RAM tier's as each
engine's daemon saw it (client.stats() hits and misses deltas: the slots engine asks moed
only for what no device slot holds; the hybrid asks for every routed expert).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ENGINES = ("stock", "hybrid", "slots", "zero-copy", "stop", "stop-zero-copy")
AFTER_SPLIT = "after-split"  # --after-split: not a timed engine
LONG_PROMPT = 300
STOP_ENGINES = ("stop", "stop-zero-copy")
LLAMA_KW = dict(n_ctx=512, n_batch=64, n_ubatch=64, n_threads=2, verbose=False, seed=0, n_gpu_layers=-1)
PROMPT_TOKENS = 4
SEED = 1234


# ---------------------------------------------------------------------- one engine (child)


def child(args: argparse.Namespace) -> None:
    import numpy as np

    kw = dict(LLAMA_KW)
    if args.engine == AFTER_SPLIT:
        return after_split_child(args, {**kw, "n_batch": args.n_batch, "n_ubatch": args.n_batch})
    client = None
    if args.engine == "stock":
        import llama_cpp

        llm = llama_cpp.Llama(model_path=args.model, **kw)
    else:
        from moed.client import Client
        from moed.engines.llama_cpp import StreamedLlama

        client = Client(args.socket, f"bench-{args.engine}")
        slots = 0 if args.engine == "hybrid" else args.experts if args.engine in STOP_ENGINES else args.slots
        llm = StreamedLlama(
            args.model,
            client=client,
            prefetch="off",
            gpu_slots=slots,
            gpu_zero_copy=args.engine in ("zero-copy", "stop-zero-copy"),
            **kw,
        )
    rng = np.random.default_rng(SEED)
    n_vocab = llm.n_vocab()
    tokens = [int(t) for t in rng.integers(1, n_vocab, PROMPT_TOKENS + args.warmup + args.tokens)]
    llm.reset()
    llm.eval(tokens[:PROMPT_TOKENS])
    for t in tokens[PROMPT_TOKENS : PROMPT_TOKENS + args.warmup]:
        llm.eval([t])
    if args.engine in STOP_ENGINES:
        return stop_child(args, llm, client, rng, n_vocab)

    def counters() -> dict:
        if client is None:
            return {}
        st = llm.stream_stats()
        d = client.stats()
        return {"stream": st, "daemon": {"hits": d["hits"], "misses": d["misses"]}}

    before = counters()
    times = []
    t_all = time.perf_counter()
    for t in tokens[PROMPT_TOKENS + args.warmup :]:
        t0 = time.perf_counter()
        llm.eval([t])
        times.append(time.perf_counter() - t0)
    wall = time.perf_counter() - t_all
    after = counters()
    out = {
        "engine": args.engine,
        "tokens": len(times),
        "tok_s": len(times) / wall,
        "ms_token_median": 1e3 * statistics.median(times),
    }
    if client is not None:
        s0, s1 = before["stream"], after["stream"]
        out["layers"] = s1["layers"] - s0["layers"]
        out["acquire_s"] = s1["acquire_s"] - s0["acquire_s"]
        out["show_s"] = s1["show_s"] - s0["show_s"]
        g0, g1 = s0.get("gpu_slots"), s1.get("gpu_slots")
        if g1 is not None:
            out["gpu"] = {k: g1[k] - g0[k] for k in ("hits", "uploads", "evictions", "cycles", "cycle_s")}
            out["gpu_total"] = {k: g1[k] for k in ("upload_bytes", "upload_s", "uploads", "slots", "layers")}
            out["zero_copy"] = bool(g1.get("zero_copy"))
        out["daemon"] = {k: after["daemon"][k] - before["daemon"][k] for k in ("hits", "misses")}
        out["devices"] = s1["devices"]["experts"]
    llm.close()
    if client is not None:
        client.close()
    print(json.dumps(out))


def stop_child(args: argparse.Namespace, llm, client, rng, n_vocab: int) -> None:
    """The stop against no stop, token pairs in ABBA order, once every expert is placed."""
    streamer = llm.streamer
    want = args.layers * args.experts

    zero_copy = bool(llm.stream_stats()["gpu_slots"].get("zero_copy"))

    def placed() -> int:
        if zero_copy:  # every expert resident in moed: no acquire reads the drive
            return int(client.stats()["resident_experts"])
        return int(llm.stream_stats()["gpu_slots"]["uploads"])

    def misses() -> int:
        """What a stop may have had to fetch: device uploads, or with zero copy moed's misses."""
        return int(client.stats()["misses"]) if zero_copy else int(llm.stream_stats()["gpu_slots"]["uploads"])

    warm = 0
    while placed() < want and warm < args.stop_warmup:
        llm.eval([int(rng.integers(1, n_vocab))])
        warm += 1
        if llm.n_tokens > llm.n_ctx() - 8:
            llm.reset()
    llm.reset()
    llm.eval([int(rng.integers(1, n_vocab))])
    times: dict[bool, list[float]] = {True: [], False: []}
    diffs = []
    before = llm.stream_stats()
    dirty = 0
    for i in range(args.tokens):
        pair = {}
        clean = True
        for stop in (True, False) if i % 2 == 0 else (False, True):
            streamer.c_callback.routed_stops(stop)
            t = int(rng.integers(1, n_vocab))
            m0 = misses() if stop else 0
            t0 = time.perf_counter()
            llm.eval([t])
            pair[stop] = time.perf_counter() - t0
            clean = clean and (not stop or misses() == m0)
        streamer.c_callback.routed_stops(True)
        if not clean:  # the stop fetched an expert: not the stop's cost alone
            dirty += 1
            continue
        for stop in (True, False):
            times[stop].append(pair[stop])
        diffs.append(pair[True] - pair[False])
    after = llm.stream_stats()
    g0, g1 = before["gpu_slots"], after["gpu_slots"]
    layers = after["layers"] - before["layers"]
    out = {
        "engine": args.engine,
        "warm_tokens": warm,
        "placed": placed(),
        "pairs": len(diffs),
        "pairs_with_a_fetch": dirty,
        "ms_stop": 1e3 * med(times[True]),
        "ms_no_stop": 1e3 * med(times[False]),
        "ms_stop_a_layer": 1e3 * med(diffs) / args.layers,
        "stops": layers,
        "uploads_timed": g1["uploads"] - g0["uploads"],
        "acquire_ms_a_stop": 1e3 * (after["acquire_s"] - before["acquire_s"]) / max(layers, 1),
        "cycle_ms_a_stop": 1e3 * (g1["cycle_s"] - g0["cycle_s"]) / max(g1["cycles"] - g0["cycles"], 1),
    }
    if not zero_copy:  # copied slots: their full hits are the layer holds' (zero copy acquires every layer)
        out.update(host_a_layer(args, llm, rng, n_vocab, misses))
    llm.close()
    client.close()
    print(json.dumps(out))


def host_a_layer(args: argparse.Namespace, llm, rng, n_vocab: int, misses) -> dict:
    """The host time a device layer's stop costs at a full hit, in C against Python's path, in
    the same engine: tokens in ABBA order, the holds taking the hit (read the top-k, the device
    LRU, write the slot ids; `device_hit`) or not (`hits_in_c` off, MOED_HITS_IN_C=0: the stop
    calls Python, whose cycle does the same: `not_tried`), each stop's time as the holds measure
    it around the whole stop (Python's part included). Medians over tokens of that token's
    time a stop; a token that uploaded an expert is left out."""
    streamer = llm.streamer
    outcome = {True: "device_hit", False: "not_tried"}
    per_stop: dict[bool, list[float]] = {True: [], False: []}
    for i in range(args.tokens):
        for in_c in (True, False) if i % 2 == 0 else (False, True):
            streamer.hits_in_c = in_c
            c0, m0 = llm.stream_stats()["crossings"][outcome[in_c]], misses()
            llm.eval([int(rng.integers(1, n_vocab))])
            c1 = llm.stream_stats()["crossings"][outcome[in_c]]
            if llm.n_tokens > llm.n_ctx() - 8:
                llm.reset()
            if misses() != m0 or c1["stops"] == c0["stops"]:
                continue  # an upload: not a full hit's cost alone
            per_stop[in_c].append((c1["host_s"] - c0["host_s"]) / (c1["stops"] - c0["stops"]))
    streamer.hits_in_c = True
    return {
        "host_us_a_layer_c": 1e6 * med(per_stop[True]),
        "host_us_a_layer_python": 1e6 * med(per_stop[False]),
        "host_tokens": [len(per_stop[True]), len(per_stop[False])],
    }


def after_split_child(args: argparse.Namespace, kw: dict) -> None:
    """A too-large call, then a 300-token prompt that fits: its decodes at the asked n_batch."""
    import warnings

    import numpy as np

    from moed.client import Client
    from moed.engines.llama_cpp import StreamedLlama

    client = Client(args.socket, "bench-after-split")
    llm = StreamedLlama(args.model, client=client, prefetch="off", gpu_slots=args.slots, **kw)
    rng = np.random.default_rng(SEED)
    wide = [int(t) for t in rng.integers(1, llm.n_vocab(), args.n_batch)]
    llm.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm.eval(wide)
    out = {
        "engine": AFTER_SPLIT,
        "slots": args.slots,
        "n_batch_asked": args.n_batch,
        "too_large_call": {"tokens": len(wide), "eval_batches": list(llm.eval_batches)},
        "warnings": [str(w.message) for w in caught],
        "n_batch_after": llm.n_batch,
    }
    llm.reset()
    t0 = time.perf_counter()
    llm.eval([wide[0]] * LONG_PROMPT)
    wall = time.perf_counter() - t0
    want = [min(args.n_batch, LONG_PROMPT - i) for i in range(0, LONG_PROMPT, args.n_batch)]
    out["long_prompt"] = {
        "tokens": LONG_PROMPT,
        "eval_batches": list(llm.eval_batches),
        "decodes": len(llm.eval_batches),
        "ceil_300_over_n_batch": len(want),
        "at_asked_n_batch": llm.eval_batches == want,
        "s": wall,
    }
    out["n_batch_end"] = llm.n_batch
    llm.close()
    client.close()
    print(json.dumps(out))


# ---------------------------------------------------------------------- the run (parent)


def ensure_model(args: argparse.Namespace) -> str:
    from moed.modelgen.makemodel import make_model

    path = pathlib.Path(args.model_dir) / (
        f"gpu-slots-l{args.layers}-e{args.experts}-k{args.used}-{args.embd}x{args.ff}.gguf"
    )
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        make_model(path, layers=args.layers, experts=args.experts, used=args.used, embd=args.embd, ff=args.ff)
    return str(path)


def run_one(engine: str, model: str, args: argparse.Namespace) -> dict:
    from moed.spawn import DaemonProcess

    # The stop engines' budget holds the model (214 MB of experts at the default geometry) and
    # no more: zero copy binds each part's slots as one tensor, which lavapipe refuses past a
    # range (a 1 GiB budget's 358 MB part was refused, moed.engines.device_host).
    budget = args.budget if engine not in STOP_ENGINES else args.stop_budget
    daemon = DaemonProcess(budget) if engine != "stock" else None
    try:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            engine,
            "--model",
            model,
            "--socket",
            daemon.socket if daemon else "",
            *("--slots", str(args.slots), "--experts", str(args.experts)),
            *("--tokens", str(args.tokens), "--warmup", str(args.warmup), "--stop-warmup", str(args.stop_warmup)),
            *("--n-batch", str(args.n_batch)),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"{engine}: rc {proc.returncode}\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        if daemon is not None:
            daemon.close()


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32, help="timed decode tokens a run")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--stop-budget", default="256MiB", help="moed's budget for the stop engines: holds the model")
    ap.add_argument("--stop-warmup", type=int, default=300, help="most tokens the stop engines warm for")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--used", type=int, default=4)
    ap.add_argument("--embd", type=int, default=512)
    ap.add_argument("--ff", type=int, default=512)
    ap.add_argument("--slots", type=int, default=16, help="S: device slots a layer (slots, zero-copy)")
    ap.add_argument("--budget", default="96MiB", help="moed's budget for hybrid, slots, zero-copy")
    ap.add_argument("--model-dir", default="/tmp/moed-bench-gpu-slots")
    ap.add_argument("--after-split", action="store_true", help="a too-large call, then a 300-token prompt (issue 47)")
    ap.add_argument("--n-batch", type=int, default=64, help="--after-split: the n_batch asked")
    ap.add_argument("--child", choices=(*ENGINES, AFTER_SPLIT), dest="engine", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        return child(args)

    probe = "import llama_cpp\nfrom moed.engines.devices import gpu_devices\nprint('|'.join(gpu_devices()))"
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    device = found.stdout.strip().splitlines()[-1] if found.stdout.strip() else ""
    if not device:
        raise SystemExit("no GPU device ggml sees (lavapipe: set GGML_VK_VISIBLE_DEVICES=0)")
    if args.after_split:
        res = run_one(AFTER_SPLIT, ensure_model(args), args)
        print(json.dumps({"device": device, **res}, indent=1))
        return after_split_report(res)
    engines = args.engines.split(",")
    if unknown := [e for e in engines if e not in ENGINES]:
        raise SystemExit(f"unknown engine(s) {unknown}: choose from {','.join(ENGINES)}")
    model = ensure_model(args)
    print(
        json.dumps(
            {
                "device": device,
                "model": model,
                "geometry": dict(layers=args.layers, experts=args.experts, used=args.used, embd=args.embd, ff=args.ff),
                "slots": args.slots,
                "budget": args.budget,
                "env": {k: os.environ.get(k, "") for k in ("GGML_VK_VISIBLE_DEVICES", "GGML_VK_DISABLE_FUSION")},
            }
        ),
        flush=True,
    )
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    ratios: dict[str, list[float]] = {e: [] for e in engines}
    for r in range(args.rounds):
        order = engines[r % len(engines) :] + engines[: r % len(engines)]
        this: dict[str, dict] = {}
        for e in order:
            res = run_one(e, model, args)
            res["round"] = r
            print(json.dumps(res), flush=True)
            runs[e].append(res)
            this[e] = res
        if "stock" in this:
            for e, res in this.items():
                if "tok_s" in res:
                    ratios[e].append(res["tok_s"] / this["stock"]["tok_s"])
    report(device, engines, runs, ratios, args)


def after_split_report(res: dict) -> None:
    from moed.testing.gpu_faults import compact

    asked, long = res["n_batch_asked"], res["long_prompt"]
    print(
        f"\nn_batch asked {asked}, S={res['slots']}; the too-large call of {res['too_large_call']['tokens']} tokens "
        f"went as {compact(res['too_large_call']['eval_batches'])}; n_batch after it {res['n_batch_after']}; the "
        f"{long['tokens']}-token prompt after it: {long['decodes']} decodes [{compact(long['eval_batches'])}] (ceil(300/{asked}) = "
        f"{long['ceil_300_over_n_batch']}, {'at' if long['at_asked_n_batch'] else 'NOT at'} the asked n_batch), "
        f"{long['s']:.2f} s"
    )
    if not long["at_asked_n_batch"] or res["n_batch_end"] != asked:
        raise SystemExit("the prompt after the split did not run at the asked n_batch")


def report(device: str, engines: list[str], runs: dict, ratios: dict, args: argparse.Namespace) -> None:
    def fmt(xs: list[float], spec: str = ".3f") -> str:
        return format(med(xs), spec) if xs else "-"

    print(f"\n{device}; {args.rounds} rounds, medians over rounds")
    print("| engine | decode tok/s | / stock, same round | device cache hit rate | moed RAM-tier hit rate |")
    print("|---|---|---|---|---|")
    for e in engines:
        rs = [x for x in runs[e] if "tok_s" in x]
        if not rs:
            continue
        dev = [
            x["gpu"]["hits"] / (x["gpu"]["hits"] + x["gpu"]["uploads"])
            for x in rs
            if x.get("gpu") and x["gpu"]["hits"] + x["gpu"]["uploads"] and not x.get("zero_copy")
        ]
        ram = [
            x["daemon"]["hits"] / (x["daemon"]["hits"] + x["daemon"]["misses"])
            for x in rs
            if x.get("daemon") and x["daemon"]["hits"] + x["daemon"]["misses"]
        ]
        tok_s = fmt([x["tok_s"] for x in rs], ".2f")
        print(f"| {e} | {tok_s} | {fmt(ratios[e])}x | {fmt(dev)} | {fmt(ram)} |")
    for e in STOP_ENGINES:
        rs = runs.get(e, [])
        if rs:
            per = [x["ms_stop_a_layer"] for x in rs]
            print(
                f"\n{e}: the per-layer stop {fmt(per)} ms (rounds: {', '.join(f'{x:.3f}' for x in per)}; "
                f"reference page, real GPU: 0.37 ms); a token {fmt([x['ms_stop'] for x in rs], '.1f')} ms with the "
                f"stops, {fmt([x['ms_no_stop'] for x in rs], '.1f')} ms without; host work a stop: acquire "
                f"{fmt([x['acquire_ms_a_stop'] for x in rs])} ms, slot cycle {fmt([x['cycle_ms_a_stop'] for x in rs])} "
                f"ms; pairs {sum(x['pairs'] for x in rs)} (left out: {sum(x['pairs_with_a_fetch'] for x in rs)}, whose stop "
                "fetched an expert)"
            )
            if "host_us_a_layer_c" in rs[0]:
                c, py = [x["host_us_a_layer_c"] for x in rs], [x["host_us_a_layer_python"] for x in rs]
                print(
                    f"{e}: host time an offloaded layer costs at a full hit: {fmt(c, '.1f')} us in C, "
                    f"{fmt(py, '.1f')} us through Python (MOED_HITS_IN_C=0), the same engine, tokens alternated "
                    f"(rounds: {', '.join(f'{a:.1f}/{b:.1f}' for a, b in zip(c, py))})"
                )
    for e in ("slots", "zero-copy", "hybrid"):
        rs = [x for x in runs.get(e, []) if x.get("layers")]
        if rs:
            acq = fmt([1e3 * x["acquire_s"] / x["layers"] for x in rs])
            show = fmt([1e3 * x["show_s"] / x["layers"] for x in rs])
            print(f"{e}: host work a stop: acquire {acq} ms (the misses' reads included), show {show} ms")
    ups = [x for x in runs.get("slots", []) if x.get("gpu_total", {}).get("upload_s")]
    if ups:
        bw = [x["gpu_total"]["upload_bytes"] / x["gpu_total"]["upload_s"] / 1e9 for x in ups]
        mb = fmt([x["gpu_total"]["upload_bytes"] / 1e6 for x in ups], ".1f")
        print(f"upload bandwidth (slots, a whole run: {mb} MB): {fmt(bw, '.2f')} GB/s")


if __name__ == "__main__":
    main()
