"""The seeded randomized fault campaign of issue 19 (tests/support/fault_campaign.py): its
schedule and oracle as pure functions, and 18 injections against 4 real daemons with
the real fake-gcs-server (``make soak`` runs the same engine longer)."""

from __future__ import annotations

import pytest
from fault_campaign import CAMPAIGN_ENV, CORRUPTION, KINDS, Campaign, schedule, summarize
from fault_oracle import (
    GroundTruth,
    NodeRestore,
    counted_copies,
    expected_restore,
    judge,
)

SEED = 19
INJECTIONS = 18  # every kind once per client mode


def test_schedule_is_a_function_of_the_seed_and_covers_every_kind():
    a = schedule(SEED, INJECTIONS)
    assert a == schedule(SEED, INJECTIONS)
    assert a != schedule(SEED + 1, INJECTIONS)
    for mode in ("mtc", "generic"):
        half = [i for i in a if i.mode == mode]
        assert len(half) == INJECTIONS // 2
        assert {i.kind for i in half} == set(KINDS)  # both corruption kinds in each mode
    assert all(i.settle == "backed_up" for i in a if i.kind == "flip_bucket")
    assert all(i.settle == "replicated" for i in a if i.kind == "flip_replica")
    assert set(CORRUPTION) <= set(KINDS)
    only = schedule(3, 9, mode="mtc", kinds=("node_loss",))
    assert {i.kind for i in only} == {"node_loss"} and {i.mode for i in only} == {"mtc"}


def truth_with(steps: int, nodes: int = 4) -> GroundTruth:
    """Versions 1..steps, each sealed by every rank (digest "d<seq>/<rank>")."""
    t = GroundTruth()
    for s in range(1, steps + 1):
        v = t.new_version(s, 1)
        for r in range(nodes):
            t.sealed(v, r, f"d{v.seq}/{r}")
    return t


def full_copies(seqs: list[int], nodes: int = 4) -> set[tuple[int, int, int, int]]:
    """Own copies on every node and a replica on rank ^ 1, for these versions (seq = step)."""
    return {(h, r, s, s) for s in seqs for r in range(nodes) for h in (r, r ^ 1)}


def test_retention_filter_drops_copies_keep_local_may_remove():
    t = truth_with(3)
    listed = full_copies([1, 2, 3])
    counted = counted_copies(listed, t.versions, {r: [r ^ 1] for r in range(4)}, keep_local=2)
    assert {c[3] for c in counted} == {2, 3}  # step 1 has two newer steps on every holder
    # a step sealed after the snapshot (no copy listed yet) still pushes the oldest out
    v = t.new_version(4, 1)
    t.sealed(v, 0, "d4/0")
    counted = counted_copies(listed, t.versions, {r: [r ^ 1] for r in range(4)}, keep_local=2)
    assert (0, 0, 2, 2) not in counted and (1, 0, 2, 2) not in counted
    assert (2, 2, 2, 2) in counted
    # abandoned history does not push anything out
    t.restored(1, 3)
    counted = counted_copies(listed, t.versions, {r: [r ^ 1] for r in range(4)}, keep_local=2)
    assert (0, 0, 2, 2) in counted


def test_oracle_node_loss_with_an_unreplicated_newest_step():
    t = truth_with(2)
    copies = full_copies([1]) | {(r, r, 2, 2) for r in range(4)}  # step 2 not replicated
    exp = expected_restore(copies, {}, t.versions, 4, lost_nodes=[3], all_copies=copies)
    assert (exp.floor_step, exp.where, exp.newest_step) == (1, "cluster", 2)
    ok = {i: NodeRestore(1, 1, errors=["restore: step 2 lacks rank 3"]) for i in range(4)}
    assert judge(ok, exp, t.versions) == []
    silent = {i: NodeRestore(1, 1) for i in range(4)}
    assert judge(silent, exp, t.versions)[0].startswith("unexplained fallback to step 1")
    older = {i: NodeRestore(None, wait_rc=1, errors=["restore: x"]) for i in range(4)}
    assert "fresh start although step 1" in judge(older, exp, t.versions)[0]


