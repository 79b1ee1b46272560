"""What the daemon does when the drive misbehaves: failed reads, a slow drive, a stuck read.

What this module owns (core calls it; it never touches the store):
- turning a reader `ReadFailure` into the `ReadError` an acquire gets, naming the
  model, layer, expert, part and errno, and counting it (overall and per model);
- the quarantine of experts whose read failed after its retries
  (moed.daemon.quarantine): their acquires fail at once;
- whether read-ahead should hold back now (`prefetch_backoff` and
  moed.daemon.drivehealth), and the count of prefetches held back or dropped;
- the watch over reads in flight: one running longer than `read_stall_warn_s`
  is logged once, shown in stats, and a spare reader thread takes its place, so
  the rest of the pool keeps serving.

Invariant kept with core: nothing of a failed read is ever published. Core marks
the slot failed (the store puts it back on the free list) before the waiters
learn of the error, and a slot reaches the residency table only through
`Store.loaded`, which a failed read never calls.
"""

from __future__ import annotations

import logging
import time

from moed.protocol import errors

from .drivehealth import DriveHealth
from .quarantine import Quarantine
from .reader import ReaderPool, ReadFailure

log = logging.getLogger("moed.faults")


class DriveFaults:
    def __init__(self, config, reader: ReaderPool):
        self.reader = reader
        self.health: DriveHealth = reader.health
        self.quarantine = Quarantine(config.read_quarantine_s)
        self.prefetch_backoff = config.prefetch_backoff
        self.stall_warn_s = config.read_stall_warn_s
        self.prefetch_dropped = 0  # prefetched experts held back or dropped while the drive was behind
        self.quarantine_refusals = 0  # acquires and prefetches refused at once by a mark
        self.stalled_reads = 0  # reads that ran past read_stall_warn_s (each counted once)
        self._warned: set[tuple] = set()  # (id(job), offset) of every stuck read logged (one each)

    # ---- failed reads -----------------------------------------------------

    def failed(self, key, what: str, err: BaseException, part_names: list[str], path: str = "") -> errors.MoedError:
        """The error a failed read of `key` raises in its waiters; quarantines the expert."""
        if isinstance(err, errors.MoedError):
            return err  # ModelStale, VerifyMismatch: already what happened
        detail: dict = {"model": path, "model_id": key.model_id, "layer": key.layer, "expert": key.expert}
        part = ""
        if isinstance(err, ReadFailure):
            detail["errno"] = err.errno
            if 0 <= err.piece < len(part_names):
                detail["part"] = part_names[err.piece]
                part = f" part {detail['part']}"
        message = f"reading {what}{part} failed: {err}"
        if isinstance(err, ReadFailure) and err.errno:  # end of file is a changed file, not a bad extent
            self.quarantine.mark(key, message, time.monotonic(), detail)
        return errors.ReadError(message, **detail)

    def refuse_marked(self, wants) -> None:
        """ReadError at once if any wanted expert is quarantined (no read is sent)."""
        if not self.quarantine:  # the hit path: nothing marked, nothing to look up
            return
        now = time.monotonic()
        for want in wants:
            message = self.quarantine.check(want.key, now)
            if message is not None:
                self.quarantine_refusals += 1
                raise errors.ReadError(message, **self.quarantine.detail(want.key))

    def unmarked(self, wants) -> list:
        """The wants a prefetch may read: quarantined experts are skipped."""
        if not self.quarantine:
            return wants
        now = time.monotonic()
        return [w for w in wants if self.quarantine.check(w.key, now) is None]

    # ---- a slow drive ----------------------------------------------------------

    def behind(self) -> bool:
        """Whether read-ahead should hold back now: the drive's latency or queue says so."""
        if not self.prefetch_backoff:
            return False
        now = time.monotonic()
        return self.health.behind(now, self.reader.oldest_demand_wait_s(now))

    # ---- reads that do not return -------------------------------------------------

    def watch(self) -> None:
        """Log each read running past `read_stall_warn_s` once, and give the pool a spare
        reader for each (a job's other chunks may be stuck too: every stuck read counts)."""
        if self.stall_warn_s <= 0:
            return
        for age_s, job, path, offset, length in self.reader.in_progress_jobs(time.monotonic()):
            if age_s < self.stall_warn_s or (id(job), offset) in self._warned:
                continue
            self._warned.add((id(job), offset))
            self.stalled_reads += 1
            spare = self.reader.add_spare()
            log.warning(
                "a read of %s (%d bytes at offset %d of %s) has not returned for %.1fs; the drive may be stalled%s",
                job.what,
                length,
                offset,
                path,
                age_s,
                ", a spare reader thread serves meanwhile" if spare else "",
            )
        if len(self._warned) > 4096:  # ids of finished jobs may be reused; keep only the running ones
            running = {(id(job), off) for _, job, _, off, _ in self.reader.in_progress_jobs(time.monotonic())}
            self._warned &= running

    def stuck_now(self) -> int:
        if self.stall_warn_s <= 0:
            return 0
        now = time.monotonic()
        return sum(1 for row in self.reader.in_progress_jobs(now) if row[0] >= self.stall_warn_s)

    # ---- stats ------------------------------------------------------------------

    def stats(self) -> dict:
        self.quarantine.expire(time.monotonic())
        self.behind()  # judged now, so `drive_behind` is the state at this snapshot
        return {
            "read_retries": self.reader.retried,
            "quarantined_experts": self.quarantine.count(),
            "quarantine_refusals": self.quarantine_refusals,
            "prefetch_dropped": self.prefetch_dropped,
            "prefetch_backoff": self.prefetch_backoff,
            "stalled_reads": self.stalled_reads,
            "stuck_reads": self.stuck_now(),
            **self.health.stats(),
        }


__all__ = ["DriveFaults"]
