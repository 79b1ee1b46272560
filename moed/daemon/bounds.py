"""The fixed bounds on what one connection can make the daemon hold.

Configurable bounds (clients, per-tenant connections and opens, deadlines) live
in `Config`; these are the per-connection buffer sizes, kept in one place so the
server enforces and the stats report the same numbers.
"""

from __future__ import annotations

from moed.protocol.framing import MAX_REQUEST_FRAME_BYTES
from moed.protocol.residency_words import HOLD_WORDS

MAX_QUEUED_FRAMES = 64  # whole requests waiting on one connection before it is no longer read
MAX_QUEUED_BYTES = 256 << 10  # ... or their encoded bytes
WRITE_HIGH_BYTES = 64 << 10  # replies buffered for a peer before the session stops answering it
WRITE_LOW_BYTES = 16 << 10  # ... and resumes once the peer has read them down to this
SEND_STALL_S = 30.0  # a peer that takes none of its open_model reply for this long is dropped
LOCAL_HOLD_SHARE = 0.5  # of the budget one tenant may keep from eviction by local holds
REVOKE_GRACE_S = 30.0  # holds of a connection the daemon closed keep counting this long at most
OPERATOR_RESERVE = 8  # connections beyond max_clients kept for operators (moectl on a full daemon)


def limits(config) -> dict:
    """Every bound, fixed and configured, as `moectl stats --json` shows it under `limits`."""
    return {
        "max_clients": config.max_clients,
        "max_clients_per_tenant": config.max_clients_per_tenant,
        "operator_reserve": OPERATOR_RESERVE,
        "local_hold_share": LOCAL_HOLD_SHARE,
        "local_holds_per_connection": HOLD_WORDS,
        "revoke_grace_s": REVOKE_GRACE_S,
        "max_request_frame_bytes": MAX_REQUEST_FRAME_BYTES,
        "max_queued_requests": MAX_QUEUED_FRAMES,
        "max_queued_bytes": MAX_QUEUED_BYTES,
        "write_high_bytes": WRITE_HIGH_BYTES,
        "hello_timeout_s": config.hello_timeout_s,
        "idle_timeout_s": config.idle_timeout_s,
        "max_opens_per_tenant": config.max_opens_per_tenant,
        "open_timeout_s": config.open_timeout_s,
        "turn_max_s": config.turn_max_s,
    }
