"""Who may open a model: the peer's own file permissions and the configured roots.

The daemon often runs with more privilege than its clients, so it must not
become a way to read files a client could not read itself. A peer may open a
model only if it could: every directory on the resolved path searchable (x)
and every file readable (r), judged with the peer's filesystem uid, gid and
supplementary groups read from /proc/<pid>/status (the pid from SO_PEERCRED),
never the daemon's. POSIX ACLs (system.posix_acl_access) are honoured. Root
peers (fsuid 0) may read anything, as the kernel would let them.

The check is made on the path before the daemon opens anything, and again on
the inodes the daemon actually opened (`check_open_files`): a path swapped
between the check and the open is refused, not served.

`model_roots`, when configured, further restricts models to files under those
directories (after resolving symlinks).
"""

from __future__ import annotations

import errno
import os
import struct
from dataclasses import dataclass

from moed.protocol import errors

R, X = 4, 1

_ACL_XATTR = "system.posix_acl_access"
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_GROUP, _ACL_MASK, _ACL_OTHER = 1, 2, 4, 8, 0x10, 0x20


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int  # filesystem uid (what the kernel checks on open)
    gids: frozenset  # filesystem gid plus supplementary groups


def peer_identity(pid: int, uid: int, gid: int) -> Peer:
    """The peer's filesystem identity; falls back to SO_PEERCRED's uid/gid if /proc is gone."""
    fields: dict[str, list[int]] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Uid", "Gid", "Groups"):
                    fields[key] = [int(x) for x in rest.split()]
    except (OSError, ValueError):
        return Peer(pid, uid, frozenset([gid]))
    if "Uid" not in fields or "Gid" not in fields:
        return Peer(pid, uid, frozenset([gid]))
    fsuid, fsgid = fields["Uid"][3], fields["Gid"][3]
    return Peer(pid, fsuid, frozenset([fsgid, *fields.get("Groups", [])]))


def _acl(path_or_fd) -> list[tuple[int, int, int]] | None:
    try:
        raw = os.getxattr(path_or_fd, _ACL_XATTR)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return None
        raise
    if len(raw) < 4 or (len(raw) - 4) % 8:
        return []  # malformed: judged by the mode bits alone
    return [struct.unpack_from("<HHI", raw, off) for off in range(4, len(raw), 8)]


def permits(peer: Peer, st: os.stat_result, want: int, acl=None) -> bool:
    """Would the kernel grant `want` (R and/or X bits) on this inode to the peer?"""
    if peer.uid == 0:
        return True
    mode = st.st_mode
    if acl:
        return _acl_permits(peer, st, want, acl)
    if peer.uid == st.st_uid:
        bits = (mode >> 6) & 7
    elif st.st_gid in peer.gids:
        bits = (mode >> 3) & 7
    else:
        bits = mode & 7
    return bits & want == want


def _acl_permits(peer: Peer, st: os.stat_result, want: int, acl) -> bool:
    by_tag: dict[int, list[tuple[int, int]]] = {}
    for tag, perm, ident in acl:
        by_tag.setdefault(tag, []).append((perm, ident))
    mask = by_tag.get(_ACL_MASK, [(7, 0)])[0][0]
    if peer.uid == st.st_uid:
        return _grants(by_tag.get(_ACL_USER_OBJ, [(0, 0)])[0][0], want)
    for perm, ident in by_tag.get(_ACL_USER, []):
        if ident == peer.uid:
            return _grants(perm & mask, want)
    groups = [perm for perm, _ in by_tag.get(_ACL_GROUP_OBJ, []) if st.st_gid in peer.gids]
    groups += [perm for perm, ident in by_tag.get(_ACL_GROUP, []) if ident in peer.gids]
    if groups:
        return any(_grants(p & mask, want) for p in groups)
    return _grants(by_tag.get(_ACL_OTHER, [(0, 0)])[0][0], want)


def _grants(perm: int, want: int) -> bool:
    return perm & want == want


def _parents(real_path: str):
    """Every directory above an absolute path, from / down."""
    parts = real_path.split("/")
    for depth in range(1, len(parts)):
        yield "/".join(parts[:depth]) or "/"


def check_readable(peer: Peer, real_path: str, shown: str) -> os.stat_result:
    """Raise PermissionDenied unless the peer could open `real_path` for reading.

    Returns the file's stat (the inode the check judged). A missing file is
    reported as missing only once the peer could search every directory above it.
    """
    for d in _parents(real_path):
        try:
            st = os.stat(d)
        except OSError as exc:
            raise errors.BadModelFile(f"{shown}: {exc.strerror}") from None
        if not permits(peer, st, X, _acl(d)):
            raise errors.PermissionDenied(f"{shown}: uid {peer.uid} may not search {d}")
    try:
        st = os.stat(real_path)
        acl = _acl(real_path)
    except FileNotFoundError:
        raise errors.BadModelFile(f"{shown}: no such file") from None
    except OSError as exc:
        raise errors.BadModelFile(f"{shown}: {exc.strerror}") from None
    if not permits(peer, st, R, acl):
        raise errors.PermissionDenied(f"{shown}: uid {peer.uid} may not read this file")
    return st


def check_open_files(peer: Peer, fds_and_paths) -> None:
    """The inodes the daemon opened must be ones the peer may read (closes a swap race)."""
    for fd, path in fds_and_paths:
        st = os.fstat(fd)
        if not permits(peer, st, R, _acl(fd)):
            raise errors.PermissionDenied(f"{path}: uid {peer.uid} may not read this file")


def check_roots(real_path: str, shown: str, roots: list[str]) -> None:
    """With `model_roots` configured, a model must resolve to a file under one of them."""
    if not roots:
        return
    for root in roots:
        base = os.path.realpath(root)
        if os.path.commonpath([base, real_path]) == base:
            return
    raise errors.PermissionDenied(f"{shown}: not under the configured model_roots ({', '.join(roots)})")


def world_readable(real_path: str) -> bool:
    """True if any local user could read the file: o+x on every directory, o+r on it, no ACLs.

    Models that are not share no RAM-tier segment with other models: a client
    maps whole segments, so a shared segment would show it other models' experts.
    """
    try:
        for d in _parents(real_path):
            if not os.stat(d).st_mode & 0o001 or _acl(d) is not None:
                return False
        return bool(os.stat(real_path).st_mode & 0o004) and _acl(real_path) is None
    except OSError:
        return False
