"""Every engine option is declared once (moed.engines.options.EngineOptions), and what
repeats it (StreamedLlama's signature, the verbs' flags, README's signature line) agrees."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from moed.engines.options import RUN, SERVE, EngineOptions

README = Path(__file__).resolve().parents[2] / "README.md"


def declared() -> dict[str, object]:
    return {f.name: f.default for f in dataclasses.fields(EngineOptions) if f.name in EngineOptions.engine_fields()}


def test_streamed_llama_keywords_are_the_declared_options_with_their_defaults():
    pytest.importorskip("llama_cpp")
    from moed.engines.llama_cpp import StreamedLlama

    params = inspect.signature(StreamedLlama.__init__).parameters
    for name, default in declared().items():
        assert name in params, f"StreamedLlama has no keyword {name}"
        assert params[name].default == default, f"{name}: StreamedLlama says {params[name].default!r}, {default!r}"
    # every plain-value keyword is declared (objects only Python callers pass are not options)
    objects = {"self", "model_path", "client", "route_hook", "source", "predict_hook", "llama_kwargs"}
    assert set(params) - objects == set(declared())


@pytest.mark.parametrize("group", [RUN, SERVE])
def test_each_flag_defaults_to_its_declaration(group):
    parser = argparse.ArgumentParser()
    EngineOptions.add_flags(parser, group)
    args = parser.parse_args([])
    shown = {a.dest: a.default for a in parser._actions if a.dest != "help"}
    assert shown, "the group shows no flags"
    options = EngineOptions.from_args(args, group)
    for f in dataclasses.fields(EngineOptions):
        flag = f.metadata.get("flag")
        if flag is not None and group in flag.help:
            assert shown[flag.dest] == f.default == getattr(options, f.name)


def test_readme_signature_lists_every_option_with_its_default():
    text = README.read_text()
    m = re.search(r"`StreamedLlama\(model_path, (.*?)\*\*llama_kwargs\)`", text, re.S)
    assert m, "README has no StreamedLlama(...) signature line"
    listed = {}
    for part in m.group(1).replace("\n", " ").split(","):
        if "=" in part:
            name, value = (s.strip() for s in part.split("=", 1))
            listed[name] = ast.literal_eval(value)
    for name, default in declared().items():
        assert name in listed, f"README's signature leaves out {name}"
        assert listed[name] == default, f"README says {name}={listed[name]!r}, the declaration {default!r}"


@pytest.mark.parametrize(
    ("engine", "given", "hint"),
    [
        ("StreamedLlama", {"prefech": "off"}, "'prefech' (did you mean 'prefetch'?)"),
        ("StreamedLlama", {"n_gpu_layer": 2}, "'n_gpu_layer' (did you mean 'n_gpu_layers'?)"),
        ("UnpackedLlama", {"repak": "off"}, "'repak' (did you mean 'repack'?)"),
        ("StockLlama", {"zzzz": 1}, "'zzzz': neither StockLlama"),
    ],
)
def test_an_unknown_keyword_is_refused_naming_the_nearest_option(engine, given, hint):
    """llama_cpp.Llama takes **kwargs and ignores what it does not know: a misspelt option
    would silently be the default. The engines refuse it before loading anything."""
    pytest.importorskip("llama_cpp")
    from moed.engines import llama_cpp as engines

    with pytest.raises(TypeError) as info:
        getattr(engines, engine)("/nonexistent/model.gguf", **given)
    assert hint in str(info.value), str(info.value)


def test_the_settings_llama_cpp_pythons_server_passes_are_accepted():
    pytest.importorskip("llama_cpp")
    from moed.engines.llama_cpp import StreamedLlama, refuse_unknown

    refuse_unknown(StreamedLlama, {"rpc_servers": None, "mul_mat_q": True, "n_gpu_layers": -1, "seed": 1})


@pytest.mark.parametrize("engine", ["StreamedLlama", "UnpackedLlama"])
@pytest.mark.parametrize("value", ["auto", "dense", "off"])
def test_both_engines_take_the_same_repack_values(engine, value):
    """One set of names for the option, on both engines: a known value gets as far as the
    model file (missing here), an unknown one is refused before, naming the three."""
    pytest.importorskip("llama_cpp")
    from moed.engines import llama_cpp as engines
    from moed.engines.options import REPACK_CHOICES

    assert value in REPACK_CHOICES
    with pytest.raises(Exception) as known:
        getattr(engines, engine)("/nonexistent/model.gguf", repack=value)
    assert "repack must be" not in str(known.value)
    with pytest.raises(ValueError, match=r"repack must be one of auto, dense, off .*'dense '"):
        getattr(engines, engine)("/nonexistent/model.gguf", repack="dense ")


@pytest.mark.parametrize("engine", ["StreamedLlama", "UnpackedLlama", "StockLlama"])
def test_close_is_idempotent_and_safe_after_a_failed_init(engine):
    """Teardown is one exit stack set up first: a failed __init__ unwinds it at once, and a
    later close() (or the finalizer's) finds nothing left."""
    pytest.importorskip("llama_cpp")
    from moed.engines import llama_cpp as engines

    cls = getattr(engines, engine)
    llm = cls.__new__(cls)
    from moed.protocol.errors import MoedError

    with pytest.raises((OSError, ValueError, MoedError)):  # the missing file
        llm.__init__("/nonexistent/model.gguf", n_ctx=64)
    llm.close()
    llm.close()


def test_the_streamer_is_built_from_the_options_and_one_hooks_object():
    """ExpertStreamer's constructor takes the declared options and one EngineHooks, nothing
    else a caller sets: a new option is a field, never another parameter."""
    pytest.importorskip("llama_cpp")
    from moed.engines.options import NO_HOOKS, EngineHooks
    from moed.engines.streamer import ExpertStreamer

    assert list(inspect.signature(ExpertStreamer.__init__).parameters) == [
        "self",
        "source",
        "options",
        "hooks",
        "layout",
    ]
    assert NO_HOOKS == EngineHooks() and NO_HOOKS.route is None and NO_HOOKS.predict is None
    assert {f.name for f in dataclasses.fields(EngineHooks)} == {"route", "predict"}


# ---- values checked by name (issue 47): the table of values once taken that should not be


@pytest.mark.parametrize(
    ("given", "option", "takes"),
    [
        ({"gpu_zero_copy": "no"}, "gpu_zero_copy", "True or False (a bool)"),  # was truthy: zero copy on
        ({"gpu_zero_copy": 1}, "gpu_zero_copy", "True or False (a bool)"),
        ({"gpu_slots": True}, "gpu_slots", "a whole number"),  # was 1 slot
        ({"gpu_slots": "4"}, "gpu_slots", "a whole number"),  # was a TypeError without the option's name
        ({"gpu_slots": 4.5}, "gpu_slots", "a whole number"),
        ({"gpu_slots": -1}, "gpu_slots", "an int >= 0"),
        ({"strict": "yes"}, "strict", "True or False (a bool)"),
        ({"prefetch_adapt": None}, "prefetch_adapt", "True or False (a bool)"),
        (
            {"prefetch_width": False},
            "prefetch_width",
            "a whole number (an int, not a bool, a float or a string) or None",
        ),
        ({"prefetch_width": 0}, "prefetch_width", "an int >= 1"),
        ({"subst_window": 2.0}, "subst_window", "a whole number (an int, not a bool, a float or a string) or None"),
        ({"subst": "0.5"}, "subst", "a number"),
        ({"subst": True}, "subst", "a number"),
        ({"acquire_timeout_s": "5"}, "acquire_timeout_s", "a number"),
        ({"prefetch": 1}, "prefetch", "a string"),
        ({"repack": None}, "repack", "a string"),
        ({"warm": "on"}, "warm", "one of off, resident, all"),
        ({"gpu_zero_copy": True}, "gpu_zero_copy", "set gpu_slots too"),
    ],
)
def test_a_value_of_the_wrong_type_or_range_is_refused_naming_the_option_the_value_and_what_it_takes(
    given, option, takes
):
    from moed.engines.options import OptionError

    with pytest.raises(OptionError) as info:
        EngineOptions(**given).check()
    err = info.value
    (value,) = given.values()
    assert err.option == option and takes in err.accepted, str(err)
    assert str(err).startswith(f"{option}={value!r} is not accepted: {option} takes "), str(err)
    assert isinstance(err, TypeError) and isinstance(err, ValueError), "callers catching either see it"


@pytest.mark.parametrize(
    "given",
    [
        {},
        {"gpu_slots": 4, "gpu_zero_copy": True, "strict": True, "prefetch_adapt": False},
        {"acquire_timeout_s": 5, "subst": 1, "prefetch_width": 2, "subst_window": 3},  # an int is a number
        {"acquire_timeout_s": 0.5, "subst": 0.25, "skeleton_dir": None, "socket_path": "/tmp/s"},
    ],
)
def test_values_of_the_declared_types_pass(given):
    import numpy as np

    EngineOptions(**given).check()
    EngineOptions(gpu_slots=np.int64(4)).check()  # a numpy integer is a whole number too


@pytest.mark.parametrize("value", ["-1", -1.0, 1.5, True, False, None])
def test_n_gpu_layers_is_an_option_and_an_int(value):
    """llama.cpp's setting, declared as an option: checked by check() like every other field."""
    from moed.engines.options import OptionError

    with pytest.raises(OptionError) as info:
        EngineOptions(n_gpu_layers=value).check()
    assert info.value.option == "n_gpu_layers", str(info.value)
    assert str(info.value).startswith(f"n_gpu_layers={value!r} is not accepted: n_gpu_layers takes a whole number")
    for ok in (-1, -2, 0, 1, 99):  # any negative is every layer, as llama.cpp reads it
        EngineOptions(n_gpu_layers=ok).check()


@pytest.mark.parametrize("name", ["n_threads", "n_threads_batch"])
@pytest.mark.parametrize("value", ["4", 2.0, True])
def test_thread_counts_are_options_and_ints_or_none(name, value):
    from moed.engines.options import OptionError

    with pytest.raises(
        OptionError, match=rf"^{name}={value!r} is not accepted: {name} takes a whole number .* or None"
    ):
        EngineOptions(**{name: value}).check()
    for ok in (None, 0, -1, 1, 8):  # None, 0 and below: the daemon's to choose
        EngineOptions(**{name: ok}).check()


def test_llama_cpps_settings_among_the_options_are_declared_once_and_passed_on_by_name():
    """n_gpu_layers and the thread counts are options and llama.cpp's keywords both: the table
    says which, StreamedLlama hands them to llama.cpp from there, and no verb declares their
    flags by hand (each flag appears once in the verb's parser, from the table)."""
    from moed.ctl import build_parser

    options = EngineOptions(n_gpu_layers=-1, n_threads=3)
    assert options.llama_settings() == {"n_gpu_layers": -1, "n_threads": 3, "n_threads_batch": None}
    assert {"n_gpu_layers", "n_threads", "n_threads_batch", "gpu_slots", "prefetch"} <= set(EngineOptions.per_model())
    assert "socket_path" not in EngineOptions.per_model() and "subst" not in EngineOptions.per_model()
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    required = {"generate": ["--prompt", "x"], "trace": ["--prompt-file", "p", "-o", "t"], "kl": ["--prompt-file", "p"]}
    for verb, group in [("generate", RUN), ("chat", RUN), ("trace", RUN), ("kl", RUN), ("serve", SERVE)]:
        parser = sub.choices[verb]
        flags = [s for a in parser._actions for s in a.option_strings]
        for flag in ("--n-gpu-layers", "--threads", "--gpu-slots"):
            assert flags.count(flag) == 1, f"{verb} {flag}"
        args = parser.parse_args(["m.gguf", "--n-gpu-layers", "-1", "--threads", "2", *required.get(verb, [])])
        assert EngineOptions.from_args(args, group).llama_settings() == {
            "n_gpu_layers": -1,
            "n_threads": 2,
            "n_threads_batch": None,
        }


@pytest.mark.filterwarnings("ignore:moed. n_gpu_layers is set but this llama.cpp sees no GPU device")
def test_streamed_llama_hands_llama_cpp_its_settings_from_the_options(monkeypatch):
    """One value each: StreamedLlama's keywords n_gpu_layers / n_threads are the options', and
    llama.cpp gets them under the same names (never a second keyword beside the option)."""
    pytest.importorskip("llama_cpp")
    from moed.engines import llama_cpp as engines

    seen = {}

    class Stop(Exception):
        pass

    def plan(model_path, options, hooks):
        seen["options"] = options
        raise Stop

    def check_counts(kwargs):
        seen["llama"] = dict(kwargs)
        return (0, 0)

    monkeypatch.setattr(engines, "_engine_plan", plan)
    monkeypatch.setattr(engines, "check_counts", check_counts)
    with pytest.raises(Stop):
        engines.StreamedLlama("/nonexistent/model.gguf", n_gpu_layers=2, n_threads=3, n_ctx=64)
    assert seen["options"].n_gpu_layers == 2 and seen["options"].n_threads == 3
    assert seen["llama"]["n_gpu_layers"] == 2 and seen["llama"]["n_threads"] == 3 and seen["llama"]["n_ctx"] == 64


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"gpu_slots": True}, "gpu_slots=True is not accepted"),
        ({"gpu_slots": "4"}, "gpu_slots='4' is not accepted"),
        ({"gpu_zero_copy": "no", "gpu_slots": 4}, "gpu_zero_copy='no' is not accepted"),
        ({"n_gpu_layers": "-1"}, "n_gpu_layers='-1' is not accepted"),
        ({"n_gpu_layers": True}, "n_gpu_layers=True is not accepted"),
        ({"n_gpu_layers": 1.5}, "n_gpu_layers=1.5 is not accepted"),
        ({"n_threads": "2"}, "n_threads='2' is not accepted"),
    ],
)
def test_streamed_llama_refuses_a_bad_value_before_it_opens_anything(given, message):
    """The checks run first: the model file (missing here) is not even looked at."""
    pytest.importorskip("llama_cpp")
    from moed.engines.llama_cpp import StreamedLlama
    from moed.engines.options import OptionError

    with pytest.raises(OptionError, match=message):
        StreamedLlama("/nonexistent/model.gguf", **given)


