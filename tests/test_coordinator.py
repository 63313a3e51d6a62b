"""The coordinator's decisions and rounds as pure logic (no gRPC, no mounts)."""

from __future__ import annotations

import pytest

from tierfs.coordinator import (
    DECIDED,
    PASSED,
    REJOIN,
    REPLAN,
    WAITING,
    Choice,
    Coordinator,
    Holding,
    Rejected,
    choose_restore,
    sources_for,
)
from tierfs.tiers.gcs_schedule import (
    COMPLETE,
    DONE,
    FAILED,
    INCOMPLETE,
    RUNNING,
    Outcome,
    RoundBook,
    RoundView,
)


def H(rank, step, digest=None, verified=True):
    return Holding(rank, step, verified, digest or f"d{rank}-{step}")


# ---------------------------------------------------------------------- choose_restore


def test_newest_step_complete_for_every_rank():
    inv = {0: [H(0, 4), H(0, 5), H(1, 4), H(1, 5)],
           1: [H(1, 4), H(1, 5), H(0, 4), H(0, 5)],
           2: [H(2, 4), H(2, 5), H(3, 4), H(3, 5)],
           3: []}  # node 3 lost its RAM: its shards live on node 2
    c = choose_restore(4, inv)
    assert c.step == 5
    assert c.holders == {0: (0, 1), 1: (0, 1), 2: (2,), 3: (2,)}


def test_incomplete_newest_falls_back_and_says_why():
    inv = {0: [H(0, 4), H(0, 5)], 1: [H(1, 4)]}
    c = choose_restore(2, inv)
    assert c.step == 4
    assert "step 5 lacks rank(s) [1]" in c.reason


def test_unverified_and_bad_copies_do_not_count():
    inv = {0: [H(0, 5), H(1, 5, verified=False), H(0, 4)], 1: [H(1, 4)]}
    assert choose_restore(2, inv).step == 4
    inv = {0: [H(0, 5), H(1, 5)], 1: [H(1, 5)]}
    assert choose_restore(2, inv, bad={(0, 1, 5)}).holders[1] == (1,)
    assert choose_restore(2, inv, bad={(0, 1, 5), (1, 1, 5)}).step is None


def test_none_and_fallback_hook():
    c = choose_restore(2, {0: [H(0, 3)], 1: []})
    assert c.step is None and "no step is complete" in c.reason
    hook = Choice(7, backup="2026-01-02_03-04", reason="backup")
    assert choose_restore(2, {0: [], 1: []}, fallback=lambda: hook) is hook
    assert choose_restore(1, {0: [H(0, 3)]}, fallback=lambda: hook).step == 3  # cluster first


def test_owner_copy_wins_then_majority_digest():
    inv = {0: [H(0, 5, "own")], 1: [H(0, 5, "other")], 2: [H(0, 5, "other")]}
    c = choose_restore(1, inv)
    assert c.digests[0] == "own" and c.holders[0] == (0,)
    inv = {1: [H(0, 5, "a")], 2: [H(0, 5, "b")], 3: [H(0, 5, "b")]}
    c = choose_restore(1, inv)
    assert c.digests[0] == "b" and c.holders[0] == (2, 3)


def test_ranks_outside_the_job_are_ignored():
    assert choose_restore(1, {0: [H(0, 2), H(5, 9)]}).step == 2


def test_sources_nearest_on_the_ring_first():
    c = Choice(5, holders={3: (0, 1, 2)})
    assert sources_for(c, 3, 4) == (False, [0, 1, 2])
    c = Choice(5, holders={1: (0, 1, 2, 3)})
    assert sources_for(c, 1, 4) == (True, [2, 3, 0])


# ---------------------------------------------------------------------- rounds


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def coord(**kw) -> tuple[Coordinator, Clock]:
    clock = Clock()
    return Coordinator(clock=clock, wall=clock, **kw), clock


