"""The fetched-file cache beside this node's own saves (tierfs.node.cache_room) and
the cache's drops in the whole-step view (least recently used first, an open while
a file is being dropped fetches it again: never a punched file shown as here)."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
import trio
from test_remote_view import BYTES, PARTS, A, B, Checked, Source, has_data, manifest, view_of

from tierfs.node import remote_view as rv_mod
from tierfs.node.cache_room import CacheRoom, reserve_bytes, shortfall

MiB = 1 << 20


def test_the_reserve_is_the_largest_own_part_within_an_eighth_and_a_half_of_the_budget():
    assert reserve_bytes(800 * MiB, 0) == 100 * MiB
    assert reserve_bytes(800 * MiB, 60 * MiB) == 100 * MiB
    assert reserve_bytes(800 * MiB, 300 * MiB) == 300 * MiB
    assert reserve_bytes(800 * MiB, 700 * MiB) == 400 * MiB


def test_the_shortfall_counts_the_incoming_bytes():
    assert shortfall(free=50, reserve=40) == 0
    assert shortfall(free=50, reserve=40, incoming=30) == 20
    assert shortfall(free=10, reserve=40) == 30


class Room:
    def __init__(self, size: int, free: int) -> None:
        self.size = size
        self.free_bytes = free

    def free(self) -> int:
        return self.free_bytes


class Cache:
    """Cached files of ``sizes`` bytes, dropped in order."""

    def __init__(self, room: Room, sizes: list[int]) -> None:
        self.room = room
        self.sizes = sizes
        self.asked: list[int] = []

    def any(self) -> bool:
        return bool(self.sizes)

    async def drop(self, need: int) -> int:
        self.asked.append(need)
        freed = 0
        while self.sizes and freed < need:
            freed += self.sizes.pop(0)
        self.room.free_bytes += freed
        return freed


def test_a_fetch_drops_what_keeps_the_reserve_free_and_nothing_when_it_fits():
    room = Room(800, free=300)  # reserve 100 (an eighth), own parts of 50
    cache = Cache(room, [120, 120, 120])
    keeper = CacheRoom(room, lambda: 50, cache.any, cache.drop)

    async def main() -> None:
        await keeper.fetching(150)  # 300 free: fits with 100 left
        assert cache.asked == []
        await keeper.fetching(250)  # 50 short: one file goes
        assert cache.asked == [50] and room.free_bytes == 420
        assert keeper.dropped == 120

    trio.run(main)


def test_a_write_of_this_node_gives_the_reserve_back_at_once():
    room = Room(800, free=30)
    cache = Cache(room, [120, 120])
    keeper = CacheRoom(room, lambda: 200, cache.any, cache.drop, interval=3600)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(keeper.run)
            keeper.poke()  # a client of this node created a file
            with trio.fail_after(10):
                while room.free_bytes < 200:
                    await trio.sleep(0.001)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert cache.asked == [170] and room.free_bytes == 270


def test_the_free_space_is_looked_at_while_files_are_cached_without_a_poke():
    room = Room(800, free=30)
    cache = Cache(room, [120])
    keeper = CacheRoom(room, lambda: 0, cache.any, cache.drop, interval=0.01)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(keeper.run)
            with trio.fail_after(10):
                while cache.sizes:
                    await trio.sleep(0.001)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert cache.asked == [70]


def test_the_least_recently_used_fetched_file_is_dropped_first(tmp_path):
    rv, ram, *_rest, own, _job = view_of(tmp_path, PARTS, [Source("peer", BYTES, ["peer 0"])])
    view = Path(ram.view) / "10"
    big, small = view / "__2_0.distcp", view / "__0_0.distcp"

    async def main() -> None:
        await rv.look(own)
        await rv.missing(big.stat().st_ino)()
        await rv.missing(small.stat().st_ino)()
        assert rv.missing(big.stat().st_ino) is None  # the big one opened again
        assert await rv.make_room(1) == len(BYTES["10/__0_0.distcp"])

    trio.run(main)
    assert has_data(big) and not has_data(small)
    assert rv.status().dropped_bytes == len(BYTES["10/__0_0.distcp"])


def test_an_open_while_a_file_is_dropped_fetches_it_again_never_the_punched_file(
    tmp_path, monkeypatch
):
    """Regression (stop 43's review): the drop marked the file remote before its
    punch, so an open in between fetched it, and the punch then emptied the file
    the view called here: zeros served through passthrough."""
    rv, ram, *_rest, own, _job = view_of(tmp_path, PARTS, [Source("peer", BYTES, ["peer 0"])])
    meta = Path(ram.view) / "10" / ".metadata"
    entered, release = threading.Event(), threading.Event()
    unfetch = rv_mod.RemoteView._unfetch

    def slow_unfetch(fd, rf):
        entered.set()
        release.wait(30)
        unfetch(fd, rf)

    async def main() -> None:
        await rv.look(own)
        ino = meta.stat().st_ino
        await rv.missing(ino)()
        rf = rv._by_ino[ino]
        monkeypatch.setattr(rv_mod.RemoteView, "_unfetch", staticmethod(slow_unfetch))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rv.make_room, 1 << 30)
            await trio.to_thread.run_sync(entered.wait, 30)
            opened = rv.missing(ino)
            assert opened is not None  # being dropped: the open waits
            nursery.start_soon(opened)
            # a fetch started now would land before the punch (the bug); give it time
            with trio.move_on_after(0.5):
                while rf.state != rv_mod.LOCAL:
                    await trio.sleep(0.01)
            assert rf.state == rv_mod.FETCHING
            release.set()
        assert rf.state == rv_mod.LOCAL

    trio.run(main)
    assert meta.read_bytes() == BYTES["10/.metadata"]


@pytest.mark.parametrize("own_bytes", [0, 300])
def test_nothing_is_asked_of_the_cache_when_nothing_is_cached(own_bytes):
    room = Room(800, free=0)
    cache = Cache(room, [])
    keeper = CacheRoom(room, lambda: own_bytes, cache.any, cache.drop)
    trio.run(keeper.fetching, 500)
    assert cache.asked == []


def test_the_bytes_dropped_for_room_are_in_the_status_line_and_the_metrics():
    from tierfs.cli.status import _whole_view_lines
    from tierfs.core.status.node import NodeStatus
    from tierfs.node.metrics import _whole_view

    view = {"active": True, "steps": [], "fetched_bytes": {"peer": 900}, "dropped_bytes": 700}
    st = NodeStatus.from_json({"whole_view": view})
    assert st.whole_view.dropped_bytes == 700
    assert st.whole_view.to_json()["dropped_bytes"] == 700
    assert _whole_view_lines(st)[0].endswith(
        "900 bytes from peer, 700 bytes dropped for room (fetched again when read)"
    )
    family = next(f for f in _whole_view({"whole_view": view}) if "dropped" in f.name)
    assert [s.value for s in family.samples] == [700.0]


def test_the_view_says_whether_it_holds_fetched_bytes(tmp_path):
    rv, ram, *_rest, own, _job = view_of(tmp_path, PARTS, [Source("peer", BYTES, ["peer 0"])])
    meta = Path(ram.view) / "10" / ".metadata"

    async def main() -> None:
        await rv.look(own)
        assert not rv.holds_fetched()
        await rv.missing(meta.stat().st_ino)()
        assert rv.holds_fetched() and rv.holds_fetched()
        await rv.drop(10)
        assert not rv.holds_fetched()

    trio.run(main)


def test_a_failing_drop_is_logged_and_the_keeper_goes_on(caplog):
    room = Room(800, free=0)
    calls: list[int] = []

    async def broken(need: int) -> int:
        calls.append(need)
        raise RuntimeError("a bug in the drop")

    keeper = CacheRoom(room, lambda: 0, lambda: True, broken, interval=0.001)

    async def main() -> None:
        await keeper.fetching(10)  # logged, not raised: the fetch goes on
        async with trio.open_nursery() as nursery:
            nursery.start_soon(keeper.run)
            with trio.fail_after(10):
                while len(calls) < 3:
                    await trio.sleep(0.001)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert "a bug in the drop" in caplog.text


def test_the_bytes_fetches_under_way_will_still_write_are_counted():
    """#14 trial 44 F1: concurrent fetches each saw the same free space and went
    ahead, so together they took the room of this node's save."""
    room = Room(800, free=300)  # reserve 100
    cache = Cache(room, [120, 120, 120])
    keeper = CacheRoom(room, lambda: 0, cache.any, cache.drop, incoming=lambda: 150)

    async def main() -> None:
        assert await keeper.fetching(100) is True  # 100 + 150 under way + 100 kept: 50 short
        assert cache.asked == [50] and room.free_bytes == 420

    trio.run(main)


def test_a_fetch_that_would_eat_into_the_reserve_is_told_so():
    room = Room(800, free=150)
    cache = Cache(room, [])  # nothing to drop (all held open, say)
    keeper = CacheRoom(room, lambda: 0, lambda: False, cache.drop)
    assert trio.run(keeper.fetching, 40) is True  # 150 - 40 >= 100
    assert trio.run(keeper.fetching, 60) is False  # 150 - 60 < 100


def test_while_this_node_saves_the_reserve_is_half_the_budget():
    """#14 trial 44 F2: a save larger than the node's earlier parts got ENOSPC on every
    try (the reserve was the size of those parts, 8 of 64 MiB, 12 MiB free)."""
    now = [0.0]
    room = Room(64, free=12)
    cache = Cache(room, [8, 8, 8, 8, 8, 8])
    keeper = CacheRoom(room, lambda: 4, cache.any, cache.drop, clock=lambda: now[0])
    assert keeper.reserve(64) == 8
    keeper.own_write()  # the client creates a file of its next save
    assert keeper.saving() and keeper.reserve(64) == 32
    assert trio.run(keeper.fetching, 0) is True
    assert room.free_bytes == 36  # 24 dropped: half the budget free for the save
    now[0] += 5.1
    assert not keeper.saving() and keeper.reserve(64) == 8


def test_a_background_fetch_without_room_is_not_started_and_not_reported(tmp_path):
    """#14 trial 44: a read-ahead that found no room wrote "could not be read" into
    replicator.errors although no reader got an error. A reader's own open still
    gets the file."""
    rv, ram, *_rest, own, job = view_of(tmp_path, PARTS, [Source("peer", BYTES, ["peer 0"])])
    meta = Path(ram.view) / "10" / ".metadata"
    room = Room(8 * len(BYTES["10/.metadata"]), free=0)
    rv.room = CacheRoom(room, lambda: 0, rv.holds_fetched, rv.make_room)

    async def main() -> None:
        await rv.look(own)
        rf = rv._by_ino[meta.stat().st_ino]
        with pytest.raises(OSError) as exc:
            await rv.fetch(rf)  # the prefetch's or a read-ahead's call
        assert exc.value.errno == errno.ENOSPC
        assert rf.state == rv_mod.REMOTE and not has_data(meta)
        await rv.missing(meta.stat().st_ino)()  # a reader's open: fetched all the same
        assert rf.state == rv_mod.LOCAL

    trio.run(main)
    assert meta.read_bytes() == BYTES["10/.metadata"]
    assert job.errors == [] and rv.status().fetch_errors == 0


def test_a_create_waits_once_for_the_cache_to_give_the_save_half_the_budget():
    """#14 trial 44 F2: passthrough writes never ask the daemon, so the room is made
    before the create returns; a create right after finds it made (no second wait),
    and nothing waits when nothing is cached or the room is there."""
    now = [0.0]
    room = Room(64, free=12)
    cache = Cache(room, [8, 8, 8, 8, 8])
    keeper = CacheRoom(room, lambda: 4, cache.any, cache.drop, clock=lambda: now[0])
    wait = keeper.before_write()
    assert wait is not None and keeper.saving()
    trio.run(wait)
    assert room.free_bytes == 36 and cache.asked == [20]
    assert keeper.before_write() is None  # the create tried again goes ahead
    now[0] += 1.0
    assert keeper.before_write() is None  # the last look found the room
    empty = CacheRoom(Room(64, free=0), lambda: 4, lambda: False, cache.drop)
    assert empty.before_write() is None


def test_a_file_a_readers_open_waits_for_is_not_dropped_before_the_open_runs(tmp_path):
    """Regression (#14 trial 44b F3): while the node saved in a loop, the room loop
    dropped files fetched for waiting readers before their opens ran (the waiter
    wakes a moment after the landing); after 4 drops the opens failed with ENOSPC.
    A file a reader's open waits for is not dropped; once the open ran, it may be."""
    rv, ram, *_rest, own, _job = view_of(tmp_path, PARTS, [Source("peer", BYTES, ["peer 0"])])
    meta = Path(ram.view) / "10" / ".metadata"
    size = len(BYTES["10/.metadata"])

    async def main() -> None:
        await rv.look(own)
        rf = rv._by_ino[meta.stat().st_ino]
        dropped: list[int] = []
        woken = trio.Event()  # the reader's wake-up after the landing, held back

        def held(wait):  # the reader's wait returns only once woken is set
            async def waiting(*args):
                await wait(*args)
                await woken.wait()

            return waiting

        rv._fetch_for = held(rv._fetch_for)
        rv._wait_verified = held(rv._wait_verified)

        async def reader() -> None:
            await rv.missing(meta.stat().st_ino)()

        async def room_loop() -> None:
            # the drop comes between the landing and the waiter's wake-up (held back
            # here: on a busy loop the reader may wake before or after the room loop)
            while rf.state != rv_mod.LOCAL:
                await trio.sleep(0)
            dropped.append(await rv.make_room(1 << 30))
            woken.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(room_loop)
            nursery.start_soon(reader)
        assert dropped == [0] and rf.state == rv_mod.LOCAL and has_data(meta)
        assert rf.waiters == 0
        assert await rv.make_room(1 << 30) == size  # no open waits any more

    trio.run(main)


class Writers:
    """The namespace's port as far as the view uses it: ``writing`` handles open for
    writing, whose files grow at every look while ``growing``; no inode held open."""

    def __init__(self) -> None:
        self.writing = 0
        self.growing = True
        self.written = 0
        self.inodes = self

    def by_ino(self, ino: int) -> None:
        return None

    def handles_open_for_write(self) -> int:
        return self.writing

    def bytes_open_for_write(self) -> int:
        if self.writing and self.growing:
            self.written += 4096
        return self.written

    def notify_changed(self, path: str) -> None:
        pass


def budget_full(tmp_path: Path):
    """A view whose budget has no room left (its room's clock is trio's) and a
    namespace port of ``Writers``: (view, the path of rank 0's ``.metadata``, the
    own part, the job, the port)."""
    rv, ram, *_rest, own, job = view_of(tmp_path, PARTS, [Source("peer", BYTES, ["peer 0"])])
    meta = Path(ram.view) / "10" / ".metadata"
    room = Room(8 * len(BYTES["10/.metadata"]), free=0)
    rv.room = CacheRoom(room, lambda: 0, rv.holds_fetched, rv.make_room, clock=trio.current_time)
    return rv, meta, own, job, Writers()


def test_a_readers_fetch_while_this_node_saves_waits_for_the_save(tmp_path):
    """#14 trial 46 FAIL 6: a budgeted node's readers fetched other ranks' files of the
    previous step while the node saved the next one; the reads took the room and
    the save got ENOSPC (2 of 9 steps). A reader's fetch that would eat into the
    room kept for saves now waits while a file of this node is open for writing or
    was created or changed less than SAVE_QUIET ago, then goes ahead; after
    SAVE_WAIT it gets ENOSPC with a line. (Refusing it at once failed whole steps of
    reads, and a load right after a save.)"""
    rv, meta, own, job, ns = budget_full(tmp_path)

    async def main() -> None:
        await rv.look(own)
        rv.attach(ns)  # type: ignore[arg-type]
        rf = rv._by_ino[meta.stat().st_ino]
        rv.room.own_write()  # this node's client writes its next step
        ns.writing = 1
        done = trio.Event()

        async def reader() -> None:
            await rv.missing(meta.stat().st_ino)()
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await trio.sleep(rv_mod.SAVE_WAIT / 2)
            assert not done.is_set() and rf.state == rv_mod.FETCHING and not has_data(meta)
            ns.writing = 0  # the save's files are closed: the reader goes ahead
            await done.wait()
        assert rf.state == rv_mod.LOCAL and trio.current_time() >= rv_mod.SAVE_WAIT / 2

        # a save that goes on and on: the reader gets ENOSPC, with a line
        await rv.drop(10)
        ns.writing = 1
        with pytest.raises(OSError) as exc:
            await rv.missing(meta.stat().st_ino)()
        assert exc.value.errno == errno.ENOSPC

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert any("saves this node has been writing for 30 s" in e for e in job.errors), job.errors


def test_fetches_under_way_pause_while_this_node_saves_and_the_reserve_is_short():
    """#14 trial 46 FAIL 6: fetches begun just before the save went on writing and took
    its room. While a save is under way and the reserve is short beside what the
    fetches will still write (after the drops), they pause; not otherwise."""
    room = Room(800, free=300)
    cache = Cache(room, [50])
    saving = {"on": False}
    incoming = {"n": 250}
    keeper = CacheRoom(
        room,
        lambda: 0,
        cache.any,
        cache.drop,
        incoming=lambda: incoming["n"],
        under_way=lambda: saving["on"],
    )
    trio.run(keeper.fetching, 0)
    assert keeper.hold_fetches is False  # short (100 kept + 250 > 350), but no save
    saving["on"] = True
    keeper.own_write()  # the reserve is half the budget now: 400 + 250 > 350
    trio.run(keeper.fetching, 0)
    assert keeper.hold_fetches is True and cache.sizes == []
    incoming["n"] = 0
    room.free_bytes = 400
    trio.run(keeper.fetching, 0)
    assert keeper.hold_fetches is False  # the fetches ended: the reserve is free
    incoming["n"] = 250
    trio.run(keeper.fetching, 0)
    assert keeper.hold_fetches is True
    saving["on"] = False  # the save's files are closed
    trio.run(keeper.fetching, 0)
    assert keeper.hold_fetches is False


def test_a_readers_fetch_under_way_pauses_for_this_nodes_save_and_goes_on_after(tmp_path):
    """#14 trial 46 FAIL 6, 1 save in 10 after the readers' wait: three readers' fetches
    of 256 MiB files began half a second before this node's save and went on writing
    while it wrote; the save got ENOSPC. A fetch under way now pauses between chunks
    while the save needs the room, and goes on once the save is done; after
    SAVE_WAIT of pausing it goes on anyway (a client copying another rank's file
    into its own would otherwise wait for itself)."""
    peer = Checked("peer", BYTES, ["peer node-rank 0"])
    rv, ram, *_rest, own, job = view_of(tmp_path, PARTS, [peer])
    meta = Path(ram.view) / "10" / ".metadata"
    size = len(BYTES["10/.metadata"])
    room = Room(8 * size, free=0)
    rv.room = CacheRoom(
        room,
        lambda: 0,
        rv.holds_fetched,
        rv.make_room,
        incoming=rv.incoming_bytes,
        under_way=rv.save_under_way,
        clock=trio.current_time,
    )
    ns = Writers()
    peer.gates["10/.metadata"] = trio.Event()

    async def main() -> None:
        await rv.look(own)
        rv.attach(ns)  # type: ignore[arg-type]
        async with trio.open_nursery() as nursery:
            room.free_bytes = 8 * size  # the reader's fetch finds room
            nursery.start_soon(rv.missing(meta.stat().st_ino))
            while "10/.metadata" not in peer.pauses:  # the fetch is at its source
                await trio.sleep(0.01)
            pause = peer.pauses["10/.metadata"]
            assert rv.incoming_bytes() == size
            assert await rv.room.fetching(0) and pause() is False  # no save: goes on
            ns.writing = 1  # this node's client creates a file of its save
            rv.room.own_write()
            room.free_bytes = 4 * size  # half the budget kept, and the fetch: short
            await rv.room.fetching(0)
            assert rv.room.hold_fetches is True and pause() is True
            ns.writing = 0  # the save's files are closed
            await trio.sleep(rv_mod.SAVE_QUIET + 0.1)  # (not the float sum at the edge)
            await rv.room.fetching(0)
            assert rv.room.hold_fetches is False and pause() is False
            ns.writing = 1  # the next save: paused again, SAVE_WAIT at most
            rv.room.own_write()
            await rv.room.fetching(0)
            assert pause() is True
            await trio.sleep(rv_mod.SAVE_WAIT + 0.1)
            assert rv.room.hold_fetches is True and pause() is False
            peer.gates["10/.metadata"].set()
        assert rv.steps[10].files["10/.metadata"].state == rv_mod.LOCAL

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert meta.read_bytes() == BYTES["10/.metadata"] and job.errors == []


def data_bytes(path: Path) -> int:
    """Bytes of ``path`` that are data, not holes (xattr blocks not counted)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        n, off, end = 0, 0, os.fstat(fd).st_size
        while off < end:
            try:
                start = os.lseek(fd, off, os.SEEK_DATA)
            except OSError:
                break  # ENXIO: holes to the end
            off = os.lseek(fd, start, os.SEEK_HOLE)
            n += off - start
        return n
    finally:
        os.close(fd)


class Used:
    """The budget of a store as its files' data bytes say (as tmpfs would)."""

    def __init__(self, root: Path, size: int) -> None:
        self.root, self.size = root, size

    def free(self) -> int:
        return self.size - sum(data_bytes(p) for p in self.root.rglob("*") if p.is_file())


class NoRoomFirst(Checked):
    """As Checked; the first fetch of ``full`` (and of each path in ``fulls``) finds
    no room (ENOSPC)."""

    full = "10/__2_0.distcp"
    fulls: tuple[str, ...] = ()

    async def fetch_file(self, job, rank, step, digest, path, fd, **kw) -> str:
        first = not any(p == path for p, _ in self.urgent)
        if (path == self.full or path in self.fulls) and first:
            self.urgent.append((path, True))
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError as exc:
                raise rv_mod.FetchFailed(f"{path}: no room for it here") from exc
        return await super().fetch_file(job, rank, step, digest, path, fd, **kw)


def test_readers_fetches_without_room_retry_in_turn_once_another_readers_file_is_closed(
    tmp_path,
):
    """#14 trial 46 (s6d, s6f): three readers' 256 MiB fetches resumed after this
    node's save beside its two own parts; the budget held two of them, and all three
    failed with ENOSPC together (5-6 reads of 216). A reader's fetch that finds no
    room while another reader's fetch is under way now waits for its turn and for
    the room: the other file, read and closed, is dropped, and it goes on."""
    peer = NoRoomFirst("peer", BYTES, ["peer node-rank 0", "peer node-rank 2"])
    rv, ram, *_rest, own, job = view_of(tmp_path, PARTS, [peer])
    view = Path(ram.view) / "10"
    room = Used(Path(ram.view), size=len(A) + len(B) + 4000)  # own part, one file more
    rv.room = CacheRoom(room, lambda: 0, rv.holds_fetched, rv.make_room, incoming=rv.incoming_bytes)
    peer.gates["10/.metadata"] = trio.Event()
    done: list[str] = []

    async def main() -> None:
        await rv.look(own)
        first, second = rv.steps[10].files["10/.metadata"], rv.steps[10].files[peer.full]

        async def reader(rf: rv_mod.RemoteFile) -> None:
            await rv.missing(rf.ino)()
            done.append(rf.path)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader, first)
            while "10/.metadata" not in peer.holds:
                await trio.sleep(0.01)
            nursery.start_soon(reader, second)
            while (peer.full, True) not in peer.urgent:
                await trio.sleep(0.01)
            await trio.sleep(0.6)  # it looks at the room every 0.25 s meanwhile
            assert done == [] and second.state == rv_mod.FETCHING and job.errors == []
            peer.gates["10/.metadata"].set()  # the first lands; its reader is done
        assert done == ["10/.metadata", peer.full]
        assert first.state == rv_mod.REMOTE and second.state == rv_mod.LOCAL  # dropped

    trio.run(main)
    assert (view / "__2_0.distcp").read_bytes() == BYTES[peer.full] and job.errors == []


