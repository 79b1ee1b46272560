"""moectl verbs, one module per group; each exposes `register(subparsers)`. And moectl's
one error path.

What this module owns: how an error reaches the operator. A verb that cannot do what
it was asked raises a typed error and returns nothing special; it never prints an
error or picks an exit status itself. `exit_status(exc)`, called only by
moed.ctl.main around the verb, prints one line on stderr, always in one format,

    moectl: <type>: <message>

and gives the exit status:
- `MoedError` (what a daemon answered, moed.protocol.errors: DaemonUnavailable,
  BadRequest, ...), `BadInput` (what the command was given: an argument, a file, a
  spec; moed.badinput) and `OSError` (a file it names cannot be read or written;
  the message is `<file>: <reason>`) -> 2;
- `BrokenPipeError` (stdout closed early: `moectl stats | head`) -> 0, silently;
- `KeyboardInterrupt` -> 130, silently.
Anything else is a bug and keeps its traceback. argparse's own usage errors (exit 2,
its own format) happen before a verb runs.

Invariant: the line is one line (a multi-line message, such as pydantic's, is joined
with "; "), so scripts can read it and tests can count it.
"""

from __future__ import annotations

import sys

from moed.badinput import BadInput
from moed.protocol.errors import MoedError

EXIT_ERROR = 2  # an error the operator can act on (bad input, the daemon's answer, a file)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it
HANDLED = (MoedError, BadInput, OSError, KeyboardInterrupt)


def error_line(exc: BaseException) -> str:
    """`moectl: <type>: <message>`, on one line."""
    if isinstance(exc, OSError) and exc.strerror:  # errno's words and the file, not "[Errno 2] ..."
        text = f"{exc.filename}: {exc.strerror}" if exc.filename is not None else exc.strerror
    else:
        text = str(exc)
    text = "; ".join(line.strip() for line in text.splitlines() if line.strip())
    return f"moectl: {type(exc).__name__}: {text}"


def exit_status(exc: BaseException) -> int:
    """Report `exc` (one of `HANDLED`) to the operator and give moectl's exit status."""
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(exc, BrokenPipeError):
        return 0
    print(error_line(exc), file=sys.stderr)
    return EXIT_ERROR