def join(c, rank, inv=(), rid=None, job="job", nodes=2, inc=None, mode="protocol"):
    return c.join(job, nodes, rank, f"10.0.0.{rank}:7000", inc or f"inc{rank}", inv,
                  rid if rid is not None else f"r{rank}", mode)


def test_strict_round_waits_for_every_rank_then_decides_the_same_step():
    c, _ = coord()
    join(c, 0, [H(0, 5), H(1, 5)])
    v = c.decide("job", 0, "r0")
    assert v.state == WAITING and v.missing == (1,)
    join(c, 1, [])  # node 1 lost its RAM
    v0, v1 = c.decide("job", 0, "r0"), c.decide("job", 1, "r1")
    assert v0.state == v1.state == DECIDED and v0.step == v1.step == 5
    assert v0.local and not v0.sources
    assert not v1.local and v1.sources == ((0, "10.0.0.0:7000"),)
    assert v1.digest == "d1-5"


def test_duplicate_join_keeps_the_newest():
    c, _ = coord()
    join(c, 0, [H(0, 5)], rid="old")
    join(c, 0, [H(0, 6)], rid="new")
    join(c, 1, [H(1, 5), H(1, 6)])
    assert c.decide("job", 0, "old").state == REJOIN
    assert c.decide("job", 0, "new").step == 6


@pytest.mark.parametrize(("args", "message"), [
    ({"rank": 2}, "out of range"),
    ({"rank": 1, "job": "other"}, "job-name mismatch"),
    ({"rank": 1, "nodes": 3}, "node count mismatch"),
])
def test_rejected_joins_say_why(args, message):
    c, _ = coord()
    join(c, 0)
    with pytest.raises(Rejected, match=message):
        join(c, **args)


def test_rank_zero_switches_the_job():
    c, _ = coord()
    join(c, 1, job="old")
    join(c, 0, job="new", nodes=4)
    assert (c.job, c.nodes) == ("new", 4)
    assert c.decide("old", 1, "r1").state == REJOIN


def test_a_stale_job_is_replaced_by_any_node():
    c, clock = coord(live_seconds=5)
    join(c, 1, job="old", rid="")
    clock.t += 10  # nobody of the old job is live and no round is open
    join(c, 1, job="new", rid="")
    assert c.job == "new"


def test_barrier_ready_then_done():
    c, _ = coord()
    join(c, 0, [H(0, 1), H(1, 1)])
    join(c, 1, [H(1, 1)])
    v = c.decide("job", 0, "r0")
    assert c.barrier("job", 0, "r0", v.round, v.version, "ready").state == WAITING
    assert c.barrier("job", 0, "r0", v.round, v.version, "done").state == WAITING
    assert c.barrier("job", 1, "r1", v.round, v.version, "ready").state == PASSED
    assert c.barrier("job", 0, "r0", v.round, v.version, "ready").state == PASSED
    assert c.barrier("job", 0, "r0", v.round, v.version, "done").waiting_for == (1,)
    assert c.barrier("job", 1, "r1", v.round, v.version, "done").state == PASSED
    assert c.round.state == "done"


def test_bad_copy_replans_to_an_older_step():
    c, _ = coord()
    join(c, 0, [H(0, 4), H(0, 5), H(1, 4), H(1, 5)])
    join(c, 1, [])
    v = c.decide("job", 1, "r1")
    assert v.step == 5
    b = c.barrier("job", 1, "r1", v.round, v.version, "ready", ok=False, bad=[(0, 1, 5)])
    assert b.state == REPLAN
    # node 0 was waiting in the ready barrier with the old version: told to replan
    assert c.barrier("job", 0, "r0", v.round, v.version, "ready").state == REPLAN
    v2 = c.decide("job", 1, "r1")
    assert (v2.step, v2.version) == (4, v.version + 1)
    assert "step 5 lacks rank(s) [1]" in v2.reason


