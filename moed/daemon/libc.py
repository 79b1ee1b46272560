"""moed.libc under its old name, for the one import not yet moved (reader.py's).

The wrapper itself is `moed/libc.py`; import it from there. This module goes
once reader.py imports `moed.libc` directly.
"""

from moed.libc import buffer_at

__all__ = ["buffer_at"]
