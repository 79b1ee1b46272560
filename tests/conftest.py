"""Session-wide test models, written once by the project's own generator.

Fixtures (all session-scoped; the files are shared, so never modify them: copy
into `tmp_path` first if a test needs to damage a model):

- `model_factory(**make_model_kwargs) -> Path`: the first shard of a model made
  with `moed.modelgen.makemodel.make_model`, cached by its arguments;
  `model_factory.shards(**kwargs) -> list[Path]` gives every shard.
- `tiny_model`: 4 layers, 8 experts, top-2, q8_0, embd 64 (unaligned: copy path).
- `aligned_model`: 4 layers, 8 experts, top-2, q8_0, embd=ff=256, alignment 4096, so
  every expert part is 69632 = 17 pages and page-aligned (zero-copy path).
- `split_model`: `tiny_model`'s geometry in 3 shards (first shard's path).
- `mixed_model`: layers q8_0, q4_0, q8_0, q4_0: two size classes.
- `q4_k_m_model`: embd=ff=256 in the `q4_k_m` recipe (llama.cpp's rule: gate/up Q4_K, down Q4_K
  in layers 0-1 and Q6_K in 2-3; quantized attention): two size classes, parts of different sizes in a layer.
- `olmoe_model`, `qwen2moe_model`, `deepseek2_model`, `mixtral_model`: `tiny_model`'s
  geometry in those architectures (mixtral: `llama` with routed experts; olmoe: whole-projection q/k norms, kv_heads = heads; qwen2moe: q/k/v
  biases and a gated dense shared expert next to the routed ones; deepseek2: MLA, a
  leading dense layer, a shared expert, sigmoid gating with a selection bias).
- `gpt_oss_model`: `tiny_model`'s geometry as gpt-oss: MXFP4 experts (2176-byte parts:
  copy path) with dense bias rows, a router bias, attention sinks, sliding-window layers;
  `gpt_oss_aligned_model`: the same at `aligned_geometry(arch="gpt-oss")` (256 x 512,
  alignment 4096: 69632-byte parts, zero-copy path).
- `glm4moe_model`: `tiny_model`'s geometry as GLM-4.5: q/k/v biases, per-head q/k norms,
  partial rope, a leading dense layer, sigmoid gating with `exp_probs_b`, a shared expert.
- `qwen35moe_model`: `tiny_model`'s geometry as Qwen3.5/3.6-MoE: three Gated DeltaNet
  layers and one gated full-attention layer, every one MoE, router input at attn_post_norm-L.
  `qwen3next_model`: the same as Qwen3-Next (fused `ssm_ba`, NeoX rope).
- `gemma4_model`: `tiny_model`'s geometry as Gemma 4 MoE: fused `ffn_gate_up_exps` (parts gate_up
  and down), a dense MLP beside the experts, per-layer token embeddings, sliding-window layers.
- `glm_dsa_model`: `tiny_model`'s geometry as GLM-5 (`glm-dsa`): MLA attention with the DSA
  lightning indexer (top 16 keys; layer 3 shares layer 2's), a leading dense layer, sigmoid
  gating with `exp_probs_b`, a shared expert.
- `llama4_model`: `tiny_model`'s geometry as Llama 4 (Scout): every layer MoE with a shared
  expert, selection on the logits with sigmoid weights on the experts' input, the router input
  rebuilt from `ffn_inp-L`; chunked attention with a NoPE layer, `rope_freqs`.
- `dots1_model`, `ernie4_5_moe_model`, `hunyuan_moe_model`, `bailingmoe2_model`,
  `minimax_m2_model`: `tiny_model`'s geometry as those families (router at ffn_norm-L):
  dots1 MHA with a leading dense layer, sigmoid + `exp_probs_b`, a shared expert; ernie4_5-moe
  softmax + `exp_probs_b`, a leading dense layer, a shared expert; hunyuan-moe softmax with a
  shared MLP in every layer; bailingmoe2 fused `attn_qkv`, a leading dense layer, sigmoid +
  `exp_probs_b`; minimax-m2 whole-projection q/k norms, sigmoid + `exp_probs_b`, no shared expert.
- `qwen4exp_model`: `qwen35moe_model`'s layers under 4 hyper-connection streams (the router
  reads the FFN mix of `hc_combine-L`), QSA indexers, one PLE layer, no output_norm.
- `kimi_k3_model`: `tiny_model`'s geometry as Kimi-K3: three KDA layers and one MLA layer,
  attention residuals, a leading dense layer, sigmoid + `exp_probs_b` at ffn_norm-L, routed
  experts in a latent space half of embd wide (32 x 64 parts), a shared expert.
- `minimax_m3_model`: `tiny_model`'s geometry as MiniMax-M3: per-head q/k norms, MSA indexers
  (blocks of 16 tokens, top 2 + 1 local; sparse only with flash attention on), a leading dense
  layer, swigluoai, sigmoid + `exp_probs_b` at ffn_norm-L, a shared expert.
- `deepseek4_model`: `tiny_model`'s geometry as DeepSeek V4: MXFP4 experts under 4 hyper-connection
  streams, sqrtsoftplus gating with `exp_probs_b`, layer 0 hash-routed (`ffn_gate_tid2eid`), CSA/HCA.
- `trained_model`: the committed tiny trained MoE (`moed.data.TINY_MOE`: 6 layers, 16
  experts, top-2, d 128, q8_0, byte-level, learned routing), checked against its sha256.
- `llama_cpp`: the llama_cpp module, or the test is skipped where it is not installed.
- `start_daemon(budget, *flags, **kw)`, `daemon`: the real moed as a subprocess.
- `shared_dir`: a world-readable temporary directory (tests that run as another uid).
"""

