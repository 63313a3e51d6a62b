"""Per-chunk crc32c of a file: combining chunk checksums and checking chunks as they arrive.

A sealed file longer than one chunk carries, in its manifest entry, the crc32c
(Castagnoli) of every :data:`CHUNK`-byte chunk (the last one shorter)
(:attr:`tierfs.store.manifest.FileEntry.chunks`). The sealer computes each
chunk's crc once and derives the file's crc32c from them with
:func:`crc32c_combine` (no second pass over the bytes); a fetch of another
rank's file checks each chunk against the manifest as it arrives
(:class:`ChunkChecker`), so verified bytes can be served before the whole
file is here (issue #14).

Pure functions and plain data; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import google_crc32c

from tierfs.core.errors import StorageError

#: bytes per checksummed chunk (the manifest records it: ``chunk_size``)
CHUNK = 4 << 20

#: the reflected Castagnoli polynomial
_POLY = 0x82F63B78
_X0 = 1 << 31  # the polynomial "1" in the reflected representation


class ChunkMismatch(StorageError):
    """A chunk's bytes are not the manifest's (a corrupt copy: refused, nothing written)."""


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo the CRC polynomial (reflected bit order)."""
    m = _X0
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> tuple[int, ...]:
    p = _X0 >> 1  # x^1
    table = [p]
    for _ in range(31):
        p = _multmodp(p, p)
        table.append(p)
    return tuple(table)


_X2N = _x2n_table()  # x^(2^k) mod P


@lru_cache(maxsize=64)
def _shift(nbytes: int) -> int:
    """x^(8 * nbytes) mod P: the operator that appends ``nbytes`` zero bytes."""
    p = _X0
    k = 3  # 8 bits per byte
    n = nbytes
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The crc32c of ``A + B`` from ``crc1 = crc32c(A)``, ``crc2 = crc32c(B)`` and
    ``len2 = len(B)`` in bytes (zlib's ``crc32_combine`` for the Castagnoli
    polynomial). O(log len2), cached per length.

    Raises:
        ValueError: a negative length.
    """
    if len2 < 0:
        raise ValueError(f"negative length {len2}")
    if len2 == 0:
        return crc1
    return _multmodp(_shift(len2), crc1) ^ crc2


#: below this many bytes a pass over them (about 2 µs for 4 KiB) is cheaper than a
#: combine (15-25 µs in Python)
COMBINE_MIN = 64 * 1024


def crc32c_append(crc: int, data: bytes, data_crc: int) -> int:
    """The crc32c of ``A + data`` from ``crc = crc32c(A)`` and ``data_crc``, the crc32c
    of ``data`` the caller computed itself: combined without a pass over ``data``
    when that is cheaper (``data`` of :data:`COMBINE_MIN` bytes or more)."""
    if not crc:
        return data_crc  # the combine of 0 and data_crc is data_crc, whatever A is
    if len(data) < COMBINE_MIN:
        return int(google_crc32c.extend(crc, data))
    return crc32c_combine(crc, data_crc, len(data))


def chunk_count(size: int, chunk: int = CHUNK) -> int:
    """Chunks of a ``size``-byte file (0 for an empty file)."""
    return (size + chunk - 1) // chunk


def combine_chunks(crcs: Sequence[int], size: int, chunk: int = CHUNK) -> int:
    """The file's crc32c from its chunks' (``size`` bytes in all, ``chunk`` bytes each
    but the last)."""
    crc = 0
    for i, c in enumerate(crcs):
        crc = crc32c_combine(crc, c, min(chunk, size - i * chunk))
    return crc


class ChunkChecker:
    """Checks a file's bytes chunk by chunk against its manifest as a copy streams in.

    Bytes come in order (:meth:`feed`); each chunk is held until complete, then
    its crc32c is compared with the manifest's and only then handed on (to be
    written): the bytes handed on are verified, in order from offset 0, and
    :attr:`verified` (bytes) only grows. A new copy that starts again at
    offset 0 (:meth:`restart`) re-checks the chunks it sends, but those below
    :attr:`verified` are not handed on again (the bytes there stay).

    Args:
        size: the file's bytes by the manifest.
        crcs: the crc32c of each chunk by the manifest (``chunk_count(size, chunk)``).
        chunk: bytes per chunk.

    Raises:
        ValueError: ``crcs`` has the wrong length.
    """

    def __init__(self, size: int, crcs: Sequence[int], chunk: int = CHUNK) -> None:
        if chunk <= 0 or len(crcs) != chunk_count(size, chunk):
            raise ValueError(f"{len(crcs)} chunk checksums for {size} bytes in {chunk}-byte chunks")
        self.size = size
        self.crcs = tuple(crcs)
        self.chunk = chunk
        self.verified = 0
        self._start = 0  # offset of the chunk being received
        self._pieces: list[bytes] = []
        self._have = 0  # bytes of the chunk being received
        self._crc = 0

    @property
    def position(self) -> int:
        """The offset the next byte fed belongs at."""
        return self._start + self._have

    def restart(self, offset: int = 0) -> None:
        """A new copy streams from ``offset`` (a chunk boundary not past :attr:`verified`).

        Raises:
            ValueError: an offset a check could not start from.
        """
        if offset % self.chunk or offset > self.verified:
            raise ValueError(f"cannot check from offset {offset} (verified {self.verified})")
        self._start, self._pieces, self._have, self._crc = offset, [], 0, 0

    def feed(
        self, offset: int, data: bytes, crc32c: int | None = None
    ) -> list[tuple[int, list[bytes]]]:
        """Take ``data`` at ``offset``; returns the newly verified chunks not handed on
        before, as (offset, pieces) in order, whose bytes the caller writes.

        ``crc32c``: the crc32c of ``data``, computed by the caller from these bytes
        (not a value a copy claimed): when ``data`` is exactly one whole chunk (as a
        peer sends them) it is compared with the manifest's without a pass over the
        bytes here; else it is ignored.

        Raises:
            ChunkMismatch: a chunk's crc32c is not the manifest's, the bytes go past
                the manifest's size, or ``offset`` is not where the stream is (a
                gap). After it the checker expects :meth:`restart`.
        """
        if offset != self.position:
            if offset < self.position and offset % self.chunk == 0 and offset <= self.verified:
                self.restart(offset)
            else:
                raise ChunkMismatch(f"bytes at offset {offset}, expected {self.position}")
        if offset + len(data) > self.size:
            raise ChunkMismatch(f"more bytes than the manifest's {self.size}")
        out: list[tuple[int, list[bytes]]] = []
        done = 0
        while done < len(data):
            end = min(self.chunk, self.size - self._start)
            take = min(end - self._have, len(data) - done)
            # the whole of ``data`` is kept as it is (no copy) when it fits the chunk
            piece = data if take == len(data) else data[done : done + take]
            done += take
            if crc32c is not None and self._have == 0 and take == end == len(data):
                self._crc = crc32c  # the caller's own crc of exactly this chunk
            else:
                self._crc = google_crc32c.extend(self._crc, piece)
            self._pieces.append(piece)
            self._have += take
            if self._have < end:
                continue
            index, start, crc = self._start // self.chunk, self._start, self._crc
            if crc != self.crcs[index]:
                self.restart(0)  # the next copy starts again
                raise ChunkMismatch(
                    f"chunk {index} (offset {start}) crc32c {crc:08x} "
                    f"!= the manifest's {self.crcs[index]:08x}"
                )
            if start >= self.verified:
                out.append((start, self._pieces))
                self.verified = start + self._have
            self._start += self._have
            self._pieces, self._have, self._crc = [], 0, 0
        return out
