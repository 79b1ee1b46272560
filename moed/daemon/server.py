"""Sessions: one per client connection, speaking the protocol over a Unix socket.

A session owns what its connection holds: its leases are released when the
connection closes, however it closes (clean close, crash, kill -9 of the peer).
Requests on one connection are answered in order: while an acquire waits for
reads or room, later frames queue behind it. Fire-and-forget requests
(`ack=False`) are never answered, not even with an error.

Bad input never reaches the daemon's state: frames are decoded with types at
the edge, a decoding failure is answered with `Error(BAD_FRAME)`, and an
oversize length prefix closes the connection (the stream cannot be
resynchronised). The first request must be Hello.
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import socket
import struct
from collections import deque

from moed.protocol import errors
from moed.protocol import messages as m
from moed.protocol.framing import FrameReader, encode
from moed.protocol.messages import PROTOCOL_VERSION

from . import control
from .access import peer_identity
from .core import Daemon, Lease

log = logging.getLogger("moed.server")

_PEERCRED = struct.Struct("3i")
MAX_QUEUED_FRAMES = 256      # decoded requests waiting on one connection before it is paused
MAX_NAMES_PER_TENANT = 32


def peer_credentials(sock) -> tuple[int, int, int]:
    """(pid, uid, gid) of the peer, from SO_PEERCRED."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    return _PEERCRED.unpack(raw)


