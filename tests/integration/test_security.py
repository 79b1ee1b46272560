"""Security against a real daemon: socket permissions, peers' own file permissions,
model roots, read-only client mappings, and leases private to their connection."""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import stat
import struct

import pytest

from moed import libc
from moed.client import Client
from moed.protocol import errors
from moed.protocol import messages as m
from tests.integration.peer import NOBODY, Outcome, as_peer

SIGSEGV = 11


def copy_model(model, directory: str, mode: int, name: str = "model.gguf") -> str:
    os.makedirs(directory, exist_ok=True)
    path = shutil.copy(model, os.path.join(directory, name))
    os.chmod(path, mode)
    return path


def _open(sock: str, path: str) -> str:
    try:
        with Client(sock, "peer") as c:
            c.open_model(path)
        return "opened"
    except errors.MoedError as exc:
        return type(exc).__name__


def _ping(sock: str) -> str:
    try:
        with Client(sock, "peer") as c:
            c.ping()
        return "served"
    except errors.DaemonUnavailable:
        return "refused"


# ---- the socket --------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="giving the socket to another group needs root")
def test_socket_mode_and_group(start_daemon, tmp_path):
    conf = tmp_path / "moed.toml"
    conf.write_text('socket_group = "nogroup"\nsocket_mode = 0o660\n')
    d = start_daemon("8MiB", "--config", str(conf))
    os.chmod(d.dir, 0o755)
    st = os.stat(d.socket)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == 65534
    assert as_peer(NOBODY, NOBODY, _ping, d.socket) == Outcome(result="served")  # in the group
    assert as_peer(NOBODY - 1, NOBODY - 1, _ping, d.socket) == Outcome(result="refused")  # not in it
    assert as_peer(NOBODY - 1, NOBODY - 1, _ping, d.socket, groups=(65534,)) == Outcome(result="served")


def test_default_socket_mode_is_0660(daemon):
    assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o660


# ---- opening models as the peer --------------------------------------------------


def test_peer_without_read_permission_is_refused(start_shared, tiny_model, shared_dir):
    d = start_shared()
    secret = copy_model(tiny_model, shared_dir, 0o600, "secret.gguf")
    public = copy_model(tiny_model, shared_dir, 0o644, "public.gguf")
    with d.client() as c:  # root has it open already: still refused
        c.open_model(secret)
    assert as_peer(NOBODY, NOBODY, _open, d.socket, secret) == Outcome(result="PermissionDenied")
    assert as_peer(NOBODY, NOBODY, _open, d.socket, public) == Outcome(result="opened")
    os.chown(secret, -1, 65534)
    os.chmod(secret, 0o640)  # readable by its group
    assert as_peer(NOBODY, NOBODY, _open, d.socket, secret) == Outcome(result="opened")
    assert as_peer(NOBODY - 1, NOBODY - 1, _open, d.socket, secret) == Outcome(result="PermissionDenied")
    hidden = os.path.join(shared_dir, "hidden")
    inner = copy_model(tiny_model, hidden, 0o644)
    os.chmod(hidden, 0o700)  # readable file in an unsearchable directory
    assert as_peer(NOBODY, NOBODY, _open, d.socket, inner) == Outcome(result="PermissionDenied")
    link = os.path.join(shared_dir, "link.gguf")  # a symlink is judged by its target
    os.symlink(inner, link)
    assert as_peer(NOBODY, NOBODY, _open, d.socket, link) == Outcome(result="PermissionDenied")
    missing = os.path.join(hidden, "nothing.gguf")  # and says nothing about what is in there
    assert as_peer(NOBODY, NOBODY, _open, d.socket, missing) == Outcome(result="PermissionDenied")


def _acl(entries) -> bytes:
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)


