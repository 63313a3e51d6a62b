"""Issue #14 without a mount: the whole-step view's rules (which rank's file a path
shows), placing other ranks' files (sparse placeholders with size, mode and the xattr;
hard links to a replica held here), fetching them verified (a corrupt copy skipped, no
copy -> EIO with the reason, the bytes punched out again), leaving them out of the
node's own seal, the sweep at start, the status, and the namespace's read-only rule."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fake_ports
import google_crc32c
import pytest
import trio
import trio.testing
from raw_map import RawMap

from tierfs.core.control import JobSpec
from tierfs.core.errors import FetchFailed
from tierfs.core.ports import PART_SAVING
from tierfs.core.priority import fetch_hold, fetch_pause, fetch_urgent
from tierfs.fuse.inodes import ROOT_ID
from tierfs.fuse.namespace import Namespace
from tierfs.fuse.remote import Deferred
from tierfs.node import dcp_expect
from tierfs.node import remote_view as view_module
from tierfs.node.catalog import ShardCatalog
from tierfs.node.remote_view import SAY_AFTER, SWEEP_EVERY, XATTR, RemoteView
from tierfs.node.resave import sealed_at
from tierfs.node.union import Conflict, union_plan
from tierfs.store.manifest import FileEntry, Manifest
from tierfs.store.ramstore import Budget, RamStore
from tierfs.store.shards import Shard, ShardKey, ShardStore

JOB = "train"
A, B, C = os.urandom(5000), os.urandom(7000), os.urandom(100)


def has_data(path: Path) -> bool:
    """True if ``path`` holds any data block (not a hole from end to end)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.lseek(fd, 0, os.SEEK_DATA)
        return True
    except OSError as exc:
        if exc.errno != errno.ENXIO:
            raise
        return False
    finally:
        os.close(fd)


def manifest(rank: int, files: dict[str, bytes], step: int = 10) -> Manifest:
    import google_crc32c

    entries = [FileEntry(str(step), "dir", mode=0o755)] + [
        FileEntry(f"{step}/{p}", "file", len(d), 0o640, google_crc32c.value(d))
        for p, d in sorted(files.items())
    ]
    return Manifest(JOB, rank, step, str(step), "generic", tuple(entries))


# ---------------------------------------------------------------------- the rules


def test_identical_paths_are_one_file_and_different_ones_a_conflict():
    own = manifest(1, {"__1_0.distcp": A, "shared.json": C})
    others = {
        0: manifest(0, {".metadata": B, "__0_0.distcp": A, "shared.json": C}),
        2: manifest(2, {"__2_0.distcp": B, "extra/x.bin": C, ".metadata": B}),
        3: manifest(3, {"__3_0.distcp": A, "shared.json": B}),
    }
    plan = union_plan(own, others)
    assert sorted(plan.files) == [
        "10/.metadata",
        "10/__0_0.distcp",
        "10/__2_0.distcp",
        "10/__3_0.distcp",
        "10/extra/x.bin",
    ]
    assert plan.files["10/.metadata"][0] == 0  # identical on 0 and 2: the lowest rank's
    assert [d.path for d in plan.dirs] == []  # "10" is the node's own; no "10/extra" entry
    # shared.json: this node's own copy wins, the conflict names every rank holding it
    assert plan.conflicts == [Conflict("10/shared.json", -1, (0, 3))]


def test_a_conflict_between_other_ranks_shows_the_lowest_rank():
    plan = union_plan(None, {2: manifest(2, {"x": A}), 1: manifest(1, {"x": B})})
    assert plan.files["10/x"][0] == 1
    assert plan.conflicts == [Conflict("10/x", 1, (1, 2))]


def test_orbax_per_process_step_metadata_is_not_a_conflict():
    """Orbax with ``primary_host=None`` (node-local storage): every process finalizes its
    own step and writes ``_CHECKPOINT_METADATA`` with its own timestamps. Regression: each
    node reported the file as a conflict in ``replicator.errors`` at every step."""
    meta = "default/_CHECKPOINT_METADATA"  # also at the step's top (item metadata)
    own = manifest(0, {"_CHECKPOINT_METADATA": A, meta: A, "commit_success.txt": A, "w/0.0": C})
    other = {"_CHECKPOINT_METADATA": B, meta: B, "commit_success.txt": B, "w/1.0": C}
    plan = union_plan(own, {1: manifest(1, other)})
    assert plan.conflicts == []
    assert sorted(plan.files) == ["10/w/1.0"]  # the node's own metadata is shown
    alone = union_plan(None, {2: manifest(2, {meta: B}), 1: manifest(1, {meta: A})})
    assert alone.conflicts == [] and alone.files[f"10/{meta}"][0] == 1


# ---------------------------------------------------------------------- placing, fetching


class Manifests:
    def __init__(self, parts: dict[int, Manifest]) -> None:
        self.parts = parts
        self.asked: list[int] = []

    async def part_manifest(
        self,
        job: str,
        rank: int,
        step: int,
        *,
        writers: int = 0,
        round_name: str = "",
        beside: tuple[int, str] | None = None,
    ) -> Manifest | None:
        self.asked.append(rank)
        self.beside = beside
        return self.parts.get(rank)


class Source:
    """A FileSource serving ``files`` (path -> bytes); ``corrupt`` copies flip a byte."""

    def __init__(self, name: str, files: dict[str, bytes], copies: list[str]) -> None:
        self.name = name
        self.files = files
        self.copies = copies
        self.corrupt: set[str] = set()
        self.calls: list[tuple[str, frozenset[str]]] = []

    async def fetch_file(
        self, job, rank, step, digest, path, fd, *, skip=frozenset(), writers=0
    ) -> str:
        self.calls.append((path, skip))
        for copy in self.copies:
            if copy in skip:
                continue
            data = self.files.get(path)
            if data is None:
                break
            if copy in self.corrupt:
                data = bytes([data[0] ^ 1]) + data[1:]
            os.pwrite(fd, data, 0)
            return copy
        raise FetchFailed(f"{self.name}: no copy of {path}")


def own_part(tmp: Path, files: dict[str, bytes]) -> tuple[RamStore, ShardStore, Shard]:
    ram = RamStore(str(tmp / "node1"))
    for rel, data in files.items():
        p = Path(ram.view) / "10" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    shards = ShardStore(ram)
    return ram, shards, shards.snapshot(ram.view, ShardKey(JOB, 1, 10), "10", ["10"], "generic")


def remote_view(
    ram: RamStore,
    catalog: ShardCatalog,
    job: fake_ports.FakeJob,
    parts: dict[int, Manifest],
    sources: list[Source],
    **options,
) -> RemoteView:
    """A view of ``ram`` whose other ranks' manifests are ``parts`` (``job`` is the
    running job and the reporter; ``options``: RemoteView's keyword arguments)."""
    return RemoteView(
        ram.view,
        ram.incoming,
        catalog,
        job,
        Manifests(parts),
        sources,
        job,
        trio.CapacityLimiter(1),
        **options,
    )


def view_of(tmp: Path, parts: dict[int, Manifest], sources: list[Source]):
    ram, shards, own = own_part(tmp, {"__1_0.distcp": A})
    catalog = ShardCatalog(shards, 3)
    catalog.add(own)
    job = fake_ports.FakeJob(JobSpec(JOB, "generic", 1, 3))
    rv = remote_view(ram, catalog, job, parts, sources)
    return rv, ram, shards, catalog, own, job


#: the names of step 10 in a view showing every rank's files of PARTS and its own
WHOLE_STEP = [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
PARTS = {0: manifest(0, {".metadata": B, "__0_0.distcp": C}), 2: manifest(2, {"__2_0.distcp": B})}
BYTES = {"10/.metadata": B, "10/__0_0.distcp": C, "10/__2_0.distcp": B}


def test_other_ranks_files_appear_with_size_and_mode_and_are_fetched_verified(tmp_path):
    peer = Source("peer", BYTES, ["peer node-rank 0", "peer node-rank 2"])
    rv, ram, shards, _catalog, own, job = view_of(tmp_path, PARTS, [peer])

    async def main() -> None:
        assert await rv.look(own) is False  # every rank's part found
        meta = Path(ram.view) / "10" / ".metadata"
        st = meta.stat()
        assert (st.st_size, stat.S_IMODE(st.st_mode), has_data(meta)) == (len(B), 0o640, False)
        mark = json.loads(os.getxattr(meta, XATTR))
        assert (mark["rank"], mark["step"], mark["path"], mark["state"]) == (
            0,
            10,
            "10/.metadata",
            "remote",
        )
        assert rv.is_remote(st.st_ino) and rv.missing(st.st_ino) is not None
        assert not rv.is_remote((Path(ram.view) / "10" / "__1_0.distcp").stat().st_ino)
        fetch = rv.missing(st.st_ino)
        assert fetch is not None
        await fetch()
        assert meta.read_bytes() == B and rv.missing(st.st_ino) is None
        s = rv.status().step(10)
        assert s is not None and s.names_ready and (s.local, s.remote) == (1, 2)
        assert rv.status().fetched_bytes == {"peer": len(B)}
        await rv.prefetch(10)
        assert rv.status().step(10).bytes_ready

    trio.run(main)
    assert job.errors == []
    # a re-seal of the step here leaves other ranks' files out of this node's part
    again = shards.snapshot(
        ram.view, ShardKey(JOB, 1, 10), "10", ["10"], "generic", foreign=rv.is_remote
    )
    assert [f.path for f in again.manifest.files] == ["10", "10/__1_0.distcp"]
    # a new daemon (RAM kept) knows them again from their xattr before it mounts: still
    # read-only and never sealed here, fetched bytes kept, an unfinished fetch a hole
    partial = Path(ram.view) / "10" / "__2_0.distcp"
    trio.run(rv.drop, 10)
    with open(partial, "r+b") as f:
        f.write(b"half")  # a fetch cut off by kill -9
    again_view = RemoteView(
        ram.view, ram.incoming, _catalog, job, Manifests({}), [], job, trio.CapacityLimiter(1)
    )
    assert again_view.reload() == 3
    assert not has_data(partial) and partial.stat().st_size == len(B)

    async def opened() -> object:
        return again_view.missing(partial.stat().st_ino)

    assert trio.run(opened) is not None
    assert all(again_view.is_remote((Path(ram.view) / p).stat().st_ino) for p in BYTES)
    s = again_view.status().step(10)
    # known from their marks only: not known until a source names those parts again
    # (tenth #16 trial FAIL B), so `tierfs wait` waits for them
    assert (s.ranks_known, s.ranks_missing, s.remote) == ((), (0, 2), 3), s
    resealed = shards.snapshot(
        ram.view, ShardKey(JOB, 1, 10), "10", ["10"], "generic", foreign=again_view.is_remote
    )
    assert [f.path for f in resealed.manifest.files] == ["10", "10/__1_0.distcp"]


def test_a_file_its_part_names_of_an_earlier_save_is_not_served(tmp_path):
    """#14 trial 60: rank 2's node sealed its part of a save cut short with a file of
    the earlier save (its verdict says so). Other nodes' opens of that file fail with
    EIO, said once, instead of a load mixing two saves; once the part is sealed whole
    (the late rank wrote after all), its new file is served."""
    from tierfs.store.verdicts import with_earlier_files

    cut = dataclasses.replace(PARTS[2], verdict=with_earlier_files(None, ["10/__2_0.distcp"]))
    peer = Source("peer", BYTES, ["peer node-rank 0", "peer node-rank 2"])
    rv, ram, _shards, _catalog, own, job = view_of(tmp_path, {**PARTS, 2: cut}, [peer])
    two = Path(ram.view) / "10" / "__2_0.distcp"

    async def main() -> None:
        await rv.look(own)
        for _ in range(2):
            opened = rv.missing(two.stat().st_ino)
            assert opened is not None
            with pytest.raises(OSError) as err:
                await opened()
            assert err.value.errno == errno.EIO
            assert "of an earlier save of the step" in str(err.value)
        meta = rv.missing((Path(ram.view) / "10" / ".metadata").stat().st_ino)
        assert meta is not None
        await meta()  # the other files of the step are served
        # the late rank wrote after all: its part sealed again, whole; the coordinator
        # reports it, the view asks again and serves the new file
        B2 = os.urandom(len(B))
        whole = manifest(2, {"__2_0.distcp": B2})
        rv.manifests = Manifests({**PARTS, 2: whole})
        peer.files = {**BYTES, "10/__2_0.distcp": B2}
        rv.parts_reported("e1", 1, [10], [(10, 2, whole.digest)])
        await rv.look(own)
        opened = rv.missing(two.stat().st_ino)
        assert opened is not None
        await opened()
        assert two.read_bytes() == B2

    trio.run(main)
    assert len(job.errors) == 1 and "10/__2_0.distcp is not served (EIO)" in job.errors[0]


def test_fetched_bytes_changed_while_no_daemon_ran_are_fetched_again(tmp_path):
    """Regression (#16 ninth trial FAIL 14): a byte flipped in another rank's file that
    the view had fetched was served as it was after a daemon restart: the restarted
    daemon knew the file again as fetched from its mark and never checked its bytes.
    Now the fetched files are checked when they are known again; wrong ones are
    remote again and fetched (verified) on their next open; right ones stay."""
    peer = Source("peer", BYTES, ["peer node-rank 0", "peer node-rank 2"])
    rv, ram, _shards, catalog, own, job = view_of(tmp_path, PARTS, [peer])
    meta, two = Path(ram.view) / "10" / ".metadata", Path(ram.view) / "10" / "__2_0.distcp"

    async def main() -> None:
        await rv.look(own)
        await rv.prefetch(10)

    trio.run(main)
    assert meta.read_bytes() == B and two.read_bytes() == B
    with open(meta, "r+b") as f:
        f.seek(10)
        f.write(bytes([B[10] ^ 0x20]))
    again = RemoteView(
        ram.view, ram.incoming, catalog, job, Manifests(PARTS), [peer], job, trio.CapacityLimiter(1)
    )
    assert again.reload() == 3
    assert not has_data(meta) and meta.stat().st_size == len(B)  # remote again
    assert json.loads(os.getxattr(meta, XATTR))["state"] == "remote"
    assert trio.run(again.look, own) is False  # the ranks name their parts again
    assert has_data(two) and again.missing(two.stat().st_ino) is None  # right: kept
    fetch = again.missing(meta.stat().st_ino)
    assert fetch is not None
    trio.run(fetch)
    assert meta.read_bytes() == B


def test_a_part_known_from_marks_is_asked_again_until_its_node_names_it(tmp_path):
    """Regression (tenth #16 trial FAIL B): after a job restart that restored rank 2's
    new save of step 10, node 0's restarted daemon knew rank 2's earlier file from its
    mark, rank 2's node did not answer its first look (it was restarting), and the view
    kept serving the earlier bytes for good (``dcp.load`` on node 0 returned a mix,
    exit 0). Now a part known from marks only is asked again at every look until a
    source names it, counts as not known in status (``tierfs wait`` waits), and an
    open of its files waits for the answer; the changed file is replaced."""
    peer = Source("peer", BYTES, ["peer node-rank 2"])
    rv, ram, _shards, catalog, own, job = view_of(tmp_path, PARTS, [peer])

    async def first() -> None:
        await rv.look(own)
        await rv.prefetch(10)

    trio.run(first)
    two = Path(ram.view) / "10" / "__2_0.distcp"
    assert two.read_bytes() == B
    # every daemon restarts; rank 2 saves its part again meanwhile (other bytes)
    new_two = manifest(2, {"__2_0.distcp": A})
    asked = Manifests({0: PARTS[0]})  # rank 2's node is still starting
    again = RemoteView(
        ram.view, ram.incoming, catalog, job, asked, [peer], job, trio.CapacityLimiter(1)
    )
    assert again.reload() == 3
    ino = two.stat().st_ino

    async def restarted() -> None:
        assert await again.look(own) is True  # rank 2 to be asked again
        s = again.status().step(10)
        assert (s.ranks_known, s.ranks_missing) == ((0,), (2,)), s
        opened = again.missing(ino)
        assert opened is not None  # waits for rank 2 to be named
        assert again.missing((Path(ram.view) / "10" / ".metadata").stat().st_ino) is None
        peer.files = {**BYTES, "10/__2_0.distcp": A}
        outcome: list[BaseException | None] = []

        async def open_two() -> None:
            try:
                await opened()
                outcome.append(None)
            except OSError as exc:
                outcome.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(open_two)
            await trio.testing.wait_all_tasks_blocked()
            assert outcome == []
            assert await again.look(own) is True  # still not answering
            assert 2 in asked.asked[-1:] and outcome == []
            asked.parts[2] = new_two  # its node is up: the new part
            assert await again.look(own) is False
        assert len(outcome) == 1 and isinstance(outcome[0], OSError)
        assert outcome[0].errno == errno.ESTALE  # the kernel looks the path up again
        s = again.status().step(10)
        assert (s.ranks_known, s.ranks_missing) == ((0, 2), ()), s
        ino2 = two.stat().st_ino
        fetch = again.missing(ino2)
        assert fetch is not None
        await fetch()

    trio.run(restarted)
    assert two.read_bytes() == A
    assert job.errors == []


def test_a_part_no_source_names_is_served_as_placed_after_the_wait(tmp_path, monkeypatch):
    """The wait for a part known from marks is bounded: with no source naming it (its
    node down for good, no copy anywhere) an open serves the placed bytes after
    UNCONFIRMED_WAIT, and the status keeps the rank as not known."""
    from tierfs.node import remote_view as rv_mod

    monkeypatch.setattr(rv_mod, "UNCONFIRMED_WAIT", 0.5)
    peer = Source("peer", BYTES, ["peer node-rank 2"])
    rv, ram, _shards, catalog, own, job = view_of(tmp_path, PARTS, [peer])

    async def first() -> None:
        await rv.look(own)
        await rv.prefetch(10)

    trio.run(first)
    again = RemoteView(
        ram.view,
        ram.incoming,
        catalog,
        job,
        Manifests({0: PARTS[0]}),
        [peer],
        job,
        trio.CapacityLimiter(1),
    )
    assert again.reload() == 3
    two = Path(ram.view) / "10" / "__2_0.distcp"

    async def restarted() -> None:
        await again.look(own)
        opened = again.missing(two.stat().st_ino)
        assert opened is not None
        await opened()  # returns after the wait: served as placed
        assert again.missing(two.stat().st_ino) is None
        assert again.status().step(10).ranks_missing == (2,)

    trio.run(restarted)
    assert two.read_bytes() == B


def test_the_parts_shown_are_what_a_new_save_replaces(tmp_path):
    """FAIL A (tenth #16 trial): the parts the view placed (rank, digest, began) are
    what this node's next save of the step records as replaced; none for another
    node count, none known only from marks."""
    rv, ram, _shards, catalog, own, job = view_of(tmp_path, PARTS, [])
    trio.run(rv.look, own)
    shown = rv.shown_parts(10, 3)
    assert {(p.rank, p.digest, p.began) for p in shown} == {
        (0, PARTS[0].digest, 0.0),
        (2, PARTS[2].digest, 0.0),
    }
    assert rv.shown_parts(10, 4) == [] and rv.shown_parts(20, 3) == []
    again = RemoteView(
        ram.view, ram.incoming, catalog, job, Manifests({}), [], job, trio.CapacityLimiter(1)
    )
    assert again.reload() == 3 and again.shown_parts(10, 3) == []


@pytest.mark.parametrize("saved_late", [False, True])
def test_an_own_part_the_other_parts_replace_is_said_once(tmp_path, monkeypatch, saved_late):
    """Tenth #16 trial NOTE F: the node whose client never saved the step again served
    its own earlier file beside the other ranks' new ones and said nothing, although
    their parts list its part as replaced. Now it is said once in replicator.errors
    unless this node seals a new part within SUSPECT_WAIT (a rank writing late)."""
    from tierfs.node import remote_view as rv_mod

    monkeypatch.setattr(rv_mod, "SUSPECT_WAIT", 0.3)
    rv, ram, shards, catalog, own, job = view_of(tmp_path, {}, [])
    listing = dataclasses.replace(PARTS[0], replaces=((1, own.manifest.digest),))
    rv.manifests.parts.update({0: listing, 2: PARTS[2]})

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            rv._fetches = nursery
            await rv.look(own)
            if saved_late:
                (Path(ram.view) / "10" / "__1_0.distcp").write_bytes(C)
                again = shards.snapshot(
                    ram.view, ShardKey(JOB, 1, 10), "10", ["10"], "generic", foreign=rv.is_remote
                )
                catalog.add(again)
            await rv.look(own)  # said once, not at every look

    trio.run(main)
    if saved_late:
        assert job.errors == []
    else:
        assert len(job.errors) == 1, job.errors
        assert "this node's own part is of an earlier save" in job.errors[0]
        assert "another part lists it as replaced" in job.errors[0]


def test_a_save_begun_while_a_look_asks_every_rank_again_suspects_every_placed_rank(tmp_path):
    """A look that asks ranks again takes their digests out of ``parts`` until they
    answer; a write beginning a new save of the step at that moment made only the ranks
    still in ``parts`` suspect, so an open of another rank's earlier file did not wait
    for its new part (found while chasing the tenth trial's G). Every placed rank is
    suspect now, and what was shown is the prior."""
    rv, _ram, _shards, catalog, own, _job = view_of(tmp_path, PARTS, [])
    trio.run(rv.look, own)

    class Slow(Manifests):
        release: trio.Event

        async def part_manifest(self, job, rank, step, *, writers=0, round_name=""):
            await self.release.wait()
            return await super().part_manifest(job, rank, step, writers=writers)

    async def main() -> None:
        slow = Slow(PARTS)
        slow.release = trio.Event()
        rv.manifests = slow
        union = rv.steps[10]
        union.recheck |= {0, 2}
        began = time.time()
        rv.new_save = lambda step: (began - 30.0, began)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rv.look, own)
            await trio.testing.wait_all_tasks_blocked()
            assert 0 not in union.parts  # being asked again
            catalog.drop(own.key, "a sealed file was opened for writing")
            assert union.suspect == {0, 2}
            assert union.prior == {0: PARTS[0].digest, 2: PARTS[2].digest}
            slow.release.set()

    trio.run(main)


