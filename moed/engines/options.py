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
- A flag's `dest` is argparse's own (`--acquire-timeout` -> `args.acquire_timeout`),
  so the flags, their help and the names other code reads are as they were.
- A new option is one field here, and its use in StreamedLlama.
- The values are checked where they are used (`check()`, called by StreamedLlama),
  so a bad flag fails as it always did: when the engine starts.
"""

from __future__ import annotations

import argparse
import dataclasses
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


def _option(default: Any, flag: Flag | None = None) -> Any:
    return field(default=default, metadata={"flag": flag} if flag is not None else {})


@dataclass(frozen=True)
class EngineOptions:
    """What a streamed engine is told, besides llama.cpp's own settings.

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

    def check(self) -> None:
        """ValueError for a value StreamedLlama cannot run with (repack: moed.engines.repack.plan)."""
        from moed.engines.lookahead import MODES

        if self.prefetch not in MODES:
            raise ValueError(f"prefetch must be one of {', '.join(MODES)}, not {self.prefetch!r}")
        check_repack(self.repack)
        if self.warm not in WARM_CHOICES:
            raise ValueError(f"warm must be one of {', '.join(WARM_CHOICES)}, not {self.warm!r}")
        if self.prefetch_width is not None and self.prefetch_width < 1:
            raise ValueError(f"prefetch_width must be >= 1, not {self.prefetch_width}")
        if self.gpu_slots < 0:
            raise ValueError(f"gpu_slots must be >= 0 (0: the experts on the CPU), not {self.gpu_slots}")
        if self.gpu_zero_copy and not self.gpu_slots:
            raise ValueError(
                "gpu_zero_copy feeds the device slots from moed's RAM tier in place: set gpu_slots too (S bounds "
                "a batch's distinct experts in a layer, as without it)"
            )

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
    "NO_HOOKS",
    "RouteHook",
    "check_repack",
]
