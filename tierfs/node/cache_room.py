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
  a handle holds open) until the fetch's bytes, and what the fetches under
  way will still write, fit with the reserve still free. A fetch a reader
  waits for goes ahead even when they do not (the reader gets the file, and
  the reserve is given back once it is closed); a background fetch (prefetch,
  read-ahead, the next files of a batch) is not started (no error: it is
  fetched when a reader opens it);
* while any file is cached it looks at the store's free space every
  ``interval`` seconds, and at once when told that a client of this node
  created or changed a file (:meth:`CacheRoom.own_write`), and drops cached
  files until the reserve is free again;
* while this node's own client writes (an own change less than
  :data:`SAVING_HOLD` seconds ago), the reserve is its largest, half of the
  budget, so a save larger than the node's earlier parts finds room up to
  that (#14 trial 44 F2: a node whose checkpoint grew got ENOSPC on every
  try, the reserve being the size of its earlier parts).

Otherwise the reserve (:func:`reserve_bytes`) is the size of this node's largest
own part held (its next save needs about as much), at least an eighth and at
most half of the budget. It guides what is dropped from the cache only: nothing
of the node's own parts or replicas is ever dropped here.

The kernel writes the node's own files without the daemon (passthrough), so
the room is made at the create of a file and within ``interval`` of its
writes (a create waits up to :data:`CREATE_WAIT` seconds for fetched files
readers hold open to be closed while less than the node's largest own part is
free). Fetches under way cannot be dropped: while a save of this node is under
way (``under_way``) and the reserve is short beside what they will still write,
:attr:`CacheRoom.hold_fetches` is set and every fetch from a peer pauses
between chunks, a reader's too; a bucket's download does not (#14 trial 46
FAIL 6: reads of the previous step begun just before the save took its
room). A save still meets ENOSPC when the files readers hold open and the
bytes fetched before it began leave no room for it; when a create waited the
whole :data:`CREATE_WAIT` for that room in vain, ``replicator.errors`` says so
(at most every :data:`SHORT_SAID_EVERY` seconds), with the bytes readers keep:
the save's ENOSPC (which the kernel answers without the daemon) has a reason.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

log = logging.getLogger(__name__)

