"""Length-prefixed frames: a 4-byte little-endian payload length, then MessagePack.

Invariant: `FrameReader.feed` never raises on garbage; it yields decoded
messages (or, with no decoder, raw payloads) or `BadFrame` instances, and after
an oversize length prefix it stops (the stream can no longer be resynchronised,
so the caller closes it).

Requests are small (the largest legitimate one, a pin of every expert of a big
model, is a few hundred KiB), so their frames are capped at
`MAX_REQUEST_FRAME_BYTES`; replies (stats of many models) may be larger.
"""

from __future__ import annotations

import struct

import msgspec

from .errors import BadFrame
from .messages import Reply, Request

HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = 16 << 20  # replies
MAX_REQUEST_FRAME_BYTES = 1 << 20  # requests: what one connection can make the daemon buffer

_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(message) -> bytearray:
    """One frame: header plus payload, encoded in place behind a reserved header."""
    frame = bytearray(4)
    _encoder.encode_into(message, frame, 4)
    HEADER.pack_into(frame, 0, len(frame) - 4)
    return frame


class FrameReader:
    """Incremental frame splitter and decoder for a byte stream."""

    __slots__ = ("_buf", "_decoder", "_max", "broken")

    def __init__(
        self, decoder: msgspec.msgpack.Decoder | None = request_decoder, max_frame_bytes: int = MAX_FRAME_BYTES
    ):
        self._buf = bytearray()
        self._decoder = decoder
        self._max = max_frame_bytes
        self.broken = False

    @property
    def buffered_bytes(self) -> int:
        """Bytes of an incomplete frame held until the rest arrives."""
        return len(self._buf)

    def feed(self, data: bytes) -> list:
        """Messages (or BadFrame errors) completed by `data`, in order."""
        if self.broken:
            return []
        buf = self._buf
        if not buf and 4 <= len(data) <= 4 + self._max and len(data) == 4 + HEADER.unpack_from(data)[0]:
            # The common case on a request/reply socket: exactly one whole frame.
            return [self._decode(data[4:] if self._decoder is None else memoryview(data)[4:])]
        buf += data
        out = []
        pos = 0
        while len(buf) - pos >= 4:
            (n,) = HEADER.unpack_from(buf, pos)
            if n > self._max:
                out.append(BadFrame(f"frame of {n} bytes exceeds the {self._max}-byte limit"))
                self.broken = True
                break
            if len(buf) - pos - 4 < n:
                break
            payload = bytes(buf[pos + 4 : pos + 4 + n])
            pos += 4 + n
            out.append(self._decode(payload))
        del buf[:pos]
        return out

    def _decode(self, payload):
        if self._decoder is None:
            return payload
        return decode(self._decoder, payload)


def decode(decoder: msgspec.msgpack.Decoder, payload):
    """One payload as a message, or a BadFrame error (returned, never raised)."""
    try:
        return decoder.decode(payload)
    # RecursionError: msgpack nested deeper than msgspec will follow
    # (a few kilobytes of 0x91 bytes do it); it is bad input like the rest.
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        return BadFrame(str(exc))
