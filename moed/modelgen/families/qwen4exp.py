"""Qwen3.8-Flash-Next (llama.cpp's `qwen4exp`): Qwen3.5-MoE's hybrid layers under hyper-connections.

What this module owns: the test-model plan `PLAN` of `qwen4exp`, written as llama.cpp's
loader reads it (`src/models/qwen4exp.cpp`, `load_arch_hparams` / `load_arch_tensors`),
and the hyper-connection sizes (`HC`, `HC_LOW_RANK`) the predictor's tests rely on.

Kept from the real model (48 layers, 36 DeltaNet + 12 QSA attention, 512 experts top-10,
a sigmoid-gated shared expert, hyper-connections, one PLE layer):
- Hyper-connections instead of every layer norm: the residual is `hyper_connection.count`
  streams; before the token mixer and before the MoE a mixer (`hc_{attn,ffn}_norm`, a
  grouped RMS norm gamma [hc, embd]; `hc_*_down` / `hc_*_up`, the low-rank
  `hyper_connection.low_rank` gate; `hc_*_inject`, the scatter weights) collapses the
  streams into the block's input, and the block's output is added back to every stream
  by its own weight. There is no `attn_norm`, `post_attention_norm` or `output_norm`:
  the final mixer `output_hc_{norm,down,up}` is the output norm.
- The router reads the FFN mixer's output (the graph's second `hc_mixed-L`; the
  residual it mixes is `hc_combine-L`), softmax fixed by the graph, normalized top-k
  weights; the shared expert's sigmoid gate does not select.
- The layer pattern and mixers of qwen35moe (moed.modelgen.families.qwen35moe):
  `full_attention_interval` 4, DeltaNet with `ssm_beta`/`ssm_alpha`, gated full
  attention with per-head q/k norms and IMRoPE sections; the full-attention layers add
  the QSA indexer (`indexer.{q,k}_proj`, `indexer.{q,k}_norm`) and a compress ratio.
- PLE n-gram hash embeddings on one DeltaNet layer (layer 0): `per_layer_token_embd`
  ([rows, per-layer width], which llama.cpp marks TENSOR_READ_LAZY), `ple_key`,
  `ple_value`, three grouped norms and the depthwise `ple_conv1d`; the hash constants are
  UINT64 arrays, as the converter writes them.

Shrunk: hc 4 streams with low rank 16; 2 indexer heads of head_dim, a budget of 4
blocks of 4 tokens; PLE 3-grams with 2 heads each (4 heads of embd / 4, so that the
heads' concatenation is embd wide, as llama.cpp's `ple_key` requires) over a table of
272 rows; everything else as qwen35moe's plan.

Invariants: `hc_*_up` is F32 with a router's spread (4 / sqrt(low rank)), so that the
sigmoid gates of the mix vary from about 0.2 to 0.8 and the mix is far from a plain
mean of the streams; `hc_*_down` and `hc_*_inject` are F16 matrices a recipe quantizes,
as llama.cpp's quantizer does for this family (it exempts `hc_` only for glm5-next).
"""

from __future__ import annotations

from gguf import GGUFValueType

from moed.gguf.archs import Arch
from moed.modelgen.families import qwen35moe
from moed.modelgen.plan import KV, ArchPlan, Geometry, Quants, Spec, routed, router_norm, shared_expert

HC = 4  # hyper_connection.count: parallel residual streams
HC_LOW_RANK = 16  # hyper_connection.low_rank: the mixer's gate bottleneck
INDEXER_HEADS = 2
INDEXER_TOP_K = 4  # whole blocks the QSA attends to, besides the incomplete tail
COMPRESS_RATIO = 4  # tokens per indexer block on the full-attention layers
PLE_LAYERS = (0,)  # llama.cpp takes exactly one; it must be a DeltaNet layer
PLE_NGRAM, PLE_HEADS_PER_NGRAM, PLE_CONV_KERNEL = 3, 2, 4
PLE_VOCAB_SIZES = (61, 67, 71, 73)  # one hash range a head: (ngram - 1) * heads_per_ngram heads
PLE_MULTIPLIERS = (0x1F3D5B79A2C4E6, 0x2B7E151628AED, 0x3243F6A8885A3)  # odd, 45-bit-ish, as the real ones
EOS = 2  # makemodel's </s>


def ple_heads() -> int:
    return (PLE_NGRAM - 1) * PLE_HEADS_PER_NGRAM


def ple_width(g: Geometry) -> int:
    """`embedding_length_per_layer_input`: a head's row; the heads side by side are embd wide."""
    return g.embd // ple_heads()


def _offsets() -> list[int]:
    return [sum(PLE_VOCAB_SIZES[:h]) for h in range(len(PLE_VOCAB_SIZES))]


