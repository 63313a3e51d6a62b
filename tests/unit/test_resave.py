"""Issue #16 F9: one step number saved again in place. Every seal records the parts
of an earlier save it replaced (tierfs.node.resave), and a restore never combines a
rank's part of the earlier save with the other ranks' parts of the new one.

Regression (fourth #16 trial, mx_repro.sh): 3 nodes saved step 20 with DCP, saved it
again in place, and node 2 was lost before its new part was replicated; the 2
survivors restored step 20 with exit 0 from their new parts and rank 2's old
replica, and ``dcp.load`` returned a mix of the two saves."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time

import pytest
import trio.testing
from test_node_parts import build, run_with_tasks, seal, write_step

from tierfs.cluster.restore_choice import OLDER, RESTORED, choose_restore, replaced_copies
from tierfs.core.control import JobSpec
from tierfs.core.types import BucketPart, BucketView, Holding
from tierfs.node import resave, statefile
from tierfs.node.intake import Changed
from tierfs.node.resave import (
    CutShort,
    EarlierSave,
    SeenPart,
    not_rewritten,
    replaced_pairs,
    sealed_at,
)
from tierfs.node.sealing import SealCandidate
from tierfs.store.manifest import FileEntry, Manifest
from tierfs.store.shards import ShardKey


def M(rank: int, tag: str, *, began: float = 0.0, sealed: float = 100.0, **kw: object) -> Manifest:
    files = (
        FileEntry("20", "dir", mode=0o755),
        FileEntry(f"20/__{rank}_0.distcp", "file", 8, 0o644, hash(tag) & 0xFFFF),
    )
    return Manifest(
        "j",
        rank,
        20,
        "20",
        "generic",
        files,
        created=sealed,
        began=began,
        sealed=sealed,
        nodes=3,
        **kw,
    )  # type: ignore[arg-type]


# ---------------------------------------------------------------------- the seal's record


def test_a_new_save_replaces_the_own_part_and_the_parts_held_when_it_began():
    a0, a1, a2 = M(0, "a0"), M(1, "a1"), M(2, "a2")
    save = EarlierSave()
    save.withdrawn(a0, [a0, a1, a2], now=100.0 + resave.RESAVE_GAP)
    assert save.began == 100.0 + resave.RESAVE_GAP and save.cutoff == 100.0
    assert set(replaced_pairs(save)) == {(0, a0.digest), (1, a1.digest), (2, a2.digest)}


def test_a_part_of_the_new_save_that_arrived_early_is_not_replaced():
    a0, a2 = M(0, "a0"), M(2, "a2")
    b1 = M(1, "b1", began=111.0, sealed=112.0)  # rank 1 began the new save after a0's seal
    save = EarlierSave()
    save.withdrawn(a0, [a2, b1], now=113.0)
    late_b2 = M(2, "b2", began=111.5, sealed=114.0)  # held at the seal
    pairs = set(replaced_pairs(save, [late_b2]))
    assert pairs == {(0, a0.digest), (2, a2.digest)}


def test_a_new_save_replaces_the_parts_the_view_showed_when_it_began():
    """Tenth #16 trial FAIL A: with ``--peers-per-node 0`` no node holds another rank's
    part, so only the parts the whole-step view showed say what the new save replaced
    (a restart before node-rank 0's verdict restored rank 2's earlier part beside the
    new ones). A shown part of the new save (begun after the own part's seal) and the
    node's own rank are never recorded; neither are shown parts of a late write."""
    a0, a2 = M(0, "a0"), M(2, "a2")
    shown = [SeenPart(2, a2.digest, 0.0), SeenPart(1, "b1", 111.0), SeenPart(0, "x", 0.0)]
    save = EarlierSave()
    save.withdrawn(a0, [], now=113.0, seen=shown)
    assert set(replaced_pairs(save)) == {(0, a0.digest), (2, a2.digest)}
    # shown at the seal: a rank's earlier part placed since (a first save's, began 0)
    pairs = replaced_pairs(save, seen_now=[SeenPart(3, "a3", 0.0), SeenPart(2, "b2", 112.0)])
    assert set(pairs) == {(0, a0.digest), (2, a2.digest), (3, "a3")}
    # recorded for a daemon restarted before the seal
    assert {tuple(p) for p in save.to_dict()["replaces"]} == {(0, a0.digest), (2, a2.digest)}
    late = EarlierSave()
    late.withdrawn(a0, [], now=100.0 + resave.RESAVE_GAP / 2, seen=shown)
    assert late.seen == [] and replaced_pairs(late) == ((0, a0.digest),)


def test_in_a_large_job_each_node_lists_the_ranks_after_its_own():
    """At most MAX_REPLACED pairs: in a 1,000-node job the parts shown are listed
    nearest ranks after this node's own first (a ring), so every rank's earlier part is
    listed by the ~255 nodes before it; an abandoned part is never crowded out."""
    own = dataclasses.replace(M(500, "a500"), rank=500, nodes=1000)
    gone = M(7, "abandoned")
    seen = [SeenPart(r, f"d{r}", 0.0) for r in range(1000) if r != 500]
    save = EarlierSave(abandoned=[gone])
    save.withdrawn(own, [], now=100.0 + resave.RESAVE_GAP, seen=seen)
    pairs = replaced_pairs(save)
    assert len(pairs) == resave.MAX_REPLACED
    assert pairs[:2] == ((500, own.digest), (7, gone.digest))
    assert [r for r, _ in pairs[2:]] == list(range(501, 501 + resave.MAX_REPLACED - 2))
    wrap = dataclasses.replace(own, rank=900)
    save = EarlierSave()
    save.withdrawn(wrap, [], now=100.0 + resave.RESAVE_GAP, seen=seen)
    ranks = [r for r, _ in replaced_pairs(save)[1:]]
    assert ranks[:99] == list(range(901, 1000)) and ranks[99:101] == [0, 1]


def test_a_write_soon_after_the_seal_continues_the_save_and_replaces_only_the_own_part():
    a0, a1 = M(0, "a0", began=50.0, replaces=((1, "old1"),)), M(1, "a1")
    save = EarlierSave()
    save.withdrawn(a0, [a1], now=100.0 + resave.RESAVE_GAP / 2)
    assert save.cutoff == 0.0 and save.began == 50.0  # the save a0 was of goes on
    # a0 itself and what a0 replaced, never rank 1's part of the same save
    assert replaced_pairs(save, [a1]) == ((0, a0.digest), (1, "old1"))


def test_a_write_soon_after_a_load_of_other_ranks_files_begins_another_save():
    """Regression (#14 trial 55 F3): save, barrier, load, save again at once. The second
    save's writes came less than RESAVE_GAP after the first seal and counted as the same
    save, so another node's load right after it read the earlier save's files of other
    ranks with no error. The parts this node's client read since its seal are of the
    earlier save: the write begins another one, and the parts read are replaced."""
    a0, a1, a2 = M(0, "a0"), M(1, "a1", sealed=101.0), M(2, "a2", sealed=101.5)
    save = EarlierSave()
    now = 100.0 + resave.RESAVE_GAP / 5
    save.withdrawn(a0, [a1], now=now, read=[(0, a0.digest), (1, a1.digest), (2, a2.digest)])
    assert save.began == now and save.cutoff == 100.0
    # rank 1's part held here was sealed after this node's part (a bigger file) and
    # less than a second before the new save began, yet it was read: replaced
    assert set(replaced_pairs(save, [a1])) == {(0, a0.digest), (1, a1.digest), (2, a2.digest)}
    assert save.read == [(1, a1.digest), (2, a2.digest)]  # never this node's own rank


def test_a_file_added_continues_the_save_and_abandoned_parts_are_replaced():
    torn = M(0, "torn", began=90.0)
    old2 = M(2, "abandoned")
    save = EarlierSave(abandoned=[old2])
    save.resealed(torn)
    assert save.began == 90.0
    assert set(replaced_pairs(save)) == {(0, torn.digest), (2, old2.digest)}


def test_files_not_written_since_the_save_began_are_of_the_earlier_save():
    """#14 trial 60: a node of ranks 2 and 3 began saving the step again at t=100; rank
    3 wrote, rank 2 never did (a save cut short): rank 2's file is of the earlier save.
    None when every file or none was written (a save that has not begun writing)."""
    assert not_rewritten({"__2_0.distcp": 90.0, "__3_0.distcp": 100.5}, 100.0) == ["__2_0.distcp"]
    assert not_rewritten({"__2_0.distcp": 101.0, "__3_0.distcp": 100.5}, 100.0) == []
    assert not_rewritten({"__2_0.distcp": 90.0, "__3_0.distcp": 91.0}, 100.0) == []
    # tmpfs stamps with the coarse clock: a file written as the save began is fresh
    assert not_rewritten({"__2_0.distcp": 99.99, "__3_0.distcp": 100.5}, 100.0) == []


def test_a_rank_late_past_the_grace_continues_the_save_cut_short():
    """A part sealed at the end of the rank grace with rank 2's file of the earlier save
    (cut short, save began at 100); rank 2 writes 60 s later, which counts as another
    save (began 160). Only the missing file came: the save cut short goes on, and rank
    3's file, written at 100.5, is not "of an earlier save". A later save that writes
    rank 3's file again is a new save judged on its own start."""
    cut = CutShort(100.0, frozenset({"__2_0.distcp"}))
    late = {"__2_0.distcp": 160.2, "__3_0.distcp": 100.5}
    assert not_rewritten(late, 160.0) == ["__3_0.distcp"]  # without the record
    assert not_rewritten(late, 160.0, cut) == []
    again = {"__2_0.distcp": 90.0, "__3_0.distcp": 200.3}
    assert not_rewritten(again, 200.0, cut) == ["__2_0.distcp"]


def test_the_record_is_bounded():
    own = M(0, "x", replaces=tuple((r, f"d{r}") for r in range(1000)))
    save = EarlierSave()
    save.resealed(own)
    assert len(replaced_pairs(save)) == resave.MAX_REPLACED


def test_the_manifest_carries_the_record_outside_its_digest():
    m = M(0, "a0", began=12.5, sealed=13.0, replaces=((1, "abc-1"), (2, "def-2")))
    back = Manifest.from_json(m.to_json())
    assert (back.replaces, back.began, back.sealed) == (m.replaces, 12.5, 13.0)
    assert back.digest == dataclasses.replace(m, replaces=(), began=0.0, sealed=0.0).digest
    assert b"replaces" not in M(0, "a0").to_json()  # a first save writes no key


# ---------------------------------------------------------------------- the sealer


JOB = JobSpec("j", "generic", 0, 2)


def replica(parts, tmp_path: pathlib.Path, rank: int, step: int, data: bytes) -> Manifest:
    """Rank ``rank``'s part of ``step`` held here as a replica (snapshotted from a
    directory beside the view)."""
    src = tmp_path / f"src{rank}-{len(data)}"
    (src / str(step)).mkdir(parents=True)
    (src / str(step) / f"__{rank}_0.distcp").write_bytes(data)
    shard = parts.shards.snapshot(
        str(src), ShardKey("j", rank, step), str(step), (str(step),), "generic", nodes=2
    )
    parts.catalog.add(shard)
    return shard.manifest


def save_again(parts, path: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """This node saves step 20 again (a training interval after its seal): a write into
    its sealed file ``path``, then the seal."""
    monkeypatch.setattr(resave, "RESAVE_GAP", 0.0)
    parts.agent.intake.write_opening(os.stat(path).st_ino)
    pathlib.Path(path).write_bytes(b"rank 0, second save")

    async def body() -> None:
        parts.agent.sealer.retry_pending("20")
        await trio.testing.wait_all_tasks_blocked()

    run_with_tasks(parts, body)


def test_a_step_saved_again_in_place_records_the_earlier_save_it_replaced(tmp_path, monkeypatch):
    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "generic")
    path = write_step(parts, 20)
    seal(parts, 20)
    key = ShardKey("j", 0, 20)
    a0 = parts.catalog[key].manifest
    assert a0.replaces == () and a0.began == 0.0 and a0.sealed > 0
    a1 = replica(parts, tmp_path, 1, 20, b"rank 1, first save")
    save_again(parts, path, monkeypatch)
    b0 = parts.catalog[key].manifest
    assert b0.digest != a0.digest
    assert set(b0.replaces) == {(0, a0.digest), (1, a1.digest)}
    assert b0.began >= a0.sealed and parts.agent.book.earlier == {}
    # a file added to the step right after: the same save goes on (rank 1's new part,
    # arrived meanwhile, is not replaced)
    monkeypatch.setattr(resave, "RESAVE_GAP", 3600.0)
    b1 = replica(parts, tmp_path, 1, 20, b"rank 1, second save, longer")
    assert b1.digest != a1.digest
    (pathlib.Path(path).parent / "extra.bin").write_bytes(b"added")
    parts.agent.book.generation["20"] += 1  # as the creation's event does

    async def added() -> None:  # what the intake schedules for a file added to a sealed step
        parts.agent.sealer.schedule(SealCandidate(20, "20", ("20",), "changed after seal"))
        await trio.testing.wait_all_tasks_blocked()

    run_with_tasks(parts, added)
    final = parts.catalog[key].manifest
    assert any(f.path == "20/extra.bin" for f in final.files)
    assert (0, b0.digest) in final.replaces and (1, a1.digest) in final.replaces
    assert (1, b1.digest) not in final.replaces
    assert final.began == b0.began


def test_a_new_save_records_the_parts_its_view_showed(tmp_path, monkeypatch):
    """The node-level form of FAIL A: no replica held here, the view shows rank 1's
    part of the earlier save; the new part lists it as replaced (the restore never
    combines it with the new save), from the withdraw through the seal."""
    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "generic")
    path = write_step(parts, 20)
    seal(parts, 20)
    key = ShardKey("j", 0, 20)
    a0 = parts.catalog[key].manifest
    asked: list[tuple[int, int]] = []

    def shown(step: int, nodes: int) -> list[SeenPart]:
        asked.append((step, nodes))
        return [SeenPart(1, "rank-1-first-save", 0.0)]

    parts.agent.book.shown = shown
    save_again(parts, path, monkeypatch)
    b0 = parts.catalog[key].manifest
    assert set(b0.replaces) == {(0, a0.digest), (1, "rank-1-first-save")}
    assert asked and all(a == (20, a0.nodes) for a in asked)


