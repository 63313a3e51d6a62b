"""Issue #14 goal 2 without a mount: the whole-step view fetches a small remote file
together with the next small files of the same part (path order) in one call of a
source that batches (:class:`tierfs.core.ports.BatchFileSource`). Each file is LOCAL
and its opens woken as soon as it landed, before the batch ends; a file the batch did
not bring (a copy failed midway, a corrupt chunk) is fetched on its own and its
bytes are still the manifest's; other ranks' files, big files and files without
chunk checksums are not batched; the background prefetch batches too."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import fake_ports
import google_crc32c
import pytest
import trio

from tierfs.core.control import JobSpec
from tierfs.core.errors import FetchFailed
from tierfs.core.priority import fetch_hold
from tierfs.node import remote_view
from tierfs.node.catalog import ShardCatalog
from tierfs.node.remote_view import LOCAL, REMOTE, XATTR, RemoteView
from tierfs.store.chunks import ChunkMismatch
from tierfs.store.manifest import FileEntry, Manifest
from tierfs.store.ramstore import RamStore
from tierfs.store.shards import ShardKey, ShardStore

JOB = "train"
CH = 4096
#: rank 0's small files (one chunk each), a big one (six chunks) and an empty one
SMALL = {f"s/f{i:02d}": os.urandom(3000 + i) for i in range(10)}
BIG = os.urandom(5 * CH + 100)
RANK0 = {**SMALL, "s/f04big": BIG, "s/f07empty": b""}
#: rank 2's file between rank 0's in path order
RANK2 = {"s/f05x": os.urandom(2000)}
COPY = "peer node-rank 0 (10.0.0.1:7000)"


def crc(data: bytes) -> int:
    return int(google_crc32c.value(data))


def manifest(rank: int, files: dict[str, bytes], chunked: bool = True) -> Manifest:
    entries = [FileEntry("10", "dir", mode=0o755), FileEntry("10/s", "dir", mode=0o755)]
    for p, d in sorted(files.items()):
        chunks = tuple(crc(d[i : i + CH]) for i in range(0, len(d), CH))
        entries.append(
            FileEntry(
                f"10/{p}",
                "file",
                len(d),
                0o640,
                crc(d),
                chunks=chunks if len(chunks) > 1 else None,
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


BYTES = {f"10/{p}": d for p, d in {**RANK0, **RANK2}.items()}


class BatchSource:
    """A BatchFileSource: ``fetch_files`` writes each target's bytes through its
    ``write`` in 1000-byte pieces and says it landed; ``stop_at`` (a path) ends the
    call there (a copy failing midway); ``flip`` (a path) corrupts a byte of it;
    ``park_after`` (a path) parks the call on ``gate`` once that file landed."""

    name = "peer"
    chunk_writes = True
    checks_written = True

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.singles: list[str] = []
        self.stop_at = ""
        self.flip = ""
        self.park_after = ""
        self.parked = trio.Event()
        self.gate = trio.Event()

    async def fetch_files(self, job, rank, step, digest, files, landed, *, writers=0) -> None:
        self.batches.append([f.path for f in files])
        hold = fetch_hold.get()  # as PeerClient.pull_files: paused while it says so
        for f in files:
            if f.path == self.stop_at:
                return
            data = bytearray(BYTES[f.path])
            if f.path == self.flip:
                data[10] ^= 0x01
            try:
                for off in range(0, len(data), 1000):
                    while hold():
                        await trio.sleep(0.005)
                    f.write(bytes(data[off : off + 1000]), off)
            except ChunkMismatch:
                return  # the copy is refused: the rest is not asked of it
            landed(f.path, COPY)
            if f.path == self.park_after:
                self.parked.set()
                await self.gate.wait()

    async def fetch_file(
        self, job, rank, step, digest, path, fd, *, skip=frozenset(), writers=0, **more
    ) -> str:
        self.singles.append(path)
        data = BYTES.get(path)
        if data is None:
            raise FetchFailed(f"no copy of {path}")
        write = more.get("write")
        if write is not None:
            for off in range(0, len(data), 1000):
                write(data[off : off + 1000], off)
        else:
            os.pwrite(fd, data, 0)
        return COPY


def view_of(tmp: Path, source: BatchSource, chunked: bool = True):
    ram = RamStore(str(tmp / "node1"))
    own_file = Path(ram.view) / "10" / "__1_0.distcp"
    own_file.parent.mkdir(parents=True)
    own_file.write_bytes(b"own")
    shards = ShardStore(ram)
    own = shards.snapshot(ram.view, ShardKey(JOB, 1, 10), "10", ["10"], "generic")
    catalog = ShardCatalog(shards, 2)
    catalog.add(own)
    job = fake_ports.FakeJob(JobSpec(JOB, "generic", 1, 3))
    parts = {0: manifest(0, RANK0, chunked), 2: manifest(2, RANK2, chunked)}
    rv = RemoteView(
        ram.view,
        ram.incoming,
        catalog,
        job,
        Manifests(parts),
        [source],
        job,
        trio.CapacityLimiter(1),
    )
    return rv, ram, own, job


def run(rv: RemoteView, own, body) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            rv._fetches = nursery
            await rv.look(own)
            with trio.fail_after(30):
                await body()
            nursery.cancel_scope.cancel()

    trio.run(main)


def rf_of(rv: RemoteView, path: str):
    return rv.steps[10].files[f"10/{path}"]


def states(rv: RemoteView) -> dict[str, str]:
    return {p.removeprefix("10/"): f.state for p, f in sorted(rv.steps[10].files.items())}


def on_disk(ram: RamStore, path: str) -> bytes:
    return (Path(ram.view) / "10" / path).read_bytes()


@pytest.fixture(autouse=True)
def small_is_below_the_big_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote_view, "BATCH_FILE_MAX", 10_000)


def test_opening_a_small_file_brings_the_next_small_files_of_its_part_in_one_call(tmp_path):
    source = BatchSource()
    rv, ram, own, job = view_of(tmp_path, source)

    async def body() -> None:
        await rv.fetch(rf_of(rv, "s/f00"), urgent=True)
        await wait_local(rv, [f"s/f{i:02d}" for i in range(10)] + ["s/f07empty"])

    run(rv, own, body)
    # rank 2's file in between and the big file are not in it; the empty file is
    assert source.batches == [
        [f"10/s/f{i:02d}" for i in range(5)]
        + [
            "10/s/f05",
            "10/s/f06",
            "10/s/f07",
            "10/s/f07empty",
            "10/s/f08",
            "10/s/f09",
        ]
    ]
    assert source.singles == []
    for p, d in {**SMALL, "s/f07empty": b""}.items():
        assert on_disk(ram, p) == d, p
        assert rf_of(rv, p).source == COPY
        # marked as here: a restarted daemon keeps the bytes (trial 43: marked while
        # still fetching, they were punched out and fetched again after a restart)
        mark = json.loads(os.getxattr(Path(ram.view) / "10" / p, XATTR))
        assert (mark["state"], mark["source"]) == (LOCAL, COPY), (p, mark)
    # not asked for: the next file in path order was in the batch (no read-ahead)
    assert states(rv)["s/f04big"] == states(rv)["s/f05x"] == REMOTE
    assert rv.fetched_bytes["peer"] >= sum(len(d) for d in SMALL.values())
    assert job.errors == []


async def wait_local(rv: RemoteView, paths: list[str]) -> None:
    while any(rf_of(rv, p).state != LOCAL for p in paths):
        await trio.sleep(0.01)


def test_an_open_is_served_as_soon_as_its_file_landed_while_the_batch_goes_on(tmp_path):
    source = BatchSource()
    source.park_after = "10/s/f00"
    rv, ram, own, job = view_of(tmp_path, source)

    async def body() -> None:
        await rv.fetch(rf_of(rv, "s/f00"), urgent=True)  # returns while the call is parked
        assert source.parked.is_set() and not source.gate.is_set()
        assert rf_of(rv, "s/f00").state == LOCAL and on_disk(ram, "s/f00") == SMALL["s/f00"]
        assert rf_of(rv, "s/f01").state == "fetching"
        # an open of the next file waits for the batch, not for a call of its own
        done = trio.Event()

        async def second() -> None:
            await rv.fetch(rf_of(rv, "s/f01"), urgent=True)
            done.set()

        async with trio.open_nursery() as n:
            n.start_soon(second)
            await trio.sleep(0.05)
            assert not done.is_set()
            source.gate.set()
        assert on_disk(ram, "s/f01") == SMALL["s/f01"]
        await wait_local(rv, [f"s/f{i:02d}" for i in range(10)])

    run(rv, own, body)
    assert len(source.batches) == 1 and source.singles == []
    assert job.errors == []


@pytest.mark.parametrize("fault", ["stop_at", "flip"])
def test_files_the_batch_did_not_bring_are_fetched_on_their_own_with_the_right_bytes(
    tmp_path, fault
):
    source = BatchSource()
    setattr(source, fault, "10/s/f03")
    rv, ram, own, job = view_of(tmp_path, source)

    async def body() -> None:
        await rv.fetch(rf_of(rv, "s/f00"), urgent=True)
        await wait_local(rv, [f"s/f{i:02d}" for i in range(10)])

    run(rv, own, body)
    assert len(source.batches) == 1
    # f03 and every file after it in the batch, each in a call of its own
    assert sorted(source.singles) == [
        "10/s/f03",
        "10/s/f04",
        "10/s/f05",
        "10/s/f06",
        "10/s/f07",
        "10/s/f07empty",
        "10/s/f08",
        "10/s/f09",
    ]
    for p, d in SMALL.items():
        assert on_disk(ram, p) == d, p  # never the flipped byte
    assert job.errors == []


def test_an_open_of_a_file_that_is_not_first_in_the_batch_still_gets_it(tmp_path):
    source = BatchSource()
    source.stop_at = "10/s/f00"  # the batch brings nothing, not even the opened file
    rv, ram, own, job = view_of(tmp_path, source)

    async def body() -> None:
        await rv.fetch(rf_of(rv, "s/f00"), urgent=True)

    run(rv, own, body)
    assert on_disk(ram, "s/f00") == SMALL["s/f00"]
    assert source.singles[0] == "10/s/f00"
    assert job.errors == []


def test_files_without_chunk_checksums_are_not_batched(tmp_path):
    source = BatchSource()
    rv, ram, own, job = view_of(tmp_path, source, chunked=False)

    async def body() -> None:
        await rv.fetch(rf_of(rv, "s/f00"), urgent=True)

    run(rv, own, body)
    assert source.batches == [] and source.singles[0] == "10/s/f00"
    assert on_disk(ram, "s/f00") == SMALL["s/f00"]
    assert job.errors == []


def test_the_prefetch_batches_the_small_files(tmp_path):
    source = BatchSource()
    rv, ram, own, job = view_of(tmp_path, source)

    async def body() -> None:
        await rv.prefetch(10)

    run(rv, own, body)
    assert set(states(rv).values()) == {LOCAL}
    # the big file and rank 2's file on their own, rank 0's small files in one call
    assert len(source.batches) == 1 and len(source.batches[0]) == 11
    assert sorted(source.singles) == ["10/s/f04big", "10/s/f05x"]
    for p, d in {**RANK0, **RANK2}.items():
        assert on_disk(ram, p) == d, p
    assert job.errors == []


# ---------------------------------------------------------------------- review regressions


async def read_while_released(rv: RemoteView, source: BatchSource, path: str) -> None:
    """A reader's open of ``path`` while the parked call is released 0.05 s later;
    it must end within 5 s (never held by its own batch)."""

    async def release() -> None:
        await trio.sleep(0.05)
        source.gate.set()

    async with trio.open_nursery() as n:
        n.start_soon(release)
        with trio.fail_after(5):
            await rv.fetch(rf_of(rv, path), urgent=True)


def test_a_reader_of_a_later_file_of_a_batch_is_not_held_by_its_own_batch(tmp_path):
    """Review of 2569809: the batch paused for readers unless its first file was waited
    for; a reader opening the second file (the first had landed) waited for a batch
    that waited for readers: forever. A reader of any file of a batch makes it urgent."""
    source = BatchSource()
    source.park_after = "10/s/f00"
    rv, ram, own, job = view_of(tmp_path, source)

    async def body() -> None:
        await rv.fetch(rf_of(rv, "s/f00"), urgent=True)
        assert rf_of(rv, "s/f01").state == "fetching"

        await read_while_released(rv, source, "s/f01")
        assert on_disk(ram, "s/f01") == SMALL["s/f01"]

    run(rv, own, body)
    assert job.errors == []


def test_a_reader_of_a_file_of_a_prefetch_batch_is_not_held(tmp_path):
    source = BatchSource()
    source.park_after = "10/s/f00"
    rv, ram, own, _job = view_of(tmp_path, source)

    async def body() -> None:
        rv._fetches.start_soon(rv.fetch, rf_of(rv, "s/f00"))  # a prefetch: not urgent
        await source.parked.wait()

        await read_while_released(rv, source, "s/f03")
        assert on_disk(ram, "s/f03") == SMALL["s/f03"]

    run(rv, own, body)


class SecondCallFails(BatchSource):
    """``fetch_file`` takes a while; a second call for a path fails (the copy went away)."""

    async def fetch_file(self, job, rank, step, digest, path, fd, **more) -> str:
        n = self.singles.count(path)
        self.singles.append(path)
        await trio.sleep(0.1 if n == 0 else 0.3)
        if n:
            raise FetchFailed(f"{path}: the copy went away")
        more["write"](BYTES[path], 0)
        return COPY


def test_a_file_dropped_and_opened_again_while_its_batch_runs_is_fetched_once(tmp_path):
    """Review of 2569809: a landed file of a running batch, dropped to make room and
    opened again, was fetched twice (the batch's task fetched it again at its end) and
    the failing second fetch punched the bytes of a file then LOCAL: zeros served."""
    source = SecondCallFails()
    source.park_after = "10/s/f00"
    rv, ram, own, job = view_of(tmp_path, source)

    async def body() -> None:
        f00 = rf_of(rv, "s/f00")
        await rv.fetch(f00, urgent=True)  # landed; the call parks after it
        assert f00.state == LOCAL
        assert await rv.drop(10) and f00.state == REMOTE  # no handle open: dropped
        async with trio.open_nursery() as n:
            n.start_soon(rv._reader_fetch, f00)  # opened again while the batch runs
            await trio.sleep(0.01)
            source.gate.set()
        await wait_local(rv, [f"s/f{i:02d}" for i in range(10)])

    run(rv, own, body)
    assert source.singles == ["10/s/f00"]
    assert rf_of(rv, "s/f00").state == LOCAL and on_disk(ram, "s/f00") == SMALL["s/f00"]
    assert job.errors == []


def test_a_file_dropped_and_fetched_again_by_a_prefetch_while_its_batch_runs(tmp_path):
    """As above, the second fetch not a reader's (the batch is not paused for it): the
    batch's task must leave the file to that fetch (second review of the batch)."""
    source = SecondCallFails()
    source.park_after = "10/s/f00"
    rv, ram, own, job = view_of(tmp_path, source)

    async def body() -> None:
        f00 = rf_of(rv, "s/f00")
        await rv.fetch(f00, urgent=True)
        assert await rv.drop(10) and f00.state == REMOTE
        async with trio.open_nursery() as n:
            n.start_soon(rv.fetch, f00)  # a prefetch or read-ahead: not urgent
            await trio.sleep(0.01)
            source.gate.set()
        await wait_local(rv, [f"s/f{i:02d}" for i in range(10)])
        await trio.sleep(0.5)  # a second fetch of f00 (the bug) would end by now

    run(rv, own, body)
    assert source.singles == ["10/s/f00"]
    assert rf_of(rv, "s/f00").state == LOCAL and on_disk(ram, "s/f00") == SMALL["s/f00"]
    assert job.errors == []


class NoRoomAtF02(BatchSource):
    """The batch finds no room at f02 (after f00 and f01 landed)."""

    async def fetch_files(self, job, rank, step, digest, files, landed, *, writers=0) -> None:
        self.batches.append([f.path for f in files])
        for f in files:
            if f.path == "10/s/f02":
                raise FetchFailed("no room") from OSError(28, "No space left on device")
            f.write(BYTES[f.path], 0)
            landed(f.path, COPY)


def test_no_room_in_a_batch_leaves_the_files_nobody_waits_for_remote(tmp_path):
    """Review of 2569809: after no room, every file of the batch was fetched on its own
    at once, urgent, each making room by dropping the others and writing a line."""
    source = NoRoomAtF02()
    rv, ram, own, job = view_of(tmp_path, source)

    async def body() -> None:
        await rv.fetch(rf_of(rv, "s/f00"), urgent=True)
        while any(f.state == "fetching" for f in rv.steps[10].files.values()):
            await trio.sleep(0.01)
        assert rf_of(rv, "s/f01").state == LOCAL
        assert rf_of(rv, "s/f02").state == REMOTE and rf_of(rv, "s/f02").errno == 28
        # an empty file needs no room: fetched (trial 43b: ENOSPC for a 0-byte file)
        assert rf_of(rv, "s/f07empty").state == LOCAL
        assert source.singles == ["10/s/f07empty"] and job.errors == []
        # a later open of one of them fetches it (room was made meanwhile)
        await rv.fetch(rf_of(rv, "s/f05"), urgent=True)
        assert on_disk(ram, "s/f05") == SMALL["s/f05"]

    run(rv, own, body)


class Down(BatchSource):
    """No copy anywhere."""

    async def fetch_files(self, job, rank, step, digest, files, landed, *, writers=0) -> None:
        self.batches.append([f.path for f in files])

    async def fetch_file(self, job, rank, step, digest, path, fd, **more) -> str:
        self.singles.append(path)
        raise FetchFailed(f"{path}: no copy")


def test_with_every_copy_down_the_prefetch_asks_for_each_file_once(tmp_path):
    """Review of 2569809: each failed single fetch's file was batched again by the next
    prefetch step, and its tail restarted: 36 fetches and error lines for 13 files.
    Second review: the prefetch's worker, behind the batch's files left over, fetched
    those the leftovers had already failed again (23 of 13, in 9 of 10 runs): 10 runs."""
    files = sorted(f"10/{p}" for p in {**RANK0, **RANK2})
    for i in range(10):
        source = Down()
        (tmp_path / str(i)).mkdir()
        rv, _ram, own, job = view_of(tmp_path / str(i), source)

        async def body(rv: RemoteView = rv) -> None:
            await rv.prefetch(10)

        run(rv, own, body)
        assert sorted(source.singles) == files, i
        assert len(job.errors) == len(files), i


def test_a_batch_keeps_to_the_directory_of_the_file_opened(tmp_path, monkeypatch):
    """The holder streams a directory's entries by name, a subdirectory's files at the
    subdirectory's place: ``s/g/x`` is sent before ``s/g-1`` although a flat sort puts
    it after, so a batch of ``s/g-1`` with it would send the file opened after it. A
    batch keeps to the directory of the file opened."""
    more = {"s/g-1": os.urandom(100), "s/g-2": os.urandom(100), "s/g/x": os.urandom(100)}
    monkeypatch.setattr(
        sys.modules[__name__], "BYTES", {**BYTES, **{f"10/{p}": d for p, d in more.items()}}
    )
    for p, d in more.items():
        monkeypatch.setitem(RANK0, p, d)
    source = BatchSource()
    rv, ram, own, job = view_of(tmp_path, source)

    async def body() -> None:
        await rv.fetch(rf_of(rv, "s/g-1"), urgent=True)
        await wait_local(rv, ["s/g-1", "s/g-2"])
        await rv.fetch(rf_of(rv, "s/g/x"), urgent=True)

    run(rv, own, body)
    assert source.batches == [["10/s/g-1", "10/s/g-2"]]
    for p, d in more.items():
        assert on_disk(ram, p) == d
    assert job.errors == []


def test_a_file_left_remote_for_no_room_is_punched_before_an_open_can_fetch_it(
    tmp_path, monkeypatch
):
    """Second review: after no room, a file nobody waited for was ended (REMOTE, its
    waiters woken) before its punch; an open in between fetched it, LOCAL, and the
    late punch emptied it: zeros served. The punch now comes first."""
    import time

    real = RemoteView._punch

    def slow_punch(fd: int, size: int) -> None:
        time.sleep(0.3)  # a busy machine: the worker thread runs late
        real(fd, size)

    monkeypatch.setattr(RemoteView, "_punch", staticmethod(slow_punch))
    source = NoRoomAtF02()
    rv, ram, own, job = view_of(tmp_path, source)

    async def body() -> None:
        await rv.fetch(rf_of(rv, "s/f00"), urgent=True)
        f02 = rf_of(rv, "s/f02")
        while f02.state != "fetching":
            await trio.sleep(0)
        await trio.sleep(0.05)  # the leftovers' punch of f02 under way
        await rv.fetch(f02, urgent=True)  # a reader opens it meanwhile
        assert f02.state == LOCAL and on_disk(ram, "s/f02") == SMALL["s/f02"]
        await trio.sleep(0.5)  # every punch has ended

    run(rv, own, body)
    assert rf_of(rv, "s/f02").state == LOCAL
    assert on_disk(ram, "s/f02") == SMALL["s/f02"], "LOCAL with zeros"
    assert job.errors == []


class NoRoomAnywhere(BatchSource):
    async def fetch_files(self, job, rank, step, digest, files, landed, *, writers=0) -> None:
        self.batches.append([f.path for f in files])
        raise FetchFailed("no room") from OSError(28, "No space left on device")

    async def fetch_file(self, job, rank, step, digest, path, fd, **more) -> str:
        self.singles.append(path)
        if not BYTES[path]:
            return COPY  # writing nothing never finds no room
        raise FetchFailed("no room") from OSError(28, "No space left on device")


def test_no_room_for_a_prefetch_batch_leaves_its_first_file_remote_too(tmp_path):
    """Second review: after no room, the first file of a batch nobody waited for was
    still fetched alone, made room (dropping files just fetched) and wrote a line."""
    source = NoRoomAnywhere()
    rv, _ram, own, job = view_of(tmp_path, source)

    async def body() -> None:
        with pytest.raises(OSError) as exc:
            await rv.fetch(rf_of(rv, "s/f00"))  # a prefetch: nobody waits
        assert exc.value.errno == 28
        while any(f.state == "fetching" for f in rv.steps[10].files.values()):
            await trio.sleep(0.01)

    run(rv, own, body)
    assert source.singles == ["10/s/f07empty"] and job.errors == []  # it needs no room
    assert rf_of(rv, "s/f00").state == REMOTE and rf_of(rv, "s/f07empty").state == LOCAL


class DroppedOnLanding(BatchSource):
    """Lands each file, and the first one is dropped at once (``make_room`` for another
    fetch sets it REMOTE) before its waiter wakes: ``view`` is the view."""

    view: RemoteView | None = None

    async def fetch_files(self, job, rank, step, digest, files, landed, *, writers=0) -> None:
        self.batches.append([f.path for f in files])
        for f in files:
            f.write(BYTES[f.path], 0)
            landed(f.path, COPY)
            if len(self.batches) == 1 and f.path == "10/s/f00":
                assert self.view is not None
                self.view.steps[10].files[f.path].state = REMOTE  # _drop_files' first step


def test_a_file_dropped_right_after_it_landed_is_fetched_again_for_its_waiter(tmp_path):
    """Trial 43b: with a small budget and several readers, a file that landed was
    dropped to make room before the open waiting for it woke; the open failed with
    EIO (errno 0: nothing failed) and no line. It is fetched again."""
    source = DroppedOnLanding()
    rv, ram, own, job = view_of(tmp_path, source)
    source.view = rv

    async def body() -> None:
        await rv.fetch(rf_of(rv, "s/f00"), urgent=True)  # no OSError

    run(rv, own, body)
    assert on_disk(ram, "s/f00") == SMALL["s/f00"]
    assert rf_of(rv, "s/f00").state == LOCAL
    assert len(source.batches) == 1 and source.singles == ["10/s/f00"]  # the rest stayed
    assert job.errors == []
