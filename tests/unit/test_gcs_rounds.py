"""The coordinator's backup rounds (pure, no daemons): rounds start only for a step
every node holds, move to a newer step when a node lost the ordered one, dedup
data-parallel uploads only where the checksums agree, and leave their
leftovers for cleanup (issue 19 cases 1 and 2)."""

from __future__ import annotations

from test_coordinator import H, coord

from tierfs.backup import layout as L
from tierfs.cluster.backup_schedule import (
    COMPLETE,
    DONE,
    FAILED,
    INCOMPLETE,
    MISSING,
    RUNNING,
    Outcome,
    RoundBook,
    RoundView,
)
from tierfs.cluster.coordinator import Holding


def book_coord(nodes: int = 2, **kw):
    c, clock = coord(backups=RoundBook(**kw))
    for r in range(nodes):
        c.join("job", nodes, r, f"a{r}", f"inc{r}", (), "", "protocol", backup_interval_steps=1)
    assert c.backups.seed("job", "2025-01-01_00-00", None)
    return c, clock


def sync(c, rank: int, step: int, held: list[int], backup=None, dp=None, digest=None):
    """``rank`` reports ``step`` replicated and holds its own shards of ``held``."""
    inv = [Holding(rank, s, True, (digest or (lambda s: f"d{rank}-{s}"))(s)) for s in held]
    return c.sync("job", rank, f"inc{rank}", step, inv, backup, dp)


def test_the_round_moves_to_the_newest_step_when_a_node_lost_the_ordered_one():
    """Exact input of issue 19 case 2: steps 1-3 sealed back to back, keep-local 1,
    backup every step; the coordinator ordered step 1 and node 0 dropped it before
    it heard of the order. Before: node 0 failed the round ("step 1 is no longer
    held on this node") and it stayed half-written."""
    c, _ = book_coord()
    sync(c, 0, 1, [1])
    rnd, step = sync(c, 1, 1, [1]).backup_order
    assert step == 1
    # node 1 uploads step 1; node 0 sealed 2 and 3 and retention dropped 1
    s = sync(c, 1, 1, [1], backup=Outcome(rnd, 1, DONE))
    assert s.backup_order is None
    s = sync(c, 0, 3, [3])
    assert s.backup_order is None  # it cannot upload step 1; no newer step is synced
    book = c.status().backups
    assert book is not None and book.active is not None
    assert book.active.lacking == {0: "step 1 is no longer held on node-rank 0"}
    # node 1 catches up: step 3 is synced and held everywhere, the round moves there
    s = sync(c, 1, 3, [1, 3])
    assert s.backup_order == (rnd, 3) and s.backup_last == RoundView(rnd, 3, RUNNING)
    assert sync(c, 0, 3, [3]).backup_order == (rnd, 3)
    # node 1's step-1 outcome is stale now: it uploads step 3 too
    assert sync(c, 1, 3, [3], backup=Outcome(rnd, 1, DONE)).backup_order == (rnd, 3)
    sync(c, 0, 3, [3], backup=Outcome(rnd, 3, DONE))
    s = sync(c, 1, 3, [3], backup=Outcome(rnd, 3, DONE))
    assert s.backup_last == RoundView(rnd, 3, COMPLETE)
    book = c.status().backups
    assert book is not None
    assert book.rounds[-1]["moved_from"] == [1] and book.rounds[-1]["step"] == 3
    assert c.backups.drain() == []  # moving is not an error
    # the round's step-1 part of node 1 is left over: removed now that it completed
    assert c.backups.take_cleanup() == [rnd] and c.backups.take_cleanup() == []


def test_a_node_reporting_missing_waits_for_a_step_every_node_holds():
    c, _ = book_coord()
    sync(c, 0, 1, [1])
    rnd, _ = sync(c, 1, 1, [1]).backup_order
    # node 0's inventory still listed step 1, but it was gone by the time it got the order
    s = sync(c, 0, 2, [2], backup=Outcome(rnd, 1, MISSING, "step 1 is gone"))
    assert s.backup_order is None and s.backup_last == RoundView(rnd, 1, RUNNING)
    # step 2 is synced, but node 1 dropped it already (keep-local 1): no move yet
    s = sync(c, 1, 3, [1, 3])
    assert s.synced_step == 2 and s.backup_order == (rnd, 1)
    assert c.backups.drain() == []
    # step 3 is synced and every node holds it: the round moves there
    assert sync(c, 0, 3, [3]).backup_order == (rnd, 3)
    assert sync(c, 1, 3, [3]).backup_order == (rnd, 3)