def test_new_restore_after_decision_opens_the_next_round():
    c, _ = coord()
    join(c, 0, [H(0, 1)])
    join(c, 1, [H(1, 1)])
    v = c.decide("job", 0, "r0")
    join(c, 1, [H(1, 1)], rid="again")  # node 1's job restarted
    assert c.round.number == v.round + 1
    assert c.decide("job", 0, "r0").state == REJOIN
    assert c.barrier("job", 0, "r0", v.round, v.version, "ready").state == REJOIN
    join(c, 0, [H(0, 1)], rid="r0")  # node 0 joins again with the same restore
    assert c.decide("job", 0, "r0").step == 1


def test_retried_join_of_the_same_restore_is_idempotent():
    c, _ = coord()
    join(c, 0, [H(0, 1)])
    join(c, 1, [H(1, 1)])
    number = c.decide("job", 0, "r0").round
    assert join(c, 1, [H(1, 1)]) == number


def test_generic_round_borrows_live_nodes_inventory():
    c, _clock = coord(live_seconds=5)
    join(c, 0, rid="", mode="generic")  # registered, heartbeating
    c.sync("job", 0, "inc0", 5, [H(0, 5), H(1, 5)])
    join(c, 1, [], rid="restart", mode="generic")  # node 1 restarted with empty RAM
    v = c.decide("job", 1, "restart")
    assert v.state == DECIDED and v.step == 5 and v.sources[0][0] == 0
    assert c.round.borrowed == (0,)
    # only the restoring node takes part in the barrier
    assert c.barrier("job", 1, "restart", v.round, v.version, "ready").state == PASSED


def test_generic_round_waits_for_a_dead_node():
    c, clock = coord(live_seconds=5)
    join(c, 0, rid="", mode="generic")
    clock.t += 6
    join(c, 1, [], rid="restart", mode="generic")
    v = c.decide("job", 1, "restart")
    assert v.state == WAITING and v.missing == (0,)


def test_sync_round():
    c, _ = coord()
    join(c, 0, rid="")
    join(c, 1, rid="")
    s = c.sync("job", 0, "inc0", 3, [])
    assert s.known and s.synced_step == -1
    s = c.sync("job", 1, "inc1", 3, [])
    assert s.synced_step == 3 and s.steps == (3, 3)
    s = c.sync("job", 0, "inc0", 4, [])
    assert s.synced_step == 3
    assert not c.sync("job", 1, "restarted", 4, []).known
    assert not c.sync("other", 1, "inc1", 4, []).known
    assert c.status()["sync"]["step"] == 3


def test_restarted_node_replaces_its_member_entry():
    c, _ = coord()
    join(c, 1, rid="", inc="a")
    join(c, 1, rid="", inc="b")
    assert [p.incarnation for p in c.peers()] == ["b"]


def test_nothing_to_restore():
    c, _ = coord()
    join(c, 0)
    join(c, 1)
    v = c.decide("job", 0, "r0")
    assert v.state == DECIDED and v.step is None


# ---------------------------------------------------------------------- restore.version


def forced_round(step, name="2025-01-01_00-00"):
    return Choice(step, reason=f"restore.version names round {name}", backup=name,
                  forced=name)


def test_restore_version_overrides_a_newer_step_complete_in_the_cluster():
    reads = []

    def override(job, nodes):
        reads.append((job, nodes))
        return forced_round(3)

    c, _ = coord(override=override)
    join(c, 0, [H(0, 5), H(1, 5)])
    join(c, 1, [H(1, 5)])
    views = [c.decide("job", r, f"r{r}") for r in (0, 1)]
    for v in views:  # every node: the named round's step, from the bucket, no peer sources
        assert (v.state, v.step, v.backup, v.forced) == (DECIDED, 3, "2025-01-01_00-00",
                                                         "2025-01-01_00-00")
        assert not v.local and not v.sources
    assert reads == [("job", 2)]  # read once per restore round
    # the same barrier as any restore
    assert c.barrier("job", 0, "r0", views[0].round, views[0].version, "ready").state == WAITING
    assert c.barrier("job", 1, "r1", views[1].round, views[1].version, "ready").state == PASSED


