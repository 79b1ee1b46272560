"""Small helpers for the daemon's background asyncio tasks."""

from __future__ import annotations

import asyncio
import contextlib


async def stop_task(task: asyncio.Task | None) -> None:
    """Cancel a background task and wait until it has ended (None: nothing to stop)."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
