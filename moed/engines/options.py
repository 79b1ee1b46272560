"""`EngineOptions`: a streamed engine's options, declared once.

What this module owns: the plain-value options of `StreamedLlama` (moed.engines.llama_cpp),
which are also what the server seam passes to every model it loads
(moed.serve.app), what a serve worker's spec carries as JSON (moed.serve), and
what the engine verbs' flags set (`moectl generate`, `chat`, `trace`, `kl`: group
`RUN`; `moectl serve`: group `SERVE`). Each field holds its default and, where a verb
group exposes it, its flag: the name, the help that group prints, the type and the
choices. The CLI builds its arguments with `add_flags` and reads them back with
`from_args`; StreamedLlama's keyword arguments are these fields (less
`client_timeout_s`) plus the objects only Python callers pass (client, source, and
the callbacks, which it gathers in one `EngineHooks`). The streamer
(moed.engines.streamer) is built from the same two: `ExpertStreamer(source, options,
hooks, layout)`.

Invariants:
- A field's default is StreamedLlama's keyword default, its flag's default and
  README's; StreamedLlama builds its EngineOptions from its keywords by these names
  and hands the streamer that object (tests/unit/test_options.py checks the
  signature, the flags and the README against this declaration).
- A flag's `dest` is argparse's own (`--acquire-timeout` -> `args.acquire_timeout`,
  `--threads` -> `args.threads`), so the flags, their help and the names other code
  reads are as they were.
- A new option is one field here, and its use in StreamedLlama. No verb declares an
  engine flag by hand.
- Some options are llama.cpp's own settings too (`llama_settings()`: `n_gpu_layers`,
  `n_threads`, `n_threads_batch`, marked `llama=True`): declared and checked here like
  every other, and passed on to `llama_cpp.Llama` by StreamedLlama as its keywords of
  the same names, so each is one value, never a second keyword beside the option.
- Every value is checked by its field's declared type and range before anything is
  loaded (`check()`, called by StreamedLlama and by `moectl serve` before it starts a
  worker, for every model with the options it gets): `bool` is refused where an int or
  a float is meant, a string is never read as a truth value nor as a number, and the
  error (`OptionError`, a TypeError and a ValueError) names the option, the value and
  what it takes. What the options mean for one model file (`for_model`: `gpu_slots`
  against its top-k and expert count, and against the layers `n_gpu_layers` puts on the
  device) is checked from its header, again before any load.
- A `moectl serve` config's model entry may set, for itself, the options serve's flags
  set for every model and llama.cpp's settings among the options (`per_model()`).
"""

from __future__ import annotations

import argparse
import dataclasses
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from moed.engines.lookahead import PredictHook

RUN = "run"  # moectl generate, chat, trace, kl
SERVE = "serve"  # moectl serve (every model it loads)
PREFETCH_CHOICES = ("gate", "gate2", "off")  # as the flags list them (moed.engines.lookahead.MODES)
WARM_CHOICES = ("off", "resident", "all")
# Which weights run on stock llama.cpp's repacked CPU kernels (moed.engines.repack):
# the same three values, with the same meaning, for StreamedLlama and UnpackedLlama.
REPACK_CHOICES = ("auto", "dense", "off")


@dataclass(frozen=True)
class Flag:
    """How a verb group shows one option: `help[group]` for each group that has the flag."""

    name: str
    help: dict[str, str]
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    action: str | None = None  # "store_true": a switch (a bool option whose default is False)

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


def _option(default: Any, flag: Flag | None = None, *, llama: bool = False) -> Any:
    """A field's default, its flag (None: Python and config only) and whether it is llama.cpp's
    own setting too (`llama`: passed on to `llama_cpp.Llama` under the field's name)."""
    return field(default=default, metadata={"flag": flag, "llama": llama})


