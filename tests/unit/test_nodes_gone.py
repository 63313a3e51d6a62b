"""Nodes declared gone for good (issue #16 items 2 and 3): the pure policy.

The coordinator's gone set (refusals, persistence with the generation,
``--gone-after``), restore, sync and backup rounds that stop waiting for gone
ranks, placement stand-ins and the re-replication targets.
"""

from __future__ import annotations

from collections.abc import Callable

import click
import pytest
from click.testing import CliRunner

from tierfs.cli.main import main
from tierfs.cluster.backup_schedule import COMPLETE, DONE, RoundBook
from tierfs.cluster.coordinator import DECIDED, PASSED, WAITING, Coordinator, Rejected, gone_problem
from tierfs.cluster.restore_choice import INCOMPLETE, OLDER, RESTORED
from tierfs.core.control import JobSpec
from tierfs.core.types import Holding
from tierfs.node import statefile
from tierfs.replication import placement
from tierfs.replication.addresses import replica_peers


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def H(rank: int, step: int) -> Holding:
    return Holding(rank, step, True, f"d{rank}-{step}", nodes=4)


def coord(**kw) -> tuple[Coordinator, Clock]:
    clock = Clock()
    return Coordinator(clock=clock, wall=clock, **kw), clock


def join(c: Coordinator, rank: int, inv=(), nodes: int = 4, rid: str | None = None) -> int:
    return c.join(
        "job", nodes, rank, f"10.0.0.{rank}:7000", f"inc{rank}", inv, rid or f"r{rank}", "protocol"
    )


def survivors(step: int = 30, replica_of_3: bool = True) -> dict[int, list[Holding]]:
    """Step ``step`` of 4 nodes as the survivors of node 3 hold it (one peer per node:
    pairs 0-1 and 2-3); node 2 holds rank 3's replica if ``replica_of_3``."""
    inv = {0: [H(0, step), H(1, step)], 1: [H(1, step), H(0, step)], 2: [H(2, step)]}
    if replica_of_3:
        inv[2].append(H(3, step))
    return inv


# ---------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("ranks", "gone", "nodes", "why"),
    [
        ((), (), 4, "no node rank named"),
        ((0,), (), 4, "node-rank 0 cannot be declared gone: it serves the coordinator"),
        ((4,), (), 4, "node-rank(s) [4] out of range for 4 nodes (must be in [0, 4))"),
        ((-1, 2), (), 4, "node-rank(s) [-1] out of range for 4 nodes"),
        ((0, 1, 2, 3), (), 4, "node-rank 0 cannot be declared gone"),
        ((1,), (), 1, "node-rank(s) [1] out of range for 1 nodes"),
    ],
)
def test_impossible_declarations_are_refused_with_the_reason(ranks, gone, nodes, why):
    assert why in gone_problem(frozenset(ranks), frozenset(gone), nodes)


def test_possible_declarations_have_no_problem():
    assert gone_problem(frozenset({3}), frozenset(), 4) == ""
    assert gone_problem(frozenset({2}), frozenset({3}), 4) == ""  # node-rank 0, 1 live
    # node-rank 0 is never gone, so one node always remains: it may run alone
    assert gone_problem(frozenset({3}), frozenset({1, 2}), 4) == ""


def test_the_coordinator_refuses_another_job_and_before_any_join():
    c, _ = coord()
    with pytest.raises(Rejected, match="no job yet"):
        c.declare_gone("job", [3])
    join(c, 0)
    with pytest.raises(Rejected, match="job-name mismatch"):
        c.declare_gone("other", [3])
    with pytest.raises(Rejected, match="serves the coordinator"):
        c.declare_gone("job", [0])
    assert c.declare_gone("job", [3]) == (3,)
    assert c.declare_gone("job", [3]) == (3,)  # again: idempotent
    assert c.take_events() == [
        "node-rank(s) [3] declared gone for good in generation 1: rounds no longer wait for them"
    ]


# ---------------------------------------------------------------------- restore rounds


def test_a_restore_round_stops_waiting_for_a_gone_rank_and_takes_its_replica():
    c, _ = coord()
    for r, inv in survivors().items():
        join(c, r, inv)
    v = c.decide("job", 0, "r0")
    assert (v.state, v.missing, v.missing_count) == (WAITING, (3,), 1)
    c.declare_gone("job", [3])
    v = c.decide("job", 2, "r2")
    assert (v.state, v.step, v.outcome) == (DECIDED, 30, RESTORED)
    assert "node-rank(s) [3] declared gone: not waited for" in v.reason
    assert "from a verified copy on a peer or in the bucket" in v.reason
    st = c.status()
    assert st.gone == (3,) and st.to_json()["gone"] == [3]


