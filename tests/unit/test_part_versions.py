"""Issue #14: what decides that another rank's part shown in a node's whole-step view
changed (that rank saved the step again), without a mount: the coordinator's numbered
record of the own-part digests (:class:`tierfs.cluster.part_versions.PartVersions`,
fed by :class:`tierfs.cluster.membership.Membership`) and the view's comparison
(:func:`tierfs.node.union.changed_ranks`)."""

from __future__ import annotations

from tierfs.cluster.membership import Membership
from tierfs.cluster.part_versions import LOST, PartChange, PartVersions
from tierfs.core.types import Holding
from tierfs.node.union import ALL_RANKS, changed_ranks


def own(rank: int, step: int, digest: str) -> Holding:
    return Holding(rank, step, True, digest)


def test_a_placed_part_with_another_reported_digest_changed():
    placed = {0: "a0", 1: "a1", 3: "a3"}
    # rank 1 saved again; rank 2 is not placed yet (the view's look finds it); rank 3
    # reported what is placed; a report with no digest says nothing
    assert changed_ranks(placed, {1: "b1", 2: "b2", 3: "a3", 0: ""}) == [1]
    assert changed_ranks(placed, {}) == []
    # the coordinator lost the changes of the step: every placed rank counts
    assert changed_ranks(placed, {ALL_RANKS: ""}) == [0, 1, 3]


def test_a_change_is_numbered_and_reported_once_to_a_node_that_asks_since():
    pv = PartVersions()
    pv.update(0, [own(0, 10, "a0"), own(1, 10, "replica-of-1")])  # replicas left out
    pv.update(1, [own(1, 10, "a1"), own(1, 20, "c1")])
    assert pv.version == 0  # first reports are no changes
    assert pv.changes(pv.epoch, [(10, 0), (20, 0)]) == []
    # the same inventory again: nothing new
    assert pv.update(1, [own(1, 10, "a1"), own(1, 20, "c1")]) == 0
    # rank 1 saves step 10 again
    assert pv.update(1, [own(1, 10, "b1"), own(1, 20, "c1")]) == 1
    assert pv.changes(pv.epoch, [(10, 0), (20, 0)]) == [PartChange(10, 1, "b1")]
    assert pv.changes(pv.epoch, [(10, pv.version)]) == []  # known already
    assert pv.changes(pv.epoch, [(20, 0)]) == []  # only the steps asked
    # dropped (retention) and saved again with other bytes: a change too
    pv.update(1, [own(1, 20, "c1")])
    pv.update(1, [own(1, 10, "e1"), own(1, 20, "c1")])
    assert pv.changes(pv.epoch, [(10, 1)]) == [PartChange(10, 1, "e1")]


def test_a_node_of_another_epoch_asks_again_itself_and_a_new_node_gets_the_changes():
    pv = PartVersions()
    pv.update(0, [own(0, 10, "a0")])
    pv.update(1, [own(1, 10, "a1")])
    pv.update(1, [own(1, 10, "b1")])
    # a node that knew another coordinator (it restarted and may have missed a change):
    # one LOST per step asked that this coordinator knows, never every digest (review B1:
    # O(N) per reply, O(N²) per heartbeat round after a coordinator restart)
    assert pv.changes("elsewhere", [(10, 7), (11, 0)]) == [PartChange(10, LOST, "")]
    # a node that asks for the first time: the changes since this coordinator started
    assert pv.changes("", [(10, 99)]) == [PartChange(10, 1, "b1")]
    before = pv.epoch
    pv.clear()
    assert pv.epoch != before and pv.changes(before, [(10, 1)]) == []


def test_only_the_newest_steps_are_kept_and_an_older_one_asked_about_is_lost():
    pv = PartVersions(keep_steps=2)
    pv.update(1, [own(1, 10, "a")])
    pv.update(1, [own(1, 10, "b")])  # version 1
    pv.update(1, [own(1, 10, "b"), own(1, 20, "c"), own(1, 30, "d")])  # step 10 dropped
    assert pv.changes(pv.epoch, [(10, 0)]) == [PartChange(10, LOST, "")]
    assert pv.changes(pv.epoch, [(10, 1)]) == []  # knew it up to its last change
    pv.update(2, [own(2, 5, "x")])  # older than every step kept: not recorded
    assert pv.changes(pv.epoch, [(5, 1)]) == []
    assert pv.changes(pv.epoch, [(5, 0)]) == [PartChange(5, LOST, "")]  # not known


def test_the_membership_numbers_the_changes_of_its_members_inventories():
    clock = [0.0]
    roster = Membership(lambda: clock[0], 10.0)
    m1, _ = roster.admit(1, "a:1", "i1")
    roster.set_inventory(m1, (own(1, 10, "a1"),))
    roster.set_inventory(m1, (own(1, 10, "b1"),))
    assert roster.parts.changes(roster.parts.epoch, [(10, 0)]) == [PartChange(10, 1, "b1")]
    # another job: a new table
    epoch = roster.parts.epoch
    roster.clear()
    assert roster.parts.epoch != epoch and roster.parts.version == 0


def test_the_holders_index_follows_inventories_replacements_and_clears():
    """``Membership.holders`` is an index kept as inventories change (#17 review: a walk
    of every member per backup-book tick); it must say what a walk would."""
    roster = Membership(lambda: 0.0, 10.0)
    m0, _ = roster.admit(0, "a:0", "i0")
    m1, _ = roster.admit(1, "a:1", "i1")
    roster.set_inventory(m0, (own(0, 5, "d0"), own(0, 6, "e0"), own(1, 5, "replica")))
    roster.set_inventory(m1, (own(1, 5, ""), own(0, 5, "replica-of-0")))
    assert roster.holders(5) == {0: "d0", 1: None}  # own parts only; "" is unknown
    assert roster.holders(6) == {0: "e0"} and roster.holders(7) == {}
    roster.holders(5)[0] = "changed by a caller"  # a copy
    assert roster.holders(5)[0] == "d0"
    roster.set_inventory(m0, (own(0, 6, "e0-again"),))  # step 5 dropped, 6 saved again
    assert roster.holders(5) == {1: None} and roster.holders(6) == {0: "e0-again"}
    m1b, replaced = roster.admit(1, "a:1", "i1-restarted")  # a restarted daemon: empty
    assert replaced and roster.holders(5) == {}
    roster.set_inventory(m1b, (own(1, 6, "f1"),))
    assert roster.holders(6) == {0: "e0-again", 1: "f1"}
    roster.clear()
    assert roster.holders(6) == {}
