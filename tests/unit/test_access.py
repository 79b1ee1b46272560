"""The peer permission check, judged like the kernel would (mode bits and POSIX ACLs)."""

from __future__ import annotations

import os

import pytest

from moed.daemon.access import Peer, R, X, check_roots, peer_identity, permits
from moed.protocol import errors

U = 0xFFFFFFFF


def st(mode: int, uid: int = 0, gid: int = 0) -> os.stat_result:
    return os.stat_result((0o100000 | mode, 1, 1, 1, uid, gid, 0, 0, 0, 0))


def peer(uid: int, *gids: int) -> Peer:
    return Peer(1, uid, frozenset(gids or (uid,)))


def test_mode_bits_owner_group_other():
    f = st(0o640, uid=10, gid=20)
    assert permits(peer(10), f, R)
    assert permits(peer(11, 20), f, R)
    assert not permits(peer(12, 21), f, R)
    assert not permits(peer(10), st(0o040, uid=10, gid=10), R)  # owner class wins, like the kernel
    assert permits(peer(0), st(0o000), R)  # root reads anything


def test_acl_named_user_masked_groups_and_other():
    f = st(0o640, uid=10, gid=20)
    acl = [(1, 6, U), (2, 4, 30), (2, 4, 31), (4, 4, U), (8, 4, 40), (0x10, 0, U), (0x20, 0, U)]
    assert permits(peer(10), f, R, acl)
    assert not permits(peer(30), f, R, acl)  # mask 0 removes the grant
    acl[5] = (0x10, 4, U)
    assert permits(peer(30), f, R, acl)
    assert permits(peer(50, 40), f, R, acl)  # named group
    assert not permits(peer(50, 41), f, R, acl)  # other: ---
    assert permits(peer(50, 20), f, R, acl)  # owning group


def test_search_bit_on_directories():
    d = os.stat_result((0o040000 | 0o750, 1, 1, 1, 10, 20, 0, 0, 0, 0))
    assert permits(peer(11, 20), d, X)
    assert not permits(peer(12), d, X)


def test_peer_identity_reads_proc_and_falls_back():
    me = peer_identity(os.getpid(), 999, 999)
    assert me.uid == os.getuid() and os.getgid() in me.gids
    gone = peer_identity(2**22 + 12345, 7, 8)
    assert gone == Peer(2**22 + 12345, 7, frozenset([8]))


def test_model_roots(tmp_path):
    check_roots(str(tmp_path / "a" / "m.gguf"), "m", [str(tmp_path / "a")])
    check_roots("/anything", "m", [])
    with pytest.raises(errors.PermissionDenied):
        check_roots(str(tmp_path / "ab" / "m.gguf"), "m", [str(tmp_path / "a")])
