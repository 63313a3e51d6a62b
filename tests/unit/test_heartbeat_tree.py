"""The heartbeat tree over loopback gRPC (issue #17 item 2).

Hundreds of simulated nodes (blocking clients in threads, no daemons) send
their heartbeats through group leaders: real :class:`SyncRelay` services on
their own :class:`AioServer`, the real coordinator service on another, and
each member's real :class:`SyncRoute` (leader choice, relay, fallback). The
coordinator's call counters show ~N/G calls per round; every member's reply
is its own; a dead or hung leader's members go direct and stay live.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc.aio
import pytest

from tierfs.cluster.coordinator import Coordinator
from tierfs.cluster.servicer import CoordinatorServicer
from tierfs.replication.addresses import PeerInfo
from tierfs.replication.client import PeerClient, sync_request
from tierfs.replication.groups import RELAY_TIMEOUT
from tierfs.replication.relay import SyncRelay
from tierfs.replication.route import CoordinatorBusy, SyncRoute
from tierfs.rpc import wire as peer_wire
from tierfs.rpc.aio_server import AioServer
from tierfs.rpc.wire import WireStats

NODES = 300
GROUP = 100
LEADERS = (0, 100, 200)
#: the candidate leaders (the lowest 3 ranks of each group) serve a relay
CANDIDATES = tuple(g + i for g in LEADERS for i in range(3))
JOB = "job"
TOKEN = "t"
#: a leader's batch window in these tests (members of a round arrive within it)
WINDOW = 1.0


def _serve(attach: Any) -> tuple[AioServer, str]:
    server = AioServer(
        attach,
        interceptors=[peer_wire.AioTokenInterceptor(TOKEN)],
        options=peer_wire.SERVER_OPTIONS,
    )
    port = server.start("127.0.0.1:0")
    return server, f"127.0.0.1:{port}"


@dataclass
class Member:
    rank: int
    address: str
    incarnation: str
    route: SyncRoute
    peers: dict[int, PeerInfo] = field(default_factory=dict)
    reply: Any = None


@dataclass
class Cluster:
    clock: list[float]
    servicer: CoordinatorServicer
    coord: str
    relays: dict[int, SyncRelay]
    servers: dict[int, AioServer]
    client: PeerClient
    members: list[Member]

    def round(self, ranks: range | list[int] | None = None) -> dict[str, int]:
        """One heartbeat of every member (all at once); the coordinator's calls it took."""
        s = self.servicer
        before = (s.sync_calls, s.batch_calls, s.batched_members)
        todo = [self.members[r] for r in (ranks if ranks is not None else range(NODES))]
        with ThreadPoolExecutor(max_workers=len(todo)) as pool:
            list(pool.map(self._beat, todo))
        return {
            "sync": s.sync_calls - before[0],
            "batch": s.batch_calls - before[1],
            "members": s.batched_members - before[2],
        }

    def _beat(self, m: Member) -> None:
        wanted = sorted({*m.route.wanted(m.rank, NODES), (m.rank + 1) % NODES})
        req = sync_request(JOB, m.rank, m.incarnation, m.rank, (), want_peers=wanted)
        via = m.route.leader_of(m.rank, NODES, m.address, m.peers)
        m.reply = m.route.sync(self.coord, req, via)
        for p in m.reply.peers:
            m.peers[p.rank] = PeerInfo(p.rank, p.address, p.incarnation, p.live)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    clock = [1000.0]
    servicer = CoordinatorServicer(Coordinator(clock=lambda: clock[0], live_seconds=5.0))
    servers: dict[int, AioServer] = {}
    server, coord = _serve(servicer.attach)
    client = PeerClient(TOKEN, WireStats())
    relays: dict[int, SyncRelay] = {}
    addresses = {}
    try:
        for r in CANDIDATES:
            relays[r] = SyncRelay(TOKEN, rank=lambda r=r: r, window=WINDOW)
            servers[r], addresses[r] = _serve(relays[r].attach)
        members = []
        for r in range(NODES):
            route = SyncRoute(client, group_size=GROUP, relay_timeout=WINDOW + 5.0)
            members.append(
                Member(r, addresses.get(r, f"10.9.{r // 250}.{r % 250}:7000"), f"i{r}", route)
            )
        for m in members:  # leaders first: everyone's Join lists its candidate leaders
            client.join(
                coord,
                job=JOB,
                nodes=NODES,
                rank=m.rank,
                address=m.address,
                incarnation=m.incarnation,
                restore_id="",
                mode="protocol",
                want_peers=m.route.wanted(m.rank, NODES),
                compact=True,
            )
        for m in members:  # what each node's Join reply would have told it
            for r in m.route.wanted(m.rank, NODES):
                a = members[r]
                m.peers[r] = PeerInfo(r, a.address, a.incarnation, True)
        yield Cluster(clock, servicer, coord, relays, servers, client, members)
    finally:
        for s in servers.values():
            s.stop(0)
        server.stop(0)
        client.close()


