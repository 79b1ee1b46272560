"""Verify mode: every expert read is hashed and compared with its first read.

With `verify = true`, a reader thread hashes the bytes it just read into a
slot (xxh3-64 over every part, in part order) before the slot may become
READY. The first read of an expert records its hash; every later read of the
same expert (after an eviction) must match it, or the read fails with
VerifyMismatch: the acquire fails loudly, the slot is dropped and nothing
is served. Catches a file rewritten in place under an open model, a drive
returning bad data, and any bug that would put the wrong bytes in a slot.

Keyed by ExpertKey, whose model id is tied to the file's identity (device,
inode, size, mtime, ctime at open), so a replaced file starts with fresh
hashes, and a retired model's hashes are forgotten. A write through the
filesystem changes that identity and is caught before any hash (ModelStale);
verify mode is for what the identity cannot see: a drive returning bad data,
a write below the filesystem, a bug that put the wrong bytes in a slot.
"""

from __future__ import annotations

import logging

import xxhash

from moed import libc
from moed.protocol import errors

log = logging.getLogger("moed.verify")


def digest(pieces) -> int:
    """xxh3-64 of the bytes a read job put in place: [(file, offset, length, dest_addr)]."""
    h = xxhash.xxh3_64()
    for _, _, length, dest in pieces:
        h.update(libc.buffer_at(dest, length))
    return h.intdigest()


class Verifier:
    def __init__(self):
        self.first: dict = {}  # ExpertKey -> digest of its first read
        self.verified = 0  # later reads that matched
        self.mismatches = 0

    def check(self, key, value: int, where: str) -> errors.MoedError | None:
        """None if the read may be served; the error to fail it with otherwise."""
        first = self.first.get(key)
        if first is None:
            self.first[key] = value
            return None
        if first == value:
            self.verified += 1
            return None
        self.mismatches += 1
        log.error("VERIFY MISMATCH: %s read %016x, first read was %016x; the read is refused", where, value, first)
        return errors.VerifyMismatch(
            f"{where}: bytes read now (xxh3 {value:016x}) differ from the "
            f"first read ({first:016x}); the file changed or the drive returned bad data"
        )

    def forget(self, model_id: int) -> None:
        """A retired model's hashes go with it (ids are never reused)."""
        self.first = {k: v for k, v in self.first.items() if k.model_id != model_id}

    def stats(self) -> dict:
        return {
            "verify": True,
            "verified_reads": self.verified,
            "verify_mismatches": self.mismatches,
            "verify_hashed_experts": len(self.first),
        }
