"""The namespace: inodes, lookup counts and handles over the RAM store's view.

This module is FUSE-free: it speaks in inode numbers, names (bytes), open
flags and ``os.stat_result`` and raises ``OSError`` with a POSIX errno. The
FUSE layer (:mod:`tierfs.fuse.operations`) translates requests onto it.

Every client-visible object is a real object in ``<ram-dir>/view`` on tmpfs,
so POSIX behaviour (rename atomicity, unlink of open files, hard links,
holes, xattrs, ENOTEMPTY...) is the kernel's own. Each inode the kernel knows
is held by an ``O_PATH`` file descriptor, as libfuse's passthrough_ll does:
renames made by the daemon itself never break an inode, unlinked files stay
reachable while the kernel holds them, and hard links are one inode.

Descriptors are a bounded resource (RLIMIT_NOFILE; a container often cannot
raise its hard limit), while the kernel may hold any number of inodes. The
``O_PATH`` descriptors therefore form a pool: past its budget the least
recently used are closed after the request that overflowed it, and their
inodes remember a file handle (``name_to_handle_at``) to be reopened with
``open_by_handle_at`` when the kernel asks for them again. Unlinked inodes
are never evicted (a handle could not bring them back).

Lookup counts follow the FUSE contract: every reply carrying an entry
(lookup, create, mkdir, mknod, symlink, link, readdirplus) adds one; FORGET
subtracts. An inode is dropped when the kernel forgot it and no handle is
open. FUSE node ids are never reused.

Concurrency: all methods run on the single thread that serves FUSE requests
(the trio thread); none of them blocks for long (tmpfs syscalls only). The
daemon's own changes to the view go through :meth:`Namespace.notify_changed`
so the kernel drops stale cache entries (FIELD-NOTES 17).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import stat
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from tierfs.core import syscalls
from tierfs.store.ramstore import Budget, StatFs

log = logging.getLogger(__name__)

ROOT_ID = 1
_PROC_FD = b"/proc/self/fd/%d"
_BACKING_FLAGS = os.O_ACCMODE | os.O_APPEND | os.O_NOATIME | os.O_SYNC | os.O_DSYNC


def _proc(fd: int) -> bytes:
    return _PROC_FD % fd


PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def unallocated(fd: int, offset: int, length: int) -> int:
    """Bytes tmpfs would newly allocate to write ``[offset, offset + length)`` of ``fd``.

    Counts whole pages in the holes of that range (found with SEEK_HOLE and
    SEEK_DATA; everything past EOF is a hole), so rewriting data already
    there costs nothing and a write far past EOF costs only what it writes.
    May overcount by one page at EOF. Moves ``fd``'s file offset.

    Raises:
        OSError: from lseek(2) (not ENXIO, which means "past the data").
    """
    end = offset + length
    pos, total = offset, 0
    while pos < end:
        try:
            hole = os.lseek(fd, pos, os.SEEK_HOLE)
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
            hole = pos  # at or past EOF
        if hole >= end:
            break
        try:
            data = os.lseek(fd, hole, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
            data = end  # no data after the hole
        stop = min(data, end)
        total += (-(-stop // PAGE_SIZE) - hole // PAGE_SIZE) * PAGE_SIZE
        pos = stop
    return total


RWF_NOAPPEND = 0x20  # pwritev2: ignore O_APPEND for this call (Linux 6.9)


def _pwrite_noappend(fd: int, data: memoryview, offset: int) -> int:
    """pwrite at ``offset`` even though ``fd`` has O_APPEND."""
    try:
        return os.pwritev(fd, [data], offset, RWF_NOAPPEND)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
    plain = os.open(_proc(fd), os.O_WRONLY | os.O_CLOEXEC)  # older kernels
    try:
        return os.pwrite(plain, data, offset)
    finally:
        os.close(plain)


def _check_access(st: os.stat_result, uid: int, gid: int, flags: int) -> None:
    """Mode-bit check for ``uid``/``gid`` opening ``st`` with ``flags`` (EACCES if denied).

    Supplementary groups are unknown to FUSE; only the primary group counts.
    """
    if uid == 0:
        return
    need = 0
    acc = flags & os.O_ACCMODE
    if acc in (os.O_RDONLY, os.O_RDWR):
        need |= 4
    if acc in (os.O_WRONLY, os.O_RDWR) or flags & os.O_TRUNC:
        need |= 2
    if st.st_uid == uid:
        bits = (st.st_mode >> 6) & 7
    elif st.st_gid == gid:
        bits = (st.st_mode >> 3) & 7
    else:
        bits = st.st_mode & 7
    if bits & need != need:
        raise OSError(errno.EACCES, "permission denied")


def _kill_bits(mode: int) -> int:
    """The mode bits a write by a caller without CAP_FSETID clears (Linux's rule)."""
    kill = mode & stat.S_ISUID
    if mode & stat.S_ISGID and mode & stat.S_IXGRP:
        kill |= stat.S_ISGID
    return kill


def default_max_fds() -> int:
    """Descriptors a namespace may hold: the soft RLIMIT_NOFILE minus a reserve.

    The reserve (an eighth, at least 256) is for sockets, logs, pipes and
    the inodes learned within one request before the pool is trimmed.
    """
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(64, soft - max(256, soft // 8))


class FsEvents(Protocol):
    """What the namespace tells the node agent. Called on the FUSE thread: be quick."""

    def opening_for_write(self, ino: int) -> None:
        """Backing inode ``ino`` is about to be opened for writing or truncated."""

    def changed(self, relpath: bytes) -> None:
        """The entry ``relpath`` (relative to the mount root) was created, removed or modified."""

    def renamed(self, old: bytes, new: bytes, mode: int) -> None:
        """``old`` was renamed to ``new`` (paths relative to the root); ``mode`` is its st_mode."""

    def released(self, relpath: bytes | None, ino: int) -> None:
        """A handle opened for writing was closed; ``relpath`` is None if the file is unlinked."""


class NullEvents:
    """An :class:`FsEvents` that ignores everything (a bare RAM filesystem)."""

    def opening_for_write(self, ino: int) -> None:
        pass

    def changed(self, relpath: bytes) -> None:
        pass

    def renamed(self, old: bytes, new: bytes, mode: int) -> None:
        pass

    def released(self, relpath: bytes | None, ino: int) -> None:
        pass


@dataclass(eq=False, slots=True)
class Inode:
    """One object the kernel knows.

    Attributes:
        nodeid: the FUSE node id (never reused).
        ino: the backing tmpfs inode number.
        opath: an ``O_PATH`` descriptor of the backing object, or -1 while evicted
            (use :meth:`Namespace.fd_of`, which reopens it).
        fhandle: the backing object's file handle, once it was evicted (a handle
            never changes, so it is kept after the object is reopened).
        evicted_ctime_ns: ``st_ctime_ns`` when ``opath`` was evicted: a name whose
            stat shows this inode number and this ctime is this object.
        mode: ``st_mode`` type bits when first seen.
        lookups: the kernel's lookup count.
        handles: open file handles.
        writers: open handles that may write.
        backing_id: the kernel passthrough id while passthrough handles are open.
        reserved: the object lies under a daemon-managed top-level name (read-only).
        virtual: generator of the content, for daemon-generated files.
        orphan: unlinked while open; the budget keeps counting it until the last
            handle is closed (managed budget only).
    """

    nodeid: int
    ino: int
    opath: int
    mode: int
    lookups: int = 0
    handles: int = 0
    writers: int = 0
    backing_id: int = 0
    reserved: bool = False
    virtual: Callable[[], bytes] | None = None
    fhandle: bytes | None = None
    evicted_ctime_ns: int = -1
    orphan: bool = False


@dataclass(eq=False, slots=True)
class Handle:
    """An open file: ``fd`` is a real descriptor of the backing file."""

    fh: int
    inode: Inode
    fd: int
    flags: int
    writable: bool
    passthrough: bool
    direct_io: bool = False
    keep_cache: bool = False


@dataclass(eq=False, slots=True)
class DirHandle:
    """An open directory with a listing taken at opendir (stable readdir cookies)."""

    fh: int
    inode: Inode
    fd: int
    names: list[bytes] = field(default_factory=list)
    listed: bool = False


@dataclass(frozen=True, slots=True)
class DirEntry:
    """One readdir entry. ``nodeid`` is 0 for entries that carry no lookup ('.' and '..')."""

    name: bytes
    cookie: int
    nodeid: int
    st: os.stat_result | None
    mode: int


class Namespace:
    """Inode and handle table over ``view_dir`` (see the module docstring).

    Args:
        view_dir: the directory served as the mount root.
        budget: the RAM budget (managed-mode growth checks, statfs).
        events: receiver of namespace events (the node agent).
        reserved: top-level names the daemon owns; clients cannot modify them (EPERM).
        virtual: relative paths (bytes) whose content is generated when opened.
        max_fds: how many descriptors the namespace may hold (``O_PATH`` pool plus
            open handles) before it evicts; default: RLIMIT_NOFILE minus a reserve.

    Raises:
        OSError: ``view_dir`` cannot be opened.
    """

    def __init__(
        self,
        view_dir: str,
        budget: Budget,
        events: FsEvents | None = None,
        reserved: frozenset[bytes] = frozenset(),
        virtual: dict[bytes, Callable[[], bytes]] | None = None,
        max_fds: int | None = None,
    ) -> None:
        self.view_dir = os.path.abspath(view_dir)
        self._view_prefix = os.fsencode(self.view_dir) + b"/"
        self.budget = budget
        self.events: FsEvents = events or NullEvents()
        self.reserved = reserved
        self.virtual = dict(virtual or {})
        root_fd = os.open(self.view_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        st = os.fstat(root_fd)
        self.dev = st.st_dev
        self.root = Inode(ROOT_ID, st.st_ino, root_fd, stat.S_IFDIR, lookups=1)
        self._by_node: dict[int, Inode] = {ROOT_ID: self.root}
        self._by_ino: dict[int, Inode] = {st.st_ino: self.root}
        self._handles: dict[int, Handle | DirHandle] = {}
        self._next_node = itertools.count(ROOT_ID + 1)
        self._next_fh = itertools.count(1)
        #: set by the FUSE session once INIT is done: passthrough enabled, backing registry
        self.passthrough = False
        self.register_backing: Callable[[int], int] | None = None
        self.close_backing: Callable[[int], None] | None = None
        #: set by the FUSE session: send an entry invalidation (parent nodeid, name)
        self.notify_inval_entry: Callable[..., None] | None = None
        #: set by the FUSE session: drop the kernel's cached attributes of a node id
        self.notify_inval_inode: Callable[[int], None] | None = None
        self.entry_timeout = 1.0
        self.attr_timeout = 1.0
        #: evictable O_PATH descriptors, least recently used first (nodeid -> inode)
        self._fd_lru: OrderedDict[int, Inode] = OrderedDict()
        self.max_fds = max_fds if max_fds is not None else default_max_fds()
        #: a plain descriptor of the view's filesystem, for open_by_handle_at
        self._mount_fd = os.open(self.view_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.can_evict = self._handles_work(root_fd)

    def _handles_work(self, fd: int) -> bool:
        try:
            handle = syscalls.name_to_handle(fd)
            os.close(syscalls.open_by_handle(self._mount_fd, handle, os.O_PATH | os.O_CLOEXEC))
        except OSError as exc:
            log.warning(
                "file handles unavailable (%s): every inode the kernel holds keeps a "
                "descriptor open",
                exc.strerror,
            )
            return False
        return True

    # ------------------------------------------------------------------ descriptor pool

    def close(self) -> None:
        """Close every descriptor the namespace holds (it is unusable afterwards)."""
        fds = [h.fd for h in self._handles.values()]
        fds += [i.opath for i in self._by_node.values() if i.opath >= 0]
        fds.append(self._mount_fd)
        for inode in self._by_node.values():
            if inode.orphan:
                inode.orphan = False
                self.budget.drop_orphan(inode.ino)
        self._handles.clear()
        self._fd_lru.clear()
        for inode in self._by_node.values():
            inode.opath = -1
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def fd_of(self, inode: Inode) -> int:
        """An ``O_PATH`` descriptor of ``inode``'s backing object, reopened if evicted.

        The descriptor stays valid until the next :meth:`trim_fds` (do not keep it).
        FUSE thread only: the pool is not locked (of the namespace, only
        :meth:`writers_of` and :meth:`notify_changed` may be called from other
        threads).

        Raises:
            OSError: ESTALE if the backing object no longer exists.
        """
        fd = inode.opath
        if fd >= 0:
            if inode is not self.root:
                self._fd_lru.move_to_end(inode.nodeid)
            return fd
        assert inode.fhandle is not None
        fd = syscalls.open_by_handle(self._mount_fd, inode.fhandle, os.O_PATH | os.O_CLOEXEC)
        inode.opath = fd
        self._fd_lru[inode.nodeid] = inode
        return fd

    def fds_held(self) -> int:
        """Descriptors the namespace holds now: ``O_PATH`` pool plus open handles."""
        return len(self._fd_lru) + len(self._handles)

    def trim_fds(self) -> int:
        """Evict least recently used ``O_PATH`` descriptors once past ``max_fds``.

        Evicts down to 15/16 of ``max_fds`` so that a pool at its limit is not
        trimmed after every request. Call between requests, never while a
        descriptor from :meth:`fd_of` is in use. Inodes whose object is
        unlinked (or whose handle cannot be taken) keep their descriptor.
        Returns the number evicted.
        """
        if self.fds_held() <= self.max_fds or not self.can_evict:
            return 0
        excess = self.fds_held() - (self.max_fds - self.max_fds // 16)
        evicted = 0
        for _ in range(len(self._fd_lru)):
            if excess <= 0:
                break
            nodeid, inode = self._fd_lru.popitem(last=False)
            try:
                st = os.fstat(inode.opath)
                if st.st_nlink == 0:
                    raise OSError(errno.ENOENT, "unlinked")
                if inode.fhandle is None:
                    inode.fhandle = syscalls.name_to_handle(inode.opath)
            except OSError:
                self._fd_lru[nodeid] = inode  # keep it, most recently used now
                continue
            os.close(inode.opath)
            inode.opath = -1
            inode.evicted_ctime_ns = st.st_ctime_ns
            excess -= 1
            evicted += 1
        return evicted

    def _known(self, st: os.stat_result) -> Inode | None:
        """The inode already known for the object ``st`` describes, if that is certain.

        Certain when its descriptor is held (the inode number cannot have been
        reused), or when it was evicted and inode number and ctime both match.
        None means unknown or uncertain: open the object and call :meth:`_learn`.
        """
        known = self._by_ino.get(st.st_ino)
        if known is None:
            return None
        if known.opath >= 0:
            if known is not self.root:
                self._fd_lru.move_to_end(known.nodeid)
            return known
        return known if known.evicted_ctime_ns == st.st_ctime_ns else None

    # ------------------------------------------------------------------ lookup table

    def inode(self, nodeid: int) -> Inode:
        """The inode for ``nodeid``; ``OSError(ESTALE)`` if unknown."""
        try:
            return self._by_node[nodeid]
        except KeyError:
            raise OSError(errno.ESTALE, "unknown inode") from None

    def _dir(self, nodeid: int) -> Inode:
        inode = self.inode(nodeid)
        if not stat.S_ISDIR(inode.mode):
            raise OSError(errno.ENOTDIR, "not a directory")
        return inode

    def _learn(self, parent: Inode, name: bytes, fd: int, st: os.stat_result) -> Inode:
        """Return the inode for backing object ``st`` (opened as ``fd``), adding one lookup.

        Takes ownership of ``fd`` (closed if the inode is already known).
        """
        known = self._by_ino.get(st.st_ino)
        if known is not None and known.opath < 0:
            # Evicted: the inode number is only the same object if the handle is.
            try:
                same = syscalls.name_to_handle(fd) == known.fhandle
            except OSError:
                same = False
            if same:
                known.opath = fd
                self._fd_lru[known.nodeid] = known
                known.lookups += 1
                return known
            del self._by_ino[st.st_ino]  # a reused inode number: the old entry is stale
            known = None
        if known is not None:
            os.close(fd)
            known.lookups += 1
            if known is not self.root:
                self._fd_lru.move_to_end(known.nodeid)
            return known
        reserved = parent.reserved or (parent is self.root and name in self.reserved)
        virtual = None
        if reserved and self.virtual:
            virtual = self.virtual.get(self._child_relpath(parent, name) or b"")
        inode = Inode(
            next(self._next_node),
            st.st_ino,
            fd,
            stat.S_IFMT(st.st_mode),
            lookups=1,
            reserved=reserved,
            virtual=virtual,
        )
        self._by_node[inode.nodeid] = inode
        self._by_ino[inode.ino] = inode
        self._fd_lru[inode.nodeid] = inode
        return inode

    def _open_child(self, parent: Inode, name: bytes) -> tuple[int, os.stat_result]:
        if name in (b".", b"..") or b"/" in name:
            raise OSError(errno.EINVAL, "invalid name")
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd_of(parent))
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            raise
        return fd, st

    def lookup(self, parent_id: int, name: bytes) -> tuple[Inode, os.stat_result]:
        """Resolve ``name`` in directory ``parent_id`` (adds one lookup).

        Raises:
            OSError: ENOENT if absent, ENOTDIR if the parent is not a directory.
        """
        parent = self._dir(parent_id)
        if name in (b".", b"..") or b"/" in name:
            raise OSError(errno.EINVAL, "invalid name")
        st = os.stat(name, dir_fd=self.fd_of(parent), follow_symlinks=False)
        if st.st_dev != self.dev:
            raise OSError(errno.EXDEV, "foreign filesystem in the RAM store")
        known = self._known(st)
        if known is not None:
            known.lookups += 1
            return known, st
        fd, st = self._open_child(parent, name)
        if st.st_dev != self.dev:
            os.close(fd)
            raise OSError(errno.EXDEV, "foreign filesystem in the RAM store")
        return self._learn(parent, name, fd, st), st

    def forget(self, nodeid: int, nlookup: int) -> None:
        """The kernel dropped ``nlookup`` references to ``nodeid`` (never raises)."""
        inode = self._by_node.get(nodeid)
        if inode is None or inode is self.root:
            return
        inode.lookups -= nlookup
        self._maybe_drop(inode)

    def _maybe_drop(self, inode: Inode) -> None:
        if inode.lookups <= 0 and inode.handles <= 0 and inode is not self.root:
            self._by_node.pop(inode.nodeid, None)
            self._fd_lru.pop(inode.nodeid, None)
            if self._by_ino.get(inode.ino) is inode:
                del self._by_ino[inode.ino]
            if inode.opath >= 0:
                try:
                    os.close(inode.opath)
                except OSError:
                    pass
                inode.opath = -1

    def writers_of(self, ino: int) -> int:
        """Open writable handles on backing inode ``ino`` (safe from any thread)."""
        inode = self._by_ino.get(ino)
        return inode.writers if inode is not None else 0

    def nodeid_hint(self, st: os.stat_result | None) -> int:
        """The node id already assigned to backing object ``st``, or 0."""
        if st is None:
            return 0
        known = self._by_ino.get(st.st_ino)
        return known.nodeid if known is not None else st.st_ino

    def known_inodes(self) -> int:
        """Number of inodes currently held (for status and tests)."""
        return len(self._by_node)

    # ------------------------------------------------------------------ paths and events

    def relpath(self, inode: Inode) -> bytes | None:
        """Path of ``inode`` relative to the root (b"" for the root); None if unlinked."""
        if inode is self.root:
            return b""
        try:
            fd = self.fd_of(inode)
            target = os.readlink(_proc(fd))
        except OSError:
            return None
        if not target.startswith(self._view_prefix):
            return None
        if target.endswith(b" (deleted)") and os.fstat(fd).st_nlink == 0:
            return None
        return target[len(self._view_prefix) :]

    def _child_relpath(self, parent: Inode, name: bytes) -> bytes | None:
        if parent is self.root:
            return name
        base = self.relpath(parent)
        return None if base is None else base + b"/" + name

    def _check_mutable(self, parent: Inode, name: bytes | None = None) -> None:
        if parent.reserved or (parent is self.root and name in self.reserved):
            raise OSError(errno.EPERM, "managed by tierfs")

    def _changed(self, parent: Inode, name: bytes) -> None:
        rel = self._child_relpath(parent, name)
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
        if self.notify_inval_entry is None or not name:
            return
        if not parent_rel:
            self.notify_inval_entry(ROOT_ID, name, wait)
            return
        try:
            st = os.lstat(os.path.join(self._view_prefix, parent_rel))
        except OSError:
            return
        parent = self._by_ino.get(st.st_ino)
        if parent is not None:
            self.notify_inval_entry(parent.nodeid, name, wait)

    # ------------------------------------------------------------------ attributes

    def getattr(self, nodeid: int, fh: int | None = None) -> tuple[Inode, os.stat_result]:
        """``stat`` of an inode (via the handle ``fh`` if given)."""
        inode = self.inode(nodeid)
        if fh is not None:
            handle = self._handles.get(fh)
            if isinstance(handle, Handle):
                return inode, os.fstat(handle.fd)
        return inode, os.fstat(self.fd_of(inode))

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

        ``kill_suidgid`` (a truncate or chown by a caller without CAP_FSETID):
        clear the set-user-ID and set-group-ID bits afterwards, as Linux does.

        A size change allocates nothing on tmpfs (growing leaves a hole), so it
        is not checked against the budget.

        Raises:
            OSError: EPERM under reserved names, EISDIR for truncating a directory,
                EINVAL for truncating other non-regular files.
        """
        inode = self.inode(nodeid)
        if inode.reserved:
            raise OSError(errno.EPERM, "managed by tierfs")
        handle = self._handles.get(fh) if fh is not None else None
        if size is not None:
            if stat.S_ISDIR(inode.mode):
                raise OSError(errno.EISDIR, "is a directory")
            if not stat.S_ISREG(inode.mode):
                raise OSError(errno.EINVAL, "not a regular file")
            self.events.opening_for_write(inode.ino)
            before = self._allocated(self.fd_of(inode))
            if isinstance(handle, Handle) and handle.writable:
                os.ftruncate(handle.fd, size)
            else:
                os.truncate(_proc(self.fd_of(inode)), size)
            self._shrunk(self.fd_of(inode), before)
        if mode is not None:
            if stat.S_ISLNK(inode.mode):
                raise OSError(errno.EOPNOTSUPP, "symlink mode")
            os.chmod(_proc(self.fd_of(inode)), stat.S_IMODE(mode))
        if uid is not None or gid is not None:
            syscalls.fchown_empty(
                self.fd_of(inode), -1 if uid is None else uid, -1 if gid is None else gid
            )
        if atime_ns is not None or mtime_ns is not None or atime_now or mtime_now:
            syscalls.utimens_empty(self.fd_of(inode), atime_ns, mtime_ns, atime_now, mtime_now)
        if kill_suidgid:
            self._kill_suidgid(inode, self.fd_of(inode))
        if size is not None or mode is not None or uid is not None or gid is not None:
            rel = self.relpath(inode)
            if rel:
                self.events.changed(rel)
        return os.fstat(self.fd_of(inode))

    def readlink(self, nodeid: int) -> bytes:
        """Target of a symlink (EINVAL if not a symlink)."""
        inode = self.inode(nodeid)
        if not stat.S_ISLNK(inode.mode):
            raise OSError(errno.EINVAL, "not a symlink")
        # readlinkat(fd, "") reads the symlink an O_PATH|O_NOFOLLOW fd refers to.
        return os.readlink(b"", dir_fd=self.fd_of(inode))

    def statfs(self) -> StatFs:
        """The RAM budget as statfs numbers."""
        return self.budget.statfs()

    # ------------------------------------------------------------------ creating names

    def _owner(self, parent: Inode, uid: int, gid: int) -> tuple[int, int]:
        pst = os.fstat(self.fd_of(parent))
        return uid, (pst.st_gid if pst.st_mode & stat.S_ISGID else gid)

    def _finish_create(
        self,
        parent: Inode,
        name: bytes,
        uid: int,
        gid: int,
        fd: int | None = None,
        chown: bool = True,
    ) -> tuple[Inode, os.stat_result]:
        owner = self._owner(parent, uid, gid)
        if fd is None:
            opath, st = self._open_child(parent, name)
        else:
            opath, st = self._opath_of(fd, parent, name)
        try:
            if chown and (st.st_uid, st.st_gid) != owner:
                syscalls.fchown_empty(opath, *owner)
                st = os.fstat(opath)
        except OSError:
            os.close(opath)
            raise
        inode = self._learn(parent, name, opath, st)
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
        opath = os.open(_proc(fd), os.O_PATH | os.O_CLOEXEC)
        return opath, os.fstat(opath)

    def mkdir(
        self, parent_id: int, name: bytes, mode: int, uid: int, gid: int
    ) -> tuple[Inode, os.stat_result]:
        """mkdir(2) of ``name`` owned by the caller (setgid directories pass their group on)."""
        parent = self._dir(parent_id)
        self._check_mutable(parent, name)
        os.mkdir(name, stat.S_IMODE(mode), dir_fd=self.fd_of(parent))
        return self._finish_create(parent, name, uid, gid)

    def mknod(
        self, parent_id: int, name: bytes, mode: int, rdev: int, uid: int, gid: int
    ) -> tuple[Inode, os.stat_result]:
        """mknod(2): regular files, FIFOs, sockets (devices need CAP_MKNOD)."""
        parent = self._dir(parent_id)
        self._check_mutable(parent, name)
        if stat.S_ISREG(mode):
            self.budget.check_growth(1)
        os.mknod(name, mode, rdev, dir_fd=self.fd_of(parent))
        return self._finish_create(parent, name, uid, gid)

    def symlink(
        self, parent_id: int, name: bytes, target: bytes, uid: int, gid: int
    ) -> tuple[Inode, os.stat_result]:
        """symlink(2): ``name`` in ``parent_id`` pointing at ``target`` (stored verbatim)."""
        parent = self._dir(parent_id)
        self._check_mutable(parent, name)
        os.symlink(target, name, dir_fd=self.fd_of(parent))
        return self._finish_create(parent, name, uid, gid)

    def link(self, nodeid: int, parent_id: int, name: bytes) -> tuple[Inode, os.stat_result]:
        """link(2): a new name for an existing inode (EPERM for directories)."""
        inode = self.inode(nodeid)
        parent = self._dir(parent_id)
        self._check_mutable(parent, name)
        if stat.S_ISDIR(inode.mode):
            raise OSError(errno.EPERM, "hard link to directory")
        if inode.reserved:
            raise OSError(errno.EPERM, "managed by tierfs")
        syscalls.link_empty(self.fd_of(inode), self.fd_of(parent), name)
        st = os.fstat(self.fd_of(inode))
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
        parent = self._dir(parent_id)
        self._check_mutable(parent, name)
        dirfd = self.fd_of(parent)
        removed = self._before_remove(dirfd, name)
        try:
            remove(name, dir_fd=dirfd)
        finally:
            self._after_remove(removed)
        self._changed(parent, name)

    # managed budget: bytes freed by removing and shrinking

    def _before_remove(self, dirfd: int, name: bytes) -> int:
        """An ``O_PATH`` descriptor of ``name`` about to lose a link, or -1.

        -1 in native mode (the filesystem keeps the budget) and when ``name``
        cannot be opened (the removal itself will report why).
        """
        if self.budget.native:
            return -1
        try:
            return os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
        except OSError:
            return -1

    def _after_remove(self, fd: int) -> None:
        """Account for the object ``fd`` after a removal (successful or not); closes ``fd``.

        Its bytes are freed if it has no link left: released to the budget
        now, or, while handles are open, when the last one is closed.
        """
        if fd < 0:
            return
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            return
        if st.st_nlink > 0:  # other links (a snapshot in the store) keep the bytes
            os.close(fd)
            self.budget.shared_removed()  # the last of them may be in the trash
            return
        inode = self._by_ino.get(st.st_ino)
        if (
            stat.S_ISREG(st.st_mode)
            and inode is not None
            and inode.handles > 0
            and not inode.orphan
        ):
            inode.orphan = True
            self.budget.hold_orphan(st.st_ino, fd)  # takes the descriptor
            return
        os.close(fd)
        self.budget.release(st.st_blocks * 512, st.st_ino)

    def _allocated(self, fd: int) -> int:
        """Bytes allocated to ``fd``'s file (managed mode; 0 in native mode)."""
        return 0 if self.budget.native else os.fstat(fd).st_blocks * 512

    def _shrunk(self, fd: int, before: int) -> None:
        """``fd``'s file had ``before`` bytes allocated: release what a truncation freed."""
        if self.budget.native:
            return
        try:
            after = os.fstat(fd).st_blocks * 512
        except OSError:
            return
        self.budget.release(before - after)

    def rename(
        self, parent_id: int, name: bytes, newparent_id: int, newname: bytes, flags: int = 0
    ) -> None:
        """rename(2)/renameat2(2): atomic and O(1); errno values are the kernel's.

        ``flags`` may be RENAME_NOREPLACE (EEXIST if ``newname`` exists) or
        RENAME_EXCHANGE.
        """
        parent = self._dir(parent_id)
        newparent = self._dir(newparent_id)
        self._check_mutable(parent, name)
        self._check_mutable(newparent, newname)
        st = os.stat(name, dir_fd=self.fd_of(parent), follow_symlinks=False)
        old_rel = self._child_relpath(parent, name)
        new_rel = self._child_relpath(newparent, newname)
        # a replaced target loses its name: its bytes may be free afterwards
        replaced = (
            -1
            if flags & syscalls.RENAME_EXCHANGE
            else self._before_remove(self.fd_of(newparent), newname)
        )
        try:
            syscalls.renameat2(self.fd_of(parent), name, self.fd_of(newparent), newname, flags)
        finally:
            self._after_remove(replaced)
        if old_rel is not None and new_rel is not None:
            self.events.renamed(old_rel, new_rel, st.st_mode)
        if old_rel is not None:
            self.events.changed(old_rel)
        if new_rel is not None:
            self.events.changed(new_rel)

    # ------------------------------------------------------------------ files

    def _new_handle(self, inode: Inode, fd: int, flags: int) -> Handle:
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        handle = Handle(next(self._next_fh), inode, fd, flags, writable, passthrough=False)
        if inode.virtual is not None:
            handle.direct_io = True
        elif inode.backing_id or (
            self._passthrough_allowed(inode, fd) and self._register_backing(inode, fd)
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

    def _passthrough_allowed(self, inode: Inode, fd: int) -> bool:
        """May this open of ``inode`` (open as ``fd``) bypass the daemon?

        Not while the inode has handles the daemon serves (the kernel refuses
        to mix passthrough and cached opens of one inode), and not for a file
        whose set-user-ID / set-group-ID bits a write must clear: such writes
        have to reach the daemon (see :meth:`kill_suidgid`).
        """
        if not self.passthrough:
            return False
        if inode.handles > 0:  # no backing id (the caller checked): daemon-served handles
            return False
        return not _kill_bits(os.fstat(fd).st_mode)

    def _register_backing(self, inode: Inode, fd: int) -> bool:
        """Register ``fd`` as ``inode``'s passthrough backing file; False to serve it here.

        A failed registration (EPERM without CAP_SYS_ADMIN; ELOOP when the
        ram-dir is on a stacked filesystem such as overlayfs or another FUSE
        mount) turns passthrough off for the session (the session's
        ``register_backing`` does that), and this open, like every later one,
        is served through the daemon instead of failing.
        """
        if not self.passthrough or self.register_backing is None:
            return False
        try:
            inode.backing_id = self.register_backing(fd)
        except OSError:
            self.passthrough = False
            return False
        return True

    def _backing_open(self, inode: Inode, flags: int) -> int:
        # No O_NOFOLLOW: /proc/self/fd/N is a magic link (the kernel resolves
        # client symlinks itself and never opens one through FUSE).
        return os.open(_proc(self.fd_of(inode)), (flags & _BACKING_FLAGS) | os.O_CLOEXEC)

    def open(self, nodeid: int, flags: int, kill_suidgid: bool = False) -> Handle:
        """open(2) of an existing file. O_TRUNC truncates here (atomic O_TRUNC).

        ``kill_suidgid``: the caller lacks CAP_FSETID and truncates: clear the
        set-user-ID and set-group-ID bits as Linux does.

        Raises:
            OSError: EISDIR for directories, EPERM writing reserved files,
                ELOOP for symlinks.
        """
        inode = self.inode(nodeid)
        if stat.S_ISDIR(inode.mode):
            raise OSError(errno.EISDIR, "is a directory")
        writes = (flags & os.O_ACCMODE) != os.O_RDONLY or flags & os.O_TRUNC
        if writes:
            if inode.reserved:
                raise OSError(errno.EPERM, "managed by tierfs")
            self.events.opening_for_write(inode.ino)
        elif inode.virtual is not None:
            self._regenerate(inode)
        fd = self._backing_open(inode, flags)
        try:
            if flags & os.O_TRUNC and stat.S_ISREG(inode.mode):
                before = self._allocated(fd)
                if (flags & os.O_ACCMODE) == os.O_RDONLY:
                    # Linux truncates on O_RDONLY|O_TRUNC too; the fd cannot.
                    os.truncate(_proc(self.fd_of(inode)), 0)
                else:
                    os.ftruncate(fd, 0)
                self._shrunk(fd, before)
                if kill_suidgid:
                    self._kill_suidgid(inode, fd)
            return self._new_handle(inode, fd, flags)
        except BaseException:
            os.close(fd)
            raise

    def _regenerate(self, inode: Inode) -> None:
        assert inode.virtual is not None
        try:
            content = inode.virtual()
        except Exception:  # a status generator must never break open()
            log.exception("generating virtual file failed")
            return
        fd = os.open(_proc(self.fd_of(inode)), os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
        try:
            os.write(fd, content)
        finally:
            os.close(fd)

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
                not open, EPERM under reserved names, ENOSPC past the budget.
        """
        parent = self._dir(parent_id)
        self._check_mutable(parent, name)
        if b"/" in name or name in (b".", b".."):
            raise OSError(errno.EINVAL, "invalid name")
        self.budget.check_growth(1)
        bflags = (flags & (_BACKING_FLAGS | os.O_TRUNC)) | os.O_CLOEXEC | os.O_NOFOLLOW
        dirfd = self.fd_of(parent)
        created = True
        try:
            fd = os.open(name, bflags | os.O_CREAT | os.O_EXCL, stat.S_IMODE(mode), dir_fd=dirfd)
        except FileExistsError:
            if flags & os.O_EXCL:
                raise
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            _check_access(st, uid, gid, flags)
            fd = os.open(name, bflags, dir_fd=dirfd)
            created = False
        try:
            if (
                not created
                and bflags & os.O_TRUNC
                and not self.budget.native
                and os.fstat(fd).st_ino == st.st_ino
            ):  # the file stat saw: truncated
                self._shrunk(fd, st.st_blocks * 512)
            inode, st = self._finish_create(parent, name, uid, gid, fd=fd, chown=created)
            if inode.reserved:
                raise OSError(errno.EPERM, "managed by tierfs")
            if (flags & os.O_ACCMODE) != os.O_RDONLY:
                self.events.opening_for_write(inode.ino)
            if kill_suidgid and not created and bflags & os.O_TRUNC:
                self._kill_suidgid(inode, fd)
                st = os.fstat(fd)
            handle = self._new_handle(inode, fd, flags)
        except BaseException:
            os.close(fd)
            raise
        return inode, st, handle

    def handle(self, fh: int) -> Handle:
        """The open file ``fh``; EBADF if unknown."""
        h = self._handles.get(fh)
        if not isinstance(h, Handle):
            raise OSError(errno.EBADF, "bad file handle")
        return h

    def read_into(self, fh: int, offset: int, buf: memoryview) -> int:
        """Read up to ``len(buf)`` bytes at ``offset`` into ``buf``; returns bytes read."""
        return os.preadv(self.handle(fh).fd, [buf], offset)

    def write(self, fh: int, offset: int, data: memoryview, cached: bool = False) -> int:
        """Write ``data`` at ``offset``; returns bytes written.

        A write(2) on an O_APPEND handle appends (the backing descriptor has
        O_APPEND). A page-cache writeback (``cached``: the kernel flushing
        mmap'd pages through whichever handle it holds) always lands at
        ``offset``, also through an O_APPEND handle.

        Raises:
            OSError: ENOSPC past the budget (nothing written), EBADF.
        """
        handle = self.handle(fh)
        if not self.budget.native:
            self.budget.check_growth(unallocated(handle.fd, offset, len(data)))
        if cached and handle.flags & os.O_APPEND:
            return _pwrite_noappend(handle.fd, data, offset)
        return os.pwrite(handle.fd, data, offset)

    def kill_suidgid(self, fh: int) -> None:
        """Clear the set-user-ID bit, and set-group-ID with group execute, of ``fh``'s file.

        What Linux does on write(2), truncate and fallocate by a caller without
        CAP_FSETID (``should_remove_suid``). With ``FUSE_HANDLE_KILLPRIV_V2``
        the kernel leaves it to the daemon and says when: a WRITE with
        ``FUSE_WRITE_KILL_SUIDGID`` (this method), a SETATTR with
        ``FATTR_KILL_SUIDGID``, an OPEN with ``FUSE_OPEN_KILL_SUIDGID`` (the
        ``kill_suidgid`` arguments of :meth:`setattr`, :meth:`open` and
        :meth:`create`). Writes through passthrough never reach the daemon, so
        files with those bits are never opened with passthrough
        (:meth:`_passthrough_allowed`). The kernel's cached attributes of the
        inode are invalidated afterwards, so the new mode shows at once.

        Raises:
            OSError: EBADF for an unknown handle.
        """
        handle = self.handle(fh)
        self._kill_suidgid(handle.inode, handle.fd)

    def _kill_suidgid(self, inode: Inode, fd: int) -> None:
        mode = os.fstat(fd).st_mode
        kill = _kill_bits(mode)
        if not kill or not stat.S_ISREG(mode):
            return
        os.chmod(_proc(fd), stat.S_IMODE(mode) & ~kill)
        if self.notify_inval_inode is not None:
            self.notify_inval_inode(inode.nodeid)

    def flush(self, fh: int) -> None:
        """close(2) of one descriptor of the handle: nothing to flush on tmpfs."""
        self.handle(fh)

    def fsync(self, fh: int, datasync: bool) -> None:
        """fsync/fdatasync: bytes are in RAM (tmpfs) once write returned; see SEMANTICS."""
        handle = self._handles.get(fh)
        if handle is None:
            raise OSError(errno.EBADF, "bad file handle")
        (os.fdatasync if datasync else os.fsync)(handle.fd)

    def release(self, fh: int) -> None:
        """The last descriptor of handle ``fh`` was closed (never raises)."""
        handle = self._handles.pop(fh, None)
        if not isinstance(handle, Handle):
            return
        inode = handle.inode
        try:
            os.close(handle.fd)
        except OSError:
            pass
        inode.handles -= 1
        if handle.writable:
            inode.writers -= 1
        if inode.handles == 0 and inode.orphan:
            inode.orphan = False
            self.budget.drop_orphan(inode.ino)  # unlinked while open: freed now
        if inode.handles == 0 and inode.backing_id and self.close_backing is not None:
            bid, inode.backing_id = inode.backing_id, 0
            try:
                self.close_backing(bid)
            except OSError:
                log.warning("closing passthrough backing %d failed", bid, exc_info=True)
        if handle.writable:
            try:
                self.events.released(self.relpath(inode), inode.ino)
            except Exception:
                log.exception("release event failed")
        self._maybe_drop(inode)

    def fallocate(self, fh: int, mode: int, offset: int, length: int) -> None:
        """fallocate(2) on tmpfs (mode 0, KEEP_SIZE, PUNCH_HOLE).

        Raises:
            OSError: ENOSPC if the range's unallocated pages pass the budget,
                EOPNOTSUPP for modes tmpfs lacks.
        """
        handle = self.handle(fh)
        if not mode & syscalls.FALLOC_FL_PUNCH_HOLE and not self.budget.native:
            self.budget.check_growth(unallocated(handle.fd, offset, length))
        self.events.opening_for_write(handle.inode.ino)
        before = self._allocated(handle.fd)
        syscalls.fallocate(handle.fd, mode, offset, length)
        if mode & syscalls.FALLOC_FL_PUNCH_HOLE:
            self._shrunk(handle.fd, before)

    def lseek(self, fh: int, offset: int, whence: int) -> int:
        """lseek(2) with SEEK_DATA/SEEK_HOLE (the kernel handles the others)."""
        return os.lseek(self.handle(fh).fd, offset, whence)

    def copy_file_range(
        self, fh_in: int, off_in: int, fh_out: int, off_out: int, length: int
    ) -> int:
        """copy_file_range(2) between two open files of the mount; returns bytes copied."""
        src, dst = self.handle(fh_in), self.handle(fh_out)
        if not self.budget.native:
            self.budget.check_growth(unallocated(dst.fd, off_out, length))
        return os.copy_file_range(src.fd, dst.fd, length, off_in, off_out)

    def handles_open_for_write(self) -> int:
        """Number of open handles that may write (status, tests)."""
        return sum(1 for h in self._handles.values() if isinstance(h, Handle) and h.writable)

    # ------------------------------------------------------------------ xattrs

    def _xattr_path(self, inode: Inode) -> bytes:
        if stat.S_ISLNK(inode.mode):
            raise OSError(errno.ENOTSUP, "no xattrs on symlinks")
        return _proc(self.fd_of(inode))

    def getxattr(self, nodeid: int, name: bytes) -> bytes:
        """getxattr(2): ENODATA if absent, ENOTSUP where unsupported."""
        return os.getxattr(self._xattr_path(self.inode(nodeid)), name)

    def setxattr(self, nodeid: int, name: bytes, value: bytes, flags: int) -> None:
        """setxattr(2) with XATTR_CREATE/XATTR_REPLACE flags."""
        inode = self.inode(nodeid)
        if inode.reserved:
            raise OSError(errno.EPERM, "managed by tierfs")
        os.setxattr(self._xattr_path(inode), name, value, flags)

    def listxattr(self, nodeid: int) -> list[bytes]:
        """listxattr(2) as a list of names."""
        inode = self.inode(nodeid)
        if stat.S_ISLNK(inode.mode):
            return []
        return [os.fsencode(n) for n in os.listxattr(_proc(self.fd_of(inode)))]

    def removexattr(self, nodeid: int, name: bytes) -> None:
        """removexattr(2)."""
        inode = self.inode(nodeid)
        if inode.reserved:
            raise OSError(errno.EPERM, "managed by tierfs")
        os.removexattr(self._xattr_path(inode), name)

    # ------------------------------------------------------------------ directories

    def opendir(self, nodeid: int) -> DirHandle:
        """opendir(3): the listing is taken on the first readdir."""
        inode = self._dir(nodeid)
        fd = os.open(_proc(self.fd_of(inode)), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        handle = DirHandle(next(self._next_fh), inode, fd)
        inode.handles += 1
        self._handles[handle.fh] = handle
        return handle

    def _dirhandle(self, fh: int) -> DirHandle:
        h = self._handles.get(fh)
        if not isinstance(h, DirHandle):
            raise OSError(errno.EBADF, "bad directory handle")
        return h

    def readdir(
        self, fh: int, offset: int, plus: bool, fits: Callable[[bytes], bool]
    ) -> Iterator[DirEntry]:
        """Yield entries after cookie ``offset``.

        Cookies are positions in a listing taken once per directory handle
        (again when the caller rewinds to 0), so entries created or removed
        during the listing cause neither skips nor duplicates (FUSE-NOTES 6).
        With ``plus`` each yielded entry (other than '.' and '..') carries a
        lookup, so the caller must check ``fits(name)`` is consulted before
        the lookup is taken: an entry is only yielded if it fits the reply.
        """
        handle = self._dirhandle(fh)
        if not handle.listed or offset == 0:
            handle.names = [b".", b".."] + [os.fsencode(n) for n in os.listdir(handle.fd)]
            handle.listed = True
        parent = handle.inode
        for index in range(offset, len(handle.names)):
            name = handle.names[index]
            cookie = index + 1
            if not fits(name):
                return
            if name in (b".", b".."):
                yield DirEntry(name, cookie, 0, None, stat.S_IFDIR)
                continue
            try:
                st = os.stat(name, dir_fd=handle.fd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed since the listing was taken
            if not plus:
                yield DirEntry(name, cookie, 0, st, st.st_mode)
                continue
            known = self._known(st)
            if known is not None and known is not self.root:
                known.lookups += 1  # one stat, no descriptor needed
                yield DirEntry(name, cookie, known.nodeid, st, st.st_mode)
                continue
            try:
                fd, st = self._open_child(parent, name)
            except FileNotFoundError:
                continue
            inode = self._learn(parent, name, fd, st)
            yield DirEntry(name, cookie, inode.nodeid, st, st.st_mode)

    def fsyncdir(self, fh: int) -> None:
        """fsync(2) of a directory."""
        os.fsync(self._dirhandle(fh).fd)

    def releasedir(self, fh: int) -> None:
        """closedir(3) (never raises)."""
        handle = self._handles.pop(fh, None)
        if not isinstance(handle, DirHandle):
            return
        try:
            os.close(handle.fd)
        except OSError:
            pass
        handle.inode.handles -= 1
        self._maybe_drop(handle.inode)