def test_posix_acl_grant_is_honoured(start_shared, tiny_model, shared_dir):
    d = start_shared()
    path = copy_model(tiny_model, shared_dir, 0o600)
    undef = 0xFFFFFFFF
    acl = _acl([(1, 6, undef), (2, 4, NOBODY), (4, 0, undef), (0x10, 4, undef), (0x20, 0, undef)])
    try:
        os.setxattr(path, "system.posix_acl_access", acl)
    except OSError as exc:
        pytest.skip(f"no POSIX ACLs here: {exc}")

    def kernel_says(p):
        try:
            os.close(os.open(p, os.O_RDONLY))
            return "readable"
        except PermissionError:
            return "denied"

    assert as_peer(NOBODY, NOBODY, kernel_says, path).result == "readable"
    assert as_peer(NOBODY, NOBODY, _open, d.socket, path) == Outcome(result="opened")
    assert as_peer(NOBODY - 1, NOBODY - 1, kernel_says, path).result == "denied"
    assert as_peer(NOBODY - 1, NOBODY - 1, _open, d.socket, path) == Outcome(result="PermissionDenied")


def test_model_roots_restrict_paths(start_shared, tiny_model, shared_dir):
    allowed = os.path.join(shared_dir, "models")
    inside = copy_model(tiny_model, allowed, 0o644)
    outside = copy_model(tiny_model, os.path.join(shared_dir, "elsewhere"), 0o644)
    d = start_shared("8MiB", f'model_roots = ["{allowed}"]\n')
    sneaky = os.path.join(allowed, "sneaky.gguf")
    os.symlink(outside, sneaky)
    with d.client() as c:
        c.open_model(inside)
        with pytest.raises(errors.PermissionDenied, match="model_roots"):
            c.open_model(outside)
        with pytest.raises(errors.PermissionDenied, match="model_roots"):
            c.open_model(sneaky)
        with pytest.raises(errors.PermissionDenied):
            c.open_model(os.path.join(allowed, "..", "elsewhere", "model.gguf"))


# ---- client mappings are read-only ---------------------------------------------------


def _lease_address(sock: str, path: str):
    c = Client(sock, "writer")
    h = c.open_model(path)
    lease = h.acquire(0, [1])
    view = lease.view(1, h.parts[0])
    return c, lease, view.ctypes.data, h.segment(lease.class_id)


def _write_through_mapping(sock: str, path: str) -> str:
    import faulthandler

    faulthandler.disable()  # the fault is expected: no traceback dump
    _, _, addr, _ = _lease_address(sock, path)
    ctypes.memmove(addr, b"\xff" * 16, 16)  # must fault: the mapping is PROT_READ
    return "wrote"


