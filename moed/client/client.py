"""Blocking client: one Unix-socket connection, requests answered in order.

Latency is the point: one `sendall` and as few `recv` calls as the reply needs,
no asyncio. Releases never cost a round trip: `Lease.release()` sends a
fire-and-forget Release, and `acquire(..., release=[...])` piggybacks releases
on the next acquire.

A dead daemon raises `DaemonUnavailable` promptly (the socket closes, or
`timeout_s` passes without a reply); the client does not reconnect by itself
(call `reconnect()`), since leases and models from the old connection are gone.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
import warnings

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


class Client:
    def __init__(
        self,
        socket_path: str | None = None,
        client_name: str = "",
        timeout_s: float | None = 120.0,
        spin_us: float | None = None,
    ):
        self.socket_path = socket_path or default_socket_path()
        self.client_name = client_name or f"pid{os.getpid()}"
        self.timeout_s = timeout_s
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
        self._sock = sock
        self._frames, self._early = FrameReader(reply_decoder), []
        self.hello = self.request(m.Hello(m.PROTOCOL_VERSION, self.client_name))

    def reconnect(self) -> None:
        """Drop the old connection (its leases are gone) and connect again."""
        self.close()
        self.connect()

    def close(self) -> None:
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

    def request(self, msg, fds: bool = False):
        """Send one request and return its reply (raising the typed error it carries)."""
        frame = _frame(msg)
        with self._lock:
            sock = self._live()
            try:
                sock.sendall(frame)
                reply, got_fds = self._recv_reply(sock, fds)
            except (BrokenPipeError, ConnectionResetError) as exc:
                # The daemon may have refused us and hung up before our request
                # arrived (too many clients, shutting down): its reason is
                # waiting in the receive buffer.
                reply, got_fds = self._parting_error(sock), []
                self._broken(exc, reply)
            except (OSError, EOFError) as exc:
                self._broken(exc)
        if isinstance(reply, m.Error):
            for fd in got_fds:
                os.close(fd)
            raise errors.error_for(reply.code, reply.message, reply.detail)
        return (reply, got_fds) if fds else reply

    def send(self, msg) -> None:
        """Send a fire-and-forget request (`ack=False`): no reply will come."""
        frame = _frame(msg)
        with self._lock:
            sock = self._live()
            try:
                sock.sendall(frame)
            except OSError as exc:
                self._broken(exc)

    def _live(self) -> socket.socket:
        if self._sock is None:
            raise errors.DaemonUnavailable("not connected (call reconnect())")
        return self._sock

    def _parting_error(self, sock: socket.socket) -> m.Error | None:
        try:
            got = self._early + self._frames.feed(sock.recv(1 << 16, socket.MSG_DONTWAIT))
        except OSError:
            got = self._early
        return next((r for r in got if isinstance(r, m.Error)), None)

    def _broken(self, exc: BaseException, reason: m.Error | None = None):
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        if reason is not None:
            raise errors.error_for(reason.code, reason.message, reason.detail)
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

    def open_model(self, path: str | os.PathLike, expert_layout: str = "", compute: str = "") -> ModelHandle:
        """Open a model; `expert_layout` ("plain", "q4_0_8x8", "q4_K_8x8+plain", ...) is the
        layout the caller computes on ("" takes the file as it is): a plain file's experts
        are made in it as the daemon reads them (a model of its own, shared by every caller
        asking the same layout), and what the daemon can neither find in the file nor make
        raises LayoutUnavailable. `compute`: what computes where in the caller's engine, for
        `moectl stats`."""
        # the daemon resolves paths itself: never in its own working directory
        info, fds = self._open(m.OpenModel(os.path.abspath(os.fspath(path)), expert_layout, compute[:256]))
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
        return ModelHandle(self, info, table if self._region is not None else None)

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


def _frame(msg) -> bytearray:
    """The request's frame; a value the wire cannot carry (an id of 2**64) is a BadRequest."""
    try:
        return encode(msg)
    except (OverflowError, TypeError, msgspec.EncodeError) as exc:
        raise errors.BadRequest(f"cannot send {type(msg).__name__}: {exc}") from None


class ModelHandle:
    """One open model on this connection; geometry mirrors the daemon's catalog."""

    def __init__(self, client: Client, info: m.ModelInfo, table: local.ReadOnlyWords | None = None):
        self.client = client
        self.info = info
        self._table = table  # None: every acquire is a round trip
        self.local_tries = 0  # hits tried with no round trip (hp_hit runs), counted for the tests
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
    ) -> Lease:
        """Hold `experts` of `layer`; blocks until they are resident. `release` piggybacks.

        `local`: try the hit with no round trip first (False: the caller tried it for this
        layer already, and it missed; the request goes to the daemon at once).

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
        g = self.client.request(m.Acquire(self.model_id, layer, experts, timeout_s, [r for r in rel if r]))
        return Lease(self, layer, list(dict.fromkeys(experts)), g)

    def hit(self, layer: int, experts, release=()) -> Lease | None:
        """The hit with no round trip only: a lease when every expert is resident (`release`
        released then), else None with nothing changed (ask with `acquire(local=False)`)."""
        if self._table is None:
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
        if region is None or row is None or info is None or client._sock is None:
            return None
        uniq = list(dict.fromkeys(experts))
        if not uniq or min(uniq) < 0 or max(uniq) >= self.n_experts:
            return None  # the daemon answers with the right error
        holds = region.take(len(uniq))
        if holds is None:
            return None  # every hold word in use: the daemon holds the rest
        self.local_tries += 1  # hp_hit runs: once a layer at most (tests count it)
        slots = region.hit(self._table, row, uniq, client._states[info.class_id], info.class_id, holds)
        if slots is None:
            region.give(holds)
            return None
        region.record(self.model_id, info.class_id, slots)
        states = client._states[info.class_id]
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
        try:
            self.client.send(m.Prefetch(self.model_id, layer, [int(e) for e in experts], ack=False))
        except errors.DaemonUnavailable:
            pass


class Lease:
    """Experts held in the RAM tier until released (or the connection closes)."""

    __slots__ = ("model", "layer", "experts", "lease_id", "class_id", "slots", "_segment", "_live", "_holds")

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

    @property
    def segment(self) -> Segment:
        return self._segment

    def slot(self, expert: int) -> int:
        return self.slots[expert]

    def view(self, expert: int, part: str) -> np.ndarray:
        if not self._live:
            raise errors.UnknownLease(f"lease {self.lease_id} was released")
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
        return self.lease_id

    def release(self) -> None:
        lease_id = self._take_for_release()
        if lease_id is not None and self.model.client._sock is not None:
            self.model.client.send(m.Release([lease_id], ack=False))

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
