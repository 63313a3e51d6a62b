"""Room for this node's own saves beside other ranks' fetched files (issue #14).

The whole-step view keeps other ranks' fetched files in the RAM store as a
cache (:class:`tierfs.node.remote_view.RemoteView`): they count against the
budget and can be dropped (fetched again on the next open). The node's own
writes go to the same store, and with FUSE passthrough the kernel writes them
into tmpfs without asking the daemon, so a budget full of cached files
answered the node's next save with ENOSPC (issue #14 trial 43b: with
``--size 48Mi``, after a reader had read the whole step, ``replicator.errors``
itself could no longer be written).

:class:`CacheRoom` keeps a *reserve* of the budget free of cached files:

* before a fetch it drops cached files (least recently used first, none that
  a handle holds open) until the fetch's bytes fit with the reserve still free;
  a fetch that fits only by eating into the reserve still goes ahead (a reader
  gets the file), and the reserve is given back once the file is closed;
* while any file is cached it looks at the store's free space every
  ``interval`` seconds, and at once when told that a client of this node
  created or changed a file (:meth:`CacheRoom.poke`), and drops cached files
  until the reserve is free again.

The reserve (:func:`reserve_bytes`) is the size of this node's largest own part
held (its next save needs about as much), at least an eighth and at most half of
the budget. It guides what is dropped from the cache only: nothing of the
node's own parts or replicas is ever dropped here.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

log = logging.getLogger(__name__)

#: the reserve's bounds, as fractions of the budget
RESERVE_MIN = 1 / 8
RESERVE_MAX = 1 / 2


class Room(Protocol):
    """The store's budget as the cache sees it (:class:`tierfs.store.ramstore.Budget`)."""

    @property
    def size(self) -> int:
        """The budget in bytes."""
        ...

    def free(self) -> int:
        """Bytes that can still be written before ENOSPC (a ``statvfs``: blocking, but
        cheap on tmpfs)."""
        ...


def reserve_bytes(budget: int, own_part: int) -> int:
    """Bytes of a ``budget`` (bytes) that cached files leave free: ``own_part`` (the
    bytes of this node's largest own part held, 0 if none), bounded to
    [``budget`` × :data:`RESERVE_MIN`, ``budget`` × :data:`RESERVE_MAX`]."""
    low, high = int(budget * RESERVE_MIN), int(budget * RESERVE_MAX)
    return min(high, max(low, own_part))


def shortfall(free: int, reserve: int, incoming: int = 0) -> int:
    """Bytes to drop from the cache so that ``incoming`` bytes fit with ``reserve``
    bytes still free, given ``free`` bytes free now (all in bytes; 0: none)."""
    return max(0, reserve + incoming - free)


class CacheRoom:
    """Keeps :func:`reserve_bytes` of the budget free of cached files (module docstring).

    Args:
        room: the store's budget (``size``, ``free()``).
        own_part: bytes of this node's largest own part held now (0 if none).
        cached: True while any file is cached (droppable or not).
        drop: ``drop(nbytes)`` drops cached files no handle holds open, least
            recently used first, until ``nbytes`` are freed; returns the bytes
            freed (:meth:`tierfs.node.remote_view.RemoteView.make_room`). Trio.
        interval: seconds between looks at the free space while files are cached.
    """

    def __init__(
        self,
        room: Room,
        own_part: Callable[[], int],
        cached: Callable[[], bool],
        drop: Callable[[int], Awaitable[int]],
        *,
        interval: float = 0.25,
    ) -> None:
        self.room = room
        self.own_part = own_part
        self.cached = cached
        self.drop = drop
        self.interval = interval
        self._poked = trio.Event()
        #: bytes dropped to keep the reserve (status and tests)
        self.dropped = 0

    def reserve(self, budget: int) -> int:
        """The reserve of a ``budget`` of that many bytes now (:func:`reserve_bytes`)."""
        return reserve_bytes(budget, self.own_part())

    def _measure(self) -> tuple[int, int]:
        """(free bytes, budget bytes) of the store (blocking: statvfs)."""
        return self.room.free(), self.room.size

    def poke(self) -> None:
        """Look at the free space now (a client of this node wrote; trio thread)."""
        self._poked.set()

    async def fetching(self, nbytes: int) -> None:
        """Make room for a fetch of ``nbytes`` with the reserve kept (best effort:
        what cannot be dropped stays, and a failure to look or drop is logged, not
        raised: the fetch itself then meets ENOSPC or not). Trio thread."""
        try:
            await self._keep(nbytes)
        except Exception:
            log.exception("making room for a fetch of %d bytes", nbytes)

    async def _keep(self, incoming: int = 0) -> int:
        if not self.cached():
            return 0
        free, budget = await trio.to_thread.run_sync(self._measure)
        reserve = self.reserve(budget)
        need = shortfall(free, reserve, incoming)
        if not need:
            return 0
        freed = await self.drop(need)
        self.dropped += freed
        if freed:
            log.info(
                "dropped %d bytes of other ranks' fetched files: %d bytes of the budget "
                "stay free for this node's own saves",
                freed,
                reserve,
            )
        return freed

    async def run(self) -> None:
        """Keep the reserve for good (a background task of the daemon)."""
        while True:
            wait = self.interval if self.cached() else math.inf
            with trio.move_on_after(wait):
                await self._poked.wait()
            self._poked = trio.Event()
            try:
                await self._keep()
            except OSError as exc:  # the store went away (unmount): look again later
                log.info("keeping room for this node's saves: %s", exc)
            except Exception:  # a bug here must not stop the daemon: said, tried again
                log.exception("keeping room for this node's saves")