def _check_replies(c: Cluster, ranks: range | list[int]) -> None:
    co = c.servicer.coordinator
    for r in ranks:
        m = c.members[r]
        reply = m.reply
        assert reply.known, r
        wanted = {*m.route.wanted(r, NODES), (r + 1) % NODES}
        assert {p.rank for p in reply.peers} == wanted, r
        for p in reply.peers:
            assert p.address == c.members[p.rank].address
            assert p.incarnation == f"i{p.rank}"
        assert reply.known_nodes == NODES
        # the coordinator heard this member now, with its own report
        assert co.members[r].last_seen == c.clock[0]
        assert co.members[r].replicated_step == r
        assert co.live(r)


def test_a_round_costs_the_coordinator_one_call_per_group_and_each_member_gets_its_reply(
    cluster,
):
    c = cluster
    calls = c.round()
    # every heartbeat went through a leader: no direct Sync, ~N/G batches
    assert calls["sync"] == 0
    assert calls["members"] == NODES
    assert len(LEADERS) <= calls["batch"] <= 2 * len(LEADERS)
    assert sum(r.batches for r in c.relays.values()) == calls["batch"]
    assert [c.relays[r].members for r in LEADERS] == [GROUP] * len(LEADERS)
    assert {m.route.via for m in c.members} == set(LEADERS)
    assert all(m.route.via == m.rank - m.rank % GROUP for m in c.members)
    _check_replies(c, range(NODES))
    assert c.members[NODES - 1].reply.live_nodes == NODES

    # a member the coordinator does not know (another incarnation) is fenced in
    # its batch like a direct Sync: known=False for it alone
    c.members[150].incarnation = "stale"
    c.clock[0] += 1.0
    calls = c.round()
    assert calls["sync"] == 0 and calls["members"] == NODES
    assert not c.members[150].reply.known
    _check_replies(c, [r for r in range(NODES) if r != 150])


def test_a_dead_leaders_members_go_direct_and_stay_live(cluster):
    c = cluster
    c.round()
    c.servers[100].stop(0)  # node-rank 100, leader of 100..199, dies
    c.clock[0] += 1.0
    members = [r for r in range(NODES) if r != 100]  # it sends no heartbeat either
    calls = c.round(members)
    assert calls["sync"] == GROUP - 1  # its members fell back in the same beat
    assert calls["members"] == NODES - GROUP
    _check_replies(c, members)
    assert all(c.members[r].route.via is None for r in range(101, 200))
    assert all(100 in c.members[r].route.failed for r in range(101, 200))
    # the next beats go through the next candidate, node-rank 101 (100 is skipped
    # for the backoff; the coordinator stops listing it live after live_seconds)
    c.clock[0] += 1.0
    calls = c.round(list(range(101, 200)))
    assert calls["sync"] == 0
    assert calls["members"] == GROUP - 1
    assert 1 <= calls["batch"] <= 2
    assert all(c.members[r].route.via == 101 for r in range(101, 200))
    assert all(c.members[r].route.fallbacks == 1 for r in range(101, 200))
    _check_replies(c, range(101, 200))
    # once the coordinator no longer lists node-rank 100 live, members choose 101
    # without trying 100 again, also after the backoff
    c.clock[0] += 10.0
    calls = c.round(members)
    assert not c.servicer.coordinator.live(100)
    assert all(not c.members[r].peers[100].live for r in range(101, 200))
    for m in c.members[101:200]:
        m.route.failed.clear()
    calls = c.round(list(range(101, 200)))
    assert calls["sync"] == 0
    assert all(c.members[r].route.via == 101 for r in range(101, 200))


