"""Which CPU kernels a loaded model computes on: the engines' `repack` option.

What this module owns: the decision, for each weight of a model llama.cpp has
loaded with `use_extra_bufts=False` (every tensor at its file offset), of whether
it runs on ggml's repacked kernels, the layout the engine asks the daemon for, and
the refusals when the file's expert bytes cannot serve that decision.
`moed.engines.kernels` does the switching.

- `repack="auto"` (the default): every weight runs on the kernels stock llama.cpp
  would use for it. Dense weights go to CPU_REPACK at load, by ggml's own repack.
  The experts: a file repacked by `moectl align --repack` on a host like this one
  computes on its layout; a plain file's experts of every type this CPU repacks
  are asked of the daemon in that layout, which it makes as it reads them (repack
  on read, moed.daemon.onread; issue 41). Either way the engine computes everything
  as stock `llama_cpp.Llama` does on the original file (bit-exact; its reference is
  `UnpackedLlama(repack="auto")`, stock's load). A type the daemon cannot make (none
  in 0.3.36 outside RISC-V) stays plain, with a warning.
- `repack="dense"`: dense weights as stock, experts plain (the kernels of
  `UnpackedLlama(repack="dense")`, its reference): what "auto" did before repack on
  read, for a host where the transform's CPU costs more than the faster kernels
  give back. A repacked file is refused.
- `repack="off"`: everything on the plain kernels (reference: `UnpackedLlama()`);
  a repacked file is refused.

Invariants:
- An expert tensor is switched to the repacked kernels only if its bytes will be
  in the layout this CPU's ggml computes that type on: the file records it, or the
  daemon makes it on read (it refuses with `LayoutUnavailable` what it cannot make,
  so a mismatch never reaches a kernel); anything else is `LayoutUnavailable`
  before the model serves a token.
- Layouts are decided per type, as ggml decides them (a q4_k_m file's Q6_K down
  parts stay plain on x86, where ggml does not repack Q6_K); a type some of whose
  tensors this CPU would not repack (rows not a multiple of the layout's) stays
  plain.
- The dense weights are placed at load by llama.cpp's own `tensor_buft_overrides`
  (`prepare`), from the header alone; a placed tensor's file range is read once, by
  the load, and no longer after. The repacked experts are switched from the first
  graph node Python sees (`switch_experts`), before any expert matmul runs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from moed.engines import kernels
from moed.engines.devices import Offload
from moed.engines.options import REPACK_CHOICES, check_repack
from moed.gguf import interleave
from moed.gguf.catalog import EXPERT_RE
from moed.gguf.header import Header, TensorInfo, type_name
from moed.gguf.layouts import KEY_CPU, KEY_LAYOUTS, PLAIN, layout_refusal, parse_layouts, summary
from moed.protocol.errors import LayoutUnavailable

MODES = REPACK_CHOICES  # the option's values, declared with it (moed.engines.options)


@dataclass
class LayoutPlan:
    """What the engine computes on: the experts' layout, which expert tensors switch, dense on or off."""

    expert_layout: str = PLAIN  # what the engine computes the experts on, and asks the daemon for
    expert_tensors: list[str] = field(default_factory=list)  # names switched to repacked kernels
    repack_dense: bool = False
    on_read: bool = False  # the file is plain: the daemon makes expert_layout as it reads
    # With a GPU offload (n_gpu_layers): the offloaded layers' dense weights are the GPU's,
    # the experts stay on the CPU (moed.engines.devices).
    offload: Offload | None = None


def plan(headers: list[Header], mode: str, path: str, offload: Offload | None = None) -> LayoutPlan:
    """Check the file's expert layout against `mode` and this CPU; raise LayoutUnavailable.
    `offload`: the GPU placement the load will make (moed.engines.devices.offload_for)."""
    layout = _plan(headers, mode, path)
    layout.offload = offload
    return layout


