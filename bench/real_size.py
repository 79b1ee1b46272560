"""A real model's size, as users run it: the model's own router, sampled tokens, a memory cap.

The other engine benches force a real trace's routes onto a 3.7 GiB model. This one
writes a model at a real geometry (`--geometry q30`: Qwen3-30B-A3B's, 48 layers x 128
experts, top-8, 2048 x 768, Q4_0, 17.3 GB) and runs each engine the way a user does:
the model's own router decides, a prompt of `--prompt` tokens is evaluated as one
batch, then `--tokens` tokens are sampled at temperature 1.5 (a random-weight model
decoded greedily repeats one token, so every expert would hit and nothing would be
measured). Page cache dropped before each run; the same seed and prompt for every
engine, so they see the same routes until sampling tells them apart.

Engines (each in its own process; the capped ones inside one cgroup v1 memory group of
`--cap` bytes, daemon and engine together):
  moed-gate  StreamedLlama, prefetch "gate" (the default), daemon budget `--budget`
  moed-off   StreamedLlama, prefetch off
  (either with `@SIZE`, e.g. `moed-off@256KiB`: its daemon reads in chunks of SIZE; or
  with `@KEY=VALUE[+KEY=VALUE]`, e.g. `moed-gate@prefault=false`: one daemon config key;
  then `%NAME=VALUE[+NAME=VALUE]`: the engine process's environment, e.g. `%GOMP_SPINCOUNT=0`)
  mmap       llama.cpp's mmap path (UnpackedLlama, use_mmap, no repack), in the cap
  NAME#T     that engine on T threads (`--threads` otherwise), e.g. `moed-gate#1/cold`
  NAME/copy  that engine on the model's `moectl align --repack` copy (NAME-repacked.gguf)
  NAME/cold  that engine with the repack cache emptied first (`--repack-cache`, the daemons'
             `repack_cache_dir`): the first use of a plain file. Any other moed run on the
             plain file finds the cache warm: `--warm full` (default) reads every expert into
             it once a round before the first such run (a model in daily use); `--warm runs`
             leaves it as the runs before left it.
  peer       BigMoeOnEdge, the other CPU expert streamer (`--peer-cli`, its bmoe-cli: llama.cpp's
             CLI with `--moe-stream`), in the cap with a cache of `--budget` and 4 I/O threads;
             skipped with the reason when `--peer-cli` is not given or not there. Its figures
             are its own llama.cpp timings (a text prompt of about `--prompt` tokens)
  stock      stock llama_cpp.Llama as users run it (resident, every repacked kernel), no
             cap; skipped with the reason when the box's MemAvailable cannot hold the model

Also in the same run: the drive's raw O_DIRECT random-read rate (`moectl bench-drive`
on the model file, 1 MiB reads, 8 in flight), the yardstick for the prompt's reads.

Prints one JSON line per engine (load, prefill and decode tok/s, daemon bytes read in
the prompt and in decode, stall, decode hit rate, peak cgroup usage) and the ratios.
Then the bounds of each moed engine's prompt and decode, from this run's own figures:
the bytes it read at the drive's raw rate (`read_s`) and stock's resident time for the
same work (`compute_s`); serialized = read_s + compute_s (reads, then compute, nothing
overlapped), overlapped = max(read_s, compute_s) (each hidden behind the other). moed's
time is printed against both: `of_serialized` below 1 means reads and compute overlap.

    python bench/real_size.py [--geometry q30|small] [--cap 6GiB] [--budget 4GiB] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from engine_vs_mmap import Cgroup, drop_page_cache, repacked_path, with_daemon  # noqa: E402

from moed.protocol.sizes import parse_size  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
GEOMETRIES = {
    # Qwen3-30B-A3B: 48 layers x 128 experts, top-8, hidden 2048, expert ff 768, 32/4 heads.
    "q30": dict(layers=48, experts=128, used=8, embd=2048, ff=768, heads=32, kv_heads=4),
    # A quick check of the script itself (1.1 GB).
    "small": dict(layers=8, experts=64, used=8, embd=1024, ff=512, heads=16, kv_heads=4),
}
TEMPERATURE = 1.5
SEED = 1234


def model_path(geometry: str) -> str:
    return f"/tmp/moed-bench-real/{geometry}-q4_0.gguf"


def ensure_model(geometry: str) -> str:
    path = model_path(geometry)
    if not os.path.exists(path):
        from moed.modelgen.makemodel import make_model

        print(f"writing {path} ...", file=sys.stderr)
        t = time.perf_counter()
        make_model(path, **GEOMETRIES[geometry], quant="q4_0", align=4096, random_experts=True, ctx=4096)
        print(f"  {time.perf_counter() - t:.0f} s", file=sys.stderr)
    return path


# ---- the engine side (a child process) -------------------------------------


def run_engine(kind: str, model: str, socket: str | None, prompt_n: int, tokens: int, threads: int) -> dict:
    import numpy as np

    kw = dict(
        n_ctx=prompt_n + tokens + 8,
        n_batch=512,
        n_ubatch=512,
        n_threads=threads,
        n_threads_batch=threads,
        seed=SEED,
        verbose=False,
    )
    t0 = time.perf_counter()
    if base(kind).startswith("moed"):
        from moed.client import Client
        from moed.engines.llama_cpp import StreamedLlama

        client = Client(socket, "real-size")
        llm = StreamedLlama(model, client=client, prefetch="gate" if base(kind) == "moed-gate" else "off", **kw)
    elif base(kind) == "mmap":
        from moed.engines.llama_cpp import UnpackedLlama

        client, llm = None, UnpackedLlama(model, use_mmap=True, **kw)
    else:
        import llama_cpp

        client, llm = None, llama_cpp.Llama(model, **kw)
    out: dict = {"engine": kind, "load_s": round(time.perf_counter() - t0, 2)}
    rng = np.random.default_rng(SEED)
    vocab = llm.n_vocab()
    prompt = [llm.token_bos()] + [int(t) for t in rng.integers(300, vocab, prompt_n - 1)]

    def daemon() -> dict:
        return client.stats() if client is not None else {}

    def stall() -> float:
        s = getattr(llm, "streamer", None)
        return s.stats.acquire_s if s is not None else 0.0

    def cpu() -> float:
        t = os.times()
        return t.user + t.system

    d0, s0, c0, q0 = daemon(), stall(), cpu(), runq_s()
    t = time.perf_counter()
    llm.eval(prompt)
    prefill_s = time.perf_counter() - t
    d1, s1, c1, q1 = daemon(), stall(), cpu(), runq_s()
    t = time.perf_counter()
    for _ in range(tokens):
        tok = llm.sample(temp=TEMPERATURE, top_k=0, top_p=1.0, min_p=0.0)
        llm.eval([int(tok)])
    decode_s = time.perf_counter() - t
    d2, s2, c2, q2 = daemon(), stall(), cpu(), runq_s()
    # Preemption: how long the engine's threads (ggml's workers among them) were runnable
    # and not running, the daemon's readers and transforms on their cores.
    out.update(prefill_runq_s=round(q1 - q0, 3), decode_runq_s=round(q2 - q1, 3))
    # Where the two cores went: the engine's CPU and the daemon's (readers, transforms, loop).
    out.update(prefill_engine_cpu_s=round(c1 - c0, 2), decode_engine_cpu_s=round(c2 - c1, 2))
    if client is not None:
        out.update(prefill_daemon_cpu_s=_cpu_s(d0, d1), decode_daemon_cpu_s=_cpu_s(d1, d2))
        out.update(prefill_daemon_sys_s=round(d1["cpu_system_s"] - d0["cpu_system_s"], 2))
    out.update(prefill_tok_s=round(prompt_n / prefill_s, 3), decode_tok_s=round(tokens / decode_s, 3))
    out.update(prefill_s=round(prefill_s, 2), decode_s=round(decode_s, 2))
    if client is not None:
        out.update(
            prefill_bytes_read=d1["bytes_read"] - d0["bytes_read"],
            decode_bytes_read=d2["bytes_read"] - d1["bytes_read"],
            prefill_read_gbps=round((d1["bytes_read"] - d0["bytes_read"]) / prefill_s / 1e9, 3),
            prefill_stall_s=round(s1 - s0, 2),
            decode_stall_s=round(s2 - s1, 2),
            decode_hit_rate=_rate(d1, d2),
            decode_repack_cpu_s=round(d2["repack_cpu_s"] - d1["repack_cpu_s"], 3),
            decode_repack_wait_cpu_s=round(d2["repack_wait_cpu_s"] - d1["repack_wait_cpu_s"], 3),
            decode_cache_reads=d2["repack_cache_reads"] - d1["repack_cache_reads"],
            decode_misses=d2["misses"] - d1["misses"],
            cache_writes=d2["repack_cache_writes"] - d0["repack_cache_writes"],
            prefill_repack_cpu_s=round(d1["repack_cpu_s"] - d0["repack_cpu_s"], 3),
            governor={
                k: v
                for k, v in llm.stream_stats().items()
                if k.startswith("prefetch_steps")
                or k in ("prefetch_precision", "prefetch_batch_precision", "prefetch_on_vs_off")
            },
        )
    import resource

    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    llm.close()
    if client is not None:
        client.close()
    return out


def runq_s() -> float:
    """Seconds this process's threads have been runnable but not running (schedstat's run
    delay, summed over the live threads): the time the scheduler gave their cores to others."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return total / 1e9


