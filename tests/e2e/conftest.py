"""e2e fixtures: the real daemon (moed.testing.DaemonProcess), llama.cpp reference runs,
and a model with one expert the drive cannot read (`bad_expert`, for the read-error tests).

Every e2e test's body runs in a fresh fork of the test process (tests/forked.py): an
engine started in a test starts as a user's first engine does, whatever ran before.
Reference logits are cached on disk for the run, since a body's memory dies with it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

LLAMA_KW = dict(n_ctx=256, n_batch=64, n_ubatch=64, logits_all=True, n_threads=2, verbose=False, seed=0)
PROMPT = b"the expert model reads memory pages from the drive, one token at a time"


def greedy_logits(
    llm, tokens: list[int], steps: int = 32, batches: list[int] | None = None, split: list[int] | None = None
) -> np.ndarray:
    """Logits of every prompt position (one eval() call) and of `steps` greedy decode steps.
    `batches`: feed the prompt in these sub-batches instead, one eval() each (stock fed the
    split a StreamedLlama made of its prompt); `split`: a list that receives the sizes of the
    prompt's decodes (StreamedLlama's `eval_batches`; one batch for stock)."""
    llm.reset()
    for i, n in enumerate(batches or [len(tokens)]):
        llm.eval(tokens[sum((batches or [])[:i]) :][:n])
    if split is not None:
        split[:] = batches or getattr(llm, "eval_batches", [len(tokens)])
    rows = [llm.scores[: llm.n_tokens].copy()]
    for _ in range(steps):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        rows.append(llm.scores[llm.n_tokens - 1 : llm.n_tokens].copy())
    return np.concatenate(rows)


def unsplit(n_tokens: int, n_batch: int = LLAMA_KW["n_batch"]) -> list[int]:
    """The decodes of an eval() of `n_tokens` in full batches (what `split` is when nothing was split)."""
    return [min(n_batch, n_tokens - i) for i in range(0, n_tokens, n_batch)]


def assert_bit_equal(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape
    differ = a.view(np.uint32) != b.view(np.uint32)
    assert not differ.any(), (
        f"{int(differ.any(axis=1).sum())} of {a.shape[0]} rows differ, max |diff| {float(np.abs(a - b).max())}"
    )


def resident_logits(path, repack: str) -> tuple[list[int], np.ndarray]:
    """Resident llama.cpp on the kernels StreamedLlama(repack=...) computes on: "auto" is stock
    `llama_cpp.Llama` itself (the experts of a plain file are repacked on read, issue 41),
    "dense" and "off" are UnpackedLlama's."""
    import llama_cpp

    from moed.engines.llama_cpp import UnpackedLlama

    if repack == "auto":
        on_read_or_skip(path)
        llm = llama_cpp.Llama(str(path), **LLAMA_KW)
    else:
        llm = UnpackedLlama(str(path), repack=repack, **LLAMA_KW)
    try:
        tokens = llm.tokenize(PROMPT)
        return tokens, greedy_logits(llm, tokens)
    finally:
        llm.close()


def on_read_or_skip(path) -> dict[str, str]:
    """{type: layout} StreamedLlama(repack="auto") asks the daemon to make on read for this plain
    file on this CPU; skips where this CPU repacks an expert type the daemon does not make (stock
    then computes it repacked and the engine plain: no one reference for both)."""
    from moed.engines.repack import on_read_layouts
    from moed.gguf.catalog import EXPERT_RE
    from moed.gguf.header import read_split

    made, left = on_read_layouts([t for h in read_split(str(path)) for t in h.tensors if EXPERT_RE.match(t.name)])
    if left:
        pytest.skip(f"this CPU computes {left} on layouts the daemon does not make on read")
    return made


def plain_reference_logits(path) -> tuple[list[int], np.ndarray]:
    """Resident llama.cpp on the plain kernels: the reference of StreamedLlama(repack="off")."""
    return resident_logits(path, "off")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Each e2e test body in its own fork (tests/forked.py)."""
    from tests.forked import in_process, run_forked

    if in_process():
        return None
    run_forked(pyfuncitem)
    return True


@pytest.fixture(scope="session")
def reference_logits(llama_cpp, tmp_path_factory):
    """`reference_logits(path)`: resident llama.cpp on the same kernels as StreamedLlama's
    default on a plain file: stock `llama_cpp.Llama` (dense weights on CPU_REPACK as stock
    puts them, experts too where this CPU repacks their type: the daemon makes that layout
    on read), cached per model on disk (test bodies run in forks, so a cache in memory
    would die with each one)."""
    import hashlib

    cache_dir = tmp_path_factory.mktemp("reference-logits")

    def get(path) -> tuple[list[int], np.ndarray]:
        st = Path(path).stat()
        key = hashlib.sha1(f"{path}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
        out = cache_dir / f"{key}.npz"
        if out.exists():
            with np.load(out) as z:
                return [int(t) for t in z["tokens"]], z["logits"]
        tokens, logits = resident_logits(str(path), "auto")
        tmp = cache_dir / f"{key}.{os.getpid()}.npz"
        np.savez(tmp, tokens=np.asarray(tokens, np.int64), logits=logits)
        tmp.rename(out)
        return tokens, logits

    return get


# ---- one expert the drive cannot read ------------------------------------------------

ROUTE_TEXTS = [b"the expert model", b"one token at a time", b"reads memory pages", b"from the drive", b"zq", b"xv"]


class BadExpert(NamedTuple):
    """A model on btrfs with one expert's `down` block unreadable (EIO), and two prompts."""

    path: Path  # the copy on the loop btrfs, one 4 KiB block of the expert corrupted
    pristine: Path  # the same model, readable
    a: bytes  # a prompt whose batch routes to the bad expert
    b: bytes  # one whose batch does not
    a_tokens: list[int]
    b_tokens: list[int]
    layer: int
    expert: int


