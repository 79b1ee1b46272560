"""moed's lifecycle: configuration errors, mlock policy, readiness, socket ownership."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile

import pytest

from moed.testing import DaemonProcess, wait_for

MOED = [sys.executable, "-m", "moed.daemon.main"]


def short_dir(mode: int = 0o700) -> str:
    d = tempfile.mkdtemp(prefix="moed-", dir="/tmp")
    os.chmod(d, mode)
    return d


def test_unknown_config_key_fails_naming_it(tmp_path):
    cfg = tmp_path / "moed.toml"
    cfg.write_text('ram_budget_bytes = "1GiB"\nram_budgte_bytes = 5\n')
    r = subprocess.run(
        MOED + ["--config", str(cfg), "--socket", f"{short_dir()}/s"], capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 2
    assert "ram_budgte_bytes" in r.stderr


def test_bad_size_flag_is_refused():
    r = subprocess.run(MOED + ["--ram-budget", "lots"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "not a size" in r.stderr


def test_shipped_example_config_is_valid():
    from moed.daemon.config import load_config

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = load_config(os.path.join(root, "systemd", "moed.toml"))
    assert cfg.ram_budget_bytes == 64 << 30
    unit = open(os.path.join(root, "systemd", "moed.service")).read()
    assert "Type=notify" in unit and "LimitMEMLOCK=infinity" in unit
    # the repack cache's directory: writable under ProtectSystem=strict, named by $CACHE_DIRECTORY
    assert "CacheDirectory=moed" in unit and cfg.repack_cache_dir == "" and cfg.repack_cache_bytes is None


def test_ready_is_notified_to_systemd_after_bind():
    d = short_dir()
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(f"{d}/notify")
    notify.settimeout(20)
    with DaemonProcess("8MiB", socket_dir=d, env={"NOTIFY_SOCKET": f"{d}/notify"}) as daemon:
        msg = notify.recv(256).decode()
        assert msg == "READY=1"
        assert os.path.exists(daemon.socket)
        assert daemon.stop() == 0
        assert notify.recv(256).decode() == "STOPPING=1"


def test_second_daemon_on_a_live_socket_is_refused(daemon):
    r = subprocess.run(
        MOED + ["--socket", daemon.socket, "--ram-budget", "8MiB"], capture_output=True, text=True, timeout=30
    )
    assert r.returncode != 0 and "another daemon" in r.stderr
    with daemon.client() as c:
        c.ping()


def _as_nobody(args: list[str]) -> list[str]:
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *args]


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the daemon without CAP_IPC_LOCK")


@needs_root
def test_require_mlock_refuses_without_lock_permission():
    d = short_dir(0o777)
    r = subprocess.run(
        _as_nobody(MOED + ["--socket", f"{d}/s", "--ram-budget", "1GiB", "--require-mlock"]),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 1
    assert "RLIMIT_MEMLOCK" in r.stderr


@needs_root
def test_unlockable_budget_starts_with_warning_and_says_so_in_stats(tiny_model):
    d = short_dir(0o777)
    proc = subprocess.Popen(
        _as_nobody(MOED + ["--socket", f"{d}/s", "--ram-budget", "1GiB"]), stderr=subprocess.PIPE, text=True
    )
    try:
        from moed.client import Client
        from moed.protocol.errors import DaemonUnavailable

        def connect():
            try:
                return Client(f"{d}/s")
            except DaemonUnavailable:
                assert proc.poll() is None, proc.stderr.read()
                return None

        c = wait_for(connect, 20, what="daemon running as nobody")
        s = c.stats()
        assert s["locked"] is False and "RLIMIT_MEMLOCK" in s["lock_error"]
        c.close()
    finally:
        proc.terminate()
        err = proc.communicate(timeout=15)[1]
    assert proc.returncode == 0
    assert "NOT be locked" in err


def test_a_test_daemon_leaves_no_directory_behind():
    """DaemonProcess removes the directory it made (socket, log) when it is done with:
    a suite starts hundreds of daemons on a box others share."""
    d = DaemonProcess("8MiB")
    assert (d.dir / "moed.log").exists() and os.path.exists(d.socket)
    d.close()
    assert not d.dir.exists() and not d.running()
    with DaemonProcess("8MiB") as e:
        made = e.dir
        e.client("x").close()
    assert not made.exists()
    kept = short_dir()
    with DaemonProcess("8MiB", socket_dir=kept):
        pass
    assert os.path.isdir(kept)  # not its own: left where the caller put it
    os.remove(os.path.join(kept, "moed.log"))
    os.rmdir(kept)
