"""File proxies for transfers and the bounded thread pool that runs them.

:class:`Stream` wraps the local file of one object transfer, in either
direction: an upload reads through it, a download writes through it. Both
ways it stops on cancel, tells the bucket monitor each piece moved (data
progress, for "slow or stalled" reports) and counts new bytes for the caller's
progress; a download also computes the crc32c and size of what was written.
:func:`run_parallel` runs one batch of transfers on a bounded pool, stopping the
batch at its first failure.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from collections.abc import Callable
from typing import Any

from tierfs.backup.errors import Cancelled
from tierfs.backup.monitor import BucketMonitor, extend_deadline


class Abort:
    """A stop flag for one parallel batch: set by its first failure, or by the caller's
    ``cancel`` event."""

    def __init__(self, outer: threading.Event | None) -> None:
        self.outer = outer
        self.local = threading.Event()

    def is_set(self) -> bool:
        return self.local.is_set() or (self.outer is not None and self.outer.is_set())

    def set(self) -> None:
        self.local.set()


class Stream:
    """The local file of one object transfer (an upload reads it, a download writes it).

    Args:
        f: the open file (binary).
        cancel: checked before each piece; set -> :class:`Cancelled`.
        on_bytes: told each increment of new bytes (any thread). An upload
            counts positions past the highest one read so far (a retried
            chunk is read again but not counted twice).
        monitor: told each piece moved (data progress).
        window: for a resumable upload (one request per chunk, each retried
            on its own): at each read, the thread's request deadline becomes
            ``window`` seconds from now, so every chunk gets a full retry
            deadline and no more.

    Attributes:
        crc, size: crc32c and bytes of what was written (downloads).
    """

    def __init__(
        self,
        f: Any,
        cancel: Abort | None,
        on_bytes: Callable[[int], None] | None,
        monitor: BucketMonitor | None = None,
        window: float | None = None,
    ) -> None:
        import google_crc32c

        self._f = f
        self._cancel = cancel
        self._on_bytes = on_bytes
        self._monitor = monitor
        self._window = window
        self._extend = google_crc32c.extend
        self._high = 0
        self.crc = 0
        self.size = 0

    def _piece(self, what: str) -> None:
        if self._cancel is not None and self._cancel.is_set():
            raise Cancelled(f"{what} cancelled")

    def _moved(self, new: int) -> None:
        if self._monitor is not None:
            self._monitor.progress()
        if new > 0 and self._on_bytes is not None:
            self._on_bytes(new)

    def read(self, n: int = -1) -> bytes:
        self._piece("upload")
        data: bytes = self._f.read(n)
        pos = self._f.tell()
        if self._window is not None:
            extend_deadline(self._window)
        self._moved(pos - self._high)
        self._high = max(self._high, pos)
        return data

    def write(self, data: bytes) -> int:
        self._piece("download")
        n: int = self._f.write(data)
        self.crc = self._extend(self.crc, bytes(data))
        self.size += len(data)
        self._moved(len(data))
        return n

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        pos: int = self._f.seek(offset, whence)
        return pos

    def tell(self) -> int:
        pos: int = self._f.tell()
        return pos

    def flush(self) -> None:
        self._f.flush()


def run_parallel(threads: int, tasks: list[Callable[[], Any]], abort: Abort | None) -> list[Any]:
    """Run ``tasks`` on a pool of at most ``threads`` threads; the first failure sets
    ``abort`` (which the tasks' streams watch), cancels what has not started, and is
    raised. Returns the results in completion order."""
    if not tasks:
        return []
    stop = abort if abort is not None else Abort(None)

    def guarded(fn: Callable[[], Any]) -> Any:
        if stop.is_set():
            raise Cancelled("cancelled")
        return fn()

    results: list[Any] = []
    with cf.ThreadPoolExecutor(min(threads, len(tasks))) as pool:
        futures = [pool.submit(guarded, t) for t in tasks]
        try:
            for fut in cf.as_completed(futures):
                results.append(fut.result())
        except BaseException:
            stop.set()
            for f in futures:
                f.cancel()
            raise
    return results
