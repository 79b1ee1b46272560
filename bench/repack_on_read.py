"""Repack on read's CPU: the transform's MB/s against the drive's raw read rate, same run.

Run: .venv/bin/python bench/repack_on_read.py [--geometry q30] [--layers 6] [--threads 8]

Writes (once, under /tmp/moed-bench-repack/) plain models at Qwen3-30B-A3B's expert
geometry (2048 x 768 parts, 64 experts a layer, page-aligned, random blocks): one
Q4_0 and one in llama.cpp's q4_k_m recipe (Q4_K gate/up, Q6_K or Q4_K down). For
each, on disjoint layers of the same file (so no phase reads what another read):

1. raw: the drive's O_DIRECT read rate, 1 MiB reads (the daemon's chunk), `--threads`
   in flight, over the expert extents of the first layers;
2. transform: moed.gguf.interleave on those bytes, one expert part at a time (the
   daemon's unit), one thread: MB/s and CPU seconds per GB (thread time), per layout,
   with moed._interleave's C moves (what the daemon runs when built) and with numpy's;
3. daemon: a real daemon (budget one layer, so every miss evicts; `--threads` readers)
   reading the next layers' experts through acquires, opened plain and then in the
   layout, on other layers each: GB/s, the daemon process's CPU seconds per GB read,
   and its own `repack_cpu_s / repacked_bytes`.

The layout is the one this host's llama.cpp computes each type on when llama_cpp is
installed (moed.engines.kernels.layout_of), else AVX2's (q4_0_8x8, q4_K_8x8). Prints
one line per measurement and a JSON summary; page cache dropped before each phase.

With `--engines`, the engines instead, as bench/real_size.py runs them (its q30 model,
17.3 GB of Q4_0; daemon and engine in one `--cap` cgroup, a `--budget` daemon, page
cache dropped, `--prompt` tokens then `--tokens` sampled, prefetch "gate"), rounds
interleaved: StreamedLlama on the plain file with repack="auto" (experts made on read),
with repack="dense" (plain experts), and on its `moectl align --repack` copy (written
once beside it). Per run: prompt and decode tok/s, bytes read, the daemon's repack CPU.

    python bench/repack_on_read.py --engines [--prompt 502] [--tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import pathlib
import platform
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_vs_mmap import drop_page_cache  # noqa: E402

CHUNK = 1 << 20
GEOMETRIES = {
    "q30": dict(experts=64, used=8, embd=2048, ff=768, heads=32, kv_heads=4),  # Qwen3-30B-A3B's parts
    "small": dict(experts=16, used=4, embd=512, ff=256, heads=8, kv_heads=2),  # a quick check of the script
}
AVX2 = {"Q4_0": "q4_0_8x8", "Q4_K": "q4_K_8x8"}


def ensure_model(geometry: str, layers: int, recipe: str) -> str:
    from moed.modelgen.makemodel import make_model

    path = f"/tmp/moed-bench-repack/{geometry}-{layers}-{recipe}.gguf"
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        print(f"writing {path} ...", file=sys.stderr, flush=True)
        kw = dict(quant="q4_0") if recipe == "q4_0" else dict(recipe=recipe)
        make_model(path, layers=layers, **GEOMETRIES[geometry], **kw, align=4096, random_experts=True)
    return path


def layouts_here(cat) -> dict[str, str]:
    """{type: layout} the engine on this host would ask for (what it computes on)."""
    try:
        from moed.engines import kernels

        found = {
            p.type_name: kernels.layout_of(p.ggml_type, p.shape[:2])
            for e in cat.layers.values()
            for p in e.parts.values()
        }
        return {t: v for t, v in found.items() if v != kernels.PLAIN}
    except ImportError:
        return {t: v for t, v in AVX2.items() if t in cat.expert_types}


def extents(cat, layers) -> list[tuple[str, int, int, object]]:
    """(path, offset, length, extent) of every expert part of `layers`."""
    return [
        (p.path, p.expert_offset(e), p.bytes_per_expert, p)
        for layer in layers
        for e in range(cat.n_experts)
        for p in cat.layers[layer].parts.values()
    ]


def raw_read(cat, layers, threads: int) -> tuple[float, list[tuple[bytes, object]]]:
    """GB/s of O_DIRECT reads of `layers`' experts in 1 MiB pieces; the parts' bytes, kept."""
    parts = extents(cat, layers)
    chunks = [(k, pos, min(CHUNK, n - pos)) for k, (_, _, n, _) in enumerate(parts) for pos in range(0, n, CHUNK)]
    fds = {p: os.open(p, os.O_RDONLY | os.O_DIRECT) for p in cat.files}
    out = [bytearray(n) for _, _, n, _ in parts]
    lock = threading.Lock()
    it = iter(chunks)

    def work():
        buf = mmap.mmap(-1, CHUNK + 8192)
        while True:
            with lock:
                c = next(it, None)
            if c is None:
                return
            k, pos, n = c
            path, off, _, _ = parts[k]
            start = off + pos - (off + pos) % 4096
            end = -(-(off + pos + n) // 4096) * 4096
            os.preadv(fds[path], [memoryview(buf)[: end - start]], start)
            out[k][pos : pos + n] = buf[off + pos - start : off + pos - start + n]

    t0 = time.perf_counter()
    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    total = sum(n for _, _, n, _ in parts)
    return total / dt / 1e9, [(bytes(b), p[3]) for b, p in zip(out, parts)]


def transform_rate(parts, made: dict[str, str]) -> dict[str, dict]:
    """Per layout and implementation (moed._interleave's C moves, numpy's): MB/s (wall) and
    CPU s/GB (thread time) of transforming each part once."""
    from moed.gguf import interleave

    rows = {}
    impls = [("c", True)] if interleave.native_moves is not None else []
    for type_name, layout in sorted(made.items()):
        mine = [(b, p) for b, p in parts if p.type_name == type_name]
        out = np.empty(max(len(b) for b, _ in mine), np.uint8)
        for impl, native in [*impls, ("numpy", False)]:
            t0, c0 = time.perf_counter(), time.thread_time()
            for b, p in mine:
                interleave.transform(layout, b, out[: len(b)], p.shape[0], p.shape[1], native=native)
            dt, cpu = time.perf_counter() - t0, time.thread_time() - c0
            n = sum(len(b) for b, _ in mine)
            rows[f"{layout} ({impl})"] = {"mb_s": n / dt / 1e6, "cpu_s_per_gb": cpu / (n / 1e9), "bytes": n}
    return rows


def through_daemon(model: str, cat, layers, layout: str, threads: int) -> dict:
    """A daemon of one layer's budget reading `layers` (the first warms): GB/s and its CPU per GB."""
    import psutil

    from moed.gguf.budget import slot_bytes
    from moed.testing import DaemonProcess

    warm, layers = layers[:1], layers[1:]
    one_layer = cat.n_experts * slot_bytes(cat.layers[warm[0]])
    d = DaemonProcess(str(one_layer), "--reader-threads", str(threads))
    try:
        c = d.client("bench")
        h = c.open_model(model, expert_layout=layout)
        k = cat.n_expert_used
        for i in range(0, cat.n_experts, k):
            h.acquire(warm[0], list(range(i, i + k))).release()
        proc = psutil.Process(d.proc.pid)
        s0, cpu0 = c.stats(), proc.cpu_times()
        t0 = time.perf_counter()
        for layer in layers:
            for i in range(0, cat.n_experts, k):
                h.acquire(layer, list(range(i, i + k))).release()
        dt = time.perf_counter() - t0
        cpu1, s = proc.cpu_times(), c.stats()
        c.close()
        n = s["bytes_read"] - s0["bytes_read"]
        cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
        repacked = s["repacked_bytes"] - s0["repacked_bytes"]
        return {
            "layout": h.expert_layout,
            "gb_s": n / dt / 1e9,
            "daemon_cpu_s_per_gb": cpu / (n / 1e9),
            "repack_cpu_s_per_gb": (s["repack_cpu_s"] - s0["repack_cpu_s"]) / (repacked / 1e9) if repacked else 0.0,
            "repacked_share": repacked / n,
        }
    finally:
        d.stop()


