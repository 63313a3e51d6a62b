"""Issue #14, verified ranges before the whole file is here (no mount): a fetch checks
each chunk against the manifest's per-chunk crc32c before it writes it, a watermark
says how many bytes from offset 0 are verified, an open and the reads below the
watermark go on at once, a read past it waits on a trio event, a corrupt middle chunk
refuses that copy without writing a byte of it, and a read fails with EIO when every
copy failed."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import fake_ports
import google_crc32c
import pytest
import trio
import trio.testing

from tierfs.core.control import JobSpec
from tierfs.core.errors import FetchFailed
from tierfs.core.priority import fetch_hold
from tierfs.node.catalog import ShardCatalog
from tierfs.node.remote_view import RemoteView
from tierfs.store.chunks import ChunkMismatch
from tierfs.store.manifest import FileEntry, Manifest
from tierfs.store.ramstore import RamStore
from tierfs.store.shards import ShardKey, ShardStore

JOB = "train"
CH = 4096
BIG = os.urandom(5 * CH + 100)  # six chunks, the last one short
PATH = "10/__0_0.distcp"


@pytest.fixture(autouse=True)
def early_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """These files are a few KiB: serve them from their verified chunks at once (the
    default waits for the whole of a file with at most 256 MiB to come)."""
    monkeypatch.setenv("TIERFS_EARLY_READ_MIB", "0")


def test_an_open_waits_for_the_whole_file_when_little_is_left():
    from tierfs.node.remote_view import MIB, early_read

    # regression (run F): a sequential reader opening the file read ahead for it got a
    # daemon-served handle (no passthrough): 1-reader full reads 547 -> 170 MB/s
    assert early_read(256 * MIB, 0, 256.0) is False
    assert early_read(1024 * MIB, 800 * MIB, 256.0) is False
    assert early_read(1024 * MIB, 0, 256.0) is True
    assert early_read(4096, 0, 0.0) is True
    assert early_read(4096, 4096, 0.0) is False


def crc(data: bytes) -> int:
    return int(google_crc32c.value(data))


def manifest(rank: int, files: dict[str, bytes], chunked: bool = True) -> Manifest:
    entries = [FileEntry("10", "dir", mode=0o755)]
    for p, d in sorted(files.items()):
        chunks = tuple(crc(d[i : i + CH]) for i in range(0, len(d), CH))
        entries.append(
            FileEntry(
                f"10/{p}",
                "file",
                len(d),
                0o640,
                crc(d),
                chunks=chunks if chunked and len(chunks) > 1 else None,
            )
        )
    return Manifest(JOB, rank, 10, "10", "generic", tuple(entries), chunk_size=CH if chunked else 0)


class Manifests:
    def __init__(self, parts: dict[int, Manifest]) -> None:
        self.parts = parts

    async def part_manifest(
        self, job: str, rank: int, step: int, *, writers: int = 0, round_name: str = ""
    ) -> Manifest | None:
        return self.parts.get(rank)


class ChunkSource:
    """A FileSource that passes each copy's bytes through ``write`` in 1000-byte pieces,
    as the peer and bucket tiers do; ``hold_after`` (bytes) parks the copy on ``gate``
    once that many bytes went through; ``flip`` (offset) corrupts a copy's byte there."""

    chunk_writes = True

    def __init__(self, name: str, copies: list[str], flip: dict[str, int] | None = None) -> None:
        self.name = name
        self.copies = copies
        self.flip = flip or {}
        self.gate = trio.Event()
        self.hold_after: int | None = None
        self.parked = trio.Event()
        self.given: list[bool] = []  # whether each call was handed the checking writer

    async def fetch_file(
        self, job, rank, step, digest, path, fd, *, skip=frozenset(), writers=0, write=None
    ) -> str:
        self.given.append(write is not None)
        if write is None:  # a manifest without chunk checksums: plain positional writes

            def write(data: bytes, offset: int) -> None:
                os.pwrite(fd, data, offset)

        tried = []
        for copy in self.copies:
            data = bytearray(BIG)
            if copy in self.flip:
                data[self.flip[copy]] ^= 0x01
            try:
                for off in range(0, len(data), 1000):
                    if self.hold_after is not None and off >= self.hold_after:
                        self.parked.set()
                        await self.gate.wait()
                    write(bytes(data[off : off + 1000]), off)
            except ChunkMismatch as exc:
                tried.append(f"{copy}: bad copy: {exc}")
                continue
            return copy
        raise FetchFailed(f"{self.name}: " + "; ".join(tried))


