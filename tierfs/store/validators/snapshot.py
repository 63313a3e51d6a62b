"""A :data:`~tierfs.store.validators.model.Reader` over a directory on disk (a sealed
snapshot's data directory, a received replica): the I/O side of a judgement.

Blocking (``pread``): call from a worker thread, as the whole judgement.
"""

from __future__ import annotations

import os

from tierfs.store.validators.model import Reader


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