def _plan(headers: list[Header], mode: str, path: str) -> LayoutPlan:
    check_repack(mode)
    file_layouts = parse_layouts(headers[0].get(KEY_LAYOUTS))
    experts = [t for h in headers for t in h.tensors if EXPERT_RE.match(t.name)]
    types = {type_name(t.ggml_type) for t in experts}
    have = summary(file_layouts, types)
    if mode != "auto":
        if file_layouts:
            raise LayoutUnavailable(layout_refusal(path, have, PLAIN))
        return LayoutPlan(repack_dense=mode == "dense")
    if file_layouts:
        _check_file_layouts(headers, file_layouts, experts, path)
        switched = [t.name for t in experts if type_name(t.ggml_type) in file_layouts]
        return LayoutPlan(have, switched, True)
    made, left = on_read_layouts(experts)
    if left:
        warnings.warn(
            f"moed: {path}'s experts of {', '.join(sorted(left))} run on llama.cpp's plain kernels: this CPU "
            f"computes {', '.join(f'{t} on {left[t]}' for t in sorted(left))}, which the daemon does not make "
            "on read; `moectl align --repack` makes a copy whose experts are in that layout",
            RuntimeWarning,
            stacklevel=4,
        )
    switched = [t.name for t in experts if type_name(t.ggml_type) in made]
    return LayoutPlan(summary(made, types), switched, True, on_read=bool(made))


def _check_file_layouts(headers: list[Header], file_layouts: dict[str, str], experts, path: str) -> None:
    """A repacked file's layouts must be what this CPU computes each expert on."""
    for t in experts:
        name, cpu = type_name(t.ggml_type), kernels.layout_of(t.ggml_type, tuple(t.dims[:2]))
        want = file_layouts.get(name, PLAIN)
        if want != PLAIN and want != cpu:
            made_for = headers[0].get(KEY_CPU, "another CPU")
            raise LayoutUnavailable(
                f"{layout_refusal(path, f'{want} (repacked for {made_for})', cpu)}; "
                f"this host's llama.cpp computes {name} of shape {t.dims[0]}x{t.dims[1]} on {cpu}"
            )


def on_read_layouts(experts: list[TensorInfo]) -> tuple[dict[str, str], dict[str, str]]:
    """For a plain file's expert tensors: ({type: layout} to ask the daemon to make on read,
    {type: layout} this CPU computes on but that stay plain: the daemon cannot make them).

    Per type, as stock decides per tensor: a type is asked only when this CPU's ggml
    computes every tensor of it on one layout, and the daemon makes that layout for
    each of them (moed.gguf.interleave); a type no tensor of which repacks is plain."""
    by_type: dict[str, set[str]] = {}
    makeable: dict[str, bool] = {}
    for t in experts:
        name, cpu = type_name(t.ggml_type), kernels.layout_of(t.ggml_type, tuple(t.dims[:2]))
        by_type.setdefault(name, set()).add(cpu)
        ok = cpu != PLAIN and interleave.can_make(cpu, t.ggml_type, t.dims[:2])
        makeable[name] = makeable.get(name, True) and ok
    made, left = {}, {}
    for name, cpus in by_type.items():
        if cpus == {PLAIN}:
            continue
        if len(cpus) == 1 and makeable[name]:
            made[name] = next(iter(cpus))
        else:
            left[name] = "+".join(sorted(cpus))
    return made, left


def dense_repacked(headers: list[Header], layout: LayoutPlan) -> list[tuple[int, TensorInfo]]:
    """(shard, tensor) of every dense weight that goes to CPU_REPACK: stock's choice, from the header alone."""
    if not layout.repack_dense:
        return []
    return [
        (shard, t)
        for shard, h in enumerate(headers)
        for t in h.tensors
        if kernels.stock_repacks_dense(t.name.encode(), t.ggml_type, tuple(t.dims))
        and not (layout.offload is not None and layout.offload.on_gpu(t.name))
    ]


def dense_offloaded(headers: list[Header], layout: LayoutPlan) -> list[tuple[int, TensorInfo]]:
    """(shard, tensor) of every weight the load copies into a GPU's memory (none without an
    offload): read from the mapping once, never again."""
    off = layout.offload
    if off is None:
        return []
    return [
        (shard, t)
        for shard, h in enumerate(headers)
        for t in h.tensors
        if off.on_gpu(t.name) and not EXPERT_RE.match(t.name)
    ]


