"""Writing a fetched file chunk by chunk, each checked against the manifest first (issue #14).

A :class:`VerifiedWriter` is the ``write(data, offset)`` a
:class:`tierfs.core.ports.FileSource` is given: it holds each chunk until it is
complete, compares its crc32c with the manifest's
(:class:`tierfs.store.chunks.ChunkChecker`) and only then writes it into the
file, so the file holds verified bytes from offset 0 up to the watermark and
holes after it; never a byte the manifest does not vouch for. The watermark is
reported to the trio thread (``on_verified``) as it moves.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence

from tierfs.store.chunks import ChunkChecker, ChunkMismatch


class VerifiedWriter:
    """Verified positional writes into a duplicate of ``fd`` (worker threads).

    Args:
        fd: the file's descriptor (duplicated here; the caller keeps its own).
        size: the file's bytes by the manifest.
        chunk_size: bytes per chunk; crcs: each chunk's crc32c (the manifest's).
        on_verified: told the watermark (bytes) each time it moves, from the
            writing thread (it must hand over to the trio thread itself).

    Raises:
        OSError: ``fd`` cannot be duplicated. ValueError: ``crcs`` does not fit ``size``.
    """

    def __init__(
        self,
        fd: int,
        size: int,
        chunk_size: int,
        crcs: Sequence[int],
        on_verified: Callable[[int], None],
    ) -> None:
        self.checker = ChunkChecker(size, crcs, chunk_size)
        self._fd = os.dup(fd)
        self._on_verified = on_verified
        self._lock = threading.Lock()
        self._busy = False
        self._closed = False

    @property
    def verified(self) -> int:
        """Bytes from offset 0 checked and written."""
        return self.checker.verified

    def __call__(self, data: bytes, offset: int, crc32c: int | None = None) -> None:
        """Take ``data`` at ``offset`` (a :class:`tierfs.core.ports.PositionalWrite`;
        ``crc32c``: the caller's own crc of ``data``, see
        :meth:`tierfs.store.chunks.ChunkChecker.feed`).

        Raises:
            ChunkMismatch: a chunk is not the manifest's (nothing of it written), or
                the writer is closed (an abandoned transfer's thread).
            OSError: the write failed (ENOSPC...).
        """
        with self._lock:
            if self._closed or self._busy:
                raise ChunkMismatch("the fetch this copy was for has ended")
            self._busy = True
        before = self.checker.verified
        try:
            for start, pieces in self.checker.feed(offset, data, crc32c):
                off = start
                try:
                    for piece in pieces:
                        view = memoryview(piece)
                        while view:
                            n = os.pwrite(self._fd, view, off)
                            view, off = view[n:], off + n
                except BaseException:
                    # that chunk is not in the file: the watermark stays below it
                    self.checker.verified = start
                    self.checker.restart(0)
                    raise
            after = self.checker.verified
        finally:
            with self._lock:
                self._busy = False
                if self._closed:
                    os.close(self._fd)
        if after != before:
            self._on_verified(after)

    def reset(self) -> None:
        """Check from scratch (the file was emptied: no byte is verified any more)."""
        with self._lock:
            self.checker = ChunkChecker(self.checker.size, self.checker.crcs, self.checker.chunk)

    def close(self) -> None:
        """No more writes; the duplicate is closed now or when a write under way ends.
        Never blocks on a write (the trio thread calls it)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self._busy:
                os.close(self._fd)
