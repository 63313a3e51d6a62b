"""Issue #16: a step is judged against the node count that wrote it (its writer
topology), whatever node count restores it: shrink, growth, one step number written
by two node counts, the bucket, the coordinator's generations and what a node added
since the step was written is told."""

from __future__ import annotations

import pytest

from tierfs.cli.wait import wait_outcome
from tierfs.cluster.coordinator import DECIDED, Coordinator, Rejected
from tierfs.cluster.restore_choice import INCOMPLETE, OLDER, RESTORED, choose_restore
from tierfs.core.control import JobSpec
from tierfs.core.types import BucketPart, BucketView, Holding
from tierfs.node import statefile
from tierfs.replication.files import holders_of, receivers_of
from tierfs.store.manifest import FileEntry, Manifest


def H(rank: int, step: int, nodes: int, created: float = 0.0, digest: str = "") -> Holding:
    return Holding(
        rank, step, True, digest or f"d{rank}-{step}-{nodes}", created=created, nodes=nodes
    )


def four_node_step(step: int = 30) -> dict[int, list[Holding]]:
    """Step ``step`` written by 4 nodes, held by the 3 survivors of node 3 (pairs
    0-1 and 2-3 replicate to each other with one peer per node: node 2 holds rank 3's
    replica)."""
    return {
        0: [H(0, step, 4), H(1, step, 4)],
        1: [H(1, step, 4), H(0, step, 4)],
        2: [H(2, step, 4), H(3, step, 4)],
    }


def test_a_step_written_by_four_nodes_is_restored_by_three():
    c = choose_restore(3, four_node_step())
    assert (c.step, c.writers, c.outcome) == (30, 4, RESTORED)
    # every rank of the writers, the lost one's from its replica
    assert c.holders == {0: (0, 1), 1: (0, 1), 2: (2,), 3: (2,)}
    assert c.reason == "step 30 is complete in the cluster (written by 4 nodes; this job has 3)"


def test_a_lost_rank_without_a_copy_makes_the_step_incomplete_not_restored():
    inv = four_node_step(30)
    inv[2] = [h for h in inv[2] if h.rank != 3]  # rank 3's part was never replicated
    for node, rank in ((0, 0), (1, 1), (2, 2)):
        inv[node].append(H(rank, 20, 4))
    inv[2].append(H(3, 20, 4))
    c = choose_restore(3, inv)
    assert (c.step, c.writers, c.outcome) == (20, 4, OLDER)
    assert "step 30 lacks rank(s) [3] (written by 4 nodes; this job has 3)" in c.problems
    # regression: counted against the 3 ranks of the new job, step 30 was "complete"
    del inv[2][-1]
    c = choose_restore(3, inv)
    assert (c.step, c.outcome) == (None, INCOMPLETE), c


def test_growth_restores_the_newest_step_whatever_node_count_wrote_it():
    inv = four_node_step(30)
    for node in range(3):
        inv[node].append(H(node, 40, 3))
    c = choose_restore(5, {**inv, 3: [], 4: []})
    # regression: the 4-node step 30 was restored and the complete 3-node step 40
    # dropped as abandoned
    assert (c.step, c.writers, c.outcome) == (40, 3, RESTORED)
    assert sorted(c.holders) == [0, 1, 2]
    assert "(written by 3 nodes; this job has 5)" in c.reason


