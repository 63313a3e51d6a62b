"""Heartbeat groups with real daemons (issue #17 item 2): 4 nodes, ``--heartbeat-group 2``.

Node-ranks 0 and 2 lead the groups {0, 1} and {2, 3}: every node's heartbeat
goes through its leader's relay, the leaders send batches to the coordinator
(node-rank 0). When leader 2 dies, node 3 falls back to a direct Sync in the
same beat and then leads itself; the coordinator never sees it stale.
"""

from __future__ import annotations

from typing import Any

import pytest
from peer_cluster import Cluster, job_args, wait_until

pytestmark = pytest.mark.slow

JOB = "hbgroups"


def test_four_daemons_in_two_heartbeat_groups_keep_their_liveness_when_a_leader_dies(
    make_mount,
):
    c = Cluster(make_mount, 4, extra=("--heartbeat-group", "2"), node_args=job_args(JOB, 4))

    def members() -> dict[int, dict[str, Any]]:
        state = c.peer(0)["coordinator_state"] or {}
        return {m["rank"]: m for m in state.get("members", [])}

    def wire(i: int) -> dict[str, int]:
        return c.peer(i)["wire"]

    wait_until(
        lambda: all(wire(i)["heartbeats_relayed"] >= 3 for i in range(4)),
        90,
        "every node's heartbeats through its group leader",
    )
    assert wire(0)["heartbeat_batches_sent"] >= 3 and wire(2)["heartbeat_batches_sent"] >= 3
    # settled (a node may lead itself until it knows its leader's address): the
    # members' heartbeats go through their leaders only
    before = {i: wire(i) for i in (1, 3)}
    wait_until(
        lambda: all(
            wire(i)["heartbeats_relayed"] >= before[i]["heartbeats_relayed"] + 3 for i in (1, 3)
        ),
        60,
        "three more heartbeats of nodes 1 and 3 through their leaders",
    )
    for i in (1, 3):
        now = wire(i)
        for key in ("heartbeat_batches_sent", "heartbeat_fallbacks", "heartbeats_direct"):
            assert now[key] == before[i][key], (i, key, now, before[i])
    wait_until(
        lambda: sorted(r for r, m in members().items() if m["live"]) == [0, 1, 2, 3],
        30,
        "the coordinator to see all 4 nodes live",
    )
    relayed = wire(3)["heartbeats_relayed"]

    c.mounts[2].kill9()  # the leader of {2, 3}
    wait_until(lambda: wire(3)["heartbeat_fallbacks"] >= 1, 30, "node 3 to leave its dead leader")
    wait_until(lambda: not members()[2]["live"], 30, "the coordinator to see node-rank 2 gone")
    m = members()
    assert m[3]["live"] and m[3]["seen_seconds_ago"] < 3.0, m[3]
    assert m[1]["live"] and m[0]["live"]
    # node 3 is now the lowest live rank of its group: it relays its own heartbeat
    wait_until(
        lambda: wire(3)["heartbeat_batches_sent"] >= 2 and wire(3)["heartbeats_relayed"] > relayed,
        30,
        "node 3 to lead its group",
    )
    assert members()[3]["seen_seconds_ago"] < 3.0
    assert "heartbeat" not in c.errors(3)


def test_a_restore_round_goes_through_the_group_leaders(make_mount):
    """The restore round's Decide and Barrier calls take the heartbeats' route
    (ARCHITECTURE.md "Batched restore round"): node 3 is lost and restarted, every
    rank restores step 3, and node 1, a member that kept running, sends its round
    calls through its leader, node 0, which batches them with its own."""
    c = Cluster(make_mount, 4, extra=("--heartbeat-group", "2"))

    def wire(i: int) -> dict[str, int]:
        return c.peer(i)["wire"]

    first = c.clients(steps="1,2,3", size=200_000)
    c.wait_synced(3)
    before = {i: wire(i) for i in range(4)}
    wait_until(
        lambda: all(
            wire(i)["heartbeats_relayed"] >= before[i]["heartbeats_relayed"] + 2 for i in (1, 3)
        ),
        60,
        "nodes 1 and 3 to heartbeat through their leaders",
    )
    before = {i: wire(i) for i in range(4)}
    c.lose(3)
    c.remount(3)
    again = c.clients(size=200_000)
    assert [r["restored"] for r in again] == [3, 3, 3, 3], c.logs()
    assert all(r["restored_ok"] for r in again), again
    assert again[3]["restored_digest"] == first[3]["saved"]["3"]
    w1, w0 = wire(1), wire(0)
    # node 1 (Decide, ready, done: at least 3 calls) only through node 0, its leader
    assert w1["round_calls_relayed"] - before[1]["round_calls_relayed"] >= 3, w1
    assert w1["round_calls_direct"] == before[1]["round_calls_direct"], w1
    assert w1["round_fallbacks"] == before[1]["round_fallbacks"], w1
    assert w0["round_batches_sent"] - before[0]["round_batches_sent"] >= 3, w0
    assert w0["round_calls_batched"] - before[0]["round_calls_batched"] >= 6, w0
    assert "restore" not in c.errors(1)
