"""BadInput: what a tool was given is invalid. Never on the wire.

The lab (trace analysis, sizing, replays, the drive bench), the trace format
(`moed.traces.BadTrace`) and budget specs (`moed.gguf.budget`) check what a user
gave them (an argument, a file, a spec) and raise this; the wire's errors
(`moed.protocol.errors`, codes and all) stay for what a daemon answers. moectl
prints either as one line, `moectl: <type>: <message>`, and exits 2.

It is a plain Exception, not a ValueError: a command's `except ValueError` around
a library call (llama.cpp refusing a file, a size that does not parse) must not
swallow it.
"""

from __future__ import annotations


class BadInput(Exception):
    """Input a tool was given is invalid; the message names it and says why."""
