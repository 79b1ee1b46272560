"""`StreamedLlama`: llama-cpp-python's `Llama` with its routed experts served by moed.

What this module owns: loading llama.cpp so that the experts are left to the
daemon (docs/design.md, "Engine technique"), and keeping `Llama`'s whole API
(`__call__`, `create_completion`, `create_chat_completion`, `tokenize`, `eval`, ...).

How it hooks in without copying `Llama.__init__`: while the base constructor
runs, `llama_cpp.llama.internals` is swapped (under a lock) for a copy whose
`LlamaModel` forces `load_mode=MMAP`, `use_extra_bufts=False`, no GPU layers unless the
layout plan offloads some (`n_gpu_layers`, moed.engines.devices), lazy per-layer embeddings,
builds the offloaded layers' device placement (with `gpu_slots`), and installs the expert
pages right after the load, and whose `LlamaContext` sets
`cb_eval` and finishes every `decode` by releasing the last layer.

Invariants:
- Pinned to llama-cpp-python==0.3.36; the ggml tensor layout is checked at start.
- Every decode ends with no grant held, also when it fails.
- A daemon that dies fails the decode in flight with `DaemonUnavailable`; every
  later decode first binds the engine again to the daemon that came back (the
  client's bounded reconnect; `ExpertStreamer.ensure_bound`), with the model and
  the KV cache kept, or raises `DaemonUnavailable` when it does not come back.
- A prompt batch whose experts cannot be held at once (device slots or the daemon's
  budget) is split for that `eval()` call alone: halved, with a RuntimeWarning naming
  the limit, and retried from the first token not yet evaluated; at one token the
  error propagates. `n_batch` stays what the user asked. Nothing fails silently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
import traceback
import types
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import llama_cpp
import llama_cpp.llama as _llama_module
import numpy as np
from llama_cpp import Llama

from moed.engines import blas, ggml_tensor
from moed.engines.devices import compute_line, gpu_devices, offload_for
from moed.engines.lookahead import PredictHook
from moed.engines.options import (
    EngineHooks,
    EngineOptions,
    ModelFacts,
    RouteHook,
    check_repack,
)
from moed.engines.sources import ExpertSource, MoedSource
from moed.engines.streamer import ExpertStreamer, snapshot_bases
from moed.engines.turns import ComputeTurns, check_counts
from moed.protocol.errors import BudgetExhausted, RequestTooLarge

if TYPE_CHECKING:
    from moed.engines.device_placement import DevicePlacement
    from moed.engines.placement import DeviceBuild

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
_HOOK_LOCK = threading.Lock()
DEVICE_REPORT_S = 1.0  # the most often an engine tells the daemon its device counters (DeviceReport)
# Settings llama-cpp-python's server passes to every model it loads that `Llama` takes only
# through its `**kwargs` (and ignores): accepted, so the server seam keeps working.
SERVER_EXTRAS = ("rpc_servers", "mul_mat_q")


def _init_params(cls: type) -> list[str]:
    import inspect

    init = cls.__dict__.get("__init__")
    return list(inspect.signature(init).parameters) if init is not None else []


def refuse_unknown(engine: type, llama_kwargs: dict) -> None:
    """TypeError for a keyword neither `engine` nor `llama_cpp.Llama` declares: `Llama` takes
    `**kwargs` and would ignore a misspelt option without a word. The error names the
    nearest known option."""
    import difflib
    import inspect

    llama = set(inspect.signature(Llama.__init__).parameters) - {"self", "kwargs"}
    unknown = [k for k in llama_kwargs if k not in llama and k not in SERVER_EXTRAS]
    if not unknown:
        return
    own = {name for cls in engine.__mro__[: engine.__mro__.index(Llama)] for name in _init_params(cls)}
    known = sorted(llama | own - {"self", "args", "kwargs", "llama_kwargs"})
    hints = []
    for name in unknown:
        near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hints.append(f"{name!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    raise TypeError(
        f"{engine.__name__}: unknown option{'s' if len(unknown) > 1 else ''} {', '.join(hints)}: "
        f"neither {engine.__name__} nor llama_cpp.Llama takes {'them' if len(unknown) > 1 else 'it'}"
    )


@contextlib.contextmanager
def _constructing(internals: types.ModuleType):
    """Run a `Llama.__init__` with `internals` in place of llama_cpp's (one at a time)."""
    with _HOOK_LOCK:
        saved = _llama_module.internals
        _llama_module.internals = internals
        try:
            yield
        finally:
            _llama_module.internals = saved


