"""The expert layout a GGUF records: plain, or repacked for one CPU's llama.cpp kernels.

`moectl align --repack` writes the routed experts of the types this CPU's llama.cpp
repacks in ggml's repacked layout (e.g. `q4_0_8x8`) and records it in three keys:

    moed.repack.layouts             array of "TYPE=LAYOUT" (e.g. "Q4_0=q4_0_8x8"), one per
                                    expert ggml type that is repacked; types not named are plain
    moed.repack.cpu                 the CPU features the layout was chosen for ("x86_64 avx2")
    moed.repack.llama_cpp_python    the llama-cpp-python (ggml) version that made it

Invariants:
- A file without `moed.repack.layouts` is plain: its expert bytes are the quantized
  blocks llama.cpp reads from any GGUF.
- Only routed expert tensors are ever repacked in a file; dense weights stay plain
  (the engine repacks them at load, as stock llama.cpp does).
- A repacked file is for moed's engines only: stock llama.cpp does not read these
  keys and would compute garbage from the experts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

KEY_LAYOUTS = "moed.repack.layouts"
KEY_CPU = "moed.repack.cpu"
KEY_BUILD = "moed.repack.llama_cpp_python"
PLAIN = "plain"


def parse_layouts(values: Iterable[str] | None) -> dict[str, str]:
    """{ggml type name: layout} from the `moed.repack.layouts` array (empty: plain)."""
    out: dict[str, str] = {}
    for item in values or ():
        type_name, sep, layout = str(item).partition("=")
        if not sep or not type_name or not layout:
            raise ValueError(f"{KEY_LAYOUTS}: bad entry {item!r} (expected TYPE=LAYOUT)")
        out[type_name] = layout
    return out


def format_layouts(layouts: Mapping[str, str]) -> list[str]:
    return [f"{t}={layouts[t]}" for t in sorted(layouts)]


def summary(layouts: Mapping[str, str], expert_types: Iterable[str]) -> str:
    """One word for the experts' layout: "plain", "q4_0_8x8", or "q4_K_8x8+plain" when mixed."""
    names = sorted({layouts.get(t, PLAIN) for t in expert_types})
    if len(names) > 1 and PLAIN in names:
        names = [n for n in names if n != PLAIN] + [PLAIN]
    return "+".join(names) or PLAIN


def layout_refusal(path: str, have: str, want: str) -> str:
    """Why a model in layout `have` cannot serve an engine computing on `want`."""
    if have == PLAIN:
        fix = f"make a repacked copy on this host with `moectl align --repack {path} OUT`, or run with repack='off'"
    elif want == PLAIN:
        fix = "run the engine with repack='auto' (or serve the original, plain file)"
    else:
        fix = f"repack the original file on this host (`moectl align --repack`); this CPU computes on {want}"
    return f"{path}: its experts are {have}, the engine computes on {want}: {fix}"
