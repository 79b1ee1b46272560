"""The GPU fault pass (issue 47, item 5): every case, as a table for bench/RESULTS.md.

Run (lavapipe, the software Vulkan device, counts as a GPU only when named):

    GGML_VK_VISIBLE_DEVICES=0 GGML_VK_DISABLE_FUSION=1 .venv/bin/python bench/gpu_faults.py \
        [--families qwen3moe,deepseek2,gpt-oss,gemma4] [--slots 2,4,16] [--copy-only] [--lengths 1,5,40,300]

Families qwen3moe, deepseek2, gpt-oss and gemma4, each a generated model of 16 experts,
top-2 (4 layers; zero copy at the family's page-aligned geometry); S (`gpu_slots`) at
top-k, 2x top-k and the expert count; copying slots and zero copy; prompts of 1, 5, 40 and
300 tokens at `n_batch` 512 and 8. One engine process per (family, S, zero copy, n_batch)
reads the prompts in that order, each after `reset()`; one stock
`llama_cpp.Llama(n_gpu_layers=-1)` process per (family, zero copy, n_batch) computes every
call the engines made: at the asked `n_batch` where the engine's call went in full batches,
fed the same sub-batches where it was split (the split call's figure against stock's whole
call is given too). A case passes when its logits (the prompt's rows and 4 greedy steps)
are bit-exact with stock's on the same decodes and `n_batch` is still the asked one after
the call. Prints one JSON line per case and the markdown table (moed.testing.gpu_faults).
The subset CI runs is tests/e2e/test_gpu_fault_pass.py.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moed.testing import DaemonProcess  # noqa: E402
from moed.testing import gpu_faults as gf  # noqa: E402


def ensure_model(arch: str, zero_copy: bool, model_dir: pathlib.Path) -> str:
    from moed.modelgen.makemodel import make_model

    kw = gf.model_kwargs(arch, zero_copy)
    path = model_dir / ("-".join(f"{k}{v}" for k, v in sorted(kw.items())) + ".gguf")
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        make_model(path, **kw)
    return str(path)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(gf.FAMILIES))
    ap.add_argument("--slots", default=",".join(map(str, gf.SLOTS)))
    ap.add_argument("--n-batches", default=",".join(map(str, gf.N_BATCHES)))
    ap.add_argument("--lengths", default=",".join(map(str, gf.PROMPT_LENGTHS)))
    ap.add_argument("--copy-only", action="store_true", help="no zero-copy cases")
    ap.add_argument("--zero-copy-only", action="store_true")
    ap.add_argument("--model-dir", default="/tmp/moed-bench-gpu-faults")
    args = ap.parse_args()
    probe = "import llama_cpp\nfrom moed.engines.devices import gpu_devices\nprint('|'.join(gpu_devices()))"
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    device = found.stdout.strip().splitlines()[-1] if found.stdout.strip() else ""
    if not device:
        raise SystemExit("no GPU device ggml sees (lavapipe: set GGML_VK_VISIBLE_DEVICES=0)")
    zero_copy = [z for z in (False, True) if not (z and args.copy_only) and not (not z and args.zero_copy_only)]
    lengths = ints(args.lengths)
    print(json.dumps({"device": device, "lengths": lengths, "steps": gf.STEPS}), flush=True)
    cases: list[gf.Case] = []
    t0 = time.monotonic()
    out = pathlib.Path(tempfile.mkdtemp(prefix="gpu-faults-"))
    for arch in args.families.split(","):
        for z in zero_copy:
            model = ensure_model(arch, z, pathlib.Path(args.model_dir))
            with DaemonProcess(gf.ZERO_COPY_BUDGET if z else gf.COPY_BUDGET) as daemon:
                for n_batch in ints(args.n_batches):
                    group = [gf.EngineSetup(arch, s, z, n_batch) for s in ints(args.slots)]
                    got = gf.check_configs(group, model, daemon.socket, lengths, out / f"{arch}-{z}-{n_batch}")
                    for c in got:
                        print(json.dumps({**vars(c), "config": c.config.name}), flush=True)
                    cases += got
    failed = [c for c in cases if not c.ok]
    print(f"\n{device}; {len(cases)} cases, {len(failed)} failed, {time.monotonic() - t0:.0f} s\n")
    print(gf.TABLE_HEAD)
    for c in cases:
        print(c.row())


if __name__ == "__main__":
    main()