class Session(asyncio.Protocol):
    def __init__(self, daemon: Daemon):
        self.daemon = daemon
        self.transport: asyncio.Transport | None = None
        self.frames = FrameReader()
        self.queue: deque = deque()
        self.busy = False
        self.closed = False
        self.hello = False
        self.leases: dict[int, Lease] = {}
        self.models: set[int] = set()
        self.pid = self.uid = self.gid = -1
        self.tenant = None
        self.task: asyncio.Future | None = None
        self.pending_plan = None    # references taken by an acquire whose task has not started yet
        self.pending_coro = None    # the handler coroutine of that task, until it starts
        self.reading = True
        self.write_paused = False
        self._handlers = {
            m.Hello: self.on_hello, m.Ping: self.on_ping, m.OpenModel: self.on_open_model,
            m.Acquire: self.on_acquire, m.Release: self.on_release, m.Prefetch: self.on_prefetch,
            m.GetStats: self.on_stats, m.ListModels: self.on_models,
            **control.handlers(self),
        }

    # ---- connection ----------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        self.pid, self.uid, self.gid = peer_credentials(sock)
        self.tenant = self.daemon.tenant(self.uid)
        self.tenant.pids.add(self.pid)
        self.daemon.sessions.add(self)
        self.daemon.counters.connections += 1
        if len(self.daemon.sessions) > self.daemon.config.max_clients:
            log.warning("refusing pid %d (uid %d): %d clients connected, max_clients is %d", self.pid,
                        self.uid, len(self.daemon.sessions) - 1, self.daemon.config.max_clients)
            self._send(m.Error(int(errors.ErrorCode.TOO_MANY_CLIENTS),
                               f"moed serves at most {self.daemon.config.max_clients} clients"))
            self.closed = True
            transport.close()

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.task is not None and not self.task.done():
            self.task.cancel()
        plan, self.pending_plan = self.pending_plan, None
        if plan is not None:
            self.daemon._unref(plan.slots, plan.generations)
        if self.pending_coro is not None:   # its task was cancelled before it ran
            self.pending_coro.close()
            self.pending_coro = None
        self.daemon.sessions.discard(self)
        leases, self.leases = list(self.leases.values()), {}
        for lease in leases:
            self.daemon.release(lease)
        self.daemon.forget_prefetches(self)       # its queued read-ahead is no longer wanted
        self.tenant.pids.discard(self.pid)
        if leases:
            log.info("connection of pid %d closed holding %d leases; released them", self.pid, len(leases))

    def data_received(self, data: bytes) -> None:
        self.queue.extend(self.frames.feed(data))
        if not self.busy:
            self._pump()
        self._flow()

    # Flow control: a peer that sends faster than it reads (or piles requests
    # behind a waiting acquire) is stopped being read, so neither its reply
    # buffer nor its request queue can grow without bound in the daemon.

    def pause_writing(self) -> None:
        self.write_paused = True
        self._flow()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._flow()

    def _flow(self) -> None:
        want = not self.write_paused and len(self.queue) <= MAX_QUEUED_FRAMES
        if want != self.reading and not self.closed and not self.transport.is_closing():
            self.reading = want
            (self.transport.resume_reading if want else self.transport.pause_reading)()

    # ---- dispatch ------------------------------------------------------------

    def _pump(self) -> None:
        while self.queue and not self.busy and not self.closed:
            msg = self.queue.popleft()
            if isinstance(msg, errors.MoedError):
                self._bad_frame(msg)
                continue
            try:
                result = self._dispatch(msg)
            except Exception as exc:  # noqa: BLE001 - a bug answers this request, the daemon lives
                self._handler_failed(msg, exc)
                continue
            if asyncio.iscoroutine(result):
                self.busy = True
                self.pending_coro = result
                self.task = asyncio.ensure_future(self._finish(msg, result))
            elif result is not None and m.wants_reply(msg):
                self._send(result)
        self._flow()

    async def _finish(self, msg, coro) -> None:
        self.pending_coro = None
        try:
            reply = await coro
            if reply is not None and m.wants_reply(msg):
                self._send(reply)
        except Exception as exc:  # noqa: BLE001
            self._handler_failed(msg, exc)
        finally:
            self.busy = False
            self.task = None
        self._pump()

    def _dispatch(self, msg):
        if not self.hello and not isinstance(msg, m.Hello):
            raise errors.NotHello(f"first request must be hello, got {type(msg).__name__}")
        return self._handlers[type(msg)](msg)

    def _handler_failed(self, msg, exc: Exception) -> None:
        """A handler raised: a MoedError is the answer; anything else is a bug, logged and answered."""
        if not isinstance(exc, errors.MoedError):
            log.exception("handler for %s failed", type(msg).__name__)
            exc = errors.InternalError(f"{type(exc).__name__}: {exc}")
        self._reply_error(msg, exc)

    def _bad_frame(self, exc: errors.MoedError) -> None:
        self.daemon.counters.bad_frames += 1
        self._send(m.Error(int(exc.code), str(exc)))
        if self.frames.broken:
            self.transport.close()

    def _reply_error(self, msg, exc: errors.MoedError) -> None:
        self.daemon.counters.errors_sent += 1
        if m.wants_reply(msg):
            self._send(m.Error(int(exc.code), exc.message or str(exc)))
        else:
            log.info("%s from pid %d failed (no reply wanted): %s", type(msg).__name__, self.pid, exc)
        if isinstance(exc, (errors.NotHello, errors.VersionMismatch)):
            self.transport.close()

    def _send(self, reply) -> None:
        if not self.closed:
            self.transport.write(encode(reply))

    # ---- handlers ------------------------------------------------------------

    def on_hello(self, msg: m.Hello):
        if msg.version != PROTOCOL_VERSION:
            raise errors.VersionMismatch(f"client speaks protocol {msg.version}, daemon {PROTOCOL_VERSION}")
        self.hello = True
        if msg.client_name:
            if len(self.tenant.names) < MAX_NAMES_PER_TENANT:   # names are for display; never unbounded
                self.tenant.names.add(msg.client_name[:64])
        d = self.daemon
        return m.HelloReply(PROTOCOL_VERSION, d.version, d.pid, self.uid, self.pid)

    def on_ping(self, msg: m.Ping):
        return m.Pong(int(self.daemon.loop.time() * 1e9))

    async def on_open_model(self, msg: m.OpenModel):
        model = await self.daemon.open_model(msg.path, peer_identity(self.pid, self.uid, self.gid))
        self.models.add(model.model_id)
        fds = [self.daemon.ramtier.segments[s.class_id].readonly_fd() for s in model.info.segments]
        try:
            self._send_with_fds(encode(model.info), fds)
        finally:
            for fd in fds:
                os.close(fd)
        return None

    def _send_with_fds(self, frame: bytes, fds: list[int]) -> None:
        """Write a frame with descriptors attached (the transport cannot carry them).

        The client is blocked waiting for this reply, so nothing is queued in
        the transport ahead of it and writing to the socket directly keeps order.
        """
        if self.transport.get_write_buffer_size():
            raise errors.InternalError("cannot pass descriptors behind queued output")
        raw = self.transport.get_extra_info("socket")
        with socket.socket(fileno=os.dup(raw.fileno())) as sock:
            sock.setblocking(True)
            sent = sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            if sent < len(frame):
                sock.sendall(frame[sent:])

    def _model(self, model_id: int):
        if model_id not in self.models:
            raise errors.UnknownModel(f"this connection has not opened model {model_id}")
        return self.daemon.model_for(model_id)

    def on_acquire(self, msg: m.Acquire):
        if msg.release:
            self._release_ids(msg.release, strict=False)
        model = self._model(msg.model_id)
        if msg.timeout_s is not None and not msg.timeout_s >= 0:
            raise errors.BadRequest(f"timeout_s must be >= 0, got {msg.timeout_s}")
        lease, pending = self.daemon.try_acquire(model, msg.layer, msg.experts, self.tenant)
        if lease is not None:
            return self._granted(lease)
        wants, self.pending_plan = pending
        return self._acquire_slow(model, msg, wants)

    async def _acquire_slow(self, model, msg: m.Acquire, wants):
        # The plan's references pass to acquire_slow here; a task cancelled before
        # it ever ran leaves them in pending_plan for connection_lost to give back.
        plan, self.pending_plan = self.pending_plan, None
        lease = await self.daemon.acquire_slow(model, msg.layer, wants, plan, self.tenant, msg.timeout_s)
        if self.closed:    # the peer went away while we read: nobody holds this lease
            self.daemon.release(lease)
            return None
        return self._granted(lease)

    def _granted(self, lease: Lease) -> m.Granted:
        self.leases[lease.lease_id] = lease
        return m.Granted(lease.lease_id, lease.slots[0].class_id, [s.index for s in lease.slots])

    def on_release(self, msg: m.Release):
        return m.Released(self._release_ids(msg.lease_ids, strict=True))

    def _release_ids(self, lease_ids: list[int], strict: bool) -> int:
        done = 0
        unknown = []
        for lease_id in lease_ids:
            lease = self.leases.pop(lease_id, None)
            if lease is None:
                unknown.append(lease_id)
                continue
            self.daemon.release(lease)
            done += 1
        if unknown and strict:
            raise errors.UnknownLease(f"this connection holds no lease {unknown[0]}"
                                      + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
        return done

    def on_prefetch(self, msg: m.Prefetch):
        model = self._model(msg.model_id)
        return m.Prefetched(self.daemon.prefetch(model, msg.layer, msg.experts, self.tenant, source=self))

    def on_stats(self, msg: m.GetStats):
        return m.StatsReply(control.visible_stats(self, self.daemon.stats()))

    def on_models(self, msg: m.ListModels):
        return m.ModelsReply(control.visible_stats(self, self.daemon.stats())["models"])


HANDLED_REQUESTS = (m.Hello, m.Ping, m.OpenModel, m.Acquire, m.Release, m.Prefetch, m.GetStats, m.ListModels,
                    *control.HANDLED)
