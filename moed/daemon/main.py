"""moed's lifecycle: start up, serve, shut down.

Startup: read and validate the configuration, probe mlock, create the daemon,
bind the socket (refusing to steal one a live daemon answers on), and only
then report readiness (a log line, and READY=1 to systemd when run under it).
Serve until SIGTERM or SIGINT. Shutdown: stop accepting, give sessions a
bounded grace period to finish in-flight requests, close every connection
(releasing its leases), stop the readers, unmap the segments, remove the
socket, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import grp
import logging
import os
import signal
import socket
import stat
import sys

import psutil
import uvloop

from moed.cache.eviction import POLICIES
from moed.protocol.sizes import format_size, parse_size

from .config import Config, ConfigError, load_config
from .core import Daemon
from .memlock import mlock_status
from .ramtier import MlockUnavailable
from .server import Session

log = logging.getLogger("moed")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv):
    p = argparse.ArgumentParser(prog="moed", description="The MoE expert streaming daemon (foreground).")
    p.add_argument(
        "--socket", dest="socket_path", help="Unix socket path (default: $MOED_SOCKET or /run/moed/moed.sock)"
    )
    p.add_argument("--ram-budget", dest="ram_budget_bytes", type=_size, help="RAM tier budget, e.g. 8GiB")
    p.add_argument("--mem-floor", dest="mem_floor_bytes", type=_size, help="keep MemAvailable above this")
    p.add_argument("--pin-budget", dest="pin_budget_bytes", type=_size, help="pinned partition (host mirror)")
    p.add_argument("--config", help="TOML configuration file")
    p.add_argument("--direct-io", choices=["auto", "on", "off"], help="O_DIRECT reads (auto: probe, fall back)")
    p.add_argument(
        "--require-mlock", action="store_true", default=None, help="refuse to start if memory cannot be locked"
    )
    p.add_argument("--reader-threads", type=int)
    p.add_argument("--policy", choices=list(POLICIES))
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
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


def warn_about_sizes(config: Config) -> None:
    """Sizes the box cannot honour are legal (the guard copes) but almost surely a mistake."""
    total = psutil.virtual_memory().total
    for name, value in (
        ("ram budget", config.ram_budget_bytes + config.pin_budget_bytes),
        ("memory floor", config.mem_floor_bytes),
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


async def serve(config: Config) -> None:
    loop = asyncio.get_running_loop()
    locked, why = mlock_status(config.ram_budget_bytes + config.pin_budget_bytes, config.require_mlock)
    daemon = Daemon(config, loop)
    if not locked:
        daemon.ramtier.locked = False
        daemon.ramtier.lock_error = why
        log.warning("expert memory will NOT be locked: %s", why)
    warn_about_sizes(config)
    try:
        listener = bind_socket(config)
    except StartupError:
        daemon.close()
        raise
    metrics = start_metrics(daemon, loop, config, listener)
    server = await loop.create_unix_server(lambda: Session(daemon), sock=listener)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info(
        "moed %s ready on %s: budget %s, mem floor %s, locked=%s, policy=%s",
        daemon.version,
        config.socket_path,
        format_size(config.ram_budget_bytes),
        format_size(config.mem_floor_bytes),
        daemon.ramtier.locked,
        config.policy,
    )
    sd_notify("READY=1")
    daemon.memguard.start()
    daemon.start()
    await stop.wait()
    await daemon.memguard.stop()
    await daemon.stop()
    sd_notify("STOPPING=1")
    log.info("stopping")
    server.close()
    if metrics is not None:
        metrics.close()
    await _drain(daemon, config.shutdown_grace_s)
    for session in list(daemon.sessions):
        session.transport.abort()
    await asyncio.sleep(0)  # let connection_lost run and release leases
    try:
        os.unlink(config.socket_path)
    except FileNotFoundError:
        pass
    daemon.close()
    log.info("stopped")


def start_metrics(daemon: Daemon, loop: asyncio.AbstractEventLoop, config: Config, listener: socket.socket):
    """The Prometheus endpoint if `metrics_listen` is set (moed.daemon.metrics), else None."""
    if not config.metrics_listen:
        return None
    try:
        from .metrics import MetricsServer

        return MetricsServer(daemon, loop, config.metrics_listen)
    except (ImportError, OSError) as exc:
        listener.close()
        os.unlink(config.socket_path)  # ours, just bound: leave nothing behind
        daemon.close()
        raise StartupError(f"cannot serve metrics on {config.metrics_listen}: {exc}") from None


async def _drain(daemon: Daemon, grace_s: float) -> None:
    """Wait (bounded) for sessions busy with a request to answer it."""
    deadline = asyncio.get_running_loop().time() + grace_s
    while any(s.busy for s in daemon.sessions) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)


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
