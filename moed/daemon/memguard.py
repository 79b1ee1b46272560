"""The memory guard: keep the box's available memory above `mem_floor_bytes`.

Owns the floor, the sampling task and the decision of how far the store may
grow (`Store.effective_budget_bytes`). It runs on the event loop: every
`mem_sample_s` it reads the memory available to this daemon and

- below the floor: lowers the store's limit by the deficit, evicts
  unreferenced slots down to it and gives their pages back to the kernel
  (`Store.shrink`, then the `settle` callback). Leased and pinned slots are never
  touched, so the limit never goes below what leases and pins hold: the store
  stops growing, and acquires reuse slots as leases are released;
- above floor + hysteresis: raises the limit by the headroom beyond that band,
  up to the configured budget, and wakes acquires waiting for room (the
  `room_changed` callback);
- in between: leaves the limit alone (the band keeps it from oscillating).

"Available" is MemAvailable from /proc/meminfo, or, when the daemon runs in
a memory cgroup with a limit (v1 or v2, any ancestor), the smaller of that and
the cgroup's headroom (limit - usage + inactive file pages): inside a
container the host's MemAvailable says nothing about the OOM killer.

Tenant floors do not hold against the guard: the box's other services come
first.

The default floor (`mem_floor_bytes` not given, or "auto"): 5% of the smaller of
the box's RAM (MemTotal) and the lowest limit of a memory cgroup the daemon is in,
at least 256 MiB (`auto_floor_bytes`). An explicit 0 turns the guard off. At start
(`size_memory`, moed.daemon.main) a RAM tier that could not fit in the cgroup's
limit above the floor is lowered to fit (`fit_budget`), with a warning.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass

import psutil

from moed.protocol.sizes import format_size

from .tasks import stop_task

log = logging.getLogger("moed.memguard")

MIN_HYSTERESIS_BYTES = 16 << 20
PAGE_BYTES = 4096
_NO_LIMIT = 1 << 60
AUTO_FLOOR_DIVISOR = 20  # the default floor is 5% of the memory the daemon can see ...
MIN_AUTO_FLOOR_BYTES = 256 << 20  # ... and never less than this


def hysteresis_for(floor_bytes: int, budget_bytes: int | None = None) -> int:
    """The band above the floor in which the guard neither gives back nor grows.

    A sixteenth of the floor, at least MIN_HYSTERESIS_BYTES, and never more than
    an eighth of the budget: a band wider than what the store could ever give
    back would keep a small store at zero on a box with a large floor.
    """
    band = max(MIN_HYSTERESIS_BYTES, floor_bytes // 16)
    if budget_bytes is not None:
        band = min(band, max(PAGE_BYTES, budget_bytes // 8))
    return band


def decide_limit(avail_bytes: int, floor_bytes: int, used_bytes: int, limit_bytes: int, budget_bytes: int) -> int:
    """The store's new growth limit for one sample (pure; the policy in one place)."""
    if floor_bytes <= 0:
        return budget_bytes
    if avail_bytes < floor_bytes:
        return max(0, min(limit_bytes, used_bytes) - (floor_bytes - avail_bytes))
    headroom = avail_bytes - floor_bytes - hysteresis_for(floor_bytes, budget_bytes)
    if headroom > 0 and limit_bytes < budget_bytes:
        return min(budget_bytes, limit_bytes + headroom)
    return limit_bytes


