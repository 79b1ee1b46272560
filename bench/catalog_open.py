"""The daemon's catalog open on real models' headers, beside gguf.GGUFReader on the same files.

The daemon parses a model's header on every first `open_model` (in its opener
thread: `moed.daemon.models.open_catalog`), so that must stay fast for the big
models people run. Goal: at most 100 ms for each header. This writes two sparse
GGUFs with the real header (metadata, tokenizer, tensor table, Q4_K_M types) of
Qwen3-30B-A3B and of DeepSeek-V3 (`moed.modelgen.sparse_headers`; 18.6 GB and 404 GB
apparent, a few MB on disk) and times, on each:

- `open_catalog(path)`: `--repeat` times, median and p90;
- the baseline in the same run: `gguf.GGUFReader(path)` (`--baseline-repeat`
  times; it builds a numpy view per array element), and llama.cpp's own header
  and vocabulary load (`vocab_only`, through llama-cpp-python, when installed);
- a real daemon (`--daemon`, on by default): `open_model` round trips, each on a
  new file identity (the file's times are bumped, so the daemon parses the
  header again), and one on an identity it already has open (no parse).

Catalog samples are taken in rounds between the baseline runs, so a change of
load on a shared box hits both.

    .venv/bin/python bench/catalog_open.py [--dir DIR] [--repeat 60] [--baseline-repeat 3] [--no-daemon]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import gguf

from moed.daemon.models import open_catalog
from moed.modelgen.sparse_headers import HeaderSpec, deepseek_v3, qwen3_30b_a3b, write_sparse

GOAL_MS = 100.0
MODELS: dict[str, Callable[[], HeaderSpec]] = {"Qwen3-30B-A3B": qwen3_30b_a3b, "DeepSeek-V3": deepseek_v3}


def timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[8] if len(xs) > 1 else xs[0]


def ms(x: float) -> str:
    return f"{x * 1e3:,.1f} ms"


class LlamaVocabLoad:
    """llama.cpp's own header and vocabulary load (`vocab_only`), its log silenced."""

    def __init__(self, llama_cpp):
        self.llama_cpp = llama_cpp
        self.quiet = llama_cpp.llama_log_callback(lambda level, text, user_data: None)  # kept alive by self
        llama_cpp.llama_log_set(self.quiet, None)
        self.params = llama_cpp.llama_model_default_params()
        self.params.vocab_only = True

    def __call__(self, path: str) -> None:
        model = self.llama_cpp.llama_model_load_from_file(path.encode(), self.params)
        if model is None:
            raise RuntimeError(f"llama.cpp did not load {path} (vocab_only)")
        self.llama_cpp.llama_model_free(model)


def llama_vocab_loader() -> LlamaVocabLoad | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    return LlamaVocabLoad(llama_cpp)


def daemon_round_trips(path: str, n: int) -> tuple[list[float], float]:
    """(first opens, each on a fresh identity; an open of an identity already open)."""
    from moed.testing import DaemonProcess

    fresh: list[float] = []
    with DaemonProcess("64MiB") as d, d.client("bench") as c:
        for i in range(n + 1):
            os.utime(path, ns=(i * 1_000_000_000, i * 1_000_000_000))  # new ctime: a new identity
            t = time.perf_counter()
            c.open_model(path)
            fresh.append(time.perf_counter() - t)
        again = min(timed(c.open_model, path) for _ in range(5))
    return fresh[1:], again  # the first also maps the hold region and segments


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="where to write the sparse models (default: a temp dir in /tmp)")
    ap.add_argument("--repeat", type=int, default=60, help="catalog opens per model")
    ap.add_argument("--baseline-repeat", type=int, default=3, help="GGUFReader and llama.cpp loads per model")
    ap.add_argument("--daemon-repeat", type=int, default=20, help="open_model round trips per model")
    ap.add_argument("--no-daemon", action="store_true")
    args = ap.parse_args()
    rounds = max(1, args.baseline_repeat)
    llama_load = llama_vocab_loader()
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="moed-catalog-", dir=args.dir or "/tmp") as tmp:
        for name, make in MODELS.items():
            spec = make()
            path = os.path.join(tmp, name + ".gguf")
            size = write_sparse(path, spec)
            cat = open_catalog(path)  # warm: the header's pages are in the page cache from here on
            reader = gguf.GGUFReader(path)
            assert cat.moe_layers == spec.moe_layers and len(reader.tensors) == len(spec.tensors)
            del reader
            ours: list[float] = []
            theirs: list[float] = []
            llama: list[float] = []
            for r in range(rounds):
                ours += [timed(open_catalog, path) for _ in range(args.repeat // rounds + (r < args.repeat % rounds))]
                theirs.append(timed(gguf.GGUFReader, path))
                if llama_load is not None:
                    llama.append(timed(llama_load, path))
            row = {
                "model": name,
                "apparent_gb": size / 1e9,
                "on_disk_mb": os.stat(path).st_blocks * 512 / 1e6,
                "tensors": len(spec.tensors),
                "vocab": spec.vocab,
                "layers": f"{len(cat.moe_layers)} MoE x {cat.n_experts}",
                "n": len(ours),
                "median": statistics.median(ours),
                "p90": p90(ours),
                "reader": statistics.median(theirs),
                "llama": statistics.median(llama) if llama else None,
            }
            if not args.no_daemon:
                fresh, again = daemon_round_trips(path, args.daemon_repeat)
                row |= {"rt_median": statistics.median(fresh), "rt_p90": p90(fresh), "rt_cached": again}
            os.unlink(path)
            rows.append(row)
    print(f"load average at end:   {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for r in rows:
        verdict = "met" if r["median"] * 1e3 <= GOAL_MS else "NOT met"
        print(
            f"\n{r['model']}: {r['layers']} experts, {r['tensors']} tensors, vocab {r['vocab']:,}, "
            f"{r['apparent_gb']:.1f} GB apparent, {r['on_disk_mb']:.1f} MB on disk"
        )
        print(f"  open_catalog         median {ms(r['median'])}  p90 {ms(r['p90'])}  (n={r['n']})  goal {verdict}")
        print(f"  gguf.GGUFReader      median {ms(r['reader'])}  (n={rounds})  ratio {r['reader'] / r['median']:,.0f}x")
        if r["llama"] is not None:
            print(
                f"  llama.cpp vocab_only median {ms(r['llama'])}  (n={rounds})  ratio {r['llama'] / r['median']:.2f}x"
            )
        if "rt_median" in r:
            print(
                f"  open_model round trip, new identity: median {ms(r['rt_median'])}  p90 {ms(r['rt_p90'])}  "
                f"(n={args.daemon_repeat}); already open: {ms(r['rt_cached'])}"
            )


if __name__ == "__main__":
    main()
