"""Data shipped with moed: the tiny trained MoE (`scripts/train-tiny-moe` reproduces it).

`TINY_MOE` is a qwen3moe-architecture, byte-level model trained on the Python
standard library's source: 6 layers x 16 experts (top-2), d 128, q8_0 experts,
5.5 MiB. It writes text that looks like Python; its routing is learned, but a tiny
model's routing is not a 30B model's. `TINY_MOE_SHA256` is the committed digest.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

TINY_MOE = Path(__file__).with_name("tiny-stdlib-moe.gguf")
TINY_MOE_SUMMARY = (
    "moed tiny-stdlib-moe: a qwen3moe-architecture byte-level model, 6 layers x 16 experts "
    "(top-2), d 128, trained on the Python standard library's source by "
    "scripts/train-tiny-moe (a tiny model: Python-looking text, not good code)"
)


def expected_sha256() -> str:
    return TINY_MOE.with_name(TINY_MOE.name + ".sha256").read_text().split()[0]


def tiny_moe(verify: bool = True) -> Path:
    """The committed model's path; with `verify`, its bytes are checked against the .sha256."""
    if verify:
        digest = hashlib.sha256(TINY_MOE.read_bytes()).hexdigest()
        if digest != expected_sha256():
            raise ValueError(
                f"{TINY_MOE} does not match its .sha256 (got {digest}); "
                "restore it from git or rerun scripts/train-tiny-moe"
            )
    return TINY_MOE
