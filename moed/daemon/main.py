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
import sys

import uvloop

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
    p.add_argument("--socket", dest="socket_path", help="Unix socket path (default: $MOED_SOCKET or /run/moed/moed.sock)")
    p.add_argument("--ram-budget", dest="ram_budget_bytes", type=_size, help="RAM tier budget, e.g. 8GiB")
    p.add_argument("--mem-floor", dest="mem_floor_bytes", type=_size, help="keep MemAvailable above this")
    p.add_argument("--pin-budget", dest="pin_budget_bytes", type=_size, help="pinned partition (host mirror)")
    p.add_argument("--config", help="TOML configuration file")
    p.add_argument("--direct-io", choices=["auto", "on", "off"], help="O_DIRECT reads (auto: probe, fall back)")
    p.add_argument("--require-mlock", action="store_true", default=None, help="refuse to start if memory cannot be locked")
    p.add_argument("--reader-threads", type=int)
    p.add_argument("--policy", choices=["lru", "lfu"])
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


def bind_socket(config: Config) -> socket.socket:
    path = config.socket_path
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)   # stale socket of a daemon that died
        else:
            raise SystemExit(f"moed: another daemon is serving on {path}")
        finally:
            probe.close()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    if config.socket_group:
        os.chown(path, -1, grp.getgrnam(config.socket_group).gr_gid)
    os.chmod(path, config.socket_mode)
    sock.listen(128)
    sock.setblocking(False)
    return sock


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
    daemon = Daemon(config)
    daemon.loop = loop
    if not locked:
        daemon.ramtier.locked = False
        daemon.ramtier.lock_error = why
        log.warning("expert memory will NOT be locked: %s", why)
    listener = bind_socket(config)
    server = await loop.create_unix_server(lambda: Session(daemon), sock=listener)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("moed %s ready on %s: budget %s, mem floor %s, locked=%s, policy=%s",
             daemon.version, config.socket_path, format_size(config.ram_budget_bytes),
             format_size(config.mem_floor_bytes), daemon.ramtier.locked, config.policy)
    sd_notify("READY=1")
    daemon.memguard.start()
    await stop.wait()
    await daemon.memguard.stop()
    sd_notify("STOPPING=1")
    log.info("stopping")
    server.close()
    await _drain(daemon, config.shutdown_grace_s)
    for session in list(daemon.sessions):
        session.transport.abort()
    await asyncio.sleep(0)   # let connection_lost run and release leases
    try:
        os.unlink(config.socket_path)
    except FileNotFoundError:
        pass
    daemon.close()
    log.info("stopped")


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
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        uvloop.run(serve(config))
    except MlockUnavailable as exc:
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
