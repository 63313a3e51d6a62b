"""Status lines of elastic restarts (issue #16): copies of each rank's part the cluster
holds (tierfs/cluster/copies.py), ranks declared gone, failed fetches in `tierfs wait`."""

from __future__ import annotations

import json

from tierfs.cli.status import format_status
from tierfs.cluster.copies import copies_line, copy_counts
from tierfs.core.status import CoordinatorStatus, NodeStatus
from tierfs.core.status.peer import PeerStatus
from tierfs.core.types import Holding


def H(rank: int, step: int, digest: str | None = None, verified: bool = True) -> Holding:
    return Holding(rank, step, verified, digest or f"d{rank}-{step}")


def test_copies_are_counted_on_live_members_with_the_parts_digest():
    # 4 nodes in pairs 0-1 and 2-3; node 3 lost: rank 3's part survives on node 2 only
    inventories = {
        0: [H(0, 4), H(1, 4), H(0, 2)],
        1: [H(1, 4), H(0, 4)],
        2: [H(2, 4), H(3, 4)],
        3: [H(3, 4), H(2, 4)],
    }
    alive = lambda r: r != 3  # noqa: E731
    assert copy_counts(inventories, 4, alive) == {0: 2, 1: 2, 2: 1, 3: 1}
    assert copy_counts(inventories, 4, lambda r: True) == {0: 2, 1: 2, 2: 2, 3: 2}
    assert copy_counts(inventories, 4, lambda r: True, frozenset({3})) == {0: 2, 1: 2, 2: 1, 3: 1}
    # a copy with other bytes than the owner's, or unverified, is not a copy
    inventories[1] = [H(1, 4), H(0, 4, "stale")]
    inventories[2] = [H(2, 4), H(3, 4, verified=False)]
    assert copy_counts(inventories, 4, alive) == {0: 1, 1: 2, 2: 1}
    # the owner gone: the digest most holders have
    inv = {0: [H(2, 4, "a")], 1: [H(2, 4, "a")], 3: [H(2, 4, "b")]}
    assert copy_counts(inv, 4, lambda r: True) == {2: 2}
    assert copy_counts(inventories, 9, alive) == {}


def test_a_rank_of_the_writers_with_no_copy_makes_the_step_incomplete():
    # step 5 saved by a 4-node job after node 3 was declared gone: rank 3 has no part
    inventories = {
        m: [Holding(r, 5, True, f"d{r}", nodes=4) for r in (m, (m + 1) % 3)] for m in range(3)
    }
    counts = copy_counts(inventories, 5, lambda r: True, frozenset({3}))
    assert counts == {0: 2, 1: 2, 2: 2, 3: 0}
    assert copy_counts(inventories, 5, lambda r: True, writers=5) == {0: 2, 1: 2, 2: 2, 3: 0, 4: 0}
    assert copies_line(5, counts) == (
        "step 5: incomplete: no copy of rank(s) [3]'s part on a live node; "
        "the others: 2 copies of every rank's part"
    )
    assert copies_line(5, {0: 0, 1: 0}) == "step 5: no verified copy known"


def test_the_copies_line_names_the_ranks_with_the_fewest():
    assert copies_line(4, {0: 2, 1: 2}) == "step 4: 2 copies of every rank's part"
    assert copies_line(4, {0: 1}) == "step 4: 1 copy of every rank's part"
    assert copies_line(4, {0: 2, 1: 2, 2: 1, 3: 1}) == (
        "step 4: 1-2 copies; fewest (1): rank(s) [2, 3]"
    )
    many = {r: 1 for r in range(10)} | {10: 2}
    assert copies_line(7, many, shown=3) == (
        "step 7: 1-2 copies; fewest (1): rank(s) [0, 1, 2] (+7 more)"
    )
    assert copies_line(7, {}) == "step 7: no verified copy known"