def auto_floor_bytes(ram_bytes: int, cgroup_limit_bytes: int | None) -> int:
    """The floor when none is given: 5% of the smaller of RAM and the cgroup's limit, at least 256 MiB.

    A twentieth keeps a big box's guard quiet until it is really short (1.2 GiB of 24),
    and the minimum leaves a small box or container room for a process to start.
    """
    seen = ram_bytes if cgroup_limit_bytes is None else min(ram_bytes, cgroup_limit_bytes)
    return max(MIN_AUTO_FLOOR_BYTES, seen // AUTO_FLOOR_DIVISOR)


def fit_budget(budget_bytes: int, pin_bytes: int, floor_bytes: int, cgroup_limit_bytes: int | None) -> int:
    """The RAM budget the tier may have in a cgroup: at most the limit less the floor and the pin budget.

    The guard would never let the store grow past that (it keeps the cgroup's headroom
    above the floor), so a larger budget only misleads: the stats, the mlock probe and
    the prefault would all count memory the daemon can never use. Raises ValueError
    when the floor and the pin budget leave no room at all.
    """
    if cgroup_limit_bytes is None:
        return budget_bytes
    room = cgroup_limit_bytes - floor_bytes - pin_bytes
    if room < PAGE_BYTES:
        raise ValueError(
            f"the memory cgroup's limit {format_size(cgroup_limit_bytes)} leaves no room for a RAM budget "
            f"above the memory floor {format_size(floor_bytes)} and the pin budget {format_size(pin_bytes)}: "
            "give a smaller --mem-floor (0 turns the guard off) or a larger limit"
        )
    return min(budget_bytes, room - room % PAGE_BYTES)


# ---- reading available memory ---------------------------------------------


@dataclass(frozen=True)
class CgroupMemory:
    """The files of one memory cgroup with a limit (v1 or v2)."""

    limit_path: str
    usage_path: str
    stat_path: str
    inactive_key: str

    def limit_bytes(self) -> int | None:
        """The limit, or None where there is none (or the file is gone)."""
        try:
            limit = _read_int(self.limit_path)
        except OSError:
            return None
        return None if limit is None or limit >= _NO_LIMIT else limit

    def headroom_bytes(self) -> int | None:
        try:
            limit = _read_int(self.limit_path)
            if limit is None or limit >= _NO_LIMIT:
                return None
            usage = _read_int(self.usage_path) or 0
            inactive = 0
            with open(self.stat_path) as f:
                for line in f:
                    k, _, v = line.partition(" ")
                    if k == self.inactive_key:
                        inactive = int(v)
                        break
        except OSError:
            return None
        return max(0, limit - usage + inactive)


def _read_int(path: str) -> int | None:
    with open(path) as f:
        text = f.read().strip()
    return None if text == "max" else int(text)


def find_cgroups(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> list[CgroupMemory]:
    """Every memory cgroup from ours up to the root that has a limit set."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            found += _walk(
                os.path.join(root, "memory"),
                path,
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
                "total_inactive_file",
            )
        elif controllers == "":
            for base in (root, os.path.join(root, "unified")):
                if os.path.exists(os.path.join(base, "cgroup.controllers")):
                    found += _walk(base, path, "memory.max", "memory.current", "inactive_file")
                    break
    return found


def _walk(base: str, path: str, limit: str, usage: str, inactive_key: str) -> list[CgroupMemory]:
    out = []
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        d = os.path.join(base, *parts[:depth])
        cg = CgroupMemory(os.path.join(d, limit), os.path.join(d, usage), os.path.join(d, "memory.stat"), inactive_key)
        if os.path.exists(cg.limit_path) and cg.headroom_bytes() is not None:
            out.append(cg)
    return out


class MemoryReader:
    """MemAvailable, bounded by the headroom of any limited memory cgroup we are in."""

    def __init__(self):
        self.cgroups = find_cgroups()

    def total_bytes(self) -> int:
        """MemTotal: the box's RAM."""
        return psutil.virtual_memory().total

    def cgroup_limit_bytes(self) -> int | None:
        """The lowest limit of the memory cgroups we are in, or None where none has one."""
        limits = [x for x in (cg.limit_bytes() for cg in self.cgroups) if x is not None]
        return min(limits, default=None)

    def auto_floor_bytes(self) -> int:
        return auto_floor_bytes(self.total_bytes(), self.cgroup_limit_bytes())

    def available_bytes(self) -> int:
        avail = psutil.virtual_memory().available
        for cg in self.cgroups:
            head = cg.headroom_bytes()
            if head is not None:
                avail = min(avail, head)
        return avail


# ---- the guard --------------------------------------------------------------


class MemGuard:
    def __init__(
        self,
        store,
        floor_bytes: int | None,
        sample_s: float,
        reader: MemoryReader | None = None,
        settle=lambda: None,
        room_changed=lambda: None,
        trim=lambda: 0,
    ):
        """`floor_bytes` None: the default floor (`auto_floor_bytes`); `settle` gives dropped slots'
        pages back; `room_changed` wakes acquires waiting for room; `trim` gives back pages made
        ahead of use (moed.daemon.prefault) and returns their bytes."""
        self.store = store
        self.settle = settle
        self.trim = trim
        self.room_changed = room_changed
        self.sample_s = sample_s
        self.reader = reader or MemoryReader()
        self.floor_bytes = self.reader.auto_floor_bytes() if floor_bytes is None else floor_bytes
        self.given_back_bytes = 0
        self.actions = 0
        self.last_available_bytes = 0
        self._task: asyncio.Task | None = None

    @property
    def active(self) -> bool:
        store = self.store
        return store.effective_budget_bytes < store.budget_bytes

    def why_held(self) -> str:
        """The truth about why the store may not grow to its budget now (for errors)."""
        store = self.store
        avail = self.last_available_bytes
        held = (
            f"the memory guard holds the store at {format_size(store.effective_budget_bytes)} "
            f"of its {format_size(store.budget_bytes)} budget"
        )
        if avail < self.floor_bytes:
            return f"{held}: MemAvailable {format_size(avail)} is below the floor {format_size(self.floor_bytes)}"
        band = hysteresis_for(self.floor_bytes, store.budget_bytes)
        return (
            f"{held}: MemAvailable {format_size(avail)} recovered above the floor "
            f"{format_size(self.floor_bytes)}, and the store grows back once it is more than "
            f"{format_size(band)} above it"
        )

    def available_bytes(self) -> int:
        self.last_available_bytes = self.reader.available_bytes()
        return self.last_available_bytes

    def set_floor(self, floor_bytes: int) -> None:
        if floor_bytes < 0:
            raise ValueError("the memory floor must not be negative")
        log.info("memory floor set to %s", format_size(floor_bytes))
        self.floor_bytes = floor_bytes
        self.step()

    def step(self) -> int:
        """Take one sample and act on it; returns the bytes given back."""
        store = self.store
        avail = self.available_bytes() if self.floor_bytes > 0 else 0
        old = store.effective_budget_bytes
        limit = decide_limit(avail, self.floor_bytes, store.used_bytes, old, store.budget_bytes)
        freed = 0
        if limit < old:
            freed = self.trim()  # pages no slot uses yet go first
            freed += store.shrink(limit)
            self.settle()
            # leases and pins may hold more than the target: then just stop growing
            limit = max(limit, store.used_bytes)
        store.set_effective_budget(limit)
        if freed or limit < old:
            self._gave_back(avail, freed, store)
        elif limit > old:
            self.room_changed()
            if limit == store.budget_bytes:
                log.info(
                    "memory guard: %s available again; the store may grow to its full budget %s",
                    format_size(avail),
                    format_size(limit),
                )
        return freed

    def _gave_back(self, avail: int, freed: int, store) -> None:
        self.given_back_bytes += freed
        self.actions += 1
        log.warning(
            "memory guard: %s available, below the floor %s: gave back %s, store limited to %s (%s used, %s pinned)",
            format_size(avail),
            format_size(self.floor_bytes),
            format_size(freed),
            format_size(store.effective_budget_bytes),
            format_size(store.used_bytes),
            format_size(store.pinned_bytes),
        )

    # ---- the sampling task ------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            try:
                self.step()
            except Exception:  # noqa: BLE001 - a failed sample must not end the guard
                log.exception("memory guard sample failed")
            await asyncio.sleep(self.sample_s)

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None

    def stats(self) -> dict:
        store = self.store
        return {
            "mem_guard_active": self.active,
            "effective_budget_bytes": store.effective_budget_bytes,
            "given_back_bytes": self.given_back_bytes,
            "mem_guard_actions": self.actions,
            "mem_hysteresis_bytes": hysteresis_for(self.floor_bytes, store.budget_bytes),
            "mem_cgroup_limited": bool(self.reader.cgroups),
        }
