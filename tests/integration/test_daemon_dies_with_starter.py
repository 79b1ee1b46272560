"""A private daemon (moed.spawn.DaemonProcess) dies with the process that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from moed.testing import wait_for

STARTER = """
import sys
from moed.spawn import DaemonProcess
d = DaemonProcess("8MiB")
print(d.proc.pid, flush=True)
sys.stdin.read()  # until killed
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_a_killed_starter_takes_its_daemon_with_it():
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert starter.stdout is not None
        daemon_pid = int(starter.stdout.readline())
        assert _alive(daemon_pid)
        os.kill(starter.pid, signal.SIGKILL)  # no cleanup runs in the starter
        starter.wait(10)
        wait_for(lambda: not _alive(daemon_pid), timeout_s=10, what="the daemon to die with its starter")
    finally:
        if starter.poll() is None:
            starter.kill()
