"""Device expert slots (moed.engines.device_slots): the routed experts on the Vulkan device, fed from moed.

Every layer on the device (`n_gpu_layers=-1`), its experts left in the CPU's buffer at
load (`-ot exps=CPU`) and replaced, before the context exists, by S < n_expert device
slots a layer; at each `ffn_moe_weights-L` the engine's callback reads the top-k ids,
acquires the experts no slot holds from the real daemon (whose budget evicts), uploads
them, and writes the slot ids back. Checked bit for bit against stock
`llama_cpp.Llama(n_gpu_layers=-1)`, which loads and computes every expert on the device,
on lavapipe (GGML_VK_VISIBLE_DEVICES=0), with Vulkan's op fusion off in both
(GGML_VK_DISABLE_FUSION=1: the callback splits the device's graph where stock fuses).

The engine is `StreamedLlama(n_gpu_layers=-1, gpu_slots=S)`, run by `_child` in a new
interpreter, with the real daemon's grants as the bytes. With `gpu_zero_copy=True`
(moed.engines.device_host) the device reads the experts in place from moed's RAM tier
(its segments imported with buffer_from_host_ptr) and the ids become moed slots: nothing
is uploaded, and the same comparison holds.

Every engine runs in a new interpreter: the device must be chosen before llama.cpp first
enumerates its backends, and a test process never computes with llama.cpp.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

from tests.e2e.conftest import LLAMA_KW, PROMPT, ROOT, VULKAN_ENV, assert_bit_equal, unsplit

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")

GEOMETRY = dict(experts=16, used=2)  # 16 experts, 2 a token: S=8 holds any 4-token batch
STEPS = 16

# ---------------------------------------------------------------------- the engines (child side)


def prompt_tokens(llm, kind: str) -> list[int]:
    tokens = llm.tokenize(PROMPT)
    if kind == "short":  # 4 tokens: at most 8 experts a layer
        return tokens[:4]
    if kind == "pair":  # 2 tokens: at most 4
        return tokens[:2]
    if kind == "repeat":  # one token 40 times: every row routes alike, k experts a layer
        return [tokens[1]] * 40
    return tokens


def _child(argv: list[str]) -> None:
    """which model out socket S prompt n_batch [batches]: one engine's greedy logits and stats, as
    JSON. `batches` (stock only; "16,16,8"): feed the prompt in these sub-batches, one eval()
    each, as a streamed engine split it (its `eval_batches`). With the "long" prompt the engine
    then reads a short prompt that fits (`<out>.after.npy`), to show the call after a split
    runs in full batches again."""
    which, model, out, socket, slots, prompt, n_batch, *rest = argv
    batches = [int(n) for n in rest[0].split(",")] if rest and rest[0] else None
    kw = {**LLAMA_KW, "n_gpu_layers": -1, "n_batch": int(n_batch), "n_ubatch": int(n_batch)}
    if which == "stock":
        import llama_cpp

        llm, client = llama_cpp.Llama(model_path=model, **kw), None
    else:
        from moed.client import Client
        from moed.engines.llama_cpp import StreamedLlama

        client = Client(socket, "gpu-slots")
        zero_copy = which == "zero-copy"
        llm = StreamedLlama(model, client=client, gpu_slots=int(slots), gpu_zero_copy=zero_copy, **kw)
    tokens = prompt_tokens(llm, prompt)
    llm.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # StreamedLlama says when it splits a call, naming the limit
        for i, n in enumerate(batches or [len(tokens)]):
            llm.eval(tokens[sum((batches or [])[:i]) :][:n])
    rows = [llm.scores[: llm.n_tokens].copy()]
    split = list(getattr(llm, "eval_batches", [len(tokens)]))
    for _ in range(STEPS):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        rows.append(llm.scores[llm.n_tokens - 1 : llm.n_tokens].copy())
    np.save(out, np.concatenate(rows))
    stats = {
        "batches": split if batches is None else batches,
        # the asked n_batch where the prompt went in full batches, else its split's largest decode
        "n_batch": int(n_batch) if split == unsplit(len(tokens), int(n_batch)) else max(split),
        "n_batch_after": llm.n_batch,  # what the engine keeps for the next call
        "prompt_tokens": len(tokens),
        "warnings": [str(w.message) for w in caught],
    }
    if prompt == "long":  # a prompt that fits, right after: one decode at the asked n_batch
        llm.reset()
        short = prompt_tokens(llm, "pair")  # 2 tokens: at most 4 experts a layer, within S=4
        llm.eval(short)
        np.save(str(out) + ".after.npy", llm.scores[: llm.n_tokens].copy())
        stats["after_batches"] = list(getattr(llm, "eval_batches", [len(short)]))
    if client is not None:
        st = llm.stream_stats()
        stats["gpu_slots"], stats["devices"] = st["gpu_slots"], st["devices"]
        daemon = client.stats()
        stats["daemon_evictions"] = daemon["evictions"]
        stats["engines"] = [what for c in daemon["clients"] for _, what in c["engines"]]
    llm.close()  # its last DeviceReport goes before the close, on this connection: the daemon has it now
    if client is not None:
        after = client.stats()
        mine = [d for c in after["clients"] if c["pid"] == os.getpid() for d in c.get("devices", [])]
        stats["daemon_device_rows"] = mine
        stats["daemon_device_sums"] = {
            k: after[f"device_{k}"] for k in ("hits", "uploads", "upload_bytes", "evictions")
        }
        client.close()
    print(json.dumps(stats))


# ---------------------------------------------------------------------- the tests (test process side)


def run_engine(which, model, tmp_path, *, socket="", slots=8, prompt="short", n_batch=64, tag="", batches=()) -> tuple:
    out = tmp_path / f"{which}-{prompt}-{n_batch}{tag}.npy"
    env = {**os.environ, **VULKAN_ENV, "PYTHONPATH": str(ROOT)}
    code = "import sys\nfrom tests.e2e.test_gpu_slots import _child\n_child(sys.argv[1:])"
    args = [which, str(model), str(out), socket, str(slots), prompt, str(n_batch), ",".join(map(str, batches))]
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    ), out


def finish(started, what: str) -> tuple[np.ndarray, dict]:
    proc, out = started
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"{what}: rc {proc.returncode}\n{stderr[-3000:]}"
    return np.load(out), json.loads(stdout.strip().splitlines()[-1])


def engine(which, model, tmp_path, **kw) -> tuple[np.ndarray, dict]:
    return finish(run_engine(which, model, tmp_path, **kw), which)


def check_reported(stats: dict) -> None:
    """The daemon saw the engine's device counters (issue 47: `moectl stats`, --json, /metrics):
    its connection's row equals the engine's own totals once it closed (the last report)."""
    g = stats["gpu_slots"]
    (row,) = stats["daemon_device_rows"]
    assert row["zero_copy"] == g.get("zero_copy", False)
    for key in ("slots", "layers", "hits", "uploads", "upload_bytes", "evictions"):
        assert row[key] == g[key], f"{key}: the daemon says {row[key]}, the engine {g[key]}"
    for key, total in stats["daemon_device_sums"].items():
        assert total >= g[key], f"device_{key}: the daemon's sum {total} below this engine's {g[key]}"


def check_slots(stats: dict, slots: int) -> None:
    assert stats["devices"]["experts"] == "GPU slots" and stats["devices"]["gpu_slots"] == slots
    check_reported(stats)
    assert stats["engines"] and all(f"their experts in {slots} device slots a layer" in e for e in stats["engines"])
    g = stats["gpu_slots"]
    assert g["slots"] == slots and g["layers"] > 0
    assert g["uploads"] > 0 and g["upload_bytes"] > 0 and g["hits"] > 0
    assert g["evictions"] > 0, "S below the expert count must evict device slots"
    assert stats["daemon_evictions"] > 0, "the budget must force the daemon to evict"


@pytest.mark.parametrize(
    "arch, slots, prompt",
    [
        ("qwen3moe", 8, "short"),
        ("deepseek2", 8, "short"),
        ("gpt-oss", 8, "short"),
        ("gemma4", 4, "pair"),  # the test model routes to 6 of its 16 experts: fewer slots, so they evict
        ("qwen35moe", 8, "short"),
    ],
)
def test_slots_on_the_device_match_stock_computing_every_expert_there(
    vulkan_device, model_factory, start_daemon, tmp_path, arch, slots, prompt
):
    """A prompt whose experts fit the slots (4 tokens in 8 of 16 slots) and 16 greedy steps,
    bit for bit; gpt-oss's expert biases (add_id) and gemma4's fused gate_up and per-expert
    scale (get_rows) are indexed by slot too."""
    model = model_factory(arch=arch, **GEOMETRY)
    stock = run_engine("stock", model, tmp_path, prompt=prompt)
    daemon = start_daemon("256KiB")
    got, stats = engine("slots", model, tmp_path, socket=daemon.socket, slots=slots, prompt=prompt)
    want, _ = finish(stock, "stock")
    assert stats["n_batch"] == 64, "the prompt's experts fit the slots: one batch"
    assert_bit_equal(got, want)
    check_slots(stats, slots)


def test_a_prompt_whose_experts_exceed_the_slots_is_split_and_matches_stock_on_the_same_split(
    vulkan_device, model_factory, start_daemon, tmp_path
):
    """The call is split for itself alone (issue 47): its logits equal stock's fed the same
    sub-batches, the warning names the device slots, and the next prompt, which fits, runs in
    one batch at the asked n_batch, bit-exact with stock there."""
    model = model_factory(**GEOMETRY)
    daemon = start_daemon("256KiB")
    got, stats = engine("slots", model, tmp_path, socket=daemon.socket, slots=4, prompt="long")
    check_split(stats, "the device slots (gpu_slots=4 a layer)")
    want, _ = engine("stock", model, tmp_path, prompt="long", batches=stats["batches"])
    assert_bit_equal(got, want)
    check_after(tmp_path, "slots", "stock", stats)
    check_slots(stats, 4)


def check_split(stats: dict, limit: str) -> None:
    """The prompt went in smaller decodes, said so naming `limit`, and n_batch stayed 64."""
    n_batch = stats["n_batch"]
    assert n_batch < 64 and stats["prompt_tokens"] > n_batch, "4 slots cannot hold the whole prompt's experts"
    assert sum(stats["batches"]) == stats["prompt_tokens"]
    assert stats["n_batch_after"] == 64, "n_batch is the user's: a split is for that call alone"
    assert any(limit in w and "n_batch stays 64" in w for w in stats["warnings"]), stats["warnings"]


def check_after(tmp_path, which: str, stock: str, stats: dict) -> None:
    """The short prompt after the split: one decode of all its tokens, as stock's."""
    assert stats["after_batches"] == [2], "the next call runs at the asked n_batch: one decode"
    got = np.load(tmp_path / f"{which}-long-64.npy.after.npy")
    want = np.load(tmp_path / f"{stock}-long-64.npy.after.npy")
    assert_bit_equal(got, want)


