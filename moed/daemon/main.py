"""moed's lifecycle: start up, serve, shut down, as named phases over one exit stack.

`Lifecycle.startup` runs the phases in order; each phase that makes a resource
pushes its undo on the one `AsyncExitStack` before the next phase runs:

1. `size_memory`: the memory floor when none is given (5% of the smaller of RAM
   and the memory cgroup's limit, at least 256 MiB), and a budget lowered, with a
   warning, to fit in the cgroup's limit above the floor (moed.daemon.memguard);
2. `lock_memory`: probe mlock for the whole budget (refuse, exit 1, when told
   to require it; else warn and serve unlocked);
3. `make_daemon`: the daemon with its RAM tier, readers and store (undo: close
   them, unmapping the segments);
4. `handle_signals`: SIGTERM and SIGINT end the main loop (undo: the handlers go);
5. `bind`: the socket, never over anything but a stale one (undo: close it and
   remove the path);
6. `accept`: sessions on the socket (undo: stop accepting, give busy sessions a
   bounded grace period to answer, close every connection, releasing its leases);
7. `serve_metrics`: the Prometheus endpoint when `metrics_listen` is set (undo:
   stop it);
8. `report_ready`: the ready line and READY=1 to systemd (undo: STOPPING=1 and
   the stopping line);
9. `start_background`: the memory guard's and the daemon's periodic tasks
   (undo: stop them).

Shutdown is the stack unwinding, the phases' undos in reverse; the same
unwinding runs when a phase fails (a `StartupError`, exit 2), so an error
anywhere leaves behind exactly nothing that was started: no socket file, no
mapped segments, no threads. Invariant: readiness is reported only after the
memory probe and the bind, and nothing is served before the daemon exists.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import grp
import logging
import os
import signal
import socket
import stat
import sys

import msgspec
import psutil
import uvloop

from moed.cache.eviction import POLICIES
from moed.protocol.sizes import format_size, parse_size

from .config import Config, ConfigError, load_config
from .core import Daemon
from .memguard import MIN_AUTO_FLOOR_BYTES, MemoryReader, fit_budget
from .memlock import mlock_status
from .ramtier import MlockUnavailable
from .sessions import Session

log = logging.getLogger("moed")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _floor(text: str) -> int | str:
    return "auto" if text == "auto" else _size(text)


FLOOR_HELP = (
    "keep the memory available to moed (MemAvailable, or a memory cgroup's headroom) above this: "
    "below it the cache gives memory back. Default (or 'auto'): 5%% of the smaller of the box's RAM "
    "and the memory cgroup's limit, at least 256MiB; 0 turns the guard off"
)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="moed", description="The MoE expert streaming daemon (foreground).")
    p.add_argument(
        "--socket", dest="socket_path", help="Unix socket path (default: $MOED_SOCKET or /run/moed/moed.sock)"
    )
    p.add_argument(
        "--ram-budget",
        dest="ram_budget_bytes",
        type=_size,
        help="RAM tier budget, e.g. 8GiB (lowered at start to fit in a memory cgroup's limit less the floor)",
    )
    p.add_argument("--mem-floor", dest="mem_floor_bytes", type=_floor, help=FLOOR_HELP)
    p.add_argument("--pin-budget", dest="pin_budget_bytes", type=_size, help="pinned partition (host mirror)")
    p.add_argument("--config", help="TOML configuration file")
    p.add_argument("--direct-io", choices=["auto", "on", "off"], help="O_DIRECT reads (auto: probe, fall back)")
    p.add_argument(
        "--require-mlock", action="store_true", default=None, help="refuse to start if memory cannot be locked"
    )
    p.add_argument("--reader-threads", type=int)
    p.add_argument("--policy", choices=list(POLICIES))
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--repack-cache",
        dest="repack_cache_bytes",
        type=_floor,
        help="disk the repack cache may take (plain files' experts kept in the layout made on read), "
        "e.g. 20GiB; default (or 'auto'): no fixed size, the filesystem kept 5%% free; 0 turns it off",
    )
    p.add_argument(
        "--repack-cache-dir",
        dest="repack_cache_dir",
        help="where the repack cache lives (default: $CACHE_DIRECTORY/repack under systemd, else ~/.cache/moed/repack)",
    )
    p.add_argument("--metrics-listen", help="serve Prometheus metrics on HOST:PORT, e.g. 127.0.0.1:9477 (default: off)")
    return p.parse_args(argv)


class StartupError(Exception):
    """A reason not to start, printed as one line (exit code 2)."""


def bind_socket(config: Config) -> socket.socket:
    """Bind and listen on the configured path, never over anything but a stale socket.

    What may be at the path: nothing; a socket a live daemon answers on (refused);
    a socket nobody answers on (a daemon that died: removed and rebound). Anything
    else (a regular file, a directory, a FIFO) is refused and left untouched.
    """
    path = config.socket_path
    gid = -1
    if config.socket_group:  # resolved before anything is made, so a typo leaves nothing behind
        try:
            gid = grp.getgrnam(config.socket_group).gr_gid
        except KeyError:
            raise StartupError(f"socket_group: no group named {config.socket_group!r}") from None
    _clear_stale_socket(path)
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise StartupError(f"cannot create the socket's directory {parent}: {exc.strerror}") from None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot bind {path}: {exc.strerror}") from None
    try:
        if gid >= 0:
            os.chown(path, -1, gid)
        os.chmod(path, config.socket_mode)
    except OSError as exc:
        sock.close()
        os.unlink(path)  # ours, just made: leave nothing behind
        raise StartupError(f"cannot set the owner group or mode of {path}: {exc}") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def _clear_stale_socket(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise StartupError(f"cannot inspect socket path {path}: {exc.strerror}") from None
    if not stat.S_ISSOCK(st.st_mode):
        what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a socket"
        raise StartupError(f"socket path {path} exists and is {what}; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # a stale socket of a daemon that died
    else:
        raise StartupError(f"another daemon is serving on {path}")
    finally:
        probe.close()


def _remove_socket(listener: socket.socket, path: str) -> None:
    """Close our listening socket and remove its path (ours: `bind_socket` made it)."""
    listener.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def size_memory(config: Config, reader: MemoryReader) -> Config:
    """`config` with the memory floor resolved (None: the default) and the budget fitted to the cgroup.

    The budget is lowered to the memory cgroup's lowest limit less the floor and the pin
    budget (`fit_budget`): above that the guard would hold the store back anyway, and the
    kernel's OOM killer, not the guard, would have the last word while it fills.
    """
    floor = reader.auto_floor_bytes() if config.mem_floor_bytes is None else config.mem_floor_bytes
    limit = reader.cgroup_limit_bytes()
    try:
        budget = fit_budget(config.ram_budget_bytes, config.pin_budget_bytes, floor, limit)
        sized = msgspec.structs.replace(config, mem_floor_bytes=floor, ram_budget_bytes=budget)
        sized.__post_init__()  # tenant floors must still fit a lowered budget
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    if limit is not None and budget < config.ram_budget_bytes:
        log.warning(
            "the ram budget %s does not fit in the memory cgroup's limit %s above the memory floor %s "
            "(pin budget %s): lowered to %s",
            format_size(config.ram_budget_bytes),
            format_size(limit),
            format_size(floor),
            format_size(config.pin_budget_bytes),
            format_size(budget),
        )
    return sized


def warn_about_sizes(config: Config) -> None:
    """Sizes the box cannot honour are legal (the guard copes) but almost surely a mistake."""
    total = psutil.virtual_memory().total
    for name, value in (
        ("ram budget", config.ram_budget_bytes + config.pin_budget_bytes),
        ("memory floor", config.mem_floor_bytes or 0),
    ):
        if value > total:
            log.warning(
                "the %s (%s) is larger than this machine's RAM (%s)", name, format_size(value), format_size(total)
            )


def sd_notify(state: str) -> None:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.sendto(state.encode(), addr)
        except OSError as exc:
            log.warning("sd_notify failed: %s", exc)


class Lifecycle:
    """One daemon process's life: `startup`, `main_loop`, and shutdown as `stack` unwinding.

    Every resource a phase makes is owned by `stack` from the moment it exists;
    no phase cleans up by hand.
    """

    def __init__(self, config: Config, stack: contextlib.AsyncExitStack):
        self.config = config
        self.stack = stack
        self.loop = asyncio.get_running_loop()
        self.should_exit = asyncio.Event()
        self.locked, self.lock_error = True, ""
        self.floor_source = ""  # how the floor was chosen, for the ready line
        self.daemon: Daemon

    async def startup(self) -> None:
        self.size_memory()
        self.lock_memory()
        self.make_daemon()
        self.handle_signals()
        listener = self.bind()
        await self.accept(listener)
        self.serve_metrics()
        self.report_ready()
        self.start_background()

    async def main_loop(self) -> None:
        await self.should_exit.wait()

    # ---- the phases, each pushing its undo ------------------------------------

    def size_memory(self) -> None:
        """The floor and the budget every later phase sizes by (see `size_memory`)."""
        if self.config.mem_floor_bytes is None:
            self.floor_source = (
                f" (the default: 5% of the smaller of RAM and the memory cgroup's limit, "
                f"at least {format_size(MIN_AUTO_FLOOR_BYTES)})"
            )
        self.config = size_memory(self.config, MemoryReader())

    def lock_memory(self) -> None:
        """Can the whole budget be locked? Raises MlockUnavailable if required and not."""
        config = self.config
        self.locked, self.lock_error = mlock_status(
            config.ram_budget_bytes + config.pin_budget_bytes, config.require_mlock
        )

    def make_daemon(self) -> None:
        self.daemon = Daemon(self.config, self.loop)
        self.stack.callback(self.daemon.close)
        if not self.locked:
            self.daemon.ramtier.locked = False
            self.daemon.ramtier.lock_error = self.lock_error
            log.warning("expert memory will NOT be locked: %s", self.lock_error)
        warn_about_sizes(self.config)

    def handle_signals(self) -> None:
        # Installed before anything is served and kept until the very end, so a
        # second signal during the grace period cannot cut the shutdown short.
        for sig in STOP_SIGNALS:
            self.loop.add_signal_handler(sig, self.should_exit.set)
            self.stack.callback(self.loop.remove_signal_handler, sig)

    def bind(self) -> socket.socket:
        listener = bind_socket(self.config)
        self.stack.callback(_remove_socket, listener, self.config.socket_path)
        return listener

    async def accept(self, listener: socket.socket) -> None:
        daemon = self.daemon
        server = await self.loop.create_unix_server(lambda: Session(daemon), sock=listener)
        self.stack.push_async_callback(self._close_sessions, server)

    def serve_metrics(self) -> None:
        """The Prometheus endpoint if `metrics_listen` is set (moed.daemon.prometheus)."""
        if not self.config.metrics_listen:
            return
        try:
            from .prometheus import MetricsServer

            metrics = MetricsServer(self.daemon, self.loop, self.config.metrics_listen)
        except (ImportError, OSError) as exc:
            raise StartupError(f"cannot serve metrics on {self.config.metrics_listen}: {exc}") from None
        self.stack.callback(metrics.close)

    def report_ready(self) -> None:
        config = self.config
        log.info(
            "moed %s ready on %s: budget %s, mem floor %s%s, locked=%s, policy=%s",
            self.daemon.version,
            config.socket_path,
            format_size(config.ram_budget_bytes),
            format_size(self.daemon.memguard.floor_bytes),
            self.floor_source,
            self.daemon.ramtier.locked,
            config.policy,
        )
        sd_notify("READY=1")
        self.stack.callback(self._report_stopping)

    def start_background(self) -> None:
        self.daemon.memguard.start()
        self.stack.push_async_callback(self.daemon.memguard.stop)
        self.daemon.start()
        self.stack.push_async_callback(self.daemon.stop)

    # ---- undos that are more than one call ------------------------------------

    @staticmethod
    def _report_stopping() -> None:
        sd_notify("STOPPING=1")
        log.info("stopping")

    async def _close_sessions(self, server: asyncio.AbstractServer) -> None:
        """Stop accepting; wait (bounded) for busy sessions to answer; close every connection."""
        server.close()
        loop = self.loop
        deadline = loop.time() + self.config.shutdown_grace_s
        while any(s.busy for s in self.daemon.sessions) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        for session in list(self.daemon.sessions):
            session.abort()
        await asyncio.sleep(0)  # let connection_lost run and release leases


async def serve(config: Config) -> None:
    async with contextlib.AsyncExitStack() as stack:
        life = Lifecycle(config, stack)
        await life.startup()
        await life.main_loop()
    log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if k != "config"}
    try:
        config = load_config(args.config, **overrides)
    except ConfigError as exc:
        print(f"moed: bad configuration: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        uvloop.run(serve(config))
    except StartupError as exc:
        print(f"moed: {exc}", file=sys.stderr)
        return 2
    except MlockUnavailable as exc:
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
