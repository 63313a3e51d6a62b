"""The tables every group of namespace operations works on, bound once.

:class:`~tierfs.fuse.dirs.DirOps` needs the inode and handle tables;
:class:`~tierfs.fuse.attrs.AttrOps` and :class:`~tierfs.fuse.files.FileOps`
also change data, so they get the RAM budget accounting, the agent's event
sink and the kernel link too. The bound methods are looked up once here
because the request path calls them many times per FUSE request. FUSE thread
only.
"""

from __future__ import annotations

from tierfs.fuse.events import FsEvents
from tierfs.fuse.handles import HandleTable
from tierfs.fuse.inodes import InodeTable
from tierfs.fuse.kernel import KernelLink
from tierfs.fuse.remote import NoRemoteFiles, RemoteFiles
from tierfs.fuse.space import Space


class TableOps:
    """Base of an operations group that reads the inode and handle tables.

    Args:
        inodes: the namespace's inode table (node id -> :class:`~tierfs.fuse.inodes.Inode`).
        handles: the namespace's open file and directory handles.
    """

    def __init__(self, inodes: InodeTable, handles: HandleTable) -> None:
        self._inodes = inodes
        self._handles = handles
        self._inode = inodes.get
        self._fd_of = inodes.fd_of
        self._file = handles.file


class DataOps(TableOps):
    """Base of an operations group that also changes what the files hold.

    Args:
        inodes, handles: as :class:`TableOps`.
        space: the RAM budget accounting (ENOSPC before a write that does not fit).
        events: told when an entry changed (sealing follows it).
        kernel: the link to the FUSE session (cache invalidation).
        remote: other ranks' files in the view (read-only; fetched on first open).
    """

    def __init__(
        self,
        inodes: InodeTable,
        handles: HandleTable,
        space: Space,
        events: FsEvents,
        kernel: KernelLink,
        remote: RemoteFiles | None = None,
    ) -> None:
        super().__init__(inodes, handles)
        self._space = space
        self._events = events
        self._kernel = kernel
        self._remote: RemoteFiles = remote if remote is not None else NoRemoteFiles()
