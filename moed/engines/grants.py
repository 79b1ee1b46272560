"""Every way Python lets a layer's grant go: the one place its release is decided.

What this module owns: the release routes of Python's half of the layer cycle
(moed.engines.cycle, moed.engines.steps) and of the binding (moed.engines.binding).
What a layer holds has one owner, the layer holds (moed.engines.holds): at most one of
their own hit grant, a Python grant and the pin hold. A grant Python acquired is handed
to them (`LayerHolds.hold`) and handed back at the next routed stop (the route
function's `grant`), after the decode (`LayerHolds.end`) or at their close
(`LayerHolds.close`). It then leaves by exactly one of these routes:

1. `acquire`: hidden, then released inside the next acquire's round trip (the
   source's `hit` or `acquire` with `release=`), or quietly when that acquire fails.
2. `let_go`: hidden, then released alone: at a stop the holds hit (nothing acquired
   to piggyback on), and after the decode.
3. `hand_back`: not released: a stop that acquires nothing gives it back to the holds,
   to go by route 1 or 2 later.
4. `let_go_quietly`: on an error at a stop (or at a stop after the decode failed):
   hidden, then released with the release's own error logged.
5. `release_quietly`: released alone, not hidden: what the holds give back at their
   close (after the model is freed, or before every expert address is reset at a
   rebind), and route 1's failed acquire (hidden already).
6. `release`: warm's leases, released at once: their slots were mapped at a lane
   layer's addresses, which a released grant's layer keeps (relaxed mode).

The holds release their own hit grant in C (a hit's release of the one before, the
hit dropped when Python is called, the pin hold's release: moed/_evalcb.c).

Invariant: pages are hidden before their grant is released (routes 1, 2, 4): once the
daemon may reuse a slot, this process can no longer read it. Routes 5 and 6 release
only what nothing computes from.
"""

from __future__ import annotations

import logging

from moed.engines.binding import Bound
from moed.engines.holds import LayerHolds
from moed.engines.sources import ExpertSource, Grant

log = logging.getLogger("moed.engine")


class GrantRoutes:
    def __init__(self, source: ExpertSource, bound: Bound):
        """`bound`: each layer's placement, which hides a grant's experts."""
        self._source = source
        self._bound = bound

    def acquire(self, layer: int, experts: list[int], prev: Grant | None, try_hit: bool) -> Grant:
        """Route 1: `experts` of `layer`, `prev` (hidden first) released in the same step: the
        source's hit first when `try_hit` (the holds did not try one), else or on a miss its
        acquire."""
        if prev is not None:
            self._hide(prev)
        try:
            grant = self._source.hit(layer, experts, release=prev) if try_hit else None
            return grant if grant is not None else self._source.acquire(layer, experts, release=prev)
        except BaseException:
            if prev is not None:
                self.release_quietly(prev)
            raise

    def let_go(self, grant: Grant) -> None:
        """Route 2: hide `grant`, then release it (its layer's matmuls have run)."""
        self._hide(grant)
        self._source.release(grant)

    @staticmethod
    def hand_back(holds: LayerHolds, grant: Grant) -> None:
        """Route 3: `grant` back to the holds unreleased (this stop acquired nothing)."""
        holds.hold(grant, show=False)

    def let_go_quietly(self, grant: Grant) -> None:
        """Route 4: hide `grant`, then release it whatever the release says."""
        try:
            self._hide(grant)
        finally:
            self.release_quietly(grant)

    def release_quietly(self, grant: Grant) -> None:
        """Route 5: release `grant`, logging the release's error (the grant may already be
        gone with the failed acquire or the lost connection)."""
        try:
            self._source.release(grant)
        except Exception as exc:  # noqa: BLE001 - the grant may already be gone with the failed acquire
            log.debug("release after failed acquire: %s", exc)

    def release(self, grant: Grant) -> None:
        """Route 6: warm's lease, released at once."""
        self._source.release(grant)

    def _hide(self, grant: Grant) -> None:
        self._bound.placement(grant.layer).hide(grant)
