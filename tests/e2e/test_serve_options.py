"""`moectl serve` checks the engine options before it starts any worker (issue 47).

A bad `--gpu-slots` or `--gpu-zero-copy` (alone, below the model's top-k, negative, or with
no `--n-gpu-layers`), or a bad engine option a model of `--config` sets for itself
(`"n_gpu_layers": "-1"`, ...), ends the command at once with one line naming the option:
no traceback, no worker started, no restart loop. The check is EngineOptions' own
(moed.engines.options: `check` and `for_model`, from the file's header), so it needs no
daemon and no device: the socket named here does not exist. Each model's options (the
flags', its own on top) are what its workers' spec carries, and the server seam hands
llama.cpp each of its settings among them once.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")
pytest.importorskip("llama_cpp.server.app")  # the [server] extra


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--gpu-slots", "1", "--n-gpu-layers", "-1"], "gpu_slots=1 is not accepted: gpu_slots takes 0 or at least 2"),
        (["--gpu-slots", "-1", "--n-gpu-layers", "-1"], "gpu_slots=-1 is not accepted: gpu_slots takes an int >= 0"),
        (["--gpu-slots", "4"], "gpu_slots=4 is not accepted: gpu_slots takes 0 unless n_gpu_layers is set"),
        (["--gpu-zero-copy"], "gpu_zero_copy=True is not accepted"),
        (["--gpu-slots", "4", "--n-gpu-layers", "1"], "N puts the output layer and the last N-1 blocks on the device"),
    ],
)
def test_a_bad_slot_value_ends_serve_with_one_line_before_any_worker(tiny_model, tmp_path, flags, words):
    """tiny_model routes to 2 of 8 experts a layer: S=1 cannot hold one token's."""
    cmd = [sys.executable, "-m", "moed.ctl", "--socket", str(tmp_path / "none.sock"), "serve", str(tiny_model)]
    t0 = time.monotonic()
    proc = subprocess.run([*cmd, "--port", "1", *flags], capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("moectl: BadInput: bad server settings: "), proc.stderr
    assert words in lines[0], lines[0]
    assert "Traceback" not in proc.stderr and "restart" not in proc.stderr and not proc.stdout.strip()
    assert time.monotonic() - t0 < 60, "refused at once, not after a worker's start"


def _serve(tmp_path, *what: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "moed.ctl", "--socket", str(tmp_path / "none.sock"), "serve", *what, "--port", "1"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _config(tmp_path, *models: dict) -> str:
    import json

    path = tmp_path / "serve.json"
    path.write_text(json.dumps({"models": list(models)}))
    return str(path)


@pytest.mark.parametrize(
    ("own", "words"),
    [
        ({"n_gpu_layers": "-1"}, "model b: n_gpu_layers='-1' is not accepted: n_gpu_layers takes a whole number"),
        ({"n_gpu_layers": True}, "model b: n_gpu_layers=True is not accepted"),  # the server's settings read 1
        ({"n_gpu_layers": 1.5}, "model b: n_gpu_layers=1.5 is not accepted"),
        ({"n_threads": "2"}, "model b: n_threads='2' is not accepted"),
        ({"n_threads_batch": 2.5}, "model b: n_threads_batch=2.5 is not accepted"),
        ({"gpu_slots": 4}, "model b: gpu_slots=4 is not accepted: gpu_slots takes 0 unless n_gpu_layers is set"),
        (
            {"gpu_slots": 8, "n_gpu_layers": 1},
            "model b: gpu_slots=8 is not accepted: gpu_slots takes 0 with n_gpu_layers=1",
        ),
        ({"gpu_zero_copy": "no", "gpu_slots": 8}, "model b: gpu_zero_copy='no' is not accepted"),
        ({"prefetch": "on"}, "model b: prefetch='on' is not accepted"),
    ],
)
def test_a_models_own_bad_value_in_the_config_ends_serve_with_one_line_naming_it(tiny_model, tmp_path, own, words):
    """A model entry may set engine options for itself; each is checked as the flags are, before
    any worker, and the line names the option, its value and the model (the first model is fine)."""
    config = _config(
        tmp_path,
        {"model": str(tiny_model), "model_alias": "a"},
        {"model": str(tiny_model), "model_alias": "b", **own},
    )
    proc = _serve(tmp_path, "--config", config)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("moectl: BadInput: bad server settings: "), proc.stderr
    assert words in lines[0], lines[0]
    assert "Traceback" not in proc.stderr and "restart" not in proc.stderr and not proc.stdout.strip()


def test_serve_n_gpu_layers_not_a_number_is_argparses_error(tmp_path):
    proc = _serve(tmp_path, "m.gguf", "--n-gpu-layers", "x")
    assert proc.returncode == 2
    assert "argument --n-gpu-layers: invalid int value: 'x'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_each_model_gets_the_flags_options_with_its_own_on_top(tiny_model, tmp_path):
    """The plan (what the workers' specs carry): every model the flags' options, a model's own
    entries over them, checked against its file; its server settings keep no engine option."""
    from moed.cli.serve import _plan
    from moed.ctl import build_parser
    from moed.engines.options import EngineOptions

    config = _config(
        tmp_path,
        {"model": str(tiny_model), "model_alias": "a", "workers": 2},
        {"model": str(tiny_model), "model_alias": "b", "n_gpu_layers": 2, "n_threads": 3, "gpu_slots": 4},
        {"model": str(tiny_model), "model_alias": "c", "n_threads": -1, "prefetch": "gate2"},
    )
    args = build_parser().parse_args(
        ["--socket", "/tmp/s.sock", "serve", "--config", config, "--n-gpu-layers", "-1", "--prefetch", "off"]
    )
    plan = _plan(args)
    options = {m.alias: EngineOptions(**m.engine) for m in plan.models}
    assert plan.socket_path == "/tmp/s.sock" and all(o.socket_path == "/tmp/s.sock" for o in options.values())
    assert options["a"] == EngineOptions(socket_path="/tmp/s.sock", n_gpu_layers=-1, prefetch="off")
    assert (options["b"].n_gpu_layers, options["b"].n_threads, options["b"].gpu_slots) == (2, 3, 4)
    assert options["b"].prefetch == "off"
    assert (options["c"].n_gpu_layers, options["c"].n_threads, options["c"].prefetch) == (-1, -1, "gate2")
    assert [m.workers for m in plan.models] == [2, 1, 1]
    for m in plan.models:
        assert not set(m.settings) & set(EngineOptions.per_model()), m.settings


def test_the_server_seam_passes_each_llama_setting_once(monkeypatch):
    """llama_cpp.server passes every ModelSettings value, defaults included: those that are engine
    options come from the options (a value set on the model's settings wins), never twice."""
    from moed.engines.options import EngineOptions
    from moed.serve import app

    made = {}

    class Engine:
        def __init__(self, **kwargs):
            made.update(kwargs)

        def own_client(self, client):
            pass

    class NoClient:
        def __init__(self, *args, **kwargs):
            pass

    monkeypatch.setattr(app, "ServedLlama", Engine)
    monkeypatch.setattr("moed.client.Client", NoClient)
    server_passes = dict(n_gpu_layers=0, n_threads=8, n_threads_batch=16, use_mlock=True, n_ctx=64)
    app._served_llama(EngineOptions(n_gpu_layers=-1, n_threads=2), None, {"n_threads_batch"}, **server_passes)
    assert (made["n_gpu_layers"], made["n_threads"], made["n_threads_batch"]) == (-1, 2, 16)
    assert made["n_ctx"] == 64 and "use_mlock" not in made


def test_llama_cpps_settings_among_the_options_are_llama_cpp_keywords():
    """The options marked as llama.cpp's settings are handed to `llama_cpp.Llama` by name: each
    must be one of its keywords (llama.cpp ignores a name it does not know)."""
    import inspect

    llama_cpp = pytest.importorskip("llama_cpp")
    from moed.engines.options import EngineOptions

    llama = inspect.signature(llama_cpp.Llama.__init__).parameters
    missing = [name for name in EngineOptions().llama_settings() if name not in llama]
    assert EngineOptions().llama_settings() and missing == [], missing
