"""Files of other ranks in the view: what the namespace asks before it opens one.

The whole-step view (issue #14, :mod:`tierfs.node.remote_view`) places other
ranks' files of a sealed step into ``<ram-dir>/view`` as real tmpfs files: a
file whose bytes are here already, or a sparse file of the right size and mode
whose bytes are fetched on first open. The namespace sees them only through
:class:`RemoteFiles`, keyed by the backing inode number:

* such a file is read-only: an open for writing without ``O_TRUNC`` and any
  SETATTR fail with ``EROFS`` (its bytes belong to another rank's sealed part);
  an open for writing with ``O_TRUNC`` (the node saving that path of the step
  again) makes it the node's own file (:meth:`RemoteFiles.taking_over`);
* a LOOKUP that finds another rank's file whose part its node may have
  replaced since (a part sealed moments ago) raises :class:`Deferred` until the
  view shows the part that node names (:meth:`RemoteFiles.looking_up`): the
  lookup the kernel makes after an open's ``ESTALE`` finds the file current;
* a LOOKUP of a name another rank's part is expected to hold soon (DCP's
  ``.metadata`` right after this node's part of a new step sealed,
  :meth:`RemoteFiles.expected`) raises :class:`Deferred` until it is placed
  or the expectation ends;
* an open of a file whose bytes are not here yet raises :class:`Deferred`:
  the session answers that request later, without holding up other requests
  (:meth:`tierfs.fuse.session.FuseSession.dispatch`): once the first chunk is
  verified when the manifest has per-chunk checksums, else after the fetch;
* a handle opened before all bytes are here is served by the daemon (never
  passthrough, which needs the complete file): a READ of verified bytes is
  answered at once, a READ past the fetch's watermark is deferred until the
  watermark passes it (EIO when every copy failed); never an unverified byte.

Unlink and rename stay allowed (a client's retention, e.g. Orbax's rmtree of
an old step, removes them like its own files).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from tierfs.core.errors import TierfsError


class Deferred(TierfsError):
    """A request that can be answered only after ``wait()`` returns (a control-flow
    signal of the FUSE layer, never seen outside it).

    Raised by a namespace operation on the FUSE thread; the session runs
    ``wait`` in a task and then calls the same handler again with the same
    request. ``wait`` raises ``OSError`` (its errno is the reply) when the
    request must fail.
    """

    def __init__(self, wait: Callable[[], Awaitable[None]]) -> None:
        super().__init__("deferred until a fetch ends")
        self.wait = wait


class RemoteFiles(Protocol):
    """What the namespace asks about other ranks' files (FUSE thread; O(1), never blocks)."""

    def is_remote(self, ino: int) -> bool:
        """True if backing inode ``ino`` is a file of another rank's part (read-only)."""
        ...

    def missing(self, ino: int) -> Callable[[], Awaitable[None]] | None:
        """None if ``ino``'s bytes are here; else the coroutine function that fetches
        them (raises ``OSError``: EIO when no copy could serve verified bytes,
        ENOSPC when they do not fit in the RAM budget)."""
        ...

    def opening(self, ino: int) -> Callable[[], Awaitable[None]] | None:
        """None if ``ino`` may be opened now (all bytes here, or the first chunk
        verified); else what to wait for first (raises ``OSError`` as :meth:`missing`)."""
        ...

    def taking_over(self, ino: int) -> Callable[[], Awaitable[None]] | None:
        """An open of ``ino`` for writing with ``O_TRUNC``: the node writes that path
        itself from now on (the file stops being another rank's). None once done;
        else what to wait for first (a fetch writing into it)."""
        ...

    def expected(self, relpath: bytes) -> Callable[[], Awaitable[None]] | None:
        """A LOOKUP of ``relpath`` (relative to the view) found nothing: None to answer
        ``ENOENT`` now; else what to wait for first (another rank's file that this
        node's part of a step just sealed expects, e.g. DCP's ``.metadata``), after
        which the lookup is tried again."""
        ...

    def looking_up(self, ino: int) -> Callable[[], Awaitable[None]] | None:
        """A LOOKUP found ``ino``, another rank's file: None to answer it now; else
        what to wait for first (that rank's node may hold a newer part, whose file
        then replaces this one under the same name), after which the lookup is tried
        again; the wait never raises."""
        ...

    def uncached(self, ino: int) -> bool:
        """True if the kernel must not cache the name of ``ino`` (another rank's file
        whose part its node may have replaced since: a part sealed moments ago): each
        open then looks the name up (:meth:`looking_up`)."""
        ...

    def creating(self) -> Callable[[], Awaitable[None]] | None:
        """A client of this node creates a file (its own: a save): None to create it
        now; else what to wait for first (other ranks' cached files giving the RAM
        budget's room back, :class:`tierfs.node.cache_room.CacheRoom`); never
        raises."""
        ...

    def partial(self, ino: int) -> bool:
        """True if ``ino`` is another rank's file whose bytes are not all here yet: a
        handle opened now is served by the daemon and its reads ask :meth:`readable`."""
        ...

    def readable(self, ino: int, offset: int, size: int) -> Callable[[], Awaitable[None]] | None:
        """None if bytes ``[offset, offset + size)`` of ``ino`` (clipped to its size) are
        verified here; else what to wait for (raises ``OSError``: EIO when every copy
        failed)."""
        ...

    def shown_mtime(self, ino: int, mtime_ns: int) -> int:
        """The mtime (ns) to tell the kernel for backing inode ``ino``, whose backing
        file says ``mtime_ns``: for another rank's file whose bytes are not all here,
        the one first shown, unchanged while its fetch writes into it; else
        ``mtime_ns``.

        The kernel (``FUSE_AUTO_INVAL_DATA``) drops a file's page cache when a
        reply shows another mtime, and waits for each page's lock to do so; a
        page whose READ the daemon holds until the fetch brings its bytes stays
        locked, so a ``stat``, or the ``READDIRPLUS`` of an ``rm -rf``, of the
        directory waited for the fetch (#14 trial 49 F1: a trainer's retention
        ``rm -rf`` of an old step blocked 21-39 s in ``fuse_readdir_uncached``
        -> ``invalidate_inode_pages2_range`` -> ``__folio_lock``)."""
        ...


class NoRemoteFiles:
    """A view without other ranks' files (a bare RAM filesystem, tests)."""

    def is_remote(self, ino: int) -> bool:
        """Always False."""
        return False

    def missing(self, ino: int) -> Callable[[], Awaitable[None]] | None:
        """Always None."""
        return None

    def opening(self, ino: int) -> Callable[[], Awaitable[None]] | None:
        """Always None."""
        return None

    def taking_over(self, ino: int) -> Callable[[], Awaitable[None]] | None:
        """Always None."""
        return None

    def expected(self, relpath: bytes) -> Callable[[], Awaitable[None]] | None:
        """Always None."""
        return None

    def looking_up(self, ino: int) -> Callable[[], Awaitable[None]] | None:
        """Always None."""
        return None

    def uncached(self, ino: int) -> bool:
        """Always False."""
        return False

    def creating(self) -> Callable[[], Awaitable[None]] | None:
        """Always None."""
        return None

    def partial(self, ino: int) -> bool:
        """Always False."""
        return False

    def readable(self, ino: int, offset: int, size: int) -> Callable[[], Awaitable[None]] | None:
        """Always None."""
        return None

    def shown_mtime(self, ino: int, mtime_ns: int) -> int:
        """Always ``mtime_ns``."""
        return mtime_ns