def view_of(tmp: Path, sources: list, chunked: bool = True):
    ram = RamStore(str(tmp / "node1"))
    own_file = Path(ram.view) / "10" / "__1_0.distcp"
    own_file.parent.mkdir(parents=True)
    own_file.write_bytes(b"own")
    shards = ShardStore(ram)
    own = shards.snapshot(ram.view, ShardKey(JOB, 1, 10), "10", ["10"], "generic")
    catalog = ShardCatalog(shards, 2)
    catalog.add(own)
    job = fake_ports.FakeJob(JobSpec(JOB, "generic", 1, 2))
    parts = {0: manifest(0, {"__0_0.distcp": BIG}, chunked)}
    rv = RemoteView(
        ram.view,
        ram.incoming,
        catalog,
        job,
        Manifests(parts),
        sources,
        job,
        trio.CapacityLimiter(1),
    )
    return rv, ram, own, job


async def _with_view(rv: RemoteView, body) -> None:
    async with trio.open_nursery() as nursery:
        rv._fetches = nursery
        await body()
        nursery.cancel_scope.cancel()


def test_an_open_and_reads_below_the_watermark_go_on_while_the_rest_is_held(tmp_path):
    peer = ChunkSource("peer", ["peer node-rank 0"])
    peer.hold_after = 2 * CH + 500  # two chunks verified, the third under way
    rv, ram, own, job = view_of(tmp_path, [peer])
    path = Path(ram.view) / PATH

    async def body() -> None:
        await rv.look(own)
        ino = path.stat().st_ino
        assert rv.partial(ino)
        opening = rv.opening(ino)
        assert opening is not None
        with trio.fail_after(10):
            await opening()  # returns on the first chunk, the copy still held
        assert peer.parked.is_set() and not peer.gate.is_set()
        assert rv.opening(ino) is None and rv.partial(ino)
        assert rv.readable(ino, 0, 2 * CH) is None
        with open(path, "rb") as f:
            assert f.read(2 * CH) == BIG[: 2 * CH]
        # the third chunk is not verified: its bytes were never written
        with open(path, "rb") as f:
            assert os.pread(f.fileno(), CH, 2 * CH) == bytes(CH)
        later = rv.readable(ino, 2 * CH, 10)
        assert later is not None
        woken = trio.Event()

        async def reader() -> None:
            await later()
            woken.set()

        async with trio.open_nursery() as n:
            n.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            assert not woken.is_set()  # past the watermark: it waits
            peer.gate.set()
            with trio.fail_after(10):
                await woken.wait()
        with trio.fail_after(10):
            await rv.fetch(rv._by_ino[ino])
        assert not rv.partial(ino) and rv.readable(ino, 0, len(BIG)) is None

    trio.run(_with_view, rv, body)
    assert path.read_bytes() == BIG
    assert job.errors == [] and peer.given == [True]


def test_an_open_waits_for_the_whole_file_only_until_the_early_read_wait(tmp_path, monkeypatch):
    """Stop 32: an open of a file with at most $TIERFS_EARLY_READ_MIB to come waited for
    the whole file however slow its fetch (mount to first byte 0.5-1 s for a 256 MiB
    file here, more under load). It now waits at most $TIERFS_EARLY_READ_WAIT s from the
    first open that waits, then is served from the verified chunks; a retried open
    goes on at once and its handle is daemon-served."""
    monkeypatch.setenv("TIERFS_EARLY_READ_MIB", "256")
    monkeypatch.setenv("TIERFS_EARLY_READ_WAIT", "0.2")
    peer = ChunkSource("peer", ["peer node-rank 0"])
    peer.hold_after = 2 * CH  # two chunks verified, then held until the gate opens
    rv, ram, own, _job = view_of(tmp_path, [peer])
    path = Path(ram.view) / PATH

    async def body() -> None:
        await rv.look(own)
        ino = path.stat().st_ino
        opening = rv.opening(ino)
        assert opening is not None
        start = trio.current_time()
        with trio.fail_after(30):
            await opening()
        assert trio.current_time() - start >= 0.2  # it did wait for the whole file
        rf = rv._by_ino[ino]
        assert rf.verified >= CH and rf.state == "fetching"
        assert rv.opening(ino) is None and rv.partial(ino)  # retried: served early
        with open(path, "rb") as f:
            assert f.read(CH) == BIG[:CH]
        peer.gate.set()
        with trio.fail_after(10):
            await rv.fetch(rf)
        assert rf.whole_until is None and not rv.partial(ino)

    trio.run(_with_view, rv, body)
    assert path.read_bytes() == BIG