def test_restore_version_that_cannot_be_restored_means_nothing():
    reads = []

    def override(job, nodes):
        reads.append(job)
        return forced_round(3)

    c, _ = coord(override=override, fallback=lambda job, nodes: Choice(1, backup="old"))
    join(c, 0, [H(0, 5), H(1, 5)])
    join(c, 1, [H(1, 5)])
    v = c.decide("job", 1, "r1")
    # node 1 could not download its part of the named round: no fallback at all
    assert c.barrier("job", 1, "r1", v.round, v.version, "ready", ok=False).state == REPLAN
    v2 = c.decide("job", 0, "r0")
    assert v2.step is None and v2.forced == "2025-01-01_00-00"
    assert "could not be restored on every node" in v2.reason and "no fallback" in v2.reason
    assert reads == ["job"]


def test_restore_version_naming_a_missing_round_means_nothing():
    c, _ = coord(override=lambda job, nodes: Choice(
        None, reason="restore.version names round 2031-01-01_00-00, which does not exist",
        forced="2031-01-01_00-00"))
    join(c, 0, [H(0, 5), H(1, 5)])
    join(c, 1, [H(1, 5)])
    for r in (0, 1):
        v = c.decide("job", r, f"r{r}")
        assert v.state == DECIDED and v.step is None and v.forced == "2031-01-01_00-00"
        assert "does not exist" in v.reason


def test_without_restore_version_the_cluster_decides():
    c, _ = coord(override=lambda job, nodes: None)
    join(c, 0, [H(0, 5), H(1, 5)])
    join(c, 1, [H(1, 5)])
    v = c.decide("job", 0, "r0")
    assert v.step == 5 and v.forced is None


# ---------------------------------------------------------------------- backup rounds


def book_coord(nodes=2, steps=1, minutes=None, seed=True, **kw):
    c, clock = coord(backups=RoundBook(**kw))
    for r in range(nodes):
        c.join("job", nodes, r, f"a{r}", f"inc{r}", (), "", "protocol",
               backup_interval_steps=steps, backup_interval_minutes=minutes)
    if seed:
        assert c.backups.seed("job", "2025-01-01_00-00", None)
    return c, clock


def sync(c, rank, step, inv=None, backup=None, inc=None, nodes=None, dp=None):
    """A Sync of ``rank`` reporting ``step``; by default it holds its steps 1..step."""
    if inv is None:
        inv = [H(rank, s) for s in range(1, step + 1)]
    return c.sync("job", rank, inc or f"inc{rank}", step, inv, backup, dp)


def test_a_completed_sync_round_orders_a_backup_round_to_every_node():
    c, _ = book_coord()
    assert sync(c, 0, 1).backup_order is None  # rank 1 has not reported step 1
    s1 = sync(c, 1, 1)
    assert s1.synced_step == 1
    rnd, step = s1.backup_order
    assert step == 1 and rnd > "2025-01-01_00-00"  # names sort after the bucket's
    assert sync(c, 0, 1).backup_order == (rnd, 1)
    assert s1.backup_last == RoundView(rnd, 1, RUNNING)
    # node 0 reports; it is not ordered again, node 1 still is
    s = sync(c, 0, 1, backup=Outcome(rnd, 1, DONE))
    assert s.backup_order is None and sync(c, 1, 1).backup_order == (rnd, 1)
    s = sync(c, 1, 1, backup=Outcome(rnd, 1, DONE))
    assert s.backup_last == RoundView(rnd, 1, COMPLETE) and s.backup_order is None
    assert c.backups.drain() == []  # a complete round writes no error line
    assert c.status()["backups"]["rounds"][-1]["state"] == COMPLETE


