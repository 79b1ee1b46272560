"""Decode speed of a model larger than its memory: llama.cpp mmap vs StreamedLlama through moed.

One script, one memory cap, one model, one routing trace:

  mmap      llama.cpp as users run it today (mmap, the kernel pages experts in
            and out), inside a memory cgroup of CAP bytes;
  moed      StreamedLlama with the daemon in the same-size cgroup (daemon and
            engine together), RAM budget BUDGET;
  resident  llama.cpp with the whole model read into RAM, no cap;
  moed-fit  StreamedLlama, no cap, a budget and a pinned partition that hold every
            expert (the daemon mirrors the model at open, as resident reads it at load).

The routes follow a real trace (OLMoE-1B-7B, 16 layers x 64 experts, top-8, from
../shared/traces/nvmoe): the eval callback overwrites the router's top-k ids
before the expert matmuls run, so every engine reads exactly the experts the real
model read, token by token. This is a benchmark-only hook. Each engine first
decodes WARMUP trace tokens, then is timed over the next TOKENS.

    python bench/engine_vs_mmap.py [--model PATH] [--cap 2.2GB] [--budget 1.3GiB]

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

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "/tmp/moed-bench-engine/olmoe-geom-q4_0.gguf"
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "nvmoe" / "olmoe-all.tokens.jsonl"
CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup/memory")
# StreamedLlama loads a skeleton (dense bytes, holes for experts): no full read at load.
SKELETON_DIR = "/tmp/moed-bench-engine/skeletons"


# ---- the engine side (runs in a child process) -----------------------------


class TraceRoutes:
    """The route hook: overwrite ids with the trace's token `cursor`."""

    def __init__(self, trace_path: str):
        from moed.lab.traces import Trace

        trace = Trace.load(trace_path)
        self.ids = np.asarray(trace.ids, dtype=np.int32)      # (tokens, layers, k), layers 0..L-1
        self.cursor = 0

    def __call__(self, layer: int, ids: np.ndarray) -> None:
        ids[:, :] = self.ids[self.cursor % len(self.ids), layer][: ids.shape[1]]


def run_engine(kind: str, model: str, trace: str, warmup: int, tokens: int, threads: int, socket: str | None) -> dict:
    from moed.engines.llama_cpp import StreamedLlama, UnpackedLlama

    routes = TraceRoutes(trace)
    kw = dict(n_ctx=warmup + tokens + 8, n_batch=32, n_ubatch=32, n_threads=threads, verbose=False)
    t0 = time.perf_counter()
    if kind.startswith("moed"):
        llm = StreamedLlama(model, socket_path=socket, route_hook=routes, skeleton_dir=SKELETON_DIR, **kw)
    else:
        llm = UnpackedLlama(model, use_mmap=(kind == "mmap"), route_hook=routes, **kw)
    load_s = time.perf_counter() - t0
    llm.eval([llm.token_bos()])
    token = llm.token_bos()
    times = []
    for i in range(warmup + tokens):
        routes.cursor = i
        if i == warmup:
            cpu0 = time.process_time()
        t = time.perf_counter()
        llm.eval([token])
        times.append(time.perf_counter() - t)
    cpu_s = time.process_time() - cpu0
    timed = times[warmup:]
    # cpu_ms_per_token: this engine process only (the daemon's share is not in it);
    # on a box shared with other work it tells compute cost apart from waiting.
    out = {"engine": kind, "load_s": round(load_s, 2), "tokens": tokens,
           "tok_s": round(len(timed) / sum(timed), 3), "warmup_tok_s": round(warmup / max(sum(times[:warmup]), 1e-9), 3),
           "cpu_ms_per_token": round(1e3 * cpu_s / tokens, 1), "peak_rss_bytes": _peak_rss()}
    if kind.startswith("moed"):
        stats = llm.moed_client.stats() if llm.moed_client else {}
        out.update(hit_rate=stats.get("hit_rate"), bytes_read=stats.get("bytes_read"),
                   evictions=stats.get("evictions"), stream=llm.stream_stats())
    llm.close()
    return out


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
        return {"max_usage_bytes": read("memory.max_usage_in_bytes"), "failcnt": read("memory.failcnt"),
                **{f"{k}_bytes": int(stat[k]) for k in keep if k in stat}}

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


