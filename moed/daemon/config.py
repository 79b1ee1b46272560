"""The daemon's configuration: one typed, frozen object, validated at start.

Sources, later wins: defaults, the TOML file (`--config`), command-line flags.
Unknown keys, wrong types and impossible values fail at start with a message
naming the key. A tenant is a peer uid (SO_PEERCRED); `[tenants.<uid or user
name>]` gives it a reserved floor and/or a ceiling of the shared budget, and
names are resolved to uids here, once (an unknown name fails the start); the
store enforces the quotas. Every `*_bytes` key also accepts a size string ("4GiB").
"""

from __future__ import annotations

import os
import pwd
import tomllib
from typing import Any, Literal

import msgspec

from moed.cache.eviction import POLICIES
from moed.protocol.paths import DEFAULT_SOCKET
from moed.protocol.sizes import parse_size

MAX_READER_THREADS = 256
MAX_SOCKET_PATH_BYTES = 107  # sun_path is 108 bytes with its terminating NUL


class ConfigError(ValueError):
    pass


class TenantConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Budget share of one tenant (a uid, or a user name resolved at start)."""

    floor_bytes: int = 0  # its experts are not evicted by others below this
    ceiling_bytes: int = 0  # 0: no ceiling


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    socket_path: str = DEFAULT_SOCKET
    ram_budget_bytes: int = 1 << 30
    # The memory guard's floor (moed.daemon.memguard). None (not given, or "auto"): 5% of the
    # smaller of RAM and the memory cgroup's limit, at least 256 MiB, resolved at start. 0: off.
    mem_floor_bytes: int | None = None
    pin_budget_bytes: int = 0
    policy: str = "lru"  # a name in policy.POLICIES
    reader_threads: int = 8
    chunk_bytes: int = 1 << 20  # a Q4 expert part of a 30B-class model (0.9 MB) is one read: bench/RESULTS.md
    direct_io: Literal["auto", "on", "off"] = "auto"
    require_mlock: bool = False
    acquire_timeout_s: float = 60.0
    shutdown_grace_s: float = 5.0
    mem_sample_s: float = 0.2
    socket_mode: int = 0o660
    socket_group: str = ""
    model_roots: list[str] = []
    verify: bool = False
    max_clients: int = 256
    max_clients_per_tenant: int = 64  # one uid cannot take every connection (operators have a reserve)
    hello_timeout_s: float = 5.0  # a connection that sends no Hello within this is closed
    idle_timeout_s: float = 0.0  # 0: off; else a connection that sends nothing for this long
    # and holds no lease is closed
    open_timeout_s: float = 30.0  # a model open (header parse) slower than this fails
    max_models: int = 64  # open models; beyond it the oldest unused one is closed
    max_opens_per_tenant: int = 2  # model opens in flight per uid (a hung file ties up only these)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    tenants: dict[str, TenantConfig] = {}
    metrics_listen: str = ""  # HOST:PORT of the Prometheus endpoint; "" (default): off
    # When the drive misbehaves (docs/design.md): a failed chunk read is tried again
    # read_retries times (backoff read_retry_backoff_s, x4 each time); then the expert
    # is quarantined for read_quarantine_s (0: never) and its acquires fail at once.
    read_retries: int = 2
    read_retry_backoff_s: float = 0.01
    read_quarantine_s: float = 30.0
    read_stall_warn_s: float = 10.0  # a read running longer is logged and a spare reader started (0: off)
    prefetch_backoff: bool = True  # no read-ahead while the drive is behind (latency or queue)
    # The RAM tier's pages made in the background after a model opens, up to the budget, so a
    # first fill costs the drive's time only, not the kernel's page zeroing (moed.daemon.prefault).
    prefault: bool = True
    # Compute turns (moed.daemon.turns): an engine that took a turn within turn_idle_s counts
    # in the split of the cores; a turn held, or waited for, longer than turn_max_s no longer
    # blocks anyone (one engine cannot stall the others).
    turn_idle_s: float = 1.0
    turn_max_s: float = 2.0
    # "ceiling" (default): a thread count an engine's user gave is granted as given while the
    # engine is alone, and is the most it gets while others compute (its share of the cores);
    # "keep": always granted as given (engines given every core then take turns).
    turn_user_threads: Literal["keep", "ceiling"] = "ceiling"
    # The repack cache (moed.daemon.repackcache): experts made on read kept on disk, so a plain
    # file reads like its `moectl align --repack` copy once they were read. Directory "" (default):
    # systemd's CacheDirectory= ($CACHE_DIRECTORY), else ~/.cache/moed; `repack` in it. Size None
    # ("auto", default): no fixed size, only the filesystem's free space kept above 5% (at least
    # 1 GiB); 0: off.
    repack_cache_dir: str = ""
    repack_cache_bytes: int | None = None

    def __post_init__(self):
        checks = [
            (self.ram_budget_bytes > 0, "ram_budget_bytes must be positive"),
            (self.policy in POLICIES, f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}"),
            (
                1 <= self.reader_threads <= MAX_READER_THREADS,
                f"reader_threads must be 1..{MAX_READER_THREADS}, got {self.reader_threads}",
            ),
            (
                self.chunk_bytes >= 4096 and self.chunk_bytes % 4096 == 0,
                "chunk_bytes must be a positive multiple of 4096",
            ),
            (self.acquire_timeout_s > 0, "acquire_timeout_s must be positive"),
            (self.shutdown_grace_s >= 0, "shutdown_grace_s must not be negative"),
            (self.mem_sample_s > 0, "mem_sample_s must be positive"),
            (0 <= self.socket_mode <= 0o777, "socket_mode must be a permission mode like 0o660"),
            (
                (self.mem_floor_bytes or 0) >= 0 and self.pin_budget_bytes >= 0 and (self.repack_cache_bytes or 0) >= 0,
                "sizes must not be negative",
            ),
            (self.max_clients >= 1, "max_clients must be at least 1"),
            (self.max_clients_per_tenant >= 1, "max_clients_per_tenant must be at least 1"),
            (self.hello_timeout_s > 0, "hello_timeout_s must be positive"),
            (self.idle_timeout_s >= 0, "idle_timeout_s must not be negative (0 turns it off)"),
            (self.open_timeout_s > 0, "open_timeout_s must be positive"),
            (self.max_models >= 1, "max_models must be at least 1"),
            (self.max_opens_per_tenant >= 1, "max_opens_per_tenant must be at least 1"),
            (0 <= self.read_retries <= 10, "read_retries must be 0..10"),
            (0 <= self.read_retry_backoff_s <= 1, "read_retry_backoff_s must be 0..1 (seconds)"),
            (self.read_quarantine_s >= 0, "read_quarantine_s must not be negative (0: no quarantine)"),
            (self.read_stall_warn_s >= 0, "read_stall_warn_s must not be negative (0: off)"),
            (self.turn_idle_s > 0, "turn_idle_s must be positive"),
            (self.turn_max_s > 0, "turn_max_s must be positive"),
            (self.socket_path != "", "socket_path must not be empty"),
            (
                len(os.fsencode(self.socket_path)) <= MAX_SOCKET_PATH_BYTES,
                f"socket_path is {len(os.fsencode(self.socket_path))} bytes; a Unix socket path "
                f"holds at most {MAX_SOCKET_PATH_BYTES}",
            ),
        ]
        for ok, why in checks:
            if not ok:
                raise ValueError(why)
        if self.metrics_listen:
            parse_listen(self.metrics_listen)
        self._check_tenants()

    def _check_tenants(self) -> None:
        resolve_tenants(self.tenants)  # unknown user names fail the start
        for key, t in self.tenants.items():
            if t.floor_bytes < 0 or t.ceiling_bytes < 0:
                raise ValueError(f"tenants.{key}: sizes must not be negative")
            if t.ceiling_bytes and t.floor_bytes > t.ceiling_bytes:
                raise ValueError(f"tenants.{key}: floor_bytes exceeds ceiling_bytes")
        floors = sum(t.floor_bytes for t in self.tenants.values())
        if floors > self.ram_budget_bytes:
            raise ValueError(f"tenant floors add up to {floors} bytes, more than ram_budget_bytes")


def parse_listen(text: str) -> tuple[str, int]:
    """`HOST:PORT` (or `[v6]:PORT`) -> (host, port); ValueError names what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"metrics_listen must be HOST:PORT (e.g. 127.0.0.1:9477), got {text!r}")
    return host.strip("[]"), int(port)