def base(kind: str) -> str:
    """The engine a kind names, without its daemon config (`@`) and environment (`%`)."""
    return name_of(kind).removesuffix("/copy").removesuffix("/cold").split("#", 1)[0]


def name_of(kind: str) -> str:
    """A kind without its daemon config (`@`) and environment (`%`): `moed-gate#1/cold`."""
    return kind.split("@", 1)[0].split("%", 1)[0]


def threads_of(kind: str, default: int) -> int:
    """`moed-gate#1/cold`: that engine computes on 1 thread (else `--threads`)."""
    name = name_of(kind).removesuffix("/copy").removesuffix("/cold")
    return int(name.split("#", 1)[1]) if "#" in name else default


def _cpu_s(a: dict, b: dict) -> float:
    return round(b["cpu_user_s"] + b["cpu_system_s"] - a["cpu_user_s"] - a["cpu_system_s"], 2)


def _rate(a: dict, b: dict) -> float | None:
    hits = b["hits"] - a["hits"]
    misses = b["misses"] - a["misses"]
    return round(hits / (hits + misses), 3) if hits + misses else None


# ---- the driver ------------------------------------------------------------


def child(args, kind: str, model: str, group: Cgroup | None, socket: str | None) -> dict:
    cmd = [*(group.prefix() if group else []), sys.executable, __file__, "--child", kind, "--model", model]
    tokens = args.mmap_tokens if base(kind) == "mmap" else args.tokens  # the mmap path in the cap is slow
    cmd += ["--prompt", str(args.prompt), "--tokens", str(tokens), "--threads", str(threads_of(kind, args.threads))]
    if socket:
        cmd += ["--socket", socket]
    peak = 0
    env = dict(os.environ)
    if "%" in kind:  # `moed-gate%GOMP_SPINCOUNT=0`: that engine's process runs with these set
        env.update(item.split("=", 1) for item in kind.split("%", 1)[1].split("+"))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + args.timeout_s
    while True:
        try:
            out, err = proc.communicate(timeout=2.0)
            break
        except subprocess.TimeoutExpired:
            if group is not None:
                peak = max(peak, group.stats()["max_usage_bytes"])
            if time.monotonic() > deadline:
                proc.kill()
                out, err = proc.communicate()
                break
    if proc.returncode != 0:
        return {"engine": kind, "error": f"exit {proc.returncode}: {err[-1200:]}"}
    res = json.loads(out.strip().splitlines()[-1])
    if group is not None:
        res["cgroup_peak_bytes"] = peak
    return res