def test_oracle_cluster_wins_over_a_newer_bucket_round_and_corruption_destroys():
    t = truth_with(3)
    copies = full_copies([2, 3])
    rounds = {"2026-12-01_10-01": 1, "2026-12-01_10-02": 2}
    # the replica of rank 1's step 3 on node 0 is corrupt and node 1 is lost
    exp = expected_restore(
        copies, rounds, t.versions, 4, lost_nodes=[1], bad_copies=[(0, 1, 3, 3)], all_copies=copies
    )
    assert (exp.floor_step, exp.where) == (2, "cluster")
    # the whole cluster is lost and the newest round has a flipped bit: the older round
    exp = expected_restore(
        copies,
        rounds,
        t.versions,
        4,
        lost_nodes=range(4),
        bad_rounds=["2026-12-01_10-02"],
        all_copies=copies,
    )
    assert (exp.floor_step, exp.where, exp.newest_step) == (1, "bucket", 2)
    silent = {i: NodeRestore(1, 1) for i in range(4)}  # the corrupt round 2 must be named
    assert judge(silent, exp, t.versions)[0].startswith("unexplained fallback to step 1")
    # the whole cluster is lost: a step only RAM held is gone without a trace
    exp = expected_restore(
        copies, {"2026-12-01_10-01": 1}, t.versions, 4, lost_nodes=range(4), all_copies=copies
    )
    assert (exp.floor_step, exp.newest_step) == (1, 1)
    # step 3 sealed on every node but not replicated, node 3 lost, the bucket stalled for
    # the whole restore: nothing is provable, but the survivors' step 3 needs a word
    own = {(r, r, 3, 3) for r in range(4)}
    exp = expected_restore(
        own, rounds, t.versions, 4, lost_nodes=[3], bucket_usable=False, all_copies=own
    )
    assert exp.floor is None and exp.newest_step == 3
    fresh = {i: NodeRestore(None, wait_rc=0, errors=["restore: bucket stalled"]) for i in range(4)}
    assert judge(fresh, exp, t.versions) == [
        "fresh start while step 3 existed, but every `tierfs wait` exited 0"
    ]
    fresh[2].wait_rc = 1
    assert judge(fresh, exp, t.versions) == []


def test_oracle_split_and_wrong_bytes():
    t = truth_with(30)
    exp = expected_restore(full_copies([30]), {}, t.versions, 4, all_copies=full_copies([30]))
    split = {i: NodeRestore(30, 30) for i in range(3)} | {3: NodeRestore(27, 27)}
    assert judge(split, exp, t.versions) == [
        "split restore: node 0 step 30, node 1 step 30, node 2 step 30, node 3 step 27"
    ]
    wrong = {i: NodeRestore(30, 30) for i in range(4)}
    wrong[2] = NodeRestore(30, error="step 30's bytes (6 files) match no save of rank 2")
    assert judge(wrong, exp, t.versions) == [
        "node 2: step 30's bytes (6 files) match no save of rank 2"
    ]
    newer = {i: NodeRestore(30, 30) for i in range(4)}
    assert judge(newer, expected_restore(set(), {}, t.versions, 4), t.versions) == []


@pytest.mark.long(minutes=4)
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_fault_campaign(make_mount, fake_gcs, monkeypatch, tmp_path):
    """18 seeded injections, every kind once in both client modes; every restore judged by
    the oracle of tests/support/fault_oracle.py (the per-injection lines are printed)."""
    for k, v in CAMPAIGN_ENV.items():
        monkeypatch.setenv(k, v)
    camp = Campaign(
        make_mount, fake_gcs, seed=SEED, injections=INJECTIONS, out=tmp_path / "campaign"
    )
    records = camp.run()
    print(summarize(records))
    assert len(records) == INJECTIONS
    assert {r.kind for r in records} == set(KINDS)
    failed = [r for r in records if not r.ok]
    assert not failed, camp.failure_report()