def test_the_copies_survive_the_status_json_and_make_a_status_line():
    st = CoordinatorStatus(job="j", nodes=4, copies_step=4, copies={0: 2, 3: 1})
    back = CoordinatorStatus.from_json(json.loads(json.dumps(st.to_json())))
    assert (back.copies_step, back.copies) == (4, {0: 2, 3: 1})
    assert CoordinatorStatus.from_json(CoordinatorStatus(job="j").to_json()).copies_step is None
    peer = PeerStatus("", coordinator_state=st)
    lines = format_status(NodeStatus.from_json({"tiers": {"peer": peer.to_json()}}))
    assert "copies     step 4: 1-2 copies; fewest (1): rank(s) [3]" in lines, lines
    plain = NodeStatus.from_json({"tiers": {"peer": PeerStatus("").to_json()}})
    assert not any(line.startswith("copies") for line in format_status(plain))


def test_a_rank_declared_gone_is_not_shown_as_not_yet_in_the_view_line():
    """Regression (new-user trial): a step missing a rank declared gone for good said
    "3 not yet", as if its part were still coming."""
    from tierfs.cli.status import _whole_view_lines
    from tierfs.core.status.whole import WholeStepStatus

    st = NodeStatus.from_json(
        {
            "tiers": {"peer": PeerStatus("", gone=(3,)).to_json()},
            "whole_view": {
                "active": True,
                "steps": [WholeStepStatus(30, ranks_known=(0, 1), ranks_missing=(2, 3)).to_json()],
            },
        }
    )
    lines = _whole_view_lines(st)
    assert "ranks 0,1 known, 2 not yet, 3 gone;" in lines[1], lines


def test_wait_bytes_says_which_fetch_failed():
    """Regression (elastic trial): ``tierfs wait --bytes`` said only "not fetched yet"
    for a file whose fetch had failed (no copy served verified bytes)."""
    from tierfs.cli.wait import whole_step_unready
    from tierfs.core.status.whole import WholeStepStatus

    def status(**kw):
        step = WholeStepStatus(40, ranks_known=(0, 1, 2), remote=1, bytes_remote=245, **kw)
        return NodeStatus.from_json(
            {
                "mode": "generic",
                "restore": {"state": "done", "step": 40, "source": "local"},
                "whole_view": {"active": True, "steps": [step.to_json()]},
            }
        )

    assert whole_step_unready(status(), True) == (
        "1 files (245 bytes) of other ranks of step 40 are not fetched yet"
    )
    assert whole_step_unready(status(failed=("checkpoint-40/__2_0.distcp",)), True) == (
        "1 files (245 bytes) of other ranks of step 40 are not fetched yet; the last "
        "fetch of checkpoint-40/__2_0.distcp failed (see replicator.errors)"
    )
    assert whole_step_unready(status(), False) is None


def test_wait_says_where_the_other_ranks_files_of_the_restored_step_come_from():
    """Regression (elastic trial): ``restored step 30 from local`` did not say that the
    other ranks' files were fetched (some from the bucket)."""
    from tierfs.cli.wait import whole_step_note
    from tierfs.core.status.whole import WholeStepStatus

    def status(fetched: dict[str, int], **kw):
        step = WholeStepStatus(30, ranks_known=(0, 2, 3), **kw)
        return NodeStatus.from_json(
            {
                "mode": "generic",
                "restore": {"state": "done", "step": 30, "source": "local"},
                "whole_view": {
                    "active": True,
                    "steps": [step.to_json()],
                    "fetched_bytes": fetched,
                },
            }
        )

    assert whole_step_note(status({"gcs": 1048576, "peer": 0}, local=4, remote=1, fetching=1)) == (
        "the other ranks' files of step 30: 4 here, 2 fetched on first read "
        "(3 ranks: 0, 2, 3); fetched by this daemon since its start: 1048576 bytes from gcs"
    )
    assert whole_step_note(status({"peer": 5}, local=6)) == (
        "the other ranks' files of step 30: 6 here, 0 fetched on first read "
        "(3 ranks: 0, 2, 3); fetched by this daemon since its start: 5 bytes from peer"
    )
    # every file here from the start (regression: a note on every plain restore)
    assert whole_step_note(status({}, local=6)) is None
    assert whole_step_note(status({"gcs": 0})) is None
    one = NodeStatus.from_json({"restore": {"state": "done", "step": 30, "source": "local"}})
    assert whole_step_note(one) is None  # one node, or no view