class _RouteCallback:
    """An eval callback that only lets a route hook rewrite the top-k ids (benchmarks)."""

    def __init__(self, hook: RouteHook):
        self.hook = hook
        # The same C ask pass as the streamer's, so the two engines pay alike per node.
        self.c_callback = ggml_tensor.EvalCallback(self._on_node)

    def _on_node(self, tensor: int) -> bool:
        layer = ggml_tensor.topk_layer(tensor)
        if layer is None:
            return True
        try:
            self.hook(layer, ggml_tensor.topk_view(tensor))
            return True
        except BaseException:  # noqa: BLE001 - must not unwind through C
            traceback.print_exc()
            return False


def _unpacked_internals(
    route: _RouteCallback | None = None, dense: list | None = None, stock: bool = False
) -> types.ModuleType:
    """llama_cpp's internals with weight repacking off (tensors stay at their file offsets);
    with `dense` (a list), the dense weights go to CPU_REPACK after the load, as stock's do,
    and the KernelSwitch is appended to it; `stock`: the load left as it is (route hook only)."""
    real = _llama_module.internals
    proxy = types.ModuleType(real.__name__)
    proxy.__dict__.update(real.__dict__)
    keep: list = []

    def load_model(*, path_model: str, params, verbose: bool = True):
        if stock:
            if params.n_gpu_layers:  # llama.cpp's --n-cpu-moe: the experts stay on the CPU
                from moed.engines.kernels import DenseOverrides

                overrides = DenseOverrides((), experts_on_cpu=True)
                overrides.install(params)
                keep.append(overrides)  # the array must outlive the load
            return real.LlamaModel(path_model=path_model, params=params, verbose=verbose)
        params.use_extra_bufts = False
        if dense is None:
            return real.LlamaModel(path_model=path_model, params=params, verbose=verbose)
        from moed.engines import repack
        from moed.gguf.header import read_split

        ks = repack.prepare(read_split(path_model), repack.LayoutPlan(repack_dense=True))
        if ks.dense is not None:
            ks.dense.install(params)  # llama.cpp places them in CPU_REPACK itself, as stock's load does
        dense.append(ks)
        model = real.LlamaModel(path_model=path_model, params=params, verbose=verbose)
        return model

    def new_context(*, model, params, verbose: bool = True):
        if route is not None:
            route.c_callback.install(params)
        if keep:  # offloaded: no op offload either, as StreamedLlama computes
            params.op_offload = False
        return real.LlamaContext(model=model, params=params, verbose=verbose)

    proxy.__dict__.update(LlamaModel=load_model, LlamaContext=new_context)
    return proxy


class _OwnedLlama(Llama):
    """A `Llama` whose engine sets up more than llama.cpp's objects: all of it goes on one
    exit stack as it is made (`_teardown`), and `close` unwinds it in the reverse order,
    llama.cpp's model, context and batch first (`_load` pushes them last). A failure in
    `__init__` unwinds it at once; a second close, or the finalizer's, finds nothing."""

    _teardown: contextlib.ExitStack

    @contextlib.contextmanager
    def _setting_up(self):
        """Around an engine's whole __init__: the stack made first, unwound on any failure."""
        self._teardown = contextlib.ExitStack()
        try:
            yield
        except BaseException:
            self.close()
            raise

    def _load(self, internals: types.ModuleType, model_path: str, llama_kwargs: dict) -> None:
        """`Llama.__init__` with `internals`. Llama's own exit stack is made at the top of its
        __init__; an empty one stands in until then, so close() is safe after any failure."""
        self._stack = contextlib.ExitStack()
        self._teardown.callback(Llama.close, self)  # the last pushed: run first
        with _constructing(internals):
            Llama.__init__(self, model_path=model_path, **llama_kwargs)

    def close(self) -> None:
        self._teardown.close()