def test_a_batch_over_8_tokens_runs_the_matmul_shaders_over_the_slots(
    vulkan_device, model_factory, start_daemon, tmp_path
):
    """40 rows of one token: k experts a layer, one batch of 40 (ggml-vulkan's matrix-matrix
    path, not the matrix-vector one of batches up to 8). Its tile choice depends on
    ceil(40 * k / ne[2]): 20 over 4 slots, 5 over stock's 16 (the aligned shader past 8).
    On lavapipe that changes nothing: bit-exact (measured for q8_0 and q4_K at 3/12, 6/24,
    10/40 and 25/100 rows an expert). A device whose shaders reduce differently by tile
    would differ here by rounding only: bounded, and said."""
    model = model_factory(**GEOMETRY)
    stock = run_engine("stock", model, tmp_path, prompt="repeat")
    daemon = start_daemon("256KiB")
    got, stats = engine("slots", model, tmp_path, socket=daemon.socket, slots=4, prompt="repeat")
    want, _ = finish(stock, "stock")
    assert stats["n_batch"] == 64 and stats["prompt_tokens"] == 40, "one batch of 40 rows"
    differ = got.view(np.uint32) != want.view(np.uint32)
    if differ.any():
        diff = float(np.abs(got - want).max())
        warnings.warn(
            f"{vulkan_device}: the slots' tile choice changed {int(differ.any(axis=1).sum())} rows, max |diff| {diff}",
            RuntimeWarning,
            stacklevel=1,
        )
        assert diff < 1e-3, f"more than a shader's rounding: max |diff| {diff}"
        assert (got.argmax(axis=1) == want.argmax(axis=1)).all()


