"""Engines sharing one daemon against the same engines each on a private daemon (issue 46, item 4).

Two setups, same engines, same total memory, same cap:
  shared   N engines on one daemon with `--budget` (one LRU over every engine's experts);
  private  the same N engines, each on its own daemon with `--budget` / N.
Measured at 2 and 4 engines (`--engines`), the two setups run back to back for every
point (their order alternates from point to point, so drift slower than a point cancels).

Routing, two kinds (`--routing`, comma-separated):
  random   a random-weight model at a q30-like geometry (`--geometry`, or `--layers
           --experts --used --embd --ff`), routed by its own router: each engine gets a
           different random prompt and samples at temperature 1.5 (greedy decoding of
           random weights repeats one token, so every expert would hit). Random weights
           share no hot experts: what sharing gains here is memory an engine uses that
           another does not. `--geometry q30` is Qwen3-30B-A3B's real size (17.3 GB, the
           file bench/real_size.py writes).
  NAME     a trace of ../shared/traces (`olmoe`: OLMoE-1B-7B, 16 layers x 64 experts,
           top-8; `dsv2lite`: DeepSeek-V2-Lite, 26 x 64, top-6), replayed through the
           engine's route hook on a random-weight model of that routing geometry (embd and
           ff from `--trace-embd --trace-ff`, smaller than the real models'). The trace is
           cut into N equal segments and engine i replays segment i, so engines decode
           different requests of the same model and overlap as real ones do. An engine
           that reaches its segment's end starts it again (`wrapped`; never the next
           engine's tokens, which only a shared daemon would have read already).

Activity, two kinds (`--activity`):
  equal    every engine decodes for `--window-s`; reported: aggregate tok/s (the sum of
           the engines'), per-engine min and max;
  unequal  engine 0 decodes for the window; the others keep their models open and decode
           one token every `--idle-gap-s` (staggered); reported: the busy engine's tok/s
           and the idle engines' token latency after each pause (median, max).

Every engine runs in its own fresh process (StreamedLlama, one llama.cpp thread unless
`--threads`), loads, evaluates its prompt and decodes `--warmup` untimed tokens, then
waits; all start the window at the same instant. The daemons' counters (hits, misses,
bytes read, the daemons' CPU; local hits included) are read just before the window and
after the engines have exited: hit rate, bytes read, read rate and daemon CPU are over
the window, summed over the setup's daemons (`hit_rate_by_daemon` per daemon). With
`--cap`, the daemons and the engines of a setup run in one cgroup v1 memory group of
that limit (a fresh one per setup; root). The page cache of the model is dropped
before each setup.

Each engine also reports its wait for compute turns (issue 46 item 3: a shared daemon
hands turns out among its engines, a private daemon has one engine); `--turns off` runs
the engines with MOED_TURNS=0. `--daemon-config` / `--shared-config` set daemon config keys
on every daemon / the shared one only (e.g. `--shared-config reader_threads=32`: the
private setup has N daemons' reader threads).

Prints one JSON line per setup, then per point: both setups' figures, the ratios shared
/ private (measured in the same run), and the goals beside them:
  unequal: busy engine shared >= 1.3x private; idle engines' token after a pause shared
           <= 1.0x private (no slower);
  equal:   aggregate shared >= 1.0x private.

Commands (`--cap` needs root and the cgroup v1 memory controller):
    .venv/bin/python bench/tenants.py --quick                  # smoke run, about 2-3 minutes
    .venv/bin/python bench/tenants.py                          # the figures, about 12-15 minutes
    .venv/bin/python bench/tenants.py --cap 6GiB               # the same inside one 6 GiB cap
    .venv/bin/python bench/tenants.py --routing random --geometry q30 --budget 4GiB --cap 6GiB \\
        --activity unequal --engines 2                         # q30's real size (writes 17.3 GB once)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import select
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from engine_vs_mmap import CGROUP_ROOT, Cgroup, drop_page_cache  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
TRACES_DIR = ROOT.parent / "shared" / "traces" / "nvmoe"
TRACES = {"olmoe": TRACES_DIR / "olmoe-all.tokens.jsonl", "dsv2lite": TRACES_DIR / "dsv2lite-all.tokens.jsonl"}
MODEL_DIR = "/tmp/moed-bench-tenants"
SKELETON_DIR = f"{MODEL_DIR}/skeletons"
GEOMETRIES = {
    # Qwen3-30B-A3B's real size: bench/real_size.py's model (17.3 GB at Q4_0).
    "q30": dict(layers=48, experts=128, used=8, embd=2048, ff=768),
    # q30's routing (128 experts, top-8) on fewer, thinner layers: 2.7 GB.
    "mid": dict(layers=16, experts=128, used=8, embd=1024, ff=768),
    # The smoke run's: 0.3 GB.
    "tiny": dict(layers=8, experts=128, used=8, embd=512, ff=256),
}
TEMPERATURE = 1.5
SEED = 1234
N_CTX = 4096
SKELETONS_MADE: set[str] = set()  # models whose skeleton an engine of this run has written
GOALS = {"busy": 1.3, "aggregate": 1.0, "idle_latency": 1.0}  # shared / private


# ---- the engine side (a child process) -------------------------------------


class Decoder:
    """One engine's decode steps: the trace's routes of its segment, `start` onwards (the
    route hook), or the model's own router on sampled tokens."""

    def __init__(self, llm, routes, start: int, segment: int):
        self.llm, self.routes = llm, routes
        self.start, self.segment, self.steps = start, segment, 0
        self.token = llm.token_bos()

    def _route_next(self) -> None:
        """The next token routed as the trace's: the segment's tokens in order, wrapping
        within the segment (never into the next engine's, which only the shared daemon
        would have read)."""
        self.routes.start(trace_token(self.start, self.segment, self.steps))
        self.steps += 1

    @property
    def wrapped(self) -> bool:
        return self.steps > self.segment

    def prompt(self, n: int, seed: int) -> None:
        import numpy as np

        rng = np.random.default_rng(seed)
        tokens = [self.llm.token_bos()] + [int(t) for t in rng.integers(300, self.llm.n_vocab(), n - 1)]
        if self.routes is not None:
            tokens = tokens[:1]  # the trace has no prompt tokens: one token starts the replay
            self._route_next()
        self.llm.eval(tokens)

    def step(self) -> None:
        llm = self.llm
        fresh = llm.n_tokens >= N_CTX - 1
        if fresh:  # the context is full: start over (the routes carry on)
            llm.reset()
        if self.routes is not None:
            self._route_next()
        elif not fresh:
            self.token = int(llm.sample(temp=TEMPERATURE, top_k=0, top_p=1.0, min_p=0.0))
        llm.eval([self.token])


