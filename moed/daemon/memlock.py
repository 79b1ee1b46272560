"""Can this process lock `n` bytes? CAP_IPC_LOCK or a high enough RLIMIT_MEMLOCK."""

from __future__ import annotations

import resource

from moed.protocol.sizes import format_size

from .ramtier import MlockUnavailable, probe_mlock

CAP_IPC_LOCK = 14


def has_cap_ipc_lock() -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    except OSError:
        pass
    return False


def mlock_status(need_bytes: int, required: bool) -> tuple[bool, str]:
    """(True, "") when `need_bytes` can be locked; else (False, why) or raise if required."""
    ok, why = probe_mlock(required)
    if ok and not has_cap_ipc_lock():
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        if soft != resource.RLIM_INFINITY and soft < need_bytes:
            ok, why = (
                False,
                (
                    f"RLIMIT_MEMLOCK is {format_size(soft)} but the budget needs "
                    f"{format_size(need_bytes)} (no CAP_IPC_LOCK)"
                ),
            )
            if required:
                raise MlockUnavailable(why)
    return ok, why
