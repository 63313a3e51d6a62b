"""Directory handles: opendir, readdir / readdirplus with stable cookies, fsyncdir, releasedir.

Cookies are positions in a listing taken once per directory handle (again
when the caller rewinds to 0), so entries created or removed during the
listing cause neither skips nor duplicates (FUSE-NOTES 6). READDIRPLUS
entries carry a lookup each, taken only once the entry is sure to fit the
reply. FUSE thread only.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tierfs.fuse import access
from tierfs.fuse.handles import DirHandle
from tierfs.fuse.inodes import proc
from tierfs.fuse.parts import TableOps


@dataclass(frozen=True, slots=True)
class DirEntry:
    """One readdir entry. ``nodeid`` is 0 for entries that carry no lookup ('.' and '..')."""

    name: bytes
    cookie: int
    nodeid: int
    st: os.stat_result | None
    mode: int


class DirOps(TableOps):
    """The directory-handle operations of the namespace.

    Args:
        inodes, handles: the namespace's tables.
    """

    def opendir(self, nodeid: int) -> DirHandle:
        """opendir(3): the listing is taken on the first readdir.

        Raises:
            OSError: ENOTDIR, ESTALE for an unknown node id.
        """
        inode = self._inodes.directory(nodeid)
        fd = os.open(proc(self._fd_of(inode)), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        return self._handles.new_dir(inode, fd)

    def readdir(
        self, fh: int, offset: int, plus: bool, fits: Callable[[bytes], bool]
    ) -> Iterator[DirEntry]:
        """Yield entries after cookie ``offset``.

        Cookies are positions in a listing taken once per directory handle
        (again when the caller rewinds to 0), so entries created or removed
        during the listing cause neither skips nor duplicates (FUSE-NOTES 6).
        ``fits(name)`` is consulted before an entry is yielded, and the
        listing stops at the first that does not fit the reply. With
        ``plus`` each yielded entry (other than '.' and '..') carries a
        lookup, taken only after ``fits`` said yes.

        Raises:
            OSError: EBADF for an unknown directory handle.
        """
        handle = self._handles.directory(fh)
        if not handle.listed or offset == 0:
            handle.names = [*access.DOTS, *(os.fsencode(n) for n in os.listdir(handle.fd))]
            handle.listed = True
        inodes = self._inodes
        parent = handle.inode
        for index in range(offset, len(handle.names)):
            name = handle.names[index]
            cookie = index + 1
            if not fits(name):
                return
            if name in access.DOTS:
                yield DirEntry(name, cookie, 0, None, stat.S_IFDIR)
                continue
            try:
                st = os.stat(name, dir_fd=handle.fd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed since the listing was taken
            if not plus:
                yield DirEntry(name, cookie, 0, st, st.st_mode)
                continue
            known = inodes.known(st)
            if known is not None and known is not inodes.root:
                known.lookups += 1  # one stat, no descriptor needed
                yield DirEntry(name, cookie, known.nodeid, st, st.st_mode)
                continue
            try:
                fd, st = inodes.open_child(parent, name)
            except FileNotFoundError:
                continue
            inode = inodes.learn(parent, name, fd, st)
            yield DirEntry(name, cookie, inode.nodeid, st, st.st_mode)

    def fsyncdir(self, fh: int) -> None:
        """fsync(2) of a directory (EBADF for an unknown handle)."""
        os.fsync(self._handles.directory(fh).fd)

    def releasedir(self, fh: int) -> None:
        """closedir(3) (never raises); the inode is dropped if the kernel forgot it."""
        handle = self._handles.release_dir(fh)
        if handle is not None:
            self._inodes.drop_if_unused(handle.inode)