def test_the_parts_whose_files_a_client_opened_are_known_by_time(tmp_path):
    """#14 trial 55 F3: a write into this node's part after its client read other ranks'
    files of the step begins another save (tierfs.node.resave); the view says which
    parts were read since a time: an open of a placed file counts, fetched or not."""
    peer = Source("peer", BYTES, ["peer node-rank 0", "peer node-rank 2"])
    rv, ram, _s, _c, own, _job = view_of(tmp_path, PARTS, [peer])

    async def main() -> None:
        await rv.look(own)
        before = time.time()
        assert rv.read_parts(10, 0.0) == [] and rv.read_parts(11, 0.0) == []
        meta = (Path(ram.view) / "10" / ".metadata").stat().st_ino
        fetch = rv.opening(meta)
        assert fetch is not None
        await fetch()
        assert rv.read_parts(10, before) == [(0, PARTS[0].digest)]
        assert rv.read_parts(10, time.time() + 1) == []  # none since then
        assert rv.missing(meta) is None  # opened again, its bytes here
        two = (Path(ram.view) / "10" / "__2_0.distcp").stat().st_ino
        rv.missing(two)
        assert rv.read_parts(10, before) == [(0, PARTS[0].digest), (2, PARTS[2].digest)]

    trio.run(main)


def test_a_corrupt_copy_is_skipped_for_the_next_one_and_said_once(tmp_path):
    peer = Source("peer", BYTES, ["peer node-rank 0", "peer node-rank 2"])
    peer.corrupt.add("peer node-rank 0")
    rv, ram, _s, _c, own, job = view_of(tmp_path, PARTS, [peer])

    async def main() -> None:
        await rv.look(own)
        ino = (Path(ram.view) / "10" / ".metadata").stat().st_ino
        await rv.missing(ino)()

    trio.run(main)
    assert (Path(ram.view) / "10" / ".metadata").read_bytes() == B
    assert peer.calls == [
        ("10/.metadata", frozenset()),
        ("10/.metadata", frozenset({"peer node-rank 0"})),
    ]
    assert len(job.errors) == 1, job.errors
    assert (
        "10/.metadata was read from peer node-rank 2 after: peer node-rank 0 served"
        in (job.errors[0])
    ), job.errors


