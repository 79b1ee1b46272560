"""llama.cpp's quant mixes, as its quantizer picks them per tensor (one copy for the model maker).

`q4_k_m_type` is LLAMA_FTYPE_MOSTLY_Q4_K_M in `llama_tensor_get_type`, for the
tensors MoE GGUFs have. makemodel (tiny real models) and sparse_headers (real-sized
sparse headers) both take their types from here, so the two agree with each
other and with llama.cpp.

Invariant: only weight matrices (2-D or 3-D) are asked about; norms, biases and
routers stay F32, which the callers decide.
"""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType

# llama.cpp's fallbacks for a row whose length is not a multiple of 256 (then F16
# where even the fallback's block does not divide it).
_K_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


# Weight matrices llama.cpp's quantizer leaves as they are in every architecture
# (tensor_allows_quantization): the indexer's small q/k projections (qwen4exp, MiniMax).
_NEVER_QUANTIZED = ("indexer.k_proj.weight", "indexer.q_proj.weight")


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_type(name: str, row: int, layers: int, experts: int) -> GGMLQuantizationType:
    """The type Q4_K_M gives the weight matrix `name` whose rows are `row` values long.

    Output Q6_K; ffn_down (routed, shared or dense) and attn_v Q6_K in the
    use_more_bits layers, else Q4_K; with exactly 8 experts (Mixtral's rule) attn_v
    and attn_k Q8_0 and attn_output Q5_K; everything else Q4_K (token_embd too);
    then the fallback for short rows, and F16 where that does not fit either.
    """
    if name.endswith(_NEVER_QUANTIZED):
        return Q.F16
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    qtype = Q.Q4_K
    if name == "output.weight":
        qtype = Q.Q6_K
    elif "attn_v.weight" in name:
        qtype = Q.Q8_0 if experts == 8 else Q.Q6_K if use_more_bits(layer, layers) else Q.Q4_K
    elif "attn_k.weight" in name and experts == 8:
        qtype = Q.Q8_0
    elif "attn_output.weight" in name and experts == 8:
        qtype = Q.Q5_K
    elif "ffn_down" in name and use_more_bits(layer, layers):
        qtype = Q.Q6_K
    if row % GGML_QUANT_SIZES[qtype][0]:
        qtype = _K_FALLBACK.get(qtype, qtype)
        if row % GGML_QUANT_SIZES[qtype][0]:
            return Q.F16
    return qtype
