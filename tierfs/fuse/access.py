"""Permission and name rules of the namespace, as pure functions over plain values.

The kernel checks mode bits itself (``default_permissions``, see
:class:`tierfs.fuse.session.MountOptions`); these are the few checks the
daemon has to make on its own:

* a CREATE that finds a file another process created meanwhile opens it as
  it is, so the caller needs the permission its mode bits give
  (:func:`check_open_access`);
* writes by a caller without CAP_FSETID clear set-user-ID and set-group-ID
  (:func:`kill_bits`, Linux's ``should_remove_suid``);
* names the daemon manages (``.tierfs/``) are read-only for clients
  (:func:`is_reserved_child`, :func:`check_mutable`, EPERM);
* a name is one path component (:func:`check_name`, EINVAL).

Errors are ``OSError`` with a POSIX errno, as the FUSE layer replies them.
"""

from __future__ import annotations

import errno
import os
import stat

#: read, write: the ``need`` bits of :func:`needed_bits` (as in an ``rwx`` triplet)
MAY_READ = 4
MAY_WRITE = 2


def opens_for_write(flags: int) -> bool:
    """True if open(2) ``flags`` may change the file: a writing access mode or O_TRUNC."""
    return (flags & os.O_ACCMODE) != os.O_RDONLY or bool(flags & os.O_TRUNC)


def needed_bits(flags: int) -> int:
    """The ``rwx`` bits (MAY_READ | MAY_WRITE) an open with ``flags`` needs."""
    need = 0
    acc = flags & os.O_ACCMODE
    if acc in (os.O_RDONLY, os.O_RDWR):
        need |= MAY_READ
    if acc in (os.O_WRONLY, os.O_RDWR) or flags & os.O_TRUNC:
        need |= MAY_WRITE
    return need


def may_open(mode: int, owner: int, group: int, uid: int, gid: int, flags: int) -> bool:
    """May ``uid``/``gid`` open a file of ``mode`` owned by ``owner``/``group`` with ``flags``?

    The mode-bit rule of POSIX: the owner's triplet for the owner, else the
    group's for the file's group, else the others'; root may always. FUSE
    does not tell the caller's supplementary groups, so only the primary
    group ``gid`` counts.
    """
    if uid == 0:
        return True
    if owner == uid:
        bits = (mode >> 6) & 7
    elif group == gid:
        bits = (mode >> 3) & 7
    else:
        bits = mode & 7
    need = needed_bits(flags)
    return bits & need == need


def check_open_access(st: os.stat_result, uid: int, gid: int, flags: int) -> None:
    """:func:`may_open` for the object ``st`` describes.

    Raises:
        OSError: EACCES if denied.
    """
    if not may_open(st.st_mode, st.st_uid, st.st_gid, uid, gid, flags):
        raise OSError(errno.EACCES, "permission denied")


def kill_bits(mode: int) -> int:
    """The mode bits a write by a caller without CAP_FSETID clears (Linux's rule).

    Set-user-ID always; set-group-ID only together with group execute (without
    it the bit means mandatory locking, which a write keeps).
    """
    kill = mode & stat.S_ISUID
    if mode & stat.S_ISGID and mode & stat.S_IXGRP:
        kill |= stat.S_ISGID
    return kill


#: the names a directory lists that are no entries of their own
DOTS = (b".", b"..")


def check_name(name: bytes) -> None:
    """A name must be one path component, not ``.`` or ``..``.

    On the request path, call it only when ``b"/" in name or name in DOTS``
    (the test inline, the error here).

    Raises:
        OSError: EINVAL otherwise.
    """
    if b"/" in name or name in DOTS:
        raise OSError(errno.EINVAL, "invalid name")


def is_reserved_child(
    parent_reserved: bool, parent_is_root: bool, name: bytes | None, reserved: frozenset[bytes]
) -> bool:
    """Does ``name`` in that parent lie under a daemon-managed name?

    True below a reserved directory, and for the reserved top-level names
    themselves (``reserved``, e.g. ``{b".tierfs"}``) directly in the root.
    """
    return parent_reserved or (parent_is_root and name in reserved)


def check_mutable(
    parent_reserved: bool, parent_is_root: bool, name: bytes | None, reserved: frozenset[bytes]
) -> None:
    """Clients may not create, remove or rename ``name`` where :func:`is_reserved_child` holds.

    Raises:
        OSError: EPERM ("managed by tierfs").
    """
    if parent_reserved or (parent_is_root and name in reserved):  # is_reserved_child, inline
        raise managed_error()


def managed_error() -> OSError:
    """The error for a client changing an object under a daemon-managed name (EPERM).

    Use as ``if inode.reserved: raise managed_error()`` (the test stays inline
    on the request path).
    """
    return OSError(errno.EPERM, "managed by tierfs")
