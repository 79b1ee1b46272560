"""The test-model plans of the newer architectures, one module per llama.cpp family.

What this package owns: `PLANS`, llama.cpp architecture name -> `ArchPlan`, merged into
moed.modelgen.makemodel.ARCHS. Each module writes one family's tensors and keys exactly
as llama.cpp's loader (`src/llama-model.cpp`, `src/models/<family>.cpp` in the
llama.cpp that scripts/setup-venv builds) requires them, and says in its docstring
what of the real models it keeps and what it shrinks.

Adding a family: one module here with its `PLAN`, one line in `PLANS`, and one entry in
the architecture table (moed.gguf.archs.ARCHS); docs/design.md, "Adding an
architecture", says what else to check.
"""

from __future__ import annotations

from moed.modelgen.families import (
    bailingmoe2,
    deepseek4,
    dots1,
    ernie4_5_moe,
    gemma4,
    glm_dsa,
    hunyuan_moe,
    kimi_k3,
    llama4,
    minimax_m2,
    minimax_m3,
    qwen3next,
    qwen4exp,
    qwen35moe,
)
from moed.modelgen.plan import ArchPlan

PLANS: dict[str, ArchPlan] = {
    "deepseek4": deepseek4.PLAN,
    "llama4": llama4.PLAN,
    "dots1": dots1.PLAN,
    "ernie4_5-moe": ernie4_5_moe.PLAN,
    "hunyuan-moe": hunyuan_moe.PLAN,
    "bailingmoe2": bailingmoe2.PLAN,
    "minimax-m2": minimax_m2.PLAN,
    "minimax-m3": minimax_m3.PLAN,
    "gemma4": gemma4.PLAN,
    "glm-dsa": glm_dsa.PLAN,
    "kimi-k3": kimi_k3.PLAN,
    "qwen35moe": qwen35moe.PLAN,
    "qwen3next": qwen3next.PLAN,
    "qwen4exp": qwen4exp.PLAN,
}