def test_a_save_again_at_once_after_a_load_records_the_parts_read(tmp_path):
    """The node-level form of F3 (#14 trial 55): this node's client read rank 1's part
    after its own seal and wrote its part again less than RESAVE_GAP later; the write
    began another save (its ``began`` is set) that replaces the part read."""
    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "generic")
    path = write_step(parts, 20)
    seal(parts, 20)
    key = ShardKey("j", 0, 20)
    a0 = parts.catalog[key].manifest
    asked: list[tuple[int, float]] = []

    def read_parts(step: int, since: float) -> list[tuple[int, str]]:
        asked.append((step, since))
        return [(1, "rank-1-read")]

    parts.agent.book.read_parts = read_parts
    parts.agent.intake.write_opening(os.stat(path).st_ino)  # RESAVE_GAP as it is
    pathlib.Path(path).write_bytes(b"rank 0, saved again at once")
    parts.agent.book.generation["20"] += 1  # as the close's event does

    async def body() -> None:
        parts.agent.sealer.retry_pending("20")
        await trio.testing.wait_all_tasks_blocked()

    run_with_tasks(parts, body)
    b0 = parts.catalog[key].manifest
    assert asked == [(20, sealed_at(a0))]
    assert set(b0.replaces) == {(0, a0.digest), (1, "rank-1-read")}
    assert b0.began >= a0.sealed > 0