def test_never_two_rounds_at_once_and_a_skip_is_reported_once():
    c, _ = book_coord()
    sync(c, 0, 1)
    rnd, _ = sync(c, 1, 1).backup_order
    sync(c, 0, 2)
    s = sync(c, 1, 2)  # step 2 is due while the round of step 1 runs: it waits
    assert s.backup_order == (rnd, 1)
    assert c.backups.drain() == []
    # step 3 becomes due while that round still runs: step 2 is skipped for good
    sync(c, 0, 3)
    sync(c, 1, 3)
    events = c.backups.drain()
    assert len(events) == 1 and "backup of step 2 skipped" in events[0] and rnd in events[0]
    assert "the newer step 3 became due" in events[0]
    sync(c, 0, 3)
    sync(c, 1, 3)
    assert c.backups.drain() == []  # once
    # a failure makes the round incomplete, reported once; the next step gets a round
    sync(c, 0, 3, backup=Outcome(rnd, 1, DONE))
    sync(c, 1, 3, backup=Outcome(rnd, 1, FAILED, "bucket unreachable: 503"))
    events = c.backups.drain()
    assert len(events) == 1 and "incomplete" in events[0] and "node-rank [1]" not in events[0]
    assert "node-rank(s) [1] failed (node-rank 1: bucket unreachable: 503)" in events[0]
    # step 3, which waited while that round ran, is the newest: its round starts now
    nxt = sync(c, 0, 3).backup_order
    assert nxt is not None and nxt[1] == 3 and nxt[0] > rnd
    assert c.backups.drain() == []  # step 3 was not skipped


def test_a_step_due_while_a_round_runs_is_backed_up_next_without_a_skip_line():
    """issue 19 case 2: steps sealed back to back with backup-interval-steps 1 wrote
    "backup of step 2 skipped" although step 2 got its round right after."""
    c, _ = book_coord()
    sync(c, 0, 1)
    rnd, _ = sync(c, 1, 1).backup_order
    sync(c, 0, 2)
    sync(c, 1, 2, backup=Outcome(rnd, 1, DONE))
    sync(c, 0, 2, backup=Outcome(rnd, 1, DONE))
    nxt = sync(c, 1, 2).backup_order
    assert nxt is not None and nxt[1] == 2
    assert c.backups.drain() == []


def test_stale_outcomes_are_ignored_and_a_restarted_node_fails_its_part():
    c, _ = book_coord()
    sync(c, 0, 1)
    rnd, _ = sync(c, 1, 1).backup_order
    sync(c, 0, 1, backup=Outcome("2020-01-01_00-00", 1, DONE))  # an older round's outcome
    assert sync(c, 0, 1).backup_order == (rnd, 1)
    sync(c, 0, 1, backup=Outcome(rnd, 1, DONE))
    c.join("job", 2, 1, "a1", "new-incarnation", (), "", "protocol")  # node 1 restarted
    s = c.sync("job", 1, "new-incarnation", -1, ())
    assert s.backup_order is None and s.backup_last.state == INCOMPLETE
    assert "node-rank 1 restarted during the round" in c.backups.drain()[0]


def test_a_round_nobody_finishes_is_given_up():
    c, clock = book_coord(timeout=100)
    sync(c, 0, 1)
    rnd, _ = sync(c, 1, 1).backup_order
    clock.t += 99
    assert sync(c, 0, 1).backup_last.state == RUNNING
    clock.t += 2
    assert sync(c, 0, 1).backup_last == RoundView(rnd, 1, INCOMPLETE)
    assert "given up after 100 s: node-rank(s) [0, 1] never finished" in c.backups.drain()[0]


def test_no_round_before_the_bucket_was_listed():
    c, _ = book_coord(seed=False)
    sync(c, 0, 1)
    assert sync(c, 1, 1).backup_order is None
    # the bucket's newest complete round holds step 1: not backed up again
    c.backups.seed("job", "2025-01-01_00-05", ("2025-01-01_00-05", 1))
    assert sync(c, 1, 1).backup_order is None
    sync(c, 0, 2)
    assert sync(c, 1, 2).backup_order[1] == 2