def test_the_barrier_passes_without_the_gone_rank():
    """Regression (real 4-node run): decided without rank 3, the 'ready' barrier still
    waited for it and the restore timed out (exit 6)."""
    c, _ = coord()
    for r, inv in survivors().items():
        join(c, r, inv)
    c.declare_gone("job", [3])
    v = c.decide("job", 0, "r0")
    b = c.barrier("job", 0, "r0", v.round, v.version, "ready")
    assert (b.state, b.waiting_for, b.waiting_count) == (WAITING, (1, 2), 2)
    b = c.barrier("job", 1, "r1", v.round, v.version, "ready")
    assert (b.state, b.waiting_for, b.waiting_count) == (WAITING, (2,), 1)
    assert c.barrier("job", 2, "r2", v.round, v.version, "ready").state == PASSED
    for r in (0, 1, 2):
        b = c.barrier("job", r, f"r{r}", v.round, v.version, "done")
    assert b.state == PASSED


def test_a_gone_rank_without_a_verified_copy_makes_the_step_incomplete_never_fresh():
    c, _ = coord()
    inv = survivors(30, replica_of_3=False)
    for r in (0, 1, 2):
        inv[r].append(H(r, 20))
    inv[2].append(H(3, 20))  # rank 3's older step has a replica
    for r, held in inv.items():
        join(c, r, held)
    c.declare_gone("job", [3])
    v = c.decide("job", 0, "r0")
    assert (v.state, v.step, v.outcome) == (DECIDED, 20, OLDER)
    assert "declared gone" in v.reason
    # nothing of rank 3 anywhere: no step, with the reason (not a fresh start)
    c2, _ = coord()
    for r, held in survivors(30, replica_of_3=False).items():
        join(c2, r, held)
    c2.declare_gone("job", [3])
    v = c2.decide("job", 0, "r0")
    assert (v.state, v.step, v.outcome) == (DECIDED, None, INCOMPLETE)
    assert "lacks rank(s) [3]" in v.reason or any("[3]" in p for p in v.problems)


def test_a_gone_node_that_joins_again_is_refused_until_a_new_generation():
    c, _ = coord()
    for r in range(3):
        join(c, r)
    c.declare_gone("job", [3])
    with pytest.raises(Rejected, match="node-rank 3 was declared gone for good in generation 1"):
        join(c, 3)
    # node-rank 0 restarts the job on 3 nodes: a new generation, nobody gone
    join(c, 0, nodes=3)
    assert (c.generation, c.gone) == (2, frozenset())


# ---------------------------------------------------------------------- sync and backup rounds


def test_the_sync_round_completes_without_the_gone_rank():
    c, _ = coord()
    for r in range(4):
        join(c, r, rid="")
    for r in range(3):
        view = c.sync("job", r, f"inc{r}", 5, [H(r, 5)])
    assert view.synced_step == -1  # rank 3 never reported
    c.declare_gone("job", [3])
    assert c.synced_step == 5
    assert c.sync("job", 0, "inc0", 6, [H(0, 6)]).synced_step == 5
    # a gone node still running (a partition) is told to join, which is refused
    assert c.sync("job", 3, "inc3", 6, [H(3, 6)]).known is False
    assert c.roster.sync_steps.get(3) is None


def test_a_backup_round_neither_waits_for_nor_needs_the_gone_rank():
    c, _ = coord(backups=RoundBook())
    for r in range(4):
        c.join("job", 4, r, f"a{r}", f"inc{r}", (), "", "protocol", backup_interval_steps=1)
    assert c.backups is not None and c.backups.seed("job", "2025-01-01_00-00", None)
    c.declare_gone("job", [3])
    assert c.backups.ranks() == [0, 1, 2]
    order = None
    for r in range(3):
        order = c.sync("job", r, f"inc{r}", 1, [H(r, 1)]).backup_order
    assert order is not None and order[1] == 1
    from tierfs.cluster.backup_schedule import Outcome

    for r in range(3):
        last = c.sync("job", r, f"inc{r}", 1, [H(r, 1)], Outcome(order[0], 1, DONE)).backup_last
    assert last is not None and last.state == COMPLETE