def test_an_open_that_sees_the_whole_file_within_the_wait_gets_passthrough(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERFS_EARLY_READ_MIB", "256")
    monkeypatch.setenv("TIERFS_EARLY_READ_WAIT", "60")
    peer = ChunkSource("peer", ["peer node-rank 0"])
    peer.hold_after = 2 * CH
    rv, ram, own, _job = view_of(tmp_path, [peer])
    path = Path(ram.view) / PATH

    async def body() -> None:
        await rv.look(own)
        ino = path.stat().st_ino
        opening = rv.opening(ino)
        assert opening is not None
        opened = trio.Event()

        async def opener() -> None:
            await opening()
            opened.set()

        async with trio.open_nursery() as n:
            n.start_soon(opener)
            with trio.fail_after(10):
                await peer.parked.wait()
            await trio.testing.wait_all_tasks_blocked()
            assert not opened.is_set()  # chunks verified, but little is left: it waits
            peer.gate.set()
        assert opened.is_set() and not rv.partial(ino)  # whole: passthrough

    trio.run(_with_view, rv, body)
    assert path.read_bytes() == BIG


def test_a_corrupt_middle_chunk_refuses_that_copy_and_no_wrong_byte_is_written(tmp_path):
    peer = ChunkSource("peer", ["peer node-rank 0"], flip={"peer node-rank 0": 3 * CH + 7})
    gcs = ChunkSource("gcs", ["bucket round r1"])
    gcs.hold_after = 0  # the bucket's copy waits: what the peer left is looked at
    rv, ram, own, job = view_of(tmp_path, [peer, gcs])
    path = Path(ram.view) / PATH

    async def body() -> None:
        await rv.look(own)
        ino = path.stat().st_ino
        rf = rv._by_ino[ino]
        async with trio.open_nursery() as n:
            n.start_soon(rv.wait_verified, rf, len(BIG))
            with trio.fail_after(10):
                await gcs.parked.wait()
            # the peer's chunks 0-2 were right and stay served; chunk 3 was never written
            assert rf.verified == 3 * CH
            assert rv.readable(ino, 0, 3 * CH) is None
            assert rv.readable(ino, 3 * CH, 1) is not None
            data = path.read_bytes()
            assert data[: 3 * CH] == BIG[: 3 * CH] and data[3 * CH :] == bytes(len(BIG) - 3 * CH)
            gcs.gate.set()
        assert rf.state == "local" and rf.source == "bucket round r1"

    trio.run(_with_view, rv, body)
    assert path.read_bytes() == BIG
    line = job.errors[-1]
    assert "was read from bucket round r1 after" in line, job.errors
    assert "chunk 3 (offset 12288)" in line, line


def test_a_read_past_the_watermark_fails_with_eio_when_every_copy_failed(tmp_path):
    peer = ChunkSource("peer", ["peer node-rank 0"], flip={"peer node-rank 0": CH + 1})
    rv, ram, own, job = view_of(tmp_path, [peer])
    path = Path(ram.view) / PATH

    async def body() -> None:
        await rv.look(own)
        ino = path.stat().st_ino
        wait = rv.readable(ino, 2 * CH, 100)
        assert wait is not None
        with trio.fail_after(10), pytest.raises(OSError) as exc:
            await wait()
        assert exc.value.errno == errno.EIO
        # nothing is served any more: the bytes were punched out, the file is remote again
        assert rv.readable(ino, 0, 10) is not None and rv._by_ino[ino].verified == 0

    trio.run(_with_view, rv, body)
    assert path.read_bytes() == bytes(len(BIG))
    assert "could not be read on this node" in job.errors[-1], job.errors
    assert "chunk 1 (offset 4096)" in job.errors[-1], job.errors


def test_a_manifest_without_chunk_checksums_waits_for_the_whole_file(tmp_path):
    peer = ChunkSource("peer", ["peer node-rank 0"])
    peer.hold_after = 2 * CH
    rv, ram, own, _job = view_of(tmp_path, [peer], chunked=False)
    path = Path(ram.view) / PATH

    async def body() -> None:
        await rv.look(own)
        ino = path.stat().st_ino
        assert rv._by_ino[ino].chunks is None
        opening = rv.opening(ino)
        assert opening is not None
        opened = trio.Event()

        async def opener() -> None:
            await opening()
            opened.set()

        async with trio.open_nursery() as n:
            n.start_soon(opener)
            with trio.fail_after(10):
                await peer.parked.wait()
            await trio.testing.wait_all_tasks_blocked()
            assert not opened.is_set()  # two chunks are here, but nothing vouches for them
            assert rv.readable(ino, 0, 10) is not None
            peer.gate.set()
        assert opened.is_set() and not rv.partial(ino)

    trio.run(_with_view, rv, body)
    assert peer.given == [False]
    assert path.read_bytes() == BIG


class HoldingSource(ChunkSource):
    """Pauses between pieces while the fetch's hold says so, as the peer tier does (a
    prefetch gives way to a reader's fetch)."""

    async def fetch_file(self, *args, **kwargs) -> str:
        hold = fetch_hold.get()
        write = kwargs["write"]

        def held_write(data: bytes, offset: int) -> None:
            self.pieces.append(hold())
            write(data, offset)

        kwargs["write"] = held_write
        self.pieces: list[bool] = []
        return await super().fetch_file(*args, **kwargs)


def test_a_reader_of_a_file_the_prefetch_is_fetching_makes_that_fetch_its_own(tmp_path):
    """Regression: a reader waiting for the watermark of a file the background prefetch
    was fetching counted as a waiting reader, and the prefetch's transfer of that very
    file paused for it: the read never returned."""
    peer = HoldingSource("peer", ["peer node-rank 0"])
    peer.hold_after = CH  # the prefetch's transfer parks after the first chunk
    rv, ram, own, _job = view_of(tmp_path, [peer])
    path = Path(ram.view) / PATH

    async def body() -> None:
        await rv.look(own)
        rf = rv._by_ino[path.stat().st_ino]
        async with trio.open_nursery() as n:
            n.start_soon(rv.fetch, rf)  # the prefetch's (not urgent)
            with trio.fail_after(10):
                await peer.parked.wait()
            waiter = rv.readable(rf.ino, 3 * CH, 10)
            assert waiter is not None
            n.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            peer.gate.set()
        assert rf.state == "local"

    trio.run(_with_view, rv, body)
    assert peer.pieces[0] is False and not any(peer.pieces[5:]), peer.pieces
    assert path.read_bytes() == BIG


class RoomAfterSave(ChunkSource):
    """The first copy's write finds no room after two chunks (this node's save took
    it); later calls serve the whole file."""

    def __init__(self) -> None:
        super().__init__("peer", ["peer node-rank 0"])
        self.failed_once = trio.Event()

    async def fetch_file(
        self, job, rank, step, digest, path, fd, *, skip=frozenset(), writers=0, write=None
    ) -> str:
        if not self.failed_once.is_set():
            self.given.append(True)
            assert write is not None
            for off in range(0, 2 * CH, 1000):
                write(bytes(BIG[off : off + 1000]), off)
            write(bytes(BIG[2 * CH : 2 * CH + 1000]), 2 * CH)  # the third chunk under way
            self.failed_once.set()
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError as exc:
                raise FetchFailed(f"{path}: no room for it here") from exc
        return await super().fetch_file(
            job, rank, step, digest, path, fd, skip=skip, writers=writers, write=write
        )


class HeldOpen:
    """The namespace's port as the view uses it: every inode held open by a reader,
    ``writing`` handles open for writing."""

    def __init__(self, path: Path) -> None:
        self.writing = 1
        self.inodes = self
        self.handles = {7: object()}
        self.path = path

    def by_ino(self, ino: int) -> HeldOpen:
        return self

    def fd_of(self, inode: HeldOpen) -> int:
        if self.fd < 0:  # the file is placed by the view's look
            self.fd = os.open(self.path, os.O_RDONLY)
        return self.fd

    def __enter__(self) -> HeldOpen:
        self.fd = -1
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)

    def handles_open_for_write(self) -> int:
        return self.writing

    def notify_changed(self, path: str) -> None:
        pass