def test_intervals_come_from_rank_zero_and_backup_requested_starts_at_once():
    c, clock = book_coord(steps=None, minutes=None)  # neither: Orbax's 30 minutes
    sync(c, 0, 1)
    assert sync(c, 1, 1).backup_order is None
    clock.t += 30 * 60
    assert sync(c, 1, 1).backup_order[1] == 1
    c, clock = book_coord(steps=None, minutes=None)
    flagged = [Holding(1, 1, True, "d", backup_requested=True)]
    sync(c, 0, 1)
    assert sync(c, 1, 1, inv=flagged).backup_order[1] == 1


def test_a_restore_starts_a_new_timeline_for_the_rounds():
    c, _ = book_coord()
    sync(c, 0, 2)
    rnd, _ = sync(c, 1, 2).backup_order
    # the job restarts (every node joins a restore round) and restores step 1
    for r, inv in ((0, [H(0, 1), H(1, 1)]), (1, [H(1, 1)])):
        c.join("job", 2, r, f"a{r}", f"inc{r}", inv, f"x{r}", "protocol",
               backup_interval_steps=1)
    assert c.decide("job", 0, "x0").step == 1
    assert sync(c, 0, 1).backup_order is None  # the old round was dropped
    # no new round while the restore round is open, then the new step 2 is backed up
    sync(c, 0, 2)
    assert sync(c, 1, 2).backup_order is None
    v = c.decide("job", 1, "x1")
    for r in (0, 1):
        c.barrier("job", r, f"x{r}", v.round, v.version, "ready")
    for r in (0, 1):
        c.barrier("job", r, f"x{r}", v.round, v.version, "done")
    new = sync(c, 1, 2).backup_order
    assert new is not None and new[1] == 2 and new[0] > rnd


def test_after_a_restore_from_the_cluster_the_interval_counts_from_the_last_round():
    """backup-interval-steps 10: a round for step 10; the job restarts from step 15
    (RAM/peers); step 20 is 10 steps after the last round, so it is backed up."""
    c, _ = book_coord(steps=10)
    sync(c, 0, 10)
    rnd, _step = sync(c, 1, 10).backup_order
    for r in (0, 1):
        sync(c, r, 10, backup=Outcome(rnd, 10, DONE))
    for r, inv in ((0, [H(0, 15), H(1, 15)]), (1, [H(1, 15)])):
        c.join("job", 2, r, f"a{r}", f"inc{r}", inv, f"x{r}", "protocol",
               backup_interval_steps=10)
    v = c.decide("job", 0, "x0")
    assert v.step == 15
    for phase in ("ready", "done"):
        for r in (0, 1):
            c.barrier("job", r, f"x{r}", v.round, v.version, phase)
    sync(c, 0, 20)
    order = sync(c, 1, 20).backup_order
    assert order is not None and order[1] == 20 and order[0] > rnd


def test_two_live_nodes_with_one_rank_are_refused():
    """Regression: a second daemon mounted with --node-rank 1 at another address made
    the coordinator flap between the two incarnations twice a second, silently."""
    c, clock = coord()
    join(c, 0, rid="")
    c.join("job", 2, 1, "10.0.0.1:7000", "first", (), "", "protocol")
    with pytest.raises(Rejected, match=r"node-rank 1 is taken: 10.0.0.1:7000 still serves it"):
        c.join("job", 2, 1, "10.0.0.9:7000", "second", (), "", "protocol")
    assert [p.incarnation for p in c.peers() if p.rank == 1] == ["first"]
    # the first one goes quiet (it died): a node that restarted elsewhere is accepted
    clock.t += c.live_seconds + 1
    c.join("job", 2, 1, "10.0.0.9:7000", "second", (), "", "protocol")
    assert [p.incarnation for p in c.peers() if p.rank == 1] == ["second"]