def run_engine(spec: dict) -> dict:
    from moed.client import Client
    from moed.engines.llama_cpp import StreamedLlama

    routes = None
    if spec["trace"]:
        from trace_routes import TraceRoutes

        routes = TraceRoutes(spec["trace"], spec["recall"])
    kw: dict = dict(n_ctx=N_CTX, n_batch=32, n_ubatch=32, seed=SEED + spec["index"], verbose=False)
    if spec["threads"] != "auto":
        kw.update(n_threads=int(spec["threads"]), n_threads_batch=int(spec["threads"]))
    client = Client(spec["socket"], f"tenants-{spec['index']}")
    t0 = time.perf_counter()
    llm = StreamedLlama(
        spec["model"],
        client=client,
        route_hook=routes,
        predict_hook=routes.predict if routes is not None and spec["prefetch"] != "off" else None,
        prefetch=spec["prefetch"],
        skeleton_dir=SKELETON_DIR,
        **kw,
    )
    out: dict = {"engine": spec["index"], "role": spec["role"], "load_s": round(time.perf_counter() - t0, 2)}
    dec = Decoder(llm, routes, spec["trace_start"], spec["segment"])
    dec.prompt(spec["prompt"], SEED + spec["index"])
    for _ in range(spec["warmup"]):
        dec.step()
    print("ready", flush=True)
    start, end = (float(x) for x in sys.stdin.readline().split()[1:3])
    time.sleep(max(0.0, start - time.monotonic()))  # the window opens for every engine at once
    if spec["role"] == "idle":
        out.update(idle_loop(dec, start, end, spec["idle_gap_s"], spec["phase"]))
    else:
        out.update(busy_loop(dec, start, end))
    if routes is not None:
        out["wrapped"] = dec.wrapped
    llm.close()
    client.close()
    return out


