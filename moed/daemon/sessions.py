"""Sessions: one per client connection, speaking the protocol over a Unix socket.

A session owns what its connection holds: its leases are released when the
connection closes, however it closes (clean close, crash, kill -9 of the peer).
Requests on one connection are answered in order: while an acquire waits for
reads or room, later frames queue behind it. Fire-and-forget requests
(`ack=False`) are never answered, not even with an error.

Bad input never reaches the daemon's state: frames are decoded with types at
the edge, a decoding failure is answered with `Error(BAD_FRAME)`, and an
oversize length prefix closes the connection (the stream cannot be
resynchronised). The first request must be Hello, within `hello_timeout_s`.

What one connection can make the daemon hold is bounded (and shown per
connection in `moectl stats`, key `clients`):
- input: one incomplete frame (at most MAX_REQUEST_FRAME_BYTES) plus queued
  whole frames, kept encoded (decoded one at a time, when dispatched), at most
  MAX_QUEUED_FRAMES or MAX_QUEUED_BYTES: beyond that the connection is no
  longer read;
- output: replies are written without ever blocking; once the transport holds
  more than WRITE_HIGH_BYTES the session stops dispatching (and reading) until
  the peer has read them down to WRITE_LOW_BYTES;
- requests in flight: one handler at a time per connection;
- descriptors passed with `open_model` go out with a non-blocking sendmsg; a
  peer that does not read them within SEND_STALL_S is disconnected
  (moed.daemon.fdsend).
The socket is never switched to blocking mode, so no peer can stall the loop.

Compute turns (moed.daemon.turndesk): a TakeTurn is answered when the turn is granted;
an acquire that waits on reads lets its connection's turn go and takes it back before
its Granted goes out; closing the connection gives its turn to the next engine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from collections import deque
from collections.abc import Coroutine

import msgspec

from moed.protocol import errors
from moed.protocol import messages as m
from moed.protocol.framing import MAX_REQUEST_FRAME_BYTES, FrameReader, decode, encode, request_decoder
from moed.protocol.messages import PROTOCOL_VERSION
from moed.protocol.residency_words import REGION_WORDS
from moed.protocol.stats import ModelRow, Stats

from . import control
from .access import peer_identity
from .bounds import (
    MAX_QUEUED_BYTES,
    MAX_QUEUED_FRAMES,
    OPERATOR_RESERVE,
    WRITE_HIGH_BYTES,
    WRITE_LOW_BYTES,
)
from .core import Daemon, LeaseRecord, PendingAcquire
from .counters import Tenant
from .fdsend import FdSender
from .turns import TurnAsk

log = logging.getLogger("moed.sessions")

_PEERCRED = struct.Struct("3i")
MAX_NAMES_PER_TENANT = 32


def peer_credentials(sock) -> tuple[int, int, int]:
    """(pid, uid, gid) of the peer, from SO_PEERCRED."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    return _PEERCRED.unpack(raw)


