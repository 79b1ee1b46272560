"""The GPU fault pass (issue 47, item 5): device-slot engines against stock, case by case.

Shared by tests/e2e/test_gpu_fault_pass.py (the subset CI runs) and bench/gpu_faults.py
(every case, the table in bench/RESULTS.md). A case is a family, S (`gpu_slots`), copy or
zero copy, the asked `n_batch` and a prompt length; the comparison is stock
`llama_cpp.Llama(n_gpu_layers=-1)` (every expert in the device's own memory) at that
`n_batch` where the engine's call went in full batches, and stock fed the same sub-batches
where the engine split it (`eval_batches`).

Every engine runs in a new interpreter (`python -m moed.testing.gpu_faults SPEC`): the
Vulkan device must be chosen before llama.cpp enumerates its backends. One process serves
one configuration (family, S, zero copy, `n_batch`) and reads its prompts in order, shortest
first, each after `reset()`, as a user's engine reads prompt after prompt: a prompt that
fits after a split one must run at the asked `n_batch`. A negative exit status (a signal)
or a Python error fails every case of that process by name; nothing here hangs past
`TIMEOUT_S`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAMILIES = ("qwen3moe", "deepseek2", "gpt-oss", "gemma4")
EXPERTS, USED = 16, 2
SLOTS = (USED, 2 * USED, EXPERTS)  # top-k, 2x top-k, the expert count
PROMPT_LENGTHS = (1, 5, 40, 300)
N_BATCHES = (512, 8)
STEPS = 4  # greedy decode steps after each prompt, compared too
N_CTX = 512
TIMEOUT_S = 900
# lavapipe is a CPU-type device ggml uses only where named; Vulkan's op fusion off, as the
# engine's callback splits the device's graph where stock would fuse (tests/e2e/conftest.py).
VULKAN_ENV = {"GGML_VK_VISIBLE_DEVICES": "0", "GGML_VK_DISABLE_FUSION": "1"}
# The daemon holds a layer's every expert at once (S = the expert count must not meet the
# budget: a split here is the slots'), and fewer than the model's, so it evicts.
COPY_BUDGET = "1MiB"  # tiny geometry: ~24 KiB a moed slot, 64 experts
ZERO_COPY_BUDGET = "4MiB"  # aligned geometry: ~204 KiB a moed slot, 48-64 experts
ROOT = Path(__file__).resolve().parents[2]
TEXT = b"the expert model reads memory pages from the drive, one token at a time; "


@dataclass(frozen=True)
class EngineSetup:
    """One engine process: the cases of every prompt length share it."""

    arch: str
    slots: int
    zero_copy: bool
    n_batch: int

    @property
    def name(self) -> str:
        return f"{self.arch} S={self.slots}{' zero-copy' if self.zero_copy else ''} n_batch={self.n_batch}"


@dataclass
class Case:
    """One prompt of one configuration, and what it gave."""

    config: EngineSetup
    length: int
    batches: list[int]  # the engine's decodes of the prompt call (eval_batches)
    n_batch_after: int  # the engine's n_batch after the call: the asked one, always
    result: str  # "bit-exact", "max diff X", or "FAIL: why"
    ok: bool
    vs_unsplit: str = ""  # a split call against stock's unsplit call at the asked n_batch

    def row(self) -> str:
        c = self.config
        split = "whole" if self.batches == unsplit(self.length, c.n_batch) else compact(self.batches)
        return (
            f"| {c.arch} | {c.slots} | {'yes' if c.zero_copy else 'no'} | {c.n_batch} | {self.length} | "
            f"{split} | {'pass' if self.ok else 'FAIL'}: {self.result}{self.vs_unsplit} |"
        )


TABLE_HEAD = (
    "| family | S | zero copy | n_batch | prompt | the call's decodes | result (against stock on the same decodes) |\n"
    "|---|---|---|---|---|---|---|"
)


def unsplit(n_tokens: int, n_batch: int) -> list[int]:
    return [min(n_batch, n_tokens - i) for i in range(0, n_tokens, n_batch)]


def compact(batches: list[int]) -> str:
    """[4, 2, 2, 2, 1] -> "4, 2 (x3), 1"."""
    runs: list[list[int]] = []
    for b in batches:
        if runs and runs[-1][0] == b:
            runs[-1][1] += 1
        else:
            runs.append([b, 1])
    return ", ".join(f"{b} (x{n})" if n > 1 else str(b) for b, n in runs)


def model_kwargs(arch: str, zero_copy: bool) -> dict:
    """make_model's arguments: 16 experts, top-2, room for the 300-token prompt; zero copy at
    the arch's page-aligned geometry (its parts whole pages, as moed's slots need)."""
    from moed.modelgen.makemodel import aligned_geometry

    geometry = aligned_geometry(arch=arch) if zero_copy else {}
    return {"arch": arch, "experts": EXPERTS, "used": USED, "ctx": 1024, **geometry}


def configs(families=FAMILIES, slots=SLOTS, zero_copy=(False, True), n_batches=N_BATCHES) -> list[EngineSetup]:
    return [EngineSetup(a, s, z, n) for a in families for z in zero_copy for s in slots for n in n_batches]


# ---------------------------------------------------------------------- the engine (child side)


def prompt(llm, length: int) -> list[int]:
    tokens = llm.tokenize(TEXT * (1 + 2 * length // len(TEXT)))
    assert len(tokens) >= length, f"the text makes {len(tokens)} tokens, {length} wanted"
    return tokens[:length]


def child(spec: dict) -> None:
    """Each job `[length, batches]` in order, after `reset()`: the prompt (one eval(), or stock
    fed `batches`), then STEPS greedy steps; logits to `out/L.npy`, one JSON line of facts."""
    import numpy as np

    from moed.protocol.errors import MoedError

    kw = dict(
        n_ctx=N_CTX, n_batch=spec["n_batch"], n_ubatch=spec["n_batch"], logits_all=True, n_threads=2, verbose=False
    )
    kw.update(seed=0, n_gpu_layers=-1)
    client: Any = None
    llm: Any
    if spec["which"] == "stock":
        import llama_cpp

        llm = llama_cpp.Llama(model_path=spec["model"], **kw)
    else:
        from moed.client import Client
        from moed.engines.llama_cpp import StreamedLlama

        client = Client(spec["socket"], "gpu-fault-pass")
        llm = StreamedLlama(
            spec["model"], client=client, gpu_slots=spec["slots"], gpu_zero_copy=spec["zero_copy"], **kw
        )
    report = []
    for i, (length, batches) in enumerate(spec["jobs"]):
        tokens = prompt(llm, length)
        llm.reset()
        fact: dict = {"length": length}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                for j, n in enumerate(batches or [length]):
                    llm.eval(tokens[sum((batches or [])[:j]) :][:n])
            except MoedError as exc:  # a typed error is a failed case, not a dead pass
                fact["error"] = f"{type(exc).__name__}: {exc}"
        fact["batches"] = batches or list(getattr(llm, "eval_batches", unsplit(length, spec["n_batch"])))
        fact["n_batch_after"] = llm.n_batch
        fact["warnings"] = [str(w.message)[:300] for w in caught if "moed" in str(w.message)]
        if "error" not in fact:
            rows = [llm.scores[: llm.n_tokens].copy()]
            for _ in range(STEPS):
                llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
                rows.append(llm.scores[llm.n_tokens - 1 : llm.n_tokens].copy())
            np.save(Path(spec["out"]) / f"{i}.npy", np.concatenate(rows))
        report.append(fact)
    if client is not None:
        report.append({"gpu_slots": {k: v for k, v in llm.stream_stats()["gpu_slots"].items() if k != "per_layer"}})
    llm.close()
    if client is not None:
        client.close()
    print(json.dumps(report))


# ---------------------------------------------------------------------- the pass (parent side)


def run(spec: dict) -> list[dict]:
    """One child; its report, or a RuntimeError naming the exit status and the end of stderr."""
    env = {**os.environ, **VULKAN_ENV, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "moed.testing.gpu_faults", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT_S,
    )
    if proc.returncode != 0:
        what = f"signal {-proc.returncode}" if proc.returncode < 0 else f"rc {proc.returncode}"
        raise RuntimeError(f"{spec['which']} engine: {what}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def engine(config: EngineSetup, model: str, socket: str, lengths, out: Path) -> list[dict] | str:
    """The engine's facts for each prompt length (logits in out/I.npy), or why its process failed."""
    spec = dict(which="engine", model=model, socket=socket, slots=config.slots, zero_copy=config.zero_copy)
    try:
        return run({**spec, "n_batch": config.n_batch, "jobs": [[n, None] for n in lengths], "out": str(out)})[:-1]
    except RuntimeError as exc:
        return str(exc)


