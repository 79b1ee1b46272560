"""The architecture table: what moed knows about each llama.cpp architecture, in one place.

What this module owns: which architectures moed serves (`ARCHS`; the catalog refuses
any other at open), where each one's router reads its input (the graph node the
eval callback stops at and the norm weight that made it), the gating its graph
fixes, and which router-side tensors it carries beside the routed experts (their
names are here too). Its readers: the catalog (served or not), the engine's
gate-ahead predictor (router input, gating, bias names) and the test-model
generator (which norm and biases it writes for an architecture). Pure data, no I/O.

Invariants:
- An architecture is served only if llama.cpp runs it and the streamed engine is
  checked bit-exact on it (tests/e2e/test_arch_matrix.py makes one model of every
  architecture here); the generator writes every one of them
  (tests/unit/test_catalog.py checks the two sets are equal).
- `gating` is set only where llama.cpp's graph fixes it (the file then carries no
  `expert_gating_func`); otherwise the file's key decides (`gating_of`).
- The selection bias `exp_probs_b` is a fact of the file, not of the architecture
  (DeepSeek-V3 has it, V2 does not): readers look for it by name in any file.
- Expert bias rows (`ffn_*_exps.bias`) are dense and resident, never parts: the
  catalog's parts are the `.weight` tensors only (see moed.gguf.catalog).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

# llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE values (the `<arch>.expert_gating_func` key).
GATING_SOFTMAX = 1
GATING_SIGMOID = 2
GATING_SOFTMAX_WEIGHT = 3  # llama.cpp's SOFTMAX_WEIGHT: select on the logits, softmax over the chosen k
GATING_SQRT_SOFTPLUS = 4  # llama.cpp's SQRT_SOFTPLUS (deepseek4): sqrt(softplus(logits))

# Router-side tensors of an MoE layer, as `blk.L.<name>`.
ROUTER_WEIGHT = "ffn_gate_inp.weight"
ROUTER_BIAS = "ffn_gate_inp.bias"  # added to the logits (llama.cpp's ffn_moe_logits_biased)
SELECTION_BIAS = "exp_probs_b.bias"  # added to gating(logits) for selection only
# deepseek4's hash routing: [vocab, top-k] I32, each token's experts in the first
# `hash_layer_count` layers (a fact of the file, looked for by name, as SELECTION_BIAS).
TOKEN_EXPERTS = "ffn_gate_tid2eid.weight"
# Tables llama.cpp marks TENSOR_READ_LAZY (gemma4's and qwen4exp's per-layer token
# embeddings): an engine loads with LLAMA_LAZY_MODE_ON and leaves them unlocked.
LAZY_TENSORS = frozenset({"per_layer_token_embd.weight"})
ROUTER_SCALE = "ffn_gate_inp.scale"  # gemma4: multiplies the router's input (Arch.router_scale)

# The dense weights llama.cpp multiplies with GGML_OP_MUL_MAT (llama-arch.cpp's
# LLM_TENSOR_INFOS), by their name after `blk.N.`, in every architecture moed serves:
# only these are candidates for CPU_REPACK, as in llama.cpp's select_weight_buft
# (token_embd is GET_ROWS, norms are MUL, biases ADD). A family that adds a MUL_MAT
# weight adds its name here, or moed computes it on other kernels than stock does.
DENSE_MATMUL_NAMES: tuple[str, ...] = (
    r"attn_(?:q|k|v|qkv|output|gate|q_a|q_b|kv_a_mqa|kv_b|k_b|v_b)",
    r"ffn_(?:gate|up|down)(?:_shexp)?",
    r"ffn_gate_inp(?:_shexp)?",
    r"nextn\.(?:eh_proj|shared_head_head)",
    r"ssm_(?:in|out|alpha|beta|ba)",  # Gated DeltaNet (qwen35moe, qwen3next): projections in and out, beta/alpha
    r"inp_gate|proj",  # gemma4's per-layer embedding gate and projection
    r"hc_(?:attn|ffn)_(?:down|up|inject)|ple_(?:key|value)|indexer\.(?:q_proj|k_proj)",  # qwen4exp
    # deepseek4 (attn_output_a is 3-D once loaded: stock does not repack it, so it is not here)
    r"attn_(?:kv|output_b)|hc_(?:attn|ffn)_fn|(?:attn|indexer)_compressor_(?:kv|gate)|indexer\.(?:proj|attn_q_b)",
    r"indexer\.attn_k",  # glm-dsa's lightning-indexer key projection (its proj and attn_q_b are deepseek4's)
    r"ssm_(?:f_a|f_b|g)|ffn_routed_(?:down|up)",  # kimi-k3: KDA decay and output gates, the latent MoE's projections
)
# The same for model-level weights (no `blk.N.`): gemma4's per_layer_model_proj is a
# REPEATING MUL_MAT weight created with layer 0's buffer types, so it repacks as any layer's.
DENSE_MATMUL_MODEL_NAMES: tuple[str, ...] = ("output", "per_layer_model_proj", r"output_hc_(?:down|up)", "output_hc_fn")
DENSE_MATMUL = re.compile(
    r"^(?:" + "|".join(DENSE_MATMUL_MODEL_NAMES) + r"|blk\.\d+\.(?:" + "|".join(DENSE_MATMUL_NAMES) + r"))\.weight$"
)


@dataclass(frozen=True)
class RouterInput:
    """Where an architecture's router reads its input: the graph node `<node>-L` and the
    norm weight `blk.L.<norm>.weight` that made it."""

    node: str
    norm: str

    @property
    def prefix(self) -> bytes:
        """The node's name up to the layer number, as the eval callback matches it."""
        return self.node.encode() + b"-"