from __future__ import annotations

import hashlib
import json
import pathlib

import pytest

from moed.modelgen.makemodel import make_model


class ModelFactory:
    """Makes models under one directory, each set of arguments once."""

    def __init__(self, root: pathlib.Path):
        self.root = root
        self._made: dict[str, list[pathlib.Path]] = {}

    def shards(self, **kwargs) -> list[pathlib.Path]:
        key = json.dumps(kwargs, sort_keys=True, default=str)
        if key not in self._made:
            name = hashlib.sha1(key.encode()).hexdigest()[:12]
            self._made[key] = make_model(self.root / name / "model.gguf", **kwargs)
        return list(self._made[key])

    def __call__(self, **kwargs) -> pathlib.Path:
        return self.shards(**kwargs)[0]


@pytest.fixture(scope="session", autouse=True)
def skeleton_cache(tmp_path_factory):
    """StreamedLlama's default skeleton cache, for this run only (not the user's ~/.cache);
    engine processes the tests start inherit it."""
    import os

    mp = pytest.MonkeyPatch()
    mp.setenv("MOED_SKELETON_DIR", str(tmp_path_factory.mktemp("skeleton-cache")))
    yield pathlib.Path(os.environ["MOED_SKELETON_DIR"])
    mp.undo()


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory) -> ModelFactory:
    return ModelFactory(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny_model(model_factory) -> pathlib.Path:
    return model_factory()


@pytest.fixture(scope="session")
def aligned_model(model_factory) -> pathlib.Path:
    return model_factory(embd=256, ff=256, align=4096)


@pytest.fixture(scope="session")
def split_model(model_factory) -> pathlib.Path:
    return model_factory(split=3)


@pytest.fixture(scope="session")
def mixed_model(model_factory) -> pathlib.Path:
    return model_factory(layer_quants="q8_0,q4_0,q8_0,q4_0")


@pytest.fixture(scope="session")
def q4_k_m_model(model_factory) -> pathlib.Path:
    return model_factory(embd=256, ff=256, recipe="q4_k_m")


@pytest.fixture(scope="session")
def olmoe_model(model_factory) -> pathlib.Path:
    return model_factory(arch="olmoe")


@pytest.fixture(scope="session")
def qwen2moe_model(model_factory) -> pathlib.Path:
    return model_factory(arch="qwen2moe")


@pytest.fixture(scope="session")
def deepseek2_model(model_factory) -> pathlib.Path:
    return model_factory(arch="deepseek2")


@pytest.fixture(scope="session")
def mixtral_model(model_factory) -> pathlib.Path:
    return model_factory(arch="llama")


@pytest.fixture(scope="session")
def gpt_oss_model(model_factory) -> pathlib.Path:
    return model_factory(arch="gpt-oss")


@pytest.fixture(scope="session")
def glm4moe_model(model_factory) -> pathlib.Path:
    return model_factory(arch="glm4moe")


@pytest.fixture(scope="session")
def qwen35moe_model(model_factory) -> pathlib.Path:
    return model_factory(arch="qwen35moe")


@pytest.fixture(scope="session")
def qwen3next_model(model_factory) -> pathlib.Path:
    return model_factory(arch="qwen3next")


@pytest.fixture(scope="session")
def gemma4_model(model_factory) -> pathlib.Path:
    return model_factory(arch="gemma4")


@pytest.fixture(scope="session")
def glm_dsa_model(model_factory) -> pathlib.Path:
    return model_factory(arch="glm-dsa")


@pytest.fixture(scope="session")
def llama4_model(model_factory) -> pathlib.Path:
    return model_factory(arch="llama4")


@pytest.fixture(scope="session")
def dots1_model(model_factory) -> pathlib.Path:
    return model_factory(arch="dots1")


@pytest.fixture(scope="session")
def ernie4_5_moe_model(model_factory) -> pathlib.Path:
    return model_factory(arch="ernie4_5-moe")


@pytest.fixture(scope="session")
def hunyuan_moe_model(model_factory) -> pathlib.Path:
    return model_factory(arch="hunyuan-moe")


@pytest.fixture(scope="session")
def bailingmoe2_model(model_factory) -> pathlib.Path:
    return model_factory(arch="bailingmoe2")


@pytest.fixture(scope="session")
def minimax_m2_model(model_factory) -> pathlib.Path:
    return model_factory(arch="minimax-m2")


@pytest.fixture(scope="session")
def kimi_k3_model(model_factory) -> pathlib.Path:
    return model_factory(arch="kimi-k3")


@pytest.fixture(scope="session")
def minimax_m3_model(model_factory) -> pathlib.Path:
    return model_factory(arch="minimax-m3")


@pytest.fixture(scope="session")
def qwen4exp_model(model_factory) -> pathlib.Path:
    return model_factory(arch="qwen4exp")


@pytest.fixture(scope="session")
def deepseek4_model(model_factory) -> pathlib.Path:
    return model_factory(arch="deepseek4")


@pytest.fixture(scope="session")
def gpt_oss_aligned_model(model_factory) -> pathlib.Path:
    from moed.modelgen.makemodel import aligned_geometry

    return model_factory(arch="gpt-oss", **aligned_geometry(arch="gpt-oss"))


@pytest.fixture(scope="session")
def trained_model() -> pathlib.Path:
    from moed.data import tiny_moe

    return tiny_moe(verify=True)


@pytest.fixture(scope="session")
def llama_cpp():
    return pytest.importorskip("llama_cpp")


@pytest.fixture(autouse=True)
def _repack_cache_dir(tmp_path_factory, monkeypatch):
    """Every test's daemons keep their repack cache (moed.daemon.repackcache) in a directory of
    that test's own, as systemd's CacheDirectory= names one: none is shared between tests, and
    none is left in the home directory."""
    monkeypatch.setenv("CACHE_DIRECTORY", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture
def start_daemon():
    """`start_daemon(budget="64MiB", *extra_args, **kw)` -> DaemonProcess, killed after the test."""
    from moed.testing import DaemonProcess

    started: list = []

    def start(budget: str = "64MiB", *args: str, **kw):
        d = DaemonProcess(budget, *args, **kw)
        started.append(d)
        return d

    yield start
    for d in started:
        d.close()


@pytest.fixture
def daemon(start_daemon):
    """A real daemon with a 64 MiB budget."""
    return start_daemon()


@pytest.fixture
def shared_dir():
    """A directory every uid can read (pytest's own tmp dirs are root-only)."""
    import os
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="moed-shared-", dir="/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def start_shared(start_daemon, shared_dir):
    """`start_shared(budget, config_toml="")`: a daemon any uid can reach (socket 0666, dir 0755)."""
    import os

    def start(budget: str = "8MiB", config: str = ""):
        conf = os.path.join(shared_dir, "moed.toml")
        with open(conf, "w") as f:
            f.write("socket_mode = 0o666\n" + config)
        d = start_daemon(budget, "--config", conf)
        os.chmod(d.dir, 0o755)
        return d

    return start