def stock(model: str, n_batch: int, jobs: set[tuple[int, tuple[int, ...]]], out: Path) -> dict[tuple, Path | str]:
    """Stock's logits for each `(length, decodes)`: {(length, decodes): file}, in one process.
    When that process dies (stock llama.cpp itself: gemma4's page-aligned model on lavapipe
    died with SIGSEGV in llama_decode after a reset, at n_batch 512, for the prompts 1, 5, 40
    and 300 in a row, each alone fine), each job runs in a process of its own, and a job
    whose process still dies maps to why (a str) instead of a file."""
    order = sorted(jobs)
    out.mkdir(parents=True, exist_ok=True)

    def one_process(todo: list[tuple[int, tuple[int, ...]]], where: Path) -> dict[tuple, Path | str]:
        where.mkdir(parents=True, exist_ok=True)
        spec = dict(which="stock", model=model, n_batch=n_batch, jobs=[[n, list(b)] for n, b in todo], out=str(where))
        run(spec)
        return {job: where / f"{i}.npy" for i, job in enumerate(todo)}

    try:
        return one_process(order, out)
    except RuntimeError:
        pass
    found: dict[tuple, Path | str] = {}
    for i, job in enumerate(order):
        try:
            found.update(one_process([job], out / f"alone-{i}"))
        except RuntimeError as exc:
            found[job] = f"no reference: {str(exc).splitlines()[0]}"
    return found