class Session(asyncio.Protocol):
    # Set by connection_made, before any other callback can run.
    transport: asyncio.Transport
    fds: FdSender  # frames with descriptors attached (open_model, map_holds)
    tenant: Tenant
    loop: asyncio.AbstractEventLoop

    def __init__(self, daemon: Daemon):
        self.daemon = daemon
        self.frames = FrameReader(decoder=None, max_frame_bytes=MAX_REQUEST_FRAME_BYTES)
        self.queue: deque = deque()  # encoded payloads (bytes) or BadFrame errors, in order
        self.queued_bytes = 0
        self.busy = False
        self.closed = False
        self.peer_closed = False  # the peer ended the connection (EOF, reset, broken protocol), not the daemon
        self.hello = False
        self.leases: dict[int, LeaseRecord] = {}
        self.models: set[int] = set()
        self.name = ""  # the client's name (Hello), for stats
        self.compute: dict[int, str] = {}  # model id -> what its engine computes where (OpenModel.compute)
        self.devices: dict[int, dict] = {}  # model id -> its engine's last DeviceReport (a DeviceRow)
        self.pid = self.uid = self.gid = -1
        self.task: asyncio.Future | None = None
        self.pending: PendingAcquire | None = None  # the acquire waiting for room or reads
        self.pending_coro: Coroutine | None = None  # the handler coroutine of the running task, until it starts
        self.reading = True
        self.write_paused = False
        self._deadline: asyncio.TimerHandle | None = None
        self.last_request_at = 0.0
        self._handlers = {
            m.Hello: self.on_hello,
            m.Ping: self.on_ping,
            m.OpenModel: self.on_open_model,
            m.Acquire: self.on_acquire,
            m.Release: self.on_release,
            m.Prefetch: self.on_prefetch,
            m.GetStats: self.on_stats,
            m.ListModels: self.on_models,
            m.MapHolds: self.on_map_holds,
            m.DeviceReport: self.on_device_report,
            m.TakeTurn: self.on_take_turn,
            m.EndTurn: self.on_end_turn,
            **control.handlers(self),
        }

    # ---- connection ----------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.loop = self.daemon.loop
        self.fds = FdSender(transport, self.loop)
        transport.set_write_buffer_limits(high=WRITE_HIGH_BYTES, low=WRITE_LOW_BYTES)
        sock = transport.get_extra_info("socket")
        self.pid, self.uid, self.gid = peer_credentials(sock)
        self.tenant = self.daemon.tenant(self.uid)
        self.tenant.pids.add(self.pid)
        self.daemon.counters.connections += 1
        self.number = self.daemon.counters.connections  # the daemon's number for it (a metrics label)
        refusal = self._refusal()
        self.daemon.sessions.add(self)
        self.daemon.wake()
        self.tenant.connections += 1
        if refusal is not None:
            log.warning("refusing pid %d (uid %d): %s", self.pid, self.uid, refusal)
            self._send(m.Error(int(errors.ErrorCode.TOO_MANY_CLIENTS), refusal))
            self.closed = True
            transport.close()
            return
        self.last_request_at = self.loop.time()
        self._arm(self.daemon.config.hello_timeout_s)

    def _refusal(self) -> str | None:
        """Why this connection may not be served (before it counts), or None."""
        cfg, d = self.daemon.config, self.daemon
        if self.tenant.connections >= cfg.max_clients_per_tenant:
            return (
                f"uid {self.uid} already has {self.tenant.connections} connections "
                f"(max_clients_per_tenant is {cfg.max_clients_per_tenant})"
            )
        limit = cfg.max_clients + (OPERATOR_RESERVE if control.is_operator(self) else 0)
        if len(d.sessions) >= limit:
            return f"moed serves at most {cfg.max_clients} clients"
        return None

    # ---- deadlines: a Hello within hello_timeout_s, then (optionally) an idle limit ----

    def _arm(self, delay_s: float) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(delay_s, self._deadline_passed) if delay_s > 0 else None

    def _deadline_passed(self) -> None:
        self._deadline = None
        if self.closed:
            return
        if not self.hello:
            self._time_out(f"no hello within {self.daemon.config.hello_timeout_s}s")
            return
        idle_s = self.daemon.config.idle_timeout_s
        quiet_s = self.loop.time() - self.last_request_at
        # A connection with a hold region is an engine that may hit locally without a
        # word to us: closing it would stop its holds counting under a read in flight.
        local = self in self.daemon.residency.regions
        if self.busy or self.leases or local or quiet_s < idle_s:
            self._arm(max(idle_s - quiet_s, idle_s / 4))  # busy or holding: not idle; look again later
            return
        self._time_out(f"idle for {quiet_s:.0f}s (idle_timeout_s is {idle_s})")

    def _time_out(self, why: str) -> None:
        log.info("closing connection of pid %d (uid %d): %s", self.pid, self.uid, why)
        self.daemon.counters.timed_out += 1
        self._send(m.Error(int(errors.ErrorCode.TIMED_OUT), why))
        self.transport.close()

    def abort(self) -> None:
        """Close the connection at once, dropping unsent output; connection_lost releases what it held."""
        self.transport.abort()

    def eof_received(self) -> bool:
        self.peer_closed = True
        return False  # close our end too

    def connection_lost(self, exc) -> None:
        self.closed = True
        # A reset or a broken pipe is the peer leaving; any other exception is ours.
        self.peer_closed = self.peer_closed or isinstance(exc, OSError)
        self.tenant.connections -= 1
        if self._deadline is not None:
            self._deadline.cancel()
        self.fds.close()
        if self.task is not None and not self.task.done():
            self.task.cancel()
        if self.pending is not None:  # its task may never have run: end it here (idempotent)
            self.pending.cancel()
            self.pending = None
        if self.pending_coro is not None:  # its task was cancelled before it ran
            self.pending_coro.close()
            self.pending_coro = None
        self.daemon.sessions.discard(self)
        leases, self.leases = list(self.leases.values()), {}
        for lease in leases:
            self.daemon.release(lease)
        self.daemon.prefetches.forget(self)  # its queued read-ahead is no longer wanted
        self.daemon.turns.forget(self)  # its compute turn goes to the next engine
        if self in self.daemon.residency.regions:
            # A peer that left stops counting now; one the daemon closed may be mid-hit
            # and does not know yet: its region is revoked (moed.protocol.residency_words).
            self.daemon.holds.close_region(self, revoke=not self.peer_closed)
        self.tenant.pids.discard(self.pid)
        if leases:
            log.info("connection of pid %d closed holding %d leases; released them", self.pid, len(leases))

    def data_received(self, data: bytes) -> None:
        frames = self.frames.feed(data)
        self.queue.extend(frames)
        self.queued_bytes += sum(len(f) for f in frames if isinstance(f, bytes))
        self.last_request_at = self.loop.time()
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
        self.fds.output_drained()
        if not self.busy:
            self._pump()  # requests left queued while the peer was not reading
        self._flow()

    def _flow(self) -> None:
        want = not self.write_paused and len(self.queue) < MAX_QUEUED_FRAMES and self.queued_bytes < MAX_QUEUED_BYTES
        if want != self.reading and not self.closed and not self.transport.is_closing():
            self.reading = want
            (self.transport.resume_reading if want else self.transport.pause_reading)()

    def buffers(self) -> dict:
        """What this connection makes the daemon hold now (stats)."""
        return {
            "pid": self.pid,
            "uid": self.uid,
            "leases": len(self.leases),
            "busy": self.busy,
            "queued_requests": len(self.queue),
            "queued_bytes": self.queued_bytes + self.frames.buffered_bytes,
            "buffered_out_bytes": self.transport.get_write_buffer_size() if self.transport else 0,
            "local_holds": self.daemon.residency.holds_of(self),
            "reading": self.reading,
            "name": self.name,
            "engines": sorted([mid, what] for mid, what in self.compute.items()),
            "devices": [self.devices[mid] for mid in sorted(self.devices)],
        }

    # ---- dispatch ------------------------------------------------------------

    def _pump(self) -> None:
        # write_paused: the peer is not reading its replies; answer nothing more
        # until it does (resume_writing pumps again), so output stays bounded.
        while self.queue and not self.busy and not self.closed and not self.write_paused:
            msg = self.queue.popleft()
            if isinstance(msg, bytes):
                self.queued_bytes -= len(msg)
                msg = decode(request_decoder, msg)
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
            self.peer_closed = True  # the peer broke the protocol: it left, as far as its holds go
            self.transport.close()

    def _reply_error(self, msg, exc: errors.MoedError) -> None:
        self.daemon.counters.errors_sent += 1
        if m.wants_reply(msg):
            self._send(m.Error(int(exc.code), exc.message or str(exc), exc.detail))
        else:
            log.info("%s from pid %d failed (no reply wanted): %s", type(msg).__name__, self.pid, exc)
        if isinstance(exc, (errors.NotHello, errors.VersionMismatch)):
            self.peer_closed = True  # as a broken frame: nothing of the peer's is revoked, just dropped
            self.transport.close()

    def _send(self, reply) -> None:
        if not self.closed:
            self.transport.write(encode(reply))

    # ---- handlers ------------------------------------------------------------

    def on_hello(self, msg: m.Hello):
        if msg.version != PROTOCOL_VERSION:
            raise errors.VersionMismatch(f"client speaks protocol {msg.version}, daemon {PROTOCOL_VERSION}")
        self.hello = True
        self._arm(self.daemon.config.idle_timeout_s)  # 0: no idle limit, the Hello deadline is cancelled
        self.name = msg.client_name[:64]
        if self.name:
            if len(self.tenant.names) < MAX_NAMES_PER_TENANT:  # names are for display; never unbounded
                self.tenant.names.add(self.name)
        d = self.daemon
        return m.HelloReply(PROTOCOL_VERSION, d.version, d.pid, self.uid, self.pid)

    def on_ping(self, msg: m.Ping):
        return m.Pong(int(self.loop.time() * 1e9))

    async def on_open_model(self, msg: m.OpenModel):
        peer = peer_identity(self.pid, self.uid, self.gid)
        # The layout the engine computes on: the file's, made on read, or LayoutUnavailable (registry).
        model = await self.daemon.open_model(msg.path, peer, self.tenant, msg.expert_layout)
        info = model.info
        assert info is not None  # set when the model was added
        self.models.add(model.model_id)
        if msg.compute:  # bounded: one short string per model this connection opened
            self.compute[model.model_id] = msg.compute
        classes = [s.class_id for s in info.segments]
        d = self.daemon

        def fds() -> list[int]:
            return [d.ramtier.segments[c].readonly_fd() for c in classes] + d.residency.fds_for(model.model_id, classes)

        await self.fds.send(encode(msgspec.structs.replace(info, residency=True)), fds)
        return None

    async def on_map_holds(self, msg: m.MapHolds):
        fd = self.daemon.residency.open_region(self)
        try:
            await self.fds.send(encode(m.HoldsMapped(REGION_WORDS)), lambda: [os.dup(fd)])
        finally:
            os.close(fd)
        return None

    def model(self, model_id: int):
        """An open model this connection opened (UnknownModel otherwise, ModelStale if retired)."""
        if model_id not in self.models:
            raise errors.UnknownModel(f"this connection has not opened model {model_id}")
        return self.daemon.model_for(model_id)

    def on_acquire(self, msg: m.Acquire):
        if msg.release:
            self._release_ids(msg.release, strict=False)
        model = self.model(msg.model_id)
        if msg.timeout_s is not None and not msg.timeout_s >= 0:
            raise errors.BadRequest(f"timeout_s must be >= 0, got {msg.timeout_s}")
        got = self.daemon.acquire(model, msg.layer, msg.experts, self.tenant, msg.timeout_s)
        if isinstance(got, LeaseRecord):
            return self._granted(got)
        self.pending = got
        # Its engine waits on reads (or room): another computes meanwhile (moed.daemon.turndesk).
        turn = self.daemon.turns.let_go_for_read(self)
        return self._acquire_slow(got, turn)

    async def _acquire_slow(self, pending: PendingAcquire, turn: TurnAsk | None = None):
        try:
            lease = await pending.wait()
        finally:
            self.pending = None
        if self.closed:  # the peer went away while we read: nobody holds this lease
            self.daemon.release(lease)
            return None
        reply = self._granted(lease)  # held by the connection from here: closing it releases the lease
        if turn is not None:  # the engine computes as soon as it has the reply: its turn first
            await self.daemon.turns.take_back(self, turn)
        return reply

    def _granted(self, lease: LeaseRecord) -> m.Granted:
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
            raise errors.UnknownLease(
                f"this connection holds no lease {unknown[0]}"
                + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else "")
            )
        return done

    def on_take_turn(self, msg: m.TakeTurn):
        return self.daemon.turns.take(self, TurnAsk(msg.threads, msg.threads_batch, msg.cpus, msg.batch))

    def on_end_turn(self, msg: m.EndTurn):
        self.daemon.turns.end(self)
        return m.TurnEnded()

    def on_prefetch(self, msg: m.Prefetch):
        model = self.model(msg.model_id)
        return m.Prefetched(self.daemon.prefetch(model, msg.layer, msg.experts, self.tenant, source=self))

    def on_device_report(self, msg: m.DeviceReport):
        """Keep an engine's latest device counters, one row per model it opened here (bounded
        like `compute`), and add what each grew by since its last report to the daemon's sums
        (`Counters.device_*`: they only grow, and outlive the connection)."""
        if msg.model_id not in self.models:
            raise errors.UnknownModel(f"this connection has not opened model {msg.model_id}")
        last = self.devices.get(msg.model_id, {})
        c = self.daemon.counters
        for name in ("hits", "uploads", "upload_bytes", "evictions"):
            grown = max(getattr(msg, name) - last.get(name, 0), 0)
            setattr(c, f"device_{name}", getattr(c, f"device_{name}") + grown)
        self.devices[msg.model_id] = {
            "model_id": msg.model_id,
            "pid": self.pid,
            "connection": self.number,
            **{k: getattr(msg, k) for k in ("slots", "layers", "hits", "uploads", "upload_bytes", "evictions")},
            "zero_copy": msg.zero_copy,
        }
        return m.DeviceReported()

    def on_stats(self, msg: m.GetStats):
        return m.StatsReply(msgspec.convert(control.visible_stats(self, self.daemon.stats()), Stats))

    def on_models(self, msg: m.ListModels):
        rows = control.visible_stats(self, self.daemon.stats())["models"]
        return m.ModelsReply(msgspec.convert(rows, list[ModelRow]))