class UnpackedLlama(_OwnedLlama):
    """`llama_cpp.Llama`, resident, on the CPU kernels `StreamedLlama(repack=...)` computes on.

    llama.cpp repacks q4_0 (and q4_K, iq4_nl, mxfp4) weights into interleaved
    blocks whose kernels round differently (about 1e-7 relative). `repack` takes
    StreamedLlama's values with their meaning (moed.engines.options.REPACK_CHOICES):
    "off" (the default: nothing repacked, the experts at their file offsets), "dense"
    (the dense weights on CPU_REPACK as stock puts them, the experts plain) or "auto"
    (every weight as stock loads it: stock `llama_cpp.Llama`, as `StockLlama`). So
    each is the bit-exact reference of `StreamedLlama` with the same `repack` on a
    plain file, and a fair baseline; with a file `moectl align --repack` made, the
    reference is stock. `route_hook` (benchmarks only) may rewrite the router's top-k
    ids in place.
    """

    def __init__(self, model_path: str, *, route_hook: RouteHook | None = None, repack: str = "off", **llama_kwargs):
        with self._setting_up():
            refuse_unknown(type(self), llama_kwargs)
            check_repack(repack)
            self._route = _RouteCallback(route_hook) if route_hook is not None else None
            kernels: list | None = [] if repack == "dense" else None
            if kernels is not None:
                self._teardown.callback(_close_all, kernels)  # after the model: nothing computes with them
            internals = _unpacked_internals(self._route, kernels, stock=repack == "auto")
            self._load(internals, model_path, llama_kwargs)


class StockLlama(_OwnedLlama):
    """`llama_cpp.Llama` loaded as stock loads it (every repacked kernel), plus an optional
    `route_hook` that may rewrite the router's top-k ids: benchmarks run stock on the same
    forced routes as the other engines. With `n_gpu_layers` (and a GPU), as llama.cpp's
    `--n-cpu-moe`: the routed experts overridden to the CPU (`-ot exps=CPU`) and no op
    offload, the reference StreamedLlama's GPU hybrid is bit-exact against."""

    def __init__(self, model_path: str, *, route_hook: RouteHook | None = None, **llama_kwargs):
        with self._setting_up():
            refuse_unknown(type(self), llama_kwargs)
            self._route = _RouteCallback(route_hook) if route_hook is not None else None
            self._load(_unpacked_internals(self._route, stock=True), model_path, llama_kwargs)