@dataclass(frozen=True)
class EngineOptions:
    """What a streamed engine is told: moed's options and the llama.cpp settings that are
    options too (where the layers compute and on how many threads); the rest of llama.cpp's
    settings (n_ctx, n_batch, seed, ...) are its own, passed through.

    See StreamedLlama's docstring for what each option does.
    """

    # The daemon's socket (the CLI's global --socket; None: $MOED_SOCKET or the default).
    socket_path: str | None = None
    acquire_timeout_s: float | None = _option(
        None,
        Flag(
            "--acquire-timeout",
            {SERVE: "seconds an acquire may wait for budget (default: the daemon's)"},
            type=float,
        ),
    )
    skeleton_dir: str | None = _option(
        "auto",
        Flag(
            "--skeleton-dir",
            {
                RUN: "load llama.cpp from a skeleton of the model kept here (dense bytes only): "
                "the load then reads no expert bytes from the drive (default auto: "
                "$MOED_SKELETON_DIR or ~/.cache/moed/skeletons; off: load the real file, read whole)",
                SERVE: "load llama.cpp from a skeleton of each model kept here "
                "(default auto: $MOED_SKELETON_DIR or ~/.cache/moed/skeletons; off: the real files)",
            },
        ),
    )
    strict: bool = False
    prefetch: str = _option(
        "gate",
        Flag(
            "--prefetch",
            {
                RUN: "predict experts from the hidden state and prefetch them while computing: one layer "
                "ahead (gate, default), also two ahead (gate2), or acquire on demand only (off)",
                SERVE: "gate-ahead prefetch: one layer ahead (gate, default), also two (gate2), or off",
            },
            choices=PREFETCH_CHOICES,
        ),
    )
    prefetch_width: int | None = _option(
        None,
        Flag(
            "--prefetch-width",
            {
                RUN: "experts per token to prefetch (default: the model's top-k)",
                SERVE: "experts per token to prefetch",
            },
            type=int,
        ),
    )
    prefetch_adapt: bool = True
    subst: float | None = _option(
        None,
        Flag(
            "--subst",
            {
                RUN: "substitution: a chosen expert that is not resident may be replaced by a resident one "
                "among the router's next k whose probability is at least R times its own (changes the "
                "outputs; price it with `moectl kl`; default off: exact)"
            },
            type=float,
            metavar="R",
        ),
    )
    subst_rule: str = _option(
        "plain",
        Flag(
            "--subst-rule",
            {
                RUN: "which stand-in: the best-ranked (plain, default) or the one most often routed together "
                "with the missing expert (cooc, learned online)"
            },
            choices=("plain", "cooc"),
        ),
    )
    subst_window: int | None = None
    repack: str = _option(
        "auto",
        Flag(
            "--repack",
            dict.fromkeys(
                (RUN, SERVE),
                "CPU kernels: stock llama.cpp's repacked ones where this CPU has them (auto, default; a plain "
                "file's experts are repacked by the daemon as it reads them), stock's for the dense weights and "
                "the plain ones for the experts (dense), or the plain ones (off)",
            ),
            choices=REPACK_CHOICES,
        ),
    )
    warm: str = _option(
        "off",
        Flag(
            "--warm",
            dict.fromkeys(
                (RUN, SERVE),
                "at load, map the experts the daemon holds (resident), or read and map every expert "
                "(all: for a model the budget holds), so the first tokens pay no first-use faults or reads "
                "(default off)",
            ),
            choices=WARM_CHOICES,
        ),
    )
    # llama.cpp's own settings as well (llama=True: StreamedLlama passes them on). N counts as
    # llama.cpp counts it (moed.engines.devices): the output layer first, then the blocks from
    # the last; any negative value is every layer.
    n_gpu_layers: int = _option(
        0,
        Flag(
            "--n-gpu-layers",
            dict.fromkeys(
                (RUN, SERVE),
                "layers on the GPU, counted as llama.cpp counts them: N is the output layer and the last N-1 "
                "blocks (1: the output layer only; -1: every layer); their dense weights on the GPU, the routed "
                "experts on the CPU from moed (llama.cpp's --n-cpu-moe) unless --gpu-slots; needs a GPU build of "
                "llama.cpp (Vulkan) and a device (default 0: everything on the CPU)",
            ),
            type=int,
            metavar="N",
        ),
        llama=True,
    )
    # None (or 0, or negative): the daemon's to decide, between decodes (moed.engines.turns).
    n_threads: int | None = _option(
        None,
        Flag(
            "--threads",
            {
                RUN: "CPU threads (default: moed shares the cores among the engines)",
                SERVE: "CPU threads of each worker (default: moed shares the cores among the engines)",
            },
            type=int,
        ),
        llama=True,
    )
    n_threads_batch: int | None = _option(None, llama=True)
    gpu_slots: int = _option(
        0,
        Flag(
            "--gpu-slots",
            dict.fromkeys(
                (RUN, SERVE),
                "with --n-gpu-layers: compute the offloaded layers' routed experts on the GPU, from S device "
                "slots a layer fed from moed's RAM tier (an LRU; default 0: those experts on the CPU)",
            ),
            type=int,
            metavar="S",
        ),
    )
    gpu_zero_copy: bool = _option(
        False,
        Flag(
            "--gpu-zero-copy",
            dict.fromkeys(
                (RUN, SERVE),
                "with --gpu-slots: the device reads the experts in place from moed's RAM tier (its segments "
                "imported as host memory), nothing uploaded; off by default: a real integrated GPU read imported "
                "host memory at about 1 GB/s (the reference page), below its own memory",
            ),
            action="store_true",
        ),
    )
    # The server's connection to the daemon (moed.serve.app opens it, with this
    # timeout); not StreamedLlama's, whose own client keeps Client's default.
    client_timeout_s: float = 30.0

    def streamed_kwargs(self) -> dict[str, Any]:
        """StreamedLlama's keyword arguments for these options."""
        return {name: getattr(self, name) for name in self.engine_fields()}

    @classmethod
    def engine_fields(cls) -> tuple[str, ...]:
        """The fields that are StreamedLlama keyword arguments (all but the server's own)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in _SERVER_ONLY)

    def llama_settings(self) -> dict[str, Any]:
        """The options that are llama.cpp's own settings too, as `llama_cpp.Llama`'s keywords."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("llama")}

    @classmethod
    def per_model(cls) -> tuple[str, ...]:
        """The options one model of `moectl serve` may set for itself (a config's model entry): those
        serve's flags set for every model, and llama.cpp's settings among the options."""
        return tuple(
            f.name
            for f in dataclasses.fields(cls)
            if f.metadata.get("llama") or (f.metadata.get("flag") is not None and SERVE in f.metadata["flag"].help)
        )

    def check(self) -> None:
        """OptionError (a TypeError and a ValueError) for a value StreamedLlama cannot run with,
        naming the option: first every field against its declared type, then the ranges
        (repack: moed.engines.repack.plan). llama.cpp's settings take every int of their type,
        as llama.cpp does: a negative `n_gpu_layers` is every layer, and a thread count of
        None, 0 or below is the daemon's to choose (moed.engines.turns.own_count)."""
        from moed.engines.lookahead import MODES

        for f in dataclasses.fields(self):
            check_type(f.name, getattr(self, f.name), str(f.type))
        if self.prefetch not in MODES:
            raise OptionError("prefetch", self.prefetch, f"one of {', '.join(MODES)}")
        check_repack(self.repack)
        if self.warm not in WARM_CHOICES:
            raise OptionError("warm", self.warm, f"one of {', '.join(WARM_CHOICES)}")
        if self.prefetch_width is not None and self.prefetch_width < 1:
            raise OptionError("prefetch_width", self.prefetch_width, "None (the model's top-k) or an int >= 1")
        if self.subst_window is not None and self.subst_window < 1:
            raise OptionError("subst_window", self.subst_window, "None (the model's top-k) or an int >= 1")
        if self.gpu_slots < 0:
            raise OptionError("gpu_slots", self.gpu_slots, "an int >= 0 (0: the experts on the CPU)")
        if self.gpu_zero_copy and not self.gpu_slots:
            raise OptionError(
                "gpu_zero_copy",
                True,
                "False unless gpu_slots is set: zero copy feeds the device slots from moed's RAM tier in place; "
                "set gpu_slots too (S bounds a batch's distinct experts in a layer, as without it)",
            )

    def for_model(self, model: ModelFacts) -> tuple[EngineOptions, str | None]:
        """These options for one model file (after `check()`): OptionError for device slots that
        cannot run (no `n_gpu_layers`, fewer than one token's top-k, or no MoE layer among the
        layers N puts on the device), and `gpu_slots` above the model's expert count recorded
        as that count, with a note saying so (None: nothing changed). Every count that reports
        the slots (stream_stats, the daemon's engine line) then says the one number."""
        from moed.gguf.catalog import format_ranges

        n_gpu_layers = self.n_gpu_layers
        s = self.gpu_slots
        if not s:
            return self, None
        if not n_gpu_layers:
            raise OptionError(
                "gpu_slots",
                s,
                "0 unless n_gpu_layers is set: the slots hold the offloaded layers' experts "
                "(n_gpu_layers=-1: every layer)",
            )
        if s < model.n_expert_used:
            raise OptionError(
                "gpu_slots",
                s,
                f"0 or at least {model.n_expert_used}: one token routes to {model.n_expert_used} "
                "experts a layer in this model",
            )
        first = 0 if n_gpu_layers < 0 else max(model.n_layers + 1 - n_gpu_layers, 0)
        if not any(layer >= first for layer in model.moe_layers):
            on_device = "the output layer only" if first >= model.n_layers else f"blocks {first}-{model.n_layers - 1}"
            raise OptionError(
                "gpu_slots",
                s,
                f"0 with n_gpu_layers={n_gpu_layers}: N puts the output layer and the last N-1 "
                f"blocks on the device, here {on_device}, and no routed-expert (MoE) layer among them "
                f"(MoE layers: {format_ranges(model.moe_layers)}; n_gpu_layers=-1: every layer)",
            )
        if s <= model.n_experts:
            return self, None
        note = (
            f"moed: gpu_slots={s} is more than this model's {model.n_experts} experts a layer: "
            f"{model.n_experts} slots a layer, every expert on the device"
        )
        return dataclasses.replace(self, gpu_slots=model.n_experts), note

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser, group: str) -> None:
        """The flags `group` (RUN or SERVE) shows, with their defaults and that group's help."""
        for name, flag in _flags(group):
            kw: dict[str, Any] = {"default": cls.__dataclass_fields__[name].default, "help": flag.help[group]}
            kw |= {k: v for k in ("type", "choices", "metavar", "action") if (v := getattr(flag, k)) is not None}
            parser.add_argument(flag.name, **kw)

    @classmethod
    def from_args(cls, args: argparse.Namespace, group: str, **given: Any) -> EngineOptions:
        """The options `group`'s flags set in `args` (the rest their defaults, or `given`)."""
        return cls(**{name: getattr(args, flag.dest) for name, flag in _flags(group)}, **given)


