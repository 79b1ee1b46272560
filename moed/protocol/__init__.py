"""The wire: messages, error codes, framing and slot layout.

Imports only the standard library and msgspec, so the client stays light.
"""

from .errors import *  # noqa: F401,F403
from .messages import *  # noqa: F401,F403