def busy_loop(dec: Decoder, start: float, end: float) -> dict:
    stall0, turn0, cpu0, n = dec.llm.streamer.stats.acquire_s, turn_wait_s(dec.llm), time.process_time(), 0
    now = time.monotonic()
    while now < end:
        dec.step()
        n += 1
        now = time.monotonic()
    took = now - start
    return {
        "tokens": n,
        "tok_s": round(n / took, 3),
        "cpu_ms_per_token": round(1e3 * (time.process_time() - cpu0) / max(n, 1), 1),
        "stall_ms_per_token": round(1e3 * (dec.llm.streamer.stats.acquire_s - stall0) / max(n, 1), 1),
        # waiting for a compute turn (issue 46, item 3: the daemon's turns among its engines)
        "turn_wait_ms_per_token": round(1e3 * (turn_wait_s(dec.llm) - turn0) / max(n, 1), 1),
    }


def turn_wait_s(llm) -> float:
    """The engine's time spent waiting for compute turns so far (0 with turns off)."""
    turns = getattr(llm, "compute_turns", None)
    return float(getattr(turns, "wait_s", 0.0))


def idle_loop(dec: Decoder, start: float, end: float, gap_s: float, phase: float) -> dict:
    """One token every `gap_s`, the first at start + gap_s * (1 + phase); each one's latency."""
    latencies = []
    at, turn0 = start + gap_s * (1 + phase), turn_wait_s(dec.llm)
    while at < end:
        time.sleep(max(0.0, at - time.monotonic()))
        t = time.perf_counter()
        dec.step()
        latencies.append(round(1e3 * (time.perf_counter() - t), 1))
        at += gap_s
    turn_ms = 1e3 * (turn_wait_s(dec.llm) - turn0)
    return {
        "tokens": len(latencies),
        "idle_ms": latencies,
        "turn_wait_ms_per_token": round(turn_ms / max(1, len(latencies)), 1),
    }


# ---- routing streams (pure) -------------------------------------------------