def tenant_uid(key: str) -> int:
    """The uid a `[tenants.<key>]` table names: digits are a uid, anything else a user name."""
    if key.isdigit():
        return int(key)
    try:
        return pwd.getpwnam(key).pw_uid
    except KeyError:
        raise ValueError(f"tenants.{key}: no such user") from None


def resolve_tenants(tenants: dict[str, TenantConfig]) -> dict[int, TenantConfig]:
    out: dict[int, TenantConfig] = {}
    for key, cfg in tenants.items():
        uid = tenant_uid(key)
        if uid in out:
            raise ValueError(f"tenants.{key}: uid {uid} is configured twice")
        out[uid] = cfg
    return out


def _sizes(raw: dict[str, Any], where: str = "") -> dict[str, Any]:
    out = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            value = _sizes(value, f"{where}{key}.")
        elif not where and key in ("mem_floor_bytes", "repack_cache_bytes") and value == "auto":
            value = None  # the default floor, also where a file gave one and a flag says auto
        elif key.endswith("_bytes") and isinstance(value, (str, int)):
            try:
                value = parse_size(value)
            except ValueError as exc:
                raise ConfigError(f"{where}{key}: {exc}") from None
        out[key] = value
    return out


def load_config(path: str | None = None, **overrides: Any) -> Config:
    """Build the Config from an optional TOML file plus non-None overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    if "socket_path" not in raw and "MOED_SOCKET" in os.environ:
        raw["socket_path"] = os.environ["MOED_SOCKET"]
    raw.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return msgspec.convert(_sizes(raw), Config)
    except (msgspec.ValidationError, ValueError) as exc:
        where = f"{path}: " if path else ""
        raise ConfigError(f"{where}{exc}") from None
