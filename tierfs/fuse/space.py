"""RAM budget accounting of the namespace: growth checks, bytes freed, files unlinked while open.

In ``native`` mode the filesystem under the ram-dir keeps the budget itself
(it answers ENOSPC) and nothing here does any work. In ``managed`` mode
(``--size`` below what the filesystem can hold, see
:class:`tierfs.store.ramstore.Budget`) tierfs counts: a write, fallocate or
copy is checked for the pages it would newly allocate (:func:`unallocated`,
so rewriting data costs nothing and a sparse write only what it writes), and
truncations, hole punches and removals tell the budget what they freed. A
file unlinked while a handle is open keeps counting until its last handle is
closed (an *orphan*, held by the budget).
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Protocol

from tierfs.fuse.inodes import Inode, InodeTable
from tierfs.store.ramstore import StatFs

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


class SpaceBudget(Protocol):
    """What the namespace needs of :class:`tierfs.store.ramstore.Budget` (bytes throughout)."""

    @property
    def native(self) -> bool:
        """The filesystem keeps the budget (ENOSPC is its own); nothing to count."""
        ...

    def check_growth(self, nbytes: int) -> None:
        """Grant ``nbytes`` more, or raise ``OSError(ENOSPC)`` (managed mode)."""

    def release(self, nbytes: int, ino: int | None = None) -> None:
        """``nbytes`` were freed."""

    def shared_removed(self) -> None:
        """A name of an object with other links (a sealed snapshot's) was removed."""

    def hold_orphan(self, ino: int, fd: int) -> None:
        """Keep counting unlinked file ``ino`` (takes ``fd``) until :meth:`drop_orphan`."""

    def drop_orphan(self, ino: int) -> None:
        """The orphan ``ino`` lost its last handle: its bytes are free."""

    def statfs(self) -> StatFs:
        """The budget as statfs numbers."""
        ...


class Space:
    """The namespace's side of the budget (module docstring).

    Args:
        budget: the RAM budget.
        inodes: the inode table (an unlinked file with open handles becomes an orphan).
    """

    def __init__(self, budget: SpaceBudget, inodes: InodeTable) -> None:
        self.budget = budget
        self._inodes = inodes

    @property
    def native(self) -> bool:
        """The filesystem keeps the budget: no counting, passthrough possible."""
        return self.budget.native

    def check_new_file(self) -> None:
        """A new regular file is about to be created (one byte of growth in managed mode).

        Raises:
            OSError: ENOSPC past the budget.
        """
        self.budget.check_growth(1)

    def check_write(self, fd: int, offset: int, length: int) -> None:
        """Writing ``[offset, offset + length)`` of ``fd`` is about to happen (managed mode).

        Raises:
            OSError: ENOSPC if the range's unallocated pages pass the budget.
        """
        if not self.budget.native:
            self.budget.check_growth(unallocated(fd, offset, length))

    def allocated(self, fd: int) -> int:
        """Bytes allocated to ``fd``'s file (managed mode; 0 in native mode)."""
        return 0 if self.budget.native else os.fstat(fd).st_blocks * 512

    def shrunk(self, fd: int, before: int) -> None:
        """``fd``'s file had ``before`` bytes allocated: release what a truncation freed."""
        if self.budget.native:
            return
        try:
            after = os.fstat(fd).st_blocks * 512
        except OSError:
            return
        self.budget.release(before - after)

    def before_remove(self, dirfd: int, name: bytes) -> int:
        """An ``O_PATH`` descriptor of ``name`` about to lose a link, or -1.

        -1 in native mode (the filesystem keeps the budget) and when ``name``
        cannot be opened (the removal itself will report why). Hand it to
        :meth:`after_remove` whether the removal succeeded or not.
        """
        if self.budget.native:
            return -1
        try:
            return os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
        except OSError:
            return -1

    def after_remove(self, fd: int) -> None:
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
        inode = self._inodes.by_ino(st.st_ino)
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

    def closed(self, inode: Inode) -> None:
        """The last handle of ``inode`` was closed: an orphan's bytes are free now."""
        if inode.orphan:
            inode.orphan = False
            self.budget.drop_orphan(inode.ino)

    def statfs(self) -> StatFs:
        """The RAM budget as statfs numbers."""
        return self.budget.statfs()