def test_one_step_number_written_by_two_node_counts_is_never_mixed():
    # step 40 first by 4 nodes (ranks 0, 1 and 3 sealed), then, after a restart on 3
    # nodes from an older step, by 3 nodes (only rank 2 sealed yet): rank 2 of the
    # 3-node save never completes the 4-node one
    inv = {
        0: [H(0, 40, 4, created=100), H(3, 40, 4, created=100), H(0, 30, 3)],
        1: [H(1, 40, 4, created=100), H(1, 30, 3)],
        2: [H(2, 40, 3, created=200), H(2, 30, 3)],
    }
    c = choose_restore(3, inv)
    assert (c.step, c.writers) == (30, 3), c
    assert "step 40 lacks rank(s) [2] (written by 4 nodes; this job has 3)" in c.problems
    assert "step 40 lacks rank(s) [0, 1]" in c.problems
    # both complete: the newer seal wins
    inv[0].append(H(0, 40, 3, created=200))
    inv[1].append(H(1, 40, 3, created=200))
    inv[2].append(H(2, 40, 4, created=100))
    c = choose_restore(3, inv)
    assert (c.step, c.writers, c.outcome) == (40, 3, RESTORED)
    assert c.digests == {0: "d0-40-3", 1: "d1-40-3", 2: "d2-40-3"}
    # the newer seal incomplete: the older save of step 40 is restored, an older state
    # than the job saved last (the #16 fourth trial: exit 0 and no word of the newer
    # save); said as such, not as "not the newest step" (an earlier trial)
    for node in (0, 1):
        inv[node] = [h for h in inv[node] if h.nodes != 3 or h.step != 40]
    inv[0].append(H(2, 40, 4, created=100))
    c = choose_restore(3, inv)
    assert (c.step, c.writers, c.outcome) == (40, 4, OLDER), c
    assert c.problems[0] == (
        "step 40 was saved again by 3 node(s) after the save restored (written by 4 "
        "nodes), and that newer save is incomplete (step 40 lacks rank(s) [0, 1]): the "
        "earlier save of step 40 is restored"
    )
    # the same two saves in the bucket only (every RAM tier lost): the newer round
    # is the newer save, however many nodes wrote the older one
    old = tuple(BucketPart(RND, r, 40, f"d{r}-40-4", nodes=4) for r in range(4))
    new = tuple(BucketPart(RND2, r, 40, f"d{r}-40-3", nodes=3) for r in (0, 1))
    c = choose_restore(2, {0: [], 1: []}, bucket=BucketView(parts=old + new, rounds=(RND2, RND)))
    assert (c.step, c.writers, c.backup, c.outcome) == (40, 4, RND, OLDER), c
    assert "step 40 was saved again by 3 node(s)" in c.problems[0]
    assert "(written by 3 nodes; this job has 2)" in c.problems[0]
    # the newer save complete: it is the one restored
    full = (*new, BucketPart(RND2, 2, 40, "d2-40-3", nodes=3))
    c = choose_restore(2, {0: [], 1: []}, bucket=BucketView(parts=old + full, rounds=(RND2, RND)))
    assert (c.step, c.writers, c.backup, c.outcome) == (40, 3, RND2, RESTORED), c


def test_copies_without_a_recorded_count_are_the_jobs():
    inv = {0: [Holding(0, 5, True, "a"), Holding(1, 5, True, "b")], 1: [Holding(1, 5, True, "b")]}
    c = choose_restore(2, inv)
    assert (c.step, c.writers) == (5, 2)
    assert "written by" not in c.reason


RND = "2026-12-01_10-00"
RND2 = "2026-12-01_10-05"


def test_a_bucket_round_written_by_four_nodes_restores_a_three_node_job():
    parts = tuple(BucketPart(RND, r, 30, f"d{r}-30-4", nodes=4) for r in range(4))
    bucket = BucketView(parts=parts, rounds=(RND,))
    c = choose_restore(3, {0: [], 1: [], 2: []}, bucket=bucket)
    assert (c.step, c.writers, c.backup) == (30, 4, RND)
    assert c.rounds == {r: (RND,) for r in range(4)}
    assert bucket.floor(3) == 30  # complete for its own 4 nodes
    # the same round without rank 3: not complete, however many nodes restore it
    short = BucketView(parts=parts[:3], rounds=(RND,))
    assert choose_restore(3, {0: [], 1: [], 2: []}, bucket=short).step is None
    assert short.floor(3) is None


def test_manifest_records_the_writers_and_reads_old_manifests():
    m = Manifest("j", 1, 5, "5", "generic", (FileEntry("5", "dir", 0, 0o755),), nodes=4)
    back = Manifest.from_json(m.to_json())
    assert back.nodes == 4 and back.digest == m.digest
    old = Manifest("j", 1, 5, "5", "generic", m.files)
    assert b'"nodes"' not in old.to_json() and Manifest.from_json(old.to_json()).nodes == 0
    # the digest is the bytes' identity: the same files written by another count agree
    assert old.digest == m.digest


# ---------------------------------------------------------------------- the coordinator


def join(c: Coordinator, rank: int, nodes: int, inv=(), rid: str | None = None):
    return c.join(
        "job", nodes, rank, f"10.0.0.{rank}:7000", f"inc{rank}", inv, rid or f"r{rank}", "generic"
    )


