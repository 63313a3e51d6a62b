"""The RAM store: the directory on tmpfs that holds every byte tierfs keeps.

Layout of ``--ram-dir`` (DESIGN.md principle 1)::

    <ram-dir>/
      view/                 the client-visible tree, served as the mount root
      store/
        shards/<job>/<rank>/<step>/   sealed snapshots and peers' replicas
        incoming/<id>/      transfers in progress (peer receive, GCS download)
        trash/<id>/         hidden client entries and withdrawn snapshots
        state.json          the node agent's small state file
        daemon.pid, daemon.log

Everything lives on one filesystem so that sealing is a hard link and hiding
is a rename. A restarted daemon finds the same tree and re-serves it.

The budget is the amount of RAM tierfs may fill. Two accounting modes:

* ``native``: the budget is what the filesystem under the ram-dir can still
  hold; the filesystem itself returns ENOSPC and the kernel may pass file
  data straight through to it (FUSE passthrough).
* ``managed``: ``--size`` is smaller than that, so tierfs counts the bytes
  itself (a periodic count of the ram-dir, plus growth granted and minus
  bytes freed since, plus files unlinked while open) and refuses growth past
  the budget with ENOSPC. Writes then go through the daemon (no passthrough).

Either way the budget covers the sealed snapshots in ``store/`` as well as
the view: a step deleted from the view keeps its bytes while retention keeps
its snapshot.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from tierfs.core.mounts import fs_type

log = logging.getLogger(__name__)

TMPFS_MAGIC = 0x01021994
#: seconds a trashed entry is kept before its bytes are freed (unless RAM is short)
TRASH_GRACE = 30.0


@dataclass(frozen=True, slots=True)
class StatFs:
    """What ``statfs`` reports through the mount (all counts in ``bsize`` blocks)."""

    bsize: int
    blocks: int
    bfree: int
    bavail: int
    files: int
    ffree: int
    namelen: int = 255


class Budget:
    """The RAM budget of one RAM store.

    Args:
        root: the ram-dir (any path on the store's filesystem).
        size: the budget in bytes, or None for "what the filesystem can hold".
        used_at_start: bytes the store already holds when the daemon starts
            (counted by :meth:`RamStore.usage`).
        recount: optional ``(seen) -> bytes`` that counts the store again and
            adds the inode number of everything it counted to the set ``seen``
            (:meth:`RamStore.usage`; a walk: call :meth:`recount` from a worker
            thread, never the FUSE thread).

    In managed mode the store's usage is its own count, not the filesystem's:
    the last count (:meth:`recount`, done periodically by the node agent)
    plus the growth granted since, minus what the namespace reported freed
    since (:meth:`release`: a file's last link removed, a truncation, a
    punched hole). Other programs filling a shared tmpfs therefore never eat
    into the budget (they can still fill the filesystem, which then answers
    ENOSPC itself). Files unlinked while open are invisible to a count; the
    namespace hands them to :meth:`hold_orphan` so they keep counting until
    their last handle is closed (:meth:`drop_orphan`).

    Bytes the agent frees outside the mount (dropped snapshots, trash) show
    at the next count. Thread-safe: growth is granted from the FUSE thread
    and from gRPC threads, counts run in a worker thread.
    """

    def __init__(
        self,
        root: str,
        size: int | None,
        used_at_start: int,
        recount: Callable[[set[int]], int] | None = None,
    ) -> None:
        self.root = root
        self._recount = recount
        self._lock = threading.Lock()
        self._base = used_at_start
        self._grown = 0
        self._freed = 0
        self._refused = False
        #: while a count runs: whole objects freed meanwhile, (inode number, bytes)
        self._counting = False
        self._freed_while_counting: list[tuple[int, int]] = []
        #: called (from the FUSE thread) after a removal left an object's bytes to its
        #: other links, e.g. a dropped snapshot in the trash (see RamStore.attach_budget)
        self.on_shared_remove: Callable[[], None] | None = None
        #: files unlinked while open: inode number -> a descriptor that keeps them
        self._orphans: dict[int, int] = {}
        vfs = os.statvfs(root)
        fs_used = (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize
        fs_avail = vfs.f_bavail * vfs.f_frsize
        #: bytes on the filesystem that are not ours when the daemon started
        self.foreign = max(0, fs_used - used_at_start)
        native_capacity = used_at_start + fs_avail
        if size is None or size >= native_capacity:
            self.mode = "native"
            self._size = None
        else:
            self.mode = "managed"
            self._size = size

    @property
    def native(self) -> bool:
        """True when the filesystem itself enforces the budget."""
        return self.mode == "native"

    @property
    def size(self) -> int:
        """The budget in bytes (native: what the store holds plus what the filesystem can take)."""
        if self._size is not None:
            return self._size
        return self.used() + self.free()

    def used(self) -> int:
        """Bytes the store holds now.

        Managed mode: the store's own count. Native mode: the filesystem's
        usage minus what others used at the last count (an estimate between
        counts, re-anchored by :meth:`recount`).
        """
        if not self.native:
            return max(0, self._base + self._grown - self._freed)
        vfs = os.statvfs(self.root)
        return max(0, (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize - self.foreign)

    def free(self) -> int:
        """Bytes that can still be written before ENOSPC."""
        vfs = os.statvfs(self.root)
        fs_avail = vfs.f_bavail * vfs.f_frsize
        if self.native:
            return fs_avail
        return max(0, min(fs_avail, self.size - self.used()))

    @property
    def wants_recount(self) -> bool:
        """True when a fresh count matters soon: ENOSPC was answered, or the budget is 90 % used.

        The node agent then counts the store every half second (in a worker
        thread) instead of every few seconds, so bytes freed outside the
        mount (dropped snapshots, emptied trash) return quickly.
        """
        if self.native:
            return False
        return self._refused or self.used() >= 0.9 * self.size

    def recount(self) -> None:
        """Count the store again and install the result (blocking: a worker thread).

        Growth granted while counting stays added (counted at most twice,
        which errs towards ENOSPC, never past the budget). A whole object
        freed while counting stays subtracted only if the count saw it; a
        truncation while counting is forgotten (the count may or may not
        include it), again erring towards ENOSPC until the next count.
        """
        if self._recount is None:
            return
        with self._lock:
            self._counting = True
            self._freed_while_counting = []
            grown_before = self._grown
        seen: set[int] = set()
        try:
            counted = self._recount(seen)
        except BaseException:
            with self._lock:
                self._counting = False
            raise
        with self._lock:
            self._counting = False
            orphans = self._orphan_bytes(exclude=seen)
            self._base = counted + orphans
            self._grown = max(0, self._grown - grown_before)
            self._freed = sum(n for ino, n in self._freed_while_counting if ino in seen)
            self._freed_while_counting = []
            self._refused = False
            if self.native:
                # re-anchor the estimate: others' usage is the filesystem's minus ours
                vfs = os.statvfs(self.root)
                self.foreign = max(0, (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize - self._base)

    @property
    def grown(self) -> int:
        """Growth granted since the last count (bytes)."""
        return self._grown

    def check_growth(self, nbytes: int) -> None:
        """Grant ``nbytes`` more bytes, or raise ``OSError(ENOSPC)`` past the budget.

        Only meaningful in managed mode; in native mode the filesystem answers.
        Never counts the store itself (that is a walk, done off the FUSE
        thread by the node agent, see :attr:`wants_recount`).
        """
        if nbytes <= 0 or self.native:
            return
        with self._lock:
            if self.used() + nbytes > self._size:  # type: ignore[operator]
                self._refused = True
                raise OSError(errno.ENOSPC, "tierfs RAM budget exhausted")
            self._grown += nbytes

    def release(self, nbytes: int, ino: int | None = None) -> None:
        """``nbytes`` of the store were freed (managed mode; native mode ignores it).

        Args:
            nbytes: bytes freed (``st_blocks * 512`` before minus after).
            ino: the inode number when a whole object is gone (its last link
                removed and no handle open); None for a truncation or a hole.
        """
        if nbytes <= 0 or self.native:
            return
        with self._lock:
            self._freed += nbytes
            if self._counting and ino is not None:
                self._freed_while_counting.append((ino, nbytes))

    def shared_removed(self) -> None:
        """A removal took a link of an object that keeps other links (managed mode).

        Its bytes are freed only with its last link. If that is in the trash (a
        snapshot retention dropped before the client deleted its own copy), the
        trash reclaimer is woken to look again: otherwise the bytes would wait
        for the trash's grace period while writes get ENOSPC. Never blocks.
        """
        callback = self.on_shared_remove
        if callback is not None:
            callback()

    def hold_orphan(self, ino: int, fd: int) -> None:
        """Keep counting file ``ino``, unlinked while open, until :meth:`drop_orphan`.

        Takes ownership of ``fd`` (any descriptor of the file; closed by
        :meth:`drop_orphan` or :meth:`close`). Managed mode only; in native
        mode ``fd`` is closed at once.
        """
        if self.native:
            os.close(fd)
            return
        with self._lock:
            old = self._orphans.pop(ino, None)
            self._orphans[ino] = fd
        if old is not None:
            os.close(old)

    def drop_orphan(self, ino: int) -> None:
        """The last handle of orphan ``ino`` was closed: its bytes are free."""
        with self._lock:
            fd = self._orphans.pop(ino, None)
            if fd is None:
                return
            try:
                nbytes = os.fstat(fd).st_blocks * 512
            except OSError:
                nbytes = 0
            self._freed += nbytes
            if self._counting:
                self._freed_while_counting.append((ino, nbytes))
        os.close(fd)

    def orphans(self) -> int:
        """Number of files unlinked while open that still count (status, tests)."""
        return len(self._orphans)

    def _orphan_bytes(self, exclude: set[int]) -> int:
        total = 0
        for ino, fd in self._orphans.items():
            if ino in exclude:
                continue  # the count saw it before it was unlinked
            try:
                total += os.fstat(fd).st_blocks * 512
            except OSError:
                continue
        return total

    def close(self) -> None:
        """Close the descriptors of orphans (the budget is unusable afterwards)."""
        with self._lock:
            fds = list(self._orphans.values())
            self._orphans.clear()
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def statfs(self) -> StatFs:
        """The budget as a statfs answer: total = budget, free = what is left."""
        vfs = os.statvfs(self.root)
        bsize = vfs.f_frsize or 4096
        free = self.free() // bsize
        total = max(self.size // bsize, free)
        return StatFs(bsize, total, free, free, vfs.f_files, vfs.f_ffree, vfs.f_namemax)


@dataclass(frozen=True, slots=True)
class StoreUsage:
    """One count of a ram-dir by area (:meth:`RamStore.usage`), in bytes allocated.

    A file hard-linked into several areas (a sealed step's snapshot shares
    its files with the view) counts once, in the first area counted: the
    view, then the shards, then the rest.

    Attributes:
        view: the client-visible tree.
        shards: bytes under ``store/shards/<job>/<rank>/`` not also in the
            view, by ``(job, rank)`` as named on disk: this node's own sealed
            snapshots (steps deleted from the view but kept by
            ``--keep-local``, or rewritten since) and the replicas of peers.
        other: everything else (transfers in progress, trash, state, log).
        counted_at: Unix time of the count.
    """

    view: int
    shards: dict[tuple[str, str], int]
    other: int
    counted_at: float

    @property
    def total(self) -> int:
        """All bytes of the ram-dir."""
        return self.view + sum(self.shards.values()) + self.other


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


class RamStore:
    """Paths and housekeeping of one ram-dir (see the module docstring).

    Args:
        root: the ram-dir; created if missing, with mode 0700: nobody else may
            read the checkpoints behind the mount's back. (``view/`` keeps the
            usual 0755: it is the mount root, which other users enter through
            ``-o allow_other``; ``store/`` is always 0700.)

    Raises:
        OSError: the directory cannot be created or is not writable.
    """

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.view = os.path.join(self.root, "view")
        self.store = os.path.join(self.root, "store")
        self.shards = os.path.join(self.store, "shards")
        self.incoming = os.path.join(self.store, "incoming")
        self.trash = os.path.join(self.store, "trash")
        #: the last count by area (:meth:`usage`), None before the first
        self.last_usage: StoreUsage | None = None
        #: the budget told about bytes :meth:`empty_trash` frees (see :meth:`attach_budget`)
        self._budget: Budget | None = None
        self._trash_lock = threading.Lock()
        self._trashed = threading.Event()
        #: the trash may hold entries (set by to_trash, cleared by a pass that emptied it)
        self._trash_held = True
        if not os.path.lexists(self.root):
            # mode at mkdir time: never readable by others, not even for a moment
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            os.chmod(self.root, 0o700)
        os.makedirs(self.view, exist_ok=True)
        for d in (self.store, self.shards, self.incoming, self.trash):
            os.makedirs(d, mode=0o700, exist_ok=True)
        os.chmod(self.store, 0o700)

    @property
    def state_file(self) -> str:
        return os.path.join(self.store, "state.json")

    @property
    def pid_file(self) -> str:
        return os.path.join(self.store, "daemon.pid")

    @property
    def log_file(self) -> str:
        return os.path.join(self.store, "daemon.log")

    def on_tmpfs(self) -> bool:
        """True when the ram-dir lives on tmpfs (bytes in RAM, not on a disk)."""
        return fs_type(self.root) in ("tmpfs", "ramfs")

    def usage(self, seen: set[int] | None = None) -> int:
        """Bytes allocated by everything under the ram-dir (hard links counted once).

        The count by area is kept in :attr:`last_usage` (``tierfs status``).
        Blocking (a walk, lstat only): never on the FUSE thread.

        Args:
            seen: if given, receives the inode number of every object counted.
        """
        if seen is None:
            seen = set()
        view = self._count_tree(self.view, seen)
        shards: dict[tuple[str, str], int] = {}
        for job in _listdir(self.shards):
            for rank in _listdir(os.path.join(self.shards, job)):
                shards[(job, rank)] = self._count_tree(os.path.join(self.shards, job, rank), seen)
        # the rest (incoming, trash, state, log), without walking the two trees again
        other = self._count_tree(self.root, seen, prune=(self.view, self.shards))
        self.last_usage = StoreUsage(view, shards, other, time.time())
        return self.last_usage.total

    @staticmethod
    def _count_tree(top: str, seen: set[int], prune: tuple[str, ...] = ()) -> int:
        """Bytes of the objects under ``top`` (itself excluded) not already in ``seen``;
        the directories in ``prune`` count, but not what is inside them."""
        total = 0
        for dirpath, dirnames, filenames in os.walk(top):
            if prune:
                dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) not in prune]
                for d in prune:
                    if os.path.dirname(d) == dirpath:
                        filenames = [*filenames, os.path.basename(d)]
            for name in dirnames + filenames:
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except OSError:
                    continue
                if st.st_ino in seen:
                    continue
                seen.add(st.st_ino)
                total += st.st_blocks * 512
        return total

    def new_incoming(self, prefix: str = "in") -> str:
        """Create and return a fresh directory under ``incoming/``."""
        path = os.path.join(self.incoming, f"{prefix}-{uuid.uuid4().hex[:12]}")
        os.makedirs(path)
        return path

    def to_trash(self, path: str) -> str:
        """Move ``path`` (inside the ram-dir) to ``trash/`` with one rename; returns where.

        The trash name starts with the Unix time, so :meth:`empty_trash` can
        leave recent entries alone for a while.
        """
        dest = os.path.join(
            self.trash, f"{int(time.time())}-{uuid.uuid4().hex[:8]}-{os.path.basename(path)}"
        )
        os.rename(path, dest)
        self._trash_held = True
        self._trashed.set()
        return dest

    def attach_budget(self, budget: Budget) -> None:
        """Report what :meth:`empty_trash` frees to ``budget`` (and let it waive the grace).

        Also starts a thread that empties the trash right after :meth:`to_trash`
        whenever the trash then holds more than the budget has free: a
        snapshot dropped by retention makes room for the next step at once,
        not at the node agent's next housekeeping round. The thread also
        looks again when the client removes a link of a file whose other
        links may be in the trash (:meth:`Budget.shared_removed`): retention
        may drop a snapshot before the client deletes its copy of the step.
        """
        self._budget = budget
        budget.on_shared_remove = self._wake_reclaimer
        threading.Thread(target=self._reclaimer, name="trash-reclaimer", daemon=True).start()

    def _wake_reclaimer(self) -> None:
        if self._trash_held:
            self._trashed.set()

    def _reclaimer(self) -> None:
        while True:
            self._trashed.wait()
            self._trashed.clear()
            try:
                self.empty_trash(TRASH_GRACE)
            except OSError:
                log.warning("emptying the trash failed", exc_info=True)

    def empty_trash(self, min_age: float = TRASH_GRACE) -> int:
        """Delete trash entries older than ``min_age`` seconds; returns entries removed.

        The grace period lets a reader that is still walking a hidden entry
        (a client reading through a restore marker that was just replaced, a
        peer streaming a dropped snapshot) finish. It is waived when the
        trash holds more freeable bytes than the budget has free (a snapshot
        dropped by retention is then what the next step needs).

        With a budget attached (:meth:`attach_budget`), the bytes freed are
        released to it at once: a dropped snapshot's room is back before the
        next count. Blocking (may free many GiB): call from a worker thread.
        """
        with self._trash_lock:  # the reclaimer thread and the node agent's housekeeping
            return self._empty_trash(min_age)

    def _empty_trash(self, min_age: float) -> int:
        now = time.time()
        names = os.listdir(self.trash)

        def young(name: str) -> bool:
            stamp = name.split("-", 1)[0]
            return stamp.isdigit() and now - int(stamp) < min_age

        budget = self._budget
        if budget is not None and any(young(n) for n in names):
            held = sum(n for name in names for _ino, n in self._freeable(name))
            if held > budget.free():
                min_age = 0.0
        removed = 0
        for name in names:
            if young(name):
                continue
            freeable = self._freeable(name) if budget is not None else []
            p = os.path.join(self.trash, name)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                try:
                    os.unlink(p)
                except OSError:
                    continue
            removed += 1
            if budget is not None and not os.path.lexists(p):
                for ino, nbytes in freeable:
                    budget.release(nbytes, ino)
        self._trash_held = bool(os.listdir(self.trash))  # to_trash meanwhile wakes a new pass
        return removed

    def _freeable(self, name: str) -> list[tuple[int, int]]:
        """(inode number, bytes) of the objects in trash entry ``name`` with no link elsewhere.

        Not cached: a link elsewhere (the client's copy in the view) may go at
        any time. Blocking: a walk (lstat only).
        """
        top = os.path.join(self.trash, name)
        found: dict[int, list[int]] = {}  # ino -> [links outside unknown, bytes, links seen]

        def note(path: str) -> None:
            try:
                st = os.lstat(path)
            except OSError:
                return
            entry = found.setdefault(st.st_ino, [st.st_nlink, st.st_blocks * 512, 0])
            entry[2] += 1
            if stat.S_ISDIR(st.st_mode):
                entry[0] = 1  # a directory has no other name; its nlink counts subdirectories

        note(top)
        if os.path.isdir(top) and not os.path.islink(top):
            for dirpath, dirnames, filenames in os.walk(top):
                for n in dirnames + filenames:
                    note(os.path.join(dirpath, n))
        return [(ino, nbytes) for ino, (nlink, nbytes, seen) in found.items() if seen >= nlink]

    def clear_incoming(self) -> None:
        """Drop transfers a previous daemon left unfinished (called once at start)."""
        for name in os.listdir(self.incoming):
            os.rename(os.path.join(self.incoming, name), os.path.join(self.trash, f"inc-{name}"))
