"""How Python lets a layer's grant go: the one release path of the streamer's parts.

What this module owns: the only function of the layer cycle (moed.engines.cycle), the
decode steps (moed.engines.steps) and the binding (moed.engines.binding) that releases
a grant, `GrantRoutes.swap`, and `Held`, the one grant Python holds during a routed
stop. What a layer holds has one owner at every instant, the layer holds
(moed.engines.holds): at most one of their own hit grant, a Python grant and the pin
hold. A Python grant moves between them and Python by handing it over, never by copy:

- the holds hand it to Python at the next routed stop (the stop function's `grant`),
  after the decode (`LayerHolds.end`) or at their close (`LayerHolds.close`);
- Python answers the stop function with the grant it holds then (`Held`: the one it
  was handed, or the one it acquired), and the holds own it from the moment the call
  returns: no window where it has no owner, and no release guarding an error (after
  an error the holds keep it and give it back after the decode);
- Python releases a grant only through `swap`: hidden, then released inside the next
  acquire's round trip when there is one (the source's `hit` or `acquire` with
  `release=`), else alone: at a hit, after a copying placement's `show`
  (`Placement.copies_grant`: its bytes are copies by then), after the decode, at the
  holds' close (not hidden: nothing computes from it, and quietly), and warm's leases.

So a grant is released by one of three functions: `swap` here, and in C the holds' own
`let_go` (their hit grant, a hit's release of the one before, the pin hold:
moed/engines/_layer_holds.c); nothing else in the streamer's parts calls a `release`.

Invariant: pages are hidden before their grant is released (but at the holds' close, when
nothing computes from them any more): once the daemon may reuse a slot, this process can
no longer read it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from moed.engines.binding import Bound
from moed.engines.sources import ExpertSource, Grant

log = logging.getLogger("moed.engine")


class Held:
    """The one grant Python holds during a routed stop (None: none), answered to the holds."""

    def __init__(self, grant: Grant | None = None):
        self.grant = grant

    def take(self) -> Grant | None:
        """The grant, no longer held here (for `swap`, which releases it)."""
        grant, self.grant = self.grant, None
        return grant


class GrantRoutes:
    def __init__(self, source: ExpertSource, bound: Bound):
        """`bound`: each layer's placement, which hides a grant's experts."""
        self._source = source
        self._bound = bound

    def swap(
        self,
        prev: Grant | None,
        layer: int = -1,
        experts: Sequence[int] = (),
        try_hit: bool = False,
        closing: bool = False,
    ) -> Grant | None:
        """THE release path: `prev` (None: none) hidden, then released, inside the acquire of
        `experts` of `layer` when there are any (one round trip; the source's hit first when
        `try_hit`, the holds having tried none), else alone. Returns what was acquired (None:
        nothing). When a step fails, `prev` is still released (once; whatever that says: it
        may have gone with a failed acquire) and the error raised. `closing`: what the holds
        give back at their close, which nothing computes from any more (the model is freed,
        or every expert address is reset next): released alone, not hidden (the model's
        mapping may be gone), a failure logged (nothing may stop the unwinding)."""
        tried = prev is None  # the release of `prev` was tried
        try:
            if prev is not None and not closing:
                self._bound.placement(prev.layer).hide(prev)
            if experts:
                src, tried = self._source, True
                grant = src.hit(layer, experts, release=prev) if try_hit else None
                return grant if grant is not None else src.acquire(layer, experts, release=prev)
            if prev is not None:
                tried = True
                self._source.release(prev)
            return None
        except BaseException as exc:
            if prev is not None and (not tried or experts):
                try:
                    self._source.release(prev)
                except Exception as again:  # noqa: BLE001 - it may be gone with the failed acquire
                    log.debug("release after %r: %s", exc, again)
            if closing and isinstance(exc, Exception):
                log.debug("release at close: %s", exc)
                return None
            raise