# ---------------------------------------------------------------------- the restore


def H(rank: int, step: int, digest: str, replaces: tuple[tuple[int, str], ...] = ()) -> Holding:
    return Holding(rank, step, True, digest, created=float(step), nodes=3, replaces=replaces)


NEW = ((0, "a0"), (1, "a1"), (2, "a2"))


def survivors() -> dict[int, list[Holding]]:
    """mx_repro.sh after node 2 was lost: step 10 complete; step 20 saved twice, the
    survivors hold their new parts (b0, b1) and rank 2's first-save replica (a2)."""
    inv: dict[int, list[Holding]] = {0: [], 1: []}
    for node in (0, 1):
        inv[node] += [H(r, 10, f"s10-{r}") for r in range(3)]
    inv[0] += [H(0, 20, "b0", NEW), H(1, 20, "b1", NEW), H(2, 20, "a2")]
    inv[1] += [H(1, 20, "b1", NEW), H(0, 20, "b0", NEW)]
    return inv


def test_a_lost_ranks_part_of_the_earlier_save_is_never_combined_with_the_new_one():
    c = choose_restore(2, survivors())
    assert (c.step, c.outcome, c.writers) == (10, OLDER, 3), c
    assert c.problems[0] == (
        "step 20 lacks rank(s) [2] (rank(s) [2]: only a part of an earlier save of step "
        "20 is left; the step was saved again, and no node or backup round holds the new "
        "save's part) (written by 3 nodes; this job has 2)"
    )
    # the same inventory from daemons of before the record: the mix (what F9 was)
    old = {n: [dataclasses.replace(h, replaces=()) for h in hs] for n, hs in survivors().items()}
    assert choose_restore(2, old).step == 20