class Free:
    def __init__(self, size: int, free: int) -> None:
        self.size, self.free_bytes = size, free

    def free(self) -> int:
        return self.free_bytes


def test_a_readers_fetch_without_room_while_this_node_saves_waits_for_the_room(tmp_path):
    """#14 trial 46 (s6d): with fetches paused for this node's save, three readers'
    256 MiB fetches resumed while the node still held its new part and the one it
    replaces; every one failed with ENOSPC at once, and the older part went 4 s
    later. A reader's fetch that finds no room while this node saves (or just
    saved) now waits for the room (SAVE_WAIT at most) and goes on; the verified
    bytes a reader holds open stay served meanwhile."""
    from tierfs.node import remote_view as rv_mod
    from tierfs.node.cache_room import CacheRoom

    peer = RoomAfterSave()
    rv, ram, own, job = view_of(tmp_path, [peer])
    path = Path(ram.view) / PATH
    room = Free(64 * len(BIG), free=0)
    rv.room = CacheRoom(
        room,
        lambda: 0,
        rv.holds_fetched,
        rv.make_room,
        incoming=rv.incoming_bytes,
        under_way=rv.save_under_way,
        clock=trio.current_time,
    )
    ns = HeldOpen(path)

    async def body() -> None:
        await rv.look(own)
        rv.attach(ns)  # type: ignore[arg-type]
        rf = rv._by_ino[path.stat().st_ino]
        rv.room.own_write()  # this node's client writes its save
        got = trio.Event()

        async def reader() -> None:
            await rv.wait_verified(rf, rf.size)
            got.set()

        room.free_bytes = 64 * len(BIG)  # the fetch's own look finds room
        rv._fetches.start_soon(reader)
        await peer.failed_once.wait()
        room.free_bytes = 0  # the save took it
        await trio.sleep(0.6)  # the fetch polls the room every 0.25 s meanwhile
        # waiting for room: the verified chunks stay served, no error said
        assert rf.state == rv_mod.FETCHING and rf.verified == 2 * CH and not got.is_set()
        assert job.errors == []
        ns.writing = 0  # the save is written
        room.free_bytes = 64 * len(BIG)  # and the part it replaces is dropped
        with trio.fail_after(10):
            await got.wait()
        assert rf.state == rv_mod.LOCAL

    with ns:  # real time: a mock clock jumps while the room is looked at in a thread
        trio.run(_with_view, rv, body)
    assert path.read_bytes() == BIG and job.errors == []


