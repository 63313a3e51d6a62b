"""A trainer starting beside a daemon that kept running (#16 sixth trial N4): the pure
decision of :mod:`tierfs.node.trainer_start`."""

from __future__ import annotations

from tierfs.node.trainer_start import (
    CURRENT,
    JOIN,
    NOTHING,
    ROUND,
    SAME_START,
    trainer_start_action,
)

SETTLED = 1000.0


def done(step: int | None, summoned: bool = False) -> dict:
    return {"state": "done", "step": step, "at": SETTLED, "summoned": summoned}


def test_a_restore_running_here_is_the_trainers():
    d = trainer_start_action("generic", True, {"state": "planning"}, [(4, SETTLED + 5)])
    assert (d.action, d.drop_after) == (JOIN, None)


def test_nothing_sealed_since_the_restore_keeps_it():
    d = trainer_start_action("generic", False, done(2), [(2, SETTLED - 50)])
    assert (d.action, d.drop_after) == (CURRENT, None)


def test_a_step_sealed_after_the_restore_starts_a_round():
    """The exact N4 input: the survivor's restore (step 2, summoned) settled, then
    the job sealed 4 and 6 here and restarted: the old result is stale."""
    d = trainer_start_action(
        "generic", False, done(2, summoned=True), [(6, SETTLED + 20), (4, SETTLED + 10)]
    )
    assert d.action == ROUND
    assert "step 6" in d.why and "step 2" in d.why


def test_a_fresh_start_followed_by_saves_starts_a_round():
    d = trainer_start_action("generic", False, done(None), [(2, SETTLED + 1)])
    assert d.action == ROUND and "(nothing)" in d.why


def test_a_summoned_round_drops_the_newer_steps_held_from_before_it():
    """Summoned into another node's round that agreed on 4, this node keeps its step 6
    (sealed before the round) until its own trainer starts: then 6 is abandoned."""
    d = trainer_start_action("generic", False, done(4, summoned=True), [(6, SETTLED - 1)])
    assert (d.action, d.drop_after) == (CURRENT, 4)
    assert "[6]" in d.why


def test_an_own_restore_never_drops_at_a_trainer_start():
    d = trainer_start_action("generic", False, done(4), [(6, SETTLED - 1)])
    assert (d.action, d.drop_after) == (CURRENT, None)


def test_a_summoned_fresh_start_drops_nothing():
    d = trainer_start_action("generic", False, done(None, summoned=True), [(6, SETTLED - 1)])
    assert (d.action, d.drop_after) == (CURRENT, None)


def test_protocol_mode_failed_and_unknown_restores_do_nothing():
    assert trainer_start_action("protocol", False, done(2), [(4, SETTLED + 1)]).action == NOTHING
    failed = {"state": "failed", "outcome": "missing", "at": SETTLED}
    assert trainer_start_action("generic", False, failed, [(4, SETTLED + 1)]).action == NOTHING
    assert trainer_start_action("generic", False, {}, []).action == NOTHING


def test_a_trainer_start_long_after_the_last_one_is_a_restart_even_without_newer_steps():
    """#16 seventh trial C, the exact input: the previous restore (step 10) was handed
    to the trainers (exit 0); the job saved step 50 on node 0 only and every trainer
    crashed. Node 1 holds nothing newer than 10, so it answered ``current`` at once
    (exit 0) while node 0 started a round (exit 2): two resume steps. A trainer start
    more than SAME_START after the one that got the result is a restart: a round."""
    d = trainer_start_action("generic", False, done(10), [(10, SETTLED - 5)], handed_ago=600.0)
    assert d.action == ROUND and "600 s ago" in d.why


def test_the_other_local_ranks_of_one_start_get_the_same_result():
    d = trainer_start_action("generic", False, done(10), [(10, SETTLED - 5)], handed_ago=3.0)
    assert (d.action, d.drop_after) == (CURRENT, None)
    edge = trainer_start_action("generic", False, done(10), [], handed_ago=SAME_START)
    assert edge.action == ROUND


def test_a_failed_restore_is_reported_first_and_retried_at_the_next_start():
    failed = {"state": "failed", "outcome": "missing", "at": SETTLED}
    assert trainer_start_action("generic", False, failed, []).action == NOTHING
    assert trainer_start_action("generic", False, failed, [], handed_ago=5.0).action == NOTHING
    assert trainer_start_action("generic", False, failed, [], handed_ago=120.0).action == ROUND


def test_a_restore_about_to_start_is_joined():
    """A daemon that just mounted shows ``pending`` before its start-up restore runs:
    the trainer's start is that restore's (its result is then handed to it)."""
    d = trainer_start_action("generic", False, {"state": "pending"}, [])
    assert d.action == JOIN


def test_a_seal_the_first_local_rank_saw_pending_opens_no_second_round():
    """#16 eighth trial D, the exact input: rank A's start saw step 20 still sealing and
    opened a round (step 10); the seal completed after that round settled; rank B,
    3 s after A, opened a second round because step 20 now counted as sealed since."""
    d = trainer_start_action(
        "generic", False, done(10), [(20, SETTLED + 2)], handed_ago=3.0, known={20}
    )
    assert (d.action, d.drop_after) == (CURRENT, None)
    # a step this start did not know of still counts (the job went on since)
    d = trainer_start_action(
        "generic", False, done(10), [(30, SETTLED + 2)], handed_ago=3.0, known={20}
    )
    assert d.action == ROUND