def segment_starts(n_tokens: int, n_engines: int) -> list[int]:
    """Where engine i's replay starts: the trace cut into `n_engines` equal segments."""
    if n_engines < 1 or n_tokens < n_engines:
        raise ValueError(f"cannot cut {n_tokens} tokens into {n_engines} segments")
    return [i * n_tokens // n_engines for i in range(n_engines)]


def trace_token(start: int, segment: int, step: int) -> int:
    """The trace token an engine's `step`-th token replays: its segment in order, again
    from the segment's start once it has replayed all of it."""
    return start + step % segment


def idle_phases(n_engines: int) -> list[float]:
    """The idle engines' phases (engine 0 is busy): spread over one gap, so their tokens
    do not all come at once."""
    idle = n_engines - 1
    return [0.0] + [(i - 1) / idle for i in range(1, n_engines)]


# ---- the driver --------------------------------------------------------------


def model_for(args, routing: str) -> tuple[str, dict]:
    """The model file for a routing kind (written once) and its geometry."""
    if routing == "random":
        geo = dict(GEOMETRIES[args.geometry])
        geo.update({k: getattr(args, k) for k in ("layers", "experts", "used", "embd", "ff") if getattr(args, k)})
    else:
        from moed.traces import Trace

        t = Trace.load(TRACES[routing])
        geo = dict(layers=t.moe_layers, experts=t.n_experts, used=t.top_k, embd=args.trace_embd, ff=args.trace_ff)
    if geo == GEOMETRIES["q30"]:
        from real_size import ensure_model

        return ensure_model("q30"), geo
    path = f"{MODEL_DIR}/{geo['layers']}x{geo['experts']}x{geo['used']}-{geo['embd']}x{geo['ff']}-q4_0.gguf"
    if not os.path.exists(path):
        from moed.modelgen.makemodel import make_model

        os.makedirs(MODEL_DIR, exist_ok=True)
        print(f"writing {path} ...", file=sys.stderr, flush=True)
        heads = max(4, geo["embd"] // 64)
        shape = {k: int(v) for k, v in geo.items()}
        make_model(
            path,
            layers=shape["layers"],
            experts=shape["experts"],
            used=shape["used"],
            embd=shape["embd"],
            ff=shape["ff"],
            heads=heads,
            kv_heads=4,
            quant="q4_0",
            align=4096,
            random_experts=True,
            ctx=N_CTX,
        )
    return path, geo


class Joined:
    """The driver inside `group` while the setup runs, so the daemons and the engines it
    starts are in the cap from their first page; moved back to its own group after."""

    def __init__(self, group: Cgroup | None):
        self.group = group
        self.home = CGROUP_ROOT / own_memory_cgroup().lstrip("/")

    def __enter__(self) -> Joined:
        if self.group is not None:
            (self.group.path / "cgroup.procs").write_text(str(os.getpid()))
        return self

    def __exit__(self, *exc) -> None:
        if self.group is not None:
            (self.home / "cgroup.procs").write_text(str(os.getpid()))
            self.group.remove()


def own_memory_cgroup() -> str:
    """This process's cgroup v1 memory group ("/" at the root)."""
    for line in open("/proc/self/cgroup"):
        _, controllers, path = line.rstrip("\n").split(":", 2)
        if "memory" in controllers.split(","):
            return path
    return "/"


def run_setup(args, point: dict, setup: str) -> dict:
    from moed.protocol.sizes import parse_size
    from moed.testing import DaemonProcess

    n, model = point["engines"], point["model"]
    budgets = [point["budget_bytes"]] if setup == "shared" else [point["budget_bytes"] // n] * n
    extra = ("--mem-floor", args.mem_floor) if args.mem_floor else ()
    config = daemon_config(args.daemon_config)
    if setup == "shared":
        config.update(daemon_config(args.shared_config))
    group = Cgroup(f"moed-tenants-{os.getpid()}-{setup}", parse_size(args.cap)) if args.cap else None
    drop_page_cache(model)
    logs = pathlib.Path(tempfile.mkdtemp(prefix="moed-tenants-"))
    with Joined(group):
        daemons = [DaemonProcess(str(b), *extra, config=config) for b in budgets]
        procs: list[subprocess.Popen] = []
        try:
            ready: set[int] = set()
            for i in range(n):
                procs.append(spawn_engine(args, point, i, daemons[0 if setup == "shared" else i].socket, logs))
                if model not in SKELETONS_MADE:
                    # The model's first load writes its skeleton: one engine alone, since engines
                    # writing it together can each map a copy that another then renames over
                    # (StreamedLlama then fails: "llama.cpp did not mmap <skeleton>").
                    wait_ready(procs, ready, logs, args.timeout_s)
                    SKELETONS_MADE.add(model)
            wait_ready(procs, ready, logs, args.timeout_s)
            before = [daemon_stats(d) for d in daemons]
            start = time.monotonic() + 0.5
            for p in procs:
                assert p.stdin is not None
                p.stdin.write(f"go {start} {start + args.window_s}\n")
                p.stdin.flush()
            engines = [finish(p, i, logs, args.window_s + args.timeout_s) for i, p in enumerate(procs)]
            after = [daemon_stats(d) for d in daemons]
            took_s = time.monotonic() - start
            peak = group.stats() if group is not None else None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for d in daemons:
                d.close()
    row = {**{k: v for k, v in point.items() if k != "model"}, "setup": setup, "engine_rows": engines}
    row.update(daemon_window(before, after))
    row["read_gbps"] = round(row["bytes_read"] / took_s / 1e9, 3)  # the window, until the last engine exited
    if peak is not None:
        row.update(cgroup_peak_bytes=peak["max_usage_bytes"], cgroup_failcnt=peak["failcnt"])
    return row


def daemon_config(spec: str | None) -> dict:
    """`reader_threads=32,chunk_bytes=262144`: daemon config keys (moed --config), as TOML values."""
    out: dict = {}
    for item in (spec or "").split(","):
        if item:
            key, _, value = item.partition("=")
            out[key] = int(value) if value.lstrip("-").isdigit() else {"true": True, "false": False}.get(value, value)
    return out


def spawn_engine(args, point: dict, i: int, socket: str, logs: pathlib.Path) -> subprocess.Popen:
    n = point["engines"]
    spec = {
        "index": i,
        "model": point["model"],
        "socket": socket,
        "role": "idle" if point["activity"] == "unequal" and i > 0 else "busy",
        "trace": str(TRACES[point["routing"]]) if point["routing"] in TRACES else None,
        "trace_start": point["starts"][i],
        "segment": point["segment"],
        "recall": args.recall,
        "prefetch": args.prefetch,
        "threads": args.threads,
        "prompt": args.prompt,
        "warmup": args.warmup,
        "idle_gap_s": args.idle_gap_s,
        "phase": idle_phases(n)[i],
    }
    env = {**os.environ, **({"MOED_TURNS": "0"} if args.turns == "off" else {})}
    return subprocess.Popen(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(logs / f"engine-{i}.log", "w"),
        text=True,
    )


def wait_ready(procs: list[subprocess.Popen], ready: set[int], logs: pathlib.Path, timeout_s: float) -> None:
    """Until every engine not in `ready` has loaded and warmed up (then adds it)."""
    deadline = time.monotonic() + timeout_s
    for i, p in enumerate(procs):
        if i in ready:
            continue
        assert p.stdout is not None
        ok, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
        line = p.stdout.readline() if ok else ""
        if line.strip() != "ready":
            raise RuntimeError(f"engine {i} did not load ({line.strip()!r}): {tail(logs, i)}")
        ready.add(i)


def finish(p: subprocess.Popen, i: int, logs: pathlib.Path, timeout_s: float) -> dict:
    try:
        out, _ = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        raise RuntimeError(f"engine {i} did not finish: {tail(logs, i)}") from None
    if p.returncode != 0:
        raise RuntimeError(f"engine {i} exited {p.returncode}: {tail(logs, i)}")
    return json.loads(out.strip().splitlines()[-1])


def tail(logs: pathlib.Path, i: int) -> str:
    return (logs / f"engine-{i}.log").read_text(errors="replace")[-1500:]


def daemon_stats(daemon) -> dict:
    with daemon.client("tenants-bench") as c:
        return c.stats()


def daemon_window(before: list[dict], after: list[dict]) -> dict:
    """Hits, misses and bytes read over the window, summed over the setup's daemons."""
    keys = ("hits", "misses", "joined_reads", "local_hits", "bytes_read", "evictions", "cpu_user_s", "cpu_system_s")
    d = {k: sum(a[k] - b[k] for a, b in zip(after, before)) for k in keys}
    d["daemon_cpu_s"] = round(d.pop("cpu_user_s") + d.pop("cpu_system_s"), 2)
    # Mean socket acquire (request to grant, on the loop) and read (submitted to done) times.
    for name in ("acquire_latency_s", "read_latency_s"):
        n = sum(a[name]["count"] - b[name]["count"] for a, b in zip(after, before))
        took = sum(a[name]["sum_s"] - b[name]["sum_s"] for a, b in zip(after, before))
        d[name.replace("latency_s", "ms_mean")] = round(1e3 * took / n, 2) if n else None
    return {**d, "hit_rate": _rate(d), "hit_rate_by_daemon": [_rate(_delta(a, b)) for a, b in zip(after, before)]}


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in ("hits", "misses")}


def _rate(d: dict) -> float | None:
    acc = d["hits"] + d["misses"]
    return round(d["hits"] / acc, 4) if acc else None


def summary(row: dict) -> dict:
    """The figures of one setup that the ratios compare."""
    rows = row["engine_rows"]
    busy = [r["tok_s"] for r in rows if r["role"] == "busy"]
    tokens = sum(r["tokens"] for r in rows)
    if row["activity"] == "equal":
        out = {"aggregate_tok_s": round(sum(busy), 3), "min_tok_s": min(busy), "max_tok_s": max(busy)}
        out["turn_wait_ms_per_token"] = round(statistics.mean(r["turn_wait_ms_per_token"] for r in rows), 1)
    else:
        idle = [ms for r in rows if r["role"] == "idle" for ms in r["idle_ms"]]
        out = {"busy_tok_s": busy[0], "idle_tokens": len(idle)}
        out["busy_turn_wait_ms_per_token"] = rows[0]["turn_wait_ms_per_token"]
        out["idle_turn_wait_ms_per_token"] = round(
            statistics.mean(r["turn_wait_ms_per_token"] for r in rows if r["role"] == "idle"), 1
        )
        if idle:
            out.update(idle_ms_median=round(statistics.median(idle), 1), idle_ms_max=max(idle))
    out.update(
        hit_rate=row["hit_rate"],
        bytes_read=row["bytes_read"],
        read_gbps=row["read_gbps"],
        daemon_cpu_s=row["daemon_cpu_s"],
        acquire_ms_mean=row["acquire_ms_mean"],
        read_ms_mean=row["read_ms_mean"],
        mb_read_per_token=round(row["bytes_read"] / max(tokens, 1) / 1e6, 2),
    )
    return out


def ratios(shared: dict, private: dict, activity: str) -> list[tuple[str, float | None, str]]:
    """(what, figure, goal verdict) for one point: ratios shared / private, hit rates
    as the difference in points."""

    def ratio(key: str) -> float | None:
        a, b = shared.get(key), private.get(key)
        return round(a / b, 3) if a is not None and b else None

    def verdict(r: float | None, goal: float, higher: bool) -> str:
        if r is None:
            return "no figure"
        met = r >= goal if higher else r <= goal
        return f"goal {'>=' if higher else '<='} {goal}: {'met' if met else 'MISSED'}"

    if activity == "equal":
        r = ratio("aggregate_tok_s")
        out = [("shared / private aggregate tok/s", r, verdict(r, GOALS["aggregate"], True))]
    else:
        r = ratio("busy_tok_s")
        out = [("shared / private busy engine tok/s", r, verdict(r, GOALS["busy"], True))]
        r = ratio("idle_ms_median")
        out.append(("shared / private idle token ms (median)", r, verdict(r, GOALS["idle_latency"], False)))
    a, b = shared.get("hit_rate"), private.get("hit_rate")
    points = round(100 * (a - b), 1) if a is not None and b is not None else None
    out.append(("hit rate shared - private, points", points, ""))
    out.append(("shared / private bytes read", ratio("bytes_read"), ""))
    return out


def points(args) -> list[dict]:
    from moed.gguf.budget import parse_budget
    from moed.traces import Trace

    out = []
    for routing in args.routing.split(","):
        if routing != "random" and routing not in TRACES:
            raise SystemExit(f"unknown routing {routing!r}: random or one of {', '.join(TRACES)}")
        model, geo = model_for(args, routing)
        n_tokens = Trace.load(TRACES[routing]).n_tokens if routing in TRACES else 0
        for n in (int(x) for x in args.engines.split(",")):
            starts = segment_starts(n_tokens, n) if n_tokens else [0] * n
            for activity in args.activity.split(","):
                out.append(
                    dict(
                        routing=routing,
                        engines=n,
                        activity=activity,
                        model=model,
                        geometry=geo,
                        budget_bytes=parse_budget(args.budget, model),
                        starts=starts,
                        segment=n_tokens // n if n_tokens else 0,
                    )
                )
    return out


def setup_order(point: int, rnd: int) -> bool:
    """Shared first? Alternates from point to point and round to round, and (points come in
    pairs of activities) from one point of an activity to the next of the same activity."""
    return (point + point // 2 + rnd) % 2 == 0


def machine() -> str:
    flags = ""
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            flags = " ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in have)
            break
    model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    return (
        f"{model}, {os.cpu_count()} cpus ({flags}), {platform.python_version()}, load average {os.getloadavg()[0]:.1f}"
    )


def print_point(point: dict, shared: list[dict], private: list[dict]) -> None:
    s = median_summary([summary(r) for r in shared])
    p = median_summary([summary(r) for r in private])
    head = f"{point['routing']}, {point['engines']} engines, {point['activity']}"
    print(f"\n{head}: budget {point['budget_bytes'] / 2**20:.0f} MiB in all")
    for name, fig in (("shared", s), ("private", p)):
        print(f"  {name:7s} {json.dumps(fig)}")
    for what, r, verdict in ratios(s, p, point["activity"]):
        print(f"  {what}: {r if r is not None else '-'}  {verdict}".rstrip())
    wrapped = [r["engine"] for row in shared + private for r in row["engine_rows"] if r.get("wrapped")]
    if wrapped:
        print(f"  note: engine(s) {sorted(set(wrapped))} replayed their whole trace segment and started it again")


def median_summary(rows: list[dict]) -> dict:
    keys = rows[0].keys()
    out = {}
    for k in keys:
        vals = [r[k] for r in rows if r.get(k) is not None]
        out[k] = None if not vals else round(statistics.median(vals), 4) if len(vals) > 1 else vals[0]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run of about 2-3 minutes")
    ap.add_argument("--routing", help="random and/or trace names (default random,olmoe,dsv2lite; quick random,olmoe)")
    ap.add_argument("--engines", default="2,4", help="engine counts")
    ap.add_argument("--activity", default="equal,unequal")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), help="random routing's model (default mid; quick tiny)")
    for k in ("layers", "experts", "used", "embd", "ff"):
        ap.add_argument(f"--{k}", type=int, help=f"random routing's model: {k} (overrides --geometry)")
    ap.add_argument("--trace-embd", type=int, help="trace models' hidden size (default 1024; quick 512)")
    ap.add_argument("--trace-ff", type=int, help="trace models' expert ff (default 512; quick 256)")
    ap.add_argument("--budget", default="25%", help="the shared budget: a share of the model's experts or a size")
    ap.add_argument("--cap", help="one cgroup v1 memory limit around each setup (daemons and engines)")
    ap.add_argument("--mem-floor", help="the daemons' --mem-floor (default: the daemon's)")
    ap.add_argument("--daemon-config", help="KEY=VALUE[,...]: config keys for every daemon (moed --config)")
    ap.add_argument("--shared-config", help="KEY=VALUE[,...]: config keys for the shared daemon only")
    ap.add_argument("--threads", default="1", help="llama.cpp threads per engine: N, or auto (pass nothing)")
    ap.add_argument(
        "--turns",
        default="on",
        choices=("on", "off"),
        help="the engines' compute turns (issue 46 item 3); off: MOED_TURNS=0 in every engine",
    )
    ap.add_argument("--prefetch", default="off", choices=("off", "gate", "gate2"))
    ap.add_argument("--recall", type=float, default=0.86, help="trace routing with prefetch: emulated recall")
    ap.add_argument("--window-s", type=float, help="timed window (default 20; quick 4)")
    ap.add_argument("--warmup", type=int, help="untimed tokens before the window (default 32; quick 8)")
    ap.add_argument("--idle-gap-s", type=float, help="unequal: an idle engine's pause (default 3; quick 1.5)")
    ap.add_argument("--prompt", type=int, default=8, help="random routing: prompt tokens, one batch")
    ap.add_argument("--rounds", type=int, default=1, help="repeat every point; medians reported")
    ap.add_argument("--timeout-s", type=float, default=600, help="an engine's load and warm-up, at most")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_engine(json.loads(args.child))))
        return 0
    quick = args.quick
    defaults = dict(
        routing="random,olmoe" if quick else "random,olmoe,dsv2lite",
        geometry="tiny" if quick else "mid",
        trace_embd=512 if quick else 1024,
        trace_ff=256 if quick else 512,
        window_s=4.0 if quick else 20.0,
        warmup=8 if quick else 32,
        idle_gap_s=1.5 if quick else 3.0,
    )
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    t0 = time.monotonic()
    print(f"machine: {machine()}")
    plan = points(args)
    print(
        json.dumps(
            {
                "budget": args.budget,
                "cap": args.cap,
                "threads": args.threads,
                "turns": args.turns,
                "prefetch": args.prefetch,
                "window_s": args.window_s,
                "warmup": args.warmup,
                "idle_gap_s": args.idle_gap_s,
                "models": {p["routing"]: p["geometry"] for p in plan},
            }
        ),
        flush=True,
    )
    results: list[tuple[dict, list[dict], list[dict]]] = []
    for i, point in enumerate(plan):
        runs: dict[str, list[dict]] = {"shared": [], "private": []}
        for rnd in range(args.rounds):
            order = ("shared", "private") if setup_order(i, rnd) else ("private", "shared")
            for setup in order:
                row = run_setup(args, point, setup)
                runs[setup].append(row)
                print(json.dumps(row), flush=True)
        results.append((point, runs["shared"], runs["private"]))
    for point, shared, private in results:
        print_point(point, shared, private)
    print(f"\n{time.monotonic() - t0:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