def test_no_copy_serving_the_right_bytes_is_eio_with_every_reason_and_no_bytes_kept(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(view_module, "REPLACED_WAIT", 0.05)  # no new part comes
    peer = Source("peer", BYTES, ["peer node-rank 0"])
    peer.corrupt.add("peer node-rank 0")
    bucket = Source("gcs", {}, ["bucket round r1"])
    rv, ram, _s, _c, own, job = view_of(tmp_path, PARTS, [peer, bucket])
    meta = Path(ram.view) / "10" / ".metadata"

    async def main() -> None:
        await rv.look(own)
        with pytest.raises(OSError) as exc:
            await rv.missing(meta.stat().st_ino)()
        assert exc.value.errno == errno.EIO

    trio.run(main)
    assert not has_data(meta) and meta.stat().st_size == len(B)  # a hole again
    line = job.errors[-1]
    assert "rank 0's 10/.metadata could not be read on this node" in line, line
    assert "peer node-rank 0 served" in line and "gcs: no copy of 10/.metadata" in line, line
    assert rv.status().step(10).failed == ("10/.metadata",)
    assert rv.status().fetch_errors == 1


class NoRoom(Source):
    async def fetch_file(
        self, job, rank, step, digest, path, fd, *, skip=frozenset(), writers=0
    ) -> str:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as exc:
            raise FetchFailed(f"{path}: no room for it here") from exc


def test_a_file_that_does_not_fit_fails_the_open_with_enospc(tmp_path):
    later = Source("gcs", BYTES, ["bucket round r1"])
    rv, ram, _s, _c, own, job = view_of(tmp_path, PARTS, [NoRoom("peer", {}, []), later])
    meta = Path(ram.view) / "10" / ".metadata"

    async def main() -> None:
        await rv.look(own)
        with pytest.raises(OSError) as exc:
            await rv.missing(meta.stat().st_ino)()
        assert exc.value.errno == errno.ENOSPC

    trio.run(main)
    assert later.calls == []  # no other copy would fit either
    assert "does not fit in the RAM budget" in job.errors[-1], job.errors


class FullOnce(Source):
    """No room on the first call (the budget is full), then it serves."""

    async def fetch_file(
        self, job, rank, step, digest, path, fd, *, skip=frozenset(), writers=0
    ) -> str:
        if not self.calls:
            self.calls.append((path, skip))
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError as exc:
                raise FetchFailed(f"{path}: no room for it here") from exc
        return await super().fetch_file(job, rank, step, digest, path, fd, skip=skip)


def test_fetched_bytes_are_a_cache_dropped_to_make_room(tmp_path):
    peer = Source("peer", BYTES, ["peer node-rank 0"])
    rv, ram, _s, _c, own, job = view_of(tmp_path, PARTS, [peer])
    view = Path(ram.view) / "10"

    async def main() -> None:
        await rv.look(own)
        await rv.missing((view / "__0_0.distcp").stat().st_ino)()
        await rv.missing((view / "__2_0.distcp").stat().st_ino)()
        assert has_data(view / "__2_0.distcp")
        assert rv.missing((view / "__0_0.distcp").stat().st_ino) is None  # opened again
        rv.sources = [FullOnce("peer", BYTES, ["peer node-rank 0"])]
        await rv.missing((view / ".metadata").stat().st_ino)()
        # the least recently used fetched file went first (not the one opened again),
        # and it is fetched again on its next open
        assert not has_data(view / "__2_0.distcp")
        assert has_data(view / "__0_0.distcp")
        assert rv.missing((view / "__2_0.distcp").stat().st_ino) is not None
        assert rv.status().step(10).remote == 1
        assert await rv.drop(10) == len(B) + len(C)

    trio.run(main)
    assert not has_data(view / ".metadata") and job.errors == []


@pytest.mark.parametrize("leases", [True, False])
def test_a_fetched_file_mapped_with_its_descriptor_closed_is_never_dropped(
    tmp_path, monkeypatch, leases
):
    """#14 trial 50: a reader's map outlives its descriptor (safetensors); with
    passthrough the map is of the store's file, so a punch turned it into zeros.
    Without leases (``fs.leases-enable=0``) /proc/*/maps is read, in a worker thread."""
    from tierfs.core import in_use

    threads: list[str] = []
    if not leases:
        real = in_use.mapped_by_a_process

        def in_thread(dev: int, ino: int) -> bool:
            threads.append(threading.current_thread().name)
            return real(dev, ino)

        monkeypatch.setattr(in_use, "lease_refused", lambda fd: None)
        monkeypatch.setattr(in_use, "mapped_by_a_process", in_thread)
    peer = Source("peer", BYTES, ["peer node-rank 0"])
    rv, ram, _s, _c, own, _job = view_of(tmp_path, PARTS, [peer])
    view = Path(ram.view) / "10"

    async def main() -> None:
        await rv.look(own)
        for name in ("__0_0.distcp", "__2_0.distcp"):
            await rv.missing((view / name).stat().st_ino)()
        mapped = RawMap(view / "__2_0.distcp")
        try:
            assert await rv.drop(10) == len(C)  # rank 0's file only
            assert rv.pinned_bytes == len(B) and rv.status().pinned_bytes == len(B)
            assert mapped.read() == B
        finally:
            mapped.close()
        assert await rv.drop(10) == len(B)
        assert rv.pinned_bytes == 0

    trio.run(main)
    assert not has_data(view / "__2_0.distcp")
    main_thread = threading.main_thread().name
    assert leases or (threads and main_thread not in threads)  # never on the trio thread


def test_status_leaves_out_the_files_and_steps_the_client_deleted(tmp_path):
    """Regression (#14 trial 49 F5.2): after ``rm -rf`` of a step, ``tierfs status``
    went on listing it ("files 1 here, 1 remote"), a failed file of it included."""
    peer = Source("peer", BYTES, ["peer node-rank 0"])
    rv, ram, _s, _c, own, _job = view_of(tmp_path, PARTS, [peer])
    view = Path(ram.view) / "10"

    async def main() -> None:
        await rv.look(own)
        await rv.missing((view / "__2_0.distcp").stat().st_ino)()
        assert rv.status().step(10).local == 1 and rv.status().step(10).remote == 2
        os.rename(view / ".metadata", tmp_path / "moved-away")
        await rv._sweep()
        st = rv.status().step(10)
        assert (st.local, st.remote) == (1, 1)
        await rv._sweep()  # at most every SWEEP_EVERY seconds: nothing new yet
        for name in ("__0_0.distcp", "__2_0.distcp", "__1_0.distcp"):
            (view / name).unlink()
        rv._swept_at -= SWEEP_EVERY
        await rv._sweep()
        assert rv.status().step(10) is None

    trio.run(main)


def test_a_step_whose_own_part_was_discarded_is_still_looked_at(tmp_path):
    """Regression (#14 trial 52): node 1's own copy of a step failed verification
    within a second of the last rank's seal and was discarded; the view looked only
    at steps with an own part held, so rank 2's files never appeared on node 1
    ("ranks 0 known, 2 not yet" for good). Rank 2's part comes after the discard."""
    parts = {0: PARTS[0]}
    peer = Source("peer", BYTES, ["peer node-rank 0"])
    rv, ram, shards, catalog, own, _job = view_of(tmp_path, parts, [peer])
    view = Path(ram.view) / "10"

    async def main() -> None:
        await rv.look(own)
        assert sorted(os.listdir(view)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
        catalog.drop(own.key, "failed verification")  # the daemon discards the copy
        rv.own_part_discarded(own)
        assert [(s, sh) for s, sh, _w in rv._eligible()] == [(10, own)]
        parts[2] = PARTS[2]  # rank 2's part sealed now
        for step, shard, writers in rv._eligible():
            await rv.look(shard, step=step, writers=writers)
        assert sorted(os.listdir(view)) == WHOLE_STEP
        assert rv.status().step(10).ranks_known == (0, 2)
        # once retention passes the step (a newer own part, step 20), it is let go
        (Path(ram.view) / "20").mkdir()
        (Path(ram.view) / "20" / "__1_0.distcp").write_bytes(A)
        catalog.add(shards.snapshot(ram.view, ShardKey(JOB, 1, 20), "20", ["20"], "generic"))
        assert all(s != 10 for s, _sh, _w in rv._eligible())

    trio.run(main)


def test_a_discard_told_before_the_catalog_drops_the_copy_keeps_the_step_looked_at(tmp_path):
    """Regression (CI ci20, test_a_rank_sealed_after_a_nodes_own_copy_was_discarded_...):
    the daemon tells the view of a discarded own part before the catalog drops it; a
    look in between found the part still held, took that for "saved again" and
    forgot the discard, so rank 2's part sealed afterwards never appeared."""
    parts = {0: PARTS[0]}
    peer = Source("peer", BYTES, ["peer node-rank 0"])
    rv, ram, _shards, catalog, own, _job = view_of(tmp_path, parts, [peer])
    view = Path(ram.view) / "10"

    async def main() -> None:
        await rv.look(own)
        rv.own_part_discarded(own)  # the daemon's order: the listener first
        assert [(s, sh) for s, sh, _w in rv._eligible()] == [(10, own)]  # still held
        catalog.drop(own.key, "failed verification")
        assert [(s, sh) for s, sh, _w in rv._eligible()] == [(10, own)]
        parts[2] = PARTS[2]  # rank 2's part sealed now
        for step, shard, writers in rv._eligible():
            await rv.look(shard, step=step, writers=writers)
        assert sorted(os.listdir(view)) == WHOLE_STEP

    trio.run(main)


def test_a_replica_held_here_is_linked_not_fetched(tmp_path):
    rv, ram, shards, catalog, own, _job = view_of(tmp_path, PARTS, [])
    other = tmp_path / "node0-view"  # rank 0's view, on the same filesystem
    other.mkdir()
    (other / "10").mkdir()
    (other / "10" / ".metadata").write_bytes(B)
    (other / "10" / "__0_0.distcp").write_bytes(C)
    replica = shards.snapshot(str(other), ShardKey(JOB, 0, 10), "10", ["10"], "generic")
    catalog.add(replica)
    rv.manifests.parts[0] = replica.manifest

    trio.run(rv.look, own)
    meta = Path(ram.view) / "10" / ".metadata"
    assert meta.stat().st_ino == (Path(replica.data) / "10" / ".metadata").stat().st_ino
    assert rv.missing(meta.stat().st_ino) is None and rv.is_remote(meta.stat().st_ino)
    # a new daemon knows the replica's names in the view again: read-only, not fetched
    again = RemoteView(ram.view, ram.incoming, catalog, _job, Manifests({}), [], _job, None)
    assert again.reload() == 3
    trio.run(again.look, own)  # rank 0's node does not answer: the replica here names it
    assert again.is_remote(meta.stat().st_ino) and again.missing(meta.stat().st_ino) is None
    # a job shrunk to one node asks no node at all: the replica here names it (CI
    # regression: `tierfs wait` waited 180 s for rank 1 of a 2-node step restored alone)
    alone = RemoteView(ram.view, ram.incoming, catalog, _job, None, [], _job, None)
    assert alone.reload() == 3
    trio.run(alone.look, own)
    assert 0 in alone.status().step(10).ranks_known
    assert alone.missing(meta.stat().st_ino) is None
    assert shards.verify(replica) == []


def test_a_step_the_client_removed_gets_nothing_placed(tmp_path):
    rv, ram, *_rest, own, _job = view_of(tmp_path, PARTS, [])
    os.rename(Path(ram.view) / "10", Path(ram.view) / "gone")
    assert trio.run(rv.look, own) is False
    assert sorted(os.listdir(ram.view)) == ["gone"]
    assert rv.status().step(10) is None


def test_a_part_not_sealed_yet_is_looked_for_again(tmp_path):
    rv, ram, *_rest, own, _job = view_of(tmp_path, {0: PARTS[0]}, [])
    assert trio.run(rv.look, own) is True  # rank 2 not known yet
    s = rv.status().step(10)
    assert (s.ranks_known, s.ranks_missing) == ((0,), (2,))
    rv.manifests.parts[2] = PARTS[2]
    assert trio.run(rv.look, own) is False
    assert (Path(ram.view) / "10" / "__2_0.distcp").stat().st_size == len(B)
    assert rv.manifests.asked == [0, 2, 2]  # a known part is not asked for again


# ---------------------------------------------------------------------- the namespace


class Remote:
    def __init__(self, ino: int) -> None:
        self.ino = ino
        self.here = False
        self.lookup_waits = 0  # lookups of ino to defer first (its part confirmed)

    def looking_up(self, ino: int):
        if ino != self.ino or self.lookup_waits <= 0:
            return None

        async def confirmed() -> None:
            self.lookup_waits -= 1

        return confirmed

    def is_remote(self, ino: int) -> bool:
        return ino == self.ino

    def missing(self, ino: int):
        if ino != self.ino or self.here:
            return None

        async def fetch() -> None:
            self.here = True

        return fetch

    def opening(self, ino: int):
        return self.missing(ino)  # no chunk checksums: the whole file first

    def partial(self, ino: int) -> bool:
        return ino == self.ino and not self.here

    def taking_over(self, ino: int):
        self.ino = -1  # the node's own file from now on
        return None

    def readable(self, ino: int, offset: int, size: int):
        return None

    def expected(self, relpath: bytes):
        if relpath != b"later":
            return None

        async def placed() -> None:
            (self.view / "later").write_bytes(b"y")

        return placed


def test_the_namespace_defers_the_open_of_a_missing_file_and_refuses_writes(tmp_path):
    view = tmp_path / "view"
    view.mkdir()
    (view / "f").write_bytes(b"x" * 10)
    remote = Remote((view / "f").stat().st_ino)
    remote.view = view
    ns = Namespace(str(view), Budget(str(view), None, 0), remote=remote)
    try:
        # a missing name: ENOENT, unless another rank's file of that name is expected
        with pytest.raises(FileNotFoundError):
            ns.lookup(ROOT_ID, b"nothing")
        with pytest.raises(Deferred) as later:
            ns.lookup(ROOT_ID, b"later")
        trio.run(later.value.wait)
        assert ns.lookup(ROOT_ID, b"later")[1].st_size == 1
        # another rank's file whose part its node may have replaced: confirmed first
        remote.lookup_waits = 1
        with pytest.raises(Deferred) as later:
            ns.lookup(ROOT_ID, b"f")
        trio.run(later.value.wait)
        assert remote.lookup_waits == 0
        inode, _st = ns.lookup(ROOT_ID, b"f")
        with pytest.raises(OSError) as exc:
            ns.open(inode.nodeid, os.O_WRONLY)
        assert exc.value.errno == errno.EROFS
        with pytest.raises(OSError) as exc:
            ns.open(inode.nodeid, os.O_RDONLY | os.O_TRUNC)
        assert exc.value.errno == errno.EROFS
        for change in ({"size": 0}, {"mode": 0o777}, {"uid": 1}):
            with pytest.raises(OSError) as exc:
                ns.setattr(inode.nodeid, None, **change)
            assert exc.value.errno == errno.EROFS
        ns.setattr(inode.nodeid, None, mtime_ns=0)  # times may change
        with pytest.raises(Deferred) as later:
            ns.open(inode.nodeid, os.O_RDONLY)
        trio.run(later.value.wait)
        handle = ns.open(inode.nodeid, os.O_RDONLY)
        ns.release(handle.fh)
        # stop 32: saving that path again (O_TRUNC for writing) makes it the node's own
        handle = ns.open(inode.nodeid, os.O_WRONLY | os.O_TRUNC)
        ns.release(handle.fh)
        assert (view / "f").stat().st_size == 0 and not remote.is_remote(inode.ino)
        ns.unlink(ROOT_ID, b"f")  # removing it is allowed
    finally:
        ns.close()


def test_a_placed_file_is_read_only_before_its_name_appears(tmp_path, monkeypatch):
    # a client opening the name the moment it appears must never read the sparse zeros
    rv, ram, *_rest, own, _job = view_of(tmp_path, PARTS, [])
    real_link = os.link
    seen: list[tuple[str, bool, bool]] = []

    def link(src, dst):
        ino = os.lstat(src).st_ino
        seen.append((os.path.basename(dst), rv.is_remote(ino), rv.missing(ino) is not None))
        real_link(src, dst)

    monkeypatch.setattr("tierfs.node.remote_view.os.link", link)
    trio.run(rv.look, own)
    assert sorted(seen) == [
        (".metadata", True, True),
        ("__0_0.distcp", True, True),
        ("__2_0.distcp", True, True),
    ]
    assert os.listdir(ram.incoming) and not os.listdir(
        os.path.join(ram.incoming, os.listdir(ram.incoming)[0])
    )  # no placeholder left behind in the scratch directory


def test_a_replica_that_arrives_later_replaces_the_placeholders(tmp_path):
    # the view was placed before rank 0's replica reached this node: its files are then
    # hard links to the replica, not fetched over the network (nor held twice in RAM)
    rv, ram, shards, catalog, own, _job = view_of(tmp_path, PARTS, [])
    trio.run(rv.look, own)
    meta = Path(ram.view) / "10" / ".metadata"
    old = meta.stat().st_ino
    assert rv.missing(old) is not None
    other = tmp_path / "node0-view"
    (other / "10").mkdir(parents=True)
    (other / "10" / ".metadata").write_bytes(B)
    (other / "10" / "__0_0.distcp").write_bytes(C)
    replica = shards.snapshot(str(other), ShardKey(JOB, 0, 10), "10", ["10"], "generic")
    catalog.add(replica)
    trio.run(rv.look, own)
    assert meta.stat().st_ino == (Path(replica.data) / "10" / ".metadata").stat().st_ino
    assert meta.read_bytes() == B and rv.missing(meta.stat().st_ino) is None
    assert rv.is_remote(old)  # an open that began on the placeholder still fetches
    s = rv.status().step(10)
    assert (s.local, s.remote) == (2, 1) and rv.status().fetched_bytes == {}


def test_a_replica_saved_again_by_its_rank_replaces_the_placed_files(tmp_path):
    """Regression (#14/#16 new-user trial): rank 0 saved step 10 again (other bytes in
    ``__0_0.distcp``) while this node's own part stayed the same; its new replica
    arrived here, but the view kept the hard link to the old replica and served the
    old bytes without an error (a world-size-1 dcp.load got the old values)."""
    rv, ram, shards, catalog, own, job = view_of(tmp_path, PARTS, [])
    other = tmp_path / "node0-view"
    (other / "10").mkdir(parents=True)
    (other / "10" / ".metadata").write_bytes(B)
    (other / "10" / "__0_0.distcp").write_bytes(C)
    catalog.add(shards.snapshot(str(other), ShardKey(JOB, 0, 10), "10", ["10"], "generic"))
    trio.run(rv.look, own)
    shard0 = Path(ram.view) / "10" / "__0_0.distcp"
    assert shard0.read_bytes() == C
    # rank 0 saves step 10 again: its new replica replaces the old one here
    C2 = os.urandom(len(C))
    (other / "10" / "__0_0.distcp").unlink()
    (other / "10" / "__0_0.distcp").write_bytes(C2)
    again = shards.snapshot(str(other), ShardKey(JOB, 0, 10), "10", ["10"], "generic")
    catalog.add(again)
    rv.manifests = Manifests({**PARTS, 0: again.manifest})
    trio.run(rv.look, own)
    assert shard0.read_bytes() == C2 and rv.missing(shard0.stat().st_ino) is None
    assert (Path(ram.view) / "10" / ".metadata").read_bytes() == B  # unchanged: kept
    assert job.errors == []


def test_a_part_the_coordinator_reports_changed_is_placed_again_without_a_replica(tmp_path):
    """Regression (#14 new-user trial, 3 nodes, one replica each): rank 0 saved step 10
    again (other bytes in ``__0_0.distcp``); this node holds no replica of rank 0 and its
    own part did not change, so it served rank 0's old bytes until its daemon restarted.
    Now the coordinator's report of the digests changed in the steps shown (the
    heartbeat's :class:`tierfs.core.ports.PartWatch`) has the part asked again."""
    C2 = os.urandom(len(C))
    peer = Source("peer", dict(BYTES), ["peer node-rank 0"])
    rv, ram, _shards, _catalog, own, job = view_of(tmp_path, dict(PARTS), [peer])
    shard0 = Path(ram.view) / "10" / "__0_0.distcp"
    new0 = manifest(0, {".metadata": B, "__0_0.distcp": C2})

    async def main() -> None:
        assert rv.watched() == ("", [])  # nothing shown yet
        await rv.look(own)
        await rv.missing(shard0.stat().st_ino)()
        assert shard0.read_bytes() == C
        assert rv.watched() == ("", [(10, 0)])
        # the coordinator's first answer: nothing changed; known up to version 4 now
        rv.parts_reported("e1", 4, [10], [(10, 0, PARTS[0].digest), (10, 1, "own")])
        assert rv.watched() == ("e1", [(10, 4)]) and rv.steps[10].recheck == set()
        # rank 0 saves step 10 again; its node reports the new part to the coordinator
        rv.manifests = Manifests({**PARTS, 0: new0})
        peer.files = {**BYTES, "10/__0_0.distcp": C2}
        rv.parts_reported("e1", 5, [10], [(10, 0, new0.digest)])
        assert rv.steps[10].recheck == {0} and rv.watched() == ("e1", [(10, 5)])
        await rv.look(own)
        assert rv.steps[10].parts[0] == new0.digest
        await rv.missing(shard0.stat().st_ino)()
        assert shard0.read_bytes() == C2
        s = rv.status().step(10)
        assert s is not None and s.resaved == (0,) and s.to_json()["resaved"] == [0]
        # the same report again (or a holder's older copy) asks for nothing
        rv.parts_reported("e1", 5, [10], [(10, 0, new0.digest)])
        assert rv.steps[10].recheck == set()
        # another coordinator (restarted): a step not asked in that reply is asked
        # from its start; a lost step's changes have every placed rank asked again
        rv.parts_reported("e2", 1, [10], [(10, -1, "")])
        assert rv.steps[10].recheck == {0, 2} and rv.watched() == ("e2", [(10, 1)])

    trio.run(main)
    assert job.errors == []  # saving a step again is no error


class OpenFiles:
    """The namespace's port as far as the view uses it: ``open`` inodes have handles."""

    def __init__(self) -> None:
        self.open: set[int] = set()
        self.inodes = self

    def by_ino(self, ino: int):
        return type("Inode", (), {"handles": {1}})() if ino in self.open else None

    def notify_changed(self, path: str) -> None:
        pass


def test_an_open_file_of_a_part_saved_again_keeps_its_bytes_until_closed(tmp_path):
    """A reader holding rank 0's old ``__0_0.distcp`` open when the coordinator reports
    rank 0's new part keeps reading the old bytes (its file is not replaced under
    it); once closed, the next look replaces it and a new open reads the new bytes."""
    C2 = os.urandom(len(C))
    peer = Source("peer", dict(BYTES), ["peer node-rank 0"])
    rv, ram, _shards, _catalog, own, job = view_of(tmp_path, dict(PARTS), [peer])
    shard0 = Path(ram.view) / "10" / "__0_0.distcp"
    new0 = manifest(0, {".metadata": B, "__0_0.distcp": C2})
    files = OpenFiles()

    async def main() -> None:
        await rv.look(own)
        await rv.missing(shard0.stat().st_ino)()
        old = shard0.stat().st_ino
        with open(shard0, "rb") as reader:
            rv.attach(files)  # type: ignore[arg-type]
            files.open.add(old)
            rv.manifests = Manifests({**PARTS, 0: new0})
            peer.files = {**BYTES, "10/__0_0.distcp": C2}
            rv.parts_reported("e1", 1, [10], [(10, 0, new0.digest)])
            assert await rv.look(own) is True  # look again soon: a file was kept
            assert shard0.stat().st_ino == old and rv.steps[10].recheck == {0}
            assert reader.read() == C  # the old bytes, whole
            files.open.clear()
        await rv.look(own)
        assert rv.steps[10].recheck == set()
        assert rv.steps[10].files["10/__0_0.distcp"].digest == new0.digest  # replaced
        await rv.missing(shard0.stat().st_ino)()
        assert shard0.read_bytes() == C2

    trio.run(main)
    assert job.errors == []


def test_a_node_without_a_part_shows_the_whole_restored_step(tmp_path):
    # issue #16: node-rank 3 of a 5-node job restored step 10, written by 3 nodes, of
    # which it holds nothing: the restored step anchors its view of ranks 0..2
    ram = RamStore(str(tmp_path / "node3"))
    catalog = ShardCatalog(ShardStore(ram), 3)
    job = fake_ports.FakeJob(JobSpec(JOB, "generic", 3, 5))
    parts = {**PARTS, 1: manifest(1, {"__1_0.distcp": A})}
    files = {**BYTES, "10/__1_0.distcp": A}
    peer = Source("peer", files, ["peer node-rank 0"])
    asked = Manifests(parts)
    rv = RemoteView(
        ram.view,
        ram.incoming,
        catalog,
        job,
        asked,
        [peer],
        job,
        trio.CapacityLimiter(1),
        restored=lambda: (1000.0, 10, 3),
    )
    assert rv._eligible() == [(10, None, 3)]

    async def main() -> None:
        assert await rv.look(None, step=10, writers=3) is False
        for path, data in files.items():
            assert (Path(ram.view) / path).stat().st_size == len(data)
        await rv.prefetch(10)

    trio.run(main)
    assert sorted(asked.asked) == [0, 1, 2]  # ranks of the writers, never 3 or 4
    assert sorted(os.listdir(Path(ram.view) / "10")) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "__2_0.distcp",
    ]
    for path, data in files.items():
        assert (Path(ram.view) / path).read_bytes() == data
    s = rv.status().step(10)
    assert s is not None and (s.writers, s.own_part, s.ranks_missing) == (3, False, ())
    assert s.bytes_ready and job.errors == []


def test_a_renumbered_node_saving_the_step_again_takes_over_its_paths(tmp_path):
    """Stop 32 trial, finding 1: a job of 5 nodes shrunk to 2 (nodes renumbered) saved
    the restored step 40 again into its directory; the new rank 0's
    ``open("__0_0.distcp", "wb")`` failed with EROFS (the old rank 0's file is
    another rank's in the view) while rank 1's write went through: a torn step was
    sealed. An O_TRUNC open for writing now makes the path the node's own; and once
    the node's part says the step is written by 2 nodes, the files of old ranks 2..
    leave the view."""
    ram = RamStore(str(tmp_path / "node0"))
    shards = ShardStore(ram)
    catalog = ShardCatalog(shards, 3)
    job = fake_ports.FakeJob(JobSpec(JOB, "generic", 0, 2))
    parts = {r: manifest(r, {f"__{r}_0.distcp": bytes([r]) * 100}) for r in range(5)}
    parts[0] = manifest(0, {".metadata": B, "__0_0.distcp": C})
    rv = RemoteView(
        ram.view,
        ram.incoming,
        catalog,
        job,
        Manifests(parts),
        [],
        job,
        trio.CapacityLimiter(1),
        restored=lambda: (1000.0, 10, 5),
    )
    view = Path(ram.view) / "10"

    async def main() -> None:
        await rv.look(None, step=10, writers=5)
        assert sorted(os.listdir(view)) == [".metadata", *(f"__{r}_0.distcp" for r in range(5))]
        ino = (view / "__0_0.distcp").stat().st_ino
        assert rv.is_remote(ino) and os.getxattr(view / "__0_0.distcp", XATTR)
        assert rv.taking_over(ino) is None
        assert not rv.is_remote(ino) and not rv.partial(ino)
        with pytest.raises(OSError) as gone:
            os.getxattr(view / "__0_0.distcp", XATTR)
        assert gone.value.errno == errno.ENODATA
        # the node saves its part of step 10 again (2 writers now) and seals it
        (view / "__0_0.distcp").write_bytes(A)
        assert rv.taking_over((view / ".metadata").stat().st_ino) is None
        (view / ".metadata").write_bytes(b"new metadata")
        own = shards.snapshot(
            ram.view, ShardKey(JOB, 0, 10), "10", ["10"], "generic", foreign=rv.is_remote, nodes=2
        )
        catalog.add(own)
        assert own.manifest.nodes == 2
        assert sorted(f.path for f in own.manifest.files if f.kind == "file") == [
            "10/.metadata",
            "10/__0_0.distcp",
        ]
        await rv.look(own)

    trio.run(main)
    # rank 1's file stays (rank 1 writes the 2-node step too: its own re-save replaces
    # it); ranks 2..4 no longer write step 10
    assert sorted(os.listdir(view)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert (view / "__0_0.distcp").read_bytes() == A
    assert (view / ".metadata").read_bytes() == b"new metadata"


def test_files_a_renumbered_node_wrote_under_its_old_rank_are_that_ranks(tmp_path):
    """Regression (issue #16, third trial, finding 1): a node that wrote step 10 as rank
    2 restarts as rank 1 (RAM kept). Its old files stayed plain files of its own in
    the view: "the own copy wins" then showed them where rank 2 saved the step again,
    and a load read old values. They are rank 2's files now: read-only, out of the
    node's seal, replaced by rank 2's new part."""
    ram = RamStore(str(tmp_path / "node"))
    view = Path(ram.view) / "10"
    view.mkdir()
    (view / "__2_0.distcp").write_bytes(A)
    shards = ShardStore(ram)
    old = shards.snapshot(ram.view, ShardKey(JOB, 2, 10), "10", ["10"], "generic")
    (view / "__1_0.distcp").write_bytes(C)  # the node's restored part as rank 1
    old_ino = (view / "__2_0.distcp").stat().st_ino
    own = shards.snapshot(  # restored from rank 1's node: its files only
        ram.view, ShardKey(JOB, 1, 10), "10", ["10"], "generic", foreign=lambda i: i == old_ino
    )
    catalog = ShardCatalog(shards, 3)
    catalog.add(old)
    catalog.add(own)
    job = fake_ports.FakeJob(JobSpec(JOB, "generic", 1, 3))
    parts = {0: manifest(0, {"__0_0.distcp": B}), 2: old.manifest}
    peer = Source("peer", {"10/__0_0.distcp": B, "10/__2_0.distcp": B}, ["peer"])
    rv = remote_view(ram, catalog, job, parts, [peer])
    old_file = view / "__2_0.distcp"

    async def main() -> None:
        await rv.look(own)
        ino = old_file.stat().st_ino
        assert rv.is_remote(ino) and rv.missing(ino) is None  # rank 2's, bytes held here
        mark = json.loads(os.getxattr(old_file, XATTR))
        assert (mark["rank"], mark["source"]) == (2, "replica held here")
        assert sorted(rv.status().step(10).ranks_known) == [0, 2]
        resealed = shards.snapshot(
            ram.view, ShardKey(JOB, 1, 10), "10", ["10"], "generic", foreign=rv.is_remote
        )
        assert [f.path for f in resealed.manifest.files if f.kind == "file"] == ["10/__1_0.distcp"]
        # rank 2 saves the step again elsewhere with other bytes: its new part replaces
        # the old file in this node's view (the coordinator reports the change)
        parts[2] = manifest(2, {"__2_0.distcp": B})
        rv.parts_reported(rv.parts_epoch, 1, [10], [(10, 2, parts[2].digest)])
        await rv.look(own)
        fetch = rv.missing(old_file.stat().st_ino)
        assert fetch is not None
        await fetch()
        assert old_file.read_bytes() == B

    trio.run(main)
    assert job.errors == []


def test_a_step_saved_again_shows_the_new_files_of_the_other_ranks(tmp_path):
    # regression (a new user's trial of issue #16): the view never asked again for a
    # rank's part it had placed, so after the job saved the same step number again
    # the old placeholders stayed: a read failed with EIO (wrong crc32c from every
    # healthy copy), also after a daemon restart, and a file of a step directory the
    # client had removed and saved again never came back
    B2 = os.urandom(len(B) + 10)
    new_parts = {0: manifest(0, {".metadata": B2, "__0_0.distcp": C}), 2: PARTS[2]}
    new_bytes = {**BYTES, "10/.metadata": B2}
    peer = Source("peer", BYTES, ["peer node-rank 0"])
    rv, ram, shards, catalog, own, job = view_of(tmp_path, dict(PARTS), [peer])
    view = Path(ram.view) / "10"

    async def main() -> None:
        await rv.look(own)
        old_two = (view / "__2_0.distcp").stat().st_ino
        # the job saves step 10 again: a new own part, rank 0's .metadata is new
        (view / "__1_0.distcp").unlink()
        (view / "__1_0.distcp").write_bytes(A + b"again")
        again = shards.snapshot(
            ram.view, ShardKey(JOB, 1, 10), "10", ["10"], "generic", foreign=rv.is_remote
        )
        catalog.add(again)
        rv.manifests = Manifests(new_parts)
        peer.files = new_bytes
        await rv.look(again)
        meta = view / ".metadata"
        assert meta.stat().st_size == len(B2)
        await rv.missing(meta.stat().st_ino)()
        assert meta.read_bytes() == B2
        assert (view / "__2_0.distcp").stat().st_ino == old_two  # same bytes: kept
        # the client removes the step and saves it again: every file comes back
        for p in sorted(view.iterdir()):
            p.unlink()
        (view / "__1_0.distcp").write_bytes(A + b"third")
        third = shards.snapshot(
            ram.view, ShardKey(JOB, 1, 10), "10", ["10"], "generic", foreign=rv.is_remote
        )
        catalog.add(third)
        await rv.look(third)
        assert sorted(p.name for p in view.iterdir()) == WHOLE_STEP
        await rv.prefetch(10)
        for path, data in new_bytes.items():
            assert (Path(ram.view) / path).read_bytes() == data

    trio.run(main)
    assert job.errors == []
    # a restarted daemon knows the placed files from their marks and asks every rank
    # again: a part changed meanwhile is replaced, not served with the old checksum
    B3 = os.urandom(len(B))
    catalog2 = ShardCatalog(shards, 3)
    catalog2.add(catalog[ShardKey(JOB, 1, 10)])
    peer2 = Source("peer", {**new_bytes, "10/.metadata": B3}, ["peer node-rank 0"])
    rv2 = RemoteView(
        ram.view,
        ram.incoming,
        catalog2,
        job,
        Manifests({0: manifest(0, {".metadata": B3, "__0_0.distcp": C}), 2: PARTS[2]}),
        [peer2],
        job,
        trio.CapacityLimiter(1),
    )
    assert rv2.reload() == 3

    async def after_restart() -> None:
        await rv2.look(catalog2[ShardKey(JOB, 1, 10)])
        meta = view / ".metadata"
        await rv2.missing(meta.stat().st_ino)()
        assert meta.read_bytes() == B3

    trio.run(after_restart)
    assert job.errors == []


def test_other_bytes_in_every_copy_ask_for_the_part_again(tmp_path, monkeypatch):
    monkeypatch.setattr(view_module, "REPLACED_WAIT", 0.05)  # no new part comes
    # regression: rank 0 saved the step again after this node had read its manifest
    # (its own part unchanged): every copy served the new bytes, and the old file
    # failed with EIO for good
    B2 = os.urandom(len(B))
    peer = Source("peer", {**BYTES, "10/.metadata": B2}, ["peer node-rank 0"])
    rv, ram, _shards, _catalog, own, job = view_of(tmp_path, dict(PARTS), [peer])
    meta = Path(ram.view) / "10" / ".metadata"

    async def main() -> None:
        await rv.look(own)
        with pytest.raises(OSError) as exc:
            await rv.missing(meta.stat().st_ino)()
        assert exc.value.errno == errno.EIO
        assert rv.steps[10].recheck == {0}
        rv.manifests = Manifests(
            {0: manifest(0, {".metadata": B2, "__0_0.distcp": C}), 2: PARTS[2]}
        )
        await rv.look(own)
        await rv.missing(meta.stat().st_ino)()

    trio.run(main)
    assert meta.read_bytes() == B2
    assert "its manifest is asked for again" in job.errors[0], job.errors


class Superseded(Source):
    """A peer tier whose rank's own node holds a newer part with other bytes."""

    async def fetch_file(
        self, job, rank, step, digest, path, fd, *, skip=frozenset(), writers=0
    ) -> str:
        self.calls.append((path, skip))
        raise FetchFailed(f"{path}: its node holds a newer part of the step", superseded=True)


def test_a_file_its_ranks_node_saved_again_is_never_read_from_a_later_source(tmp_path, monkeypatch):
    """Regression (#14 trial 60 M1a): after two saves in a row the rank's own node held a
    newer part; a later source (another copy, the bucket's round of the earlier save)
    served the earlier bytes, checked against the earlier manifest. A fetch the rank's
    node ended as superseded asks no further source: the part is asked for again."""
    monkeypatch.setattr(view_module, "REPLACED_WAIT", 0.05)  # no new part comes here
    peer = Superseded("peer", BYTES, ["peer node-rank 0"])
    bucket = Source("bucket", BYTES, ["gcs round-1"])
    rv, ram, _shards, _catalog, own, job = view_of(tmp_path, dict(PARTS), [peer, bucket])
    meta = Path(ram.view) / "10" / ".metadata"

    async def main() -> None:
        await rv.look(own)
        with pytest.raises(OSError) as exc:
            await rv.missing(meta.stat().st_ino)()
        assert exc.value.errno == errno.EIO
        assert rv.steps[10].recheck == {0}  # its part is asked for again

    trio.run(main)
    assert peer.calls and bucket.calls == []
    assert not has_data(meta)
    assert len(job.errors) == 1 and "newer part" in job.errors[0], job.errors


async def rank_0_saved_again(rv: RemoteView, own: Shard, meta: bytes) -> None:
    """Rank 0 saves step 10 of ``PARTS`` again with ``.metadata`` holding ``meta``: its
    node names the new part, the coordinator reports it, and the view looks again."""
    new0 = manifest(0, {".metadata": meta, "__0_0.distcp": C})
    rv.manifests = Manifests({**PARTS, 0: new0})
    rv.parts_reported("e1", 1, [10], [(10, 0, new0.digest)])
    await rv.look(own)


def test_a_file_saved_again_is_replaced_in_one_step_and_its_name_never_goes_missing(tmp_path):
    """Regression (#14 trial 60 M1b): rank 0 saved the step again; the look removed
    the old placed file, and placed the new one in a second step. A load's lookup in
    between was answered ENOENT (``FileNotFoundError`` on ``__1_0.distcp``). The new
    file is now renamed over the old name: a lookup finds the old inode or the new."""
    B2 = os.urandom(len(B))
    peer = Source("peer", {**BYTES, "10/.metadata": B2}, ["peer node-rank 0"])
    rv, ram, _shards, _catalog, own, job = view_of(tmp_path, dict(PARTS), [peer])
    meta = Path(ram.view) / "10" / ".metadata"
    seen: list[bool] = []
    place = rv._place

    def placing(*args: object) -> list[str]:
        seen.append(meta.exists())  # between the removal of stale files and placing
        return place(*args)  # type: ignore[arg-type]

    async def main() -> None:
        await rv.look(own)
        old = meta.stat().st_ino
        rv._place = placing  # type: ignore[method-assign]
        await rank_0_saved_again(rv, own, B2)
        assert seen == [True]
        assert meta.stat().st_ino != old and rv.steps[10].replacing == {}
        # an open of the old inode (a name looked up before) is told to look it up
        # again, never served the old placeholder's holes
        assert rv.is_remote(old)
        stale = rv.missing(old)
        assert stale is not None
        with pytest.raises(OSError) as err:
            await stale()
        assert err.value.errno == errno.ESTALE
        await rv.missing(meta.stat().st_ino)()

    trio.run(main)
    assert meta.read_bytes() == B2 and job.errors == []


async def looks(rv: RemoteView, own: Shard) -> None:
    """The view's loop as far as these tests need it: a look whenever it is woken."""
    while True:
        await rv._wake.wait()
        rv._wake = trio.Event()
        await rv.look(own)


def recent(parts: dict[int, Manifest]) -> dict[int, Manifest]:
    """``parts`` sealed just now (PARTS were made at import: a worker may run a test a
    minute later, past the window in which an open asks a part's node)."""
    return {r: dataclasses.replace(m, created=time.time()) for r, m in parts.items()}


def test_a_file_whose_replacement_failed_is_removed_never_left_with_its_old_bytes(tmp_path):
    """Regression (#14 trial 62, silent wrong values): three saves of a step in a row;
    placing rank 2's new file failed (``[Errno 2]``: the replica it was to link was
    replaced meanwhile), and the old file stayed in the view, no longer tracked, its
    first-save bytes served to a load. Now it is removed after that look (a lookup
    until the next look finds nothing: never the old bytes) and placed again then."""
    B2 = os.urandom(len(B))
    peer = Source("peer", {**BYTES, "10/.metadata": B2}, ["peer node-rank 0"])
    rv, ram, _shards, _catalog, own, _job = view_of(tmp_path, dict(PARTS), [peer])
    meta = Path(ram.view) / "10" / ".metadata"
    place_file = rv._place_file
    fail = [True]

    def failing(*args: object) -> object:
        if fail and args[4] == "10/.metadata":
            fail.clear()
            raise FileNotFoundError(errno.ENOENT, "the replica was replaced meanwhile")
        return place_file(*args)  # type: ignore[arg-type]

    async def main() -> None:
        await rv.look(own)
        old = meta.stat().st_ino
        rv._place_file = failing  # type: ignore[method-assign]
        await rank_0_saved_again(rv, own, B2)
        assert not meta.exists() and rv.steps[10].replacing == {}
        stale = rv.missing(old)  # an open of the old inode: looked up again
        assert stale is not None
        with pytest.raises(OSError) as err:
            await stale()
        assert err.value.errno == errno.ESTALE
        rv.steps[10].recheck.add(0)
        await rv.look(own)  # placed at the next look
        await rv.missing(meta.stat().st_ino)()

    trio.run(main)
    assert meta.read_bytes() == B2


class Owners(Manifests):
    """Manifests whose ranks' nodes also say what part they hold now (``owner_part``):
    ``saving`` answers :data:`PART_SAVING` that many times first, then ``after`` (rank
    -> manifest) becomes the part held."""

    def __init__(self, parts: dict[int, Manifest], saving: int = 0, after=None) -> None:
        super().__init__(parts)
        self.saving = saving
        self.after = after or {}
        self.owner_asked: list[int] = []

    async def owner_part(self, job: str, rank: int, step: int) -> str | None:
        self.owner_asked.append(rank)
        if self.saving > 0:
            self.saving -= 1
            return PART_SAVING
        self.parts.update(self.after)
        part = self.parts.get(rank)
        return part.digest if part is not None else None


def test_an_open_right_after_a_seal_asks_the_ranks_node_and_waits_for_its_new_save(tmp_path):
    """Regression (#14 trial 60 M1a): ``dcp.save`` twice in a row, then barrier and load.
    A node showing rank 0's part of the first save (sealed a moment before) served its
    bytes until it learned of the second save 0.1-0.2 s later: the load returned the
    first save's values. An open of a file of a part sealed less than RESAVE_GAP ago now
    asks the rank's node what it holds: while it writes the step again the open waits,
    and a newer part there has the file replaced first (ESTALE: the kernel looks the
    path up again and opens the new file)."""
    B2 = os.urandom(len(B))
    peer = Source("peer", dict(BYTES), ["peer node-rank 0"])
    rv, ram, _shards, _catalog, own, job = view_of(tmp_path, recent(PARTS), [peer])
    meta = Path(ram.view) / "10" / ".metadata"
    new0 = manifest(0, {".metadata": B2, "__0_0.distcp": C})
    owners = Owners(recent(PARTS), saving=3, after={0: new0})
    rv.manifests = owners

    async def main() -> None:
        await rv.look(own)
        old = meta.stat().st_ino
        # the peer holds the first save's bytes (a replica of the earlier part)
        opened = rv.missing(old)
        assert opened is not None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(looks, rv, own)
            with pytest.raises(OSError) as err, trio.fail_after(view_module.REPLACED_WAIT):
                await opened()
            assert err.value.errno == errno.ESTALE  # replaced by rank 0's new part
            nursery.cancel_scope.cancel()
        # 3 answers "saving", the new part, and the new part again once shown here
        assert owners.owner_asked == [0] * 5
        peer.files = {**BYTES, "10/.metadata": B2}  # the new part's replica
        new = meta.stat().st_ino
        assert new != old
        fetch = rv.missing(new)  # the open again: confirmed just now, fetched
        assert fetch is not None
        await fetch()
        assert owners.owner_asked == [0] * 5

    trio.run(main)
    assert meta.read_bytes() == B2 and job.errors == []


class OwnerSequence(Owners):
    """Owners whose rank-0 node names the parts in ``names`` in turn (each becomes the
    part held as it is named; None: "being saved again"), then the last one."""

    def __init__(self, parts: dict[int, Manifest], names: list[Manifest | None]) -> None:
        super().__init__(parts)
        self.names = names

    async def owner_part(self, job: str, rank: int, step: int) -> str | None:
        self.owner_asked.append(rank)
        m = self.names.pop(0) if len(self.names) > 1 else self.names[0]
        if m is None:
            return PART_SAVING
        self.parts[rank] = m
        return m.digest


def saves_in_a_row(tmp_path: Path, names: list[int | None]):
    """A view of ``PARTS`` sealed just now whose rank-0 node then names, in turn, the
    parts of saves ``names`` (1: the one shown; 2 and 3: two saves of the step again,
    whose ``.metadata`` holds new bytes). Returns the view, its own part, the job, the
    peer source, the path of ``.metadata`` in the view, the owners and the three
    saves' ``.metadata`` bytes."""
    saved = [B, os.urandom(len(B)), os.urandom(len(B))]
    parts = [manifest(0, {".metadata": b, "__0_0.distcp": C}) for b in saved]
    peer = Source("peer", dict(BYTES), ["peer node-rank 0"])
    rv, ram, _shards, _catalog, own, job = view_of(tmp_path, recent(PARTS), [peer])
    owners = OwnerSequence(recent(PARTS), [None if n is None else parts[n - 1] for n in names])
    rv.manifests = owners
    return rv, own, job, peer, Path(ram.view) / "10" / ".metadata", owners, parts, saved


async def estale_of_the_first_open(rv: RemoteView, own: Shard, meta: Path) -> None:
    """The look, then the open of ``meta`` with looks in the background: ESTALE."""
    await rv.look(own)
    opened = rv.missing(meta.stat().st_ino)
    assert opened is not None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(looks, rv, own)
        with pytest.raises(OSError) as err, trio.fail_after(view_module.REPLACED_WAIT):
            await opened()
        assert err.value.errno == errno.ESTALE
        nursery.cancel_scope.cancel()


def test_a_step_saved_three_times_in_a_row_gets_one_estale_for_the_last_save(tmp_path):
    """#14 trial 61: three ``dcp.save`` in a row; the open's question named the second
    save's part, the file was replaced by it, then by the third: the kernel retries an
    open once after ESTALE, and the second ESTALE reached the application. The node is
    now asked again until it names the part the view shows: one ESTALE, the last save."""
    rv, own, job, peer, meta, owners, parts, saved = saves_in_a_row(tmp_path, [2, 3, 3])

    async def main() -> None:
        await estale_of_the_first_open(rv, own, meta)
        assert rv.steps[10].parts[0] == parts[2].digest and owners.owner_asked == [0] * 3
        peer.files = {**BYTES, "10/.metadata": saved[2]}
        fetch = rv.missing(meta.stat().st_ino)  # the kernel's one retry: served
        assert fetch is not None
        await fetch()

    trio.run(main)
    assert meta.read_bytes() == saved[2] and job.errors == []


def test_the_lookup_after_an_open_s_estale_waits_for_the_part_the_ranks_node_names(tmp_path):
    """Regression (#14, stop 52 CI): a step saved again right after its load, then
    loaded; the open of ``.metadata`` got ESTALE (its file replaced by rank 0's new
    part), and the kernel's one retry got ESTALE again: ``metadata is None; ... [Errno
    116] Stale file handle``. The lookup the kernel makes after an ESTALE now asks the
    rank's node first (its confirmation of a moment ago expired, and it names yet
    another part): it waits until the view shows that part, the lookup run again
    finds it, and its open is served without another question or ESTALE."""
    rv, own, job, peer, meta, owners, parts, saved = saves_in_a_row(tmp_path, [2, 2, 3, 3])

    async def main() -> None:
        await estale_of_the_first_open(rv, own, meta)
        assert rv.steps[10].parts[0] == parts[1].digest
        looked_up = rv.looking_up(meta.stat().st_ino)  # the kernel's retry: it asks
        assert looked_up is not None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(looks, rv, own)
            with trio.fail_after(view_module.REPLACED_WAIT):
                await looked_up()  # never raises
            nursery.cancel_scope.cancel()
        assert rv.steps[10].parts[0] == parts[2].digest and owners.owner_asked == [0] * 4
        assert rv.looking_up(meta.stat().st_ino) is None  # the lookup run again
        peer.files = {**BYTES, "10/.metadata": saved[2]}
        fetch = rv.missing(meta.stat().st_ino)  # its open: confirmed just now, fetched
        assert fetch is not None
        await fetch()
        assert owners.owner_asked == [0] * 4

    trio.run(main)
    assert meta.read_bytes() == saved[2] and job.errors == []


def test_the_kernels_retry_after_an_estale_waits_while_the_ranks_node_seals_again(tmp_path):
    """Regression (#14 trial 64 HIGH-1, ESTALE with no line, 1 step in 840): three saves
    of a step in a row, then a load; the open of ``.metadata`` was answered ESTALE
    (replaced by the second save's file), and the kernel's retry looked the name up
    while rank 0's node had not sealed the third save yet ("being saved again"): the
    lookup was answered at once with the second save's file, its open waited, the file
    was replaced again, and the second ESTALE reached the application. The lookup
    that follows an open's ESTALE now waits like the open."""
    rv, own, job, peer, meta, owners, parts, saved = saves_in_a_row(
        tmp_path, [2, 2, None, None, 3, 3]
    )

    async def main() -> None:
        await estale_of_the_first_open(rv, own, meta)
        assert rv.steps[10].parts[0] == parts[1].digest
        async with trio.open_nursery() as nursery:
            nursery.start_soon(looks, rv, own)
            retry = rv.looking_up(meta.stat().st_ino)  # the kernel's retry
            assert retry is not None
            with trio.fail_after(view_module.REPLACED_WAIT):
                await retry()
            nursery.cancel_scope.cancel()
        assert rv.steps[10].parts[0] == parts[2].digest and owners.owner_asked == [0] * 6
        assert rv.looking_up(meta.stat().st_ino) is None  # the session's run again
        peer.files = {**BYTES, "10/.metadata": saved[2]}
        fetch = rv.missing(meta.stat().st_ino)  # its open: confirmed, fetched
        assert fetch is not None
        await fetch()
        assert owners.owner_asked == [0] * 6

    trio.run(main)
    assert meta.read_bytes() == saved[2] and job.errors == []


def test_a_replica_of_an_earlier_save_held_here_is_not_placed_for_the_part_the_node_names(
    tmp_path,
):
    """Regression (#14 trial 65 MEDIUM-1, EIO after 10 s, 1 step in 1,520): three saves
    of a step in a row; the replica of rank 0's second save landed here after the
    third's and replaced it. An open's question named the third save, but every look
    placed the replica held here again (it was trusted before the node was asked), and
    the open failed with EIO after 10 s. The part an open's question names is now
    wanted: a held replica of other bytes is passed over and the node asked."""
    saved = [B, os.urandom(len(B)), os.urandom(len(B))]
    parts = [manifest(0, {".metadata": b, "__0_0.distcp": C}) for b in saved]
    peer = Source("peer", dict(BYTES), ["peer node-rank 0"])
    rv, ram, shards, catalog, own, job = view_of(tmp_path, recent({2: PARTS[2]}), [peer])
    holder = tmp_path / "replicas"  # the second save's replica, on the same filesystem
    (holder / "10").mkdir(parents=True)
    (holder / "10" / ".metadata").write_bytes(saved[1])
    (holder / "10" / "__0_0.distcp").write_bytes(C)
    second = shards.snapshot(str(holder), ShardKey(JOB, 0, 10), "10", ["10"], "generic")
    catalog.add(second)
    owners = OwnerSequence(recent({2: PARTS[2]}), [parts[2]])  # the node: its third save
    rv.manifests = owners
    meta = Path(ram.view) / "10" / ".metadata"

    async def main() -> None:
        await rv.look(own)
        assert rv.steps[10].parts[0] == second.manifest.digest  # linked from the replica
        opened = rv.missing(meta.stat().st_ino)
        assert opened is not None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(looks, rv, own)
            with pytest.raises(OSError) as err, trio.fail_after(view_module.REPLACED_WAIT):
                await opened()
            assert err.value.errno == errno.ESTALE  # replaced by the third save's file
            nursery.cancel_scope.cancel()
        assert rv.steps[10].parts[0] == parts[2].digest
        peer.files = {**BYTES, "10/.metadata": saved[2]}
        fetch = rv.missing(meta.stat().st_ino)
        assert fetch is not None
        await fetch()

    trio.run(main)
    assert meta.read_bytes() == saved[2] and job.errors == []


class SlowOwners(Owners):
    """Owners whose answer takes 0.1 s (a question on the wire)."""

    async def owner_part(self, job: str, rank: int, step: int) -> str | None:
        await trio.sleep(0.1)
        return await super().owner_part(job, rank, step)


def test_opens_of_a_ranks_files_at_once_share_the_question_to_its_node(tmp_path):
    """Six opens of rank 0's files at once (several ranks per node reading
    ``.metadata``, a reader's threads) ask rank 0's node twice, not six times: the
    first open's question, then one shared by the opens that came while it was under
    way (begun after each of them)."""
    peer = Source("peer", dict(BYTES), ["peer node-rank 0"])
    rv, ram, _shards, _catalog, own, job = view_of(tmp_path, recent(PARTS), [peer])
    owners = SlowOwners(recent(PARTS))
    rv.manifests = owners
    view = Path(ram.view) / "10"

    async def main() -> None:
        await rv.look(own)
        inos = [(view / n).stat().st_ino for n in (".metadata", "__0_0.distcp")] * 3
        async with trio.open_nursery() as nursery:
            for ino in inos:
                opened = rv.missing(ino)
                assert opened is not None
                nursery.start_soon(opened)  # all six begin before the first answer
        assert owners.owner_asked == [0, 0]
        fetch = rv.missing(inos[0])  # the open run again: confirmed just now, fetched
        assert fetch is not None
        await fetch()
        assert owners.owner_asked == [0, 0]

    trio.run(main)
    assert (view / ".metadata").read_bytes() == B and job.errors == []


def test_every_lookup_asks_so_a_save_begun_after_an_earlier_lookup_is_never_missed(tmp_path):
    """Regression (#14 trial 63 HIGH, silent wrong values): DCP's check for
    ``.metadata`` at a save's start looked the name up and rank 0's node confirmed the
    part shown; rank 0 then saved the step again, and the load's opens within the next
    second trusted that confirmation: node 1 read the earlier save's bytes from its
    replica (step 202), or node 2's fetch was refused (EIO). Every lookup of such a
    name now asks, and an open trusts only a confirmation of its own file."""
    rv, own, _job, peer, meta, owners, parts, saved = saves_in_a_row(tmp_path, [1, 2, 2])

    async def main() -> None:
        await rv.look(own)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(looks, rv, own)
            check = rv.looking_up(meta.stat().st_ino)  # the save's check, at its start
            assert check is not None
            await check()
            assert rv.looking_up(meta.stat().st_ino) is None  # the session's run again
            assert owners.owner_asked == [0]
            # rank 0 saved the step again; the load opens .metadata right after
            load = rv.looking_up(meta.stat().st_ino)
            assert load is not None
            with trio.fail_after(view_module.REPLACED_WAIT):
                await load()
            nursery.cancel_scope.cancel()
        assert rv.steps[10].parts[0] == parts[1].digest and owners.owner_asked == [0] * 3
        peer.files = {**BYTES, "10/.metadata": saved[1]}
        fetch = rv.missing(meta.stat().st_ino)  # the open of the file found: confirmed
        assert fetch is not None
        await fetch()
        assert owners.owner_asked == [0] * 3

    trio.run(main)
    assert meta.read_bytes() == saved[1]


def test_a_lookup_told_the_node_is_saving_again_leaves_its_file_unconfirmed(tmp_path):
    """An answer is trusted only until the next question: a lookup confirmed the file
    (DCP's check at a save's start), then the load's lookup was told "being saved
    again" and answered at once; the open after it must ask (and wait), never trust
    the earlier confirmation."""
    rv, ram, _shards, _catalog, own, _job = view_of(tmp_path, recent(PARTS), [])
    owners = Owners(recent(PARTS))
    rv.manifests = owners
    meta = Path(ram.view) / "10" / ".metadata"

    async def main() -> None:
        await rv.look(own)
        ino = meta.stat().st_ino
        await rv.looking_up(ino)()  # confirmed
        rv.looking_up(ino)  # the session's run again
        owners.saving = 1
        await rv.looking_up(ino)()  # "being saved again": answered at once
        assert owners.owner_asked == [0, 0]
        rv.looking_up(ino)
        opened = rv.missing(ino)
        assert opened is not None
        await opened()  # asks: saved meanwhile (the part shown), served
        assert owners.owner_asked == [0, 0, 0]

    trio.run(main)


def test_a_lookup_is_not_held_up_by_a_node_still_saving_and_the_open_after_it_waits(
    tmp_path, monkeypatch
):
    """Trial 63 MEDIUM-2: DCP's check for ``.metadata`` at a save's start (a lookup)
    waited while rank 0's node wrote the step again, which slowed every save. A lookup
    now asks once and is answered; the open after it waits for that node, until one
    deadline counted from the lookup's question: EIO then, said once in
    ``replicator.errors``. A later open asks afresh."""
    monkeypatch.setattr(view_module, "CONFIRM_WAIT", 0.2)
    peer = Source("peer", dict(BYTES), ["peer node-rank 0"])
    rv, ram, _shards, _catalog, own, job = view_of(tmp_path, recent(PARTS), [peer])
    meta = Path(ram.view) / "10" / ".metadata"
    owners = Owners(recent(PARTS), saving=10**6)
    rv.manifests = owners

    async def main() -> None:
        await rv.look(own)
        ino = meta.stat().st_ino
        looked_up = rv.looking_up(ino)
        assert looked_up is not None
        await looked_up()
        assert owners.owner_asked == [0] and rv.looking_up(ino) is None  # answered
        opened = rv.missing(ino)
        assert opened is not None
        with pytest.raises(OSError) as err, trio.fail_after(5):
            await opened()
        assert err.value.errno == errno.EIO and len(owners.owner_asked) > 2
        assert len(job.errors) == 1 and "saving the step again" in job.errors[0]
        owners.saving = 0  # saved: a later open is served
        opened = rv.missing(ino)
        assert opened is not None
        await opened()
        assert rv.missing(ino) is not None  # confirmed: on to the fetch

    trio.run(main)


def test_the_name_of_a_file_of_a_part_sealed_moments_ago_is_not_cached_by_the_kernel(tmp_path):
    """An open whose name the kernel cached reaches the inode it found then: a file the
    view replaced since answers ESTALE, and the kernel retries only once. The entry of
    another rank's file whose part was sealed less than CONFIRM_WINDOW s ago is
    answered with no entry timeout, so each open looks the name up (and the lookup
    resolves it to the part its node holds); an older part's, or the node's own
    file's, keeps the mount's timeout."""
    from tierfs.fuse import protocol as P
    from tierfs.fuse.operations import Operations

    rv, ram, _shards, _catalog, own, _job = view_of(tmp_path, recent(PARTS), [])
    rv.manifests = Owners(recent(PARTS))
    view = Path(ram.view)
    trio.run(rv.look, own)
    meta, mine = view / "10" / ".metadata", view / "10" / "__1_0.distcp"
    assert rv.uncached(meta.stat().st_ino) and not rv.uncached(mine.stat().st_ino)
    ns = Namespace(str(view), Budget(str(view), None, 0), remote=rv)
    ops = Operations(ns)
    ns.entry_timeout = 10.0

    def entry_valid(path: Path) -> float:
        _nodeid, _gen, valid, _attr, nsec, _ = P.ENTRY_OUT_HEAD.unpack_from(
            ops._entry(1, path.stat())
        )
        return valid + nsec / 1e9

    try:
        assert entry_valid(meta) == 0.0 and entry_valid(mine) == 10.0
        rv.steps[10].sealed[0] = time.time() - view_module.CONFIRM_WINDOW
        assert not rv.uncached(meta.stat().st_ino) and entry_valid(meta) == 10.0
    finally:
        ns.close()


def test_a_part_sealed_long_before_is_served_without_asking_its_node(tmp_path):
    """The question is for parts sealed less than RESAVE_GAP before the open (two saves
    of a step closer than that count as one save elsewhere); an older part's files are
    served at once, and a node that cannot answer (down) does not hold them up."""
    old = {
        r: dataclasses.replace(m, created=time.time() - 60, sealed=time.time() - 60)
        for r, m in PARTS.items()
    }
    peer = Source("peer", dict(BYTES), ["peer node-rank 0"])
    rv, ram, _shards, _catalog, own, _job = view_of(tmp_path, dict(old), [peer])
    owners = Owners(dict(old))
    rv.manifests = owners
    meta = Path(ram.view) / "10" / ".metadata"

    async def main() -> None:
        await rv.look(own)
        await rv.missing(meta.stat().st_ino)()
        assert owners.owner_asked == []
        # a recent part whose node cannot say: served as placed
        rv.steps[10].sealed[2] = time.time()
        two = Path(ram.view) / "10" / "__2_0.distcp"
        owners.parts.pop(2)
        opened = rv.missing(two.stat().st_ino)
        assert opened is not None
        await opened()
        assert owners.owner_asked == [2]
        fetch = rv.missing(two.stat().st_ino)
        assert fetch is not None
        await fetch()

    trio.run(main)
    assert meta.read_bytes() == B


def test_a_reader_of_a_file_saved_again_meanwhile_waits_for_the_new_part(tmp_path):
    """Regression (#14 trial 59 M1): ``dcp.save`` twice in a row into one directory, then
    a load; another node opened ``.metadata`` 9 ms before it learned of rank 0's new
    part, every copy held the new bytes, and the open failed with EIO (12 of 13 steps).
    The reader now waits for the look that asks that rank again; the file replaced, it
    gets ESTALE (the kernel opens the new file), and no line is written."""
    B2 = os.urandom(len(B))
    peer = Source("peer", {**BYTES, "10/.metadata": B2}, ["peer node-rank 0"])
    rv, ram, _shards, _catalog, own, job = view_of(tmp_path, dict(PARTS), [peer])
    meta = Path(ram.view) / "10" / ".metadata"

    async def main() -> None:
        await rv.look(own)
        ino = meta.stat().st_ino
        rv.manifests = Manifests(
            {0: manifest(0, {".metadata": B2, "__0_0.distcp": C}), 2: PARTS[2]}
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(looks, rv, own)
            with pytest.raises(OSError) as exc, trio.fail_after(view_module.REPLACED_WAIT):
                await rv.missing(ino)()
            assert exc.value.errno == errno.ESTALE
            nursery.cancel_scope.cancel()
        await rv.missing(meta.stat().st_ino)()  # the kernel's lookup again: the new file

    trio.run(main)
    assert meta.read_bytes() == B2
    assert job.errors == []


# ---------------------------------------------------------------------- a source that checks


class Checked(Source):
    """A source that checks the bytes against ``expect`` as they are written (as the peer
    tier does): it refuses a copy whose file is not ``expect`` with ``other_bytes``."""

    checks_written = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.expects: list[tuple[int, int] | None] = []
        self.urgent: list[tuple[str, bool]] = []
        self.gates: dict[str, trio.Event] = {}
        self.holds: dict[str, Callable[[], bool]] = {}
        self.pauses: dict[str, Callable[[], bool]] = {}

    async def fetch_file(
        self, job, rank, step, digest, path, fd, *, skip=frozenset(), writers=0, expect=None
    ) -> str:
        self.expects.append(expect)
        self.urgent.append((path, fetch_urgent.get()()))
        self.holds[path] = fetch_hold.get()
        self.pauses[path] = fetch_pause.get()
        gate = self.gates.get(path)
        if gate is not None:
            await gate.wait()
        data = self.files.get(path)
        if data is not None and expect != (len(data), google_crc32c.value(data)):
            raise FetchFailed(f"{self.name}: other bytes of {path}", other_bytes=True)
        return await super().fetch_file(job, rank, step, digest, path, fd, skip=skip)


def test_a_source_that_checks_as_it_writes_is_given_the_manifest_entry_and_not_read_back(
    tmp_path,
):
    peer = Checked("peer", BYTES, ["peer node-rank 0"])
    rv, ram, _s, _c, own, job = view_of(tmp_path, PARTS, [peer])
    meta = Path(ram.view) / "10" / ".metadata"

    async def main() -> None:
        await rv.look(own)
        # the file-work limiter is held: a read-back of the fetched bytes would wait on it
        async with rv.io_limiter:
            with trio.fail_after(10):
                await rv.missing(meta.stat().st_ino)()

    trio.run(main)
    assert meta.read_bytes() == B and job.errors == []
    assert peer.expects == [(len(B), google_crc32c.value(B))]
    assert rv.status().fetched_bytes == {"peer": len(B)}


def test_other_bytes_said_by_a_checking_source_ask_for_the_part_again(tmp_path, monkeypatch):
    monkeypatch.setattr(view_module, "REPLACED_WAIT", 0.05)  # no new part comes
    B2 = os.urandom(len(B))
    peer = Checked("peer", {**BYTES, "10/.metadata": B2}, ["peer node-rank 0"])
    rv, ram, _s, _c, own, job = view_of(tmp_path, dict(PARTS), [peer])
    meta = Path(ram.view) / "10" / ".metadata"

    async def main() -> None:
        await rv.look(own)
        with pytest.raises(OSError) as exc:
            await rv.missing(meta.stat().st_ino)()
        assert exc.value.errno == errno.EIO
        assert rv.steps[10].recheck == {0}

    trio.run(main)
    assert not has_data(meta)
    assert "its manifest is asked for again" in job.errors[0], job.errors


async def running(rv: RemoteView, nursery: trio.Nursery) -> None:
    """Start ``rv``'s loop and wait until step 10's other ranks' files are placed."""
    nursery.start_soon(rv.run)
    with trio.fail_after(10):
        while rv._fetches is None or not rv.steps.get(10) or not rv.steps[10].files:
            await trio.sleep(0.01)


def test_a_readers_open_is_urgent_and_the_prefetch_starts_nothing_while_it_waits(tmp_path):
    peer = Checked("peer", BYTES, ["peer node-rank 0"])
    rv, ram, _s, _c, _own, job = view_of(tmp_path, PARTS, [peer])
    view = Path(ram.view) / "10"
    peer.gates["10/.metadata"] = trio.Event()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await running(rv, nursery)
            opened = trio.Event()

            async def reader() -> None:
                await rv.missing((view / ".metadata").stat().st_ino)()
                opened.set()

            nursery.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(rv.prefetch, 10)
            await trio.testing.wait_all_tasks_blocked()
            # the reader's fetch runs urgent; the prefetch starts nothing while it waits
            assert peer.urgent == [("10/.metadata", True)]
            peer.gates["10/.metadata"].set()
            with trio.fail_after(10):
                await opened.wait()
                while not rv.status().step(10).bytes_ready:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)
    # the rest in the background (read-ahead or prefetch, whichever came first)
    assert peer.urgent[0] == ("10/.metadata", True)
    assert sorted(peer.urgent[1:]) == [("10/__0_0.distcp", False), ("10/__2_0.distcp", False)]
    assert (view / "__0_0.distcp").read_bytes() == C and job.errors == []


def test_after_a_readers_open_the_next_file_in_path_order_is_read_ahead(tmp_path):
    peer = Checked("peer", BYTES, ["peer node-rank 0"])
    rv, ram, _s, _c, _own, job = view_of(tmp_path, PARTS, [peer])
    view = Path(ram.view) / "10"

    def state(name: str) -> str:
        return rv.steps[10].files[f"10/{name}"].state

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await running(rv, nursery)
            await rv.missing((view / ".metadata").stat().st_ino)()
            with trio.fail_after(10):
                while state("__0_0.distcp") != "local":
                    await trio.sleep(0.01)
            await trio.testing.wait_all_tasks_blocked()
            assert state("__2_0.distcp") == "remote"  # one file ahead, no more
            # its open finds the bytes here, and reads the next one ahead
            assert rv.missing((view / "__0_0.distcp").stat().st_ino) is None
            with trio.fail_after(10):
                while state("__2_0.distcp") != "local":
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert peer.urgent == [
        ("10/.metadata", True),
        ("10/__0_0.distcp", False),
        ("10/__2_0.distcp", False),
    ]
    assert (view / "__2_0.distcp").read_bytes() == B and job.errors == []


def test_a_prefetch_under_way_is_held_while_a_reader_waits_for_another_file(tmp_path):
    peer = Checked("peer", BYTES, ["peer node-rank 0"])
    rv, ram, _s, _c, _own, job = view_of(tmp_path, PARTS, [peer])
    view = Path(ram.view) / "10"
    peer.gates["10/__2_0.distcp"] = trio.Event()  # the prefetch's file
    peer.gates["10/.metadata"] = trio.Event()  # the reader's

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await running(rv, nursery)
            prefetch = rv.steps[10].files["10/__2_0.distcp"]
            nursery.start_soon(rv.fetch, prefetch)
            await trio.testing.wait_all_tasks_blocked()
            hold = peer.holds["10/__2_0.distcp"]
            assert hold() is False  # nobody waits: it goes on
            nursery.start_soon(rv.missing((view / ".metadata").stat().st_ino))
            await trio.testing.wait_all_tasks_blocked()
            assert hold() is True  # a reader waits for .metadata: the prefetch pauses
            assert peer.holds["10/.metadata"]() is False  # the reader's own never does
            peer.gates["10/.metadata"].set()
            with trio.fail_after(10):
                while rv.steps[10].files["10/.metadata"].state != "local":
                    await trio.sleep(0.01)
            await trio.testing.wait_all_tasks_blocked()
            assert hold() is False
            # a reader opens the prefetched file itself: it is urgent now, never held
            nursery.start_soon(rv.missing((view / "__2_0.distcp").stat().st_ino))
            await trio.testing.wait_all_tasks_blocked()
            assert (rv._readers, prefetch.urgent, hold()) == (1, True, False)
            peer.gates["10/__2_0.distcp"].set()
            with trio.fail_after(10):
                while not rv.status().step(10).bytes_ready:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert job.errors == []


def test_an_open_waits_for_the_new_save_of_the_other_ranks_after_this_node_began_one(
    tmp_path, monkeypatch
):
    """Regression (#16 fourth trial F1): every rank saved step 10 again in place and,
    after a barrier, loaded it. This node showed rank 0's earlier part (fetched by an
    earlier load) and served its old bytes without an error until the coordinator's
    notice arrived. Now, once this node's write began another save of the step, an
    open of another rank's file waits for that rank's part of the new save (a part
    sealed since, or whose save began then); a file replaced meanwhile answers ESTALE
    (the kernel looks the path up again), a rank silent too long EIO, said."""
    C2 = os.urandom(len(C))
    peer = Source("peer", dict(BYTES), ["peer node-rank 0"])
    rv, ram, shards, catalog, own, job = view_of(tmp_path, dict(PARTS), [peer])
    shard0 = Path(ram.view) / "10" / "__0_0.distcp"
    shard2 = Path(ram.view) / "10" / "__2_0.distcp"

    async def main() -> None:
        await rv.look(own)
        await rv.missing(shard0.stat().st_ino)()
        assert shard0.read_bytes() == C  # fetched by an earlier load
        began = time.time()
        rv.new_save = lambda step: (began - 30.0, began)
        catalog.drop(own.key, "a sealed file was opened for writing")  # the save begins
        union = rv.steps[10]
        assert union.suspect == {0, 2} and union.own_began == began
        old_ino = shard0.stat().st_ino
        wait = rv.opening(old_ino)
        assert wait is not None  # its bytes are here, but may be of the earlier save
        # rank 0's node shows the part of the new save; this node's own is sealed again
        new0 = dataclasses.replace(
            manifest(0, {".metadata": B, "__0_0.distcp": C2}), began=began + 0.2
        )
        rv.manifests = Manifests({**PARTS, 0: new0})
        peer.files = {**BYTES, "10/__0_0.distcp": C2}
        (Path(ram.view) / "10" / "__1_0.distcp").write_bytes(A[::-1])
        own2 = shards.snapshot(
            ram.view, ShardKey(JOB, 1, 10), "10", ["10"], "generic", foreign=rv.is_remote
        )
        catalog.add(own2)
        async with trio.open_nursery() as nursery:
            failed: list[int] = []

            async def opener() -> None:
                try:
                    await wait()
                except OSError as exc:
                    failed.append(exc.errno or 0)

            nursery.start_soon(opener)
            await trio.testing.wait_all_tasks_blocked()
            assert failed == []  # still waiting
            await rv.look(own2)
        assert failed == [errno.ESTALE]  # replaced by rank 0's new part
        assert 0 not in union.suspect and union.parts[0] == new0.digest
        await rv.missing(shard0.stat().st_ino)()
        assert shard0.read_bytes() == C2
        # rank 2's node still shows its part of the earlier save: its opens wait, then
        # fail with EIO once the wait is over, said in replicator.errors
        assert union.suspect == {2}
        union.suspect_until = trio.current_time() + 0.2
        with pytest.raises(OSError) as exc:
            await rv.opening(shard2.stat().st_ino)()
        assert exc.value.errno == errno.EIO
        assert union.suspect == set()
        assert any("rank 2 showed no part of the save this node began" in e for e in job.errors)

    trio.run(main)


def resealed(shards: ShardStore, ram: RamStore, rv: RemoteView, began: float) -> Shard:
    """This node's part of step 10 sealed again, as a seal of a save begun at ``began``
    (Unix seconds) records it (other ranks' files of the view left out)."""
    own = shards.snapshot(
        ram.view, ShardKey(JOB, 1, 10), "10", ["10"], "generic", foreign=rv.is_remote
    )
    return dataclasses.replace(own, manifest=dataclasses.replace(own.manifest, began=began))


def test_a_rank_of_the_same_save_that_wrote_seconds_before_this_node_is_served(
    tmp_path, monkeypatch
):
    """Regression (#16 tenth trial, a false refusal): every rank saved step 10 again in
    place, this node 8 s after the others (it began writing late). Rank 0's new part
    was sealed before this node began and its save began more than RESAVE_GAP / 2
    earlier, so by the timestamps it looked like the earlier save: opens of its files
    waited 40 s, then failed with EIO for good, and ``dcp.load`` failed on this node.
    Its bytes changed since this node's save began (another digest than the part shown
    then): it is of the same save, placed and served at once."""
    monkeypatch.setattr("tierfs.node.remote_view.SUSPECT_WAIT", 0.3)
    C2 = os.urandom(len(C))
    peer = Source("peer", dict(BYTES), ["peer node-rank 0"])
    rv, ram, shards, catalog, own, job = view_of(tmp_path, dict(PARTS), [peer])
    shard0 = Path(ram.view) / "10" / "__0_0.distcp"

    async def main() -> None:
        await rv.look(own)
        began = time.time()
        rv.new_save = lambda step: (began - 30.0, began)
        catalog.drop(own.key, "a sealed file was opened for writing")  # this node begins
        union = rv.steps[10]
        assert union.suspect == {0, 2} and union.prior == {0: PARTS[0].digest, 2: PARTS[2].digest}
        # rank 0 began 8 s earlier and finished before this node began
        new0 = dataclasses.replace(
            manifest(0, {".metadata": B, "__0_0.distcp": C2}), began=began - 8, sealed=began - 7.9
        )
        new2 = dataclasses.replace(
            manifest(2, {"__2_0.distcp": C}), began=began - 7, sealed=began - 6.5
        )
        rv.manifests = Manifests({0: new0, 2: new2})
        peer.files = {**BYTES, "10/__0_0.distcp": C2, "10/__2_0.distcp": C}
        (Path(ram.view) / "10" / "__1_0.distcp").write_bytes(A[::-1])
        own2 = resealed(shards, ram, rv, began)
        catalog.add(own2)
        assert await rv.look(own2) is False
        assert union.suspect == set() and union.refused == {}
        assert union.parts == {0: new0.digest, 2: new2.digest}
        await trio.sleep(0.4)  # past the wait: still nothing refused
        await rv.look(own2)
        assert union.refused == {}
        await rv.opening(shard0.stat().st_ino)()  # fetches it: no wait, no EIO
        wait = rv.missing(shard0.stat().st_ino)
        if wait is not None:
            await wait()
        assert shard0.read_bytes() == C2

    trio.run(main)
    assert job.errors == []


def test_a_node_that_writes_late_does_not_take_the_others_new_parts_for_the_earlier_save(
    tmp_path, monkeypatch
):
    """Regression (#16 tenth trial FAIL E): every rank saved step 10 again in place,
    this node 20 s after the others. By then the others' new parts were already in its
    view (the coordinator's notice), so when it began its save, the digests it kept as
    "shown before the new save" were the new ones: they looked unchanged, and opens of
    their files failed with EIO for good. Now the digests kept are those of the parts
    of this node's own (earlier) save."""
    monkeypatch.setattr("tierfs.node.remote_view.SUSPECT_WAIT", 0.3)
    C2, B2 = os.urandom(len(C)), os.urandom(len(B))
    peer = Source("peer", dict(BYTES), ["peer node-rank 0", "peer node-rank 2"])
    rv, ram, shards, catalog, own, job = view_of(tmp_path, dict(PARTS), [peer])
    shard0 = Path(ram.view) / "10" / "__0_0.distcp"

    async def main() -> None:
        await rv.look(own)
        union = rv.steps[10]
        began = time.time()
        new0 = dataclasses.replace(
            manifest(0, {".metadata": B, "__0_0.distcp": C2}), began=began - 20, sealed=began - 19
        )
        new2 = dataclasses.replace(
            manifest(2, {"__2_0.distcp": B2}), began=began - 20, sealed=began - 19
        )
        rv.manifests = Manifests({0: new0, 2: new2})
        peer.files = {**BYTES, "10/__0_0.distcp": C2, "10/__2_0.distcp": B2}
        union.recheck |= {0, 2}  # the coordinator's notice: ranks 0 and 2 saved again
        await rv.look(own)
        assert union.parts == {0: new0.digest, 2: new2.digest}
        # this node begins its part of the same save, 20 s late
        rv.new_save = lambda step: (began - 30.0, began)
        catalog.drop(own.key, "a sealed file was opened for writing")
        assert union.prior == {0: PARTS[0].digest, 2: PARTS[2].digest}
        (Path(ram.view) / "10" / "__1_0.distcp").write_bytes(A[::-1])
        own2 = resealed(shards, ram, rv, began)
        catalog.add(own2)
        assert await rv.look(own2) is False
        await trio.sleep(0.4)  # past the wait
        await rv.look(own2)
        assert union.suspect == set() and union.refused == {}
        wait = rv.opening(shard0.stat().st_ino)
        if wait is not None:
            await wait()
        assert shard0.read_bytes() == C2

    trio.run(main)
    assert job.errors == []


def test_a_rank_late_in_one_save_is_current_in_the_next_one_this_node_writes_late(
    tmp_path, monkeypatch
):
    """Regression (eleventh #16 trial E2): step 10 saved again in place twice; in the
    first re-save rank 2 wrote 20 s after this node, in the second this node wrote 25 s
    after the others. The digests this node kept of its own save (the same-save parts)
    had none for rank 2 (begun too far from this node's part), so rank 2's newest part
    never counted as current: opens of its files failed with EIO for good and a load on
    this node failed. A part that lists this node's part the save replaced (the part
    its view showed when its save began) is of that save or a later one: current."""
    monkeypatch.setattr("tierfs.node.remote_view.SUSPECT_WAIT", 0.3)
    C2, B2, C3, B3 = (os.urandom(n) for n in (len(C), len(B), len(C) + 1, len(B) + 1))
    peer = Source("peer", dict(BYTES), ["peer node-rank 0", "peer node-rank 2"])
    rv, ram, shards, catalog, own, job = view_of(tmp_path, dict(PARTS), [peer])
    shard2 = Path(ram.view) / "10" / "__2_0.distcp"
    t0 = time.time() - 200

    async def main() -> None:
        await rv.look(own)
        union = rv.steps[10]
        # the first re-save: this node and rank 0 at t0, rank 2 20 s late
        (Path(ram.view) / "10" / "__1_0.distcp").write_bytes(A[::-1])
        own2 = resealed(shards, ram, rv, t0)
        catalog.add(own2)
        p0 = dataclasses.replace(
            manifest(0, {".metadata": B, "__0_0.distcp": C2}), began=t0, sealed=t0 + 1
        )
        p2 = dataclasses.replace(manifest(2, {"__2_0.distcp": B2}), began=t0 + 20, sealed=t0 + 21)
        rv.manifests = Manifests({0: p0, 2: p2})
        peer.files = {**BYTES, "10/__0_0.distcp": C2, "10/__2_0.distcp": B2}
        await rv.look(own2)
        assert union.parts == {0: p0.digest, 2: p2.digest} and union.refused == {}
        # the second re-save: ranks 0 and 2 at began - 25, this node 25 s late; their
        # views showed this node's part own2 when they began (it is what they replace)
        began = time.time()
        lists = ((1, own2.manifest.digest),)
        q0 = dataclasses.replace(
            manifest(0, {".metadata": B, "__0_0.distcp": C3}),
            began=began - 25,
            sealed=began - 24,
            replaces=((0, p0.digest), *lists),
        )
        q2 = dataclasses.replace(
            manifest(2, {"__2_0.distcp": B3}),
            began=began - 25,
            sealed=began - 24,
            replaces=((2, p2.digest), *lists),
        )
        rv.manifests = Manifests({0: q0, 2: q2})
        peer.files = {**BYTES, "10/__0_0.distcp": C3, "10/__2_0.distcp": B3}
        union.recheck |= {0, 2}  # the coordinator's notice
        await rv.look(own2)
        assert union.parts == {0: q0.digest, 2: q2.digest}
        rv.new_save = lambda step: (t0 + 1, began)
        rv.own_replaced = lambda step: frozenset(lists)
        catalog.drop(own2.key, "a sealed file was opened for writing")  # this node begins
        assert 2 not in (union.prior or {})  # rank 2 was late in the save shown before
        (Path(ram.view) / "10" / "__1_0.distcp").write_bytes(A)
        own3 = resealed(shards, ram, rv, began)
        catalog.add(own3)
        await rv.look(own3)
        await trio.sleep(0.4)  # past the wait
        await rv.look(own3)
        assert union.suspect == set() and union.refused == {}
        wait = rv.opening(shard2.stat().st_ino)
        if wait is not None:
            await wait()
        assert shard2.read_bytes() == B3
        # a part listing only an older part of this node is not taken for current
        older = dataclasses.replace(q2, replaces=((1, own.manifest.digest),))
        assert not union.current(older)

    trio.run(main)
    assert job.errors == []


def test_a_rank_that_no_longer_writes_the_step_is_never_waited_for(tmp_path, monkeypatch):
    """Regression (CI, a busy machine): a job renumbered onto 3 nodes saved step 30 of
    the 4-node save again; the node began its save while rank 3's files were placed, so
    rank 3 became suspect, its files then left the view (the step now written by 3
    nodes), yet rank 3 stayed suspect and was refused 40 s later, a false line in
    ``replicator.errors``. A rank beyond the step's node count is never waited for."""
    monkeypatch.setattr("tierfs.node.remote_view.SUSPECT_WAIT", 0.3)
    peer = Source("peer", dict(BYTES), ["peer node-rank 0", "peer node-rank 2"])
    rv, ram, shards, catalog, own, job = view_of(tmp_path, dict(PARTS), [peer])

    async def main() -> None:
        await rv.look(own)
        union = rv.steps[10]
        began = time.time()
        rv.new_save = lambda step: (began - 30.0, began)
        catalog.drop(own.key, "a sealed file was opened for writing")
        assert union.suspect == {0, 2}
        new0 = dataclasses.replace(
            manifest(0, {".metadata": B, "__0_0.distcp": C[::-1]}),
            began=began + 0.1,
            sealed=began + 1,
            nodes=2,
        )
        rv.manifests = Manifests({0: new0})
        peer.files = {**BYTES, "10/__0_0.distcp": C[::-1]}
        (Path(ram.view) / "10" / "__1_0.distcp").write_bytes(A[::-1])
        own2 = resealed(shards, ram, rv, began)
        own2 = dataclasses.replace(own2, manifest=dataclasses.replace(own2.manifest, nodes=2))
        catalog.add(own2)
        await rv.look(own2)  # the step is written by 2 nodes now: rank 2's files leave
        assert 2 not in union.suspect and not (Path(ram.view) / "10" / "__2_0.distcp").exists()
        await trio.sleep(0.4)  # past the wait
        await rv.look(own2)
        assert union.refused == {} and union.suspect == set()

    trio.run(main)
    assert job.errors == []


@pytest.mark.parametrize("sign", ["listed", "older"])
def test_a_rank_whose_new_save_never_came_is_not_served_beside_the_new_save(
    tmp_path, monkeypatch, sign, caplog
):
    """Regression (#16 ninth trial FAIL 15/16, silent wrong data): every rank saved
    step 10 again in place but rank 2's new save never came (its trainer crashed, or
    its node died before its new part was copied): node 2 still showed its part of the
    earlier save. The view went on serving rank 2's earlier files (the log said "not
    shown"), an open waiting for rank 2's new part failed only once and then served
    them, and ``dcp.load`` returned two saves' values with exit 0. Now rank 2's files
    are not served (EIO, said once) until its node shows a part of the new save, for
    every open; status and ``tierfs wait`` say so. The sign of the earlier save: rank
    0's new part lists rank 2's part as replaced (it held a replica), or rank 2's part
    was sealed before the others began saving again (no copy held anywhere)."""
    monkeypatch.setattr("tierfs.node.remote_view.SUSPECT_WAIT", 0.5)
    B2, C2, B3 = os.urandom(len(B)), os.urandom(len(C)), os.urandom(len(B) + 3)
    old2 = dataclasses.replace(PARTS[2], created=time.time() - 120, sealed=time.time() - 120)
    parts = {0: PARTS[0], 2: old2}
    peer = Source("peer", dict(BYTES), ["peer node-rank 0", "peer node-rank 2"])
    rv, ram, shards, catalog, own, job = view_of(tmp_path, dict(parts), [peer])
    view = Path(ram.view) / "10"
    shard2 = view / "__2_0.distcp"
    caplog.set_level("INFO", logger="tierfs.node.remote_view")

    async def main() -> None:
        await rv.look(own)
        await rv.missing(shard2.stat().st_ino)()
        assert shard2.read_bytes() == B  # the first save, read by an earlier load
        # the save again: this node and rank 0 write new parts, rank 2 never does
        began = time.time()
        (view / "__1_0.distcp").write_bytes(A[::-1])
        again = resealed(shards, ram, rv, began)
        catalog.add(again)
        new0 = dataclasses.replace(
            manifest(0, {".metadata": B2, "__0_0.distcp": C2}),
            began=began + 0.1,
            sealed=began + 1,
            replaces=((0, PARTS[0].digest), (2, old2.digest)) if sign == "listed" else (),
        )
        rv.manifests = Manifests({0: new0, 2: old2})
        peer.files = {**BYTES, "10/.metadata": B2, "10/__0_0.distcp": C2}
        assert await rv.look(again) is True  # rank 2 is looked for again
        union = rv.steps[10]
        assert union.parts[0] == new0.digest and union.parts[2] == old2.digest
        assert 2 in union.suspect and 2 not in union.refused
        wait = rv.opening(shard2.stat().st_ino)
        assert wait is not None  # its bytes are here, but of the earlier save
        with pytest.raises(OSError) as first:
            await wait()  # waits SUSPECT_WAIT for rank 2's new part, which never shows
        assert first.value.errno == errno.EIO
        assert union.refused.keys() == {2}
        said = [e for e in job.errors if "rank 2's files are not served" in e]
        assert len(said) == 1, job.errors
        # every later open fails too (it failed only the first one before the fix)
        for _ in range(3):
            await rv.look(again)
            for gate in (rv.opening, rv.missing):
                with pytest.raises(OSError) as later:
                    await gate(shard2.stat().st_ino)()
                assert later.value.errno == errno.EIO
                assert "earlier save" in later.value.strerror or "earlier save" in str(later.value)
        assert len([e for e in job.errors if "rank 2's files are not served" in e]) == 1
        s = rv.status().step(10)
        assert s is not None and s.refused == (2,) and not s.names_ready
        # node 2 saves its part of the new save at last: served, the new bytes
        new2 = dataclasses.replace(
            manifest(2, {"__2_0.distcp": B3}), began=began + 30, sealed=began + 31
        )
        rv.manifests.parts[2] = new2
        peer.files["10/__2_0.distcp"] = B3
        assert await rv.look(again) is False
        assert union.refused == {} and union.parts[2] == new2.digest
        await rv.missing(shard2.stat().st_ino)()
        assert shard2.read_bytes() == B3
        assert rv.status().step(10).names_ready

    trio.run(main)
    # said once in the log, not at every look (tenth trial G: ten lines a second)
    lines = [r for r in caplog.records if "not shown; its node is asked again" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]


def test_a_step_a_restore_abandoned_shows_only_this_nodes_own_files(tmp_path):
    """Regression (#16 fifth trial F4): step 20 saved again in place, a node lost before
    its new part was copied; the restore took step 10 and abandoned step 20, which
    stays in the mount. Each survivor's view still showed other ranks' parts of it,
    some of the new save and some of the earlier one (from its backup round),
    different on each node, and a stock ``dcp.load`` of that newest directory returned
    the mix without an error. Now the other ranks' files leave the view of a step whose
    own part a restore abandoned (a file still open stays until closed), so such a
    load fails loudly; a new save of the step shows every rank's files again."""
    peer = Source("peer", BYTES, ["peer node-rank 0", "peer node-rank 2"])
    rv, ram, shards, catalog, own, _job = view_of(tmp_path, PARTS, [peer])
    abandoned: set[int] = set()
    rv.abandoned = lambda step: step in abandoned
    step_dir = Path(ram.view) / "10"
    files = OpenFiles()

    async def main() -> None:
        assert await rv.look(own) is False
        assert sorted(os.listdir(step_dir)) == WHOLE_STEP
        rv.attach(files)  # type: ignore[arg-type]
        held = (step_dir / "__2_0.distcp").stat().st_ino
        files.open.add(held)  # a reader still has rank 2's file open
        # the restore abandons step 10 (drop_abandoned: book.abandoned, then the drop)
        abandoned.add(10)
        catalog.drop(own.key, "abandoned: the job restored step 5")
        assert rv._eligible() == []
        assert await rv._leave_abandoned(set()) is True  # one file is still open
        assert sorted(os.listdir(step_dir)) == ["__1_0.distcp", "__2_0.distcp"]
        files.open.discard(held)
        assert await rv._leave_abandoned(set()) is False
        assert sorted(os.listdir(step_dir)) == ["__1_0.distcp"]  # its own file only
        assert (step_dir / "__1_0.distcp").read_bytes() == A
        assert 10 not in rv.steps and rv.status().step(10) is None
        # the step saved again here: a new seal, every rank's files shown again
        abandoned.clear()
        again = shards.snapshot(
            ram.view, ShardKey(JOB, 1, 10), "10", ["10"], "generic", foreign=rv.is_remote
        )
        catalog.add(again)
        assert await rv.look(again) is False
        assert sorted(os.listdir(step_dir)) == WHOLE_STEP

    trio.run(main)


def test_a_newer_step_a_node_kept_through_a_restore_shows_only_its_own_files(tmp_path):
    """Regression (#16 sixth trial N1): a restore round decided step 5; the nodes it
    summoned (they had kept running, or were summoned before their own restore
    began) kept their parts of step 10, and their views kept showing step 10's
    other ranks' files, rank 3's of an earlier save among them: a one-process
    ``dcp.load`` returned the mix. A step newer than the restored one whose own part
    was sealed before that restore shows only the node's own files; sealed again
    after it (the step saved again), every rank's files again."""
    peer = Source("peer", BYTES, ["peer node-rank 0", "peer node-rank 2"])
    rv, ram, shards, catalog, own, _job = view_of(tmp_path, PARTS, [peer])
    restore: list[tuple[float, int, int]] = []
    rv.restored = lambda: restore[-1] if restore else None
    step_dir = Path(ram.view) / "10"

    async def main() -> None:
        assert await rv.look(own) is False
        assert sorted(os.listdir(step_dir)) == WHOLE_STEP
        # a restore decides step 5 after this node's part of step 10 was sealed; the
        # part stays in the catalog (this node was summoned: it keeps its newer parts)
        restore.append((time.time(), 5, 3))
        assert sealed_at(own.manifest) < restore[-1][0]
        assert rv.left_behind(10) and not rv.left_behind(5)
        assert rv._eligible() == [(5, None, 3)]  # the restored step, not step 10
        assert await rv._leave_abandoned(set()) is False
        assert sorted(os.listdir(step_dir)) == ["__1_0.distcp"]  # its own file only
        assert own.key in catalog
        # the step saved again here after the restore: shown whole again
        while time.time() <= restore[-1][0]:  # (a coarse clock)
            await trio.sleep(0.001)
        again = shards.snapshot(
            ram.view, ShardKey(JOB, 1, 10), "10", ["10"], "generic", foreign=rv.is_remote
        )
        catalog.add(again)
        assert not rv.left_behind(10)
        assert await rv.look(again) is False
        assert sorted(os.listdir(step_dir)) == WHOLE_STEP

    trio.run(main)


def test_a_bucket_round_of_an_earlier_save_is_never_shown_beside_the_new_save(tmp_path):
    """Regression (#16 fifth trial F5, silent wrong data with exit 0): step 20 saved
    again in place, node 3 lost, the job restarted on 3 nodes and restored step 20
    from the new parts. A survivor asked for rank 2's part while node 2 was still
    restarting; the newest backup round holding it was the first save's, and the view
    served rank 2's earlier bytes (verified against the earlier manifest) beside the
    new parts: ``dcp.load`` returned a mix. Now a round's part is not shown when this
    node's own part is of a save begun after it was sealed, nor when another part of
    the save lists it as replaced; its node is asked again."""
    began = time.time()
    old2 = dataclasses.replace(
        manifest(2, {"__2_0.distcp": B}), created=began - 60, sealed=began - 60
    )
    new2 = dataclasses.replace(
        manifest(2, {"__2_0.distcp": C}), began=began + 0.1, sealed=began + 1
    )
    rounds = Manifests({2: old2})
    peer = Source("peer", {**BYTES, "10/__2_0.distcp": C}, ["peer node-rank 2"])
    new0 = dataclasses.replace(PARTS[0], began=began + 0.05, sealed=began + 1)  # saved again too
    rv, ram, _shards, catalog, own, _job = view_of(tmp_path, {0: new0}, [peer])
    rv.more_manifests = [rounds]
    resaved = dataclasses.replace(own, manifest=dataclasses.replace(own.manifest, began=began))
    catalog.add(resaved)
    shard2 = Path(ram.view) / "10" / "__2_0.distcp"
    # this node's part is of the new save: node 2 does not answer, its round is older
    assert trio.run(rv.look, resaved) is True
    assert rounds.asked == [2] and not shard2.exists()
    # the round is asked for a part beside this node's own one (seed 29 #14: a round
    # holding another part of this rank is another save; tests/unit/test_fetch_file.py)
    assert rounds.beside == (1, resaved.manifest.digest)
    # node 2 answers with its part of the new save: shown, its bytes served
    rv.manifests.parts[2] = new2
    assert trio.run(rv.look, resaved) is False
    assert trio.run(rv.missing(shard2.stat().st_ino)) is None and shard2.read_bytes() == C

    # a node whose own part is a first save (began 0): another part of the step lists
    # the round's part as replaced by its save
    rv2, ram2, _s, _catalog2, own2, _j = view_of(tmp_path / "b", {}, [peer])
    rv2.more_manifests = [Manifests({2: old2})]
    lister = dataclasses.replace(PARTS[0], replaces=((0, "x"), (2, old2.digest)))
    rv2.manifests.parts[0] = lister
    assert trio.run(rv2.look, own2) is True
    assert not (Path(ram2.view) / "10" / "__2_0.distcp").exists()
    assert (Path(ram2.view) / "10" / ".metadata").exists()  # rank 0's part is shown
    # a part listing its own digest (identical bytes saved again) is not replaced
    rv2.manifests.parts[2] = dataclasses.replace(old2, replaces=((2, old2.digest),))
    assert trio.run(rv2.look, own2) is False
    assert (Path(ram2.view) / "10" / "__2_0.distcp").stat().st_size == len(B)


def test_a_part_of_the_step_saved_by_another_node_count_is_never_shown(tmp_path):
    """Regression (#16 fifth trial F8, silent mixed data): a 4-node job saved step 20,
    went on with 3 renumbered nodes and saved step 20 again; renumbered once more, the
    node that was rank 2 of the 4-node save became rank 2 again and sent that part:
    node 0 showed it beside the 3-node save's parts. A part written by another node
    count than this view's save of the step is not shown, from a replica held here,
    from its node, or from a bucket round."""
    old2 = dataclasses.replace(manifest(2, {"__2_0.distcp": B}), nodes=4)
    new2 = dataclasses.replace(manifest(2, {"__2_0.distcp": C}), nodes=3)
    peer = Source("peer", {**BYTES, "10/__2_0.distcp": C}, ["peer node-rank 2"])
    rv, ram, shards, catalog, own, _job = view_of(tmp_path, {0: PARTS[0], 2: old2}, [peer])
    rv.more_manifests = [Manifests({2: old2})]
    other = tmp_path / "node2-view"  # the 4-node part, also held here as a replica
    (other / "10").mkdir(parents=True)
    (other / "10" / "__2_0.distcp").write_bytes(B)
    held = shards.snapshot(str(other), ShardKey(JOB, 2, 10), "10", ["10"], "generic", nodes=4)
    catalog.add(held)
    shard2 = Path(ram.view) / "10" / "__2_0.distcp"
    assert trio.run(rv.look, own) is True  # rank 2's part of this save: not known yet
    assert not shard2.exists()
    assert (Path(ram.view) / "10" / ".metadata").exists()  # rank 0's part is shown
    rv.manifests.parts[2] = new2  # node 2 answers with its part of the 3-node save
    assert trio.run(rv.look, own) is False
    assert trio.run(rv.missing(shard2.stat().st_ino)) is None and shard2.read_bytes() == C


def test_a_save_begun_in_a_step_shown_without_an_own_part_waits_for_the_new_parts(tmp_path):
    """Regression (#16 fifth trial F3): a job grew from 3 to 4 nodes and every rank
    saved the restored step 10 again in place, then loaded it. The new node 3 held no
    part of the step, so nothing told its view that a new save began: it served rank
    0's earlier ``.metadata`` (with equal keys the earlier values would have come back
    silently). Now a file this node creates in such a step makes the other ranks'
    parts sealed more than RESAVE_GAP before suspect: an open of their files waits
    for their part of the new save (F1's rule); a removal, a part sealed just now, or
    another step changes nothing."""
    ram = RamStore(str(tmp_path / "node3"))
    catalog = ShardCatalog(ShardStore(ram), 3)
    job = fake_ports.FakeJob(JobSpec(JOB, "generic", 3, 4))
    long_ago = time.time() - 60
    parts = {
        r: dataclasses.replace(m, created=long_ago, sealed=long_ago)
        for r, m in {**PARTS, 1: manifest(1, {"__1_0.distcp": A})}.items()
    }
    peer = Source("peer", {**BYTES, "10/__1_0.distcp": A}, ["peer node-rank 0"])
    rv = remote_view(ram, catalog, job, parts, [peer], restored=lambda: (1000.0, 10, 3))
    meta = Path(ram.view) / "10" / ".metadata"

    async def main() -> None:
        assert await rv.look(None, step=10, writers=3) is False
        union = rv.steps[10]
        assert union.tops == {"10"} and not union.suspect
        rv.own_change("10/gone.bin")  # a removal: nothing
        rv.own_change("10/.metadata")  # another rank's file itself (e.g. a refused chmod)
        rv.own_change("11/x")  # another step
        assert not union.suspect
        await rv.missing(meta.stat().st_ino)()  # fetched by an earlier load
        assert rv.missing(meta.stat().st_ino) is None
        (Path(ram.view) / "10" / "__3_0.distcp").write_bytes(b"new")  # this node saves
        rv.own_change("10/__3_0.distcp")
        assert union.suspect == {0, 1, 2} and union.recheck >= {0, 1, 2}
        assert rv.missing(meta.stat().st_ino) is not None  # waits for rank 0's new part
        assert rv.opening(meta.stat().st_ino) is not None

    trio.run(main)

    # parts sealed just now belong to the same save: no wait
    rv.steps[10].suspect.clear()
    rv.steps[10].sealed = dict.fromkeys(rv.steps[10].sealed, time.time() - 1)
    rv.own_change("10/__3_0.distcp")
    assert rv.steps[10].suspect == set()


def test_a_load_right_after_a_save_waits_for_rank_0s_metadata(tmp_path):
    """Regression (#16 fifth trial F1): every rank saved a new step with stock DCP,
    passed a barrier and loaded it; on ranks 1..3 the lookup of ``.metadata`` failed
    with ENOENT (rank 0's part came a few seconds later). Now, for EXPECT_FOR s after
    this node's part of a step sealed, a lookup of DCP's ``.metadata`` missing in a
    directory of that part (DCP data files, none of the coordinator rank's ``__0_*``)
    waits while some rank's part is not known here: until it is placed, every part is
    known, or the time is up. Other names, and the node that writes ``.metadata``,
    never wait (the kernel looks a name up before creating it)."""
    rv, ram, _shards, _catalog, own, _job = view_of(tmp_path, {}, [])
    loads: list[str] = []
    rv.load_began = loads.append  # the sealer ends a rank grace (#14 trial 58 H1)

    async def main() -> None:
        assert await rv.look(own) is True  # ranks 0 and 2 not known yet
        assert rv.expected(b"10/__0_0.distcp") is None  # only .metadata waits
        assert loads == []
        assert rv.expected(b"11/.metadata") is None  # another step
        wait = rv.expected(b"10/.metadata")
        assert wait is not None
        assert loads == ["11", "10"]
        rv.manifests.parts.update(PARTS)  # their nodes sealed their parts
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            assert rv._expecting == 1
            await rv.look(own)
        assert rv._expecting == 0
        assert (Path(ram.view) / "10" / ".metadata").stat().st_size == len(B)
        assert rv.expected(b"10/.metadata") is None  # every part known now

    trio.run(main)

    # every part but rank 0's known and none brings .metadata: the time bounds the wait
    rv2, _ram2, _s2, _c2, own2, _j2 = view_of(tmp_path / "b", {2: PARTS[2]}, [])

    async def bounded() -> None:
        await rv2.look(own2)
        old = time.time() - 20  # the own data file's write no longer counts (dcp_expect)
        os.utime(Path(_ram2.view) / "10" / "__1_0.distcp", (old, old))
        wait = rv2.expected(b"10/.metadata")
        assert wait is not None
        rv2.steps[10].expect_since = trio.current_time() - 9.9  # EXPECT_FOR is 10 s
        with trio.fail_after(1):
            await wait()
        assert rv2.expected(b"10/.metadata") is None
        # the step saved again in place: this node's new part waits again (#16 twelfth
        # trial D2: the wait counted from the first save's look, and a load right
        # after a second save found no .metadata while rank 0's new part was coming)
        (Path(_ram2.view) / "10" / "__1_0.distcp").write_bytes(b"saved again")
        again = _s2.snapshot(_ram2.view, ShardKey(JOB, 1, 10), "10", ["10"], "generic")
        assert again.manifest.digest != own2.manifest.digest
        await rv2.look(again)
        assert rv2.expected(b"10/.metadata") is not None

    trio.run(bounded)

    # the node whose part holds the coordinator rank's data file writes .metadata itself
    ram3 = RamStore(str(tmp_path / "c"))
    (Path(ram3.view) / "10").mkdir(parents=True)
    (Path(ram3.view) / "10" / "__0_0.distcp").write_bytes(C)
    shards3 = ShardStore(ram3)
    own3 = shards3.snapshot(ram3.view, ShardKey(JOB, 0, 10), "10", ["10"], "generic")
    catalog3 = ShardCatalog(shards3, 3)
    catalog3.add(own3)
    job3 = fake_ports.FakeJob(JobSpec(JOB, "generic", 0, 3))
    rv3 = remote_view(ram3, catalog3, job3, {}, [])

    async def coordinator_rank() -> None:
        assert await rv3.look(own3) is True
        assert rv3.expected(b"10/.metadata") is None

    trio.run(coordinator_rank)


def test_a_fetch_given_up_for_room_keeps_the_bytes_an_open_handle_reads(tmp_path):
    """Regression (#14 trial 46): a fetch given up for lack of room punched its file
    (emptied, then made a hole of its size again) while a reader that opened it
    during the fetch read its verified bytes: a read of a 256 MiB file ended at 160
    MiB with no error. A file a handle holds open is not punched; otherwise nothing
    counts as verified while the punch runs, so an open meanwhile waits."""
    from tierfs.node import remote_view as rv_mod

    rv, ram, *_rest, own, _job = view_of(tmp_path, dict(PARTS), [Source("peer", BYTES, ["p"])])
    path = Path(ram.view) / "10" / "__0_0.distcp"
    files = OpenFiles()

    async def main() -> None:
        await rv.look(own)
        rv.attach(files)  # type: ignore[arg-type]
        rf = rv._by_ino[path.stat().st_ino]

        def fetching_with_bytes() -> None:  # as a fetch leaves it: all verified
            rf.state, rf.done, rf.verified = rv_mod.FETCHING, trio.Event(), rf.size
            with open(path, "r+b") as f:
                f.write(C)

        fetching_with_bytes()
        files.open.add(rf.ino)  # a reader opened it during the fetch
        await rv._punch_fetching(rf)
        assert path.read_bytes() == C and rf.verified == rf.size  # left alone
        files.open.clear()
        await rv._punch_fetching(rf)
        assert rf.verified == 0 and path.stat().st_size == len(C)
        assert path.read_bytes() == bytes(len(C))  # the bytes are out

    trio.run(main)


class FailsFirst(Source):
    """The first call waits for ``gate`` and fails (every copy); later calls serve."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = trio.Event()

    async def fetch_file(self, job, rank, step, digest, path, fd, *, skip=frozenset(), writers=0):
        if not self.calls:
            self.calls.append((path, skip))
            await self.gate.wait()
            raise FetchFailed(f"{self.name}: the copy went away")
        return await super().fetch_file(job, rank, step, digest, path, fd, skip=skip)


def test_a_failed_fetch_a_reader_started_again_and_read_says_nothing(tmp_path):
    """#14 trial 46 (s6h-s6k): "could not be read on this node" lines in
    replicator.errors for files every reader read: a fetch another task had started
    failed, and the reader that waited for it started it again and got the bytes.
    The line is written when a reader gets the error, not when a fetch a reader
    waits for fails; the failure is still counted."""
    peer = FailsFirst("peer", BYTES, ["peer node-rank 0"])
    rv, ram, *_rest, own, job = view_of(tmp_path, PARTS, [peer])
    meta = Path(ram.view) / "10" / ".metadata"

    async def main() -> None:
        await rv.look(own)
        rf = rv._by_ino[meta.stat().st_ino]
        got: list[OSError] = []

        async def background() -> None:  # a read-ahead's or prefetch's fetch
            try:
                await rv.fetch(rf)
            except OSError as exc:
                got.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(background)
            while not peer.calls:
                await trio.sleep(0.01)
            nursery.start_soon(rv.wait_verified, rf, rf.size)  # a reader joins it
            await trio.testing.wait_all_tasks_blocked()
            assert rf.urgent
            peer.gate.set()
        # the background fetch's caller saw the failure, or (when the reader had
        # started the fetch again before it woke) the bytes
        assert rf.state == "local" and all(e.errno == errno.EIO for e in got)

    trio.run(main)
    assert meta.read_bytes() == B
    assert job.errors == [] and rv.status().fetch_errors == 1


def test_the_reader_that_gets_a_failed_fetchs_error_says_it_once(tmp_path):
    """Two readers of a file whose every copy fails: one line, with the reason."""
    rv, ram, *_rest, own, job = view_of(tmp_path, PARTS, [Source("peer", {}, ["peer 0"])])
    meta = Path(ram.view) / "10" / ".metadata"
    errors: list[int] = []

    async def main() -> None:
        await rv.look(own)

        async def reader() -> None:
            try:
                await rv.missing(meta.stat().st_ino)()
            except OSError as exc:
                errors.append(exc.errno)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            nursery.start_soon(reader)

    trio.run(main)
    assert errors == [errno.EIO, errno.EIO]
    assert len(job.errors) == 1 and "could not be read on this node" in job.errors[0]


def test_emptying_a_fetched_file_never_changes_its_size(tmp_path, monkeypatch):
    """Regression (#14 trial 46, trial 47 FAIL A): emptying a file whose fetch failed
    or was dropped was ``ftruncate(0)`` then ``ftruncate(size)``; a reader of the
    file saw it end at 48, 84 or 160 MiB of 256 MiB with no error. The bytes are
    punched out with the size kept; a copy that wrote past the size is cut back."""
    path = tmp_path / "f"
    path.write_bytes(os.urandom(3 * 4096))
    sizes: list[int] = []
    real = os.ftruncate
    monkeypatch.setattr(os, "ftruncate", lambda fd, n: (sizes.append(n), real(fd, n))[1])
    fd = os.open(path, os.O_RDWR)
    try:
        RemoteView._punch(fd, 3 * 4096)
        assert os.fstat(fd).st_size == 3 * 4096 and not has_data(path)
        assert sizes == []  # never 0 on the way
        os.pwrite(fd, b"x" * 8192, 3 * 4096)  # a copy that wrote past the size
        RemoteView._punch(fd, 3 * 4096)
        assert os.fstat(fd).st_size == 3 * 4096 and not has_data(path)
        assert sizes == [3 * 4096]
    finally:
        os.close(fd)


class Partial(Remote):
    """A remote file opened during its fetch: its first 4 bytes are verified, the
    rest is a hole until the wait ``readable`` returns writes it."""

    def __init__(self, ino: int, path: Path, data: bytes) -> None:
        super().__init__(ino)
        self.path, self.data, self.asked = path, data, []

    def opening(self, ino: int):
        return None  # the open goes on with the first bytes verified

    def creating(self):
        return None

    def readable(self, ino: int, offset: int, size: int):
        self.asked.append((offset, size))
        if ino != self.ino or self.here or offset + size <= 4:
            return None

        async def fetched() -> None:
            with open(self.path, "r+b") as f:
                f.write(self.data)
            self.here = True

        return fetched


def test_copy_file_range_from_a_file_being_fetched_copies_only_verified_bytes(tmp_path):
    """Regression (#14 trial 48 FAIL E): ``cat`` of another rank's file into the mount
    (one copy_file_range of 256 MiB) copied the holes past the fetch's watermark: a
    full-size file of zeros after its first 4 MiB, and exit 0. The copy waits for
    the bytes as a read does."""
    view = tmp_path / "view"
    view.mkdir()
    data = os.urandom(64 * 1024)
    src = view / "f"
    with open(src, "wb") as f:
        f.write(data[:4])
        f.truncate(len(data))  # holes past the verified bytes
    remote = Partial(src.stat().st_ino, src, data)
    ns = Namespace(str(view), Budget(str(view), None, 0), remote=remote)
    try:
        inode, _st = ns.lookup(ROOT_ID, b"f")
        h_in = ns.open(inode.nodeid, os.O_RDONLY)
        assert h_in.partial
        _out, _st, h_out = ns.create(ROOT_ID, b"copy", os.O_WRONLY | os.O_CREAT, 0o644, 0, 0)
        with pytest.raises(Deferred) as later:
            ns.copy_file_range(h_in.fh, 0, h_out.fh, 0, len(data))
        assert remote.asked[-1] == (0, len(data))
        trio.run(later.value.wait)
        assert ns.copy_file_range(h_in.fh, 0, h_out.fh, 0, len(data)) == len(data)
        ns.release(h_in.fh)
        ns.release(h_out.fh)
        assert (view / "copy").read_bytes() == data
    finally:
        ns.close()


def test_the_mtime_shown_for_a_file_being_fetched_stays_until_its_bytes_are_here(tmp_path):
    """Regression (#14 trial 49 F1): a fetch writing into another rank's file changed
    its mtime; the kernel (auto_inval_data) then dropped the file's page cache at the
    next READDIRPLUS or GETATTR, waiting on the lock of a page whose READ the daemon
    held for the fetch: a trainer's `rm -rf` of the step blocked 21-39 s. The mtime
    first shown now stays while the bytes are not all here."""
    peer = Source("peer", BYTES, ["peer node-rank 0", "peer node-rank 2"])
    rv, ram, _shards, _catalog, own, _job = view_of(tmp_path, PARTS, [peer])

    async def main() -> None:
        assert await rv.look(own) is False
        meta = Path(ram.view) / "10" / ".metadata"
        st = meta.stat()
        first = st.st_mtime_ns
        assert rv.shown_mtime(st.st_ino, first) == first  # shown once: remembered
        later = first + 7_000_000_000  # what the backing file says once written into
        assert rv.shown_mtime(st.st_ino, later) == first
        fetch = rv.missing(st.st_ino)
        assert fetch is not None
        await fetch()
        assert rv.shown_mtime(st.st_ino, later) == later  # here: the file's own again
        own_ino = (Path(ram.view) / "10" / "__1_0.distcp").stat().st_ino
        assert rv.shown_mtime(own_ino, 123) == 123  # this node's own file: as it is

    trio.run(main)


def test_an_entry_reply_carries_the_mtime_shown_not_the_backing_files():
    from tierfs.fuse import protocol as P

    st = os.stat("/")
    plain = P.pack_attr(st, 5)
    shown = P.pack_attr(st, 5, mtime_ns=1_700_000_000_123_456_789)
    fields = P.ATTR.unpack(shown)
    assert (fields[4], fields[7]) == (1_700_000_000, 123_456_789)  # mtime, mtimensec
    assert P.ATTR.unpack(plain)[4] == st.st_mtime_ns // 1_000_000_000
    assert P.pack_attr(st, 5, None) == plain


def test_a_load_right_after_a_save_where_one_rank_seals_later_waits_for_its_files(tmp_path):
    """Regression (#14 trial 53 B1): after stock ``dcp.save`` and a barrier, (a) the node
    of a rank whose part was not sealed yet (its big file still checksummed) answered
    the lookup of ``.metadata`` with ENOENT, and (b) a node where ``.metadata`` was
    placed answered ``__2_0.distcp`` of a rank whose part was not known yet with
    ENOENT. Both now wait until the part brings the file (or every part is known)."""
    rv, ram, _shards, _catalog, own, _job = view_of(tmp_path, {}, [])
    step = Path(ram.view) / "10"

    async def main() -> None:
        # (a) nothing looked at yet (this node's own part not sealed): its own data
        # file was written just now, so .metadata is expected
        assert rv.steps == {}
        spec = _job.job
        _job.job = JobSpec(JOB, "generic", 0, 1)  # a one-node job: no other part comes
        assert rv.expected(b"10/.metadata") is None  # (regression: tar x waited 10 s)
        _job.job = spec
        wait = rv.expected(b"10/.metadata")
        assert wait is not None
        assert rv.expected(b"10/__2_0.distcp") is None  # no .metadata here: no save done
        rv.manifests.parts[0] = PARTS[0]  # rank 0's part (with .metadata) comes
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            assert rv._expecting == 1
            await rv.look(own)
        assert (step / ".metadata").exists() and rv._expecting == 0
        # (b) .metadata placed, rank 2's part not known yet: its data file is expected
        wait = rv.expected(b"10/__2_0.distcp")
        assert wait is not None
        assert rv.expected(b"10/__0_9.distcp") is not None  # any DCP data file name
        rv.manifests.parts[2] = PARTS[2]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            await rv.look(own)
        assert (step / "__2_0.distcp").exists() and rv._expecting == 0
        # every part known: a DCP name none of them has still waits out the window (a
        # node with several ranks may seal its part again with one more file, #14
        # trial 54 F1), and not past it
        assert rv.expected(b"10/__0_9.distcp") is not None
        old = time.time() - 20
        os.utime(step / ".metadata", (old, old))
        assert rv.expected(b"10/__0_9.distcp") is None

    trio.run(main)


def test_a_part_sealed_again_with_one_more_file_ends_the_wait_and_a_vain_wait_is_said(
    tmp_path,
):
    """#14 trial 54 F1: with 2 ranks per node, node 2 sealed its part with rank 4's file
    before rank 5 created ``__5_0.distcp``, and sealed it again a moment later; other
    nodes took "every part known" for the end and answered ENOENT. F5: a lookup that
    waited in vain left no line anywhere."""
    early = manifest(2, {"__4_0.distcp": B})
    full = manifest(2, {"__4_0.distcp": B, "__5_0.distcp": C})
    rv, ram, _shards, _catalog, own, job = view_of(tmp_path, {0: PARTS[0], 2: early}, [])
    step = Path(ram.view) / "10"

    async def main() -> None:
        await rv.look(own)
        assert (step / ".metadata").exists() and (step / "__4_0.distcp").exists()
        wait = rv.expected(b"10/__5_0.distcp")
        assert wait is not None  # every part is known, but the save just finished
        rv.manifests.parts[2] = full  # node 2 seals its part again, now complete
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            rv.steps[10].recheck.add(2)
            await rv.look(own)
        assert (step / "__5_0.distcp").exists()
        assert job.errors == []
        # a name that never comes: the wait ends with the window, said once
        (step / ".metadata").touch()
        vain = rv.expected(b"10/__9_0.distcp")
        assert vain is not None
        old = time.time() - dcp_expect.EXPECT_FOR + 0.3
        os.utime(step / ".metadata", (old, old))
        with trio.fail_after(5):
            await vain()
        assert len(job.errors) == 1 and "10/__9_0.distcp waited" in job.errors[0], job.errors

    trio.run(main)


def test_a_lookup_that_waited_in_vain_before_a_save_into_its_directory_is_not_an_error(
    tmp_path,
):
    """#14 trial 57 L1: DCP's save retried into a failed save's directory first looks
    for an earlier ``.metadata``; that lookup waits and ends in vain on every node, and
    each retry left a line per node in ``replicator.errors``. The line now waits
    SAY_AFTER s and is left out when this node's client writes into the directory
    meanwhile (a save began: the lookup was its check); otherwise it is said."""
    rv, _ram, _shards, _catalog, own, job = view_of(tmp_path, PARTS, [])

    async def main() -> None:
        await rv.look(own)
        async with trio.open_nursery() as nursery:
            rv._fetches = nursery
            rv._expect_ended("10/.metadata", "10", 4.0)
            await trio.sleep(1)
            assert job.errors == []
            rv.own_change("10/__1_0.distcp")  # the retried save writes
            await trio.sleep(SAY_AFTER)
            assert job.errors == []
            # the retried save rewrites its files in place (no creation): the node
            # reports saving the directory (a file open for writing)
            rv.saving_now = lambda: ["12"]
            rv._expect_ended("12/.metadata", "12", 4.0)
            await trio.sleep(SAY_AFTER + 1)
            assert job.errors == []
            rv.saving_now = list
            rv._expect_ended("11/sub/.metadata", "11/sub", 4.0)  # no save follows
            await trio.sleep(SAY_AFTER + 1)
            assert len(job.errors) == 1 and "11/sub/.metadata waited 4.0 s" in job.errors[0]
            rv._fetches = None

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def saved_a_minute_ago(path: Path) -> tuple[Any, RamStore, Any, Any]:
    """A view of node 1 whose own DCP data file of step 10 was written a minute ago,
    rank 2's part known and rank 0's (the coordinator's) not: (view, RAM store, own
    part, job). Its first look goes through :func:`looked_a_minute_ago`."""
    rv, ram, *_rest, own, job = view_of(path, {2: PARTS[2]}, [])
    old = time.time() - 60
    os.utime(Path(ram.view) / "10" / "__1_0.distcp", (old, old))
    return rv, ram, own, job


async def looked_a_minute_ago(rv: Any, own: Any) -> None:
    """The first look of :func:`saved_a_minute_ago`'s view, its part sealed a minute
    before (the 10 s windows of the DCP rules are over)."""
    await rv.look(own)
    rv.steps[10].expect_since = trio.current_time() - 60


def test_a_lookup_of_metadata_waits_while_another_node_saves_its_step(tmp_path):
    """#14 trial 54 F2: the coordinator rank finished its writes more than 10 s after
    this node's own (a much bigger part); the others' ``dcp.load`` right after the
    save found no ``.metadata``: the window counted from their own writes had ended.
    Now such a lookup also waits while the coordinator reports another node saving
    that step directory (:mod:`tierfs.cluster.savers`), SAVING_MAX s at most, and
    ends SAVING_HOLD s after the last such report (regression: a lookup 9 ms after the
    first reply without it ended at once, before the view had asked for the part)."""
    from tierfs.node import remote_view as rv_mod

    rv, ram, own, _job = saved_a_minute_ago(tmp_path)

    async def main() -> None:
        await looked_a_minute_ago(rv, own)
        assert rv.expected(b"10/.metadata") is None  # no report: ENOENT at once
        rv.others_saving(["11", "10"])
        assert rv.expected(b"10/__0_0.distcp") is None  # only .metadata waits
        assert rv.expected(b"12/.metadata") is None
        wait = rv.expected(b"10/.metadata")
        assert wait is not None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            for _ in range(40):  # 40 s of reports: still waiting (EXPECT_MAX is 30 s)
                await trio.sleep(1)
                rv.others_saving(["10"])
            assert rv._expecting == 1
            rv.manifests.parts[0] = PARTS[0]  # rank 0's node sealed its part
            await rv.look(own)
        assert rv._expecting == 0
        assert (Path(ram.view) / "10" / ".metadata").stat().st_size == len(B)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))

    # the reports end and no part brings it: ENOENT SAVING_HOLD s after the last one
    rv2, _ram2, own2, _j2 = saved_a_minute_ago(tmp_path / "b")

    async def ended() -> None:
        await looked_a_minute_ago(rv2, own2)
        rv2.others_saving(["10"])
        wait = rv2.expected(b"10/.metadata")
        assert wait is not None
        began = trio.current_time()
        await trio.sleep(1)
        rv2.others_saving([])  # node 0's save ended without a part (a failed save)
        assert rv2.expected(b"10/.metadata") is not None  # a new lookup waits too
        await wait()
        assert 1 <= trio.current_time() - began <= 1 + rv_mod.SAVING_HOLD + 0.5
        # no heartbeat reply for REPLIES_LIVE s (no coordinator): ENOENT at once
        await trio.sleep(rv_mod.REPLIES_LIVE + 0.1)
        assert rv2.expected(b"10/.metadata") is None

    trio.run(ended, clock=trio.testing.MockClock(autojump_threshold=0))

    # #14 trial 55 F1: a rank began writing 12 s late, and its node and the
    # coordinator's saved in milliseconds, between two heartbeats: the lookup waits for
    # the next two replies, and one names the directory
    rv3, ram3, own3, _j3 = saved_a_minute_ago(tmp_path / "c")

    async def fresh() -> None:
        await looked_a_minute_ago(rv3, own3)
        assert rv3.expected(b"10/.metadata") is None  # no reply yet: no heartbeat
        rv3.others_saving([])
        await trio.sleep(0.5)
        wait = rv3.expected(b"10/.metadata")
        assert wait is not None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            for _ in range(5):  # node 0 reports the directory it changed a moment ago
                await trio.sleep(1)
                rv3.others_saving(["10"])
            assert rv3._expecting == 1  # still waiting, 5 s after the lookup
            rv3.manifests.parts[0] = PARTS[0]
            await rv3.look(own3)
        assert (Path(ram3.view) / "10" / ".metadata").stat().st_size == len(B)

    trio.run(fresh, clock=trio.testing.MockClock(autojump_threshold=0))

    # two replies that name nothing: ENOENT after the second, said in replicator.errors
    rv4, _ram4, own4, job4 = saved_a_minute_ago(tmp_path / "d")

    async def nothing() -> None:
        await looked_a_minute_ago(rv4, own4)
        rv4.others_saving([])
        began = trio.current_time()
        wait = rv4.expected(b"10/.metadata")
        assert wait is not None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            for _ in range(2):
                await trio.sleep(1)
                rv4.others_saving([])
        assert trio.current_time() - began == pytest.approx(2, abs=0.3)
        assert any("10/.metadata waited" in e for e in job4.errors)

    trio.run(nothing, clock=trio.testing.MockClock(autojump_threshold=0))


def test_an_old_step_without_metadata_is_answered_at_once(tmp_path):
    """A checkpoint scan looking for ``.metadata`` in an old step whose save failed (own
    data files FRESH_FOR s old or more) does not wait for heartbeat replies."""
    from tierfs.node import remote_view as rv_mod

    rv, ram, *_rest, own, _job = view_of(tmp_path, {2: PARTS[2]}, [])
    data = Path(ram.view) / "10" / "__1_0.distcp"

    async def main() -> None:
        await rv.look(own)
        rv.steps[10].expect_since = trio.current_time() - 3600
        rv.others_saving([])
        for age, waits in ((rv_mod.FRESH_FOR + 60, False), (60, True)):
            t = time.time() - age
            os.utime(data, (t, t))
            assert (rv.expected(b"10/.metadata") is not None) is waits, age

    trio.run(main)


def test_a_lookup_run_again_after_its_wait_ended_is_answered_enoent(tmp_path):
    """Regression (#14 trial 56 N1, HIGH): the FUSE session runs a lookup answered
    later again once its wait ends (up to 3 times, then EIO). The wait for two
    heartbeat replies began afresh at each run, so ``stat checkpoint-52/.metadata`` in
    the directory of a failed save got EIO after 5 s, and a DCP save retried into it
    failed on every rank but the coordinator's. Now the run after a wait that ended in
    vain is answered ENOENT, as the session would do."""
    from tierfs.fuse.remote import Deferred

    rv, _ram, own, _job = saved_a_minute_ago(tmp_path)

    def lookup() -> None:  # what the namespace does with a missing name
        wait = rv.expected(b"10/.metadata")
        if wait is not None:
            raise Deferred(wait)
        raise OSError(errno.ENOENT, "10/.metadata")

    async def session_loop() -> int:  # tierfs.fuse.session's _wait_and_answer
        try:
            lookup()
        except Deferred as first:
            later = first
        for _ in range(3):
            try:
                await later.wait()
                lookup()
            except Deferred as again:
                later = again
                continue
            except OSError as exc:
                return exc.errno
        return errno.EIO

    async def main() -> None:
        await looked_a_minute_ago(rv, own)
        async with trio.open_nursery() as nursery:

            async def replies() -> None:
                while True:
                    rv.others_saving([])
                    await trio.sleep(1)

            nursery.start_soon(replies)
            await trio.sleep(0.5)  # heartbeat replies come
            began = trio.current_time()
            assert await session_loop() == errno.ENOENT
            assert trio.current_time() - began < 3
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
