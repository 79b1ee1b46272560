"""moectl verbs, one module per group; each exposes `register(subparsers)`."""

import sys


def fail(message: str) -> int:
    """Print moectl's one-line error and give the exit status for bad input (2)."""
    print(f"moectl: {message}", file=sys.stderr)
    return 2
