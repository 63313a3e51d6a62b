"""Worker-thread lanes for the peer plane's blocking calls (trio thread).

Every :class:`tierfs.replication.client.PeerClient` call blocks, so it runs in
a ``trio.to_thread`` worker under a capacity limiter: one lane for data
(:data:`TRANSFERS` shard sends and pulls at once) and a separate one for
control calls (heartbeats, probes, restore rounds), so a heartbeat is never
queued behind a large transfer. The whole-step view's file fetches have a third
lane (:data:`FILE_FETCHES` at once, :class:`PriorityLane`: a reader's open before
the background prefetch).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

from tierfs.core.priority import fetch_urgent

#: concurrent shard transfers (sends and pulls) per node
TRANSFERS = 2
#: concurrent control calls (Sync, Join, Decide, Barrier, probes) per node
CONTROL_CALLS = 8


class Lane:
    """A capacity limiter for blocking calls run in worker threads.

    Args:
        capacity: calls running at once; more wait for a slot (no thread).

    Attributes:
        limiter: the ``trio.CapacityLimiter`` (a caller holding it across
            several calls uses it directly).
    """

    def __init__(self, capacity: int) -> None:
        self.limiter = trio.CapacityLimiter(capacity)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in a worker thread (trio thread; a cancelled caller abandons
        the thread, whose result is then dropped)."""
        async with self.limiter:
            return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)


#: concurrent file fetches of the whole-step view per node (issue #14): their own lane,
#: so a reader's open never waits behind a replica transfer
FILE_FETCHES = 3


class PriorityLane:
    """A capacity limiter whose waiters are served urgent first (trio thread).

    A task that waits for a slot is *urgent* while
    :data:`tierfs.core.priority.fetch_urgent` (its own context's) says so: a reader's
    ``open()`` gets the next free slot before any background prefetch; within
    each kind, first come first served. A slot is never taken back from a
    running call.

    Args:
        capacity: calls running at once.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.busy = 0
        #: (is it urgent now, its wake-up) of every waiting task, in arrival order
        self._waiting: list[tuple[Callable[[], bool], trio.Event]] = []

    @property
    def waiting(self) -> int:
        """Tasks waiting for a slot."""
        return len(self._waiting)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one slot for the body (waits, urgent first; cancellable while waiting)."""
        if self.busy < self.capacity and not self._waiting:
            self.busy += 1
        else:
            entry = (fetch_urgent.get(), trio.Event())
            self._waiting.append(entry)
            try:
                await entry[1].wait()
            except BaseException:
                if entry in self._waiting:
                    self._waiting.remove(entry)
                else:  # granted while being cancelled: pass the slot on
                    self._release()
                raise
        try:
            yield
        finally:
            self._release()

    def urgent_waiting(self) -> bool:
        """True while an urgent body waits for a slot (any thread: a paused transfer
        asks it so that it goes on and frees its slot instead of holding it while
        the reader it pauses for waits for that very slot)."""
        return any(urgent() for urgent, _ in list(self._waiting))

    def _release(self) -> None:
        self.busy -= 1
        if not self._waiting:
            return
        pick = next((e for e in self._waiting if e[0]()), self._waiting[0])
        self._waiting.remove(pick)
        self.busy += 1
        pick[1].set()