def check_configs(configs: list[EngineSetup], model: str, socket: str, lengths=PROMPT_LENGTHS, out=None) -> list[Case]:
    """Run each configuration's engine (one model, one n_batch) over `lengths`, then one stock
    process for every call those engines made, and compare prompt by prompt."""
    import numpy as np

    (n_batch,) = {c.n_batch for c in configs}
    out = Path(out or tempfile.mkdtemp(prefix="gpu-faults-"))
    runs = {}
    for config in configs:
        mine = out / config.name.replace(" ", "_").replace("=", "")
        mine.mkdir(parents=True, exist_ok=True)
        runs[config] = (mine, engine(config, model, socket, lengths, mine))
    jobs = {(n, tuple(unsplit(n, n_batch))) for n in lengths}
    jobs |= {(f["length"], tuple(f["batches"])) for _, facts in runs.values() if isinstance(facts, list) for f in facts}
    want = stock(model, n_batch, jobs, out / f"stock-{n_batch}")
    cases = []
    for config, (mine, facts) in runs.items():
        if isinstance(facts, str):
            cases += [Case(config, n, [], -1, facts.splitlines()[0], False) for n in lengths]
            continue
        for i, f in enumerate(facts):
            n, batches = f["length"], f["batches"]
            case = Case(config, n, batches, f["n_batch_after"], "", True)
            if "error" in f:
                case.result, case.ok = f["error"][:200], False
            elif isinstance(ref := want[(n, tuple(batches))], str):  # stock itself died on this job
                case.result, case.ok = ref, False
            else:
                got = np.load(mine / f"{i}.npy")
                case.result, case.ok = compare(got, np.load(ref))
                whole = want[(n, tuple(unsplit(n, n_batch)))]
                if batches != unsplit(n, n_batch):
                    diff = compare(got, np.load(whole))[0] if not isinstance(whole, str) else "no reference"
                    case.vs_unsplit = f" (stock's whole call: {diff})"
            if case.n_batch_after != n_batch:
                case.result, case.ok = f"{case.result}; n_batch left at {case.n_batch_after}", False
            cases.append(case)
    return cases


def compare(got, want) -> tuple[str, bool]:
    """("bit-exact", True), or the largest difference (False)."""
    import numpy as np

    if got.shape != want.shape:
        return f"shapes {got.shape} and {want.shape}", False
    if not (got.view(np.uint32) != want.view(np.uint32)).any():
        return "bit-exact", True
    return f"max diff {float(np.abs(got - want).max()):.3g}", False


if __name__ == "__main__":
    warnings.simplefilter("default")
    child(json.loads(sys.argv[1]))
