"""What the namespace asks of the kernel connection: passthrough backing ids, invalidations.

The namespace is FUSE-free, but four of its answers need the channel the
FUSE session owns: registering a passthrough backing file, dropping one,
and telling the kernel to forget a cached entry or cached attributes. The
namespace and its parts share one :class:`KernelLink`; until the session
connects it (:meth:`tierfs.fuse.session.FuseSession` at construction and at
INIT) every hook is absent and passthrough is off, which is also what a bare
namespace in a unit test gets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(eq=False, slots=True)
class KernelLink:
    """The kernel hooks of one namespace; filled in by the FUSE session.

    Attributes:
        passthrough: new opens may use FUSE passthrough (granted at INIT; turned
            off for good when a registration fails).
        register_backing: ``fd -> backing id`` (FUSE_DEV_IOC_BACKING_OPEN);
            raises ``OSError`` (EPERM without CAP_SYS_ADMIN, ELOOP on a stacked
            filesystem).
        close_backing: ``backing id -> None`` (FUSE_DEV_IOC_BACKING_CLOSE).
        inval_entry: ``(parent node id, name, wait) -> None``: drop a cached
            entry; thread-safe.
        inval_inode: ``node id -> None``: drop cached attributes; safe on the
            FUSE thread.
    """

    passthrough: bool = False
    register_backing: Callable[[int], int] | None = None
    close_backing: Callable[[int], None] | None = None
    inval_entry: Callable[[int, bytes, bool], None] | None = None
    inval_inode: Callable[[int], None] | None = None
