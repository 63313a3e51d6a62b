"""The inode table: FUSE node ids, lookup counts, forget, and the ``O_PATH`` descriptor pool.

Each inode the kernel knows is held by an ``O_PATH`` file descriptor of its
backing object in ``<ram-dir>/view``, as libfuse's passthrough_ll does:
renames made by the daemon itself never break an inode, unlinked files stay
reachable while the kernel holds them, and hard links are one inode.

Descriptors are a bounded resource (RLIMIT_NOFILE; a container often cannot
raise its hard limit), while the kernel may hold any number of inodes. The
``O_PATH`` descriptors therefore form a pool: past its budget the least
recently used are closed after the request that overflowed it
(:meth:`InodeTable.trim`), and their inodes remember a file handle
(``name_to_handle_at``) to be reopened with ``open_by_handle_at`` when the
kernel asks for them again (:meth:`InodeTable.fd_of`). Unlinked inodes are
never evicted (a handle could not bring them back).

Lookup counts follow the FUSE contract: every reply carrying an entry
(lookup, create, mkdir, mknod, symlink, link, readdirplus) adds one
(:meth:`InodeTable.learn`, or ``lookups += 1`` on a known inode); FORGET
subtracts (:meth:`InodeTable.forget`). An inode is dropped when the kernel
forgot it and no handle is open (:meth:`InodeTable.drop_if_unused`). FUSE
node ids are never reused.

FUSE thread only, except :meth:`InodeTable.writers_of` and
:meth:`InodeTable.by_ino` (single dict reads, safe from any thread).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import resource
import stat
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tierfs.core import syscalls
from tierfs.fuse import access

log = logging.getLogger(__name__)

ROOT_ID = 1
_PROC_FD = b"/proc/self/fd/%d"


def proc(fd: int) -> bytes:
    """``/proc/self/fd/<fd>``: the magic link that reopens (or names) what ``fd`` refers to."""
    return _PROC_FD % fd


def default_max_fds() -> int:
    """Descriptors a namespace may hold: the soft RLIMIT_NOFILE minus a reserve.

    The reserve (an eighth, at least 256) is for sockets, logs, pipes and
    the inodes learned within one request before the pool is trimmed.
    """
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(64, soft - max(256, soft // 8))


@dataclass(eq=False, slots=True)
class Inode:
    """One object the kernel knows.

    Attributes:
        nodeid: the FUSE node id (never reused).
        ino: the backing tmpfs inode number.
        opath: an ``O_PATH`` descriptor of the backing object, or -1 while evicted
            (use :meth:`InodeTable.fd_of`, which reopens it).
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
        control: called when a client opens the file for writing: a daemon-generated
            file that is also a request (``.tierfs/restart``); None for others.
        orphan: unlinked while open; the budget keeps counting it until the last
            handle is closed (managed budget only).
        unlinked: a regular file whose last link is gone: its descriptor is closed with
            its last handle (:meth:`InodeTable.unlinked`), not when the kernel forgets it.
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
    control: Callable[[], None] | None = None
    fhandle: bytes | None = None
    evicted_ctime_ns: int = -1
    orphan: bool = False
    unlinked: bool = False