# A benchmark hook: called with (layer, ids) where ids is the writable (n_tokens, k)
# view of the router's choice; it may overwrite ids before the expert matmuls run.
RouteHook = Callable[[int, "np.ndarray"], None]


@dataclass(frozen=True)
class EngineHooks:
    """The callbacks a Python caller may hand a streamed engine (benchmarks, tests): every
    one None by default, and then nothing of it runs.

    `route(layer, ids)`: may overwrite the router's top-k ids in place, before the
    experts are acquired (RouteHook). `predict(target, lead,
    ids)`: may overwrite the look-ahead's predictions (moed.engines.lookahead.PredictHook).
    What only observes (traces, tests) is added later: `ExpertStreamer.observers` and
    `record_predictions`.
    """

    route: RouteHook | None = None
    predict: PredictHook | None = None


NO_HOOKS = EngineHooks()


def check_repack(repack: str) -> None:
    """ValueError unless `repack` is one of REPACK_CHOICES (every engine takes the same)."""
    if repack not in REPACK_CHOICES:
        raise ValueError(
            f"repack must be one of {', '.join(REPACK_CHOICES)} (auto: stock's repacked kernels for every weight, "
            f"dense: for the dense weights only, off: none), not {repack!r}"
        )


class OptionError(TypeError, ValueError):
    """A value an engine option does not take. A TypeError (a wrong type) and a ValueError (a
    wrong value) both, so callers that catch either (the CLI's `ValueError` -> one line) see
    it; `option`, `value` and `accepted` say which, what and what it takes."""

    def __init__(self, option: str, value: Any, accepted: str):
        self.option, self.value, self.accepted = option, value, accepted
        super().__init__(f"{option}={value!r} is not accepted: {option} takes {accepted}")