def test_a_rank_that_saved_identical_bytes_again_is_not_an_earlier_save():
    inv = survivors()
    inv[2] = [H(2, 20, "a2", ((2, "a2"), (0, "a0"), (1, "a1")))]  # node 2 kept: same bytes
    c = choose_restore(3, inv)
    assert (c.step, c.outcome, c.digests) == (20, RESTORED, {0: "b0", 1: "b1", 2: "a2"}), c
    assert replaced_copies(3, [h for hs in inv.values() for h in hs])[(20, 3)] == {
        (0, "a0"),
        (1, "a1"),
    }


def test_the_new_saves_part_of_the_lost_rank_in_a_round_completes_the_step():
    # a round of the new save (rank 1's upload failed): linked to the RAM parts by b0
    parts = tuple(
        BucketPart("2026-12-05_01-30", r, 20, f"b{r}", nodes=3, replaces=NEW) for r in (0, 2)
    )
    c = choose_restore(2, survivors(), bucket=BucketView(parts=parts))
    assert (c.step, c.outcome, c.digests[2]) == (20, RESTORED, "b2"), c


def test_a_whole_round_of_the_earlier_save_is_not_restored_as_the_step():
    """Every RAM tier lost: the first save's round is whole, the second save's round
    was cut off without rank 2. Before: the first save of step 20 came back with exit 0
    (the newer save never mentioned)."""
    r1, r2 = "2026-12-05_01-00", "2026-12-05_01-10"
    parts = tuple(
        [BucketPart(r1, r, 10, f"s10-{r}", nodes=3) for r in range(3)]
        + [BucketPart(r1, r, 20, f"a{r}", nodes=3) for r in range(3)]
        + [BucketPart(r2, r, 20, f"b{r}", nodes=3, replaces=NEW) for r in (0, 1)]
    )
    c = choose_restore(3, {}, bucket=BucketView(parts=parts))
    assert (c.step, c.outcome) == (10, OLDER), c
    assert "(rank(s) [2]: only a part of an earlier save of step 20 is left" in c.problems[0]