def _chunks(n: int, size: int) -> list[int]:
    """The sizes of `Llama.eval`'s decodes of `n` tokens in batches of `size`."""
    return [size] * (n // size) + ([n % size] if n % size else [])


def _close_all(closables: list) -> None:
    while closables:
        closables.pop().close()


def _skeleton(source, skeleton_dir: str | os.PathLike) -> list[str]:
    """The files llama.cpp loads: skeleton shards, or the real files ("off", or when the
    default cache cannot hold a skeleton)."""
    from moed.engines.skeleton import default_dir, skeleton_for

    if os.fspath(skeleton_dir) == "off":
        return list(source.files)
    if os.fspath(skeleton_dir) != "auto":
        return skeleton_for(source, skeleton_dir)  # a directory the caller chose: its errors are theirs
    try:
        return skeleton_for(source, default_dir())
    except OSError as exc:
        warnings.warn(
            f"moed: no skeleton of {source.files[0]} in {default_dir()} ({exc}); llama.cpp loads the real "
            "file, reading all of it (set MOED_SKELETON_DIR to a writable directory)",
            RuntimeWarning,
            stacklevel=3,
        )
        return list(source.files)


def _hooked_internals(
    streamer: ExpertStreamer, zero_copy: bool = False, turns: ComputeTurns | None = None
) -> types.ModuleType:
    """A copy of `llama_cpp._internals` whose model and context classes stream experts;
    `zero_copy`: the device slots read moed's segments in place (gpu_zero_copy); `turns`:
    every decode computes in a turn of the daemon's, with its thread counts (moed.engines.turns)."""
    real = _llama_module.internals
    proxy = types.ModuleType(real.__name__)
    proxy.__dict__.update(real.__dict__)

    def load_model(*, path_model: str, params, verbose: bool = True):
        params.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP
        params.use_extra_bufts = False  # a repacked tensor would not sit at its file offset
        if streamer.layout is None or streamer.layout.offload is None:
            params.n_gpu_layers = 0  # no GPU device: nothing to offload (the layout plan checked)
        # the per-layer token embeddings (archs.LAZY_TENSORS) read by rows from the mapping, not
        # copied whole into anonymous memory: gigabytes in the real Gemma 4 and Qwen3.8 files
        params.lazy_mode = llama_cpp.LLAMA_LAZY_MODE_ON
        if streamer.kernels is not None and streamer.kernels.dense is not None:
            streamer.kernels.dense.install(params)  # stock's CPU_REPACK weights, placed by llama.cpp's loader
        before = snapshot_bases(streamer.mapped_files)
        model = real.LlamaModel(path_model=path_model, params=params, verbose=verbose)
        device: DeviceBuild | None = None
        try:
            # The device placement (moed.engines.placement.build_device: copied slots, or with
            # `zero_copy` moed's segments imported into the device) replaces the offloaded
            # layers' expert tensors before any context exists: ggml's scheduler places a
            # MUL_MAT_ID when it splits a graph. Closed here until the streamer takes it over.
            from moed.engines.placement import build_device

            offload = streamer.layout.offload if streamer.layout is not None else None
            device = build_device(model.model, streamer.source, offload, zero_copy)
            streamer.install(before)
            if device is not None:
                built, device = device, None  # the streamer's from place_on's first line, whatever it raises
                streamer.place_on(built.placement, built.layers, stop=built.stop)
        except BaseException:
            model.close()  # first: a device placement outlives the model
            if device is not None:  # built, not yet the streamer's
                device.placement.close()
            raise
        return model

    class StreamedContext(real.LlamaContext):
        def __init__(self, *, model, params, verbose: bool = True):
            streamer.c_callback.install(params)
            # Never copy a CPU weight to the GPU for a prompt batch: an expert tensor's
            # pages are mapped by moed only for the experts a layer routes to.
            params.op_offload = False
            super().__init__(model=model, params=params, verbose=verbose)

        def decode(self, batch):
            # The daemon died since the last decode: bound again to the one that came back
            # (bounded wait; the model and the KV cache are kept), before anything is read.
            streamer.ensure_bound()
            n = int(batch.batch.n_tokens)
            ids = np.ctypeslib.as_array(batch.batch.token, shape=(n,)).copy() if batch.batch.token and n else None
            if turns is not None:  # no two engines' ggml workers spin against each other
                turns.take(self.ctx, batch=n > 1)
            try:
                self._streamed_decode(batch, n, ids)
            finally:
                if turns is not None:
                    turns.end()

        def _streamed_decode(self, batch, n: int, ids) -> None:
            streamer.begin(n, ids)
            # A callback that answers False stops the graph but llama_decode still
            # returns 0 (ggml's scheduler only breaks out of the split), so the
            # stored error is checked on success too: those logits are garbage.
            try:
                with blas.one_thread():  # numpy's BLAS must not spin beside ggml's threads
                    super().decode(batch)
            except RuntimeError as exc:
                err = streamer.take_error()
                if err is not None:
                    raise err from exc
                raise
            finally:
                streamer.finish()
            err = streamer.take_error()
            if err is not None:
                raise err

    proxy.__dict__.update(LlamaModel=load_model, LlamaContext=StreamedContext)
    return proxy


def _slots_repack(repack: str, offload, path: str) -> str:
    """The repack mode with device slots: their uploads need the file's plain bytes, so the
    experts stay plain for every layer (the daemon holds one layout of a model for an
    engine); the dense weights are repacked as stock does. A repacked file is refused."""
    if offload is None or not offload.gpu_slots or repack == "off":
        return repack
    from moed.gguf.catalog import Catalog
    from moed.gguf.layouts import PLAIN
    from moed.protocol.errors import LayoutUnavailable

    if Catalog.open(path).expert_layout != PLAIN:
        raise LayoutUnavailable(
            f"{path}: its experts are repacked for the CPU (moectl align --repack); device slots upload "
            "the plain bytes ggml's GPU kernels read: use the original file"
        )
    return "dense"


def _engine_plan(model_path: str, options: EngineOptions, hooks: EngineHooks):
    """Where the layers compute and on which kernels (moed.engines.repack.LayoutPlan, its
    `offload` the GPU's share): what the options ask of this file on this host, checked."""
    from moed.engines import repack as kernel_layout
    from moed.gguf.header import read_split

    headers = read_split(model_path)
    offload = offload_for(headers, options.n_gpu_layers, options.gpu_slots)  # for_model checked the slots
    if offload is not None and (hooks.route is not None or options.subst is not None):
        what = "route_hook" if hooks.route is not None else "subst"
        raise ValueError(
            f"{what} rewrites the router's ids in place: not with n_gpu_layers (they are in the GPU's "
            "memory); use n_gpu_layers=0 for it"
        )
    return kernel_layout.plan(headers, _slots_repack(options.repack, offload, model_path), model_path, offload)


def _check_llama_kwargs(kwargs: dict) -> None:
    """llama.cpp settings a streamed engine cannot run with (refused) or ignores (warned)."""
    if kwargs.get("use_mmap") is False:
        raise ValueError("StreamedLlama needs use_mmap=True: the experts are mapped into llama.cpp's mapping")
    if kwargs.pop("use_mlock", False):
        warnings.warn(
            "StreamedLlama ignores use_mlock: it locks the dense weights itself "
            "(locking the experts would read the whole model)",
            RuntimeWarning,
            stacklevel=4,
        )
    if kwargs.get("n_gpu_layers", 0) and not gpu_devices():
        warnings.warn(
            "moed: n_gpu_layers is set but this llama.cpp sees no GPU device; everything runs on the CPU",
            RuntimeWarning,
            stacklevel=4,
        )
    if kwargs.get("op_offload"):
        raise ValueError(
            "StreamedLlama needs op_offload off: a prompt batch would copy whole expert tensors to the "
            "GPU, experts moed has not mapped"
        )


def _check_capacity(src) -> None:
    """A single token's experts must fit in one acquire of `src`, or nothing can ever run."""
    for layer in src.moe_layers:
        cap = src.capacity(layer)
        if cap is not None and cap < src.n_expert_used:
            raise RequestTooLarge(
                f"layer {layer}: the daemon holds at most {cap} experts of this size, "
                f"one token needs {src.n_expert_used}"
            )


class StreamedLlama(_OwnedLlama):
    """A drop-in for `llama_cpp.Llama(model_path=..., ...)` whose routed experts come from moed.

    `client`: a `moed.client.Client`; when None, one is opened on `socket_path`
    (default `$MOED_SOCKET` or /run/moed/moed.sock) and closed with this object.
    `acquire_timeout_s`: how long an acquire may wait for budget (None: forever).
    `route_hook`: benchmark only, may overwrite the router's ids in place.
    `skeleton_dir`: llama.cpp loads a skeleton of the model kept there (the real
    file with holes for the experts, see moed.engines.skeleton), so the load reads
    only the dense bytes from the drive. This llama.cpp maps every model file with
    MAP_POPULATE: without a skeleton each load reads the whole model (measured: 3.71
    GiB for a 3.70 GiB model), churns the box's page cache, and over a bad block in
    an expert's range does not return. "auto" (default): the user's cache
    (`skeleton.default_dir()`: $MOED_SKELETON_DIR, else $XDG_CACHE_HOME/moed/skeletons);
    if it cannot be written there, a warning, and the real file. None or "off": the
    real file (`--skeleton-dir off`; `./off` names a directory called off).
    `strict`: released zero-copy experts go back to PROT_NONE, so any read of an
    expert not granted right now faults (tests, debugging). The default leaves them
    mapped to their last slot until it changes: no syscall on a repeated hit.
    Either way an expert never acquired faults.
    `prefetch`: "gate" (default) predicts each layer's experts one layer ahead from
    the hidden state and prefetches them while the engine computes, "gate2" also
    two layers ahead, "off" acquires on demand only. `prefetch_width`: experts per
    token to prefetch (default: the model's top-k). `prefetch_adapt` (default
    True): decode steps measure prefetch on against off and keep the faster
    (moed.engines.governor); False prefetches on every step. Prefetch never
    changes the logits. `predict_hook`: benchmark only, may overwrite predictions.
    `subst`: None (default) computes exactly; a number r > 0 lets a token whose
    chosen expert is not resident use instead the best resident one among the
    router's next `subst_window` (default k) choices whose probability is at least
    r times the missing one's (moed.engines.substitute; this changes the outputs:
    price it with `moectl kl`). `subst_rule`: "plain" (best-ranked) or "cooc"
    (most often routed together with the missing expert, learned online).
    `repack` (the same values, with the same meaning, as UnpackedLlama's: each is
    bit-exact with `UnpackedLlama(repack=...)` of the same value on a plain file):
    "auto" (default) runs every weight on the CPU kernels stock llama.cpp would use,
    bit-exact with stock `llama_cpp.Llama`: the dense weights are repacked at load by
    ggml, and the experts are in this CPU's layout, made by the daemon as it reads a
    plain file or found in a file from `moectl align --repack`; "dense" keeps the
    experts plain; "off" runs everything on the plain kernels. moed.engines.repack.
    `warm`: "off" (default); "resident" maps the experts the daemon holds at load,
    "all" reads and maps every expert (see `warm()`).
    `n_gpu_layers` (llama.cpp's own, passed on to it): N counts as llama.cpp counts, the
    output layer and the last N-1 blocks on the GPU (-1: every layer), their dense weights
    there and the routed experts on the CPU from moed (moed.engines.devices).
    `gpu_slots`: with `n_gpu_layers`, the offloaded layers' routed experts computed on
    the GPU from S device slots a layer (moed.engines.device_slots). `gpu_zero_copy`
    (with `gpu_slots`; off by default): the device reads them in place from moed's RAM
    tier, imported as host memory, and nothing is uploaded (moed.engines.device_host;
    a real integrated GPU read imported host memory at about 1 GB/s).
    A daemon restart needs no user code: the eval in flight raises `DaemonUnavailable`,
    and the next one reconnects (the client's `reconnect_s`, default 30 s: retries from
    50 ms doubling to 1 s), maps the new daemon's RAM tier, and runs on the same model
    and KV cache; `ensure_connected()` does that step alone.
    Threads (llama.cpp's `n_threads`, `n_threads_batch`): a count given (K >= 1) is
    used in full while this is the only active engine and is at most an even share of
    the cores while several are (the daemon's `turn_user_threads = "keep"`: always K);
    one left out (None, 0 or negative) is the daemon's to decide, applied between
    decodes: every core this process may run on while it is the one engine computing,
    an even share when several are (moed.daemon.turns). Either way each decode computes
    in a turn the daemon grants, so engines that together ask for more threads than there
    are cores take turns instead of spinning against each other (`MOED_TURNS=0`: no turns,
    llama-cpp-python's default counts). The attributes follow the counts applied.
    The value options, llama.cpp's `n_gpu_layers`, `n_threads` and `n_threads_batch`
    included, are declared once, in `moed.engines.options.EngineOptions` (defaults, flags,
    help, checks); `self.options` holds them, and `from_options` builds
    an engine from one. The callbacks (`route_hook`, `predict_hook`) are gathered in
    one `EngineHooks`; the streamer is built from the two.
    """

    _ZERO_COPY = ", read in place from moed's RAM tier (zero copy)"
    eval_batches: list[int] = []  # the sizes of the last eval()'s decodes (set by each call)

    @classmethod
    def from_options(cls, model_path: str, options: EngineOptions, **kwargs):
        """`cls(model_path, ...)` with `options` (moed.engines.options) as its keyword arguments;
        `kwargs`: the rest (client, hooks, llama.cpp's settings)."""
        return cls(model_path, **options.streamed_kwargs(), **kwargs)

    def __init__(
        self,
        model_path: str,
        *,
        client=None,
        socket_path: str | None = None,
        acquire_timeout_s: float | None = None,
        route_hook: RouteHook | None = None,
        source: ExpertSource | None = None,
        skeleton_dir: str | os.PathLike | None = "auto",
        strict: bool = False,
        prefetch: str = "gate",
        prefetch_width: int | None = None,
        prefetch_adapt: bool = True,
        predict_hook: PredictHook | None = None,
        subst: float | None = None,
        subst_rule: str = "plain",
        subst_window: int | None = None,
        repack: str = "auto",
        warm: str = "off",
        n_gpu_layers: int = 0,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        gpu_slots: int = 0,
        gpu_zero_copy: bool = False,
        **llama_kwargs,
    ):
        # What this engine sets up is let go in one place, in the reverse order (close): the
        # client it opened last, then the streamer (holds, device slots, kernels), then
        # llama.cpp's model, context and batch first.
        self._own_client = None
        with self._setting_up():
            self._teardown.callback(self._close_own_client)
            refuse_unknown(type(self), llama_kwargs)
            # The value options as one EngineOptions (moed.engines.options declares them, defaults
            # included; tests/unit/test_options.py holds this signature's defaults to them), the
            # callbacks as one EngineHooks.
            given = locals()
            options = EngineOptions(**{name: given[name] for name in EngineOptions.engine_fields()})
            self._start(model_path, options, EngineHooks(route_hook, predict_hook), client, source, llama_kwargs)

    def _start(
        self,
        model_path: str,
        options: EngineOptions,
        hooks: EngineHooks,
        client,
        source: ExpertSource | None,
        llama_kwargs: dict,
    ) -> None:
        if options.skeleton_dir is not None:
            options = dataclasses.replace(options, skeleton_dir=os.fspath(options.skeleton_dir))
        options.check()
        if options.gpu_slots:  # against the file: its top-k, its experts, the layers N offloads
            options, note = options.for_model(ModelFacts.of(model_path))
            if note is not None:
                warnings.warn(note, RuntimeWarning, stacklevel=3)
        self.options = options
        # The options that are llama.cpp's settings too (n_gpu_layers, the thread counts) are
        # its keywords as well: checked above, passed on from here.
        llama_kwargs = {**llama_kwargs, **options.llama_settings()}
        _check_llama_kwargs(llama_kwargs)
        own_threads = check_counts(llama_kwargs)  # counts left to the daemon are None from here
        layout = _engine_plan(model_path, options, hooks)
        offload = layout.offload
        # Zero copy (moed.engines.device_host) where the experts are on a device at all.
        zero_copy = bool(options.gpu_zero_copy and offload is not None and offload.gpu_slots)
        if llama_cpp.__version__ != LLAMA_CPP_PYTHON_VERSION:
            warnings.warn(
                f"moed is tested with llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}, found "
                f"{llama_cpp.__version__}; the ggml tensor layout is checked, the rest is not",
                RuntimeWarning,
                stacklevel=3,
            )
        if source is None:
            if client is None:
                from moed.client import Client

                client = Client(options.socket_path, client_name=f"StreamedLlama[{os.getpid()}]")
                self.own_client(client)
            source = MoedSource(
                client,
                model_path,
                timeout_s=options.acquire_timeout_s,
                expert_layout=layout.expert_layout,
                compute=compute_line(offload) + (self._ZERO_COPY if zero_copy else ""),
            )
        self.moed_client = client
        self.compute_turns = ComputeTurns(client, *own_threads, on_counts=self._threads_now)
        self.streamer = ExpertStreamer(source, options, hooks, layout)
        self._teardown.callback(self.streamer.close)  # after the model: nothing reads its experts any more
        # The device counters' last report (at close too: run after the model, before the slots go).
        self._device_reported_at = -DEVICE_REPORT_S
        self._teardown.callback(self._report_device, final=True)
        if options.skeleton_dir is not None:
            self.streamer.mapped_files = _skeleton(source, options.skeleton_dir)
            model_path = self.streamer.mapped_files[0]
        self._load(_hooked_internals(self.streamer, zero_copy, self.compute_turns), model_path, llama_kwargs)
        if not self._logits_all:  # Llama.eval asks for the last token's logits only
            # The load above ran streamer.install, which builds the look-ahead.
            assert self.streamer.lookahead is not None
            self.streamer.lookahead.expect_output_rows(1)
        _check_capacity(self.streamer.source)
        if options.warm != "off":
            self.warm(everything=options.warm == "all")

    # ---- evaluation with batch lowering ----------------------------------

    def eval(self, tokens: Sequence[int]) -> None:
        """`Llama.eval`, except that a batch naming more experts in a layer than can be held at
        once (the device slots, `SlotsExceeded`, or the daemon's budget) is split for this
        call alone: the failing batch is halved (a RuntimeWarning names the limit) and the
        rest of this call's tokens go in batches of that size, from the first token not yet
        evaluated; at one token the error propagates. `n_batch` stays what was asked, so the
        next call runs in full batches again. `eval_batches`: the sizes of this call's
        decodes, in order (what stock must be fed to compute the same)."""
        tokens = list(tokens)
        start, asked = self.n_tokens, self.n_batch
        self.eval_batches = []
        try:
            while True:
                done, size = self.n_tokens, self.n_batch
                try:
                    super().eval(tokens[self.n_tokens - start :])
                    break
                except (RequestTooLarge, BudgetExhausted) as exc:
                    if size <= 1:
                        raise
                    self._split(exc, asked)
                finally:  # the decodes that went through, at this attempt's size
                    self.eval_batches += _chunks(self.n_tokens - done, size)
        finally:
            self.n_batch = asked
        self._report_device()

    def _split(self, exc: BaseException, asked: int) -> None:
        """Halve this call's batches after `exc`, saying which limit the batch met."""
        from moed.engines.device_placement import SlotsExceeded

        if isinstance(exc, SlotsExceeded):
            limit = f"the device slots (gpu_slots={self.options.gpu_slots} a layer)"
        else:
            limit = "what the daemon's budget can hold at once"
        lowered = max(1, self.n_batch // 2)
        warnings.warn(
            f"moed: a batch of {self.n_batch} tokens routes to more experts in a layer than {limit} "
            f"({type(exc).__name__}: {exc}); this call goes on in batches of {lowered} "
            f"(n_batch stays {asked} for the next)",
            RuntimeWarning,
            stacklevel=3,
        )
        self.n_batch = lowered

    def _report_device(self, final: bool = False) -> None:
        """The device slots' counters to the daemon (`moectl stats`, /metrics): after an eval at
        most every DEVICE_REPORT_S, and once more at close (`final`), fire and forget, so the
        cost is a frame a second; nothing without device slots."""
        # The one placement the load hands the streamer (`place_on`) is the device's; none
        # once the streamer closed it.
        placed = self.streamer.placed if getattr(self, "streamer", None) is not None else []
        now = time.monotonic()
        if not placed or (not final and now - self._device_reported_at < DEVICE_REPORT_S):
            return
        self._device_reported_at = now
        t = cast("DevicePlacement", placed[0]).totals()
        counters = {k: int(t[k]) for k in ("slots", "layers", "hits", "uploads", "upload_bytes", "evictions")}
        # At close nothing may stop the unwinding; after an eval a failure here is a bug, raised.
        with contextlib.suppress(Exception) if final else contextlib.nullcontext():
            self.streamer.source.report_device({**counters, "zero_copy": bool(t.get("zero_copy", False))})

    def warm(self, everything: bool = False) -> int:
        """Map the experts the daemon holds now, so their first use costs no fault (a
        resident engine pays that at load); `everything`: every expert, reading what the
        daemon lacks (the budget must hold the model). Returns the experts mapped."""
        return self.streamer.warm(everything)

    # ---- lifecycle -------------------------------------------------------

    def stream_stats(self) -> dict:
        """The engine's own counters: acquires, pages, and the look-ahead's.

        `stall_s`: seconds spent waiting in acquire (all layers, all decodes);
        `prediction_recall`: routed (token, expert) pairs the one-ahead prediction
        named; `prefetch_issued = prefetch_hits + prefetch_wasted + prefetch_pending`
        (experts named in prefetches, resolved when their layer routes);
        `per_layer[layer]`: the same per layer (moed.engines.lookahead). With `subst`:
        `subst_per_token` (substitutions over all tokens), `subst_reads_avoided`
        (distinct missing experts per layer whose every use went to a stand-in, so no
        read), `subst_weight_share` (routing probability on stand-ins over all chosen).
        Compute turns (moed.engines.turns): `turns` taken, `turn_wait_s` waited for them,
        `threads_auto` (the daemon decides a thread count). `crossings[outcome]`: the routed
        stops of each outcome (moed.engines.holds.OUTCOMES: `lane_hit` and `device_hit` are
        done in C alone), their calls into Python and from it, and their host time `host_s`.
        """
        return {**self.streamer.report(), **self.compute_turns.stats()}

    def _threads_now(self, n_threads: int, n_threads_batch: int) -> None:
        """The counts llama.cpp computes with changed (a turn's): the attributes follow."""
        self.n_threads, self.n_threads_batch = n_threads, n_threads_batch
        self.context_params.n_threads, self.context_params.n_threads_batch = n_threads, n_threads_batch

    def ensure_connected(self) -> None:
        """Bind the engine to a live daemon now, as the next eval would: after moed restarted,
        reconnect (bounded by the client's `reconnect_s`) and map the new RAM tier; nothing
        when the connection is up. Raises DaemonUnavailable when moed does not come back."""
        self.streamer.ensure_bound()

    def own_client(self, client) -> None:
        """`client` is this engine's: closed with it, after everything else (moectl serve
        opens the connection it hands in)."""
        self._own_client = client

    def _close_own_client(self) -> None:
        client, self._own_client = self._own_client, None
        if client is not None:
            client.close()


__all__ = ["StreamedLlama", "UnpackedLlama", "StockLlama", "LLAMA_CPP_PYTHON_VERSION"]
