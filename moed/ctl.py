"""moectl: the operator's command line.

Each module in `moed.cli` owns a group of verbs and exposes
`register(subparsers)`, which adds its parsers and sets `func(args) -> int` on
each. Modules are discovered, so adding a verb never edits this file. A verb's
errors are raised, and reported here through moectl's one error path
(`moed.cli.exit_status`: one line, `moectl: <type>: <message>`, exit 2).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import pkgutil
import sys

import moed.cli
from moed.protocol.paths import default_socket_path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moectl", description="Operate and study moed.")
    parser.add_argument(
        "--socket", default=default_socket_path(), help="daemon socket (default: $MOED_SOCKET or %(default)s)"
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    for info in sorted(pkgutil.iter_modules(moed.cli.__path__), key=lambda i: i.name):
        module = importlib.import_module(f"moed.cli.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`parser.parse_args`, but an unknown flag's error names the verb's nearest flag."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        verb = verbs.choices[args.verb]
        flags = [s for a in verb._actions for s in a.option_strings] + [
            s for a in parser._actions for s in a.option_strings
        ]
        hints = []
        for arg in extra:
            near = (
                difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1, cutoff=0.6) if arg.startswith("-") else []
            )
            hints.append(f"{arg} (did you mean {near[0]}?)" if near else arg)
        verb.error(f"unrecognized arguments: {' '.join(hints)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(build_parser(), argv)
    try:
        return int(args.func(args) or 0)
    except moed.cli.HANDLED as exc:  # the one error path: one line, one format (moed.cli)
        return moed.cli.exit_status(exc)


if __name__ == "__main__":
    sys.exit(main())