@pytest.mark.parametrize("nodes", [3, 4])
def test_a_save_by_another_node_count_does_not_replace_parts(nodes):
    """The record applies within one save's node count: a 4-node save of step 20 is
    judged alone (F3 orders the two saves)."""
    inv = {0: [H(r, 20, f"a{r}") for r in range(3)]}
    inv[0].append(dataclasses.replace(H(0, 20, "x0", NEW), nodes=4))
    c = choose_restore(nodes, inv)
    assert c.step == 20 and c.writers == 3


def test_a_daemon_restarted_before_the_reseal_still_records_the_earlier_save(tmp_path, monkeypatch):
    """The record survives a daemon restart between the write that began the new save
    and its seal (``state.json``). Before, the restarted daemon knew nothing of the
    withdraw: the step counted as one retention had dropped and was never sealed
    again (not replicated, not backed up), and a seal would have recorded nothing."""
    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "generic")
    path = write_step(parts, 20)
    marker = pathlib.Path(path).parent / "commit_success.txt"
    marker.write_bytes(b"ok")
    seal(parts, 20)
    key = ShardKey("j", 0, 20)
    a0 = parts.catalog[key].manifest
    a1 = replica(parts, tmp_path, 1, 20, b"rank 1, first save")
    monkeypatch.setattr(resave, "RESAVE_GAP", 0.0)
    parts.agent.intake.write_opening(os.stat(path).st_ino)
    pathlib.Path(path).write_bytes(b"rank 0, second save")
    marker.unlink()  # the client removes its marker first (DCP's .metadata, overwrite=True)

    async def events() -> None:  # the Withdrawn event reaches the trio thread
        parts.agent.intake.close()
        await parts.agent.intake.process()

    run_with_tasks(parts, events)
    assert key not in parts.catalog
    # the daemon stops before the re-seal; another one starts on the same ram-dir

    again = build(tmp_path)
    again.agent.control.set_job(JOB, "generic")
    again.agent.book.load()
    assert key in again.agent.book.withdrawn_created
    assert again.agent.book.withdrawn_names == {"20": key}
    # the former part's marker counts while the client has not written it again
    assert "20/commit_success.txt" in again.agent.sealer._former_files(20)
    marker.write_bytes(b"ok")

    async def body() -> None:
        await again.agent.sealer.reconcile()
        await trio.testing.wait_all_tasks_blocked()

    run_with_tasks(again, body)
    b0 = again.catalog[key].manifest
    assert b0.digest != a0.digest
    assert set(b0.replaces) == {(0, a0.digest), (1, a1.digest)}
    assert b0.created == a0.created and b0.began > 0
    assert again.agent.book.earlier == {} and again.agent.book.withdrawn_created == {}