def drive_rate(model: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "moed.ctl", "bench-drive", model, "--seconds", "8", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    run = json.loads(out.stdout)["runs"][0]
    return {"raw_gbps": run["gbps"], "direct": run["direct"]}


def mem_available() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def daemon_config(kind: str) -> tuple[str, ...]:
    """`moed-off@256KiB`: that engine's daemon reads in chunks of 256 KiB (the default
    before issue 32's change to 1 MiB); `moed-gate@prefault=false`: that engine's daemon
    runs with one config key set (`+` joins several). So before and after run in one
    invocation, interleaved."""
    kind = kind.split("%", 1)[0]
    if "@" not in kind:
        return ()
    lines = []
    for item in kind.split("@", 1)[1].split("+"):
        key, sep, value = item.partition("=")
        if not sep:
            key, value = "chunk_bytes", item
        toml = value if value in ("true", "false") or value.lstrip("-").isdigit() else f'"{value}"'
        lines.append(f"{key} = {toml}\n")
    path = pathlib.Path(f"/tmp/moed-real-{os.getpid()}-{slug(kind)}.toml")
    path.write_text("".join(lines))
    return ("--config", str(path))


def slug(kind: str) -> str:
    """A kind as one path component (cgroup and config file names)."""
    return "".join(c if c.isalnum() or c in "-_=." else "-" for c in kind)


def model_for(kind: str, model: str) -> str:
    """The file a kind runs on: `moed-gate/copy` runs on the model's `moectl align --repack`
    copy (`NAME-repacked.gguf` beside it), so plain and copy alternate in one run."""
    return repacked_path(model) if name_of(kind).endswith("/copy") else model


def fill_cache(args, plain: str) -> dict:
    """Every expert of the plain file read once through a daemon on `--repack-cache`, in the
    layout the copy records (this CPU's), until the cache holds them all: the steady state of a
    model in daily use. Returns what it took."""
    from moed.client import Client
    from moed.gguf.catalog import Catalog

    layout = Catalog.open(repacked_path(plain)).expert_layout
    cat = Catalog.open(plain)
    want = len(cat.layers) * cat.n_experts
    t0 = time.perf_counter()

    def body(sock: str) -> dict:
        with Client(sock, "fill") as c:
            m = c.open_model(plain, expert_layout=layout)
            written = 0
            for _ in range(4):  # a write skipped while the writer was busy is made on the next pass
                for layer in sorted(cat.layers):
                    for e in range(cat.n_experts):
                        with m.acquire(layer, [e]):
                            pass
                last, since = -1, time.monotonic()
                while time.monotonic() - since < 1.0:  # the writer's queue drains (16 experts at most)
                    if (w := c.stats()["repack_cache_writes"]) != last:
                        last, since = w, time.monotonic()
                    time.sleep(0.2)
                s = c.stats()
                if s["repack_cache_writes"] == written or not s["repack_cache_dir"]:
                    break  # a pass that wrote nothing: every expert is in the cache
                written = s["repack_cache_writes"]
            return s

    s = with_daemon(args, args.budget, None, body, extra=("--repack-cache-dir", args.repack_cache))
    return {"filled_s": round(time.perf_counter() - t0, 1), "writes": s["repack_cache_writes"], "of": want}


PERF_LINE = re.compile(r"(prompt eval|eval) time\s*=\s*([\d.]+) ms /\s*(\d+) (?:tokens|runs)")


def run_peer(args, model: str, group: Cgroup | None) -> dict:
    """BigMoeOnEdge's bmoe-cli on the plain file, as its README runs it; its llama.cpp timings."""
    if not args.peer_cli or not os.access(args.peer_cli, os.X_OK):
        return {"engine": "peer", "skipped": f"no BigMoeOnEdge bmoe-cli (--peer-cli {args.peer_cli or 'not given'})"}
    cache_gib = max(1, parse_size(args.budget) >> 30)
    words = " ".join(["the"] * max(1, args.prompt - 1))
    cmd = [*(group.prefix() if group else []), args.peer_cli, "-m", model, "-p", words, "-n", str(args.tokens)]
    cmd += ["-t", str(args.threads), "--temp", str(TEMPERATURE), "--seed", str(SEED), "-no-cnv"]
    cmd += ["--moe-stream", "--moe-stream-cache", str(cache_gib), "--moe-stream-io-threads", "4", "--moe-stream-direct"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
    if proc.returncode != 0:
        return {"engine": "peer", "error": f"exit {proc.returncode}: {proc.stderr[-1200:]}"}
    out: dict = {"engine": "peer", "wall_s": round(time.perf_counter() - t0, 2)}
    for what, ms, n in PERF_LINE.findall(proc.stderr):
        phase = "prefill" if what == "prompt eval" else "decode"
        out[f"{phase}_s"], out[f"{phase}_tok_s"] = round(float(ms) / 1e3, 2), round(int(n) / (float(ms) / 1e3), 3)
    if "decode_tok_s" not in out:
        out["error"] = "no llama.cpp timings in its output: " + proc.stderr[-600:]
    return out


def run_once(args, plain: str, kinds: list[str]) -> list[dict]:
    results = []
    filled = False
    for kind in kinds:
        model = model_for(kind, plain)
        cold = name_of(kind).endswith("/cold")
        if cold:
            shutil.rmtree(args.repack_cache, ignore_errors=True)
            filled = False
        elif args.warm == "full" and not filled and model == plain and base(kind).startswith("moed"):
            print(json.dumps({"fill_cache": fill_cache(args, plain)}), flush=True)
            filled = True
        drop_page_cache(model)
        if not cold and os.path.isdir(args.repack_cache):
            for name in os.listdir(args.repack_cache):  # a warm cache is on the drive, not in RAM
                drop_page_cache(os.path.join(args.repack_cache, name))
        if base(kind) == "peer":
            group = Cgroup(f"moed-real-{os.getpid()}-peer", parse_size(args.cap))
            try:
                results.append(run_peer(args, model, group))
            finally:
                group.remove()
            print(json.dumps(results[-1]), flush=True)
            continue
        if base(kind) == "stock":
            need = os.path.getsize(model) * 1.1
            if mem_available() < need:
                results.append({"engine": kind, "skipped": f"MemAvailable {mem_available()} < {need:.0f}"})
                continue
            results.append(child(args, kind, model, None, None))
            continue
        group = Cgroup(f"moed-real-{os.getpid()}-{slug(kind)}", parse_size(args.cap))
        try:
            if base(kind) == "mmap":
                results.append(child(args, kind, model, group, None))
            else:
                results.append(
                    with_daemon(
                        args,
                        args.budget,
                        group,
                        lambda sock, k=kind, g=group, m=model: child(args, k, m, g, sock),
                        extra=(*daemon_config(kind), "--repack-cache-dir", args.repack_cache),
                    )
                )
        finally:
            group.remove()
        print(json.dumps(results[-1]), flush=True)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="q30")
    ap.add_argument("--model", help="an existing model (default: written for --geometry)")
    ap.add_argument("--cap", default="6GiB", help="memory cgroup limit for the capped engines")
    ap.add_argument("--budget", default="4GiB", help="moed's RAM budget inside the cap")
    ap.add_argument("--prompt", type=int, default=25, help="prompt tokens, one batch")
    ap.add_argument("--tokens", type=int, default=64, help="sampled decode tokens")
    ap.add_argument("--mmap-tokens", type=int, default=8, help="decode tokens for the (slow) mmap run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peer-cli", help="BigMoeOnEdge's bmoe-cli, for the `peer` engine (skipped without it)")
    ap.add_argument(
        "--warm",
        choices=["full", "runs"],
        default="full",
        help="the repack cache a plain-file run that is not NAME/cold finds: 'full' (every expert read "
        "into it first, once a round: a model in daily use), or 'runs' (as the runs before left it)",
    )
    ap.add_argument(
        "--repack-cache",
        default="/tmp/moed-bench-real/repack-cache",
        help="the daemons' repack cache directory (emptied before each NAME/cold run)",
    )
    ap.add_argument("--engines", default="moed-gate,moed-off,mmap,stock")
    ap.add_argument("--rounds", type=int, default=1, help="repeat the set, engines interleaved; medians reported")
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_engine(args.child, args.model, args.socket, args.prompt, args.tokens, args.threads)))
        return 0
    model = args.model or ensure_model(args.geometry)
    kinds = args.engines.split(",")
    drive = drive_rate(model)
    print(json.dumps({"drive": drive, "model_bytes": os.path.getsize(model), "cap": args.cap, "budget": args.budget}))
    rounds = [run_once(args, model, kinds) for _ in range(args.rounds)]
    print("\nmedians over", args.rounds, "round(s):")
    med: dict[str, dict] = {}
    for kind in kinds:
        rows = [r for rnd in rounds for r in rnd if r["engine"] == kind and "error" not in r and "skipped" not in r]
        if rows:
            med[kind] = {
                k: statistics.median(r[k] for r in rows)
                for k in ("prefill_tok_s", "decode_tok_s", "prefill_s", "decode_s")
            }
            for k in ("prefill_read_gbps", "decode_hit_rate", "prefill_bytes_read", "decode_bytes_read"):
                vals = [r[k] for r in rows if r.get(k) is not None]
                if vals:
                    med[kind][k] = statistics.median(vals)
        print(f"  {kind:10s} {json.dumps(med.get(kind, 'no run'))}")
    if "moed-gate" in med and "moed-off" in med:
        for k in ("prefill_tok_s", "decode_tok_s"):
            print(f"  gate / off {k}: {med['moed-gate'][k] / med['moed-off'][k]:.3f}")
    for ref in ("mmap", "stock", "peer"):
        if ref in med and "moed-gate" in med:
            for k in ("prefill_tok_s", "decode_tok_s"):
                print(f"  moed-gate / {ref} {k}: {med['moed-gate'][k] / med[ref][k]:.3f}")
    if "moed-gate" in med and "prefill_read_gbps" in med["moed-gate"]:
        print(f"  prompt reads / raw drive: {med['moed-gate']['prefill_read_gbps'] / drive['raw_gbps']:.3f}")
    print("\nwhere a decode token's time goes (ms a token, medians):")
    for kind in kinds:
        rows = [r for rnd in rounds for r in rnd if r["engine"] == kind and "decode_stall_s" in r]
        if rows:
            print(f"  {kind:10s} {json.dumps(token_time(rows, args.tokens))}")
    for kind, row in med.items():
        if kind.startswith("moed") and "stock" in med:
            for phase, b in bounds(row, med["stock"], drive["raw_gbps"]).items():
                print(f"  {kind} {phase} bounds: {json.dumps(b)}")
    return 0