def _make_writable(sock: str, path: str) -> list[str]:
    _, _, addr, seg = _lease_address(sock, path)
    results = []
    try:
        libc.mprotect(addr - addr % mmap.PAGESIZE, mmap.PAGESIZE, libc.PROT_READ | libc.PROT_WRITE)
        results.append("mprotect allowed")
    except OSError as exc:
        results.append(f"mprotect {errors_name(exc)}")
    try:
        mmap.mmap(seg.fd, mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        results.append("mmap allowed")
    except OSError as exc:
        results.append(f"mmap {errors_name(exc)}")
    try:
        os.close(os.open(f"/proc/self/fd/{seg.fd}", os.O_RDWR))
        results.append("reopen allowed")
    except OSError as exc:
        results.append(f"reopen {errors_name(exc)}")
    return results


def errors_name(exc: OSError) -> str:
    import errno

    return errno.errorcode.get(exc.errno, str(exc.errno))


def test_a_write_through_a_client_mapping_faults(start_shared, tiny_model, shared_dir):
    d = start_shared()
    path = copy_model(tiny_model, shared_dir, 0o644)
    assert as_peer(NOBODY, NOBODY, _write_through_mapping, d.socket, path) == Outcome(signal=SIGSEGV)
    assert as_peer(0, 0, _write_through_mapping, d.socket, path) == Outcome(signal=SIGSEGV)
    got = as_peer(NOBODY, NOBODY, _make_writable, d.socket, path)
    assert got.result == ["mprotect EACCES", "mmap EACCES", "reopen EACCES"], got
    with d.client() as c:  # and the daemon's bytes are intact
        from moed.gguf.catalog import Catalog
        from tests.integration.test_daemon import check_lease

        h = c.open_model(path)
        with h.acquire(0, [1]) as lease:
            check_lease(Catalog.open(path), lease, 0, [1])


# ---- leases belong to their connection -------------------------------------------


def _steal(sock: str, path: str, lease_id: int) -> tuple:
    with Client(sock, "thief") as c:
        h = c.open_model(path)
        try:
            c.request(m.Release([lease_id]))
            released = "released"
        except errors.UnknownLease:
            released = "UnknownLease"
        c.request(m.Acquire(h.model_id, 0, [5], None, [lease_id]))  # piggybacked: ignored
        mine = [t for t in c.stats()["tenants"] if t["uid"] == os.getuid()][0]
        return released, mine["leases"]


def test_one_tenant_cannot_release_another_tenants_lease(start_shared, tiny_model, shared_dir):
    d = start_shared()
    path = copy_model(tiny_model, shared_dir, 0o644)
    with d.client("owner") as c:
        h = c.open_model(path)
        lease = h.acquire(1, [2, 3])
        assert as_peer(NOBODY, NOBODY, _steal, d.socket, path, lease.lease_id) == Outcome(result=("UnknownLease", 1))
        with d.client("same-uid-other-connection") as c2:
            c2.open_model(path)
            with pytest.raises(errors.UnknownLease):
                c2.request(m.Release([lease.lease_id]))
        owner_row = [t for t in c.stats()["tenants"] if t["uid"] == 0][0]
        assert owner_row["leases"] == 1  # still held
        c.request(m.Release([lease.lease_id]))  # and its owner can release it


def _class_ids(sock: str, path: str) -> list[int]:
    with Client(sock, "peer") as c:
        return [s.class_id for s in c.open_model(path).info.segments]


def test_private_models_never_share_a_segment_with_other_models(start_shared, tiny_model, shared_dir):
    """A client maps whole segments: sharing one would show it another model's experts."""
    d = start_shared()
    public_a = copy_model(tiny_model, shared_dir, 0o644, "a.gguf")
    public_b = copy_model(tiny_model, shared_dir, 0o644, "b.gguf")
    private = copy_model(tiny_model, shared_dir, 0o600, "private.gguf")
    with d.client() as c:
        h = c.open_model(private)
        with h.acquire(0, [1]):  # private experts resident in its segment
            pass
        private_ids = {s.class_id for s in h.info.segments}
    seen = as_peer(NOBODY, NOBODY, _class_ids, d.socket, public_a).result
    assert seen and not set(seen) & private_ids
    assert as_peer(NOBODY, NOBODY, _class_ids, d.socket, public_b).result == seen  # public ones share


def test_relative_and_nul_paths_are_refused_by_the_daemon(daemon, tiny_model, tmp_path, monkeypatch):
    with daemon.client() as c:
        for bad in ("model.gguf", "../x.gguf", "/tmp/a\0b"):
            with pytest.raises(errors.BadRequest):
                c.request(m.OpenModel(bad), fds=True)
        monkeypatch.chdir(os.path.dirname(tiny_model))  # the client makes a relative path absolute
        h = c.open_model(os.path.basename(tiny_model))
        assert h.path == os.path.realpath(tiny_model)


def _my_view(sock: str) -> tuple:
    with Client(sock, "viewer") as c:
        s = c.stats()
        if os.getuid() != 0:  # a tenant sees only its own connections; the operator all
            assert s["clients"] and all(r["uid"] == os.getuid() for r in s["clients"])
        return sorted(t["uid"] for t in s["tenants"]), sorted(os.path.basename(r["path"]) for r in s["models"])


def test_a_tenant_sees_only_its_own_row_and_models_it_could_open(start_shared, tiny_model, shared_dir):
    d = start_shared()
    public = copy_model(tiny_model, shared_dir, 0o644, "public.gguf")
    private = copy_model(tiny_model, shared_dir, 0o600, "private.gguf")
    with d.client("root-engine") as c:
        c.open_model(private)
        c.open_model(public)
        assert as_peer(NOBODY, NOBODY, _my_view, d.socket) == Outcome(result=([NOBODY], ["public.gguf"]))
        tenants, models = _my_view(d.socket)  # the operator sees everything
        assert tenants == [0, NOBODY] and models == ["private.gguf", "public.gguf"]