def test_a_daemon_killed_before_the_withdraw_was_recorded_seals_the_new_save_at_start(
    tmp_path, monkeypatch
):
    """Regression (tenth #16 trial NOTE C): node 2's daemon was killed milliseconds
    after the write that began a new save of step 30, before ``state.json`` recorded
    the withdraw; the restarted daemon took the complete new part in its RAM for the
    step retention had dropped ("not sealed again"), so it was never replicated and
    the restore took an older step. Now the files written after the recorded seal
    time say it is a new save: it is sealed again at start."""
    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "generic")
    path = write_step(parts, 20)
    (pathlib.Path(path).parent / "commit_success.txt").write_bytes(b"ok")  # found at start
    seal(parts, 20)
    key = ShardKey("j", 0, 20)
    a0 = parts.catalog[key].manifest
    parts.agent.book.save()  # state.json as of the seal
    monkeypatch.setattr(resave, "RESAVE_GAP", 0.0)
    parts.agent.intake.write_opening(os.stat(path).st_ino)  # no event handled: killed
    pathlib.Path(path).write_bytes(b"rank 0, second save")
    os.utime(path, (a0.sealed + 1, a0.sealed + 1))  # written after the seal (coarse clocks)

    again = build(tmp_path)
    again.agent.control.set_job(JOB, "generic")
    again.agent.book.load()
    assert key not in again.agent.book.withdrawn_created  # the record was lost
    assert again.agent.book.sealed_times == {key: sealed_at(a0)}

    async def body() -> None:
        await again.agent.sealer.reconcile()
        await trio.testing.wait_all_tasks_blocked()

    run_with_tasks(again, body)
    b0 = again.catalog[key].manifest
    assert b0.digest != a0.digest
    assert [f.size for f in b0.files if f.path == "20/" + os.path.basename(path)] == [19]


def test_a_step_retention_dropped_and_nobody_wrote_is_not_sealed_again_at_start(tmp_path):
    """The other side of NOTE C's fix (#16 fourth trial F7 kept): a step whose snapshot
    retention dropped, its files not written since, is not sealed again at start."""
    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "generic")
    path = write_step(parts, 20)
    (pathlib.Path(path).parent / "commit_success.txt").write_bytes(b"ok")  # found at start
    seal(parts, 20)
    key = ShardKey("j", 0, 20)
    parts.agent.keeper.drop_shard(key, "retention")
    parts.agent.book.save()

    again = build(tmp_path)
    again.agent.control.set_job(JOB, "generic")
    again.agent.book.load()
    assert key in again.agent.book.sealed_times

    async def body() -> None:
        await again.agent.sealer.reconcile()
        await trio.testing.wait_all_tasks_blocked()

    run_with_tasks(again, body)
    assert key not in again.catalog


def test_the_record_round_trips_through_state_json_and_a_bad_one_is_left_out():
    e = EarlierSave(began=5.0, cutoff=3.0, own=[M(0, "a0")], held=[M(1, "a1", began=1.0)])
    saved = statefile.SavedState(
        withdrawn={ShardKey("j", 0, 20): 1.5}, earlier={ShardKey("j", 0, 20): e}
    )
    back = statefile.decode(json.loads(statefile.encode(saved)))
    assert back.withdrawn == {ShardKey("j", 0, 20): 1.5}
    got = back.earlier[ShardKey("j", 0, 20)]
    assert (got.began, got.cutoff, got.files()) == (5.0, 3.0, ["20", "20/__0_0.distcp"])
    assert replaced_pairs(got) == replaced_pairs(e)
    bad = json.loads(statefile.encode(saved))
    bad["earlier"] = [["j", 0, 20, {"began": "x"}]]
    bad["withdrawn"] = [["j", 0]]
    back = statefile.decode(bad)
    assert back.earlier == {} and back.withdrawn == {}


