"""Blocking client: one Unix-socket connection, requests answered in order.

Latency is the point: one `sendall` and as few `recv` calls as the reply needs,
no asyncio. Releases never cost a round trip: `Lease.release()` sends a
fire-and-forget Release, and `acquire(..., release=[...])` piggybacks releases
on the next acquire.

A dead daemon raises `DaemonUnavailable` promptly (the socket closes, or
`timeout_s` passes without a reply): the request in flight fails, since the leases
of that connection are gone with it. The next request reconnects on its own: it
retries from 50 ms, doubling to 1 s, for up to `reconnect_s` (default 30 s; 0 turns
it off, and only `reconnect()` connects again), sends Hello, and re-opens every
model still open on this client (`ModelHandle`s are re-bound to the new daemon's
model ids, segments, residency tables and hold region). A daemon that does not
answer within `reconnect_s` gives `DaemonUnavailable` saying so; the request after
that tries again.

Invariants of a reconnect (`generation` counts the connections):
- nothing of the old connection stays mapped or counted by this client: its
  segments, slot states and hold region are dropped before the new ones are mapped
  (a lease still open keeps what it reads mapped until it is released);
- a lease of an older generation is never released into the new connection (its
  lease id means nothing there): a round-trip lease is forgotten, a local lease
  clears its holds in its own (old) region; `view` of it raises `LeaseLost`;
- a request is sent on the generation its ids were read for, or not at all; one
  found to be unsendable (no connection, or its ids from a replaced one) was seen by
  no daemon, and is sent again with its ids read again where the caller allows;
- one thread reconnects at a time (`_reviving`), and until it has re-bound every
  model, other threads' requests wait for it; a handle's local hits use only the
  table, region and slot states of the connection it was bound on.
A local hit (moed.client.local) needs no round trip, so it cannot see the daemon
die: until a round trip notices, it reads the dead daemon's segments, whose pages
stay valid (and unchanged) while mapped. Engines check the connection before each
decode (moed.engines.streamer).
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
import warnings
import weakref

import msgspec
import numpy as np

from moed.protocol import errors
from moed.protocol import messages as m
from moed.protocol import residency_words as rz
from moed.protocol.framing import FrameReader, encode, reply_decoder
from moed.protocol.paths import default_socket_path  # also re-exported by moed.client

from . import local
from .segments import Segment

DEFAULT_SPIN_US = 100.0  # busy-poll for a reply this long before sleeping (0: never)
DEFAULT_RECONNECT_S = 30.0  # how long a lost connection is retried (systemd restarts moed in ~1 s)
RECONNECT_FIRST_PAUSE_S = 0.05  # the first retry's pause, doubled after each failure ...
RECONNECT_MAX_PAUSE_S = 1.0  # ... up to this


class Client:
    def __init__(
        self,
        socket_path: str | None = None,
        client_name: str = "",
        timeout_s: float | None = 120.0,
        spin_us: float | None = None,
        reconnect_s: float = DEFAULT_RECONNECT_S,
    ):
        """`reconnect_s`: how long a request retries a lost connection (0: never; see module)."""
        self.socket_path = socket_path or default_socket_path()
        self.client_name = client_name or f"pid{os.getpid()}"
        self.timeout_s = timeout_s
        if reconnect_s < 0:
            raise ValueError(f"reconnect_s={reconnect_s}: a number of seconds, 0 or more")
        self.reconnect_s = float(reconnect_s)
        self.generation = 0  # connections made: leases and ids belong to the one they came on
        self._closed = False  # close() was called: no request reconnects
        self._reviving = threading.Lock()  # one reconnect at a time
        # The thread inside connect() (None: none): until it has re-bound every model, other
        # threads' requests wait for it (their ids may be the old connection's).
        self._connecting: int | None = None
        # The models opened on this client, re-opened on a reconnect (weak: a handle nobody
        # holds is not opened again).
        self._handles: weakref.WeakSet[ModelHandle] = weakref.WeakSet()
        if spin_us is None:
            spin_us = float(os.environ.get("MOED_CLIENT_SPIN_US", DEFAULT_SPIN_US))
        self.spin_ns = int(spin_us * 1000)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._frames = FrameReader(reply_decoder)
        self._early: list = []  # replies that arrived in one recv with the one awaited
        self._segments: dict[int, Segment] = {}
        # Hits without a round trip (moed.client.local): this connection's hold
        # region and each class's slot states, mapped once the first model opens.
        self._region: local.HoldRegion | None = None
        self._states: dict[int, local.ReadOnlyWords] = {}
        self.hello: m.HelloReply | None = None
        self.connect()

    # ---- connection ------------------------------------------------------

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if self.timeout_s is not None:
            # The kernel's receive timeout, not settimeout(): a Python-level
            # timeout polls before every send and recv, two extra syscalls per
            # round trip on the hit path.
            sec = int(self.timeout_s)
            usec = int((self.timeout_s - sec) * 1e6)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", sec, usec))
        try:
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            raise errors.DaemonUnavailable(
                f"cannot connect to moed at {self.socket_path}: {exc.strerror or exc}"
            ) from None
        self._connecting = threading.get_ident()  # before the socket is seen by other threads
        self._sock = sock
        self._closed = False
        self.generation += 1
        self._frames, self._early = FrameReader(reply_decoder), []
        try:
            self.hello = self.request(m.Hello(m.PROTOCOL_VERSION, self.client_name))
            self._reopen()
        except BaseException:
            self._drop()  # no handle is left bound to a connection it could not open its model on
            raise
        finally:
            self._connecting = None

    def reconnect(self, wait_s: float | None = None) -> None:
        """Drop the connection (its leases are gone) and connect again, retrying from 50 ms,
        doubling to 1 s, for up to `wait_s` (None: `reconnect_s`; 0: one try); every model
        still open on this client is opened again (module docstring)."""
        with self._reviving:
            self._drop()
            self._connect_retrying(self.reconnect_s if wait_s is None else wait_s)

    def ensure_connected(self) -> None:
        """Reconnect if the connection is gone (`alive()` False), as a request would: bounded by
        `reconnect_s`, raising DaemonUnavailable if moed does not answer (or reconnect_s is 0)."""
        if not self.alive():
            self._revive()

    def alive(self) -> bool:
        """Whether the connection is up as far as this process can tell without a round trip
        (one non-blocking peek: a daemon that died has closed its end)."""
        sock = self._sock
        if sock is None:
            return False
        try:
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True  # nothing to read: the usual state of a live connection
        except OSError:
            return False

    def _revive(self) -> None:
        """The connection is gone: reconnect within `reconnect_s` (see module)."""
        if self._closed:
            raise errors.DaemonUnavailable("this Client was closed")
        if self.reconnect_s <= 0:
            raise errors.DaemonUnavailable(
                "the connection to moed was lost (this Client has reconnect_s=0: Client.reconnect() connects again)"
            )
        with self._reviving:
            if not self.alive():  # unless another thread reconnected meanwhile
                self._drop()
                self._connect_retrying(self.reconnect_s)

    def _connect_retrying(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        pause = RECONNECT_FIRST_PAUSE_S
        while True:
            try:
                self.connect()
                return
            except errors.DaemonUnavailable as exc:
                self._drop()
                left = deadline - time.monotonic()
                if left <= 0:
                    if wait_s <= 0:
                        raise
                    raise errors.DaemonUnavailable(
                        f"moed at {self.socket_path} did not answer for {wait_s:g} s after the connection "
                        f"was lost ({exc}); the next request tries again"
                    ) from None
            time.sleep(min(pause, left))  # the daemon is starting (or not): nothing to poll but the socket
            pause = min(2 * pause, RECONNECT_MAX_PAUSE_S)

    def _reopen(self) -> None:
        """Open this client's models again on the new connection (their ids may have changed);
        one that cannot be opened fails the reconnect with its error (none is left half bound)."""
        for handle in list(self._handles):
            path, expert_layout, compute = handle.asked
            info, fds = self._open(m.OpenModel(path, expert_layout, compute))
            handle._bind(info, self._map_model(info, fds))

    def close(self) -> None:
        """Close the connection for good: no request reconnects after this (`connect()` and
        `reconnect()` still do)."""
        self._closed = True
        self._drop()

    def _drop(self) -> None:
        """Let the connection go with everything mapped for it (see module invariants)."""
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()
        self._states.clear()
        if self._region is not None:  # no more hits; unmapped once its open local leases are released
            self._region.close()
            self._region = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- wire --------------------------------------------------------------

    def request(self, msg, fds: bool = False, generation: int | None = None):
        """Send one request and return its reply (raising the typed error it carries).

        A lost connection is reconnected first (module docstring); `generation`: the
        connection whose ids `msg` carries (a model id, lease ids): if another has replaced
        it, nothing is sent and DaemonUnavailable is raised."""
        try:
            return self._request(msg, fds, generation)
        except _Unsent as exc:  # callers see the type they were promised, not the internal one
            raise errors.DaemonUnavailable(str(exc)) from None

    def _request(self, msg, fds: bool = False, generation: int | None = None):
        """`request`, raising `_Unsent` when nothing left (callers that send again catch it)."""
        frame = _frame(msg)
        if self._sock is None and generation is None:
            self._revive()
        try:
            return self._round_trip(frame, fds, generation)
        except _Unsent:
            # The daemon was gone before the request left (an idle connection whose daemon
            # died): no one saw it, so it goes to the daemon that is back, unless its ids
            # belong to the old connection (the caller rebuilds it) or it is part of connecting
            # (connect() fails, and a reconnect's loop tries again).
            if (
                generation is not None
                or self.reconnect_s <= 0
                or self._closed
                or self._connecting == threading.get_ident()
            ):
                raise
            self._revive()
            return self._round_trip(frame, fds, None)

    def _round_trip(self, frame: bytearray, fds: bool, generation: int | None):
        with self._lock:
            sock = self._live(generation)
            try:
                sock.sendall(frame)
            except (BrokenPipeError, ConnectionResetError) as exc:
                # The daemon may have refused us and hung up before our request
                # arrived (too many clients, shutting down): its reason is
                # waiting in the receive buffer. Without one, it is gone.
                self._broken(exc, self._parting_error(sock), unsent=True)
            try:
                reply, got_fds = self._recv_reply(sock, fds)
            except (BrokenPipeError, ConnectionResetError) as exc:
                reply, got_fds = self._parting_error(sock), []
                self._broken(exc, reply)
            except (OSError, EOFError) as exc:
                self._broken(exc)
        if isinstance(reply, m.Error):
            for fd in got_fds:
                os.close(fd)
            raise errors.error_for(reply.code, reply.message, reply.detail)
        return (reply, got_fds) if fds else reply

    def send(self, msg, generation: int | None = None) -> None:
        """Send a fire-and-forget request (`ack=False`): no reply will come. Never reconnects
        (DaemonUnavailable when the connection is gone); `generation` as for `request`."""
        frame = _frame(msg)
        with self._lock:
            try:
                sock = self._live(generation)
            except _Unsent as exc:
                raise errors.DaemonUnavailable(str(exc)) from None
            try:
                sock.sendall(frame)
            except OSError as exc:
                self._broken(exc)

    def _live(self, generation: int | None = None) -> socket.socket:
        """The socket to send on; `_Unsent` (nothing was sent) when there is none, or when the
        request's ids came from a connection another thread has replaced meanwhile."""
        if self._sock is None:
            raise _Unsent("this Client was closed" if self._closed else "the connection to moed was lost")
        if generation is not None and generation != self.generation:
            raise _Unsent("the connection these ids came from was lost (moed went away)")
        if self._connecting is not None and self._connecting != threading.get_ident():
            raise _Unsent("moed is being reconnected by another thread")
        return self._sock

    def _parting_error(self, sock: socket.socket) -> m.Error | None:
        try:
            got = self._early + self._frames.feed(sock.recv(1 << 16, socket.MSG_DONTWAIT))
        except OSError:
            got = self._early
        return next((r for r in got if isinstance(r, m.Error)), None)

    def _broken(self, exc: BaseException, reason: m.Error | None = None, unsent: bool = False):
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        if reason is not None:
            raise errors.error_for(reason.code, reason.message, reason.detail)
        if unsent:
            raise _Unsent(f"connection to moed lost: {exc}") from None
        if isinstance(exc, (TimeoutError, BlockingIOError)):  # SO_RCVTIMEO expired
            raise errors.DaemonUnavailable(f"moed did not answer within {self.timeout_s}s") from None
        raise errors.DaemonUnavailable(f"connection to moed lost: {exc or 'closed'}") from None

    def _recv_reply(self, sock: socket.socket, want_fds: bool):
        """The next reply (and any descriptors that came with it), split by the shared FrameReader."""
        fds: list[int] = []
        while not self._early:
            if want_fds:
                data, new_fds, _, _ = socket.recv_fds(sock, 1 << 16, 16)
                fds.extend(new_fds)
            else:
                # The hit path: usually one recv holding exactly one reply, decoded in place.
                data = (self._spin_recv(sock) if self.spin_ns else None) or sock.recv(1 << 16)
            if not data:
                raise EOFError("daemon closed the connection")
            self._early = self._frames.feed(data)
        reply = self._early.pop(0)
        if isinstance(reply, errors.BadFrame):  # the stream cannot be trusted any more
            raise EOFError(f"undecodable reply: {reply}")
        return reply, fds

    def _spin_recv(self, sock: socket.socket) -> bytes | None:
        """Poll for the reply for up to `spin_ns` before sleeping in recv.

        A hit is answered in tens of microseconds; sleeping and being woken
        costs about as much again on a busy VM (measured: p50 75 -> 32 µs).
        The engine would sit idle in that window anyway. None: not yet.
        """
        deadline = time.perf_counter_ns() + self.spin_ns
        recv = sock.recv
        while True:
            try:
                return recv(1 << 16, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if time.perf_counter_ns() > deadline:
                    return None
                # Yield, so a spinning engine never keeps the daemon off a shared core.
                os.sched_yield()

    # ---- verbs ---------------------------------------------------------------

    def ping(self) -> int:
        return self.request(m.Ping()).time_ns

    def stats(self) -> dict:
        return msgspec.to_builtins(self.request(m.GetStats()).stats)

    def models(self) -> list[dict]:
        return msgspec.to_builtins(self.request(m.ListModels()).models)

    def take_turn(self, threads: int = 0, threads_batch: int = 0, cpus: int = 1, batch: bool = False) -> m.TurnGranted:
        """Wait for a compute turn (moed.daemon.turns) on this connection as it is: never
        reconnects (DaemonUnavailable if it is gone; a daemon without turns: BadFrame).
        `threads`/`threads_batch`: the caller's own counts, 0 where the daemon decides."""
        cap = lambda n: min(max(int(n), 0), m.MAX_THREADS)  # noqa: E731 - the wire's bounds
        ask = m.TakeTurn(cap(threads), cap(threads_batch), max(1, cap(cpus)), bool(batch))
        return self.request(ask, generation=self.generation)

    def end_turn(self, generation: int | None = None) -> None:
        """Let the turn go, fire and forget; `generation`: the connection it was taken on
        (another one knows nothing of it: DaemonUnavailable, nothing sent)."""
        self.send(m.EndTurn(), generation=self.generation if generation is None else generation)

    def open_model(self, path: str | os.PathLike, expert_layout: str = "", compute: str = "") -> ModelHandle:
        """Open a model; `expert_layout` ("plain", "q4_0_8x8", "q4_K_8x8+plain", ...) is the
        layout the caller computes on ("" takes the file as it is): a plain file's experts
        are made in it as the daemon reads them (a model of its own, shared by every caller
        asking the same layout), and what the daemon can neither find in the file nor make
        raises LayoutUnavailable. `compute`: what computes where in the caller's engine, for
        `moectl stats`."""
        # the daemon resolves paths itself: never in its own working directory
        asked = (os.path.abspath(os.fspath(path)), expert_layout, compute[:256])
        info, fds = self._open(m.OpenModel(*asked))
        handle = ModelHandle(self, info, self._map_model(info, fds), asked)
        self._handles.add(handle)
        return handle

    def _map_model(self, info: m.ModelInfo, fds: list[int]) -> local.ReadOnlyWords | None:
        """Map what came with an opened model (segments and slot states not mapped yet, the
        hold region once); its residency table, or None (local hits off)."""
        n = len(info.segments)
        want = 2 * n + 1 if info.residency else n
        if len(fds) != want:
            for fd in fds:
                os.close(fd)
            raise errors.InternalError(f"expected {want} descriptors with the model, got {len(fds)}")
        for seg_info, fd in zip(info.segments, fds):
            if seg_info.class_id in self._segments:
                os.close(fd)
            else:
                self._segments[seg_info.class_id] = Segment(seg_info, fd)
        table = None
        if info.residency:
            for seg_info, fd in zip(info.segments, fds[n : 2 * n]):
                if seg_info.class_id in self._states:
                    os.close(fd)
                else:
                    self._states[seg_info.class_id] = local.ReadOnlyWords(fd)
            table = local.ReadOnlyWords(fds[2 * n])
            self._map_holds()
        return table if self._region is not None else None

    def _open(self, msg: m.OpenModel):
        """OpenModel, waiting while this tenant's other opens are in flight (engines that
        start together: the daemon runs max_opens_per_tenant at once), up to `timeout_s`."""
        deadline = time.monotonic() + (self.timeout_s if self.timeout_s is not None else 120.0)
        pause = 0.01
        while True:
            try:
                return self.request(msg, fds=True)
            except errors.TooBusy as exc:
                if exc.busy != "opens" or time.monotonic() + pause > deadline:
                    raise
            time.sleep(pause)  # the other opens take a header parse: tens of ms
            pause = min(2 * pause, 0.5)

    def _map_holds(self) -> None:
        """This connection's hold region, asked for once (when local hits are enabled)."""
        if self._region is not None or not local.enabled():
            return
        reply, fds = self.request(m.MapHolds(), fds=True)
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise errors.InternalError(f"expected one hold-region descriptor, got {len(fds)}")
        self._region = local.HoldRegion(fds[0], reply.region_words)

    def segment(self, class_id: int) -> Segment:
        return self._segments[class_id]


class _Unsent(errors.DaemonUnavailable):
    """The connection was found gone before a request left: nothing was sent (safe to send
    again on a new connection, with ids read again)."""


def _frame(msg) -> bytearray:
    """The request's frame; a value the wire cannot carry (an id of 2**64) is a BadRequest."""
    try:
        return encode(msg)
    except (OverflowError, TypeError, msgspec.EncodeError) as exc:
        raise errors.BadRequest(f"cannot send {type(msg).__name__}: {exc}") from None


def _geometry(info: m.ModelInfo) -> tuple:
    """What a model must keep across a reconnect: its files' experts where they were."""
    return (
        info.files,
        info.moe_layers,
        info.n_experts,
        info.n_expert_used,
        info.expert_layout,
        [(L.layer, L.parts) for L in info.layers],
    )


class ModelHandle:
    """One open model on this client; geometry mirrors the daemon's catalog. A reconnect
    binds it to the new daemon's model (`_bind`): `model_id` and size classes may change."""

    def __init__(
        self,
        client: Client,
        info: m.ModelInfo,
        table: local.ReadOnlyWords | None = None,
        asked: tuple[str, str, str] = ("", "", ""),
    ):
        self.client = client
        self.asked = asked  # OpenModel's (path, expert_layout, compute): what a reconnect opens again
        self.local_tries = 0  # hits tried with no round trip (hp_hit runs), counted for the tests
        self._bind(info, table)

    def _bind(self, info: m.ModelInfo, table: local.ReadOnlyWords | None) -> None:
        """Take `info` (and its residency table) as this model's: at open, and again on each
        reconnect, where the model's id and size classes may differ but not its geometry."""
        before: m.ModelInfo | None = getattr(self, "info", None)
        if before is not None and _geometry(before) != _geometry(info):
            raise errors.ModelStale(
                f"{self.asked[0]}: the model changed while moed was away ({before.n_experts} experts, "
                f"layers {before.moe_layers} before); open it again"
            )
        self.info = info
        self._table = table  # None: every acquire is a round trip
        self._region = self.client._region  # the hold region of the connection `table` came on
        self._rows = {layer: i * info.n_experts for i, layer in enumerate(sorted(info.moe_layers))}
        self.model_id = info.model_id
        self.path = info.path
        self.files = info.files
        self.moe_layers = info.moe_layers
        self.n_experts = info.n_experts
        self.n_expert_used = info.n_expert_used
        self.parts = info.parts
        self.expert_layout = info.expert_layout
        self._layers = {L.layer: L for L in info.layers}

    def layer(self, layer: int) -> m.LayerInfo:
        try:
            return self._layers[layer]
        except KeyError:
            raise errors.UnknownLayer(f"no routed experts in layer {layer}") from None

    def segment(self, class_id: int) -> Segment:
        return self.client.segment(class_id)

    def acquire(
        self,
        layer: int,
        experts,
        timeout_s: float | None = None,
        release=(),
        *,
        timeout: float | None = None,
        local: bool = True,
        generation: int | None = None,
    ) -> Lease:
        """Hold `experts` of `layer`; blocks until they are resident. `release` piggybacks.

        `local`: try the hit with no round trip first (False: the caller tried it for this
        layer already, and it missed; the request goes to the daemon at once).

        `generation`: the connection the caller's state belongs to (an engine's mappings):
        when it is not the live one, DaemonUnavailable and nothing sent, never a reconnect
        (None: a lost connection is reconnected first, module docstring).

        `timeout_s`: how long the daemon may wait for room (None: its default).
        `timeout` is the first interface's name (`m.acquire(layer, experts, timeout=None)`),
        which callers outside this repository are promised: kept, with a DeprecationWarning.
        """
        if timeout is not None:
            warnings.warn(
                "ModelHandle.acquire(timeout=) is deprecated; use timeout_s=", DeprecationWarning, stacklevel=2
            )
            timeout_s = timeout if timeout_s is None else timeout_s
        experts = list(map(int, experts))
        if local and self._table is not None:
            # `hit`'s body, inline: a local hit costs ~5 µs, and one more call and conversion
            # showed in bench/acquire_latency.py (issue 39's A/B, bench/RESULTS.md)
            lease = self._acquire_locally(layer, experts)
            if lease is not None:
                for prior in release:
                    prior.release()
                return lease
        rel = [lease._take_for_release() for lease in release]
        client = self.client
        rel_ids = [r for r in rel if r]
        if generation is not None:
            g = client.request(m.Acquire(self.model_id, layer, experts, timeout_s, rel_ids), generation=generation)
        else:
            g = self._ask(layer, experts, timeout_s, rel_ids)
        return Lease(self, layer, list(dict.fromkeys(experts)), g)

    def _ask(self, layer: int, experts: list[int], timeout_s: float | None, rel_ids: list[int]) -> m.Granted:
        """Acquire's round trip, reconnecting first when the connection is lost; sent once more
        on a new connection when the daemon was found gone before it left (the ids read again)."""
        client = self.client
        if client._sock is None:
            client._revive()  # before the ids are read: a reconnect re-binds them
        gen = client.generation
        try:
            return client._request(m.Acquire(self.model_id, layer, experts, timeout_s, rel_ids), generation=gen)
        except _Unsent as exc:
            if client.reconnect_s <= 0:
                raise errors.DaemonUnavailable(str(exc)) from None
        client._revive()
        gen = client.generation  # the released leases went with the lost connection
        return client.request(m.Acquire(self.model_id, layer, experts, timeout_s, []), generation=gen)

    def hit(self, layer: int, experts, release=(), generation: int | None = None) -> Lease | None:
        """The hit with no round trip only: a lease when every expert is resident (`release`
        released then), else None with nothing changed (ask with `acquire(local=False)`);
        `generation` as for `acquire` (not the live connection's: None)."""
        if self._table is None or (generation is not None and generation != self.client.generation):
            return None
        lease = self._acquire_locally(layer, list(map(int, experts)))
        if lease is not None:
            for prior in release:
                prior.release()
        return lease

    def _acquire_locally(self, layer: int, experts: list[int]) -> Lease | None:
        """A hit with no round trip, or None (not all resident, or anything odd: ask the daemon)."""
        client = self.client
        region, row, info = client._region, self._rows.get(layer), self._layers.get(layer)
        # The region this handle's table was bound with (a reconnect under way may have mapped
        # the new daemon's already, or dropped the old one's states).
        if region is None or region is not self._region or row is None or info is None or client._sock is None:
            return None
        states = client._states.get(info.class_id)
        if states is None:
            return None
        uniq = list(dict.fromkeys(experts))
        if not uniq or min(uniq) < 0 or max(uniq) >= self.n_experts:
            return None  # the daemon answers with the right error
        holds = region.take(len(uniq))
        if holds is None:
            return None  # every hold word in use: the daemon holds the rest
        self.local_tries += 1  # hp_hit runs: once a layer at most (tests count it)
        slots = region.hit(self._table, row, uniq, states, info.class_id, holds)
        if slots is None:
            region.give(holds)
            return None
        region.record(self.model_id, info.class_id, slots)
        return Lease(self, layer, uniq, m.Granted(0, info.class_id, slots), (region, holds, states))

    def local_hits(self) -> local.LocalHits | None:
        """What a caller needs to take this model's hits itself, as `acquire` does
        (moed/_hitproto.h): None when this connection has no table (local hits off)."""
        region = self.client._region
        if self._table is None or region is None:
            return None
        states = {L.class_id: self.client._states[L.class_id] for L in self._layers.values()}
        n_entries = len(self._rows) * self.n_experts
        # The pin word follows the entries (None: a table without one, no whole steps).
        pin_word = rz.pin_word(n_entries) if len(self._table.words) > n_entries else None
        return local.LocalHits(
            region, self._table, dict(self._rows), states, region.counter_word(self.model_id), self.model_id, pin_word
        )

    def all_pinned(self) -> bool:
        """Whether every expert of the model is pinned and READY now (the table's pin word:
        engines then take whole steps); False without a table."""
        hits = self.local_hits()
        return hits is not None and hits.pin_word is not None and int(hits.table.words[hits.pin_word]) == 1

    def resident(self, layer: int, experts) -> np.ndarray:
        """Which of `experts` of `layer` are resident now: a bool array read from the
        residency table, with no round trip. A hint for choosing what to prefetch or
        what to route to; an acquire is still the only thing that holds them. All
        False when this connection has no table (local hits off)."""
        ids = np.asarray(experts, dtype=np.int64)
        info = self._layers.get(layer)
        if self._table is None or info is None or info.class_id not in self.client._states:
            return np.zeros(len(ids), dtype=bool)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.n_experts):
            raise errors.UnknownExpert(f"experts must be 0..{self.n_experts - 1}")
        return local.resident(self._table, self._rows[layer], ids, self.client._states[info.class_id])

    def prefetch(self, layer: int, experts) -> None:
        """Ask for experts to be read ahead; never waits, never errors back.

        A hint: if the daemon is gone it is dropped here (the next acquire says
        so with DaemonUnavailable). Arguments that cannot be sent still raise.
        """
        gen = self.client.generation
        try:
            self.client.send(m.Prefetch(self.model_id, layer, [int(e) for e in experts], ack=False), gen)
        except errors.DaemonUnavailable:
            pass

    def report_device(self, **counters) -> None:
        """Tell the daemon this engine's device-slot counters for this model (`m.DeviceReport`'s
        fields: slots, layers, hits, uploads, upload_bytes, evictions, zero_copy); fire and
        forget, dropped if the daemon is gone, as a prefetch."""
        gen = self.client.generation
        try:
            self.client.send(m.DeviceReport(self.model_id, **counters), gen)
        except errors.DaemonUnavailable:
            pass