def child(args, kind: str, group, socket: str | None, tokens: int, warmup: int) -> dict:
    prefix = group.prefix() if group else []
    cmd = [*prefix, sys.executable, __file__, "--child", kind, "--model", args.model, "--trace", args.trace,
           "--tokens", str(tokens), "--warmup", str(warmup), "--threads", str(args.threads)]
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
                sample = group.stats()            # the last sample while the engine runs
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
    from tests.support import wait_for

    sock_dir = pathlib.Path(f"/tmp/moed-bench-{os.getpid()}")
    sock_dir.mkdir(exist_ok=True)
    sock = str(sock_dir / "s")
    prefix = cgroup.prefix() if cgroup else []
    log = open(sock_dir / "moed.log", "wb")
    daemon = subprocess.Popen([*prefix, sys.executable, "-m", "moed.daemon.main", "--socket", sock,
                               "--ram-budget", budget, *extra], stdout=log, stderr=subprocess.STDOUT)
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


def ensure_model(path: str) -> None:
    if not os.path.exists(path):
        sys.path.insert(0, str(ROOT / "bench"))
        import engine_model

        print(f"writing {path} ...", file=sys.stderr)
        engine_model.write(path)


def main() -> int:
    from moed.protocol.sizes import parse_size

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--cap", default="2.2GB", help="memory cgroup limit for the capped runs")
    ap.add_argument("--budget", default="1.4GiB", help="moed RAM budget inside the cap")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=64)
    ap.add_argument("--mmap-tokens", type=int, default=8, help="timed tokens for the (slow) mmap run")
    ap.add_argument("--threads", type=int, default=1,
                    help="llama.cpp threads (1: ggml's spinning barriers collapse when the box is shared)")
    ap.add_argument("--engines", default="mmap,moed,resident,moed-fit")
    ap.add_argument("--policy", default="lru", choices=["lru", "lfu"], help="the daemon's eviction policy")
    ap.add_argument("--timeout-s", type=float, default=1200)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        print(json.dumps(run_engine(args.child, args.model, args.trace, args.warmup, args.tokens,
                                    args.threads, args.socket)))
        return 0

    ensure_model(args.model)
    cap = parse_size(args.cap) if not args.cap.endswith("GB") else int(float(args.cap[:-2]) * 1e9)
    size = os.path.getsize(args.model)
    print(f"model {args.model}: {size / 2**30:.2f} GiB; cap {cap / 2**30:.2f} GiB; "
          f"moed budget {args.budget}; trace {pathlib.Path(args.trace).name}", file=sys.stderr)
    results = {}
    for kind in args.engines.split(","):
        drop_page_cache(args.model)
        capped = kind in ("mmap", "moed")
        group = Cgroup(f"moed-bench-{os.getpid()}-{kind}", cap) if capped else None
        warmup = 4 if kind == "mmap" else args.warmup
        tokens = args.mmap_tokens if kind == "mmap" else args.tokens
        try:
            if kind.startswith("moed"):
                budget = args.budget if kind == "moed" else f"{int(size * 1.1)}"
                # Everything fits: the daemon mirrors the whole model in its pinned
                # partition at open (as the resident engine reads it all at load).
                extra = ("--pin-budget", f"{int(size * 1.1)}") if kind == "moed-fit" else ()
                extra += ("--policy", args.policy)
                res = with_daemon(args, budget, group,
                                  lambda sock: child(args, kind, group, sock, tokens, warmup), extra)
            else:
                res = child(args, kind, group, None, tokens, warmup)
            if group:
                res["cgroup"] = group.stats()
        finally:
            if group:
                group.remove()
        results[kind] = res
        print(json.dumps(res))
        sys.stdout.flush()
    ratios = {}
    rate = {k: v.get("tok_s") for k, v in results.items()}
    if rate.get("moed") and rate.get("mmap"):
        ratios["moed_vs_mmap_in_cap"] = round(rate["moed"] / rate["mmap"], 2)
    if rate.get("moed-fit") and rate.get("resident"):
        ratios["moed_fit_vs_resident"] = round(rate["moed-fit"] / rate["resident"], 3)
    if rate.get("moed") and rate.get("resident"):
        ratios["moed_in_cap_vs_resident"] = round(rate["moed"] / rate["resident"], 3)
    cpu = {k: v.get("cpu_ms_per_token") for k, v in results.items()}
    if cpu.get("moed-fit") and cpu.get("resident"):
        ratios["moed_fit_vs_resident_cpu"] = round(cpu["resident"] / cpu["moed-fit"], 3)
    print(json.dumps({"ratios": ratios, "loadavg": os.getloadavg()}))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