def _part(rank: int, body: bytes, *, sealed: float, began: float = 0.0, replaces=()) -> Manifest:
    import google_crc32c

    entries = (
        FileEntry(f"20/__{rank}_0.distcp", "file", len(body), 0o644, google_crc32c.value(body)),
    )
    return Manifest(
        "j",
        rank,
        20,
        "20",
        "generic",
        entries,
        created=sealed,
        sealed=sealed,
        began=began,
        replaces=tuple(replaces),
    )


def test_earlier_parts_names_a_part_of_an_earlier_save_and_never_one_of_the_same_save():
    """The two signs of tierfs.store.saves.earlier_parts (ninth trial FAIL 15/16): a part
    another part lists as replaced (unless a part of those very bytes lists itself),
    and a part unchanged since before the newest save began (the prior digests the
    judging node saw), sealed before it, its own save RESAVE_GAP or more before it.
    A rank of the same save that began writing late has other bytes: never earlier
    (tenth trial: one rank 8-25 s late was refused)."""
    from tierfs.store.saves import RESAVE_GAP, earlier_parts

    t = 1_000_000.0
    first = {r: _part(r, b"first %d" % r, sealed=t) for r in range(3)}
    prior = {r: m.digest for r, m in first.items()}
    again = {
        r: _part(r, b"again %d" % r, sealed=t + 60 + r, began=t + 50 + 2 * r) for r in range(3)
    }
    # one save, first or again, staggered: nothing earlier
    assert earlier_parts(first.values(), prior=prior) == {}
    assert earlier_parts(again.values(), prior=prior) == {}
    # one rank 25 s late, sealed after or even before... its bytes changed: the same save
    late = _part(2, b"again 2", sealed=t + 80, began=t + 75)
    assert earlier_parts([again[0], again[1], late], prior=prior) == {}
    early = dataclasses.replace(again[0], began=t + 20, sealed=t + 21)
    assert earlier_parts([early, again[1], late], prior=prior) == {}
    # rank 2's new save never came: its part is the one seen before the new save
    mixed = earlier_parts([again[0], again[1], first[2]], prior=prior)
    assert list(mixed) == [2] and "unchanged since before rank 1 began" in mixed[2]
    # ... not said without the prior digests (a daemon restarted since)
    assert earlier_parts([again[0], again[1], first[2]]) == {}
    # ... and when a part held elsewhere lists it (the listed sign), with or without
    lister = dataclasses.replace(again[0], replaces=((2, first[2].digest),))
    assert earlier_parts([again[1], first[2]], also_listed=[lister]).keys() == {2}
    assert "lists it as replaced" in earlier_parts([first[2]], also_listed=[lister])[2]
    # rank 2 saved identical bytes again: a part of those bytes lists itself
    renewed = dataclasses.replace(
        first[2], began=t + 52, sealed=t + 61, replaces=((2, first[2].digest),)
    )
    assert earlier_parts([lister, again[1], renewed], prior=prior) == {}
    # the timestamps must agree: an unchanged part whose save began less than the gap
    # before the newest one (two saves are never that close) is not called earlier
    near = dataclasses.replace(first[2], sealed=t + 51, began=t + 52 - RESAVE_GAP + 0.5)
    assert earlier_parts([again[0], again[1], near], prior={**prior, 2: near.digest}) == {}


