"""The daemon's configuration: TOML plus overrides into one frozen object;
sizes as strings; unknown keys and bad values fail naming the key; overrides
win; MOED_SOCKET sets the default socket path."""

from __future__ import annotations

import os

import pytest

from moed.daemon.config import DEFAULT_SOCKET, Config, ConfigError, TenantConfig, load_config


@pytest.fixture(autouse=True)
def no_socket_env(monkeypatch):
    monkeypatch.delenv("MOED_SOCKET", raising=False)


@pytest.fixture
def toml(tmp_path):
    def write(text: str) -> str:
        path = tmp_path / "moed.toml"
        path.write_text(text)
        return str(path)

    return write


def test_defaults():
    c = load_config()
    assert c == Config()
    assert c.socket_path == DEFAULT_SOCKET and c.ram_budget_bytes == 1 << 30 and c.policy == "lru"


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        load_config().ram_budget_bytes = 5


def test_toml_with_sizes_lists_and_tenants(toml):
    uid = os.getuid()
    c = load_config(
        toml(f"""
        socket_path = "/tmp/m.sock"
        ram_budget_bytes = "4GiB"
        mem_floor_bytes = "512MiB"
        pin_budget_bytes = 1048576
        chunk_bytes = "1MiB"
        policy = "lfu"
        reader_threads = 4
        direct_io = "off"
        acquire_timeout_s = 5          # an int where a float is expected is fine
        socket_mode = 0o600
        model_roots = ["/models", "/srv/models"]
        log_level = "debug"

        [tenants.{uid}]
        floor_bytes = "1GiB"
        ceiling_bytes = "2 GiB"
    """)
    )
    assert c.socket_path == "/tmp/m.sock"
    assert c.ram_budget_bytes == 4 << 30 and c.mem_floor_bytes == 512 << 20
    assert c.pin_budget_bytes == 1 << 20 and c.chunk_bytes == 1 << 20
    assert (c.policy, c.reader_threads, c.direct_io, c.log_level) == ("lfu", 4, "off", "debug")
    assert c.acquire_timeout_s == 5.0 and c.socket_mode == 0o600
    assert c.model_roots == ["/models", "/srv/models"]
    assert c.tenants == {str(uid): TenantConfig(floor_bytes=1 << 30, ceiling_bytes=2 << 30)}


@pytest.mark.parametrize(
    "text, names",
    [
        ("bogus = 1", "bogus"),
        ("ram_budget = '1GiB'", "ram_budget"),
        ("[tenants.0]\nfloor = 1", "floor"),
        ("[extra]\nx = 1", "extra"),
    ],
)
def test_unknown_keys_fail_naming_the_key(toml, text, names):
    with pytest.raises(ConfigError, match=names):
        load_config(toml(text))


@pytest.mark.parametrize(
    "text, names",
    [
        ("ram_budget_bytes = 'lots'", "ram_budget_bytes"),
        ("ram_budget_bytes = '-1GiB'", "ram_budget_bytes"),
        ("ram_budget_bytes = 0", "ram_budget_bytes"),
        ("ram_budget_bytes = 1.5e9", "ram_budget_bytes"),
        ("ram_budget_bytes = true", "ram_budget_bytes"),
        ("mem_floor_bytes = -1", "mem_floor_bytes"),
        ("chunk_bytes = 1000", "chunk_bytes"),
        ("chunk_bytes = 0", "chunk_bytes"),
        ("policy = 'fifo'", "policy"),
        ("direct_io = 'maybe'", "direct_io"),
        ("log_level = 'loud'", "log_level"),
        ("reader_threads = 0", "reader_threads"),
        ("reader_threads = '8'", "reader_threads"),
        ("reader_threads = true", "reader_threads"),
        ("acquire_timeout_s = 0", "acquire_timeout_s"),
        ("acquire_timeout_s = -1.5", "acquire_timeout_s"),
        ("shutdown_grace_s = -1", "shutdown_grace_s"),
        ("mem_sample_s = 0", "mem_sample_s"),
        ("socket_mode = 0o1777", "socket_mode"),
        ("socket_mode = -1", "socket_mode"),
        ("max_clients = 0", "max_clients"),
        ("socket_path = ''", "socket_path"),
        ("socket_path = 5", "socket_path"),
        ("model_roots = '/models'", "model_roots"),
        ("require_mlock = 'yes'", "require_mlock"),
        ("tenants = 5", "tenants"),
        ("[tenants.0]\nfloor_bytes = 'much'", "floor_bytes"),
    ],
)
def test_bad_values_fail_naming_the_key(toml, text, names):
    path = toml(text)
    with pytest.raises(ConfigError, match=names) as info:
        load_config(path)
    assert path in str(info.value)  # and where it came from


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_missing_and_unparsable_files(tmp_path, toml):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(str(tmp_path / "absent.toml"))
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(toml("ram_budget_bytes = "))
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(str(tmp_path))  # a directory


def test_overrides_win_and_none_means_not_given(toml):
    path = toml("ram_budget_bytes = '4GiB'\npolicy = 'lfu'\nreader_threads = 2")
    c = load_config(path, ram_budget_bytes="512MiB", policy=None, reader_threads=6)
    assert c.ram_budget_bytes == 512 << 20  # size strings work as overrides too
    assert c.policy == "lfu"  # None: keep the file's value
    assert c.reader_threads == 6


def test_bad_overrides_fail_too():
    with pytest.raises(ConfigError, match="mem_floor_bytes"):
        load_config(mem_floor_bytes="a lot")
    with pytest.raises(ConfigError, match="no_such_option"):
        load_config(no_such_option=1)


def test_moed_socket_sets_the_default_socket(monkeypatch, toml):
    monkeypatch.setenv("MOED_SOCKET", "/tmp/env.sock")
    assert load_config().socket_path == "/tmp/env.sock"
    assert load_config(toml("ram_budget_bytes = 4096")).socket_path == "/tmp/env.sock"
    path = toml("socket_path = '/tmp/file.sock'")
    assert load_config(path).socket_path == "/tmp/file.sock"  # the file beats the env
    assert load_config(path, socket_path="/tmp/flag.sock").socket_path == "/tmp/flag.sock"
    assert load_config(socket_path="/tmp/flag.sock").socket_path == "/tmp/flag.sock"