def hc_mixer(g: Geometry, p: str) -> list[Spec]:
    """One hyper-connection mixer `p` (`blk.L.hc_attn_`, `blk.L.hc_ffn_`, `output_hc_`) without its inject."""
    hc_dim = HC * g.embd
    return [
        Spec(p + "norm.weight", (HC, g.embd), "norm"),  # ggml [embd, hc]: a gamma per stream
        Spec(p + "down.weight", (HC_LOW_RANK, hc_dim), "f16"),
        Spec(p + "up.weight", (hc_dim, HC_LOW_RANK), "router"),  # F32, strong: the gates must vary
    ]


def _hc(g: Geometry, p: str) -> list[Spec]:
    return [Spec(p + "inject.weight", (HC, HC * g.embd), "f16"), *hc_mixer(g, p)]


def _indexer(g: Geometry, p: str) -> list[Spec]:
    d = g.head_dim  # at least the rope width, which the indexer's q and k rotate too
    return [
        Spec(p + "indexer.q_proj.weight", (INDEXER_HEADS * d, g.embd), "f16"),
        Spec(p + "indexer.k_proj.weight", (d, g.embd), "f16"),
        Spec(p + "indexer.q_norm.weight", (d,), "norm"),
        Spec(p + "indexer.k_norm.weight", (d,), "norm"),
    ]


def _ple(g: Geometry, p: str) -> list[Spec]:
    hc_dim = HC * g.embd
    return [
        Spec(p + "ple_key.weight", (hc_dim, g.embd), "f16"),
        Spec(p + "ple_value.weight", (g.embd, g.embd), "f16"),
        Spec(p + "ple_norm_key.weight", (HC, g.embd), "norm"),
        Spec(p + "ple_norm_query.weight", (HC, g.embd), "norm"),
        Spec(p + "ple_norm_conv.weight", (HC, g.embd), "norm"),
        Spec(p + "ple_conv1d.weight", (hc_dim, PLE_CONV_KERNEL), "bias"),  # F32, as ssm_conv1d
    ]


def _layer(g: Geometry, i: int, qt: Quants, facts: Arch) -> list[Spec]:
    p = f"blk.{i}."
    recurrent = qwen35moe.is_recurrent(i)
    mixer = (
        qwen35moe.delta_net(g, p, fused_beta_alpha=False)
        if recurrent
        else qwen35moe.gated_attention(g, p) + _indexer(g, p)
    )
    # No norm of the router's own: its input is the FFN mixer's output (hc_ffn_norm is the
    # mixer's gamma, written above), so routed()'s norm spec is left out.
    norm = router_norm(g, p, facts).name
    ffn = [s for s in routed(g, p, qt, facts) if s.name != norm] + shared_expert(g, p, gated=True)
    return [
        *_hc(g, p + "hc_attn_"),
        *_hc(g, p + "hc_ffn_"),
        *mixer,
        *(_ple(g, p) if i in PLE_LAYERS else []),
        *ffn,
    ]


def _model_tensors(g: Geometry, vocab: int) -> list[Spec]:
    rows = sum(PLE_VOCAB_SIZES)
    return [*hc_mixer(g, "output_hc_"), Spec("per_layer_token_embd.weight", (rows, ple_width(g)), "embd")]


def _kv(g: Geometry) -> KV:
    u64 = GGUFValueType.UINT64
    return {
        **qwen35moe.PLAN.extra_kv(g),  # hybrid layout, ssm sizes, partial IMRoPE sections
        "hyper_connection.count": HC,
        "hyper_connection.low_rank": HC_LOW_RANK,
        "attention.indexer.head_count": INDEXER_HEADS,
        "attention.indexer.key_length": g.head_dim,
        "attention.indexer.top_k": INDEXER_TOP_K,
        "attention.compress_ratios": [0 if qwen35moe.is_recurrent(i) else COMPRESS_RATIO for i in range(g.layers)],
        "ple.layers": list(PLE_LAYERS),
        "ple.ngram_size": PLE_NGRAM,
        "ple.heads_per_ngram": PLE_HEADS_PER_NGRAM,
        "ple.conv_kernel": PLE_CONV_KERNEL,
        "ple.eos_token_id": EOS,
        "embedding_length_per_layer_input": ple_width(g),
        "ple.layer_multipliers": (u64, list(PLE_MULTIPLIERS)),
        "ple.head_offsets": (u64, _offsets()),
        "ple.head_vocab_sizes": (u64, list(PLE_VOCAB_SIZES)),
    }


PLAN = ArchPlan(_layer, _kv, model_tensors=_model_tensors, output_norm=False)
