"""Heartbeat groups (issue #17 item 2): grouping by node rank and the leader choice (pure)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tierfs.replication.groups import LEADER_BACKOFF, candidates, group_of, leader
from tierfs.replication.route import SyncRoute


def test_groups_are_consecutive_node_ranks():
    assert group_of(0, 100) == range(0, 100)
    assert group_of(99, 100) == range(0, 100)
    assert group_of(100, 100) == range(100, 200)
    assert group_of(9_999, 100) == range(9_900, 10_000)
    with pytest.raises(ValueError):
        group_of(5, 0)
    with pytest.raises(ValueError):
        group_of(-1, 100)


def test_small_jobs_have_no_leader_candidates():
    assert candidates(3, 5, 100) == []
    assert candidates(99, 100, 100) == []
    assert candidates(99, 101, 100) == [0, 1, 2]
    # the last group is clipped to the node count
    assert candidates(100, 101, 100) == [100]
    assert candidates(250, 1_000, 100, 3) == [200, 201, 202]


def test_leader_is_the_lowest_live_candidate_not_gone():
    live = {200: True, 201: True, 202: True}
    assert leader(250, 1_000, live=live) == 200
    assert leader(200, 1_000, live=live) == 200  # the leader is in its own batch
    assert leader(250, 1_000, live={**live, 200: False}) == 201
    assert leader(250, 1_000, live=live, gone={200, 201}) == 202
    # an unknown address is no candidate; none left: direct
    assert leader(250, 1_000, live={202: False}) is None
    assert leader(3, 5, live={0: True}) is None


def test_a_failed_leader_is_skipped_for_the_backoff_then_tried_again():
    live = {0: True, 1: True, 2: True}
    failed = {0: 100.0}
    assert leader(50, 200, live=live, failed=failed, now=100.0) == 1
    assert leader(50, 200, live=live, failed=failed, now=100.0 + LEADER_BACKOFF - 0.1) == 1
    assert leader(50, 200, live=live, failed=failed, now=100.0 + LEADER_BACKOFF) == 0
    assert leader(50, 200, live=live, failed={0: 1.0, 1: 1.0, 2: 1.0}, now=2.0) is None


@dataclass
class Peer:
    address: str
    live: bool


def test_route_picks_the_leader_address_from_the_coordinators_peers():
    now = [10.0]
    route = SyncRoute(None, group_size=10, clock=lambda: now[0])  # type: ignore[arg-type]
    peers = {10: Peer("10.0.0.10:7000", True), 11: Peer("10.0.0.11:7000", True)}
    assert route.wanted(15, 40) == [10, 11, 12]
    assert route.wanted(10, 40) == [11, 12]
    assert route.wanted(5, 10) == []
    assert route.leader_of(15, 40, "10.0.0.15:7000", peers) == (10, "10.0.0.10:7000")
    # the leader sends its own heartbeat to its own relay
    assert route.leader_of(10, 40, "10.0.0.10:7000", peers) == (10, "10.0.0.10:7000")
    # no address of its own (no server): it never leads; the next candidate does
    assert route.leader_of(10, 40, "", peers) == (11, "10.0.0.11:7000")
    route.failed[10] = now[0]
    assert route.leader_of(15, 40, "x", peers) == (11, "10.0.0.11:7000")
    now[0] += LEADER_BACKOFF
    assert route.leader_of(15, 40, "x", peers) == (10, "10.0.0.10:7000")
    # a small job: direct
    assert route.leader_of(5, 10, "x", peers) is None
