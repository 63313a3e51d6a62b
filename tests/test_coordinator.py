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
