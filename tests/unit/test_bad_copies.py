"""A copy that fails verification takes its files out of the view (#16 fifth trial F6,
F7), without a mount: the view's entries are hard links to the store's bytes, so a
copy discarded for a checksum mismatch must not stay readable through them."""

from __future__ import annotations

import os
from pathlib import Path

import fake_ports
import trio
from test_remote_view import BYTES, PARTS, Source, remote_view

from tierfs.core import syscalls
from tierfs.core.control import JobSpec
from tierfs.node.catalog import ShardCatalog, ShardVerifier
from tierfs.node.view import ClientView
from tierfs.store.ramstore import RamStore
from tierfs.store.shards import Shard, ShardKey, ShardStore

JOB = "train"
A, B = os.urandom(5000), os.urandom(7000)


def flip(path: str | Path, offset: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def sealed(ram: RamStore, shards: ShardStore, rank: int, files: dict[str, bytes]) -> Shard:
    for rel, data in files.items():
        p = Path(ram.view) / "10" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return shards.snapshot(ram.view, ShardKey(JOB, rank, 10), "10", ["10"], "generic")


def with_replica(tmp_path: Path):
    """Node 1 of 3 holding its own part of step 10 and a replica of rank 0's (``.metadata``
    and ``__0_0.distcp`` of ``BYTES``). Returns its RAM store, shard store, own part,
    catalog, the replica and the job."""
    ram = RamStore(str(tmp_path / "node1"))
    shards = ShardStore(ram)
    own = sealed(ram, shards, 1, {"__1_0.distcp": A})
    catalog = ShardCatalog(shards, 3)
    catalog.add(own)
    other = tmp_path / "node0-view"  # rank 0's view, on the same filesystem
    (other / "10").mkdir(parents=True)
    (other / "10" / ".metadata").write_bytes(BYTES["10/.metadata"])
    (other / "10" / "__0_0.distcp").write_bytes(BYTES["10/__0_0.distcp"])
    replica = shards.snapshot(str(other), ShardKey(JOB, 0, 10), "10", ["10"], "generic")
    catalog.add(replica)
    job = fake_ports.FakeJob(JobSpec(JOB, "generic", 1, 3))
    return ram, shards, own, catalog, replica, job


def verifier(shards: ShardStore, catalog: ShardCatalog, job) -> ShardVerifier:
    return ShardVerifier(shards, catalog, job, trio.CapacityLimiter(2))


def test_a_bad_own_copy_leaves_the_view_and_the_restored_copy_takes_its_place(tmp_path):
    """F6: node 2's own part of step 10 had a flipped byte; its restart found it and
    restored a verified copy from a peer, but the view kept the hard link to the bad
    bytes and ``dcp.load`` read them (exit 0, ``restored step 10 from peer:0``)."""
    ram = RamStore(str(tmp_path / "node1"))
    shards = ShardStore(ram)
    own = sealed(ram, shards, 1, {"__1_0.distcp": A, "extra.bin": B})
    catalog = ShardCatalog(shards, 3)
    catalog.add(own)
    job = fake_ports.FakeJob(JobSpec(JOB, "generic", 1, 3))
    view = ClientView(ram)
    check = verifier(shards, catalog, job)

    parents: dict[str, bytes | None] = {}

    async def withdraw(shard: Shard) -> None:
        await trio.to_thread.run_sync(view.withdraw_bad, shard, parents)

    check.on_bad(withdraw)
    bad, good = Path(ram.view) / "10" / "__1_0.distcp", Path(ram.view) / "10" / "extra.bin"
    good_ino = good.stat().st_ino
    before = syscalls.identity(str(bad.parent))
    flip(bad)  # the view's file is the store's file (a hard link): both are bad
    assert trio.run(check.verify, own) is False
    assert own.bad == ("10/__1_0.distcp",)
    assert not bad.exists()  # never served with the wrong bytes
    # the directory it left, known before it left (a repair goes back only there)
    assert parents == {"10/__1_0.distcp": before} and before is not None
    assert good.read_bytes() == B and good.stat().st_ino == good_ino  # a good file stays
    assert own.key not in catalog
    assert any("failed verification" in e for e in job.errors), job.errors
    # the restore's verified copy (from a peer: here sealed from another tree) is linked
    # back into the view in place of the bad one
    peer_tree = tmp_path / "peer"
    (peer_tree / "10").mkdir(parents=True)
    (peer_tree / "10" / "__1_0.distcp").write_bytes(A)
    (peer_tree / "10" / "extra.bin").write_bytes(B)
    fetched = shards.snapshot(str(peer_tree), ShardKey(JOB, 1, 10), "10", ["10"], "generic")
    assert view.link_missing(fetched) == ["10/__1_0.distcp"]
    assert bad.read_bytes() == A


def test_a_file_the_client_rewrote_since_the_seal_is_left_alone(tmp_path):
    """Only entries that are the bad copy's own inode leave the view."""
    ram = RamStore(str(tmp_path / "node1"))
    shards = ShardStore(ram)
    own = sealed(ram, shards, 1, {"__1_0.distcp": A})
    flip(Path(own.data) / "10" / "__1_0.distcp")
    mine = Path(ram.view) / "10" / "__1_0.distcp"
    mine.unlink()
    mine.write_bytes(B)  # a new file of that name (another inode)
    assert shards.verify(own) and own.bad == ("10/__1_0.distcp",)
    assert ClientView(ram).withdraw_bad(own) == []
    assert mine.read_bytes() == B


def test_a_bad_replica_behind_another_ranks_file_is_placed_again_and_fetched(tmp_path):
    """F7: node 0 held a replica of rank 2 with a flipped byte; its restore discarded
    the copy, while the whole-step view kept serving the file (a hard link to it)."""
    ram, shards, own, catalog, replica, job = with_replica(tmp_path)
    peer = Source("peer", BYTES, ["peer node-rank 0"])
    rv = remote_view(ram, catalog, job, {**PARTS, 0: replica.manifest}, [peer])
    check = verifier(shards, catalog, job)
    check.on_bad(rv.discard_bad)
    view = ClientView(ram)
    view.foreign = rv.is_remote

    async def withdraw(shard: Shard) -> None:
        await trio.to_thread.run_sync(view.withdraw_bad, shard)

    check.on_bad(withdraw)
    meta = Path(ram.view) / "10" / ".metadata"

    async def main() -> None:
        await rv.look(own)
        held = (Path(replica.data) / "10" / ".metadata").stat().st_ino
        assert meta.stat().st_ino == held
        flip(meta)  # the replica's bytes, seen through the view's hard link
        assert await check.verify(replica) is False
        assert not meta.exists()
        await rv.look(own)  # asked again: placed as a remote file, fetched on open
        ino = meta.stat().st_ino
        assert ino != held
        fetch = rv.missing(ino)
        assert fetch is not None
        await fetch()

    trio.run(main)
    assert meta.read_bytes() == BYTES["10/.metadata"]
    assert replica.key not in catalog
    # the good file of the discarded replica stays shown (its bytes were right)
    assert (Path(ram.view) / "10" / "__0_0.distcp").read_bytes() == BYTES["10/__0_0.distcp"]


def test_a_file_a_bad_replica_took_out_comes_back_once_its_part_is_named_again(tmp_path):
    """Regression (#14 trial 66 M2): node 0's replica of rank 1 failed verification while
    rank 1's node and the bucket were down; its file left the view, and it stayed
    missing for 70 s after both were back (``FileNotFoundError`` in ``dcp.load``, no
    line; status "0 remote"): the look kept the part "as placed" and never asked again.
    A rank whose files a bad copy took out is now asked at every look until named."""
    ram, shards, own, catalog, replica, job = with_replica(tmp_path)
    peer = Source("peer", BYTES, ["peer node-rank 0"])
    parts = {**PARTS, 0: replica.manifest}
    rv = remote_view(ram, catalog, job, parts, [peer])
    check = verifier(shards, catalog, job)
    check.on_bad(rv.discard_bad)
    meta = Path(ram.view) / "10" / ".metadata"

    async def main() -> None:
        await rv.look(own)
        flip(meta)  # the replica's bytes, seen through the view's hard link
        del parts[0]  # rank 0's node (and every other source) cannot name its part now
        assert await check.verify(replica) is False
        assert not meta.exists()
        assert await rv.look(own) is True  # not found: looked at again soon
        assert not meta.exists()
        parts[0] = replica.manifest  # rank 0's node is back
        await rv.look(own)
        fetch = rv.missing(meta.stat().st_ino)  # placed again, fetched on open
        assert fetch is not None
        await fetch()
        assert 0 not in rv.steps[10].discarded

    trio.run(main)
    assert meta.read_bytes() == BYTES["10/.metadata"]


def test_a_copy_a_peer_found_damaged_is_checked_at_once_and_discarded(tmp_path):
    """Regression (#16 ninth trial FAIL 13): a byte flipped in node 1's replica of
    rank 2's part; node 0 read that file through its view, refused node 1's bytes and
    was served by another copy, but node 1 kept its copy (checked again only at a
    restart past ``$TIERFS_REVERIFY_AFTER``), offered it in every inventory and a
    restore used it. Now the holder checks the copy as soon as a pull served from it
    sends a chunk with other bytes than its manifest: discarded, said once; a good
    copy named the same way is kept, and a copy no longer held is skipped."""
    ram = RamStore(str(tmp_path / "node1"))
    shards = ShardStore(ram)
    replica = sealed(ram, shards, 2, {"__2_0.distcp": A})
    catalog = ShardCatalog(shards, 3)
    catalog.add(replica)
    job = fake_ports.FakeJob(JobSpec(JOB, "generic", 1, 3))
    check = verifier(shards, catalog, job)
    flip(Path(replica.data, "10", "__2_0.distcp"))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(check.run)
            check.suspect(replica.key, "10/__2_0.distcp")
            check.suspect(replica.key, "10/__2_0.distcp")  # one check for both
            with trio.fail_after(30):
                while replica.key in catalog:
                    await trio.sleep(0.01)
            # a good copy is kept; an unknown key is skipped
            good = sealed(RamStore(str(tmp_path / "node1b")), shards, 0, {"x": B})
            catalog.add(good)
            check.suspect(good.key, "10/x")
            check.suspect(ShardKey(JOB, 5, 10), "10/y")
            with trio.fail_after(30):
                while check._suspects:
                    await trio.sleep(0.01)
            assert good.key in catalog
            nursery.cancel_scope.cancel()

    trio.run(main)
    said = [e for e in job.errors if "failed verification" in e]
    assert len(said) == 1 and "step 10 of rank 2" in said[0], job.errors


def test_a_replica_superseded_while_a_look_links_it_leaves_the_view_after_that_look(
    tmp_path,
):
    """CI regression (#16 N2 test, stop 52): a restore superseded node 3's replica of
    rank 2's 4-node part 6 ms after a look began to link it into the view (its file
    out of the view's books between the old file's removal and the new one's
    placement); the discard found nothing to take out and node 3 kept showing the
    4-node save's ``__2_0.distcp``. The discard now waits for the look under way."""
    import threading

    ram, _shards, own, catalog, replica, job = with_replica(tmp_path)
    rv = remote_view(ram, catalog, job, {**PARTS, 0: replica.manifest}, [])
    entered, release = threading.Event(), threading.Event()
    place = rv._place

    def held_place(*args):  # type: ignore[no-untyped-def]
        entered.set()
        release.wait(10)
        return place(*args)

    rv._place = held_place  # type: ignore[method-assign]
    meta = Path(ram.view) / "10" / ".metadata"
    discarded = []

    async def discard() -> None:
        await rv.discard_superseded(replica)
        discarded.append(True)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rv.look, own)
            with trio.fail_after(10):
                while not entered.is_set():
                    await trio.sleep(0.01)
            nursery.start_soon(discard)
            await trio.sleep(0.1)
            assert not discarded  # waits for the look
            release.set()
        assert discarded and not meta.exists()  # taken out once placed
        assert 0 in rv.steps[10].recheck

    trio.run(main)
