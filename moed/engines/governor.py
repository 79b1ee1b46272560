"""Whether the engine prefetches on its next decode step: an A/B test on its own step times.

What this module owns: the choice between prefetch on and off for single-token
(decode) steps, made from nothing but the engine's measured step times. Pure:
no clock, no I/O (the caller passes the seconds).

The rule. Decode steps run in windows of `window` steps; every step of a window
runs one arm (on or off). Each arm keeps an exponentially weighted mean of its
windows' mean step time. The next window runs the arm whose mean is lower, except
that one window in `explore` runs the other arm, so that a change (the budget
filled up, another engine arrived, the predictions got worse) is noticed. Until
both arms have a measured window, they alternate, starting with on.

Why measure instead of modelling the drive: prefetch pays when the reads it moves
off the critical path (at most the compute they overlap) outweigh what it adds:
wasted reads on a drive that is already the limit, and slots it evicts that would
have hit. Both sides depend on the drive, the budget, the other tenants and how
good the predictions are; the engine sees none of these directly, but its step
time sees all of them. Cost: when prefetch makes a step X slower, the exploring
windows cost about X / explore (X = 20% -> ~2% at explore = 10); when it makes a
step faster, they cost that gain / explore.

Invariants: `begin` and `end` alternate; steps that are not decode steps (prompt
batches) do not touch the windows and always run with prefetch on.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PrefetchGovernor:
    window: int = 8
    explore: int = 10
    alpha: float = 0.5             # weight of the newest window in an arm's mean
    mean_s: dict = field(default_factory=lambda: {True: None, False: None})
    arm: bool = True
    windows: int = 0
    steps_on: int = 0
    steps_off: int = 0
    _left: int = 0
    _sum_s: float = 0.0
    _n: int = 0
    _counted: bool = False

    def begin(self, decode_step: bool) -> bool:
        """Start a step; True when it should prefetch."""
        self._counted = decode_step
        if not decode_step:
            return True
        if self._left == 0:
            self.arm = self._next_arm()
            self._left, self._sum_s, self._n = self.window, 0.0, 0
        if self.arm:
            self.steps_on += 1
        else:
            self.steps_off += 1
        return self.arm

    def end(self, seconds: float) -> None:
        """The step started by the last `begin` took `seconds`."""
        if not self._counted:
            return
        self._sum_s += seconds
        self._n += 1
        self._left -= 1
        if self._left == 0:
            mean = self._sum_s / self._n
            old = self.mean_s[self.arm]
            self.mean_s[self.arm] = mean if old is None else self.alpha * mean + (1 - self.alpha) * old
            self.windows += 1

    def _next_arm(self) -> bool:
        on, off = self.mean_s[True], self.mean_s[False]
        if on is None or off is None:
            return on is None                 # measure on first, then off
        best = on <= off
        if self.windows % self.explore == self.explore - 1:
            return not best
        return best

    def state(self) -> dict:
        return {"prefetch_steps_on": self.steps_on, "prefetch_steps_off": self.steps_off,
                "step_s_on": self.mean_s[True], "step_s_off": self.mean_s[False]}
