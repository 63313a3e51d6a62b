"""CrcAhead: a big file is checksummed as its writer closes it, so the seal finds its
crc32c in the cache and does not read it again (issue #18 item 1)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing

from tierfs.node import crc_ahead as ca
from tierfs.store import manifest as mf
from tierfs.store.manifest import crc32c_chunks, scan_tree

BIG = os.urandom(ca.MIN_BYTES + 12345)


def run(ahead: ca.CrcAhead, *paths: str) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            ahead.spawn = nursery.start_soon  # type: ignore[assignment]
            for p in paths:
                ahead.closed(p)

    trio.run(main)


def test_a_closed_big_file_is_in_the_cache_the_seal_reads(tmp_path, monkeypatch):
    (tmp_path / "step").mkdir()
    f = tmp_path / "step" / "big.bin"
    f.write_bytes(BIG)
    (tmp_path / "step" / "small").write_bytes(b"x" * 100)
    cache: mf.CrcCache = {}
    ahead = ca.CrcAhead(str(tmp_path), cache, lambda fn: None)
    run(ahead, "step/big.bin", "step/small")
    st = f.stat()
    crc, _, chunks = crc32c_chunks(str(f))
    assert cache == {(st.st_ino, st.st_size, st.st_mtime_ns): (crc, chunks)}
    assert ahead.files == 1 and ahead.bytes == len(BIG)

    read: list[str] = []
    real = mf.crc32c_chunks

    def counting(path, *a, **k):
        read.append(os.path.basename(str(path)))
        return real(path, *a, **k)

    monkeypatch.setattr(mf, "crc32c_chunks", counting)
    entries = {e.path: e for e in scan_tree(str(tmp_path), ["step"], cache=cache)}
    assert read == ["small"]  # the big file's bytes were not read again
    assert entries["step/big.bin"].crc32c == crc and entries["step/big.bin"].chunks == chunks


def test_a_file_written_while_it_is_read_is_not_cached(tmp_path, monkeypatch):
    f = tmp_path / "big.bin"
    f.write_bytes(BIG)
    real = ca.crc32c_chunks

    def writing(fd, *a, **k):
        out = real(fd, *a, **k)
        with open(f, "r+b") as w:  # a write lands while the file is read
            w.seek(10)
            w.write(b"changed")
        return out

    monkeypatch.setattr(ca, "crc32c_chunks", writing)
    cache: mf.CrcCache = {}
    ahead = ca.CrcAhead(str(tmp_path), cache, lambda fn: None)
    run(ahead, "big.bin")
    assert cache == {} and ahead.files == 0


def test_a_file_gone_before_it_is_read_is_skipped(tmp_path):
    cache: mf.CrcCache = {}
    ahead = ca.CrcAhead(str(tmp_path), cache, lambda fn: None)
    run(ahead, "gone.bin")
    assert cache == {} and ahead.files == 0


def test_a_just_written_file_is_read_once_the_clock_moved_past_its_mtime(tmp_path, monkeypatch):
    """The read starts QUIET after the file's mtime: a later write then gets a later
    mtime even with coarse timestamps."""
    f = tmp_path / "big.bin"
    f.write_bytes(BIG)
    mtime = f.stat().st_mtime_ns
    started: list[int] = []
    real = ca.crc32c_chunks

    def timed(fd, *a, **k):
        started.append(time.time_ns())
        return real(fd, *a, **k)

    monkeypatch.setattr(ca, "crc32c_chunks", timed)
    run(ca.CrcAhead(str(tmp_path), {}, lambda fn: None), "big.bin")
    assert started and started[0] - mtime >= ca.QUIET * 1e9


@pytest.mark.parametrize("n", [ca.PENDING + 5])
def test_a_burst_beyond_the_pending_bound_is_left_to_the_seal(tmp_path, n):
    cache: mf.CrcCache = {}
    ahead = ca.CrcAhead(str(tmp_path), cache, lambda fn: None)
    started: list[object] = []
    ahead.spawn = started.append  # type: ignore[assignment]
    for i in range(n):
        ahead.closed(f"f{i}")
    assert len(ahead._pending) == ca.PENDING and len(started) == 1


def test_a_file_renamed_right_after_its_close_is_read_at_its_new_path(tmp_path):
    """Regression (#18 run R): a plain-files save closes its one file and renames the
    step directory at once; the read by the path of the close found nothing
    (ENOENT, "checksum ahead of the seal ... No such file") and the seal read the
    whole file itself. The failing input: tmp-checkpoint-3/part.bin closed, then
    tmp-checkpoint-3 renamed to checkpoint-3 before the read."""
    (tmp_path / "tmp-checkpoint-3").mkdir()
    f = tmp_path / "tmp-checkpoint-3" / "part.bin"
    f.write_bytes(BIG)
    ino = f.stat().st_ino
    os.rename(tmp_path / "tmp-checkpoint-3", tmp_path / "checkpoint-3")
    where = {ino: "checkpoint-3/part.bin"}
    cache: mf.CrcCache = {}
    ahead = ca.CrcAhead(str(tmp_path), cache, lambda fn: None, locate=where.get)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            ahead.spawn = nursery.start_soon  # type: ignore[assignment]
            ahead.closed("tmp-checkpoint-3/part.bin", ino)

    trio.run(main)
    st = (tmp_path / "checkpoint-3" / "part.bin").stat()
    crc, _, chunks = crc32c_chunks(str(tmp_path / "checkpoint-3" / "part.bin"))
    assert cache == {(st.st_ino, st.st_size, st.st_mtime_ns): (crc, chunks)}
    assert ahead.files == 1


def test_another_file_under_the_closed_files_name_is_not_taken_for_it(tmp_path):
    """The name of the close now holds another file (the closed one renamed away and
    unknown to the namespace): nothing is cached for the closed inode's sake; the
    other file's own close brings it."""
    f = tmp_path / "part.bin"
    f.write_bytes(BIG)
    ino = f.stat().st_ino
    os.rename(f, tmp_path / "moved.bin")
    (tmp_path / "part.bin").write_bytes(BIG[::-1])
    cache: mf.CrcCache = {}
    ahead = ca.CrcAhead(str(tmp_path), cache, lambda fn: None, locate=lambda i: None)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            ahead.spawn = nursery.start_soon  # type: ignore[assignment]
            ahead.closed("part.bin", ino)

    trio.run(main)
    assert cache == {} and ahead.files == 0


def test_a_rename_between_the_look_and_the_open_is_looked_up_again(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    f = tmp_path / "a" / "part.bin"
    f.write_bytes(BIG)
    ino = f.stat().st_ino
    looks = iter(["a/part.bin", "b/part.bin"])
    os.rename(tmp_path / "a", tmp_path / "b")  # after the first look, before the open
    cache: mf.CrcCache = {}
    ahead = ca.CrcAhead(str(tmp_path), cache, lambda fn: None, locate=lambda i: next(looks))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            ahead.spawn = nursery.start_soon  # type: ignore[assignment]
            ahead.closed("a/part.bin", ino)

    trio.run(main)
    assert ahead.files == 1 and len(cache) == 1


def test_a_seal_waits_for_the_checksums_queued_before_it_not_for_later_ones(tmp_path, monkeypatch):
    """#18: a seal that started while the file's checksum at close was still being
    read read the same bytes beside it (twice the CPU on 2 busy vCPUs); it now
    waits for what was queued before it, and files closed after it do not delay it."""
    for name in ("a.bin", "b.bin", "later.bin"):
        (tmp_path / name).write_bytes(BIG)
    later_ino = (tmp_path / "later.bin").stat().st_ino
    cache: mf.CrcCache = {}
    ahead = ca.CrcAhead(str(tmp_path), cache, lambda fn: None)
    gate = threading.Event()
    real = ca.crc32c_chunks

    def gated(fd, *a, **k):
        if os.fstat(fd).st_ino == later_ino:
            assert gate.wait(30)  # the file closed after the seal began is slow to read
        return real(fd, *a, **k)

    settled_with: list[int] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            ahead.spawn = nursery.start_soon  # type: ignore[assignment]
            ahead.closed("a.bin", (tmp_path / "a.bin").stat().st_ino)
            ahead.closed("b.bin", (tmp_path / "b.bin").stat().st_ino)
            seal = trio.Event()

            async def sealing() -> None:
                await ahead.settled()
                settled_with.append(len(cache))
                seal.set()

            nursery.start_soon(sealing)
            await trio.testing.wait_all_tasks_blocked()  # the seal is waiting
            ahead.closed("later.bin", later_ino)
            with trio.fail_after(30):
                await seal.wait()
            gate.set()

    monkeypatch.setattr(ca, "crc32c_chunks", gated)
    trio.run(main)
    assert settled_with == [2]  # both files queued before were in the cache
    assert len(cache) == 3 and ahead.files == 3


def test_settled_returns_at_once_with_nothing_queued():
    ahead = ca.CrcAhead("/nonexistent", {}, lambda fn: None)

    async def main() -> None:
        with trio.fail_after(1):
            await ahead.settled()

    trio.run(main)


def _holders(path: str) -> int:
    """Descriptors of this process open on ``path``."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(path):
                n += 1
        except OSError:
            pass
    return n


def _closed_then_let_go(
    ahead: ca.CrcAhead, path, ino: int, started: Callable[[], Awaitable[object]]
) -> list[int]:
    """Close ``path`` (backing inode ``ino``) into ``ahead``; once ``started()`` returned,
    let it go; the descriptors held on it then and after the wait."""
    held: list[int] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            ahead.spawn = nursery.start_soon  # type: ignore[assignment]
            ahead.closed(path.name, ino)
            await started()
            held.append(_holders(str(path)))
            assert ahead.let_go(ino + 1) is None  # another file: nothing to wait for
            wait = ahead.let_go(ino)
            assert wait is not None
            with trio.fail_after(5):
                await wait()
            held.append(_holders(str(path)))

    trio.run(main)
    return held


def test_a_file_waiting_for_the_quiet_time_holds_no_descriptor_and_lets_go(tmp_path):
    """Regression (fault campaign seed 19, 7 December 2026): the read held the file open
    while it waited QUIET after the mtime, so a client's unlink right after its close
    left the RAM taken; now nothing is open while waiting, and let_go ends the wait."""
    f = tmp_path / "big.bin"
    f.write_bytes(BIG)
    ino = f.stat().st_ino
    os.utime(f, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))  # QUIET not yet passed
    ahead = ca.CrcAhead(str(tmp_path), {}, lambda fn: None)
    # the worker waits for the clock
    seen = _closed_then_let_go(ahead, f, ino, trio.testing.wait_all_tasks_blocked)
    assert seen == [0, 0] and ahead.files == 0
    assert ahead.let_go(ino) is None  # no read under way


def test_let_go_stops_a_read_under_way_at_the_next_chunk(tmp_path, monkeypatch):
    f = tmp_path / "big.bin"
    f.write_bytes(os.urandom(8 * (1 << 20)))
    ino = f.stat().st_ino
    real = ca.crc32c_chunks
    reading, chunks_read = threading.Event(), []

    def slow(fd, *a, cancelled=None, **k):
        def between() -> bool:
            chunks_read.append(1)
            reading.set()
            time.sleep(0.05)
            return cancelled()

        return real(fd, *a, cancelled=between, chunk=1 << 20, **k)

    monkeypatch.setattr(ca, "crc32c_chunks", slow)
    monkeypatch.setattr(ca, "QUIET", 0)
    ahead = ca.CrcAhead(str(tmp_path), {}, lambda fn: None)
    held = _closed_then_let_go(ahead, f, ino, lambda: trio.to_thread.run_sync(reading.wait))
    assert held == [1, 0]
    assert len(chunks_read) < 8 and ahead.files == 0  # stopped before the end