# ---------------------------------------------------------------------- persistence, --gone-after


def stored_coordinator(store: str, now: Callable[[], float] = lambda: 1000.0) -> Coordinator:
    """A coordinator that keeps its generation and gone set in ``store`` (as the daemon
    of node-rank 0 does), on the clock ``now``."""
    return Coordinator(
        clock=now,
        wall=now,
        generation=statefile.load_generation(store),
        on_generation=lambda *g: statefile.save_generation(store, *g),
        gone=statefile.load_gone(store),
        on_gone=lambda gone: statefile.save_gone(store, gone),
    )


def test_the_gone_set_survives_a_coordinator_restart_of_the_same_generation(tmp_path):
    store = str(tmp_path)

    def coordinator() -> Coordinator:
        return stored_coordinator(store)

    c = coordinator()
    join(c, 0)
    c.declare_gone("job", [2])
    assert statefile.load_gone(store) == (2,)
    c = coordinator()  # node-rank 0 restarted, same count: same generation, still gone
    join(c, 0)
    assert (c.generation, c.gone) == (1, frozenset({2}))
    with pytest.raises(Rejected, match="declared gone"):
        join(c, 2)
    c = coordinator()  # restarted with another --nodes: the next generation clears it
    join(c, 0, nodes=3)
    assert (c.generation, c.gone, statefile.load_gone(store)) == (2, frozenset(), ())


def test_gone_after_declares_a_silent_member_gone():
    c, clock = coord(gone_after=30.0)
    for r in range(4):
        join(c, r, rid="")
    clock.t += 20
    for r in range(3):
        c.sync("job", r, f"inc{r}", 1, [H(r, 1)])
    assert c.gone == frozenset()  # 20 s of silence < 30 s
    clock.t += 15
    for r in range(3):
        c.sync("job", r, f"inc{r}", 1, [H(r, 1)])
    assert c.gone == frozenset({3}) and c.synced_step == 1
    assert "no heartbeat for more than 30 s (--gone-after)" in c.take_events()[0]


def test_gone_after_is_off_by_default_and_never_takes_node_rank_0():
    c, clock = coord()
    for r in range(2):
        join(c, r, nodes=2, rid="")
    clock.t += 10_000
    c.sync("job", 0, "inc0", 1, [])
    assert c.gone == frozenset()
    c, clock = coord(gone_after=5.0)
    join(c, 0, nodes=2, rid="")
    join(c, 1, nodes=2, rid="")
    clock.t += 10
    c.sync("job", 0, "inc0", 1, [])
    assert c.gone == frozenset({1})  # node-rank 0 remains
    assert c.expire_gone() == ()


# ---------------------------------------------------------------------- placement


def test_stand_ins_replace_gone_receivers_on_the_ring():
    # 4 nodes, one peer each: 2 -> 3; 3 gone: the next live rank after 3 is 0
    assert placement.with_stand_ins([3], 2, 4, {3}) == [0]
    assert placement.with_stand_ins([1], 0, 4, {1}) == [2]
    # not itself, not another receiver, not another gone rank
    assert placement.with_stand_ins([3, 0], 2, 4, {3}) == [1, 0]
    assert placement.with_stand_ins([3], 2, 4, {3, 0}) == [1]
    # nothing gone: unchanged; fewer live nodes than receivers: fewer receivers
    assert placement.with_stand_ins([1, 2], 0, 4, set()) == [1, 2]
    assert placement.with_stand_ins([1, 2], 0, 3, {1}) == [2]


def test_every_live_node_keeps_its_copy_count_after_a_loss():
    nodes, k, gone = 6, 2, {4}
    for rank in range(nodes):
        if rank in gone:
            continue
        placed = placement.peer_ranks(rank, nodes, peers_per_node=k)
        stand = placement.with_stand_ins(placed, rank, nodes, gone)
        assert len(stand) == len(placed) and not set(stand) & gone and rank not in stand


def test_replica_peers_of_a_job_get_stand_ins():
    job = JobSpec(name="job", framework="generic", node_rank=2, nodes=4, peers_per_node=1)
    assert replica_peers(job) == [3]
    assert replica_peers(job, frozenset({3})) == [0]