def test_a_node_added_since_the_step_gets_the_step_and_no_part():
    c = Coordinator(clock=lambda: 1000.0, wall=lambda: 1000.0)
    join(c, 0, 3, [H(0, 40, 2), H(1, 40, 2)])
    join(c, 1, 3, [H(1, 40, 2), H(0, 40, 2)])
    join(c, 2, 3, [])
    v = c.decide("job", 2, "r2")
    assert (v.state, v.step, v.writers) == (DECIDED, 40, 2)
    assert (v.local, v.sources, v.backup, v.backups, v.digest) == (False, (), None, (), "")
    v0 = c.decide("job", 0, "r0")
    assert (v0.step, v0.writers, v0.local) == (40, 2, True)


def test_generations_of_the_job_at_the_coordinator():
    c = Coordinator(clock=lambda: 1000.0, wall=lambda: 1000.0)
    join(c, 0, 4)
    join(c, 1, 4)
    assert (c.generation, c.nodes) == (1, 4)
    # a member of the old generation is refused with what to do
    with pytest.raises(Rejected, match=r"restart node-rank 0 with --nodes 3"):
        join(c, 1, 3)
    join(c, 0, 3)  # node-rank 0 restarted with the new count: a new generation
    assert (c.generation, c.nodes) == (2, 3)
    join(c, 1, 3)
    st = c.status().to_json()
    assert (st["generation"], st["nodes"]) == (2, 3)
    with pytest.raises(Rejected, match="node count mismatch") as refused:
        join(c, 2, 4)
    assert "or remount this node with --nodes 3" in str(refused.value)
    # node-rank 3 does not exist in a 3-node job: never told to use --nodes 3
    # (regression, new-user trial)
    with pytest.raises(Rejected, match="node count mismatch") as refused:
        join(c, 3, 4)
    assert str(refused.value).endswith("(to resize the job, restart node-rank 0 with --nodes 4)")


def test_a_protocol_mode_node_of_another_count_is_told_about_replicator_yaml():
    """Regression: in MTC protocol mode (no --nodes flag: the count is in the client's
    replicator.yaml) the refusal said to restart with --nodes."""
    c = Coordinator(clock=lambda: 1000.0, wall=lambda: 1000.0)
    c.join("job", 4, 0, "10.0.0.0:7000", "inc0", (), "r0")
    c.join("job", 4, 1, "10.0.0.1:7000", "inc1", (), "r1")
    with pytest.raises(Rejected) as got:
        c.join("job", 3, 1, "10.0.0.1:7000", "inc1b", (), "r1b")
    msg = str(got.value)
    assert "node-rank 0's client must restart with nodes: 3 in its replicator.yaml" in msg
    assert "--nodes" not in msg


# ---------------------------------------------------------------------- placement, wait


def test_replica_holders_follow_the_writers_placement():
    job = JobSpec("j", "generic", node_rank=0, nodes=3, peers_per_node=1)
    # rank 3 of a 4-node step: its replica went to its pair, node 2 (on 3 nodes the
    # placement differs: rank 2 replicates to node 0)
    assert receivers_of(job, 3, 4) == [2]
    assert receivers_of(job, 2, 4) == [] and receivers_of(job, 2) == [0]
    # ranks the job no longer has are never named
    assert all(r < 3 for w in (4, 5, 8) for rank in range(w) for r in receivers_of(job, rank, w))
    assert receivers_of(job, 1) == [0]
    # where a lost rank's part is: its replica holder by the old placement, then that
    # holder's receivers today (where it copies the part again)
    assert holders_of(job, 3, 4) == [2, 0]
    assert holders_of(job, 1, 4) == [1, 0]  # the owner is still there
    assert holders_of(job, 2, 4) == [2]  # its old receiver, node 3, is gone


def test_a_part_whose_owner_and_receiver_are_declared_gone_is_asked_of_the_stand_in():
    """Regression (new-user trial, job k): 4 nodes in pairs 0-1 and 2-3; node 3 declared
    gone, so node 2 sent its parts to its stand-in, node 0; then node 2 declared gone.
    The other nodes asked nodes 2 and 3 for rank 2's files ("no address known here")
    and read EIO although node 0 held them."""
    job = JobSpec("k", "generic", node_rank=1, nodes=4, peers_per_node=1)
    assert holders_of(job, 2) == [2, 3]  # nobody gone: the owner, its receiver
    assert holders_of(job, 2, gone=frozenset({3})) == [2, 0]
    assert holders_of(job, 2, gone=frozenset({2, 3})) == [0]
    assert holders_of(job, 3, gone=frozenset({2, 3})) == [0]
    assert holders_of(job, 0, gone=frozenset({2, 3})) == [0, 1]  # nothing gone of its own
    # a rank the job no longer has: as before, and never a gone one
    small = JobSpec("j", "generic", node_rank=0, nodes=3, peers_per_node=1)
    assert holders_of(small, 3, 4, gone=frozenset({2})) == [0]


