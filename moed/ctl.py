"""moectl: the operator's command line.

Each module in `moed.cli` owns a group of verbs and exposes
`register(subparsers)`, which adds its parsers and sets `func(args) -> int` on
each. Modules are discovered, so adding a verb never edits this file. A verb's
errors are raised, and reported here through moectl's one error path
(`moed.cli.exit_status`: one line, `moectl: <type>: <message>`, exit 2).
"""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except moed.cli.HANDLED as exc:  # the one error path: one line, one format (moed.cli)
        return moed.cli.exit_status(exc)


if __name__ == "__main__":
    sys.exit(main())