def test_two_slot_engines_on_one_daemon_each_keep_their_own_slots(vulkan_device, model_factory, start_daemon, tmp_path):
    """Two processes, one daemon: each has its own device slots, both read moed's one RAM tier."""
    model = model_factory(**GEOMETRY)
    want, _ = engine("stock", model, tmp_path)
    daemon = start_daemon("256KiB")
    runs = [run_engine("slots", model, tmp_path, socket=daemon.socket, slots=8, tag=f"-{i}") for i in range(2)]
    for i, started in enumerate(runs):
        got, stats = finish(started, f"slots engine {i}")
        assert_bit_equal(got, want)
        check_slots(stats, 8)


# ---------------------------------------------------------------------- zero copy (moed.engines.device_host)

# Parts whose size is a multiple of the page, so moed's slots are a whole number of blocks
# apart (ggml-vulkan finds an expert at nb[2] / block bytes): 256 x 256 q8_0 is 17 pages;
# gpt-oss's MXFP4 (17-byte blocks) needs 512 x 256.
ZERO_COPY_GEOMETRY = {
    "qwen3moe": dict(experts=16, used=2, embd=256, ff=256),
    "gpt-oss": dict(experts=16, used=2, embd=512, ff=256),
    "gemma4": dict(experts=16, used=2, embd=256, ff=256),
}
# About 10 moed slots of 3 such parts (208,896 bytes a slot): a batch's 8 fit, 64 experts do not.
ZERO_COPY_BUDGET = "2MiB"


