"""Length-prefixed frames: a 4-byte little-endian payload length, then MessagePack.

Invariant: `FrameReader.feed` never raises on garbage; it yields decoded
messages or `BadFrame` instances, and after an oversize length prefix it stops
(the stream can no longer be resynchronised, so the caller closes it).
"""

from __future__ import annotations

import struct

import msgspec

from .errors import BadFrame
from .messages import Reply, Request

HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = 16 << 20

_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(message) -> bytes:
    """One frame: header plus payload."""
    payload = _encoder.encode(message)
    return HEADER.pack(len(payload)) + payload


class FrameReader:
    """Incremental frame splitter and decoder for a byte stream."""

    __slots__ = ("_buf", "_decoder", "broken")

    def __init__(self, decoder: msgspec.msgpack.Decoder = request_decoder):
        self._buf = bytearray()
        self._decoder = decoder
        self.broken = False

    def feed(self, data: bytes) -> list:
        """Messages (or BadFrame errors) completed by `data`, in order."""
        if self.broken:
            return []
        buf = self._buf
        buf += data
        out = []
        pos = 0
        while len(buf) - pos >= 4:
            (n,) = HEADER.unpack_from(buf, pos)
            if n > MAX_FRAME_BYTES:
                out.append(BadFrame(f"frame of {n} bytes exceeds the {MAX_FRAME_BYTES}-byte limit"))
                self.broken = True
                break
            if len(buf) - pos - 4 < n:
                break
            payload = bytes(buf[pos + 4 : pos + 4 + n])
            pos += 4 + n
            try:
                out.append(self._decoder.decode(payload))
            # RecursionError: msgpack nested deeper than msgspec will follow
            # (a few kilobytes of 0x91 bytes do it); it is bad input like the rest.
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
                out.append(BadFrame(str(exc)))
        del buf[:pos]
        return out