def test_fetches_waiting_for_room_do_not_wait_for_each_other(tmp_path):
    """Regression (#14 trial 46 s6g): the three readers' fetches that found no room
    counted each other's bytes as still to come, so the first in turn waited for
    room the others would never take (they write nothing before their turn) and
    every read of the step took 30 s more. The budget holds two of the three
    files: two are served while the third fetch is still under way."""
    X, Y, Z = os.urandom(7000), os.urandom(7000), os.urandom(7000)
    parts = {0: manifest(0, {"x0": X, "x1": Y}), 2: manifest(2, {"x2": Z})}
    files = {"10/x0": X, "10/x1": Y, "10/x2": Z}
    peer = NoRoomFirst("peer", files, ["peer node-rank 0", "peer node-rank 2"])
    peer.fulls = ("10/x1", "10/x2")
    rv, ram, *_rest, own, job = view_of(tmp_path, parts, [peer])
    room = Used(Path(ram.view), size=len(A) + 2 * 7000 + 1000)
    rv.room = CacheRoom(room, lambda: 0, rv.holds_fetched, rv.make_room, incoming=rv.incoming_bytes)
    peer.gates["10/x0"] = trio.Event()
    done: list[str] = []

    async def main() -> None:
        await rv.look(own)
        union = rv.steps[10]

        async def reader(path: str) -> None:
            await rv.missing(union.files[path].ino)()
            done.append(path)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader, "10/x0")
            while "10/x0" not in peer.holds:
                await trio.sleep(0.01)
            nursery.start_soon(reader, "10/x1")
            nursery.start_soon(reader, "10/x2")
            with trio.fail_after(rv_mod.SAVE_WAIT / 3):
                while len(done) < 2:
                    await trio.sleep(0.01)
            assert sorted(done) == ["10/x1", "10/x2"] and job.errors == []
            peer.gates["10/x0"].set()
        assert sorted(done) == ["10/x0", "10/x1", "10/x2"]

    trio.run(main)
    assert (Path(ram.view) / "10" / "x0").read_bytes() == X and job.errors == []


