"""Attributes of inodes: stat, SETATTR (chmod, chown, truncate, utimens), readlink, xattrs, statfs.

Every change goes to the backing object through its ``O_PATH`` descriptor
(``/proc/self/fd`` or an ``AT_EMPTY_PATH`` call), so it follows the object
across renames. Objects under daemon-managed names refuse changes (EPERM).
FUSE thread only.
"""

from __future__ import annotations

import errno
import os
import stat

from tierfs.core import syscalls
from tierfs.fuse import access
from tierfs.fuse.handles import Handle
from tierfs.fuse.inodes import Inode, proc
from tierfs.fuse.kernel import KernelLink
from tierfs.fuse.parts import DataOps
from tierfs.store.ramstore import StatFs


def clear_suidgid(kernel: KernelLink, inode: Inode, fd: int) -> None:
    """Clear the :func:`~tierfs.fuse.access.kill_bits` of ``inode``'s file (open as ``fd``).

    Regular files only. The kernel's cached attributes of the inode are
    invalidated afterwards, so the new mode shows at once.
    """
    mode = os.fstat(fd).st_mode
    kill = access.kill_bits(mode)
    if not kill or not stat.S_ISREG(mode):
        return
    os.chmod(proc(fd), stat.S_IMODE(mode) & ~kill)
    if kernel.inval_inode is not None:
        kernel.inval_inode(inode.nodeid)


class AttrOps(DataOps):
    """The attribute operations of the namespace.

    Args:
        inodes, handles, space: the namespace's tables and budget accounting.
        events: told when a truncate, chmod or chown changed an entry.
        kernel: the link to the FUSE session (attribute invalidation).
    """

    def getattr(self, nodeid: int, fh: int | None = None) -> tuple[Inode, os.stat_result]:
        """``stat`` of an inode (via the open file ``fh`` if given and known).

        Raises:
            OSError: ESTALE for an unknown node id.
        """
        inode = self._inode(nodeid)
        if fh is not None:
            handle = self._handles.get(fh)
            if isinstance(handle, Handle):
                return inode, os.fstat(handle.fd)
        return inode, os.fstat(self._fd_of(inode))

    def setattr(
        self,
        nodeid: int,
        fh: int | None,
        *,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        size: int | None = None,
        atime_ns: int | None = None,
        mtime_ns: int | None = None,
        atime_now: bool = False,
        mtime_now: bool = False,
        kill_suidgid: bool = False,
    ) -> os.stat_result:
        """chmod/chown/truncate/utimens in one call, as FUSE SETATTR delivers them.

        ``size`` in bytes, times in nanoseconds since the epoch. ``kill_suidgid``
        (a truncate or chown by a caller without CAP_FSETID): clear the
        set-user-ID and set-group-ID bits afterwards, as Linux does.

        A size change allocates nothing on tmpfs (growing leaves a hole), so it
        is not checked against the budget.

        Raises:
            OSError: EPERM under reserved names, EISDIR for truncating a directory,
                EINVAL for truncating other non-regular files, EOPNOTSUPP for
                chmod of a symlink, EROFS for a size, mode or owner change of
                another rank's file (:mod:`tierfs.fuse.remote`).
        """
        inodes = self._inodes
        inode = inodes.get(nodeid)
        if inode.reserved:
            raise access.managed_error()
        if (size, mode, uid, gid) != (None, None, None, None) and self._remote.is_remote(inode.ino):
            raise OSError(errno.EROFS, "another rank's file of a sealed step")
        handle = self._handles.get(fh) if fh is not None else None
        if size is not None:
            if stat.S_ISDIR(inode.mode):
                raise OSError(errno.EISDIR, "is a directory")
            if not stat.S_ISREG(inode.mode):
                raise OSError(errno.EINVAL, "not a regular file")
            self._events.opening_for_write(inode.ino)
            before = self._space.allocated(self._fd_of(inode))
            if isinstance(handle, Handle) and handle.writable:
                os.ftruncate(handle.fd, size)
            else:
                os.truncate(proc(self._fd_of(inode)), size)
            self._space.shrunk(self._fd_of(inode), before)
        if mode is not None:
            if stat.S_ISLNK(inode.mode):
                raise OSError(errno.EOPNOTSUPP, "symlink mode")
            os.chmod(proc(self._fd_of(inode)), stat.S_IMODE(mode))
        if uid is not None or gid is not None:
            syscalls.fchown_empty(
                self._fd_of(inode), -1 if uid is None else uid, -1 if gid is None else gid
            )
        if atime_ns is not None or mtime_ns is not None or atime_now or mtime_now:
            syscalls.utimens_empty(self._fd_of(inode), atime_ns, mtime_ns, atime_now, mtime_now)
        if kill_suidgid:
            clear_suidgid(self._kernel, inode, self._fd_of(inode))
        if size is not None or mode is not None or uid is not None or gid is not None:
            rel = inodes.relpath(inode)
            if rel:
                self._events.changed(rel)
        return os.fstat(self._fd_of(inode))

    def readlink(self, nodeid: int) -> bytes:
        """Target of a symlink.

        Raises:
            OSError: EINVAL if not a symlink, ESTALE for an unknown node id.
        """
        inode = self._inode(nodeid)
        if not stat.S_ISLNK(inode.mode):
            raise OSError(errno.EINVAL, "not a symlink")
        # readlinkat(fd, "") reads the symlink an O_PATH|O_NOFOLLOW fd refers to.
        return os.readlink(b"", dir_fd=self._fd_of(inode))

    def statfs(self) -> StatFs:
        """The RAM budget as statfs numbers."""
        return self._space.statfs()

    # ------------------------------------------------------------------ xattrs

    def _xattr_path(self, inode: Inode) -> bytes:
        if stat.S_ISLNK(inode.mode):
            raise OSError(errno.ENOTSUP, "no xattrs on symlinks")
        return proc(self._fd_of(inode))

    def getxattr(self, nodeid: int, name: bytes) -> bytes:
        """getxattr(2): ENODATA if absent, ENOTSUP where unsupported (symlinks)."""
        return os.getxattr(self._xattr_path(self._inode(nodeid)), name)

    def setxattr(self, nodeid: int, name: bytes, value: bytes, flags: int) -> None:
        """setxattr(2) with XATTR_CREATE/XATTR_REPLACE flags; EPERM under reserved names."""
        inode = self._inode(nodeid)
        if inode.reserved:
            raise access.managed_error()
        os.setxattr(self._xattr_path(inode), name, value, flags)

    def listxattr(self, nodeid: int) -> list[bytes]:
        """listxattr(2) as a list of names (none for symlinks)."""
        inode = self._inode(nodeid)
        if stat.S_ISLNK(inode.mode):
            return []
        return [os.fsencode(n) for n in os.listxattr(proc(self._fd_of(inode)))]

    def removexattr(self, nodeid: int, name: bytes) -> None:
        """removexattr(2); EPERM under reserved names, ENODATA if absent."""
        inode = self._inode(nodeid)
        if inode.reserved:
            raise access.managed_error()
        os.removexattr(self._xattr_path(inode), name)
