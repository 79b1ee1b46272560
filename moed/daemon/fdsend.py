"""Frames with descriptors attached, on a connection whose transport cannot carry them.

One `FdSender` per connection (a `Session` owns it). Order: everything the
transport holds goes out first (its output drained), then a non-blocking
sendmsg carries the descriptors with the frame's first bytes, and the
transport writes whatever the kernel did not take. The socket is never put in
blocking mode: a peer that reads nothing for SEND_STALL_S is disconnected
(`TimedOut`), so no peer can stall the loop. The descriptors made for a frame
are closed here, sent or not.
"""

from __future__ import annotations

import array
import asyncio
import os
import socket
from collections.abc import Callable

from moed.protocol import errors

from .bounds import SEND_STALL_S, WRITE_HIGH_BYTES, WRITE_LOW_BYTES


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class FdSender:
    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self.transport, self.loop = transport, loop
        self.closed = False
        self._drained: asyncio.Future | None = None  # set when the transport's output is empty

    def output_drained(self) -> None:
        """The transport's output went below its low mark (resume_writing)."""
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def close(self) -> None:
        """The connection is gone: a send waiting for the output to drain ends."""
        self.closed = True
        if self._drained is not None and not self._drained.done():
            self._drained.cancel()

    async def send(self, frame: bytes | bytearray, make_fds: Callable[[], list[int]]) -> None:
        """Write `frame` with the descriptors `make_fds()` returns (made once the output drained)."""
        deadline = self.loop.time() + SEND_STALL_S
        await self._drain(deadline)
        raw = self.transport.get_extra_info("socket")
        fds = make_fds()
        # A dup shares the socket's file status: it stays non-blocking, as the loop needs.
        sock = socket.socket(fileno=os.dup(raw.fileno()))
        try:
            sock.setblocking(False)
            sent = await self._sendmsg(sock, frame, fds, deadline)
        finally:
            sock.close()
            for fd in fds:
                os.close(fd)
        if sent < len(frame):
            self.transport.write(frame[sent:])

    async def _drain(self, deadline: float) -> None:
        """Wait until the transport holds no output (resume_writing fires at an empty buffer)."""
        if not self.transport.get_write_buffer_size():
            return
        self._drained = self.loop.create_future()
        self.transport.set_write_buffer_limits(high=1, low=0)
        try:
            await asyncio.wait_for(self._drained, max(0.0, deadline - self.loop.time()))
        except TimeoutError:
            self.transport.abort()
            raise errors.TimedOut(f"the peer read none of its replies for {SEND_STALL_S}s") from None
        finally:
            self._drained = None
            if not self.closed:
                self.transport.set_write_buffer_limits(high=WRITE_HIGH_BYTES, low=WRITE_LOW_BYTES)

    async def _sendmsg(self, sock: socket.socket, frame: bytes | bytearray, fds: list[int], deadline: float) -> int:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        loop = self.loop
        while True:
            try:
                return sock.sendmsg([frame], ancillary)
            except BlockingIOError:
                pass
            # The kernel's buffer is full: wait for room on our own descriptor
            # (the transport's is registered with the loop already).
            ready = loop.create_future()
            loop.add_writer(sock.fileno(), _resolve, ready)
            try:
                await asyncio.wait_for(ready, max(0.0, deadline - loop.time()))
            except TimeoutError:
                self.transport.abort()
                raise errors.TimedOut(f"the peer took no bytes for {SEND_STALL_S}s") from None
            finally:
                loop.remove_writer(sock.fileno())


__all__ = ["FdSender"]
