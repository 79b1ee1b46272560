"""Whether the engine prefetches on its next decode step: a precision floor, then a paired A/B test.

What this module owns: the choice, for each single-token (decode) step, between
prefetch on (predict and issue), off (neither) and shadow (predict, score the
prediction, issue nothing), from two engine-local signals: the precision of its
own prefetches and its measured step times. Pure: no clock, no I/O (the caller
passes the seconds and the counts).

The rule.
1. Precision floor. The engine keeps a running precision of its prefetches
   (experts named for a layer that the layer then routed, over all named; an
   exponential mean over the steps that named any). Below `precision_floor`
   (0.65) prefetch stays off: too much of what it would read is wrong, and wrong
   prefetches evict slots of the shared cache that would have hit. That damage lasts beyond the step (it is
   the cache's contents), so a step-by-step A/B cannot see it, both arms share
   the polluted cache: measured in the 2.2 GB cap at recall 0.6, the steps a
   run ran with prefetch off were 17% slower than those of a run that never
   prefetched, while the A/B saw the two arms within 2%; with gate2 at recall
   0.86 (one- and two-ahead sets together: precision ~0.75) the A/B chose on
   and the run was 6% slower than off. Precision, not recall, because it counts
   what is read: gate2 and wider rows name more than they hit. While below the
   floor, probes are shadow probes: they predict and name but send nothing, so
   the precision is re-measured without reading a byte. A shadow probe is
   `shadow_probe` (1) shadow step, not a timed pairing: nothing is timed below
   the floor, and one step names k experts for every layer. So is a probe while
   no precision is known (the steps named nothing the cache lacked, as right
   after a prompt that read the predicted experts in): nothing is read on a
   guess. Each shadow step stops at every router input in Python (about 40 ms of
   a 190 ms token on the Qwen3-30B geometry in its cap, where random weights keep
   the precision near 0.46): the 16 shadow and 2 sent steps the old schedule ran
   in a 64-token decode (unknown precision counted as good) made it 0.94x prefetch
   off; 4 shadow steps (2 cold, then one a probe) cost about 1.5% (bench/RESULTS.md,
   issue 49).
2. Paired A/B. At or above the floor the engine alternates between a probe and
   a stint. A probe is `probe` decode steps that alternate on, off, on, off, ...;
   its verdict is the log of the ratio of the two arms' median step times. A
   stint runs the arm that the mean verdict of the last `memory` probes favours
   (on when it is not slower) for `stint` steps; while the same arm keeps winning
   the stint doubles, up to `stint_max`, and it drops back to `stint` when the
   winner changes. Alternating step by step pairs the arms: both see the same
   cache, context length and load on the box, which a window-by-window
   comparison does not (the first window, on a cold cache, was measured 30%
   slower than the next whatever its arm). Medians, because a preempted step is
   an outlier, not a trend; several probes, because eight steps of each arm
   differ by their tokens' routes alone by ~10%.
The first `skip` decode steps (cold cache, first-touch costs) are not timed; the
first `skip_shadow` (2) of them are shadow steps that measure the precision before
anything is sent (running them on, a recall-0.6 engine at a 25% budget read
enough wrong experts during those steps to stay 3-4% behind an engine that never
prefetched), and the rest run off. The precision is the plain ratio of what was
named until `precision_min_named` (512) experts were, then an exponential mean: the
few experts the first steps after a prompt name read high (most predicted experts
are resident), and a probe that began on that figure ran 16 steps of shadow and sent
steps before the mean came down (issue 49). A timed probe whose precision falls
below the floor ends at once, off. An arm kept on whose precision falls below
the floor turns off at once.

Why measure instead of modelling the drive: prefetch pays when the reads it moves
off the critical path (at most the compute they overlap) outweigh what it adds:
wasted reads on a drive that is already the limit, and slots it evicts that would
have hit. Both depend on the drive, the budget, the other tenants and how good the
predictions are; the engine sees none of these directly, but its step time and
its precision see all of them. Cost: the losing arm runs half of each probe, a share
of probe / 2 / (probe + stint) of the steps: 1/5 while the stint is 32 steps, 1/18
once it is 128.

Prompt batches have their own precision (a batch names the union of its tokens'
predictions, so it hits far more often than a decode step: the two do not mix).
The first batch is a trial: it sends, and scores as it goes; once it has named
`trial_min_named` experts, a precision below `trial_floor` (0.5: half of it
wasted) turns the rest of it into a shadow (it names and scores, reads nothing
more), so a model whose predictions are bad wastes a few hundred reads once. The
trial's bar is lower than the floor because a network's first layers predict
worse than its later ones: on the Qwen3-30B geometry the first 170 named were
0.76 right and the whole batch 0.86, so a cut at the floor stopped a batch that
paid. After it, batches run on at or above
the floor; below it they run off, with every `batch_probe_every`-th one a shadow.
Why: a prompt in a cap is a read problem, so a wrong prefetch costs the drive time
the prompt waits on (Qwen3-30B geometry, 25 tokens in a 6 GiB cap: 13% more bytes,
prefill 0.83x prefetch off, measured while numpy's BLAS still spun beside ggml),
while a right one moves reads under the compute of the layer before. A first
batch that only shadowed cost a one-batch prompt 3% and gained nothing; sent, the
same batch (precision 0.86-0.93) ran 1.16-1.26x prefetch off (bench/RESULTS.md).

Invariants: `begin` and `end` alternate; prompt batches never touch the decode
schedule, its timings or its precision.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

ON, OFF, SHADOW = "on", "off", "shadow"


@dataclass
class PrefetchGovernor:
    probe: int = 16
    stint: int = 32
    stint_max: int = 128
    skip: int = 8
    skip_shadow: int = 2  # of the skip steps, how many shadow ones measure the precision first
    shadow_probe: int = 1  # steps of a probe below the floor or without a precision (shadow, not timed)
    memory: int = 4
    precision_floor: float = 0.65
    precision_alpha: float = 0.1  # weight of the newest step in the running precision
    precision_min_named: int = 512  # until this many were named, the precision is their plain ratio
    mode: str = ON
    precision: float | None = None
    batch_precision: float | None = None  # the same, over prompt batches' prefetches
    batch_probe_every: int = 8  # below the floor, every 8th prompt batch is a shadow
    trial_min_named: int = 256  # what a trial batch names before its precision may cut it
    trial_floor: float = 0.5  # below this a trial batch stops sending
    _trial: bool = False  # the batch under way is the trial (sent before any batch precision)
    _batches: int = 0
    steps: dict = field(default_factory=lambda: {ON: 0, OFF: 0, SHADOW: 0})
    probes: int = 0
    last_median_s: dict = field(default_factory=lambda: {ON: None, OFF: None})
    verdicts: list = field(default_factory=list)  # log(median on / median off) per timed probe
    _step: int = 0
    _phase_left: int = 0
    _probing: bool = False
    _shadow_probing: bool = False  # the probe under way started below the floor
    _stint_now: int = 0
    _winner: str = ON  # the arm the last stint ran
    _times: dict = field(default_factory=lambda: {ON: [], OFF: []})
    _counted: bool = False
    _cold: list = field(default_factory=lambda: [0, 0])  # used, named over the cold steps

    def begin(self, decode_step: bool) -> str:
        """Start a step; returns ON, OFF or SHADOW."""
        self._counted = decode_step
        self._trial = False
        if not decode_step:
            self._batches += 1
            if self.batch_precision is None:
                self._trial = True  # sent, and cut to a shadow by `cut` if it proves wrong
                return ON
            if self.batch_precision >= self.precision_floor:
                return ON
            # Below the floor: off, and a shadow batch now and then to see whether it rose
            # (a shadow batch stops at every router input: 0.78x a plain prompt, measured).
            return SHADOW if self._batches % self.batch_probe_every == 0 else OFF
        self._step += 1
        if self._step <= self.skip:
            self.mode = SHADOW if self._step <= self.skip_shadow else OFF
        else:
            fell = self._probing and not self._shadow_probing and not self._above_floor()
            if self._phase_left == 0 or fell or (self.mode == ON and not self._probing and self._below_floor()):
                self._next_phase()  # a probe whose precision fell below the floor ends at once, off
            if self._shadow_probing:
                self.mode = SHADOW
            elif self._probing:  # a timed probe, at or above the floor (`fell` ends it otherwise)
                self.mode = ON if self._phase_left % 2 == 0 else OFF  # alternate (probe is even)
            self._phase_left -= 1
        self.steps[self.mode] += 1
        return self.mode

    def scored(self, used: int, named: int) -> None:
        """Of the `named` experts a step named for prefetch (sent or shadow), its layers routed `used`."""
        if not named:
            return
        p = used / named
        if not self._counted:  # a prompt batch
            b = self.batch_precision
            self.batch_precision = p if b is None else 0.5 * p + 0.5 * b  # few batches: weigh them alike
            return
        if self._step <= self.skip or self._cold[1] < self.precision_min_named:
            # Cold steps, and until enough was named: the plain ratio over all of them. The few
            # experts the first steps after a prompt name (most are resident) read high, and an
            # exponential mean would carry that into several wasted steps sent.
            self._cold[0] += used
            self._cold[1] += named
            self.precision = self._cold[0] / self._cold[1]
            return
        a = self.precision_alpha
        self.precision = p if self.precision is None else a * p + (1 - a) * self.precision

    def cut(self, used: int, named: int) -> bool:
        """Mid-step, of what it named so far the step's layers routed `used` of `named`:
        True when the rest of a trial batch must only shadow (its precision is below
        `trial_floor` once it has named `trial_min_named`). Only ever True once a step; other steps never."""
        if self._trial and named >= self.trial_min_named and used < self.trial_floor * named:
            self._trial = False
            return True
        return False

    def end(self, seconds: float) -> None:
        """The step started by the last `begin` took `seconds`."""
        if self._counted and self._probing and self._step > self.skip and self.mode in self._times:
            self._times[self.mode].append(seconds)

    def _below_floor(self) -> bool:
        return self.precision is not None and self.precision < self.precision_floor

    def _above_floor(self) -> bool:
        return self.precision is not None and self.precision >= self.precision_floor

    def _next_phase(self) -> None:
        if self._probing:
            self._run_winner()
        else:
            self._times = {ON: [], OFF: []}
            # Below the floor, or no precision yet (its steps named nothing the cache lacked:
            # nothing to read ahead): shadow steps measure it; nothing is read on a guess.
            self._shadow_probing = not self._above_floor()
            length = self.shadow_probe if self._shadow_probing else self.probe + self.probe % 2
            self._probing, self._phase_left = True, length

    def _run_winner(self) -> None:
        self.probes += 1
        if not self._above_floor() or not self._times[ON]:
            winner = OFF  # a shadow probe, or the precision fell: not timed
        else:
            on, off = (statistics.median(self._times[a]) for a in (ON, OFF))
            self.last_median_s = {ON: on, OFF: off}
            self.verdicts = (self.verdicts + [math.log(on / off) if on > 0 and off > 0 else 0.0])[-self.memory :]
            winner = ON if sum(self.verdicts) <= 0 else OFF
        same = self.probes > 1 and winner == self._winner
        self._stint_now = min(self.stint_max, 2 * self._stint_now) if same else self.stint
        self.mode = self._winner = winner
        self._probing, self._shadow_probing, self._phase_left = False, False, self._stint_now

    def state(self) -> dict:
        mean = sum(self.verdicts) / len(self.verdicts) if self.verdicts else None
        return {
            "prefetch_steps_on": self.steps[ON],
            "prefetch_steps_off": self.steps[OFF],
            "prefetch_steps_shadow": self.steps[SHADOW],
            "prefetch_probes": self.probes,
            "step_s_on": self.last_median_s[ON],
            "step_s_off": self.last_median_s[OFF],
            "prefetch_on_vs_off": None if mean is None else math.exp(mean),
            "prefetch_precision": self.precision,
            "prefetch_batch_precision": self.batch_precision,
        }
