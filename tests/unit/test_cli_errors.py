"""moectl's one error path: every handled error is one line, `moectl: <type>: <message>`."""

from __future__ import annotations

import errno

import pytest

from moed.badinput import BadInput
from moed.cli import EXIT_ERROR, EXIT_INTERRUPTED, error_line, exit_status
from moed.protocol.errors import BadRequest, DaemonUnavailable


@pytest.mark.parametrize(
    ("exc", "line"),
    [
        (BadInput("no such model file: m.gguf"), "moectl: BadInput: no such model file: m.gguf"),
        (DaemonUnavailable("cannot connect"), "moectl: DaemonUnavailable: cannot connect"),
        (BadRequest("not a size\nat all"), "moectl: BadRequest: not a size; at all"),
        (
            FileNotFoundError(errno.ENOENT, "No such file or directory", "p.txt"),
            "moectl: FileNotFoundError: p.txt: No such file or directory",
        ),
        (
            FileExistsError("out.gguf exists (--force replaces it)"),
            "moectl: FileExistsError: out.gguf exists (--force replaces it)",
        ),
    ],
)
def test_one_line_one_format(exc, line, capsys):
    assert error_line(exc) == line
    assert exit_status(exc) == EXIT_ERROR == 2
    assert capsys.readouterr().err == line + "\n"


def test_a_closed_pipe_and_ctrl_c_are_silent(capsys):
    assert exit_status(BrokenPipeError()) == 0
    assert exit_status(KeyboardInterrupt()) == EXIT_INTERRUPTED == 130
    assert capsys.readouterr().err == ""


def test_an_unknown_flag_is_refused_naming_the_nearest_one(capsys):
    from moed.ctl import main

    with pytest.raises(SystemExit) as info:
        main(["generate", "m.gguf", "--prompt", "x", "--prefech", "off", "--n-gpu-layrs=2"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert (
        "unrecognized arguments: --prefech (did you mean --prefetch?) off --n-gpu-layrs=2 (did you mean --n-gpu-layers?)"
        in err
    )
    assert "moectl generate" in err  # the verb's own usage line


def test_an_unknown_flag_with_nothing_near_gets_no_guess(capsys):
    from moed.ctl import main

    with pytest.raises(SystemExit):
        main(["stats", "--zzzz"])
    assert "unrecognized arguments: --zzzz\n" in capsys.readouterr().err


@pytest.mark.parametrize("verb", [["generate", "m.gguf", "--prompt", "x"], ["serve", "m.gguf"]])
@pytest.mark.parametrize(("flag", "value"), [("--n-gpu-layers", "x"), ("--n-gpu-layers", "1.5"), ("--threads", "two")])
def test_an_engine_flag_that_is_not_a_number_is_argparses_error(verb, flag, value, capsys):
    """The flags come from the option table (moed.engines.options), typed there: a value that is
    not an int is refused by argparse before the verb runs, naming the flag."""
    pytest.importorskip("llama_cpp")
    from moed.ctl import main

    with pytest.raises(SystemExit) as info:
        main([*verb, flag, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: invalid int value: '{value}'" in err, err
    assert f"moectl {verb[0]}" in err and "Traceback" not in err