def test_a_round_whose_step_nobody_can_provide_times_out_with_the_reason():
    c, clock = book_coord(timeout=100)
    sync(c, 0, 1, [1])
    rnd, _ = sync(c, 1, 1, [1]).backup_order
    sync(c, 0, 1, [], backup=Outcome(rnd, 1, MISSING, "step 1 is gone"))
    clock.t += 101
    assert sync(c, 1, 1, [1]).backup_last == RoundView(rnd, 1, INCOMPLETE)
    (line,) = c.backups.drain()
    assert "no longer held step 1" in line and "node-rank 0: step 1 is gone" in line


def test_no_round_starts_for_a_step_some_node_no_longer_holds():
    c, _ = book_coord()
    sync(c, 0, 1, [2])  # reported step 1 replicated, but holds only step 2 now
    assert sync(c, 1, 1, [1]).backup_order is None
    book = c.status().backups
    assert book is not None and "no longer held by node-rank(s) [0]" in book.last_decision
    sync(c, 0, 2, [2])
    assert sync(c, 1, 2, [2]).backup_order[1] == 2


def test_a_failed_round_is_cleaned_up_once_a_later_round_completed():
    c, _ = book_coord()
    sync(c, 0, 1, [1])
    r1, _ = sync(c, 1, 1, [1]).backup_order
    sync(c, 0, 1, [1], backup=Outcome(r1, 1, DONE))
    sync(c, 1, 1, [1], backup=Outcome(r1, 1, FAILED, "access denied"))
    assert c.backups.take_cleanup() == []  # uploads into it may still be finishing
    sync(c, 0, 2, [2])
    r2, _ = sync(c, 1, 2, [2]).backup_order
    sync(c, 0, 2, [2], backup=Outcome(r2, 2, DONE))
    assert c.backups.take_cleanup() == []
    sync(c, 1, 2, [2], backup=Outcome(r2, 2, DONE))
    assert c.backups.take_cleanup() == [r1]


def test_data_parallel_dedup_only_where_the_digests_agree():
    """Exact input of issue 19 case 1 at the coordinator: 2 nodes, D=2, the two
    nodes' shards differ (an array sharded across them): no dedup, one line."""
    c, _ = book_coord()
    sync(c, 0, 1, [1], dp=2)
    s1 = sync(c, 1, 1, [1], dp=2)
    assert s1.backup_order is not None
    s0 = sync(c, 0, 1, [1], dp=2)
    assert not s0.backup_dedup and not s1.backup_dedup  # node 1 is the uploader anyway
    (line,) = c.backups.drain()
    assert "assume-data-parallelism 2 did not hold for step 1" in line
    assert "node-ranks [0, 1] (uploader 1)" in line
    # identical bytes (equal digests): node 0 may point at node 1's data
    c, _ = book_coord()
    same = lambda s: f"same-{s}"  # noqa: E731
    sync(c, 0, 1, [1], dp=2, digest=same)
    assert sync(c, 1, 1, [1], dp=2, digest=same).backup_dedup is False
    assert sync(c, 0, 1, [1], dp=2, digest=same).backup_dedup is True
    assert c.backups.drain() == []
    # without data parallelism nobody dedups, whatever the digests
    c, _ = book_coord()
    sync(c, 0, 1, [1], digest=same)
    sync(c, 1, 1, [1], digest=same)
    assert sync(c, 0, 1, [1], digest=same).backup_dedup is False


def test_differing_data_parallel_columns_are_reported_once_per_job():
    c, _ = book_coord()
    for step in (1, 2):
        sync(c, 0, step, [step], dp=2)
        rnd, _ = sync(c, 1, step, [step], dp=2).backup_order
        for r in (0, 1):
            sync(c, r, step, [step], dp=2, backup=Outcome(rnd, step, DONE))
    lines = [e for e in c.backups.drain() if "assume-data-parallelism" in e]
    assert len(lines) == 1


def test_dedup_plan():
    # 4 nodes, D=2: columns {0, 2} (uploader 2) and {1, 3} (uploader 3)
    plan = L.dedup_plan({0: "a", 1: "b", 2: "a", 3: "c"}, 4, 2)
    assert plan.dedup == {0} and plan.differing == ((3, (1, 3)),)
    assert "node-ranks [1, 3] (uploader 3)" in plan.describe(5, 2)
    # a rank or uploader without the step: no dedup, not reported as differing
    assert L.dedup_plan({0: "a", 1: "b"}, 4, 2) == L.DedupPlan()
    assert L.dedup_plan({0: "a", 1: "a"}, 2, None) == L.DedupPlan()
    assert L.dedup_plan({0: "a", 1: "a"}, 2, 1) == L.DedupPlan()
    assert L.dedup_plan({r: "x" for r in range(6)}, 6, 3).dedup == {0, 1, 2, 3}
    assert L.DedupPlan().describe(1, 2) == ""