def check_zero_copy(stats: dict, slots: int) -> None:
    assert stats["devices"]["experts"] == "GPU slots" and stats["devices"]["gpu_slots"] == slots
    check_reported(stats)
    assert stats["engines"] and all("read in place from moed's RAM tier (zero copy)" in e for e in stats["engines"])
    g = stats["gpu_slots"]
    assert g["zero_copy"] and g["slots"] == slots and g["layers"] > 0
    assert g["segments"] >= 1 and g["imported_bytes"] > 0
    assert g["read_only"], "the import is of the client's read-only mapping (PROT_READ, MAP_SHARED)"
    assert g["hits"] > 0 and g["cycles"] > 0
    assert g["uploads"] == g["upload_bytes"] == g["evictions"] == 0, "zero copy uploads no expert"
    assert stats["daemon_evictions"] > 0, "the budget must force the daemon to evict"


@pytest.mark.parametrize("arch", sorted(ZERO_COPY_GEOMETRY))
def test_zero_copy_reads_moeds_slots_in_place_and_matches_stock(
    vulkan_device, model_factory, start_daemon, tmp_path, arch
):
    """The device computes every expert from moed's imported segments, the ids rewritten to
    moed slots at each layer: a 4-token prompt and 16 greedy steps, bit for bit against stock
    computing every expert from its own device memory, with the daemon evicting. gpt-oss's
    expert biases (add_id) and gemma4's fused gate_up and per-expert scale are indexed by moed
    slot too (their rows copied where a slot changed expert)."""
    model = model_factory(arch=arch, **ZERO_COPY_GEOMETRY[arch])
    stock = run_engine("stock", model, tmp_path)
    daemon = start_daemon(ZERO_COPY_BUDGET)
    got, stats = engine("zero-copy", model, tmp_path, socket=daemon.socket, slots=8)
    want, _ = finish(stock, "stock")
    assert stats["n_batch"] == 64, "the prompt's experts fit: one batch"
    assert_bit_equal(got, want)
    check_zero_copy(stats, 8)
    if arch in ("gpt-oss", "gemma4"):
        assert stats["gpu_slots"]["row_uploads"] > 0, "biases and scales follow the moed slots"


