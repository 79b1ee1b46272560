"""moectl verbs that read and write GGUF files: make-model, index, align.

All three work on files only (no daemon). Bad input is a one-line error and exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from moed.badinput import BadInput
from moed.protocol.errors import MoedError
from moed.protocol.sizes import format_size


def register(sub) -> None:
    p = sub.add_parser("make-model", help="write a tiny MoE test model (GGUF; qwen3moe unless --arch)")
    p.add_argument("out", metavar="OUT.gguf")
    # checked by make_model (moed.modelgen.makemodel.ARCHS): importing it here would slow every moectl start
    p.add_argument(
        "--arch",
        default="qwen3moe",
        help="llama.cpp architecture: qwen3moe, olmoe, qwen2moe, deepseek2, llama (Mixtral-style; also: mixtral), "
        "gpt-oss (MXFP4 experts with biases, attention sinks, sliding-window layers), glm4moe (GLM-4.5), "
        "qwen35moe (Qwen3.5/3.6-MoE: Gated DeltaNet + attention), qwen3next (Qwen3-Next), "
        "qwen4exp (Qwen3.8-Flash-Next: hyper-connections), deepseek4 (DeepSeek V4), gemma4 (Gemma 4 MoE: fused "
        "gate_up experts), llama4, dots1, ernie4_5-moe, hunyuan-moe, bailingmoe2, minimax-m2, minimax-m3, glm-dsa or kimi-k3",
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--used", type=int, default=2, help="experts per token (top-k)")
    p.add_argument("--embd", type=int, default=64)
    p.add_argument("--ff", type=int, default=64, help="expert feed-forward length")
    p.add_argument(
        "--quant",
        default=None,
        choices=["q8_0", "q4_0", "q4_k", "q6_k", "mxfp4"],
        help="the routed experts' quant (default: the architecture's own: mxfp4 for gpt-oss, else q8_0)",
    )
    p.add_argument("--layer-quants", default=None, metavar="Q,Q,...", help="one quant per layer (mixed size classes)")
    p.add_argument(
        "--recipe",
        default=None,
        help="a named quant mix, llama.cpp's rule per tensor (q4_k_m: gate/up Q4_K, down Q6_K or Q4_K by layer, "
        "quantized attention)",
    )
    p.add_argument("--align", type=int, default=32, help="general.alignment (4096: page-aligned experts)")
    p.add_argument("--split", type=int, default=1, help="number of shards")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: minimal)")
    p.add_argument("--ctx", type=int, default=256, help="context length")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument(
        "--random-experts",
        action="store_true",
        help="fill experts with random quant blocks (fast; for big benchmark models)",
    )
    p.add_argument(
        "--like",
        default=None,
        metavar="TRACE",
        help="take layers, experts and top-k from a routing trace (overrides those flags)",
    )
    p.set_defaults(func=_make_model)

    p = sub.add_parser("index", help="show where a GGUF's routed experts live")
    p.add_argument("model", metavar="MODEL.gguf")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_index)

    p = sub.add_parser("align", help="rewrite a GGUF with 4096-byte alignment (page-aligned experts)")
    p.add_argument("src", metavar="IN")
    p.add_argument("dst", metavar="OUT")
    p.add_argument("--alignment", type=int, default=4096, help=argparse.SUPPRESS)
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    p.add_argument("--no-verify", action="store_true", help="skip comparing every tensor after writing")
    p.add_argument(
        "--repack",
        action="store_true",
        help="also write the experts in the layout this CPU's llama.cpp computes on (e.g. q4_0_8x8): "
        "moed's engines then run stock llama.cpp's repacked kernels on them; for moed only",
    )
    p.set_defaults(func=_align)


def _make_model(args) -> int:
    from moed.modelgen.makemodel import make_model

    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):  # as align: a typo in OUT makes no directories
        raise BadInput(f"make-model: output directory {out_dir} does not exist")
    if args.like:  # the trace's routing geometry wins
        from moed.lab.live_replay import like_trace
        from moed.traces import Trace

        vars(args).update(like_trace(Trace.load(args.like)))
    try:
        paths = make_model(
            args.out,
            layers=args.layers,
            experts=args.experts,
            used=args.used,
            embd=args.embd,
            ff=args.ff,
            quant=args.quant,
            layer_quants=args.layer_quants,
            align=args.align,
            split=args.split,
            seed=args.seed,
            vocab=args.vocab,
            ctx=args.ctx,
            heads=args.heads,
            kv_heads=args.kv_heads,
            random_experts=args.random_experts,
            arch="llama" if args.arch == "mixtral" else args.arch,  # Mixtral's files say "llama"
            recipe=args.recipe,
        )
    except ValueError as exc:  # an OSError is reported as it is (moed.cli)
        raise BadInput(f"make-model: {exc}") from None
    for p in paths:
        print(p)
    return 0


def _index(args) -> int:
    from moed.gguf.catalog import Catalog

    cat = Catalog.open(args.model)
    if args.json:
        print(json.dumps(cat.to_dict()))
        return 0
    _print_index(cat)
    return 0


def _print_index(cat) -> None:
    from rich.console import Console
    from rich.table import Table

    from moed.gguf.catalog import format_ranges

    console = Console()
    aligned = "yes" if cat.page_aligned else "partly" if any(e.page_aligned for e in cat.layers.values()) else "no"
    console.print(f"[bold]{cat.path}[/bold]  ({cat.arch}, {len(cat.files)} file(s), alignment {cat.alignment})")
    console.print(
        f"layers {cat.n_layers}, MoE layers {format_ranges(cat.moe_layers)}, experts "
        f"{cat.n_experts}, top-k {cat.n_expert_used}, parts {'+'.join(cat.parts)}"
    )
    console.print(f"routed expert bytes {format_size(cat.expert_bytes_total)}, page-aligned expert extents: {aligned}")
    table = Table("class", "layers", "type", *cat.parts, "expert", "aligned", title="bytes per expert, by size class")
    for i, (key, layers) in enumerate(cat.size_classes.items()):
        types = sorted({cat.layers[l].parts[p].type_name for l in layers for p, _ in key})
        table.add_row(
            str(i),
            format_ranges(layers),
            ",".join(types),
            *(str(b) for _, b in key),
            str(sum(b for _, b in key)),
            "yes" if all(cat.layers[l].page_aligned for l in layers) else "no",
        )
    console.print(table)
    for f in cat.files:
        console.print(f"  {f}")


def _repack_transform(src: str):
    from moed.engines import repack
    from moed.gguf.header import read_split

    try:
        import llama_cpp._logger as llama_log

        llama_log.set_verbose(False)  # ggml logs every repacked tensor otherwise
    except (ImportError, AttributeError):
        pass
    return repack.file_transform(read_split(src))


def _align(args) -> int:
    from moed.gguf.align import align_gguf
    from moed.gguf.catalog import Catalog

    try:
        transform = _repack_transform(args.src) if args.repack else None
        outs = align_gguf(
            args.src,
            args.dst,
            alignment=args.alignment,
            overwrite=args.force,
            verify=not args.no_verify,
            progress=sys.stderr.isatty(),
            transform=transform,
        )
    except MoedError:
        raise
    except ValueError as exc:  # an OSError (OUT exists, no such file) is reported as it is (moed.cli)
        raise BadInput(f"align: {exc}") from None
    for out in outs:
        print(out, flush=True)
    try:
        cat = Catalog.open(outs[0])
    except MoedError:
        return 0  # not a MoE model: nothing more to say
    if transform is not None:
        from moed.gguf.layouts import KEY_CPU

        print(f"experts repacked: {cat.expert_layout} (for {transform.kvs[KEY_CPU]})", file=sys.stderr)
    parts = [p for e in cat.layers.values() for p in e.parts.values()]
    aligned = sum(p.page_aligned for p in parts)
    print(
        f"{aligned} of {len(parts)} expert tensors page-aligned"
        + ("" if aligned == len(parts) else " (the others' bytes per expert are not a multiple of 4096)"),
        file=sys.stderr,
    )
    return 0
