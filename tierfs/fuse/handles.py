"""Open file and directory handles, and the FUSE passthrough backing ids of their inodes.

A FUSE ``fh`` names one open of the client; each is a real descriptor of the
backing file in ``<ram-dir>/view`` (:class:`Handle`) or directory
(:class:`DirHandle`). When the kernel granted passthrough, an open file's
data bypasses the daemon: the file is registered as a *backing file* and
every passthrough open of the inode shares that backing id until its last
handle is closed. Otherwise the daemon serves the data, with the page cache
where that is safe (``keep_cache``) and ``direct_io`` for write-only opens
(FUSE-NOTES trap 3: no mmap can happen there) and generated files.

FUSE thread only.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
from dataclasses import dataclass, field

from tierfs.fuse import access
from tierfs.fuse.inodes import Inode
from tierfs.fuse.kernel import KernelLink

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class Handle:
    """An open file: ``fd`` is a real descriptor of the backing file.

    Attributes:
        fh: the FUSE file handle (never reused within a session).
        flags: the open(2) flags the client gave.
        writable: opened for writing (counted in ``Inode.writers``).
        passthrough: the kernel moves the data (``inode.backing_id``).
        direct_io, keep_cache: the FOPEN flags of a daemon-served open.
        content: a daemon-generated file's bytes as generated at this open
            (``Inode.virtual``): reads are served from them (None: from ``fd``).
        partial: another rank's file opened before all its bytes were here: each
            read asks whether its range is verified yet (until the file is).
    """

    fh: int
    inode: Inode
    fd: int
    flags: int
    writable: bool
    passthrough: bool
    direct_io: bool = False
    keep_cache: bool = False
    content: bytes | None = None
    partial: bool = False


@dataclass(eq=False, slots=True)
class DirHandle:
    """An open directory with a listing taken at the first readdir (stable readdir cookies)."""

    fh: int
    inode: Inode
    fd: int
    names: list[bytes] = field(default_factory=list)
    listed: bool = False


class HandleTable:
    """Every open handle of the namespace, by ``fh``.

    Args:
        kernel: the link to the FUSE session (passthrough granted, backing registry).
    """

    def __init__(self, kernel: KernelLink) -> None:
        self.kernel = kernel
        #: every open handle by fh (read it, never change it: the session counts it per request)
        self.open: dict[int, Handle | DirHandle] = {}
        self._handles = self.open
        self._next_fh = itertools.count(1)

    # ------------------------------------------------------------------ finding handles

    def get(self, fh: int) -> Handle | DirHandle | None:
        """The handle ``fh`` of either kind, or None."""
        return self._handles.get(fh)

    def file(self, fh: int) -> Handle:
        """The open file ``fh``.

        Raises:
            OSError: EBADF if unknown or a directory handle.
        """
        h = self._handles.get(fh)
        if not isinstance(h, Handle):
            raise OSError(errno.EBADF, "bad file handle")
        return h

    def directory(self, fh: int) -> DirHandle:
        """The open directory ``fh``.

        Raises:
            OSError: EBADF if unknown or a file handle.
        """
        h = self._handles.get(fh)
        if not isinstance(h, DirHandle):
            raise OSError(errno.EBADF, "bad directory handle")
        return h

    def count(self) -> int:
        """Handles open now (each holds one descriptor)."""
        return len(self._handles)

    def open_for_write(self) -> int:
        """Number of open file handles that may write (status, tests)."""
        return sum(1 for h in self._handles.values() if isinstance(h, Handle) and h.writable)

    def bytes_open_for_write(self) -> int:
        """Bytes allocated in the files that open handles may write (``st_blocks`` of
        each backing file, once per inode): it grows while a client writes, also
        through passthrough, which the daemon never sees."""
        seen: dict[int, int] = {}
        for h in self._handles.values():
            if isinstance(h, Handle) and h.writable and h.inode.ino not in seen:
                try:
                    seen[h.inode.ino] = os.fstat(h.fd).st_blocks * 512
                except OSError:
                    seen[h.inode.ino] = 0
        return sum(seen.values())

    # ------------------------------------------------------------------ opening

    def new_file(self, inode: Inode, fd: int, flags: int, daemon: bool = False) -> Handle:
        """A handle for ``fd``, a descriptor of ``inode``'s backing file opened with ``flags``.

        Takes ownership of ``fd``. Decides how the data moves: passthrough if
        the kernel granted it and this inode may use it (:meth:`_passthrough_allowed`),
        else the daemon with ``direct_io`` or ``keep_cache``. ``daemon``: never
        passthrough (a file whose bytes are still being fetched).
        """
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        handle = Handle(next(self._next_fh), inode, fd, flags, writable, passthrough=False)
        if inode.virtual is not None:
            handle.direct_io = True
        elif not daemon and (
            inode.backing_id
            or (self._passthrough_allowed(inode, fd) and self._register_backing(inode, fd))
        ):
            # every passthrough open of one inode shares its backing id, also
            # after passthrough was turned off for new inodes
            handle.passthrough = True
        elif (flags & os.O_ACCMODE) == os.O_WRONLY:
            # FUSE-NOTES trap 3: direct_io only where no mmap can happen.
            handle.direct_io = True
        else:
            handle.keep_cache = True
        inode.handles += 1
        if writable:
            inode.writers += 1
        self._handles[handle.fh] = handle
        return handle

    def new_dir(self, inode: Inode, fd: int) -> DirHandle:
        """A handle for ``fd``, a plain descriptor of directory ``inode`` (takes ownership)."""
        handle = DirHandle(next(self._next_fh), inode, fd)
        inode.handles += 1
        self._handles[handle.fh] = handle
        return handle

    def _passthrough_allowed(self, inode: Inode, fd: int) -> bool:
        """May this open of ``inode`` (open as ``fd``) bypass the daemon?

        Not while the inode has handles the daemon serves (the kernel refuses
        to mix passthrough and cached opens of one inode), and not for a file
        whose set-user-ID / set-group-ID bits a write must clear: such writes
        have to reach the daemon (see ``FileOps.kill_suidgid``).
        """
        if not self.kernel.passthrough:
            return False
        if inode.handles > 0:  # no backing id (the caller checked): daemon-served handles
            return False
        return not access.kill_bits(os.fstat(fd).st_mode)

    def _register_backing(self, inode: Inode, fd: int) -> bool:
        """Register ``fd`` as ``inode``'s passthrough backing file; False to serve it here.

        A failed registration (EPERM without CAP_SYS_ADMIN; ELOOP when the
        ram-dir is on a stacked filesystem such as overlayfs or another FUSE
        mount) turns passthrough off for the session (the session's
        ``register_backing`` does that), and this open, like every later one,
        is served through the daemon instead of failing.
        """
        register = self.kernel.register_backing
        if not self.kernel.passthrough or register is None:
            return False
        try:
            inode.backing_id = register(fd)
        except OSError:
            self.kernel.passthrough = False
            return False
        return True

    # ------------------------------------------------------------------ closing

    def release_file(self, fh: int) -> Handle | None:
        """Close file handle ``fh``: its descriptor, its inode's counts, the backing id.

        The backing id is dropped with the inode's last handle. Returns the
        closed handle, or None if ``fh`` named no open file (never raises).
        The caller still owes the inode's follow-ups (budget, events, drop).
        """
        handle = self._handles.get(fh)
        if not isinstance(handle, Handle):
            return None  # unknown, or a directory's: left as it is
        del self._handles[fh]
        inode = handle.inode
        try:
            os.close(handle.fd)
        except OSError:
            pass
        inode.handles -= 1
        if handle.writable:
            inode.writers -= 1
        close = self.kernel.close_backing
        if inode.handles == 0 and inode.backing_id and close is not None:
            bid, inode.backing_id = inode.backing_id, 0
            try:
                close(bid)
            except OSError:
                log.warning("closing passthrough backing %d failed", bid, exc_info=True)
        return handle

    def release_dir(self, fh: int) -> DirHandle | None:
        """Close directory handle ``fh``; None if it named no open directory (never raises)."""
        handle = self._handles.get(fh)
        if not isinstance(handle, DirHandle):
            return None  # unknown, or a file's: left as it is
        del self._handles[fh]
        try:
            os.close(handle.fd)
        except OSError:
            pass
        handle.inode.handles -= 1
        return handle

    def close_all(self) -> None:
        """Close every handle's descriptor without any follow-up (the namespace is closing)."""
        fds = [h.fd for h in self._handles.values()]
        self._handles.clear()
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