def test_a_fresh_start_is_no_answer_on_a_node_that_holds_steps_now():
    """Regression (#16 sixth trial N4, a silent fresh start): right after a node loss,
    ``tierfs wait`` on both survivors printed ``nothing to restore ... a fresh start``
    (exit 0), their restore at mount time, while they held step 20; a trainer that
    follows the printed step starts ranks 0 and 1 from scratch. Such a result is not
    an answer: the wait goes on for the round the restarted node starts."""
    from tierfs.cli.wait import stale_fresh_start

    def status(restore: dict, steps: list[tuple[int, str]]) -> NodeStatus:
        return NodeStatus.from_json(
            {
                "restore": restore,
                "steps": [{"step": s, "name": f"checkpoint-{s}", "state": st} for s, st in steps],
            }
        )

    fresh = {"state": "done", "outcome": "fresh", "reason": "no step of the job exists"}
    line = stale_fresh_start(status(fresh, [(20, "replicated"), (10, "replicated")]))
    assert line is not None and "holds step 20 now" in line
    assert stale_fresh_start(status(fresh, [])) is None  # a true fresh start
    assert stale_fresh_start(status(fresh, [(10, "writing")])) is None  # being written
    restored = {"state": "done", "step": 10, "source": "local", "outcome": "restored"}
    assert stale_fresh_start(status(restored, [(20, "replicated")])) is None
    running = {"state": "planning"}
    assert stale_fresh_start(status(running, [(20, "replicated")])) is None


def test_a_restored_step_dropped_since_is_not_waited_for():
    """#16 eighth trial N7: retention (--keep-local) dropped the restored step 60 while
    the job saved 120-140; ``tierfs wait --no-restart`` waited for "the other ranks'
    files of step 60" that no view shows any more and exited 7 after --timeout."""
    from tierfs.cli.wait import whole_step_unready

    def status(steps: list[int]) -> NodeStatus:
        return NodeStatus.from_json(
            {
                "mode": "generic",
                "restore": {"state": "done", "step": 60, "source": "local"},
                "whole_view": {"active": True, "steps": []},
                "steps": [
                    {"step": s, "name": f"checkpoint-{s}", "state": "replicated"} for s in steps
                ],
            }
        )

    assert whole_step_unready(status([140, 130, 120]), False) is None
    # just restored, the view has not looked at it yet: still waited for
    assert whole_step_unready(status([60]), False) == (
        "the other ranks' files of step 60 are not in the view yet"
    )
    assert whole_step_unready(status([]), False) is not None  # a node added since


def test_wait_bytes_says_when_the_ram_budget_cannot_hold_the_other_ranks_files():
    """Regression (#14 trial 49 F5): on a node with ``--size 1200Mi``, ``tierfs wait
    --bytes`` ended with exit 7 and "1 files (268435456 bytes) ... are not fetched yet"
    and no cause, while the prefetch fetched and dropped the files in turn."""
    from tierfs.cli.wait import whole_step_unready
    from tierfs.core.status.whole import WholeStepStatus

    def status(free: int, dropped: int = 0, size: int | None = 1258291200):
        step = WholeStepStatus(210, ranks_known=(0, 1, 2), remote=1, bytes_remote=268435456)
        return NodeStatus.from_json(
            {
                "mode": "generic",
                "budget": {"mode": "native", "total_bytes": 1258291200, "free_bytes": free}
                | ({"size_bytes": size} if size is not None else {}),
                "restore": {"state": "done", "step": 210, "source": "local"},
                "whole_view": {
                    "active": True,
                    "steps": [step.to_json()],
                    "dropped_bytes": dropped,
                },
            }
        )

    head = "1 files (268435456 bytes) of other ranks of step 210 are not fetched yet"
    assert whole_step_unready(status(free=100 << 20), True) == (
        head + "; the RAM budget (--size 1258291200 bytes, 104857600 free) cannot hold "
        "them beside this node's own files: a file not kept is fetched when read"
    )
    assert whole_step_unready(status(free=600 << 20, dropped=268435456), True) == (
        head + "; the RAM budget (--size 1258291200 bytes, 629145600 free) may be too "
        "small to keep them all (268435456 bytes of fetched files were dropped for room): "
        "a file not kept is fetched when read"
    )
    assert whole_step_unready(status(free=600 << 20), True) == head  # room: just not yet
    assert whole_step_unready(status(free=100 << 20, size=None), True) == head  # no --size
