"""OwnRepair: this node's own files whose RAM copy failed verification are fetched back
into the view from another copy, checked (#14 trial 49 F2)."""

from __future__ import annotations

import os

import trio
from gcs_fixtures import make_shard

from tierfs.core import syscalls
from tierfs.core.control import JobSpec
from tierfs.core.errors import FetchFailed
from tierfs.node.jobstate import JobState
from tierfs.node.own_repair import OwnRepair

GOOD = os.urandom(9 << 20)
SMALL = b"small file\n"


class Source:
    """A FileSource that serves ``data`` (per path; None: fails)."""

    def __init__(self, name: str, data: dict[str, bytes | None]) -> None:
        self.name = name
        self.data = data
        self.asked: list[tuple[int, int, str]] = []

    async def fetch_file(self, job, rank, step, digest, path, fd, **kw) -> str:
        self.asked.append((rank, step, path))
        got = self.data.get(path)
        if got is None:
            raise FetchFailed(f"{self.name}: no copy of {path}")
        os.pwrite(fd, got, 0)
        return self.name


def setup(tmp_path, rank: int = 1):
    shard = make_shard(
        tmp_path / "ram",
        "job",
        1,
        7,
        {"ckpt-7/big.bin": GOOD, "ckpt-7/small.txt": SMALL},
        framework="generic",
        modes={"ckpt-7/big.bin": 0o640},
    )
    view = tmp_path / "view"
    (view / "ckpt-7").mkdir(parents=True)
    state = JobState()
    state.job = JobSpec("job", "generic", rank, 3)
    lines: list[str] = []
    notified: list[str] = []
    return shard, view, state, lines, notified


def repair(tmp_path, shard, view, state, lines, notified, sources, paths):
    scratch = str(tmp_path / "scratch")
    r = OwnRepair(str(view), scratch, state, sources, lines.append, notified.append)
    trio.run(r.repair, shard, paths)
    return r


def test_a_damaged_own_file_comes_back_from_the_first_copy_with_the_sealed_bytes(tmp_path):
    shard, view, state, lines, notified = setup(tmp_path)
    bad = bytearray(GOOD)
    bad[5 << 20] ^= 0xFF
    near = Source("peer node-rank 0", {"ckpt-7/big.bin": bytes(bad)})  # other bytes
    far = Source("bucket round r1", {"ckpt-7/big.bin": GOOD, "ckpt-7/small.txt": SMALL})
    r = repair(tmp_path, shard, view, state, lines, notified, [near, far], ["ckpt-7/big.bin"])
    assert (view / "ckpt-7" / "big.bin").read_bytes() == GOOD
    assert (view / "ckpt-7" / "big.bin").stat().st_mode & 0o777 == 0o640
    assert near.asked == [(1, 7, "ckpt-7/big.bin")] and far.asked == near.asked
    assert lines == [
        "step 7: this node's own ckpt-7/big.bin failed verification in RAM; its sealed "
        "bytes were fetched back from bucket round r1"
    ]
    assert notified == ["ckpt-7/big.bin"] and r.repaired == 1
    assert os.listdir(tmp_path / "scratch") == []  # nothing left behind


def test_no_copy_leaves_the_file_out_and_says_why(tmp_path):
    shard, view, state, lines, notified = setup(tmp_path)
    r = repair(
        tmp_path, shard, view, state, lines, notified,
        [Source("peer node-rank 0", {})], ["ckpt-7/small.txt"],
    )  # fmt: skip
    assert not (view / "ckpt-7" / "small.txt").exists()
    assert lines == [
        "step 7: this node's own ckpt-7/small.txt failed verification in RAM and is not "
        "in the view: peer node-rank 0: no copy of ckpt-7/small.txt"
    ]
    assert r.lost == 1 and notified == []


def test_a_file_the_client_wrote_meanwhile_is_left_as_the_client_made_it(tmp_path):
    shard, view, state, lines, notified = setup(tmp_path)
    (view / "ckpt-7" / "small.txt").write_bytes(b"the client's new bytes")
    src = Source("peer node-rank 0", {"ckpt-7/small.txt": SMALL})
    repair(tmp_path, shard, view, state, lines, notified, [src], ["ckpt-7/small.txt"])
    assert (view / "ckpt-7" / "small.txt").read_bytes() == b"the client's new bytes"
    assert src.asked == [] and lines == []


def test_another_ranks_replica_is_not_repaired_here(tmp_path):
    shard, view, state, lines, notified = setup(tmp_path, rank=2)  # this node is rank 2
    r = OwnRepair(str(view), str(tmp_path / "s"), state, [], lines.append, notified.append)
    r.taken_out(shard, ["ckpt-7/big.bin"])  # rank 1's replica: the whole-step view's job
    assert r._receive.statistics().current_buffer_used == 0


def test_a_directory_the_client_removed_and_made_again_gets_no_old_file(tmp_path):
    """Regression (#14 trial 50, F2 variant): right after node 2's own file left the
    view, its client ran ``rm -rf checkpoint-80 && mkdir checkpoint-80`` and wrote a new
    file; the repair linked the old file into the NEW directory (it only checked that a
    directory of that name existed). The directory is now known by its file handle."""
    shard, view, state, lines, notified = setup(tmp_path)
    far = Source("bucket round r1", {"ckpt-7/big.bin": GOOD})
    r = OwnRepair(str(view), str(tmp_path / "scratch"), state, [far], lines.append, notified.append)
    # the view took the identity before the file left (ClientView.withdraw_bad); the
    # client replaced the directory before the listener ran (trial 51: 17 ms later)
    parents = {"ckpt-7/big.bin": syscalls.identity(str(view / "ckpt-7"))}
    os.rmdir(view / "ckpt-7")
    (view / "ckpt-7").mkdir()
    (view / "ckpt-7" / "new_file.txt").write_bytes(b"new")
    r.taken_out(shard, ["ckpt-7/big.bin"], parents)

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(r.run)
            await r._send.aclose()

    trio.run(main)
    assert sorted(os.listdir(view / "ckpt-7")) == ["new_file.txt"]
    assert lines == [] and notified == [] and r.repaired == 0


def test_a_file_comes_back_into_its_directory_after_the_queue(tmp_path):
    """The same path through :meth:`OwnRepair.taken_out` and the background task, the
    directory kept: the file comes back."""
    shard, view, state, lines, notified = setup(tmp_path)
    far = Source("bucket round r1", {"ckpt-7/big.bin": GOOD})
    r = OwnRepair(str(view), str(tmp_path / "scratch"), state, [far], lines.append, notified.append)
    r.taken_out(shard, ["ckpt-7/big.bin"])

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(r.run)
            await r._send.aclose()

    trio.run(main)
    assert (view / "ckpt-7" / "big.bin").read_bytes() == GOOD
    assert r.repaired == 1 and notified == ["ckpt-7/big.bin"]