# What each declared type takes, as the errors say it. bool is not an int here (True is not
# 1 slot) and no string is a truth value ("no" is not True).
_TAKES = {
    "bool": "True or False (a bool)",
    "int": "a whole number (an int, not a bool, a float or a string)",
    "float": "a number (an int or a float, not a bool or a string)",
    "str": "a string",
    "None": "None",
}


def _is(value: Any, kind: str) -> bool:
    if kind == "None":
        return value is None
    if kind == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind == "int":
        return isinstance(value, numbers.Integral)
    if kind == "float":
        return isinstance(value, numbers.Real)
    return kind == "str" and isinstance(value, str)


def check_type(option: str, value: Any, declared: str) -> None:
    """OptionError unless `value` is of the `declared` type (a field's annotation: "int",
    "float | None", ...), naming `option`, the value and what it takes."""
    kinds = [k.strip() for k in declared.split("|")]
    if not any(_is(value, k) for k in kinds):
        raise OptionError(option, value, " or ".join(_TAKES.get(k, k) for k in kinds))


@dataclass(frozen=True)
class ModelFacts:
    """What `EngineOptions.for_model` needs of a model file (moed.gguf.catalog.Catalog has each)."""

    n_layers: int
    moe_layers: tuple[int, ...]
    n_experts: int
    n_expert_used: int

    @classmethod
    def of(cls, path: str) -> ModelFacts:
        """The facts from the file's header (the GGUF catalog: no llama.cpp, no expert bytes read)."""
        from moed.gguf.catalog import Catalog

        cat = Catalog.open(path)
        return cls(cat.n_layers, tuple(cat.moe_layers), cat.n_experts, cat.n_expert_used)


_SERVER_ONLY = ("client_timeout_s",)


def _flags(group: str) -> list[tuple[str, Flag]]:
    found = [(f.name, f.metadata.get("flag")) for f in dataclasses.fields(EngineOptions)]
    return [(name, flag) for name, flag in found if flag is not None and group in flag.help]


__all__ = [
    "RUN",
    "SERVE",
    "REPACK_CHOICES",
    "EngineHooks",
    "EngineOptions",
    "Flag",
    "ModelFacts",
    "OptionError",
    "NO_HOOKS",
    "RouteHook",
    "check_repack",
    "check_type",
]
