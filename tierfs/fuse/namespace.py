"""The namespace: the tree of names over the RAM store's view, composed of its parts.

This package layer is FUSE-free: it speaks in node ids, names (bytes), open
flags and ``os.stat_result`` and raises ``OSError`` with a POSIX errno. The
FUSE layer (:mod:`tierfs.fuse.operations`) translates requests onto it.

Every client-visible object is a real object in ``<ram-dir>/view`` on tmpfs,
so POSIX behaviour (rename atomicity, unlink of open files, hard links,
holes, xattrs, ENOTEMPTY...) is the kernel's own. The parts, one job each:

* :mod:`~tierfs.fuse.inodes` - node ids, lookup counts, forget, the ``O_PATH``
  descriptor pool (:class:`~tierfs.fuse.inodes.InodeTable`);
* :mod:`~tierfs.fuse.handles` - open file and directory handles, passthrough
  backing ids (:class:`~tierfs.fuse.handles.HandleTable`);
* :mod:`~tierfs.fuse.access` - permission and reserved-name rules (pure);
* :mod:`~tierfs.fuse.space` - the RAM budget's accounting (managed mode);
* :mod:`~tierfs.fuse.files` - the data path of open files;
* :mod:`~tierfs.fuse.attrs` - stat, SETATTR, readlink, xattrs, statfs;
* :mod:`~tierfs.fuse.dirs` - directory handles and readdir;
* this module - the tree operations that create, remove and rename names
  (lookup, create, mkdir, mknod, symlink, link, unlink, rmdir, rename), the
  daemon's own changes (:meth:`Namespace.notify_changed`), and the
  :class:`Namespace` that builds the parts and offers their operations under
  the names the FUSE handlers call (bound once at construction: no extra
  call per request).

Concurrency: everything runs on the single thread that serves FUSE requests
(the trio thread); nothing blocks for long (tmpfs syscalls only). Only
:meth:`Namespace.notify_changed` and ``Namespace.writers_of`` may be called
from other threads. The daemon's own changes to the view go through
:meth:`Namespace.notify_changed` so the kernel drops stale cache entries
(FIELD-NOTES 17).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable

from tierfs.core import syscalls
from tierfs.fuse import access
from tierfs.fuse.attrs import AttrOps, clear_suidgid
from tierfs.fuse.dirs import DirEntry, DirOps
from tierfs.fuse.events import FsEvents, NullEvents
from tierfs.fuse.files import BACKING_FLAGS, FileOps
from tierfs.fuse.handles import DirHandle, Handle, HandleTable
from tierfs.fuse.inodes import ROOT_ID, Inode, InodeTable, default_max_fds, proc
from tierfs.fuse.kernel import KernelLink
from tierfs.fuse.remote import Deferred, NoRemoteFiles, RemoteFiles
from tierfs.fuse.space import Space, SpaceBudget

__all__ = [
    "ROOT_ID",
    "DirEntry",
    "DirHandle",
    "FsEvents",
    "Handle",
    "Inode",
    "Namespace",
    "NullEvents",
]


class Namespace:
    """The namespace over ``view_dir`` (see the module docstring).

    Args:
        view_dir: the directory served as the mount root.
        budget: the RAM budget (managed-mode growth checks, statfs).
        events: receiver of namespace events (the node agent); default: none.
        reserved: top-level names the daemon owns; clients cannot modify them (EPERM).
        virtual: relative paths (bytes) whose content is generated when opened.
        controls: relative paths (bytes) under reserved names whose open for writing
            is a request to the daemon (the function is called on the FUSE thread and
            must not block); the file's bytes are the daemon's.
        max_fds: how many descriptors the namespace may hold (``O_PATH`` pool plus
            open handles) before it evicts; default: RLIMIT_NOFILE minus a reserve.
        remote: other ranks' files in the view (:mod:`tierfs.fuse.remote`);
            default: none.

    Attributes:
        kernel: the hooks the FUSE session fills in (passthrough, invalidations).
        entry_timeout, attr_timeout: kernel cache lifetimes of replies (seconds;
            set by the session from the mount options).
        inodes, handles, space, files, attrs, dirs: the parts.

    Raises:
        OSError: ``view_dir`` cannot be opened.
    """

    def __init__(
        self,
        view_dir: str,
        budget: SpaceBudget,
        events: FsEvents | None = None,
        reserved: frozenset[bytes] = frozenset(),
        virtual: dict[bytes, Callable[[], bytes]] | None = None,
        max_fds: int | None = None,
        remote: RemoteFiles | None = None,
        controls: dict[bytes, Callable[[], None]] | None = None,
    ) -> None:
        self.view_dir = os.path.abspath(view_dir)
        self._view_prefix = os.fsencode(self.view_dir) + b"/"
        self.budget = budget
        self.events: FsEvents = events if events is not None else NullEvents()
        self.reserved = reserved
        self.kernel = KernelLink()
        self.entry_timeout = 1.0
        self.attr_timeout = 1.0
        self.inodes = inodes = InodeTable(
            self.view_dir,
            reserved,
            dict(virtual or {}),
            max_fds if max_fds is not None else default_max_fds(),
            controls=dict(controls or {}),
        )
        self.root = inodes.root
        self.handles = handles = HandleTable(self.kernel)
        self.space = space = Space(budget, inodes)
        self.remote: RemoteFiles = remote if remote is not None else NoRemoteFiles()
        self.files = files = FileOps(inodes, handles, space, self.events, self.kernel, self.remote)
        self.attrs = attrs = AttrOps(inodes, handles, space, self.events, self.kernel, self.remote)
        self.dirs = dirs = DirOps(inodes, handles)
        # The parts' operations under the namespace's names, bound once: a FUSE
        # handler's ``ns.write(...)`` costs what a method of this class would.
        self.inode = inodes.get
        self._directory = inodes.directory
        self.fd_of = inodes.fd_of
        self.forget = inodes.forget
        self.relpath = inodes.relpath
        self.writers_of = inodes.writers_of
        self.nodeid_hint = inodes.nodeid_hint
        self.known_inodes = inodes.count
        self.handle = handles.file
        self.handles_open_for_write = handles.open_for_write
        self.bytes_open_for_write = handles.bytes_open_for_write
        self.open = files.open
        self.read_into = files.read_into
        self.write = files.write
        self.kill_suidgid = files.kill_suidgid
        self.flush = files.flush
        self.fsync = files.fsync
        self.release = files.release
        self.fallocate = files.fallocate
        self.lseek = files.lseek
        self.copy_file_range = files.copy_file_range
        self.getattr = attrs.getattr
        self.setattr = attrs.setattr
        self.readlink = attrs.readlink
        self.statfs = attrs.statfs
        self.getxattr = attrs.getxattr
        self.setxattr = attrs.setxattr
        self.listxattr = attrs.listxattr
        self.removexattr = attrs.removexattr
        self.opendir = dirs.opendir
        self.readdir = dirs.readdir
        self.fsyncdir = dirs.fsyncdir
        self.releasedir = dirs.releasedir

    @property
    def passthrough(self) -> bool:
        """New opens may use FUSE passthrough (granted at INIT, off after a failed registration)."""
        return self.kernel.passthrough

    @property
    def can_evict(self) -> bool:
        """``O_PATH`` descriptors can be evicted (the view's filesystem has file handles)."""
        return self.inodes.can_evict

    @property
    def max_fds(self) -> int:
        """Descriptors the namespace may hold before :meth:`trim_fds` evicts."""
        return self.inodes.max_fds

    # ------------------------------------------------------------------ descriptors

    def fds_held(self) -> int:
        """Descriptors the namespace holds now: ``O_PATH`` pool plus open handles."""
        return self.inodes.pooled() + self.handles.count()

    def trim_fds(self) -> int:
        """Evict least recently used ``O_PATH`` descriptors once past ``max_fds``.

        Returns at once (0) below the budget; see
        :meth:`tierfs.fuse.inodes.InodeTable.trim`. Call between requests.
        Returns the number evicted.
        """
        return self.inodes.trim(self.handles.count())

    def close(self) -> None:
        """Close every descriptor the namespace holds (it is unusable afterwards).

        Files unlinked while open stop counting against the budget.
        """
        self.handles.close_all()
        for inode in self.inodes.held():
            self.space.closed(inode)
        self.inodes.close()

    # ------------------------------------------------------------------ names

    def lookup(self, parent_id: int, name: bytes) -> tuple[Inode, os.stat_result]:
        """Resolve ``name`` in directory ``parent_id`` (adds one lookup).

        Raises:
            OSError: ENOENT if absent, ENOTDIR if the parent is not a directory,
                EINVAL for an invalid name, EXDEV for an object on another
                filesystem (a mount inside the RAM store).
            Deferred: absent, but another rank's file of that name is expected
                soon (:meth:`tierfs.fuse.remote.RemoteFiles.expected`); or another
                rank's file whose part may have been replaced since
                (:meth:`tierfs.fuse.remote.RemoteFiles.looking_up`).
        """
        inodes = self.inodes
        parent = inodes.directory(parent_id)
        if b"/" in name or name in access.DOTS:
            access.check_name(name)
        try:
            st = os.stat(name, dir_fd=inodes.fd_of(parent), follow_symlinks=False)
        except FileNotFoundError:
            rel = inodes.child_relpath(parent, name)
            wait = self.remote.expected(rel) if rel is not None else None
            if wait is not None:
                raise Deferred(wait) from None
            raise
        if st.st_dev != inodes.dev:
            raise OSError(errno.EXDEV, "foreign filesystem in the RAM store")
        if stat.S_ISREG(st.st_mode) and self.remote.is_remote(st.st_ino):
            wait = self.remote.looking_up(st.st_ino)
            if wait is not None:
                raise Deferred(wait)
        known = inodes.known(st)
        if known is not None:
            known.lookups += 1
            return known, st
        fd, st = inodes.open_child(parent, name)
        if st.st_dev != inodes.dev:
            os.close(fd)
            raise OSError(errno.EXDEV, "foreign filesystem in the RAM store")
        return inodes.learn(parent, name, fd, st), st

    def _changed(self, parent: Inode, name: bytes) -> None:
        rel = self.inodes.child_relpath(parent, name)
        if rel is not None:
            self.events.changed(rel)

    def notify_changed(self, relpath: str | bytes, wait: bool = False) -> None:
        """The daemon changed ``relpath`` in the view behind the kernel's back.

        Sends an entry invalidation so clients see the change at once. Safe to
        call from any thread. With ``wait`` the call returns only after the
        kernel processed it: use that from worker threads only, never from
        the FUSE thread (the kernel takes the parent directory's lock).
        """
        rel = os.fsencode(relpath).strip(b"/")
        parent_rel, _, name = rel.rpartition(b"/")
        inval = self.kernel.inval_entry
        if inval is None or not name:
            return
        if not parent_rel:
            inval(ROOT_ID, name, wait)
            return
        try:
            st = os.lstat(os.path.join(self._view_prefix, parent_rel))
        except OSError:
            return
        parent = self.inodes.by_ino(st.st_ino)
        if parent is not None:
            inval(parent.nodeid, name, wait)

    # ------------------------------------------------------------------ creating names

    def create(
        self,
        parent_id: int,
        name: bytes,
        flags: int,
        mode: int,
        uid: int,
        gid: int,
        kill_suidgid: bool = False,
    ) -> tuple[Inode, os.stat_result, Handle]:
        """open(2) with O_CREAT: returns the new (or existing) inode and a handle.

        The kernel sends CREATE after a lookup found no entry; if another
        process created the name in between (and O_EXCL is not set) the
        existing file is opened as it is: owner and mode stay, and the caller
        needs the permission the mode bits give it.

        Raises:
            OSError: EEXIST with O_EXCL, EACCES for a racing file the caller may
                not open, EPERM under reserved names, ENOSPC past the budget,
                EROFS writing another rank's file.
            Deferred: a racing file of another rank whose bytes are not here yet.
        """
        parent = self._directory(parent_id)
        access.check_mutable(parent.reserved, parent is self.root, name, self.reserved)
        if b"/" in name or name in access.DOTS:
            access.check_name(name)
        self.space.check_new_file()
        room = self.remote.creating()  # other ranks' cached files give way to a save
        if room is not None:
            raise Deferred(room)
        bflags = (flags & (BACKING_FLAGS | os.O_TRUNC)) | os.O_CLOEXEC | os.O_NOFOLLOW
        dirfd = self.fd_of(parent)
        created = True
        try:
            fd = os.open(name, bflags | os.O_CREAT | os.O_EXCL, stat.S_IMODE(mode), dir_fd=dirfd)
        except FileExistsError:
            if flags & os.O_EXCL:
                raise
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            access.check_open_access(st, uid, gid, flags)
            if self.remote.is_remote(st.st_ino):
                if access.opens_for_write(flags) or flags & os.O_TRUNC:
                    raise OSError(errno.EROFS, "another rank's file of a sealed step") from None
                fetch = self.remote.missing(st.st_ino)
                if fetch is not None:
                    raise Deferred(fetch) from None
            fd = os.open(name, bflags, dir_fd=dirfd)
            created = False
        try:
            if (
                not created
                and bflags & os.O_TRUNC
                and not self.space.native
                and os.fstat(fd).st_ino == st.st_ino
            ):  # the file stat saw: truncated
                self.space.shrunk(fd, st.st_blocks * 512)
            inode, st = self._finish_create(parent, name, uid, gid, fd=fd, chown=created)
            if inode.reserved:
                raise access.managed_error()
            if (flags & os.O_ACCMODE) != os.O_RDONLY:
                self.events.opening_for_write(inode.ino)
            if kill_suidgid and not created and bflags & os.O_TRUNC:
                clear_suidgid(self.kernel, inode, fd)
                st = os.fstat(fd)
            handle = self.handles.new_file(inode, fd, flags)
        except BaseException:
            os.close(fd)
            raise
        return inode, st, handle

    def _finish_create(
        self,
        parent: Inode,
        name: bytes,
        uid: int,
        gid: int,
        fd: int | None = None,
        chown: bool = True,
    ) -> tuple[Inode, os.stat_result]:
        """Give the new ``name`` the caller's owner (setgid parents their group) and learn it."""
        pst = os.fstat(self.fd_of(parent))
        owner = (uid, pst.st_gid if pst.st_mode & stat.S_ISGID else gid)
        if fd is None:
            opath, st = self.inodes.open_child(parent, name)
        else:
            opath, st = self._opath_of(fd, parent, name)
        try:
            if chown and (st.st_uid, st.st_gid) != owner:
                syscalls.fchown_empty(opath, *owner)
                st = os.fstat(opath)
        except OSError:
            os.close(opath)
            raise
        inode = self.inodes.learn(parent, name, opath, st)
        self._changed(parent, name)
        return inode, st

    def _opath_of(self, fd: int, parent: Inode, name: bytes) -> tuple[int, os.stat_result]:
        """An ``O_PATH`` descriptor of the object open as ``fd`` (just created as ``name``).

        Opened by name in the parent (a plain lookup), kept only if it is the
        same object; through ``/proc/self/fd`` (a slower magic-link walk) if
        the daemon renamed or replaced the name meanwhile.
        """
        want = os.fstat(fd).st_ino
        try:
            opath = os.open(
                name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd_of(parent)
            )
        except OSError:
            opath = -1
        if opath >= 0:
            st = os.fstat(opath)
            if st.st_ino == want:
                return opath, st
            os.close(opath)
        opath = os.open(proc(fd), os.O_PATH | os.O_CLOEXEC)
        return opath, os.fstat(opath)

    def mkdir(
        self, parent_id: int, name: bytes, mode: int, uid: int, gid: int
    ) -> tuple[Inode, os.stat_result]:
        """mkdir(2) of ``name`` owned by the caller (setgid directories pass their group on)."""
        parent = self._directory(parent_id)
        access.check_mutable(parent.reserved, parent is self.root, name, self.reserved)
        os.mkdir(name, stat.S_IMODE(mode), dir_fd=self.fd_of(parent))
        return self._finish_create(parent, name, uid, gid)

    def mknod(
        self, parent_id: int, name: bytes, mode: int, rdev: int, uid: int, gid: int
    ) -> tuple[Inode, os.stat_result]:
        """mknod(2): regular files, FIFOs, sockets (devices need CAP_MKNOD)."""
        parent = self._directory(parent_id)
        access.check_mutable(parent.reserved, parent is self.root, name, self.reserved)
        if stat.S_ISREG(mode):
            self.space.check_new_file()
        os.mknod(name, mode, rdev, dir_fd=self.fd_of(parent))
        return self._finish_create(parent, name, uid, gid)

    def symlink(
        self, parent_id: int, name: bytes, target: bytes, uid: int, gid: int
    ) -> tuple[Inode, os.stat_result]:
        """symlink(2): ``name`` in ``parent_id`` pointing at ``target`` (stored verbatim)."""
        parent = self._directory(parent_id)
        access.check_mutable(parent.reserved, parent is self.root, name, self.reserved)
        os.symlink(target, name, dir_fd=self.fd_of(parent))
        return self._finish_create(parent, name, uid, gid)

    def link(self, nodeid: int, parent_id: int, name: bytes) -> tuple[Inode, os.stat_result]:
        """link(2): a new name for an existing inode (EPERM for directories)."""
        inodes = self.inodes
        inode = inodes.get(nodeid)
        parent = inodes.directory(parent_id)
        access.check_mutable(parent.reserved, parent is self.root, name, self.reserved)
        if stat.S_ISDIR(inode.mode):
            raise OSError(errno.EPERM, "hard link to directory")
        if inode.reserved:
            raise access.managed_error()
        syscalls.link_empty(inodes.fd_of(inode), inodes.fd_of(parent), name)
        st = os.fstat(inodes.fd_of(inode))
        inode.lookups += 1
        self._changed(parent, name)
        return inode, st

    # ------------------------------------------------------------------ removing and renaming

    def unlink(self, parent_id: int, name: bytes) -> None:
        """unlink(2). Open handles keep the data until closed (POSIX).

        Managed budget: the file's bytes are released at once when this was
        its last link (a sealed step's files keep a link in the store's
        snapshot, so deleting them from the view frees nothing) and no handle
        is open; else when its last handle is closed.
        """
        self._remove(parent_id, name, os.unlink)

    def rmdir(self, parent_id: int, name: bytes) -> None:
        """rmdir(2): ENOTEMPTY for a non-empty directory."""
        self._remove(parent_id, name, os.rmdir)

    def _remove(self, parent_id: int, name: bytes, remove: Callable[..., None]) -> None:
        """``remove(name, dir_fd=...)`` (os.unlink or os.rmdir) with the budget told."""
        parent = self._directory(parent_id)
        access.check_mutable(parent.reserved, parent is self.root, name, self.reserved)
        dirfd = self.fd_of(parent)
        gone = self._last_link(dirfd, name) if remove is os.unlink else None
        removed = self.space.before_remove(dirfd, name)
        try:
            remove(name, dir_fd=dirfd)
        finally:
            self.space.after_remove(removed)
        if gone is not None:
            self.inodes.unlinked(gone)
        self._changed(parent, name)

    def _last_link(self, dirfd: int, name: bytes, moving: int = -1) -> Inode | None:
        """Before ``name`` in ``dirfd`` is removed or replaced: if it is a regular file's
        last link, wait first for the node's own reader of it to let go
        (:meth:`FsEvents.removing`), and return its known inode, whose descriptor
        must go at once afterwards (:meth:`InodeTable.unlinked`); else None (also when
        it is backing inode ``moving``: a rename onto another link of itself).

        Both make the file's RAM free before the removal is answered, as on tmpfs.

        Raises:
            Deferred: a reader of the daemon holds the file (the request runs again
                once it let go).
        """
        try:
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_ino == moving:
            return None
        wait = self.events.removing(st.st_ino)
        if wait is not None:
            raise Deferred(wait)
        return self.inodes.known(st)

    def rename(
        self, parent_id: int, name: bytes, newparent_id: int, newname: bytes, flags: int = 0
    ) -> None:
        """rename(2)/renameat2(2): atomic and O(1); errno values are the kernel's.

        ``flags`` may be RENAME_NOREPLACE (EEXIST if ``newname`` exists) or
        RENAME_EXCHANGE.
        """
        inodes = self.inodes
        parent = inodes.directory(parent_id)
        newparent = inodes.directory(newparent_id)
        access.check_mutable(parent.reserved, parent is self.root, name, self.reserved)
        access.check_mutable(newparent.reserved, newparent is self.root, newname, self.reserved)
        st = os.stat(name, dir_fd=inodes.fd_of(parent), follow_symlinks=False)
        old_rel = inodes.child_relpath(parent, name)
        new_rel = inodes.child_relpath(newparent, newname)
        # a replaced target loses its name: its bytes may be free afterwards
        gone = (
            None
            if flags & (syscalls.RENAME_EXCHANGE | syscalls.RENAME_NOREPLACE)
            else self._last_link(inodes.fd_of(newparent), newname, moving=st.st_ino)
        )
        replaced = (
            -1
            if flags & syscalls.RENAME_EXCHANGE
            else self.space.before_remove(inodes.fd_of(newparent), newname)
        )
        try:
            syscalls.renameat2(inodes.fd_of(parent), name, inodes.fd_of(newparent), newname, flags)
        finally:
            self.space.after_remove(replaced)
        if gone is not None:
            inodes.unlinked(gone)
        if old_rel is not None and new_rel is not None:
            self.events.renamed(old_rel, new_rel, st.st_mode)
        if old_rel is not None:
            self.events.changed(old_rel)
        if new_rel is not None:
            self.events.changed(new_rel)