def cpu_line() -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    flags = " ".join(x for x in ("avx2", "avx512f", "avx512bw", "avx512vnni", "amx_int8") if x in have)
                    break
    except OSError:
        name = platform.processor()
    return f"{name}, {os.cpu_count()} CPUs, {flags}"


# ---- the engines (--engines) ------------------------------------------------


def engine_child(model: str, socket: str, repack: str, prompt: int, tokens: int, threads: int) -> dict:
    """bench/real_size.py's moed-gate run, with `repack`."""
    import real_size

    import moed.engines.llama_cpp as lc

    base = lc.StreamedLlama

    class WithRepack(base):  # type: ignore[misc, valid-type]
        def __init__(self, *a, **kw):
            super().__init__(*a, repack=repack, **kw)

    lc.StreamedLlama = WithRepack  # type: ignore[misc]
    return real_size.run_engine("moed-gate", model, socket, prompt, tokens, threads)


def repacked_copy(model: str) -> str:
    out = model[: -len(".gguf")] + "-repacked.gguf"
    if not os.path.exists(out):
        import subprocess

        print(f"moectl align --repack {model} {out} ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "moed.ctl", "align", "--repack", model, out], check=True)
    return out


def run_engines(args) -> int:
    import statistics
    import subprocess

    import real_size
    from engine_vs_mmap import Cgroup, with_daemon

    from moed.client import Client
    from moed.protocol.sizes import parse_size

    plain = args.model or real_size.ensure_model("q30")
    copy = repacked_copy(plain)
    # name -> (model, repack, daemon config): "before" is the plain file as it ran before
    # issue 41 (plain kernels, RAM-tier pages made at their first fill)
    known = {
        "on-read": (plain, "auto", ""),
        "dense": (plain, "dense", ""),
        "file": (copy, "auto", ""),
        "before": (plain, "dense", "prefault = false\n"),
    }
    unknown = [v for v in args.variants.split(",") if v not in known]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}: choose from {sorted(known)}")
    variants = [(v, *known[v]) for v in args.variants.split(",")]
    drive = real_size.drive_rate(plain)
    print(
        json.dumps({"cpu": cpu_line(), "drive": drive, "cap": args.cap, "budget": args.budget, "prompt": args.prompt})
    )
    runs: dict[str, list[dict]] = {name: [] for name, *_ in variants}
    for _ in range(args.rounds):
        for name, model, repack, config in variants:
            for path in (plain, copy):
                drop_page_cache(path)
            group = Cgroup(f"moed-repack-{os.getpid()}-{name}", parse_size(args.cap))

            def one(sock, model=model, repack=repack, group=group):
                cmd = [*group.prefix(), sys.executable, __file__, "--child", repack, "--model", model, "--socket", sock]
                cmd += ["--prompt", str(args.prompt), "--tokens", str(args.tokens), "--threads", "2"]
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
                if proc.returncode != 0:
                    return {"error": proc.stderr[-1500:]}
                out = json.loads(proc.stdout.strip().splitlines()[-1])
                with Client(sock, "bench") as c:
                    s = c.stats()
                (row,) = s["models"]
                out.update(layout=row["expert_layout"], repacked_bytes=s["repacked_bytes"])
                out.update(repack_cpu_s=round(s["repack_cpu_s"], 2), bytes_read=s["bytes_read"])
                return out

            extra: tuple[str, ...] = ()
            if config:
                conf = pathlib.Path(f"/tmp/moed-repack-{os.getpid()}-{name}.toml")
                conf.write_text(config)
                extra = ("--config", str(conf))
            try:
                res = with_daemon(None, args.budget, group, one, extra=extra)
            finally:
                group.remove()
            res["variant"] = name
            runs[name].append(res)
            print(json.dumps(res), flush=True)
    print(f"\nmedians over {args.rounds} round(s), prompt {args.prompt} tokens, cap {args.cap}, budget {args.budget}:")
    med = {}
    for name, rows in runs.items():
        ok = [r for r in rows if "error" not in r]
        if ok:
            med[name] = {k: statistics.median(r[k] for r in ok) for k in ("prefill_tok_s", "decode_tok_s")}
            print(f"  {name:8s} {json.dumps(med[name])}  ({', '.join(str(r['prefill_tok_s']) for r in ok)})")
    if "on-read" in med and "file" in med:
        for k in ("prefill_tok_s", "decode_tok_s"):
            print(f"  on-read / file {k}: {med['on-read'][k] / med['file'][k]:.3f}")
            for other in ("dense", "before"):
                if other in med:
                    print(f"  on-read / {other} {k}: {med['on-read'][k] / med[other][k]:.3f}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="q30")
    ap.add_argument("--layers", type=int, default=6, help="layers per model: 2 raw, 2 plain, 2 in the layout")
    ap.add_argument("--threads", type=int, default=8, help="reads in flight (raw) and the daemon's readers")
    ap.add_argument("--engines", action="store_true", help="run the engines instead (see above)")
    ap.add_argument("--model", help="--engines: the plain model (default: bench/real_size.py's q30)")
    ap.add_argument("--cap", default="6GiB")
    ap.add_argument("--budget", default="4GiB")
    ap.add_argument("--prompt", type=int, default=502)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default="on-read,dense,file", help="--engines: any of on-read,dense,file,before")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(engine_child(args.model, args.socket, args.child, args.prompt, args.tokens, 2)))
        return 0
    if args.engines:
        return run_engines(args)
    from moed.gguf.catalog import Catalog

    print(f"cpu: {cpu_line()}")
    summary = {"cpu": cpu_line(), "geometry": args.geometry, "threads": args.threads, "models": {}}
    for recipe in ("q4_0", "q4_k_m"):
        model = ensure_model(args.geometry, args.layers, recipe)
        cat = Catalog.open(model)
        made = layouts_here(cat)
        from moed.gguf.layouts import summary as layout_summary

        layout = layout_summary(made, cat.expert_types)
        third = max(2, len(cat.moe_layers) // 3)
        raw_layers, plain_layers, made_layers = (
            cat.moe_layers[:third],
            cat.moe_layers[third : 2 * third],
            cat.moe_layers[2 * third :],
        )
        drop_page_cache(model)
        gb_s, parts = raw_read(cat, raw_layers, args.threads)
        rates = transform_rate(parts, made)
        drop_page_cache(model)
        plain = through_daemon(model, cat, plain_layers, "", args.threads)
        drop_page_cache(model)
        on_read = through_daemon(model, cat, made_layers, layout, args.threads) if made else None
        print(f"{recipe} ({os.path.getsize(model) / 1e9:.2f} GB, experts {layout} on this host):")
        print(f"  raw O_DIRECT read, 1 MiB x {args.threads} in flight: {gb_s * 1e3:.0f} MB/s")
        for name, r in rates.items():
            print(
                f"  transform {name}, one thread: {r['mb_s']:.0f} MB/s "
                f"({r['mb_s'] / (gb_s * 1e3):.2f}x the read rate), {r['cpu_s_per_gb']:.3f} CPU-s/GB"
            )
        print(
            f"  daemon, plain: {plain['gb_s'] * 1e3:.0f} MB/s read, {plain['daemon_cpu_s_per_gb']:.3f} daemon CPU-s/GB"
        )
        if on_read:
            print(
                f"  daemon, {on_read['layout']} made on read: {on_read['gb_s'] * 1e3:.0f} MB/s read, "
                f"{on_read['daemon_cpu_s_per_gb']:.3f} daemon CPU-s/GB "
                f"(of which repack {on_read['repack_cpu_s_per_gb'] * on_read['repacked_share']:.3f}; "
                f"{on_read['repacked_share']:.0%} of the bytes repacked)"
            )
        summary["models"][recipe] = {
            "file_gb": os.path.getsize(model) / 1e9,
            "raw_read_mb_s": gb_s * 1e3,
            "transform": rates,
            "daemon_plain": plain,
            "daemon_on_read": on_read,
        }
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