class Lease:
    """Experts held in the RAM tier until released (or the connection closes)."""

    __slots__ = ("model", "layer", "experts", "lease_id", "class_id", "slots", "_segment", "_live", "_holds", "_gen")

    def __init__(
        self,
        model: ModelHandle,
        layer: int,
        experts: list[int],
        granted: m.Granted,
        holds: tuple[local.HoldRegion, list[int], local.ReadOnlyWords] | None = None,
    ):
        self.model = model
        self.layer = layer
        self.experts = experts
        self.lease_id = granted.lease_id
        self.class_id = granted.class_id
        self.slots = dict(zip(experts, granted.slots))
        self._segment = model.segment(granted.class_id)
        self._live = True
        self._holds = holds  # a local lease (no round trip): its region, hold words and the class's states
        self._gen = model.client.generation  # the connection it was granted on (module invariants)

    @property
    def segment(self) -> Segment:
        return self._segment

    def slot(self, expert: int) -> int:
        return self.slots[expert]

    def view(self, expert: int, part: str) -> np.ndarray:
        if not self._live:
            raise errors.UnknownLease(f"lease {self.lease_id} was released")
        if self._gen != self.model.client.generation:
            raise errors.LeaseLost(
                f"layer {self.layer}: this lease was granted on a connection to moed that was lost; acquire again"
            )
        try:
            slot = self.slots[expert]
        except KeyError:
            raise errors.UnknownExpert(f"expert {expert} is not in this lease ({self.experts})") from None
        return self._segment.view(slot, part)

    @property
    def local(self) -> bool:
        """Granted with no round trip (held in this connection's hold region)."""
        return self._holds is not None

    def _take_for_release(self) -> int | None:
        """The lease id to send the daemon, or None (released already, or local: let go here)."""
        if not self._live:
            return None
        self._live = False
        if self._holds is not None:
            region, words, states = self._holds
            # Cleared even when the connection is gone: a revoked region then ends early.
            if not region.release(states, words):
                raise errors.LeaseLost(
                    f"layer {self.layer}: a slot of this local lease was refilled before its release "
                    "(the daemon closed this connection and its holds outlived the grace); "
                    "what was read from it may be wrong"
                )
            return None
        # A lease of a lost connection: the daemon let it go when the connection closed.
        return self.lease_id if self._gen == self.model.client.generation else None

    def release(self) -> None:
        lease_id = self._take_for_release()
        client = self.model.client
        if lease_id is not None and client._sock is not None:  # None: a lease of a lost connection
            client.send(m.Release([lease_id], ack=False), self._gen)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