def test_another_ranks_first_save_sealed_after_this_node_began_again_is_not_replaced(
    tmp_path, monkeypatch
):
    """Regression (#14 trial 57 H1, HIGH): rank 0 was killed before DCP's ``.metadata``
    and the save was retried into the same directory. Node 0 had never sealed a part of
    the step, so its part of the retry was a first save (``began`` 0); node 1 sealed its
    own part of the retry after it arrived and listed it as replaced ("of an earlier
    save"), and every node refused rank 0's new part: ``dcp.load`` failed although the
    save had succeeded. A first save of another rank sealed after this node began its
    new save is of the new save."""
    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "generic")
    path = write_step(parts, 20)
    seal(parts, 20)
    key = ShardKey("j", 0, 20)
    a0 = parts.catalog[key].manifest
    old1 = replica(parts, tmp_path, 1, 20, b"rank 1, the failed save")  # sealed before
    monkeypatch.setattr(resave, "RESAVE_GAP", 0.0)
    parts.agent.intake.write_opening(os.stat(path).st_ino)  # this node saves again
    pathlib.Path(path).write_bytes(b"rank 0, the retried save")
    time.sleep(0.01)
    new1 = replica(parts, tmp_path, 1, 20, b"rank 1, its first seal: of the retry")

    async def body() -> None:
        parts.agent.sealer.retry_pending("20")
        await trio.testing.wait_all_tasks_blocked()

    run_with_tasks(parts, body)
    b0 = parts.catalog[key].manifest
    assert (0, a0.digest) in b0.replaces and (1, old1.digest) in b0.replaces
    assert (1, new1.digest) not in b0.replaces


def test_a_step_removed_and_made_again_is_another_save_of_it(tmp_path, monkeypatch):
    """Regression (#14 trial 66 H1, silent wrong values): ``rm -rf`` of a sealed step on
    every node, then the step saved again. The new files are new inodes (no write into
    a sealed file), so this node went on naming its earlier part until the new seal,
    and another node placed that part's files. Making the step directory again now
    withdraws the part (the node answers "being saved again"), and the new seal
    records the parts it replaces. A change of the sealed directory's attributes, or a
    file made in it, withdraws nothing."""
    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "generic")
    path = write_step(parts, 20)
    seal(parts, 20)
    key = ShardKey("j", 0, 20)
    a0 = parts.catalog[key].manifest
    a1 = replica(parts, tmp_path, 1, 20, b"rank 1, first save")
    events = parts.agent.fs_events()
    top = pathlib.Path(path).parent
    events.changed(b"20")  # the sealed directory's attributes (chmod, utime)
    marker = top.parent / "20.marker"  # a restore marker renamed into a step's name
    marker.symlink_to(".sibling")
    assert parts.agent.intake._new_entry("20.marker") is False
    (top / "other.bin").write_bytes(b"added")
    events.changed(b"20/other.bin")
    assert parts.catalog.get(key) is not None and not parts.agent.book.resaving(key)
    monkeypatch.setattr(resave, "RESAVE_GAP", 0.0)
    for p in top.iterdir():
        p.unlink()
    top.rmdir()  # the client removes the step: the snapshot stays
    events.changed(b"20")
    assert parts.catalog.get(key) is not None and not parts.agent.book.resaving(key)
    top.mkdir()  # and makes it again: another save
    events.changed(b"20")
    assert parts.catalog.get(key) is None and parts.agent.book.resaving(key)
    pathlib.Path(path).write_bytes(b"rank 0, second save")

    async def body() -> None:
        for event in (b"20", b"20/data.bin"):
            await parts.agent.intake.handle(Changed(os.fsdecode(event)))
        parts.agent.sealer.retry_pending("20")
        await trio.testing.wait_all_tasks_blocked()

    run_with_tasks(parts, body)
    b0 = parts.catalog[key].manifest
    assert b0.digest != a0.digest and b0.began >= a0.sealed
    assert set(b0.replaces) == {(0, a0.digest), (1, a1.digest)}


def test_a_directory_renamed_into_a_removed_steps_name_is_another_save_of_it(tmp_path):
    """Orbax writes a step into a temporary directory and renames it into place: after
    the step was removed, that rename begins another save of it as ``mkdir`` does."""
    parts = build(tmp_path)
    parts.agent.control.set_job(JOB, "generic")
    path = write_step(parts, 20)
    seal(parts, 20)
    key = ShardKey("j", 0, 20)
    top = pathlib.Path(path).parent
    for p in top.iterdir():
        p.unlink()
    top.rmdir()
    tmp = top.parent / "20.orbax-checkpoint-tmp-1"
    tmp.mkdir()
    (tmp / "data.bin").write_bytes(b"rank 0, second save")
    os.rename(tmp, top)
    parts.agent.fs_events().renamed(b"20.orbax-checkpoint-tmp-1", b"20", 0o040755)
    assert parts.catalog.get(key) is None and parts.agent.book.resaving(key)
