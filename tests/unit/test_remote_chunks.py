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
