"""Whether the drive is behind: the signal that stops read-ahead from deepening a stall.

What this module owns: two views of the drive, fed by the reader threads, and the
one question core asks before it issues or keeps a prefetch, `behind(now,
oldest_demand_wait_s)`.

- Latency against the drive's own recent figures. Every chunk's service time
  (the `preadv`, retries excluded) is normalised by its size plus a per-read
  overhead (`OVERHEAD_BYTES`: a 4 KiB read is not 64x cheaper than a 256 KiB one)
  and folded, as its logarithm, into two moving averages: `recent` (the last ten
  or so reads) and `baseline` (the last several hundred). Averaging logarithms
  (a geometric mean) keeps one read that took 1,000x from moving either much:
  a drive is behind when most recent reads are slow, not when one was. The drive
  is behind once `recent` is `slow_factor` times `baseline`, and is no longer
  once it falls under `recover_factor` times (hysteresis, so the prefetch switch
  does not flap).
  While behind, the baseline learns ten times slower: a throttled or stalled
  drive must not teach it that slow is normal within seconds, yet a drive that
  stays slower for good becomes the new normal after some thousands of reads.
  Nothing is judged before `min_samples` reads.
- Its queue: demand reads that wait for a reader thread. When the oldest queued
  demand chunk has waited `queue_behind_s`, every reader is busy and demand is
  already late, so a prefetch could only take a reader from the next demand.

Thread-safe: `observe` runs on reader threads, `behind` on the event loop.
"""

from __future__ import annotations

import math
import threading

OVERHEAD_BYTES = 64 << 10  # a read's fixed cost, in bytes' worth of transfer (NVMe: ~20 us at 3 GB/s)


class DriveHealth:
    def __init__(
        self,
        slow_factor: float = 4.0,
        recover_factor: float = 2.0,
        queue_behind_s: float = 0.1,
        recent_alpha: float = 0.1,
        baseline_alpha: float = 0.005,
        min_samples: int = 32,
    ):
        self.slow_factor, self.recover_factor = slow_factor, recover_factor
        self.queue_behind_s = queue_behind_s
        self.recent_alpha, self.baseline_alpha = recent_alpha, baseline_alpha
        self.min_samples = min_samples
        self.samples = 0
        self.recent = 0.0  # log(seconds per byte), recent reads
        self.baseline = 0.0  # log(seconds per byte), the drive's own recent normal
        self.slow = False  # the latency view's state (with hysteresis)
        self.behind_since: float | None = None  # when behind() last turned true
        self.episodes = 0  # times the drive went behind
        self._lock = threading.Lock()

    def observe(self, seconds: float, nbytes: int) -> None:
        """One chunk read in `seconds` (reader thread)."""
        x = math.log(max(seconds, 1e-7) / (nbytes + OVERHEAD_BYTES))
        with self._lock:
            self.samples += 1
            if self.samples == 1:
                self.recent = self.baseline = x
                return
            self.recent += self.recent_alpha * (x - self.recent)
            learn = self.baseline_alpha / (10 if self.slow else 1)
            self.baseline += learn * (x - self.baseline)
            if self.samples < self.min_samples:
                return
            ratio = math.exp(self.recent - self.baseline)
            self.slow = ratio >= self.recover_factor if self.slow else ratio >= self.slow_factor

    def behind(self, now: float, oldest_demand_wait_s: float = 0.0) -> bool:
        """Whether to hold back read-ahead now (event loop)."""
        behind = self.slow or oldest_demand_wait_s >= self.queue_behind_s
        if behind and self.behind_since is None:
            self.behind_since = now
            self.episodes += 1
        elif not behind:
            self.behind_since = None
        return behind

    def stats(self) -> dict:
        with self._lock:
            ratio = math.exp(self.recent - self.baseline) if self.samples else 0.0
            return {
                "drive_behind": self.behind_since is not None,
                "drive_latency_ratio": round(ratio, 3),
                "drive_behind_episodes": self.episodes,
            }


__all__ = ["DriveHealth", "OVERHEAD_BYTES"]