def prepare(headers: list[Header], layout: LayoutPlan) -> kernels.KernelSwitch:
    """The kernel switch for a model about to load: its dense overrides (install them on the
    load's params) and whether repacked experts wait for `switch_experts`."""
    dense = dense_repacked(headers, layout)
    experts_on_cpu = layout.offload is not None
    overrides = kernels.DenseOverrides((t.name for _, t in dense), experts_on_cpu) if dense or experts_on_cpu else None
    ks = kernels.KernelSwitch(overrides)
    ks.done.expert_layout = layout.expert_layout
    ks.done.dense_tensors = len(dense)
    ks.done.dense_bytes = sum(t.n_bytes for _, t in dense)
    ks.done.dense_layouts = tuple(sorted({kernels.layout_of(t.ggml_type, tuple(t.dims[:2])) for _, t in dense}))
    ks.experts_pending = bool(layout.expert_tensors)
    return ks


def switch_experts(ks: kernels.KernelSwitch, node: int, headers: list[Header], bases: list[int], layout: LayoutPlan):
    """Point the repacked expert tensors at the repacked kernels, found from graph node `node`
    (a node of the first decode, before any expert matmul). LayoutUnavailable names a tensor
    that could not be found; nothing is switched then."""
    wanted_names = set(layout.expert_tensors)
    anchors: dict[bytes, int] = {}
    wanted: dict[bytes, int] = {}
    for shard, h in enumerate(headers):
        for t in h.tensors:
            anchors[t.name.encode()] = bases[shard] + t.offset
            if t.name in wanted_names:
                wanted[t.name.encode()] = bases[shard] + t.offset
    try:
        found = kernels.find_in_graph(node, anchors, wanted)
    except LookupError as exc:
        raise LayoutUnavailable(f"{headers[0].path}: the repacked experts cannot be switched: {exc}") from exc
    ks.repack_experts(found.values())


def file_transform(headers: list[Header]):
    """The `moed.gguf.align.Transform` of `moectl align --repack`: every routed expert
    tensor whose type this CPU's llama.cpp repacks, expert by expert, by ggml's repack.

    Raises ValueError when the file is repacked already or nothing in it would be.
    """
    import llama_cpp

    from moed.gguf.align import Transform
    from moed.gguf.layouts import KEY_BUILD, format_layouts

    if headers[0].get(KEY_LAYOUTS) is not None:
        raise ValueError(f"{headers[0].path} is repacked already ({KEY_LAYOUTS}); repack the original file")
    repackers: dict[tuple[int, int, int], kernels.Repacker] = {}
    found: dict[str, str] = {}
    plain: set[str] = set()
    for h in headers:
        for t in h.tensors:
            if not EXPERT_RE.match(t.name):
                continue
            layout = kernels.layout_of(t.ggml_type, tuple(t.dims[:2]))
            if layout == PLAIN:
                plain.add(type_name(t.ggml_type))
                continue
            key = (t.ggml_type, t.dims[0], t.dims[1])
            if key not in repackers:
                repackers[key] = kernels.Repacker(*key)
            found[type_name(t.ggml_type)] = layout
    if not found:
        raise ValueError(
            f"nothing to repack: this CPU's llama.cpp computes the experts' types "
            f"({', '.join(sorted(plain))}) on its plain kernels"
        )
    mixed = set(found) & plain
    if mixed:
        raise ValueError(f"experts of type {', '.join(sorted(mixed))} would be repacked in some layers only")

    def unit_of(t):
        if not EXPERT_RE.match(t.name):
            return None
        return repackers.get((t.ggml_type, t.dims[0], t.dims[1]))

    kvs: dict[str, str | list[str]] = {
        KEY_LAYOUTS: format_layouts(found),
        KEY_CPU: kernels.cpu_backend().features(),
        KEY_BUILD: llama_cpp.__version__,
    }
    return Transform(unit_of, kvs)