def test_holders_follow_each_members_latest_inventory():
    c, _ = coord()
    for r in range(2):
        c.join("job", 2, r, f"a{r}", f"inc{r}", (), "", "protocol")
    c.sync("job", 0, "inc0", 1, [H(0, 1), H(1, 1)])
    c.sync("job", 1, "inc1", 1, [H(1, 1), H(0, 2)])  # a replica of rank 0 does not count
    assert c.holders(1) == {0: "d0-1", 1: "d1-1"} and c.holders(2) == {}
    c.sync("job", 0, "inc0", 2, [H(0, 2)])
    assert c.holders(1) == {1: "d1-1"} and c.holders(2) == {0: "d0-2"}


def test_a_step_number_saved_again_with_other_bytes_is_backed_up_again():
    """Regression (#15 new-user trial, job sg): steps 10 and 20 were backed up; the
    trainer removed step 20 and saved it again with other values. No round was ever
    made for the new bytes (only steps above the last one backed up were), and after
    a cluster loss the bucket's old step 20 came back with exit 0. A part whose
    digest changed makes the step due again; the same bytes do not."""
    c, clock = book_coord()
    sync(c, 0, 20, [20])
    r1, step = sync(c, 1, 20, [20]).backup_order
    assert step == 20
    sync(c, 0, 20, [20], backup=Outcome(r1, 20, DONE))
    sync(c, 1, 20, [20], backup=Outcome(r1, 20, DONE))
    # the same bytes: nothing new
    assert sync(c, 0, 20, [20]).backup_order is None
    assert sync(c, 1, 20, [20]).backup_order is None
    # rank 1 saved step 20 again: other bytes in its part; rank 0's may still come
    again = lambda s: f"again-{s}"  # noqa: E731
    sync(c, 0, 20, [20])
    assert sync(c, 1, 20, [20], digest=again).backup_order is None
    book = c.status().backups
    assert book is not None and book.last_decision == (
        "step 20 was saved again by rank(s) [1]: waiting up to 30 s for the new parts "
        "of rank(s) [0]"
    )
    clock.t += 29
    assert sync(c, 1, 20, [20], digest=again).backup_order is None
    clock.t += 1.5  # rank 0 never saved it again: the round starts with its old part
    order = sync(c, 1, 20, [20], digest=again).backup_order
    assert order is not None and order[1] == 20 and order[0] > r1, order
    book = c.status().backups
    assert book is not None and "step 20 was saved again since round" in book.last_decision
    assert "rank(s) [1]" in book.last_decision
    sync(c, 0, 20, [20], backup=Outcome(order[0], 20, DONE))
    sync(c, 1, 20, [20], backup=Outcome(order[0], 20, DONE), digest=again)
    # backed up: the new bytes are not due again
    assert sync(c, 1, 20, [20], digest=again).backup_order is None


def test_a_step_saved_again_by_every_rank_gets_one_round_of_the_new_parts():
    """Regression (second #15 trial): a 2-node re-save of step 20 made two rounds
    0.1 s apart; the first started at rank 0's new part and took rank 1's old one,
    a step nobody saved. The round waits for the other ranks' new parts."""
    c, _ = book_coord()
    sync(c, 0, 20, [20])
    r1, _step = sync(c, 1, 20, [20]).backup_order
    sync(c, 0, 20, [20], backup=Outcome(r1, 20, DONE))
    sync(c, 1, 20, [20], backup=Outcome(r1, 20, DONE))
    again = lambda s: f"again-{s}"  # noqa: E731
    assert sync(c, 0, 20, [20], digest=again).backup_order is None  # rank 1's may come
    order = sync(c, 1, 20, [20], digest=again).backup_order
    assert order is not None and order[1] == 20 and order[0] > r1, order
    book = c.backups
    assert book.state.last_parts == ((0, "again-20"), (1, "again-20"))


def test_saved_again_is_decided_on_the_digests_pure():
    """The one-node path (tierfs/backup/follower.py) decides with the node's own part:
    regression of the new-user trial's job hfrw (a rewritten model.safetensors of a
    sealed checkpoint-200 was never backed up again; the bucket restored the old one)."""
    from tierfs.core.rounds import START, WAIT, ScheduleState, decide_round, saved_again

    state = ScheduleState(started_at=0.0, last_round="2025-01-01_00-00", last_step=200)
    state.last_parts = ((0, "a"),)
    kw = {"now": 100.0, "step": 200, "interval_minutes": None, "interval_steps": 1}
    assert decide_round(state, parts={0: "a"}, **kw).action == WAIT
    d = decide_round(state, parts={0: "b"}, **kw)
    assert d.action == START and "step 200 was saved again" in d.due, d
    assert decide_round(state, parts={}, **kw).action == WAIT  # nothing reported
    state.last_parts = None  # unknown (a round taken from the bucket): not guessed
    assert decide_round(state, parts={0: "b"}, **kw).action == WAIT
    assert saved_again(((0, "a"), (1, "b")), {0: "a", 1: "c", 2: "z"}) == [1]