# A model of 4 blocks, all MoE, 16 experts, top-4 (the generated qwen3moe); one whose
# first block is dense (deepseek2's leading dense block).
QWEN = dict(n_layers=4, moe_layers=(0, 1, 2, 3), n_experts=16, n_expert_used=4)
DEEPSEEK = dict(n_layers=4, moe_layers=(1, 2, 3), n_experts=16, n_expert_used=4)


def _for_model(model: dict, n_gpu_layers: int, **given):
    from moed.engines.options import ModelFacts

    options = EngineOptions(n_gpu_layers=n_gpu_layers, **given)
    options.check()
    return options.for_model(ModelFacts(**model))


def test_gpu_slots_above_the_expert_count_are_recorded_as_the_count_with_a_note():
    options, note = _for_model(QWEN, -1, gpu_slots=10000)
    assert options.gpu_slots == 16
    assert note is not None and "gpu_slots=10000" in note and "16 slots a layer" in note
    options, note = _for_model(QWEN, -1, gpu_slots=16, gpu_zero_copy=True)
    assert options.gpu_slots == 16 and note is None
    assert _for_model(QWEN, -1, gpu_slots=4) == (EngineOptions(n_gpu_layers=-1, gpu_slots=4), None)
    assert _for_model(QWEN, 0) == (EngineOptions(), None), "no slots: nothing to check against the file"


