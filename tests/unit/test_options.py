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