FFN_NORM = RouterInput("ffn_norm", "ffn_norm")


@dataclass(frozen=True)
class Arch:
    """One architecture's facts. `gating`: fixed by llama.cpp's graph, or None (the file's
    key decides); `router_bias`: the router carries `ffn_gate_inp.bias`; `expert_bias`:
    each routed part has a bias row per expert (`ffn_{gate,up,down}_exps.bias`);
    `router_scale`: the node is the residual itself and the router reads
    rms_norm(node) / sqrt(n_embd) * `ffn_gate_inp.scale` (gemma4), no norm weight: the
    predictor norms the rows itself, and `router_input.norm` is only the experts' input
    norm the generator writes."""

    router_input: RouterInput = FFN_NORM
    gating: int | None = None
    router_bias: bool = False
    expert_bias: bool = False
    router_scale: bool = False
    # The node is the hyper-connection residual [n_embd, hc, T] the FFN mixer reads
    # (qwen4exp's hc_combine-L) and `router_input.norm` is that mixer's gamma: the
    # predictor computes the mix (blk.L.hc_ffn_{norm,down,up}) itself.
    hc_mix: bool = False
    # The node is the residual the FFN's RMS norm reads (llama4's ffn_inp-L: its graph names
    # no normed row) and `router_input.norm` that norm's weight: the predictor computes
    # rms_norm(node) * norm itself (as gemma4's router_scale, without the 1/sqrt(n_embd)).
    rms_node: bool = False
    # The gating the loader assumes when the file names none (glm-dsa's: sigmoid), where
    # that is not softmax; the file's `expert_gating_func` wins when present.
    default_gating: int | None = None