def test_zero_copy_splits_a_prompt_whose_experts_exceed_s_and_matches_stock_on_the_same_split(
    vulkan_device, model_factory, start_daemon, tmp_path
):
    """S still bounds a batch's distinct experts in a layer (as for the copying slots), so a
    long prompt is split alike (that call alone), and matches stock fed that split."""
    model = model_factory(**ZERO_COPY_GEOMETRY["qwen3moe"])
    daemon = start_daemon(ZERO_COPY_BUDGET)
    got, stats = engine("zero-copy", model, tmp_path, socket=daemon.socket, slots=4, prompt="long")
    check_split(stats, "the device slots (gpu_slots=4 a layer)")
    want, _ = engine("stock", model, tmp_path, prompt="long", batches=stats["batches"])
    assert_bit_equal(got, want)
    check_after(tmp_path, "zero-copy", "stock", stats)
    check_zero_copy(stats, 4)


def test_zero_copy_refuses_slots_that_are_not_a_whole_number_of_blocks_apart(
    vulkan_device, model_factory, start_daemon, tmp_path
):
    """64 x 64 q8_0 parts are 4,352 bytes, in slots 8,192 bytes apart: not a whole number of
    34-byte blocks, which ggml-vulkan would read 7,680 elements apart (NaN logits, measured).
    Refused at load, saying why and what to use instead."""
    model = model_factory(**GEOMETRY)
    daemon = start_daemon("256KiB")
    proc, _ = run_engine("zero-copy", model, tmp_path, socket=daemon.socket, slots=8)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode != 0
    assert "HostImportUnavailable" in stderr and "not a whole number of q8_0 blocks" in stderr, stderr[-3000:]
    assert "gpu_zero_copy=False" in stderr


def test_zero_copy_needs_gpu_slots():
    from moed.engines.options import EngineOptions

    with pytest.raises(ValueError, match="set gpu_slots too"):
        EngineOptions(gpu_zero_copy=True).check()
    EngineOptions(gpu_zero_copy=True, gpu_slots=8).check()


@pytest.mark.parametrize("which", ["slots", "zero-copy"])
def test_slots_above_the_expert_count_are_the_count_in_every_key(
    vulkan_device, model_factory, start_daemon, tmp_path, which
):
    """gpu_slots=10000 on 16 experts is recorded as 16 (with a RuntimeWarning): the placement's
    `slots`, `devices.gpu_slots` and the daemon's engine line all say 16 (issue 47; before, the
    placement said 16 and the devices 10000, or zero copy 10000)."""
    geometry = ZERO_COPY_GEOMETRY["qwen3moe"] if which == "zero-copy" else GEOMETRY
    model = model_factory(**geometry)
    daemon = start_daemon(ZERO_COPY_BUDGET if which == "zero-copy" else "256KiB")
    got, stats = engine(which, model, tmp_path, socket=daemon.socket, slots=10000)
    assert stats["devices"]["experts"] == "GPU slots" and stats["devices"]["gpu_slots"] == 16
    assert stats["gpu_slots"]["slots"] == 16 and stats["daemon_device_rows"][0]["slots"] == 16
    assert stats["engines"] and all("in 16 device slots a layer" in e for e in stats["engines"]), stats["engines"]
    assert np.isfinite(got).all()