class InodeTable:
    """Node ids and backing descriptors of every inode the kernel holds (module docstring).

    Args:
        view_dir: the absolute path of the directory served as the mount root.
        reserved: top-level names the daemon owns: inodes under them are
            marked ``reserved``.
        virtual: relative paths (bytes) under reserved names whose content is
            generated when opened (``Inode.virtual``).
        max_fds: descriptors the namespace may hold (``O_PATH`` pool plus open
            handles) before :meth:`trim` evicts.
        controls: relative paths (bytes) under reserved names that a client may open
            for writing: the open calls the function (``Inode.control``).

    Raises:
        OSError: ``view_dir`` cannot be opened.
    """

    def __init__(
        self,
        view_dir: str,
        reserved: frozenset[bytes],
        virtual: dict[bytes, Callable[[], bytes]],
        max_fds: int,
        controls: dict[bytes, Callable[[], None]] | None = None,
    ) -> None:
        self.view_prefix = os.fsencode(view_dir) + b"/"
        self.reserved = reserved
        self.virtual = virtual
        self.controls = controls or {}
        self.max_fds = max_fds
        root_fd = os.open(view_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        st = os.fstat(root_fd)
        #: the view's device: objects elsewhere (a mount inside the view) are refused
        self.dev = st.st_dev
        self.root = Inode(ROOT_ID, st.st_ino, root_fd, stat.S_IFDIR, lookups=1)
        self._by_node: dict[int, Inode] = {ROOT_ID: self.root}
        self._by_ino: dict[int, Inode] = {st.st_ino: self.root}
        self._next_node = itertools.count(ROOT_ID + 1)
        #: evictable O_PATH descriptors, least recently used first (nodeid -> inode)
        self._fd_lru: OrderedDict[int, Inode] = OrderedDict()
        #: a plain descriptor of the view's filesystem, for open_by_handle_at
        self._mount_fd = os.open(view_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
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

    # ------------------------------------------------------------------ finding inodes

    def get(self, nodeid: int) -> Inode:
        """The inode for ``nodeid``.

        Raises:
            OSError: ESTALE if the node id is unknown (forgotten, or never given out).
        """
        try:
            return self._by_node[nodeid]
        except KeyError:
            raise OSError(errno.ESTALE, "unknown inode") from None

    def directory(self, nodeid: int) -> Inode:
        """:meth:`get` for a directory.

        Raises:
            OSError: ESTALE if unknown, ENOTDIR if not a directory.
        """
        inode = self.get(nodeid)
        if not stat.S_ISDIR(inode.mode):
            raise OSError(errno.ENOTDIR, "not a directory")
        return inode

    def by_ino(self, ino: int) -> Inode | None:
        """The inode held for backing inode number ``ino``, if any (safe from any thread)."""
        return self._by_ino.get(ino)

    def writers_of(self, ino: int) -> int:
        """Open writable handles on backing inode ``ino`` (safe from any thread)."""
        inode = self._by_ino.get(ino)
        return inode.writers if inode is not None else 0

    def nodeid_hint(self, st: os.stat_result | None) -> int:
        """The node id already assigned to backing object ``st``, else its inode number; 0 for None.

        For plain READDIR entries, which carry no lookup (the kernel only shows the number).
        """
        if st is None:
            return 0
        known = self._by_ino.get(st.st_ino)
        return known.nodeid if known is not None else st.st_ino

    def count(self) -> int:
        """Number of inodes currently held, the root included (status, tests)."""
        return len(self._by_node)

    def held(self) -> Iterator[Inode]:
        """Every inode held now (do not learn or drop inodes while iterating)."""
        return iter(self._by_node.values())

    def known(self, st: os.stat_result) -> Inode | None:
        """The inode already known for the object ``st`` describes, if that is certain.

        Certain when its descriptor is held (the inode number cannot have been
        reused), or when it was evicted and inode number and ctime both match.
        None means unknown or uncertain: open the object and call :meth:`learn`.
        Adds no lookup.
        """
        known = self._by_ino.get(st.st_ino)
        if known is None:
            return None
        if known.opath >= 0:
            if known is not self.root:
                self._fd_lru.move_to_end(known.nodeid)
            return known
        return known if known.evicted_ctime_ns == st.st_ctime_ns else None

    # ------------------------------------------------------------------ learning and forgetting

    def open_child(self, parent: Inode, name: bytes) -> tuple[int, os.stat_result]:
        """An ``O_PATH`` descriptor of ``name`` in ``parent`` (no symlink followed) and its stat.

        Raises:
            OSError: EINVAL for an invalid name, ENOENT if absent.
        """
        if b"/" in name or name in access.DOTS:
            access.check_name(name)
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd_of(parent))
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            raise
        return fd, st

    def learn(self, parent: Inode, name: bytes, fd: int, st: os.stat_result) -> Inode:
        """Return the inode for backing object ``st`` (opened as ``fd``), adding one lookup.

        Takes ownership of ``fd`` (closed if the inode is already known). A new
        inode under a reserved name is ``reserved`` and, if listed in
        ``virtual``, generated.
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
        reserved = access.is_reserved_child(
            parent.reserved, parent is self.root, name, self.reserved
        )
        virtual = control = None
        if reserved and (self.virtual or self.controls):
            rel = self.child_relpath(parent, name) or b""
            virtual = self.virtual.get(rel)
            control = self.controls.get(rel)
        inode = Inode(
            next(self._next_node),
            st.st_ino,
            fd,
            stat.S_IFMT(st.st_mode),
            lookups=1,
            reserved=reserved,
            virtual=virtual,
            control=control,
        )
        self._by_node[inode.nodeid] = inode
        self._by_ino[inode.ino] = inode
        self._fd_lru[inode.nodeid] = inode
        return inode

    def forget(self, nodeid: int, nlookup: int) -> None:
        """The kernel dropped ``nlookup`` references to ``nodeid`` (never raises).

        Unknown node ids and the root are ignored.
        """
        inode = self._by_node.get(nodeid)
        if inode is None or inode is self.root:
            return
        inode.lookups -= nlookup
        self.drop_if_unused(inode)

    def drop_if_unused(self, inode: Inode) -> None:
        """Drop ``inode`` (closing its descriptor) once no lookup and no handle is left."""
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

    # ------------------------------------------------------------------ descriptor pool

    def fd_of(self, inode: Inode) -> int:
        """An ``O_PATH`` descriptor of ``inode``'s backing object, reopened if evicted.

        The descriptor stays valid until the next :meth:`trim` (do not keep it).

        Raises:
            OSError: ESTALE if the backing object no longer exists.
        """
        fd = inode.opath
        if fd >= 0:
            if inode is not self.root:
                self._fd_lru.move_to_end(inode.nodeid)
            return fd
        if inode.unlinked or inode.fhandle is None:
            raise OSError(errno.ESTALE, "the file was removed")
        fd = syscalls.open_by_handle(self._mount_fd, inode.fhandle, os.O_PATH | os.O_CLOEXEC)
        inode.opath = fd
        self._fd_lru[inode.nodeid] = inode
        return fd

    def unlinked(self, inode: Inode) -> None:
        """``inode`` may just have lost a link: if it has none left and no handle is open,
        close its descriptor now (never raises).

        The descriptor held the file's pages: tmpfs frees them only with its last
        reference, and the kernel forgets an unlinked inode only after the unlink was
        answered. Without this, a client's ``unlink`` returned before the RAM was
        free, and its next write could get ENOSPC on a full budget (a trainer removes
        an old step and saves at once; fault campaign seed 19, 7 December 2026). With
        handles open the descriptor is closed with the last of them
        (:meth:`closed_last_handle`). The inode stays known until the kernel forgets
        it, but no longer by its inode number (tmpfs may reuse it), and
        :meth:`fd_of` raises ESTALE for it.
        """
        if inode is self.root or inode.opath < 0 or not stat.S_ISREG(inode.mode):
            return
        try:
            if os.fstat(inode.opath).st_nlink > 0:
                return  # another link (the store's snapshot of a sealed step) holds it
        except OSError:
            return
        inode.unlinked = True
        if inode.handles <= 0:
            self._let_go(inode)

    def closed_last_handle(self, inode: Inode) -> None:
        """``inode``'s handles are all closed: an unlinked file's descriptor goes now."""
        if inode.unlinked and inode.handles <= 0 and inode.opath >= 0:
            self._let_go(inode)

    def _let_go(self, inode: Inode) -> None:
        """Close an unlinked inode's descriptor and forget its inode number."""
        self._fd_lru.pop(inode.nodeid, None)
        if self._by_ino.get(inode.ino) is inode:
            del self._by_ino[inode.ino]
        try:
            os.close(inode.opath)
        except OSError:
            pass
        inode.opath = -1

    def pooled(self) -> int:
        """``O_PATH`` descriptors in the pool now (the root's is not counted)."""
        return len(self._fd_lru)

    def trim(self, other_fds: int) -> int:
        """Evict least recently used ``O_PATH`` descriptors once past ``max_fds``.

        ``other_fds``: descriptors the namespace holds besides the pool (open
        handles). Evicts down to 15/16 of ``max_fds`` so that a pool at its
        limit is not trimmed after every request. Call between requests, never
        while a descriptor from :meth:`fd_of` is in use. Inodes whose object is
        unlinked (or whose handle cannot be taken) keep their descriptor.
        Returns the number evicted.
        """
        held = len(self._fd_lru) + other_fds
        if held <= self.max_fds or not self.can_evict:
            return 0
        excess = held - (self.max_fds - self.max_fds // 16)
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

    def close(self) -> None:
        """Close every descriptor of the table (it is unusable afterwards)."""
        fds = [i.opath for i in self._by_node.values() if i.opath >= 0]
        fds.append(self._mount_fd)
        self._fd_lru.clear()
        for inode in self._by_node.values():
            inode.opath = -1
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    # ------------------------------------------------------------------ paths

    def relpath(self, inode: Inode) -> bytes | None:
        """Path of ``inode`` relative to the root (b"" for the root); None if unlinked."""
        if inode is self.root:
            return b""
        try:
            fd = self.fd_of(inode)
            target = os.readlink(proc(fd))
        except OSError:
            return None
        if not target.startswith(self.view_prefix):
            return None
        if target.endswith(b" (deleted)") and os.fstat(fd).st_nlink == 0:
            return None
        return target[len(self.view_prefix) :]

    def child_relpath(self, parent: Inode, name: bytes) -> bytes | None:
        """Path of ``name`` in ``parent`` relative to the root; None if ``parent`` is unlinked."""
        if parent is self.root:
            return name
        base = self.relpath(parent)
        return None if base is None else base + b"/" + name
