"""Decode speed of a model larger than its memory: llama.cpp mmap vs StreamedLlama through moed.

One script, one memory cap, one model, one routing trace:

  mmap      llama.cpp as users run it today (mmap, the kernel pages experts in
            and out), inside a memory cgroup of CAP bytes;
  moed      StreamedLlama with the daemon in the same-size cgroup (daemon and
            engine together), RAM budget BUDGET;
  resident  llama.cpp with the whole model read into RAM, no cap;
  moed-fit  StreamedLlama, no cap, a budget and a pinned partition that hold every
            expert (the daemon mirrors the model at open, as resident reads it at load);
  stock     stock llama_cpp.Llama, resident, no cap: every repacked CPU kernel
            (CPU_REPACK), the engine users compare with.

The moed engines run `repack="auto"` on the file `moectl align --repack` makes of
the model (`--repacked`, made once next to it): stock's kernels for every weight.
`moed-off` and `moed-fit-off` run `repack="off"` on the plain model: the plain
kernels, as `resident` (UnpackedLlama) does. Every engine takes the trace's routes,
stock included (StockLlama: stock's load plus the route hook).

The routes follow a real trace (OLMoE-1B-7B, 16 layers x 64 experts, top-8, from
../shared/traces/nvmoe): the eval callback overwrites the router's top-k ids
before the expert matmuls run, so every engine reads exactly the experts the real
model read, token by token. This is a benchmark-only hook. Each engine first
decodes WARMUP trace tokens, then is timed over the next TOKENS.

    python bench/engine_vs_mmap.py [--model PATH] [--cap 2.2GB] [--budget 1.3GiB]

Prefetch (issue 11): `--prefetch off,gate,gate2` runs every moed engine once per
mode, `--recall 0.6,0.86,1.0` once per stated recall, `--rounds N` repeats the
whole set with the modes interleaved (off, gate, gate2, off, ...), so that every
ratio compares runs made minutes apart on the same box. The routes are forced
to the trace, so the model's own predictor (random weights) would predict
nothing useful: the benchmark emulates it. At every prediction the engine makes,
each of the trace's true experts of the predicted layer is kept with probability
RECALL and the rest of the row (same width) is filled with random wrong experts,
so a prefetch is as large as a real one. Issuing, overlap, waste and eviction
are the engine's and the daemon's real code (`predict_hook` only rewrites the
prediction). Two ahead uses the same recall (an upper bound: real two-ahead
recall is lower). `--prefetch-adapt off` prefetches on every step (default: the
engine's governor decides). `--budget 25%` is a share of all experts' slot bytes;
`--cap none` runs moed without the cgroup.

Prefill: `--prefill N` times one prompt of N tokens (every token routed as the
trace's next token, so a batch touches what the real model's would) instead of
decode tokens.

Needs root for the cgroup (cgroup v1 at /sys/fs/cgroup/memory). Prints one JSON
line per engine and the ratios; RESULTS.md records them.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np
from trace_routes import DEFAULT_TRACE, TraceRoutes

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "/tmp/moed-bench-engine/olmoe-geom-q4_0.gguf"
CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup/memory")
# StreamedLlama loads a skeleton (dense bytes, holes for experts): no full read at load.
SKELETON_DIR = "/tmp/moed-bench-engine/skeletons"


# ---- the engine side (runs in a child process) -----------------------------


def load_engine(
    kind: str, model: str, socket: str | None, routes: TraceRoutes | None, prefetch="off", adapt=True, **kw
):
    """One engine of the benches, on the trace's routes (`kw`: llama.cpp's settings;
    `routes` None: the model's own router, no hook, every engine as users run it).

    moed-*: StreamedLlama (`-off`: repack="off" on the plain file; else the
    `align --repack` copy); stock: llama_cpp.Llama as stock loads it, resident; mmap:
    UnpackedLlama on llama.cpp's mmap; anything else: UnpackedLlama resident.
    """
    from moed.engines.llama_cpp import StockLlama, StreamedLlama, UnpackedLlama

    if kind.startswith("moed"):
        plain = kind.endswith("-off")
        return StreamedLlama(
            model if plain else repacked_path(model),
            repack="off" if plain else "auto",
            socket_path=socket,
            route_hook=routes,
            skeleton_dir=SKELETON_DIR,
            prefetch=prefetch,
            prefetch_adapt=adapt,
            predict_hook=routes.predict if routes is not None else None,
            **kw,
        )
    if kind == "stock":  # its repacked kernels, on the trace's routes
        return StockLlama(model, use_mmap=False, route_hook=routes, **kw)
    return UnpackedLlama(model, use_mmap=(kind == "mmap"), route_hook=routes, **kw)


def run_engine(
    kind: str,
    model: str,
    trace: str,
    warmup: int,
    tokens: int,
    threads: int,
    socket: str | None,
    prefetch: str = "off",
    recall: float = 1.0,
    adapt: bool = True,
    prefill: int = 0,
) -> dict:
    routes = TraceRoutes(trace, recall)
    batch = 512 if prefill else 32
    # n_threads_batch too: llama-cpp-python defaults prompt batches to every core, which on
    # this 2-vCPU box makes prefill race the daemon and any other work for the CPU.
    kw = dict(
        n_ctx=max(warmup + tokens, prefill) + 8,
        n_batch=batch,
        n_ubatch=batch,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    t0 = time.perf_counter()
    llm = load_engine(kind, model, socket, routes, prefetch, adapt, **kw)
    load_s = time.perf_counter() - t0
    out = {"engine": kind, "load_s": round(load_s, 2)}
    if kind.startswith("moed-fit"):
        # Everything fits: read and map every expert now, as resident and stock read the
        # whole model at load, so no expert's first use falls in the timed tokens.
        t0 = time.perf_counter()
        out["warmed_experts"] = llm.warm(everything=True)
        out["warm_s"] = round(time.perf_counter() - t0, 2)
    if kind.startswith("moed"):
        out.update(prefetch=prefetch, recall=recall if prefetch != "off" else None, adapt=adapt)
    out.update(_prefill(llm, routes, prefill) if prefill else _decode(llm, routes, warmup, tokens))
    out["peak_rss_bytes"] = _peak_rss()
    if kind.startswith("moed"):
        stats = llm.moed_client.stats() if llm.moed_client else {}
        stream = llm.stream_stats()
        out.update(
            hit_rate=stats.get("hit_rate"),
            bytes_read=stats.get("bytes_read"),
            evictions=stats.get("evictions"),
            daemon_prefetches=stats.get("prefetches"),
            daemon_prefetch_hits=stats.get("prefetch_hits"),
            daemon_wasted_prefetches=stats.get("wasted_prefetches"),
            stream={k: v for k, v in stream.items() if k != "per_layer"},
        )
        # The real predictor's numpy cost (its matmul, top-k, union) per step that predicted,
        # without the emulation's.
        steps = (stream.get("prefetch_steps_on", stream["decodes"]) + stream.get("prefetch_steps_shadow", 0)) or 1
        out["predictor_ms_per_step"] = round(1e3 * (stream["predict_s"] - routes.hook_s) / steps, 3)
    llm.close()
    return out


def _decode(llm, routes: TraceRoutes, warmup: int, tokens: int) -> dict:
    llm.eval([llm.token_bos()])
    token = llm.token_bos()
    times, arms = [], []
    for i in range(warmup + tokens):
        routes.start(i)
        if i == warmup:
            cpu0 = time.process_time()
            stall0 = _stall(llm)
        t = time.perf_counter()
        llm.eval([token])
        times.append(time.perf_counter() - t)
        arms.append(_arm(llm))
    cpu_s = time.process_time() - cpu0
    timed = times[warmup:]
    by_arm = {a: [t for t, x in zip(timed, arms[warmup:]) if x is a] for a in (True, False)}
    # cpu_ms_per_token: this engine process only (the daemon's share is not in it);
    # on a box shared with other work it tells compute cost apart from waiting.
    return {
        "tokens": tokens,
        "tok_s": round(len(timed) / sum(timed), 3),
        "warmup_tok_s": round(warmup / max(sum(times[:warmup]), 1e-9), 3),
        "cpu_ms_per_token": round(1e3 * cpu_s / tokens, 1),
        "stall_ms_per_token": None if stall0 is None else round(1e3 * (_stall(llm) - stall0) / tokens, 2),
        # timed steps by the arm the engine's governor ran them in (prefetch on / off)
        "steps_on": len(by_arm[True]),
        "steps_off": len(by_arm[False]),
        "step_ms_on": round(1e3 * float(np.mean(by_arm[True])), 2) if by_arm[True] else None,
        "step_ms_off": round(1e3 * float(np.mean(by_arm[False])), 2) if by_arm[False] else None,
    }


def _arm(llm) -> bool | None:
    la = getattr(getattr(llm, "streamer", None), "lookahead", None)
    return None if la is None else la.arm()


def _prefill(llm, routes: TraceRoutes, n: int) -> dict:
    """One prompt of `n` tokens after a one-token warm-up (the first decode pays one-off costs)."""
    llm.eval([llm.token_bos()])
    llm.reset()
    routes.start(1000)
    prompt = [llm.token_bos()] * n
    cpu0, stall0 = time.process_time(), _stall(llm)
    t = time.perf_counter()
    llm.eval(prompt)
    dt = time.perf_counter() - t
    return {
        "prefill_tokens": n,
        "tok_s": round(n / dt, 3),
        "prefill_s": round(dt, 3),
        "cpu_ms_per_token": round(1e3 * (time.process_time() - cpu0) / n, 2),
        "stall_s": None if stall0 is None else round(_stall(llm) - stall0, 3),
    }


def _stall(llm) -> float | None:
    streamer = getattr(llm, "streamer", None)
    return None if streamer is None else streamer.stats.acquire_s


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- the driver ------------------------------------------------------------


class Cgroup:
    """A cgroup v1 memory group with a hard limit; processes join by writing their pid."""

    def __init__(self, name: str, limit_bytes: int):
        self.path = CGROUP_ROOT / name
        self.path.mkdir(exist_ok=True)
        (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        self.limit_bytes = limit_bytes

    def prefix(self) -> list[str]:
        """argv prefix that joins this group, then execs the command."""
        return ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "sh"]

    def stats(self) -> dict:
        def read(name: str) -> int:
            return int((self.path / name).read_text())

        stat = dict(line.split() for line in (self.path / "memory.stat").read_text().splitlines())
        keep = ("rss", "cache", "shmem", "mapped_file", "unevictable")
        return {
            "max_usage_bytes": read("memory.max_usage_in_bytes"),
            "failcnt": read("memory.failcnt"),
            **{f"{k}_bytes": int(stat[k]) for k in keep if k in stat},
        }

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass


def drop_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def child(args, kind: str, group, socket: str | None, tokens: int, warmup: int, run: dict | None = None) -> dict:
    run = run or {}
    prefix = group.prefix() if group else []
    cmd = [
        *prefix,
        sys.executable,
        __file__,
        "--child",
        kind,
        "--model",
        args.model,
        "--trace",
        args.trace,
        "--tokens",
        str(tokens),
        "--warmup",
        str(warmup),
        "--threads",
        str(args.threads),
        "--prefetch",
        run.get("prefetch", "off"),
        "--recall",
        str(run.get("recall", 1.0)),
        "--prefetch-adapt",
        args.prefetch_adapt,
        "--prefill",
        str(args.prefill),
    ]
    if socket:
        cmd += ["--socket", socket]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sample = {}
    deadline = time.monotonic() + args.timeout_s
    while True:
        try:
            out, err = proc.communicate(timeout=2.0)
            break
        except subprocess.TimeoutExpired:
            if group is not None:
                sample = group.stats()  # the last sample while the engine runs
            if time.monotonic() > deadline:
                proc.kill()
                out, err = proc.communicate()
                break
    if proc.returncode != 0:
        return {"engine": kind, "error": f"exit {proc.returncode}: {err[-1500:]}"}
    res = json.loads(out.strip().splitlines()[-1])
    if sample:
        res["cgroup_while_running"] = sample
    return res


def with_daemon(args, budget: str, cgroup: Cgroup | None, fn, extra: tuple = ()):
    from moed.testing import wait_for

    sock_dir = pathlib.Path(f"/tmp/moed-bench-{os.getpid()}")
    sock_dir.mkdir(exist_ok=True)
    sock = str(sock_dir / "s")
    prefix = cgroup.prefix() if cgroup else []
    log = open(sock_dir / "moed.log", "wb")
    daemon = subprocess.Popen(
        [*prefix, sys.executable, "-m", "moed.daemon.main", "--socket", sock, "--ram-budget", budget, *extra],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: os.path.exists(sock) or daemon.poll() is not None, 30, what="moed socket")
        if daemon.poll() is not None:
            raise RuntimeError((sock_dir / "moed.log").read_text())
        return fn(sock)
    finally:
        daemon.terminate()
        daemon.wait(30)
        log.close()
        shutil.rmtree(sock_dir, ignore_errors=True)


def repacked_path(model: str) -> str:
    return model[: -len(".gguf")] + "-repacked.gguf" if model.endswith(".gguf") else model + "-repacked"


def ensure_model(path: str, recipe: str | None = None) -> None:
    if not os.path.exists(path):
        sys.path.insert(0, str(ROOT / "bench"))
        import engine_model

        print(f"writing {path} ...", file=sys.stderr)
        engine_model.write(path, recipe=recipe)
    out = repacked_path(path)
    if not os.path.exists(out):
        print(f"moectl align --repack {path} {out} ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "moed.ctl", "align", "--repack", path, out], check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--cap", default="2.2GB", help="memory cgroup limit for the capped runs ('none': no cap)")
    ap.add_argument("--budget", default="1.4GiB", help="moed RAM budget inside the cap (or a share: 25%%)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=64)
    ap.add_argument("--mmap-tokens", type=int, default=8, help="timed tokens for the (slow) mmap run")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="llama.cpp threads (1: ggml's spinning barriers collapse when the box is shared)",
    )
    ap.add_argument("--engines", default="mmap,moed-off,moed,resident,stock,moed-fit")
    ap.add_argument("--recipe", choices=("q4_k_m",), default=None, help="how a missing --model is written")
    ap.add_argument("--policy", default="lru", choices=["lru", "lfu"], help="the daemon's eviction policy")
    ap.add_argument("--prefetch", default="off", help="moed engines: comma-separated modes (off,gate,gate2)")
    ap.add_argument("--recall", default="0.86", help="emulated predictor recall(s), comma-separated")
    ap.add_argument(
        "--prefetch-adapt",
        default="on",
        choices=["on", "off"],
        help="on: the engine's governor decides per decode step; off: prefetch every step",
    )
    ap.add_argument("--prefill", type=int, default=0, help="time a prompt of N tokens instead of decoding")
    ap.add_argument("--rounds", type=int, default=1, help="repeat every run, interleaved; medians are reported")
    ap.add_argument("--timeout-s", type=float, default=1200)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        print(
            json.dumps(
                run_engine(
                    args.child,
                    args.model,
                    args.trace,
                    args.warmup,
                    args.tokens,
                    args.threads,
                    args.socket,
                    prefetch=args.prefetch,
                    recall=float(args.recall),
                    adapt=args.prefetch_adapt == "on",
                    prefill=args.prefill,
                )
            )
        )
        return 0

    ensure_model(args.model, args.recipe)
    cap = _cap_bytes(args.cap)
    size = os.path.getsize(args.model)
    print(
        f"model {args.model}: {size / 2**30:.2f} GiB; cap {args.cap}; moed budget {args.budget}; "
        f"trace {pathlib.Path(args.trace).name}",
        file=sys.stderr,
    )
    results: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for label, kind, run in plan(args):
            res = one_run(args, kind, run, cap, size)
            results.setdefault(label, []).append(res)
            print(json.dumps({"label": label, **res}))
            sys.stdout.flush()
    print(json.dumps({"medians": medians(results), "ratios": ratios(results), "loadavg": os.getloadavg()}))
    return 0


def _cap_bytes(spec: str) -> int | None:
    from moed.protocol.sizes import parse_size

    if spec == "none":
        return None
    return int(float(spec[:-2]) * 1e9) if spec.endswith("GB") else parse_size(spec)


def plan(args) -> list[tuple[str, str, dict]]:
    """(label, engine kind, prefetch settings) for one round, prefetch modes interleaved."""
    out = []
    for kind in args.engines.split(","):
        if not kind.startswith("moed"):
            out.append((kind, kind, {}))
            continue
        for mode in args.prefetch.split(","):
            recalls = args.recall.split(",") if mode != "off" else ["1.0"]
            for r in recalls:
                label = f"{kind}/{mode}" + (f"@{r}" if mode != "off" else "")
                out.append((label, kind, {"prefetch": mode, "recall": float(r)}))
    return out


def one_run(args, kind: str, run: dict, cap: int | None, size: int) -> dict:
    drop_page_cache(args.model)
    capped = kind in ("mmap", "moed", "moed-off") and cap is not None
    group = Cgroup(f"moed-bench-{os.getpid()}-{kind}", cap) if capped else None
    warmup = 4 if kind == "mmap" else args.warmup
    tokens = args.mmap_tokens if kind == "mmap" else args.tokens
    try:
        if kind.startswith("moed"):
            fit = kind.startswith("moed-fit")
            budget = f"{int(size * 1.1)}" if fit else _budget(args.budget, args.model)
            # Everything fits: the daemon mirrors the whole model in its pinned
            # partition at open (as the resident engine reads it all at load).
            extra = ("--pin-budget", f"{int(size * 1.1)}") if fit else ()
            extra += ("--policy", args.policy)
            res = with_daemon(
                args, budget, group, lambda sock: child(args, kind, group, sock, tokens, warmup, run), extra
            )
        else:
            res = child(args, kind, group, None, tokens, warmup)
        if group:
            res["cgroup"] = group.stats()
    finally:
        if group:
            group.remove()
    return res


def _budget(spec: str, model: str) -> str:
    if not spec.endswith("%"):
        return spec
    from moed.gguf.budget import parse_budget

    return str(parse_budget(spec, model))


def medians(results: dict[str, list[dict]]) -> dict[str, float | None]:
    out = {}
    for label, runs in results.items():
        rates = [r["tok_s"] for r in runs if r.get("tok_s")]
        out[label] = round(float(np.median(rates)), 3) if rates else None
    return out


def ratios(results: dict[str, list[dict]]) -> dict[str, float]:
    """Median ratios: every moed run against mmap and resident, and prefetch on against off.

    On against off is the median of per-round ratios (each pair ran minutes apart).
    """
    med = medians(results)
    out = {}
    for label, rate in med.items():
        if not rate or not label.startswith("moed"):
            continue
        kind = label.split("/")[0]
        for base in ("mmap", "resident", "stock"):
            if med.get(base):
                out[f"{label} vs {base}"] = round(rate / med[base], 3)
        plain = label.replace(kind, kind + "-off", 1)
        if not kind.endswith("-off") and med.get(plain):
            out[f"{label} vs {plain}"] = round(rate / med[plain], 3)
        off = results.get(f"{kind}/off")
        if off and label != f"{kind}/off":
            per_round = [
                a["tok_s"] / b["tok_s"] for a, b in zip(results[label], off) if a.get("tok_s") and b.get("tok_s")
            ]
            if per_round:
                out[f"{label} vs {kind}/off"] = round(float(np.median(per_round)), 3)
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