# ---------------------------------------------------------------------- no Python at a warm hit (issue 48)

WARM_STEPS = 8
HITS_IN_C = """
import json, sys
import numpy as np
from moed.client import Client
from moed.engines.llama_cpp import StreamedLlama
from tests.e2e.conftest import LLAMA_KW, PROMPT

model, sock, out, n_gpu, steps, n_expert = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7])
client = Client(sock, "hits-in-c")
llm = StreamedLlama(model, client=client, n_gpu_layers=n_gpu, gpu_slots=n_expert, prefetch="off", **LLAMA_KW)
tokens = llm.tokenize(PROMPT)[:4]


def crossings():
    return llm.stream_stats()["crossings"]


def greedy(feed=None):
    # the prompt, then `steps` tokens: greedy (feed None) or the ones given; their logits and tokens
    llm.reset()
    llm.eval(tokens)
    rows, fed = [llm.scores[: llm.n_tokens].copy()], []
    before = crossings()
    for i in range(steps):
        t = int(np.argmax(llm.scores[llm.n_tokens - 1])) if feed is None else feed[i]
        fed.append(t)
        llm.eval([t])
        rows.append(llm.scores[llm.n_tokens - 1 : llm.n_tokens].copy())
    after = crossings()
    delta = {k: {f: after[k][f] - before[k][f] for f in ("stops", "to_python", "from_python")} for k in after}
    return np.concatenate(rows), fed, delta


# A first pass fills the device slots and moed's RAM tier; the second takes the very same
# routes (the same tokens from a reset context), so every routed expert is a hit.
cold, fed, _ = greedy()
warm, _, delta = greedy(fed)
np.save(out, np.stack([cold, warm]))
st = llm.stream_stats()
holds = llm.streamer.holds
print(json.dumps({
    "crossings": delta,
    "lane_layers": sorted(holds.layers),
    "device_layers": sorted(holds.device_layers),
    "moe_layers": len(llm.streamer.source.moe_layers),
    "gpu_layers": st["devices"]["gpu_layers"],
}))
llm.close()
client.close()
"""


def test_warm_decode_steps_of_a_partial_offload_make_no_call_into_python(
    vulkan_device, model_factory, start_daemon, tmp_path
):
    """A model aligned to pages (its CPU layers are lane layers), the last two of four layers
    offloaded with a device slot for every expert, a budget that holds the model, look-ahead
    off: once the slots and moed hold what the decode routes to, 8 decode steps make no call
    into Python at all, every routed stop counted once (a lane layer's hit or a device layer's,
    each in C alone), and the logits are those of the first pass, which went through Python."""
    from moed.modelgen.makemodel import aligned_geometry

    model = model_factory(**{**aligned_geometry(), **GEOMETRY})
    daemon = start_daemon("64MiB")
    out = tmp_path / "hits-in-c.npy"
    env = {**os.environ, **VULKAN_ENV, "PYTHONPATH": str(ROOT)}
    args = [str(model), daemon.socket, str(out), "3", str(WARM_STEPS), str(GEOMETRY["experts"])]
    proc = subprocess.run(
        [sys.executable, "-c", HITS_IN_C, *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    cold, warm = np.load(out)
    assert_bit_equal(warm, cold)  # the hits in C compute what Python's path did
    assert got["lane_layers"] == [0, 1] and got["device_layers"] == [2, 3], got
    cross = got["crossings"]
    print("\ncrossings over the warm steps:", json.dumps(cross))
    assert sum(c["to_python"] for c in cross.values()) == 0, cross
    assert sum(c["from_python"] for c in cross.values()) == 0, cross
    assert sum(c["stops"] for c in cross.values()) == WARM_STEPS * got["moe_layers"], cross
    assert cross["lane_hit"]["stops"] == WARM_STEPS * 2 and cross["device_hit"]["stops"] == WARM_STEPS * 2, cross