@pytest.mark.parametrize(
    ("model", "n_gpu_layers", "slots", "words"),
    [
        (QWEN, 0, 8, "0 unless n_gpu_layers is set"),
        (QWEN, -1, 2, "at least 4: one token routes to 4 experts"),
        (QWEN, -1, 3, "at least 4"),
        (
            QWEN,
            1,
            16,
            "n_gpu_layers=1: N puts the output layer and the last N-1 blocks on the device, here the "
            "output layer only, and no routed-expert (MoE) layer among them",
        ),
        (DEEPSEEK, 1, 16, "the output layer only"),
    ],
)
def test_device_slots_that_cannot_run_are_refused_naming_both_options(model, n_gpu_layers, slots, words):
    from moed.engines.options import OptionError

    with pytest.raises(OptionError) as info:
        _for_model(model, n_gpu_layers, gpu_slots=slots)
    assert info.value.option == "gpu_slots" and words in str(info.value), str(info.value)
    if "the output layer only" in words:  # no MoE layer offloaded: both options named, and what N puts there
        assert f"n_gpu_layers={n_gpu_layers}" in str(info.value) and "gpu_slots=16" in str(info.value)


def test_device_slots_need_one_offloaded_moe_layer():
    assert _for_model(QWEN, 2, gpu_slots=8)[0].gpu_slots == 8  # the output and block 3
    assert _for_model(DEEPSEEK, 2, gpu_slots=8)[0].gpu_slots == 8
    assert _for_model(DEEPSEEK, 99, gpu_slots=8)[0].gpu_slots == 8  # more than the model: every layer
    from moed.engines.options import OptionError

    first_only = dict(n_layers=4, moe_layers=(0,), n_experts=16, n_expert_used=4)  # MoE in block 0 alone
    with pytest.raises(OptionError, match=r"here blocks 1-3, and no routed-expert .*MoE layers: 0;"):
        _for_model(first_only, 4, gpu_slots=8)


