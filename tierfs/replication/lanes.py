"""Worker-thread lanes for the peer plane's blocking calls (trio thread).

Every :class:`tierfs.replication.client.PeerClient` call blocks, so it runs in
a ``trio.to_thread`` worker under a capacity limiter: one lane for data
(:data:`TRANSFERS` shard sends and pulls at once) and a separate one for
control calls (heartbeats, probes, restore rounds), so a heartbeat is never
queued behind a large transfer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

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