def test_the_status_line_shows_the_gone_ranks():
    from tierfs.cli.status import _generation
    from tierfs.core.status import NodeStatus
    from tierfs.core.status.peer import PeerStatus

    st = NodeStatus.from_json({"tiers": {"peer": PeerStatus("", gone=(3,)).to_json()}})
    assert _generation(st) == "  gone [3]"
    assert PeerStatus.from_json(PeerStatus("", gone=(1, 3)).to_json()).gone == (1, 3)
    assert "gone" not in PeerStatus("").to_json()


def test_wait_notes_a_skipped_gone_rank():
    from tierfs.cli.wait import gone_note
    from tierfs.cluster.restore_rounds import gone_reason

    reason = gone_reason("step 30 is complete in the cluster", [3])
    assert gone_note(reason) == (
        "node-rank(s) [3] declared gone: not waited for, their part taken only from a "
        "verified copy on a peer or in the bucket (a step saved after they were declared "
        "gone lacks their part and is never complete: restart the job with a node count "
        "without them before training on)"
    )
    assert gone_note("step 30 lacks rank(s) [3]; node-rank(s) [1] discarded") == ""


def test_nodes_gone_needs_a_job_and_a_coordinator():
    from tierfs.cli.nodes import _target

    with pytest.raises(click.ClickException, match="runs no job yet"):
        _target({}, None)
    with pytest.raises(click.ClickException, match="does not know its coordinator"):
        _target({"job": {"name": "j"}, "tiers": {"peer": {"coordinator": None}}}, None)
    status = {"job": {"name": "j"}, "tiers": {"peer": {"coordinator": "10.0.0.0:7000"}}}
    assert _target(status, None) == ("j", "10.0.0.0:7000")
    assert _target(status, "h:1") == ("j", "h:1")
    result = CliRunner().invoke(main, ["nodes", "gone", "/mnt/x"])
    assert result.exit_code == 2 and "Missing argument 'RANKS...'" in result.output


def test_a_refused_node_drops_the_coordinators_last_node_counts():
    # regression (issue #16 trial): a node the coordinator refused (declared gone)
    # kept showing "5 node(s) live" from its last accepted heartbeat
    from types import SimpleNamespace

    from tierfs.replication.addresses import AddressBook, Endpoint

    book = AddressBook(Endpoint(None, ""))
    book.update([], SimpleNamespace(live_nodes=5, known_nodes=5, gone=[]))
    assert book.node_counts == (5, 5)
    book.coordinator_down()
    assert book.node_counts is None


def test_a_job_that_ran_at_another_count_since_starts_a_new_generation(tmp_path):
    """Regression (#16 fourth trial F8): node 3 declared gone in generation 1 (4 nodes);
    the job restarted on 3 nodes, renumbered, under another node's coordinator; then
    back at 4 nodes with the old node-rank 0 as coordinator, which took up its stored
    generation 1 with gone [3] and refused the new, empty node 3 for good."""
    store = str(tmp_path)
    wall = [1000.0]

    def coordinator() -> Coordinator:
        return stored_coordinator(store, lambda: wall[0])

    c = coordinator()
    join(c, 0)
    c.declare_gone("job", [3])
    # meanwhile the job ran at 3 nodes elsewhere and saved step 20 there
    wall[0] = 2000.0
    c = coordinator()
    three = [Holding(0, 20, True, "d0", created=1500.0, nodes=3)]
    join(c, 0, inv=three)
    assert (c.generation, c.gone, statefile.load_gone(store)) == (2, frozenset(), ())
    assert "generation 2 of job 'job' (4 nodes) begins" in c.take_events()[0]
    join(c, 3)  # the new node 3 is welcome
    # a part of another count sealed before the generation began proves nothing
    c = coordinator()
    join(c, 0, inv=[Holding(0, 10, True, "d", created=900.0, nodes=3)])
    assert c.generation == 2


def test_gone_ranks_are_written_as_ranges():
    """A rack of 1,000 gone ranks is one short line in logs and events, not 1,000
    numbers (found with bench/heartbeat_bench.py --gone 1000)."""
    from tierfs.core.ranks import rank_ranges

    assert rank_ranges(range(9000, 10000)) == "[9000-9999]"
    assert rank_ranges([9, 3, 4, 5, 7, 8]) == "[3-5, 7-9]"
    assert rank_ranges([2, 1]) == "[1, 2]" and rank_ranges([]) == "[]"