def prompt_routes(path, texts) -> dict[bytes, tuple[list[int], dict[int, set[int]]]]:
    """text -> (its tokens, layer -> experts its prompt batch routed to), on the pristine model
    (computed in a fork: fixtures call it, and the test process never runs an engine)."""
    from tests.forked import call_forked

    return call_forked(_prompt_routes, str(path), list(texts))


def _prompt_routes(path, texts) -> dict[bytes, tuple[list[int], dict[int, set[int]]]]:
    from moed.engines.llama_cpp import StreamedLlama
    from moed.testing import DaemonProcess

    seen: dict[int, set[int]] = defaultdict(set)

    def hook(layer, ids) -> None:
        seen[layer].update(int(e) for e in ids.ravel() if e >= 0)

    out = {}
    with DaemonProcess("64MiB") as d, d.client("routes") as c:
        llm = StreamedLlama(str(path), client=c, route_hook=hook, prefetch="off", repack="off", **LLAMA_KW)
        try:
            for text in texts:
                tokens = llm.tokenize(text)
                seen.clear()
                llm.reset()
                llm.eval(tokens)
                out[text] = (tokens, {k: set(v) for k, v in seen.items()})
        finally:
            llm.close()
    return out


@contextlib.contextmanager
def bad_expert(model_factory, texts=ROUTE_TEXTS) -> Iterator[BadExpert]:
    """A model whose one expert only prompt A's batch routes to reads EIO (root, btrfs).

    The routes are found on the pristine model with no prefetch and the plain
    kernels (so the engines under test must run that way too); the model's parts
    are page-aligned, so the 4 KiB overwritten under the filesystem
    (moed.testing.faultfs) are that expert's alone. Skips where a loop btrfs
    cannot be made; the filesystem goes when the context ends.
    """
    from moed.gguf.catalog import Catalog
    from moed.testing import faultfs

    if why := faultfs.unavailable():
        pytest.skip(f"real EIO needs a loop btrfs: {why}")
    src = model_factory(embd=256, ff=256, align=4096)  # page-aligned parts: one block is one expert's
    routes = prompt_routes(src, texts)
    for a, b in itertools.permutations(texts, 2):
        (ta, ra), (tb, rb) = routes[a], routes[b]
        only_a = [(layer, e) for layer in sorted(ra) for e in sorted(ra[layer] - rb.get(layer, set()))]
        if only_a:
            break
    else:
        pytest.fail("no prompt pair routes apart: every prompt uses every expert")
    layer, expert = only_a[0]
    with faultfs.LoopBtrfs() as fs:
        path = fs.copy_in(src, "bad.gguf")
        _, off, _ = Catalog.open(str(path)).extent(layer, expert, "down")
        fs.corrupt(path, off + 2 * 4096)
        yield BadExpert(path, Path(src), a, b, ta, tb, layer, expert)


# ---- a Vulkan device (the GPU tests: test_gpu_hybrid, test_gpu_faults, test_gpu_slots) --------

ROOT = Path(__file__).resolve().parents[2]
# lavapipe, Mesa's software Vulkan device, is a CPU-type device ggml uses only where named; Vulkan's
# op fusion off, as the engines' callbacks split the device's graph where stock would fuse.
VULKAN_ENV = {"GGML_VK_VISIBLE_DEVICES": "0", "GGML_VK_DISABLE_FUSION": "1"}
PROBE = "import llama_cpp\nfrom moed.engines.devices import gpu_devices\nprint('|'.join(gpu_devices()))"


@pytest.fixture(scope="module")
def vulkan_device() -> str:
    """The Vulkan device's name, or a skip saying what is missing."""
    env = {**os.environ, **VULKAN_ENV, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    devices = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if not devices:
        pytest.skip(
            "no Vulkan device: this llama.cpp was built without GGML_VULKAN, or no Vulkan driver "
            "(lavapipe: mesa-vulkan-drivers) is installed; scripts/setup-system installs both where it can"
        )
    return devices


def greedy_steps(llm, tokens: list[int], rows: list, steps: int = 32):
    """`greedy_logits` one eval at a time: yields after each, appending its logits to `rows`."""
    llm.reset()
    llm.eval(tokens)
    rows.append(llm.scores[: llm.n_tokens].copy())
    yield
    for _ in range(steps):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        rows.append(llm.scores[llm.n_tokens - 1 : llm.n_tokens].copy())
        yield
