"""Where the daemon listens by default: one definition for moed, moectl and the client."""

from __future__ import annotations

import os

DEFAULT_SOCKET = "/run/moed/moed.sock"


def default_socket_path() -> str:
    """$MOED_SOCKET, else /run/moed/moed.sock."""
    return os.environ.get("MOED_SOCKET", DEFAULT_SOCKET)
