"""Fixtures that start the real daemon (see tests/support.py)."""

from __future__ import annotations

import pytest

from tests.support import DaemonProcess


@pytest.fixture
def start_daemon():
    """`start_daemon(budget="64MiB", *extra_args)` -> DaemonProcess, stopped after the test."""
    started: list[DaemonProcess] = []

    def start(budget: str = "64MiB", *args: str, **kw) -> DaemonProcess:
        d = DaemonProcess(budget, *args, **kw)
        started.append(d)
        return d

    yield start
    for d in started:
        d.kill()


@pytest.fixture
def daemon(start_daemon) -> DaemonProcess:
    return start_daemon()