@pytest.mark.parametrize("verb", ["generate", "chat", "trace", "kl", "serve"])
def test_n_gpu_layers_help_says_what_n_means(verb, capsys):
    """N is the output layer plus N-1 blocks, as llama.cpp counts (N=1: the output layer alone)."""
    pytest.importorskip("llama_cpp")
    from moed.ctl import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args([verb, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "N is the output layer and the last N-1 blocks (1: the output layer only; -1: every layer)" in out
    assert "the last N blocks and the output" not in out


@pytest.mark.parametrize(
    ("given", "words"),
    [
        ({"n_gpu_layers": 1, "gpu_slots": 8}, "n_gpu_layers=1: N puts the output layer and the last N-1 blocks"),
        ({"n_gpu_layers": -1, "gpu_slots": 1}, "0 or at least 2: one token routes to 2 experts"),
        ({"gpu_slots": 4}, "0 unless n_gpu_layers is set"),
    ],
)
def test_streamed_llama_checks_the_slots_against_the_file_before_it_connects(tiny_model, tmp_path, given, words):
    """From the file's header (tiny_model: 4 MoE blocks, 8 experts, top-2), before any daemon or
    load: the socket named here does not exist, and the error is the option's, not a connection's."""
    pytest.importorskip("llama_cpp")
    from moed.engines.llama_cpp import StreamedLlama
    from moed.engines.options import OptionError

    with pytest.raises(OptionError, match=words):
        StreamedLlama(str(tiny_model), socket_path=str(tmp_path / "none.sock"), **given)
