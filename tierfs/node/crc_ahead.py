"""Checksum a file when its last writer closes it, before its step is sealed (issue
#18 item 1: the crc32c computed on the way, not after the save).

A seal reads every byte of the step once for its manifest's crc32c
(:func:`tierfs.store.manifest.scan_tree`), and replication starts only after
that. Most files of a step are closed well before the step is complete (DCP
writes ``.metadata`` after every rank's data files; HF, NeMo and Orbax rename
the step directory last), so :class:`CrcAhead` reads each big file as its last
write handle closes, in one worker thread at a time, and puts its crc32c (and
its chunks') into the seals' cache, keyed by (inode, size, mtime in ns) exactly
as the seal looks it up. The seal then only stats that file.

Trust: the value is kept only if nothing wrote the file while it was read:
its inode, size and mtime are the same before and after the read, and the
read starts only once the clock has moved :data:`QUIET` past the file's
mtime, so a write after the first look gets a later mtime even on a kernel
whose file timestamps are coarse (tmpfs stamps writes with the coarse
clock before Linux 6.13's multigrain timestamps). A file written after
it was read has another mtime; the seal reads it again.

A file is found by its backing inode, not by the path it had at its close:
trainers rename the step directory right after the last close (plain
files, HF, NeMo), and a read by the old path found nothing (ENOENT), so
the seal read the file itself (#18 run R: one file per rank, renamed at
once). The current path is asked for just before the read.

A file the client removes is let go at once: no descriptor is held while the
read waits for :data:`QUIET`, and an unlink of the file being read waits
(deferred, never blocking the FUSE thread) until the read stopped and its
descriptor was closed (:meth:`CrcAhead.let_go`). A held descriptor kept the
removed file's pages, and the client's next write on a full RAM budget got
ENOSPC (fault campaign seed 19, 7 December 2026).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from tierfs.store.manifest import CrcCache, crc32c_chunks

log = logging.getLogger(__name__)

#: files smaller than this (bytes) are left to the seal (reading them is cheap)
MIN_BYTES = 4 << 20
#: seconds the clock must be past a file's mtime before it is read (a coarse
#: timestamp tick is at most 10 ms)
QUIET = 0.02
#: files waiting to be read at most (a burst beyond it is left to the seal)
PENDING = 256
#: entries of the cache this fills, at most (oldest forgotten first)
KEPT = 4096


class CrcAhead:
    """Checksums big files as their last writer closes them (see the module docstring).

    Args:
        root: the directory the view-relative paths are under (the RAM store's view).
        cache: the seals' crc32c cache (:attr:`tierfs.node.steps.StepBook.crc_cache`);
            filled on the trio thread.
        spawn: starts a background task (``TaskSpawner.spawn``).
        locate: the current view-relative path of the file with backing inode
            number ``ino``, or None when unknown (trio thread); without it the
            path at the close is read.
    """

    def __init__(
        self,
        root: str,
        cache: CrcCache,
        spawn: Callable[[Callable[..., Awaitable[object]]], Any],
        locate: Callable[[int], str | None] | None = None,
    ) -> None:
        self.root = root
        self.cache = cache
        self.spawn = spawn
        self.locate = locate or (lambda ino: None)
        #: view-relative path at the last close -> backing inode number (0: unknown)
        self._pending: dict[str, int] = {}
        self._running = False
        self._added: dict[tuple[int, int, int], None] = {}
        #: files taken into the queue, and read (or skipped) since the start
        self._queued = 0
        self._finished = 0
        self._progress = trio.Event()
        #: files read here, and their bytes (status and tests)
        self.files = 0
        self.bytes = 0
        #: the read under way: (backing inode number, stop flag for the worker, set
        #: once its descriptor is closed), None between reads
        self._in_read: tuple[int, threading.Event, trio.Event] | None = None

    def closed(self, path: str, ino: int = 0) -> None:
        """The last write handle of the view file ``path`` (backing inode number
        ``ino``; 0: unknown) closed (trio thread; never blocks): read it in the
        background when it is big enough."""
        if path in self._pending or len(self._pending) >= PENDING:
            return
        self._pending[path] = ino
        self._queued += 1
        if not self._running:
            self._running = True
            self.spawn(self._drain)

    async def _drain(self) -> None:
        try:
            while self._pending:
                path, ino = next(iter(self._pending.items()))
                try:
                    found = await self._read(ino, path)
                except OSError as exc:
                    log.debug("checksum ahead of the seal of %s: %s", path, exc)
                    found = None
                finally:
                    self._pending.pop(path, None)
                if found is not None:
                    key, value, size = found
                    log.debug("checksummed a file closed as %s ahead of the seal (%d bytes)",
                              path, size)  # fmt: skip
                    self.cache[key] = value
                    self._added[key] = None
                    self.files += 1
                    self.bytes += size
                    while len(self._added) > KEPT:
                        old = next(iter(self._added))
                        del self._added[old]
                        self.cache.pop(old, None)
                self._finished += 1
                self._wake()
        finally:
            self._running = False
            self._wake()

    def _wake(self) -> None:
        progress, self._progress = self._progress, trio.Event()
        progress.set()

    async def settled(self) -> None:
        """Return once every file queued before this call was read (or skipped); at
        once when none is waiting (trio thread). Files closed later are not waited
        for. A seal waits here instead of reading the same bytes beside the worker
        (#18: on 2 busy vCPUs that doubled the seal's CPU)."""
        target = self._queued
        while self._finished < target and self._running:
            await self._progress.wait()

    async def _read(
        self, ino: int, path: str
    ) -> tuple[tuple[int, int, int], tuple[int, tuple[int, ...] | None], int] | None:
        """:meth:`_checksum` of the file at its current path; a file renamed between
        the look and the open is looked up once more.

        Raises:
            OSError: the file is gone or unreadable.
        """
        first = self.locate(ino) if ino > 0 else None
        stop, closed = threading.Event(), trio.Event()
        self._in_read = (ino, stop, closed)
        try:
            try:
                return await trio.to_thread.run_sync(self._checksum, first or path, ino, stop)
            except FileNotFoundError:
                again = self.locate(ino) if ino > 0 else None
                if again is None or again == (first or path):
                    raise
                return await trio.to_thread.run_sync(self._checksum, again, ino, stop)
        finally:
            self._in_read = None
            closed.set()

    def let_go(self, ino: int) -> Callable[[], Awaitable[None]] | None:
        """The client is about to remove the last link of backing inode ``ino`` (FUSE
        thread, which is the trio thread; never blocks): None if no read here holds
        it, else the read is told to stop and what to wait for until its descriptor
        is closed (one chunk of :data:`tierfs.store.chunks.CHUNK` bytes at most).
        """
        current = self._in_read
        if current is None or ino <= 0 or current[0] != ino:
            return None
        current[1].set()
        return current[2].wait

    def _checksum(
        self, path: str, ino: int = 0, stop: threading.Event | None = None
    ) -> tuple[tuple[int, int, int], tuple[int, tuple[int, ...] | None], int] | None:
        """(cache key, cache value, bytes) of the view file ``path``, or None when it
        is small, not a regular file, another file than backing inode ``ino``
        (when not 0), already known, or was written while read (worker thread).
        ``stop`` set: the client removes the file; the read ends at the next chunk.

        Raises:
            OSError: the file is gone or unreadable; InterruptedError when ``stop``
                was set.
        """
        stop = stop or threading.Event()
        full = os.path.join(self.root, path)
        look = os.stat(full, follow_symlinks=False)  # no descriptor held while waiting
        if not stat.S_ISREG(look.st_mode) or look.st_size < MIN_BYTES:
            return None
        if ino > 0 and look.st_ino != ino:
            return None  # another file took the name: its own close brings it here
        age = time.time_ns() - look.st_mtime_ns
        if age < QUIET * 1e9 and stop.wait(QUIET - age / 1e9):
            raise InterruptedError("the file is being removed")
        fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            before = os.fstat(fd)
            if not stat.S_ISREG(before.st_mode) or before.st_size < MIN_BYTES:
                return None
            if before.st_ino != look.st_ino:
                return None  # another file took the name: its own close brings it here
            key = (before.st_ino, before.st_size, before.st_mtime_ns)
            if key in self.cache:
                return None
            crc, size, crcs = crc32c_chunks(fd, cancelled=stop.is_set)
            after = os.fstat(fd)
            if size != before.st_size or (after.st_ino, after.st_size, after.st_mtime_ns) != key:
                return None  # written meanwhile: the seal reads it
            return key, (crc, crcs if len(crcs) > 1 else None), size
        finally:
            os.close(fd)
