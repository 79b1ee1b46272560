"""Experts whose reads failed, kept out of the drive's way for a while.

What this module owns: the marks on experts whose read failed after its retries
(`ReaderPool` retries a chunk `read_retries` times with a short backoff before
failing it). A marked expert's acquire, prefetch or pin fails at once with the
same error, for `quarantine_s`, instead of sending another read at a range that
has just failed: a bad sector answers every read the same way, and a drive that
retries internally can take seconds per failing read (docs/design.md, "When the
drive misbehaves"). The mark ends by itself (a transient fault heals), when the
operator clears it (`moectl clear-errors`), or with the model (a file that
changed is a new model, with no marks).

Pure: no I/O, no clock of its own (the caller passes `now`, monotonic seconds).
The key is whatever names one expert of one model (core uses `ExpertKey`); the
model's id is its `model_id` attribute, so `clear(model_id)` can clear one model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Mark:
    until_s: float  # monotonic time the mark ends
    message: str  # what the failed read said (the error the acquires get)
    failures: int = 1
    detail: dict | None = (
        None  # the error's facts (which expert, which errno), given back with it  # failed reads (each after its retries) while marked or just before
    )


class Quarantine:
    def __init__(self, quarantine_s: float):
        self.quarantine_s = quarantine_s
        self._marks: dict = {}

    def __len__(self) -> int:
        return len(self._marks)

    def mark(self, key, message: str, now: float, detail: dict | None = None) -> None:
        """`key`'s read failed: refuse it for `quarantine_s` from now (0: never marked)."""
        if self.quarantine_s <= 0:
            return
        old = self._marks.get(key)
        self._marks[key] = Mark(now + self.quarantine_s, message, old.failures + 1 if old else 1, detail)

    def detail(self, key) -> dict:
        mark = self._marks.get(key)
        return dict(mark.detail or {}) if mark is not None else {}

    def check(self, key, now: float) -> str | None:
        """The error message if `key` is marked now, else None (and an ended mark goes)."""
        mark = self._marks.get(key)
        if mark is None:
            return None
        if now >= mark.until_s:
            del self._marks[key]
            return None
        left = mark.until_s - now
        return f"{mark.message} (quarantined for {left:.0f}s more; `moectl clear-errors` reads it again now)"

    def clear(self, model_id: int | None = None) -> int:
        """Remove the marks of one model (or all); how many were removed."""
        gone = [k for k in self._marks if model_id is None or k.model_id == model_id]
        for k in gone:
            del self._marks[k]
        return len(gone)

    def expire(self, now: float) -> None:
        for k in [k for k, mark in self._marks.items() if now >= mark.until_s]:
            del self._marks[k]

    def count(self, model_id: int | None = None) -> int:
        return sum(1 for k in self._marks if model_id is None or k.model_id == model_id)

    def entries(self, model_id: int) -> list:
        """The marked keys of one model (for stats)."""
        return [k for k in self._marks if k.model_id == model_id]


__all__ = ["Mark", "Quarantine"]
