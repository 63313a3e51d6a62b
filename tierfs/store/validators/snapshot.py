"""The I/O side of a judgement: :data:`~tierfs.store.validators.model.Reader` s over a
directory on disk (a sealed snapshot's data directory, a received replica) and over
whole small files brought from elsewhere (a peer, a backup round), checked against
their manifest.

Blocking (``pread``, the fetch callable): call from a worker thread, as the whole
judgement.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterable

import google_crc32c

from tierfs.store.manifest import FileEntry
from tierfs.store.validators.model import Reader

#: bytes: the largest file a :func:`checked_reader` brings whole into memory (the
#: rules read small files: DCP ``.metadata``, Orbax metadata, indexes, headers)
READ_LIMIT = 16 << 20


def checked_reader(
    entries: Iterable[FileEntry], get: Callable[[str], bytes], limit: int = READ_LIMIT
) -> Reader:
    """A reader of one rank's part whose files come whole from ``get(path)`` (a
    peer's copy, a bucket object), each brought once, kept in memory and used only
    if its size and crc32c are the manifest's ``entries``.

    ``get`` raises OSError for a file it cannot bring (its errno is kept: ENOENT
    for no such object, EIO for a failed read).

    The reader raises OSError (the rules then judge the file by its size): ENOENT
    (not a file of the part), EFBIG (over ``limit`` bytes, by default
    :data:`READ_LIMIT`), EIO (the bytes differ from the manifest), or what ``get``
    raised.
    """
    files = {f.path: f for f in entries if f.kind == "file"}
    cache: dict[str, bytes] = {}

    def read(relpath: str, offset: int, length: int) -> bytes:
        data = cache.get(relpath)
        if data is None:
            entry = files.get(relpath)
            if entry is None:
                raise OSError(errno.ENOENT, "not a file of the part", relpath)
            if entry.size > limit:
                raise OSError(errno.EFBIG, f"larger than {limit} bytes", relpath)
            got = get(relpath)
            if len(got) != entry.size or google_crc32c.value(got) != entry.crc32c:
                raise OSError(errno.EIO, "the bytes differ from the manifest", relpath)
            cache[relpath] = data = got
        return data[offset : offset + length]

    return read


def dir_reader(root: str) -> Reader:
    """Read ``root/<relpath>`` for :func:`tierfs.store.validators.judge_step`.

    ``relpath`` is a manifest path (checked safe by the manifest: no ``..``, not
    absolute); the last component is opened with ``O_NOFOLLOW``, so a symlink
    in place of a file fails with ELOOP instead of being followed.

    Raises:
        OSError: as ``open``/``pread`` raise (ENOENT, ELOOP, EIO...).
    """

    def read(relpath: str, offset: int, length: int) -> bytes:
        if relpath.startswith("/") or ".." in relpath.split("/"):
            raise OSError(1, "unsafe path", relpath)
        fd = os.open(os.path.join(root, relpath), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    return read