def test_a_fetch_behind_one_waiting_for_room_waits_too(tmp_path):
    """Regression (#14 trial 46 s6h, one read a step): a fetch found no room in the
    moment between another reader closing its file and the fetch in turn dropping
    it; nothing else was under way or held open, so it failed with a "could not be
    read" line (its reader's next read fetched it again). Behind a fetch waiting
    for room, room may come: the one ahead drops the closed file, fetches, and its
    reader closes it in turn."""
    rv, *_rest, own, _job = view_of(tmp_path, PARTS, [Source("peer", BYTES, ["peer 0"])])

    async def main() -> None:
        await rv.look(own)
        ahead, this = rv.steps[10].files["10/.metadata"], rv.steps[10].files["10/__2_0.distcp"]
        assert rv._room_may_come(this, behind=True) is False  # nothing at all
        rv._inflight |= {ahead, this}
        rv._short |= {ahead, this}
        assert rv._room_may_come(this, behind=True) is True
        assert rv._room_may_come(ahead) is False  # the one in turn: nothing will come

    trio.run(main)


def test_a_create_waits_for_fetched_files_held_open_to_be_closed_and_dropped():
    """Regression (#14 trial 46 s6i, 1 save in 10): three readers' 256 MiB files of
    the previous step, fetched before the save began, were held open when the save
    created its first file; the save got ENOSPC, and the files were closed and
    dropped a second later. The create now waits (CREATE_WAIT at most) until its
    node's largest own part fits, dropping what the readers closed meanwhile."""
    room = Room(64, free=4)
    held = {"open": True}

    class Held(Cache):
        async def drop(self, need: int) -> int:
            return 0 if held["open"] else await super().drop(need)

    cache = Held(room, [16, 16])
    keeper = CacheRoom(room, lambda: 12, cache.any, cache.drop, interval=0.05)

    async def main() -> None:
        wait = keeper.before_write()
        assert wait is not None
        async with trio.open_nursery() as nursery:
            created = trio.Event()

            async def create() -> None:
                await wait()
                created.set()

            nursery.start_soon(create)
            await trio.sleep(0.3)
            assert not created.is_set() and room.free_bytes == 4  # waits for the readers
            held["open"] = False  # they close their files
            with trio.fail_after(5):
                await created.wait()
        assert room.free_bytes >= 12

    trio.run(main)