def test_a_readers_fetch_without_room_and_no_save_of_this_node_fails_at_once(tmp_path):
    """The wait for room is for a save of this node only: with none under way or just
    written, no room is coming and the open gets ENOSPC with a line at once."""
    from tierfs.node import remote_view as rv_mod
    from tierfs.node.cache_room import CacheRoom

    peer = RoomAfterSave()
    rv, ram, own, job = view_of(tmp_path, [peer])
    path = Path(ram.view) / PATH

    room = Free(64 * len(BIG), free=64 * len(BIG))
    rv.room = CacheRoom(room, lambda: 0, rv.holds_fetched, rv.make_room, clock=trio.current_time)
    ns = HeldOpen(path)
    ns.writing = 0

    async def body() -> None:
        await rv.look(own)
        rv.attach(ns)  # type: ignore[arg-type]
        rf = rv._by_ino[path.stat().st_ino]
        began = trio.current_time()
        with pytest.raises(OSError) as exc:
            await rv.wait_verified(rf, rf.size)
        waited = trio.current_time() - began
        assert exc.value.errno == errno.ENOSPC and waited < rv_mod.SAVE_WAIT / 3

    with ns:
        trio.run(_with_view, rv, body)
    assert "does not fit in the RAM budget" in job.errors[-1], job.errors