def token_time(rows: list[dict], tokens: int) -> dict:
    """A decode token's time, split (medians over rounds, ms): `token` its wall time; `wait` in
    acquires (reads the engine waited on, and the round trips); `compute` the rest; `transform`
    the daemon's repack CPU, `in_wait` the part of it on reads an engine waited on; `runq` the
    engine's threads runnable but preempted; `engine_cpu`, `daemon_cpu` what each used."""

    def per(key: str) -> float:
        return round(statistics.median(r[key] for r in rows) * 1e3 / tokens, 1)

    out = {"token": per("decode_s"), "wait": per("decode_stall_s")}
    out["compute"] = round(out["token"] - out["wait"], 1)
    out.update(transform=per("decode_repack_cpu_s"), in_wait=per("decode_repack_wait_cpu_s"))
    out.update(runq=per("decode_runq_s"), engine_cpu=per("decode_engine_cpu_s"), daemon_cpu=per("decode_daemon_cpu_s"))
    return out


def bounds(moed: dict, stock: dict, raw_gbps: float) -> dict[str, dict]:
    """The serialized and overlapped bounds of a moed engine's prompt and decode (module
    docstring), from its bytes read at the drive's raw rate and stock's resident time."""
    out = {}
    for phase in ("prefill", "decode"):
        if f"{phase}_bytes_read" not in moed:
            continue
        read_s = moed[f"{phase}_bytes_read"] / (raw_gbps * 1e9)
        compute_s = stock[f"{phase}_s"]
        serialized, overlapped = read_s + compute_s, max(read_s, compute_s)
        took = moed[f"{phase}_s"]
        out[phase] = {
            "moed_s": round(took, 2),
            "read_s": round(read_s, 2),
            "compute_s": round(compute_s, 2),
            "serialized_s": round(serialized, 2),
            "overlapped_s": round(overlapped, 2),
            "of_serialized": round(took / serialized, 3),
            "of_overlapped": round(took / overlapped, 3),
        }
    return out


if __name__ == "__main__":
    sys.exit(main())