def test_a_hung_leaders_members_go_direct_after_the_relay_timeout(cluster):
    c = cluster
    c.relays[200].window = 3600.0  # node-rank 200 takes calls but never sends its batch
    for m in c.members[200:]:
        m.route.relay_timeout = 1.0
    calls = c.round(range(200, NODES))
    assert calls["sync"] == GROUP
    assert calls["batch"] == 0
    _check_replies(c, range(200, NODES))
    assert all(c.members[r].route.failed.get(200) is not None for r in range(200, NODES))


def test_a_leader_that_cannot_reach_the_coordinator_is_kept(cluster):
    """The batch call fails (the coordinator is at fault, not the leader): the
    members sync directly this beat and go through their leader again the next."""
    c = cluster
    relay = c.relays[200]
    relay._connect = lambda address: grpc.aio.insecure_channel("127.0.0.1:1")  # nothing there
    relay._channels.clear()
    calls = c.round(range(200, NODES))
    assert calls["sync"] == GROUP and calls["batch"] == 0
    _check_replies(c, range(200, NODES))
    assert relay.failures >= 1
    assert all(c.members[r].route.fallbacks == 1 for r in range(200, NODES))
    assert all(200 not in c.members[r].route.failed for r in range(200, NODES))
    relay._connect = lambda address: grpc.aio.insecure_channel(address)
    relay._channels.clear()
    c.clock[0] += 1.0
    calls = c.round(range(200, NODES))
    assert calls["sync"] == 0 and calls["members"] == GROUP
    assert all(c.members[r].route.via == 200 for r in range(200, NODES))


def _beats(c: Cluster, ranks: range) -> list[str]:
    """One heartbeat of each of ``ranks`` at once: "relayed", "direct" or "skipped"."""

    def beat(m: Member) -> str:
        try:
            c._beat(m)
        except CoordinatorBusy:
            return "skipped"
        return "relayed" if m.route.via is not None else "direct"

    with ThreadPoolExecutor(max_workers=len(ranks)) as pool:
        return list(pool.map(beat, [c.members[r] for r in ranks]))


def _until(cond: Any, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_slow_coordinator_skips_one_beat_instead_of_sending_every_member_direct(cluster):
    """Review of #17, B2: a coordinator stalled for a few seconds (its lock held, as a
    bucket lookup does) made the leader's batch call outlast its members' relay
    calls (10 s against 3 s): every member took its healthy leader for a dead one,
    went direct at once and stayed direct for the 30 s backoff, 10,000 direct Syncs
    per second on a coordinator already behind. Now the leader gives its call up
    before its members' deadline and says so; the members skip that beat (no direct
    Sync, leader kept), and only a second such beat in a row goes direct."""
    c = cluster
    relay = c.relays[200]
    for m in c.members[200:]:
        m.route.relay_timeout = RELAY_TIMEOUT  # the shipped default (3 s)
    release = threading.Event()

    def stall() -> threading.Thread:
        t = threading.Thread(target=c.servicer.locked, args=(lambda _c: release.wait(60),))
        t.start()
        return t

    stalled = stall()
    try:
        direct_before = c.servicer.sync_calls
        assert _beats(c, range(200, NODES)) == ["skipped"] * GROUP
        assert relay.failures == 1
        assert c.servicer.sync_calls == direct_before  # nobody went direct
        assert all(200 not in c.members[r].route.failed for r in range(200, NODES))
        # still stalled: a second busy beat in a row goes direct (answered once the
        # coordinator is back)
        with ThreadPoolExecutor(max_workers=1) as pool:
            second = pool.submit(_beats, c, range(200, NODES))
            _until(lambda: relay.failures == 2, "the second batch to time out")
            release.set()
            assert second.result() == ["direct"] * GROUP
    finally:
        release.set()
        stalled.join()
    _check_replies(c, range(200, NODES))
    assert all(c.members[r].route.skipped == 1 for r in range(200, NODES))
    # the next beat goes through the leader again
    c.clock[0] += 1.0
    calls = c.round(range(200, NODES))
    assert calls["sync"] == 0 and calls["members"] == GROUP
    assert all(c.members[r].route.via == 200 for r in range(200, NODES))