def test_a_create_waits_for_held_files_at_most_create_wait(monkeypatch):
    """Files a reader never closes: the create goes ahead after CREATE_WAIT."""
    from tierfs.node import cache_room

    monkeypatch.setattr(cache_room, "CREATE_WAIT", 0.3)
    room = Room(64, free=4)

    class Held(Cache):
        async def drop(self, need: int) -> int:
            return 0

    cache = Held(room, [16])
    said: list[str] = []
    keeper = CacheRoom(
        room, lambda: 12, cache.any, cache.drop, interval=0.05, kept=lambda: 16, report=said.append
    )

    async def main() -> None:
        wait = keeper.before_write()
        assert wait is not None
        with trio.fail_after(5):
            await wait()
        assert room.free_bytes == 4
        # the save's ENOSPC has a reason in replicator.errors (once a minute at most)
        assert said == [
            "a save of this node may fail with ENOSPC: 4 bytes of the RAM budget are free, "
            "below the 12 its saves need; 16 bytes of other ranks' files fetched here are "
            "kept by open files or memory maps of readers (they are dropped once closed); "
            "waited 0.3 s for them"
        ]
        keeper._kept_at = -1e9
        wait = keeper.before_write()
        assert wait is not None
        await wait()
        assert len(said) == 1

    trio.run(main)


def test_a_file_held_open_for_writing_that_does_not_grow_is_no_save(tmp_path):
    """Regression (#14 trial 47 FAIL C): ``cat`` of another rank's file into a new
    file of this node took 30 s and logged a line: the output file, open for
    writing, counted as a save under way, so the read waited for its own output
    to be closed. Only a create or change less than SAVE_QUIET ago, or files open
    for writing that grew in that time, count now."""
    rv, meta, own, job, ns = budget_full(tmp_path)

    async def main() -> None:
        await rv.look(own)
        rv.attach(ns)  # type: ignore[arg-type]
        rv.room.own_write()  # ``cat`` created its output file
        ns.writing, ns.growing = 1, False  # and holds it open, waiting for the read
        assert rv.save_under_way()
        began = trio.current_time()
        await rv.missing(meta.stat().st_ino)()
        assert trio.current_time() - began < 2 * rv_mod.SAVE_QUIET + 0.5

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert meta.read_bytes() == BYTES["10/.metadata"] and job.errors == []