#: the reserve's bounds, as fractions of the budget
RESERVE_MIN = 1 / 8
RESERVE_MAX = 1 / 2
#: seconds after this node's client last created or changed a file during which
#: the cache gives the whole budget to the save
SAVING_HOLD = 5.0
#: seconds a create of this node's waits at most for fetched files held open to be
#: closed and dropped, while the free space is below its largest own part
CREATE_WAIT = 5.0
#: seconds between INFO lines about dropped bytes (DEBUG in between)
LOG_EVERY = 30.0
#: seconds between ``replicator.errors`` lines about a save left without room
SHORT_SAID_EVERY = 60.0


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
        incoming: bytes the fetches under way will still write (their files are
            not droppable; :meth:`tierfs.node.remote_view.RemoteView.incoming_bytes`).
        under_way: True while a save of this node is under way (a file open for
            writing, or one created or changed just now;
            :meth:`tierfs.node.remote_view.RemoteView.save_under_way`).
        interval: seconds between looks at the free space while files are cached,
            fetched or saved.
        clock: monotonic seconds (tests).
        kept: bytes of cached files that open files or memory maps kept at the last
            drop (:attr:`tierfs.node.remote_view.RemoteView.pinned_bytes`).
        report: writes a line to ``replicator.errors`` (a save left without room).
    """

    def __init__(
        self,
        room: Room,
        own_part: Callable[[], int],
        cached: Callable[[], bool],
        drop: Callable[[int], Awaitable[int]],
        *,
        incoming: Callable[[], int] = lambda: 0,
        under_way: Callable[[], bool] = lambda: False,
        interval: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
        kept: Callable[[], int] = lambda: 0,
        report: Callable[[str], None] = lambda line: None,
    ) -> None:
        self.kept = kept
        self.report = report
        self._hold_said = False  # the last "pausing" line was INFO (fetches ran)
        self._short_said_at = -math.inf
        self.room = room
        self.own_part = own_part
        self.cached = cached
        self.drop = drop
        self.incoming = incoming
        self.under_way = under_way
        self.interval = interval
        self.clock = clock
        self._poked = trio.Event()
        self._saving_until = -math.inf
        self._last_write = -math.inf
        #: (free, budget) bytes at the last look; when a create waited for drops last
        self._seen: tuple[int, int] | None = None
        self._kept_at = -math.inf
        self._lock = trio.Lock()
        self._logged_at = -math.inf
        self._unlogged = 0
        #: bytes dropped to keep the reserve (status and tests)
        self.dropped = 0
        #: True while a save of this node is under way and, at the last look, the
        #: reserve was short beside the bytes the fetches under way will still write
        #: (after the drops): every fetch then pauses between chunks. Set on the trio
        #: thread, read by any (a plain attribute: the GIL makes it atomic).
        self.hold_fetches = False

    def saving(self) -> bool:
        """True while this node's client writes (an own change in the last
        :data:`SAVING_HOLD` seconds)."""
        return self.clock() < self._saving_until

    def reserve(self, budget: int) -> int:
        """The reserve of a ``budget`` of that many bytes now: :func:`reserve_bytes`,
        and its upper bound (half the budget) while this node saves."""
        if self.saving():
            return int(budget * RESERVE_MAX)
        return reserve_bytes(budget, self.own_part())

    def own_write(self) -> None:
        """A client of this node created or changed a file (trio thread): the cache
        keeps the larger reserve now and for :data:`SAVING_HOLD` seconds."""
        self._last_write = self.clock()
        self._saving_until = self._last_write + SAVING_HOLD
        self._poked.set()

    def wrote_within(self, seconds: float) -> bool:
        """Whether a client of this node created or changed a file in the last
        ``seconds`` seconds."""
        return self.clock() - self._last_write < seconds

    async def free_bytes(self) -> int:
        """Bytes of the budget free now (a ``statvfs`` in a worker thread). Trio
        thread.

        Raises:
            OSError: the store cannot be looked at (unmounted)."""
        free, _budget = await trio.to_thread.run_sync(self._measure)
        return free

    def _measure(self) -> tuple[int, int]:
        """(free bytes, budget bytes) of the store (blocking: statvfs)."""
        return self.room.free(), self.room.size

    def poke(self) -> None:
        """Look at the free space now (a client of this node wrote; trio thread)."""
        self._poked.set()

    def before_write(self) -> Callable[[], Awaitable[None]] | None:
        """A client of this node creates a file (FUSE thread; never blocks): the cache
        gives way to the save (:meth:`own_write`), and when files are cached and the
        last look found less free than the reserve, the create first waits for one
        round of drops (at most once per ``interval``): the kernel then writes the
        file's bytes into room already made (#14 trial 44 F2); while less than this
        node's largest own part is free, it waits for fetched files held open to be
        closed and dropped, :data:`CREATE_WAIT` seconds at most."""
        self.own_write()
        now = self.clock()
        if now - self._kept_at < self.interval or not self.cached():
            return None
        if self._seen is not None and self._seen[0] >= self.reserve(self._seen[1]):
            return None
        self._kept_at = now

        async def keep() -> None:
            try:
                await self._keep()
                await self._room_for_save()
            except Exception:
                log.exception("making room for a save of this node's")
            finally:
                self._kept_at = self.clock()  # the create tried again goes ahead

        return keep

    async def _room_for_save(self) -> None:
        """After a round of drops at a create: while the free space is below the size
        of this node's largest own part (bounded to the budget's eighth and half:
        :func:`reserve_bytes`) and fetched files are held (open, or waited for:
        droppable once closed), drop again every ``interval`` seconds, for
        :data:`CREATE_WAIT` seconds at most; the create waits meanwhile.

        #14 trial 46 (s6i, 1 save in 10): three readers' 256 MiB files of the
        previous step, fetched before the save began, were held open while the
        save's first file was created; the save got ENOSPC, and the files were
        closed and dropped a second later."""
        deadline = self.clock() + CREATE_WAIT
        while self.cached() and self.clock() < deadline:
            assert self._seen is not None
            free, budget = self._seen
            if free >= reserve_bytes(budget, self.own_part()):
                return
            await trio.sleep(self.interval)
            await self._keep()
        if self._seen is None or not self.cached():
            return
        free, budget = self._seen
        want, kept = reserve_bytes(budget, self.own_part()), self.kept()
        if free < want and kept > 0:
            self._said_short(free, want, kept)

    def _said_short(self, free: int, want: int, kept: int) -> None:
        """A create of this node waited :data:`CREATE_WAIT` s in vain for room: said in
        ``replicator.errors`` (at most every :data:`SHORT_SAID_EVERY` s)."""
        now = self.clock()
        if now - self._short_said_at < SHORT_SAID_EVERY:
            return
        self._short_said_at = now
        line = (
            f"a save of this node may fail with ENOSPC: {free} bytes of the RAM budget "
            f"are free, below the {want} its saves need; {kept} bytes of other ranks' "
            "files fetched here are kept by open files or memory maps of readers (they "
            f"are dropped once closed); waited {CREATE_WAIT:g} s for them"
        )
        log.warning("%s", line)
        try:
            self.report(line)
        except Exception:
            log.exception("reporting a save without room")

    async def fetching(self, nbytes: int) -> bool:
        """Make room for a fetch of ``nbytes`` with the reserve kept, beside what the
        fetches under way will still write; True when it then fits, False when it
        would eat into the reserve (a background fetch is then not started). Best
        effort: what cannot be dropped stays, and a failure to look or drop is
        logged, not raised (True: the fetch itself then meets ENOSPC or not). Trio
        thread."""
        try:
            return await self._keep(nbytes) >= 0
        except Exception:
            log.exception("making room for a fetch of %d bytes", nbytes)
            return True

    async def _keep(self, nbytes: int = 0) -> int:
        """Drop cached files until ``nbytes`` more fit beside the fetches under way
        with the reserve free; returns 0 when they then fit, else minus the bytes
        still missing. One at a time (the loop, fetches and creates would each
        drop for the same shortfall)."""
        async with self._lock:
            free, budget = await trio.to_thread.run_sync(self._measure)
            reserve = self.reserve(budget)
            incoming = self.incoming()
            need = shortfall(free, reserve, nbytes + incoming)
            if need and self.cached():
                freed = await self.drop(need)
                self._dropped(freed, reserve)
                need -= freed
                free += freed
            self._seen = (free, budget)
            self._hold(shortfall(free, reserve, incoming) > 0)
            return -need if need > 0 else 0

    def _hold(self, short: bool) -> None:
        """Pause the fetches under way (:attr:`hold_fetches`) when the reserve is
        ``short`` beside them while this node saves; go on otherwise."""
        hold = short and self.under_way()
        if hold != self.hold_fetches:
            # said only where fetches run (#14 trial 53 D2: a node with nothing to fetch
            # logged a pair per save near a full budget)
            if hold:
                self._hold_said = self.incoming() > 0
            log.log(
                logging.INFO if self._hold_said else logging.DEBUG,
                "%s other ranks' fetches: %s",
                "pausing" if hold else "resuming",
                "this node's save under way needs the room they would take"
                if hold
                else "no save of this node needs their room now",
            )
        self.hold_fetches = hold

    def _dropped(self, freed: int, reserve: int) -> None:
        self.dropped += freed
        self._unlogged += freed
        if not self._unlogged:
            return
        now = self.clock()
        if now - self._logged_at < LOG_EVERY:
            log.debug("dropped %d bytes of other ranks' fetched files", freed)
            return
        log.info(
            "dropped %d bytes of other ranks' fetched files since the last such line: "
            "%d bytes of the budget stay free for this node's own saves%s",
            self._unlogged,
            reserve,
            " (it is saving)" if self.saving() else "",
        )
        self._logged_at, self._unlogged = now, 0

    async def run(self) -> None:
        """Keep the reserve for good (a background task of the daemon)."""
        while True:
            busy = self.cached() or self.saving() or self.incoming() > 0 or self.hold_fetches
            wait = self.interval if busy else math.inf
            with trio.move_on_after(wait):
                await self._poked.wait()
            self._poked = trio.Event()
            try:
                await self._keep()
            except OSError as exc:  # the store went away (unmount): look again later
                log.info("keeping room for this node's saves: %s", exc)
            except Exception:  # a bug here must not stop the daemon: said, tried again
                log.exception("keeping room for this node's saves")
