"""Hypothesis strategies for hostile frames, shared by the robustness tests and bench/fuzz_frames.py.

Four kinds, mixed: raw random payloads; valid MessagePack of random maps
(wrong tags, wrong field types); well-typed requests with hostile values
(huge, negative, empty, enormous lists, odd paths); and truncated or
bit-flipped encodings of real requests. Oversize length prefixes are left to
a dedicated test, since they close the connection by design.
"""

from __future__ import annotations

import msgspec
from hypothesis import strategies as st

from moed.protocol import messages as m
from moed.protocol.framing import HEADER

TAGS = [t.__struct_config__.tag for t in m.REQUEST_TYPES + m.REPLY_TYPES] + ["", "nope", "hello\x00"]  # type: ignore[attr-defined]
FIELDS = [
    "version",
    "model_id",
    "layer",
    "experts",
    "timeout_s",
    "release",
    "lease_ids",
    "ack",
    "path",
    "client_name",
    "floor_bytes",
    "all",
    "from_stats",
    "x",
]

ints = st.one_of(st.integers(-3, 70), st.integers(-(2**63), 2**64 - 1), st.sampled_from([0, 1, -1, 2**31, 2**63]))
scalars = st.one_of(
    ints, st.floats(allow_nan=True), st.text(max_size=40), st.binary(max_size=40), st.booleans(), st.none()
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
paths = st.one_of(
    st.text(max_size=60),
    st.sampled_from(["/", "/dev/zero", "/proc/self/mem", "/etc/shadow", "", "../../../etc/passwd", "/tmp", "a" * 5000]),
)
# long lists are built, not drawn element by element (drawing 1000s of elements is slow)
expert_lists = st.one_of(
    st.lists(ints, max_size=12), st.builds(lambda n, e: [e % 8] * n, st.integers(1000, 3000), st.integers(0, 7))
)


def _random_map():
    return st.fixed_dictionaries({"t": st.sampled_from(TAGS)}, optional={f: values for f in FIELDS}).map(
        msgspec.msgpack.encode
    )


def _hostile_request():
    return st.one_of(
        st.builds(
            m.Acquire, ints, ints, expert_lists, st.one_of(st.none(), st.floats(-1, 0.01)), st.lists(ints, max_size=5)
        ),
        st.builds(m.Release, st.lists(ints, max_size=20), st.booleans()),
        st.builds(m.Prefetch, ints, ints, expert_lists, st.booleans()),
        st.builds(m.OpenModel, paths),
        st.builds(m.Hello, ints, st.text(max_size=100)),
        st.builds(m.Ping),
        st.builds(m.GetStats),
        st.builds(m.ListModels),
        st.builds(m.Unpin, ints, st.lists(st.tuples(ints, ints), max_size=4), st.booleans()),
    ).map(msgspec.msgpack.encode)


def _damaged(payload: bytes, cut: int, flip: int) -> bytes:
    if not payload:
        return payload
    b = bytearray(payload[: max(0, len(payload) - cut)])
    if b:
        b[flip % len(b)] ^= 0xFF
    return bytes(b)


payloads = st.one_of(
    st.binary(max_size=200),
    _random_map(),
    _hostile_request(),
    st.builds(_damaged, _hostile_request(), st.integers(0, 8), st.integers(0, 1000)),
)

frames = payloads.map(lambda p: HEADER.pack(len(p)) + p)


class RawConnection:
    """A hand-driven connection: send any bytes, then sync on a Ping to drain the replies."""

    def __init__(self, sock_path: str, timeout_s: float = 10.0):
        import socket

        from moed.protocol.framing import encode

        self._socket_mod, self._encode = socket, encode
        self.path, self.timeout_s = sock_path, timeout_s
        self.reconnects = 0
        self._connect()

    def _connect(self) -> None:
        s = self._socket_mod.socket(self._socket_mod.AF_UNIX, self._socket_mod.SOCK_STREAM)
        s.settimeout(self.timeout_s)
        s.connect(self.path)
        from moed.protocol.framing import FrameReader, reply_decoder

        self._got: list = []  # what FrameReader.feed completed, not yet taken by _next
        self.sock, self.frames = s, FrameReader(reply_decoder)
        s.sendall(self._encode(m.Hello(m.PROTOCOL_VERSION, "fuzzer")))
        assert isinstance(self._next(), m.HelloReply)

    def _next(self):
        import os

        while not self._got:
            data, fds, _, _ = self._socket_mod.recv_fds(self.sock, 1 << 16, 16)
            for fd in fds:
                os.close(fd)
            if not data:
                return None
            self._got = self.frames.feed(data)
        return self._got.pop(0)

    def exchange(self, frames: list[bytes]) -> list:
        """Send `frames` then a Ping; the replies before the Pong (reconnects if the daemon hung up)."""
        try:
            self.sock.sendall(b"".join(frames) + self._encode(m.Ping()))
            replies: list = []
            while True:
                r = self._next()
                if r is None:
                    raise ConnectionError("closed")
                if isinstance(r, m.Pong):
                    return replies
                replies.append(r)
        except (ConnectionError, OSError):
            self.sock.close()
            self.reconnects += 1
            self._connect()
            return []

    def close(self) -> None:
        self.sock.close()