# The architectures moed serves. gpt-oss norms the router's input with
# post_attention_norm (the graph's attn_post_norm-L; there is no ffn_norm); glm4moe's
# node is post_attn_norm-L, from the same weight name.
ARCHS: Mapping[str, Arch] = {
    "qwen3moe": Arch(),
    "olmoe": Arch(),
    "qwen2moe": Arch(),
    "deepseek2": Arch(),
    "llama": Arch(),  # Mixtral-style: llama with ffn_*_exps
    "gpt-oss": Arch(
        RouterInput("attn_post_norm", "post_attention_norm"),
        gating=GATING_SOFTMAX_WEIGHT,
        router_bias=True,
        expert_bias=True,
    ),
    "glm4moe": Arch(RouterInput("post_attn_norm", "post_attention_norm")),
    # Every layer MoE, DeltaNet or attention; the router reads attn_post_norm-L, softmax
    # fixed by the graph (qwen35moe.cpp); the shared expert's sigmoid gate does not select.
    "qwen35moe": Arch(RouterInput("attn_post_norm", "post_attention_norm"), gating=GATING_SOFTMAX),
    "qwen3next": Arch(RouterInput("attn_post_norm", "post_attention_norm"), gating=GATING_SOFTMAX),  # the same FFN
    # The router reads rms_norm(attn_out-L) / sqrt(n_embd) * ffn_gate_inp.scale, softmax fixed
    # by the graph (gemma4.cpp); the experts read ffn_norm_2-L (pre_ffw_norm_2), which the
    # graph computes after ffn_moe_topk-L, so the look-ahead stops at attn_out-L.
    "gemma4": Arch(RouterInput("attn_out", "pre_ffw_norm_2"), gating=GATING_SOFTMAX, router_scale=True),
    # The router reads the FFN hyper-connection mix (the second hc_mixed-L, a name the
    # attention mix shares), softmax fixed by the graph (qwen4exp.cpp); the look-ahead
    # stops at the one node named hc_combine-L, the residual after attention, and mixes it.
    "qwen4exp": Arch(RouterInput("hc_combine", "hc_ffn_norm"), gating=GATING_SOFTMAX, hc_mix=True),
    # The router reads ffn_norm-L (rms_norm of the FFN's hyper-connection pre-mix, a plain row
    # per token), sqrtsoftplus fixed by the loader, exp_probs_b on the routed layers; the first
    # hash_layer_count layers select by token id (TOKEN_EXPERTS), still at ffn_moe_topk-L.
    "deepseek4": Arch(gating=GATING_SQRT_SOFTPLUS),
    # Llama 4: the router reads rms_norm(ffn_inp) * ffn_norm, but llama4.cpp's cb(cur, "ffn_norm")
    # in an MoE layer names the attention output, not the normed row: the look-ahead stops at
    # the residual ffn_inp-L and norms it (rms_node). Selection on the logits, sigmoid weights
    # (fixed by the graph; the input is scaled by the weight before the experts).
    "llama4": Arch(RouterInput("ffn_inp", "ffn_norm"), gating=GATING_SIGMOID, rms_node=True),
    "dots1": Arch(),  # V3-style: ffn_norm-L, the file's sigmoid gating, exp_probs_b, leading dense layer
    "ernie4_5-moe": Arch(gating=GATING_SOFTMAX),  # ffn_norm-L, softmax fixed by the graph, exp_probs_b
    "hunyuan-moe": Arch(gating=GATING_SOFTMAX),  # ffn_norm-L, softmax fixed by the graph
    "bailingmoe2": Arch(),  # ffn_norm-L, the file's sigmoid gating, exp_probs_b, leading dense layer
    "minimax-m2": Arch(),  # ffn_norm-L, the file's sigmoid gating, exp_probs_b (required)
    # GLM-5 (DSA): V3's FFN after MLA + lightning-indexer attention; ffn_norm-L, the file's gating,
    # sigmoid when it names none (llama.cpp's loader), exp_probs_b, leading dense layers.
    "glm-dsa": Arch(default_gating=GATING_SIGMOID),
    # Kimi-K3: KDA + MLA, a leading dense layer; the router reads ffn_norm-L at full width (its
    # logits computed by kimi-k3.cpp and handed to build_moe_ffn), the file's sigmoid gating,
    # exp_probs_b; the routed experts run on ffn_routed_down's latent projection of that row.
    "kimi-k3": Arch(),
    # MiniMax-M3: M2's GQA with MSA (the block-sparse indexer) in the MoE layers, a leading dense
    # layer; ffn_norm-L, the file's sigmoid gating, exp_probs_b (required), a shared expert.
    "minimax-m3": Arch(),
}
SERVED_ARCHS = tuple(ARCHS)
_OTHER = Arch()  # what an architecture not in the table is taken to be


def arch_of(name: str) -> Arch:
    """The facts of architecture `name`; one not in the table gets the common case
    (ffn_norm input, the file's gating, no biases)."""
    return ARCHS.get(name, _OTHER)


def router_input(arch: str) -> RouterInput:
    return arch_of(arch).router_input


def gating_of(header) -> int:
    """The router's gating: fixed by the architecture's graph, else the file's
    `expert_gating_func`, else what the loader assumes (softmax, or Arch.default_gating)."""
    arch = str(header.get("general.architecture", ""))
    facts = arch_of(arch)
    default = facts.default_gating or GATING_SOFTMAX
    return facts.gating or int(header.get(f"{arch}.expert_gating_func", default) or default)
