"""Whether the engine prefetches on its next decode step: a paired A/B test on its own step times.

What this module owns: the choice between prefetch on and off for single-token
(decode) steps, made from nothing but the engine's measured step times. Pure:
no clock, no I/O (the caller passes the seconds).

The rule. The engine alternates between a probe and a hold. A probe is
`probe` decode steps that alternate on, off, on, off, ...; its verdict is the
log of the ratio of the two arms' median step times. A hold runs the arm that
the mean verdict of the last `memory` probes favours (on when it is not
slower) for `hold` steps; while the same arm keeps winning the hold doubles, up
to `hold_max`, and it drops back to `hold` when the winner changes. The first
`skip` decode steps (a cold cache, first-touch costs) run with prefetch on and
are not measured. Alternating step by step pairs the arms: both see the same
cache, the same context length and the same load on the box, which a
window-by-window comparison does not (the first window, on a cold cache, was
measured 30% slower than the next whatever its arm). Medians, because a step
that another process preempted is an outlier, not a trend; several probes,
because eight steps of each arm differ by their tokens' routes alone by ~10%.

Why measure instead of modelling the drive: prefetch pays when the reads it moves
off the critical path (at most the compute they overlap) outweigh what it adds:
wasted reads on a drive that is already the limit, and slots it evicts that would
have hit. Both sides depend on the drive, the budget, the other tenants and how
good the predictions are; the engine sees none of these directly, but its step
time sees all of them. Cost: the losing arm runs half of each probe, a share of
probe / 2 / (probe + hold) of the steps: 1/5 while the hold is 32 steps, 1/18 once
it is 128, so when prefetch makes a step X slower the rule costs about X / 18 in
a steady state, and when it makes a step faster it gives up that share of the gain.

Invariants: `begin` and `end` alternate; steps that are not decode steps (prompt
batches) do not touch the schedule and always run with prefetch on.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass
class PrefetchGovernor:
    probe: int = 16
    hold: int = 32
    hold_max: int = 128
    skip: int = 8
    memory: int = 4
    arm: bool = True
    steps_on: int = 0
    steps_off: int = 0
    probes: int = 0
    last_median_s: dict = field(default_factory=lambda: {True: None, False: None})
    verdicts: list = field(default_factory=list)   # log(median on / median off) per probe, newest last
    _step: int = 0                  # decode steps begun
    _phase_left: int = 0
    _probing: bool = False
    _hold_now: int = 0
    _held: bool = True              # the arm of the last hold
    _times: dict = field(default_factory=lambda: {True: [], False: []})
    _counted: bool = False

    def begin(self, decode_step: bool) -> bool:
        """Start a step; True when it should prefetch."""
        self._counted = decode_step
        if not decode_step:
            return True
        self._step += 1
        if self._step <= self.skip:
            self.arm = True
        else:
            if self._phase_left == 0:
                self._next_phase()
            if self._probing:
                self.arm = self._phase_left % 2 == 0       # on, off, on, off, ... (probe is even)
            self._phase_left -= 1
        if self.arm:
            self.steps_on += 1
        else:
            self.steps_off += 1
        return self.arm

    def end(self, seconds: float) -> None:
        """The step started by the last `begin` took `seconds`."""
        if self._counted and self._probing and self._step > self.skip:
            self._times[self.arm].append(seconds)

    def _next_phase(self) -> None:
        if self._probing:
            self._hold_winner()
        else:
            self._times = {True: [], False: []}
            self._probing, self._phase_left = True, self.probe + self.probe % 2

    def _hold_winner(self) -> None:
        on, off = (statistics.median(self._times[a]) for a in (True, False))
        self.last_median_s = {True: on, False: off}
        self.probes += 1
        self.verdicts = (self.verdicts + [math.log(on / off) if on > 0 and off > 0 else 0.0])[-self.memory:]
        winner = sum(self.verdicts) <= 0
        same = self.probes > 1 and winner == self._held
        self._hold_now = min(self.hold_max, 2 * self._hold_now) if same else self.hold
        self.arm = self._held = winner
        self._probing, self._phase_left = False, self._hold_now

    def state(self) -> dict:
        mean = sum(self.verdicts) / len(self.verdicts) if self.verdicts else None
        return {"prefetch_steps_on": self.steps_on, "prefetch_steps_off": self.steps_off,
                "prefetch_probes": self.probes, "step_s_on": self.last_median_s[True],
                "step_s_off": self.last_median_s[False],
                "prefetch_on_vs_off": None if mean is None else math.exp(mean)}
