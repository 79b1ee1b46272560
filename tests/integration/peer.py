"""Run a function as another uid in a forked child, for tests about tenants and permissions.

`as_peer(uid, gid, fn, *args)` forks, drops to (uid, gid) with no supplementary
groups (plus `groups`), runs `fn(*args)` and returns `Outcome(result, error,
signal)`: what it returned, the `TypeName: message` of what it raised, or the
signal that killed it. No exec: the venv's interpreter lives under /root,
which another uid cannot execute, so the child keeps this process's imports.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import time
from typing import NamedTuple

import pytest

NOBODY = 65534


class Outcome(NamedTuple):
    result: object = None
    error: str = ""
    signal: int = 0


def as_peer(uid: int, gid: int, fn, *args, groups: tuple = (), timeout_s: float = 30.0) -> Outcome:
    if os.geteuid() != 0:
        pytest.skip("running as another uid needs root")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns
        os.close(r)
        try:
            os.setgroups(list(groups))
            os.setgid(gid)
            os.setuid(uid)
            out = Outcome(result=fn(*args))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out = Outcome(error=f"{type(exc).__name__}: {exc}")
        try:
            os.write(w, pickle.dumps(out))
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                raise TimeoutError(f"peer child {pid} did not finish within {timeout_s}s")
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(r)
        _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return Outcome(signal=os.WTERMSIG(status))
    return pickle.loads(data) if data else Outcome(error="child exited without a result")
