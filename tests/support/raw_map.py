"""A memory map whose descriptor is closed at once, as safetensors (Rust memmap2) makes.

Python's ``mmap`` module keeps a ``dup`` of the descriptor for the map's life, so
a map made with it always leaves an open handle behind; the FUSE handle then
stays open, and a bug that only a map without one shows stays hidden (#14 trial
50).
"""

from __future__ import annotations

import ctypes
import mmap
import os

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_FAILED = ctypes.c_void_p(-1).value


class RawMap:
    """A read-only shared map of the whole file at ``path`` (its descriptor closed).

    Raises:
        OSError: the open or the ``mmap(2)`` failed (its errno).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            self.size = os.fstat(fd).st_size
            addr = _libc.mmap(None, self.size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        finally:
            os.close(fd)
        if addr is None or addr == _FAILED:
            raise OSError(ctypes.get_errno(), f"mmap of {path}")
        self.addr: int = addr

    def read(self) -> bytes:
        """The file's bytes as the map shows them now."""
        return ctypes.string_at(self.addr, self.size)

    def close(self) -> None:
        """Unmap (idempotent)."""
        if self.addr:
            _libc.munmap(self.addr, self.size)
            self.addr = 0