@pytest.mark.parametrize(
    ("restore", "nodes", "line"),
    [
        (
            {"state": "done", "step": 30, "source": "local", "writers": 4, "outcome": "restored"},
            3,
            "restored step 30 from local (written by 4 nodes; this job has 3)",
        ),
        (
            {"state": "done", "step": 30, "source": "local", "writers": 3, "outcome": "restored"},
            3,
            "restored step 30 from local",
        ),
        (
            {"state": "done", "step": 40, "source": "none", "writers": 3, "outcome": "restored"},
            5,
            "restored step 40 (written by 3 nodes: this node holds no part of it; the other "
            "ranks' files are in the view)",
        ),
    ],
)
def test_wait_says_the_writer_topology(restore, nodes, line):
    assert wait_outcome(restore, nodes) == (0, line)


def test_a_restarted_coordinator_continues_the_generation_or_starts_the_next():
    told: list[tuple[str, int, int, float]] = []

    def coordinator(memory, at):
        return Coordinator(
            clock=lambda: 1000.0,
            wall=lambda: at,
            generation=memory,
            on_generation=lambda *g: told.append(g),
        )

    c = coordinator(None, 100.0)
    join(c, 0, 4)
    assert (c.generation, c.generation_since, told[-1]) == (1, 100.0, ("job", 4, 1, 100.0))
    # node-rank 0 restarted with the same count: the same generation
    c = coordinator(told[-1], 200.0)
    join(c, 0, 4)
    assert (c.generation, c.generation_since) == (1, 100.0)
    # with another count: the next one, from now
    c = coordinator(told[-1], 300.0)
    join(c, 0, 3)
    assert (c.generation, c.generation_since, told[-1]) == (2, 300.0, ("job", 3, 2, 300.0))
    # another job starts at 1
    c = coordinator(told[-1], 400.0)
    c.join("other", 2, 0, "10.0.0.0:7000", "inc0", (), "r0", "generic")
    assert c.generation == 1


def test_the_generation_file_round_trips(tmp_path):
    assert statefile.load_generation(str(tmp_path)) is None
    statefile.save_generation(str(tmp_path), "job", 3, 2, 300.5)
    assert statefile.load_generation(str(tmp_path)) == ("job", 3, 2, 300.5)
    (tmp_path / statefile.GENERATION_FILE).write_text("{")
    assert statefile.load_generation(str(tmp_path)) is None


def test_waiting_nodes_are_told_a_missing_rank_came_with_another_count():
    t = [1000.0]
    c = Coordinator(clock=lambda: t[0], wall=lambda: t[0])
    join(c, 0, 3, rid="r0")
    with pytest.raises(Rejected):
        join(c, 2, 4)  # node 2 still runs with the old count
    v = c.decide("job", 0, "r0")
    assert v.missing == (1, 2)
    assert v.waiting_for == (
        "joined with another node count (node-rank 2 with --nodes 4; this generation has 3 nodes)"
    )
    t[0] += 61  # an old refusal is not named any more
    assert c.decide("job", 0, "r0").waiting_for == ""


def test_a_save_in_place_keeps_its_first_seal_time_and_is_still_the_newer_save():
    """#16 N2 repro: step 20 saved by 4 nodes, then again in place by 3 (each part
    re-sealed keeps the step's first seal time, for retention, and lists the 4-node
    parts it replaced); node 3 rejoined holding its 4-node part, sealed a little later.
    By seal times alone the 4-node save looked newer: every node's wait exited 2 with
    ``step 20 was saved again by 4 node(s) after the save restored``."""
    replaced = tuple((r, f"d{r}-20-4") for r in range(4))

    def new(rank: int) -> Holding:
        return Holding(rank, 20, True, f"d{rank}-20-3", created=100, nodes=3, replaces=replaced)

    inv = {
        0: [new(0), new(2)],
        1: [new(1), new(0)],
        2: [new(2), new(1)],
        3: [H(3, 20, 4, created=101), H(2, 20, 4, created=101)],
    }
    c = choose_restore(4, inv)
    assert (c.step, c.writers, c.outcome) == (20, 3, RESTORED), c
    assert not c.problems, c.problems
