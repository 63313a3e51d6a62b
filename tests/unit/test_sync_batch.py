"""The coordinator's batched heartbeat call, SyncBatch (issue #17 item 2).

Two coordinators in the same state on the same clock: one answers each
member's Sync, the other the same requests in one SyncBatch. Every reply
must be byte-identical (the fencing, the peers, the gone ranks, the part
changes, counts), and the coordinator's state after the round the same.
The handlers are called directly (no sockets: the gRPC path is
tests/unit/test_heartbeat_tree.py).
"""

from __future__ import annotations

import asyncio

from tierfs.cluster.coordinator import Coordinator, Holding
from tierfs.cluster.servicer import CoordinatorServicer
from tierfs.replication.addresses import AddressBook, Endpoint
from tierfs.replication.client import sync_request
from tierfs.rpc import peer_pb2
from tierfs.rpc import wire as peer_wire

NODES = 12
JOB = "job"


def _join(s: CoordinatorServicer, rank: int, incarnation: str, *held: Holding) -> None:
    """Node ``rank``'s daemon ``incarnation`` joins at 10.0.0.<rank>:7000 holding ``held``."""
    q = peer_pb2.JoinRequest(
        job=JOB,
        nodes=NODES,
        rank=rank,
        address=f"10.0.0.{rank}:7000",
        incarnation=incarnation,
        mode="protocol",
        inventory=[peer_wire.held_shard(h) for h in held],
    )
    asyncio.run(s.Join(q, None))


def _servicer(clock: list[float]) -> CoordinatorServicer:
    s = CoordinatorServicer(Coordinator(clock=lambda: clock[0], live_seconds=5.0))
    for r in range(NODES):
        _join(s, r, f"i{r}", Holding(r, 3, True, f"d{r}-3"))
    s.coordinator.declare_gone(JOB, [7], "test")
    return s


def _requests(step: int, digest: str = "") -> list[peer_pb2.SyncRequest]:
    out = []
    for r in range(NODES):
        inc = "stale" if r == 4 else f"i{r}"  # node-rank 4 restarted: it must join again
        held = [Holding(r, 3, True, f"d{r}-3"), Holding(r, step, True, digest or f"d{r}-{step}")]
        out.append(
            sync_request(
                JOB,
                r,
                inc,
                step,
                held,
                want_peers=sorted({0, (r + 1) % NODES, (r + 5) % NODES} - {r}),
                view_steps=[(step, 0)],
            )
        )
    return out


def test_a_batch_answers_every_member_as_its_own_sync_would():
    clock = [100.0]
    one, batch = _servicer(clock), _servicer(clock)
    for step in (5, 6):
        clock[0] += 1.0
        reqs = _requests(step)
        direct = [asyncio.run(one.Sync(q, None)) for q in reqs]
        got = asyncio.run(batch.SyncBatch(peer_pb2.SyncBatchRequest(members=reqs, leader=0), None))
        assert len(got.replies) == NODES
        for r, (a, b) in enumerate(zip(direct, got.replies, strict=True)):
            # (each coordinator numbers its part digests in an epoch of its own)
            assert (a.parts_epoch == one.coordinator.roster.parts.epoch) == a.known
            assert (b.parts_epoch == batch.coordinator.roster.parts.epoch) == b.known
            a.parts_epoch = b.parts_epoch = ""
            # (so are their gone tags: the epoch is in them)
            assert a.gone_tag.startswith(one.coordinator.roster.parts.epoch + ":")
            a.gone_tag = b.gone_tag = ""
            assert b.SerializeToString() == a.SerializeToString(), r
        assert batch.batch_calls == step - 4 and batch.batched_members == NODES * (step - 4)
        assert batch.sync_calls == 0
    replies = got.replies
    assert not replies[4].known and not replies[7].known  # restarted; gone for good
    assert all(replies[r].known for r in range(NODES) if r not in (4, 7))
    assert list(replies[0].gone) == [7]
    assert [p.rank for p in replies[3].peers] == [0, 4, 8]
    assert replies[3].peers[1].address == "10.0.0.4:7000"
    c1, c2 = one.coordinator, batch.coordinator
    for r in range(NODES):
        assert c2.members[r].last_seen == c1.members[r].last_seen
        assert c2.members[r].inventory == c1.members[r].inventory


def test_a_changed_inventory_is_taken_though_the_last_one_is_reused():
    clock = [100.0]
    s = _servicer(clock)
    first = _requests(5)
    asyncio.run(s.SyncBatch(peer_pb2.SyncBatchRequest(members=first), None))
    held = s.coordinator.members[2].inventory
    asyncio.run(s.SyncBatch(peer_pb2.SyncBatchRequest(members=_requests(5)), None))
    assert s.coordinator.members[2].inventory is held  # same bytes: not converted again
    asyncio.run(s.SyncBatch(peer_pb2.SyncBatchRequest(members=_requests(5, "other")), None))
    assert [h.digest for h in s.coordinator.members[2].inventory] == ["d2-3", "other"]
    assert s.coordinator.roster.holders(5)[2] == "other"


def test_an_unchanged_heartbeat_still_sees_a_peer_go_silent():
    # the request bytes of node-rank 3 never change; its peer 4 (a stale incarnation,
    # never heard after its join at t=100) must turn not live after live_seconds (5 s)
    clock = [100.0]
    s = _servicer(clock)
    live = []
    for t in (101.0, 104.0, 106.0):
        clock[0] = t
        got = asyncio.run(s.SyncBatch(peer_pb2.SyncBatchRequest(members=_requests(5)), None))
        live.append([(p.rank, p.live) for p in got.replies[3].peers])
        c = s.coordinator
        rows = c.roster.peer_rows([8, 0, 4, 4, 99])
        assert rows == [(p.rank, p.address, p.incarnation, p.live) for p in c.peers([0, 4, 8])]
    assert live == [
        [(0, True), (4, True), (8, True)],
        [(0, True), (4, True), (8, True)],
        [(0, True), (4, False), (8, True)],
    ]


def test_a_join_between_two_equal_heartbeats_does_not_keep_the_joins_inventory():
    # the second heartbeat's bytes equal the first's: its cached Holdings are not the
    # tuple the join set, so the membership takes them again (regression guard of the
    # identity check in Membership.set_inventory)
    clock = [100.0]
    s = _servicer(clock)
    asyncio.run(s.SyncBatch(peer_pb2.SyncBatchRequest(members=_requests(5)), None))
    _join(s, 2, "i2", Holding(2, 9, True, "joined"))
    assert [h.digest for h in s.coordinator.members[2].inventory] == ["joined"]
    asyncio.run(s.SyncBatch(peer_pb2.SyncBatchRequest(members=_requests(5)), None))
    assert [h.digest for h in s.coordinator.members[2].inventory] == ["d2-3", "d2-5"]
    assert s.coordinator.roster.holders(5)[2] == "d2-5"


def test_the_gone_ranks_are_sent_again_only_when_they_changed():
    """Review of #17, B3: every Sync reply listed every gone rank (O(gone) per call; a
    heartbeat round at 10,000 nodes with a rack of 1,000 gone cost 0.33 s of
    coordinator CPU instead of 0.10 s). A node that names the gone set it has (its
    ``gone_tag``) gets ``gone_same`` and no list until the set changes."""
    clock = [100.0]
    s = _servicer(clock)
    book = AddressBook(Endpoint("10.0.0.3:7000", "10.0.0.3:7000", "i3"))
    first = asyncio.run(s.Sync(_requests(5)[3], None))
    assert list(first.gone) == [7] and first.gone_tag and not first.gone_same
    book.update(first.peers, first)
    assert (book.gone, book.gone_tag) == (frozenset({7}), first.gone_tag)
    ask = _requests(6)[3]
    ask.gone_tag = book.gone_tag
    again = asyncio.run(s.Sync(ask, None))
    assert again.gone_same and list(again.gone) == [] and again.gone_tag == first.gone_tag
    book.update(again.peers, again)
    assert book.gone == frozenset({7})  # kept: unchanged
    s.coordinator.declare_gone(JOB, [9, 10, 11], "test")
    ask.gone_tag = book.gone_tag
    changed = asyncio.run(s.Sync(ask, None))
    assert not changed.gone_same and list(changed.gone) == [7, 9, 10, 11]
    book.update(changed.peers, changed)
    assert book.gone == frozenset({7, 9, 10, 11}) and book.gone_tag == changed.gone_tag
    # a node of before the tag (none sent) always gets the list
    assert list(asyncio.run(s.Sync(_requests(7)[3], None)).gone) == [7, 9, 10, 11]


def test_a_kept_peers_reply_always_equals_the_peers_built_afresh():
    """A node's peers are answered from its last reply's bytes while they are exact
    (issue #17): at every heartbeat they must equal the rows built afresh, through a
    peer going silent and being heard again, a peer's daemon restarting,
    and the node asking for other peers."""
    clock = [100.0]
    s, fresh = _servicer(clock), _servicer(clock)  # fresh: builds every reply's peers
    reqs = _requests(5)
    quiet: set[int] = set()
    live: dict[tuple[int, int], dict[int, bool]] = {}
    for t in range(101, 130):
        clock[0] = float(t)
        if t == 104:
            quiet.add(1)  # node-rank 1 stops heartbeating: not live from t=109
        if t == 115:
            quiet.discard(1)  # heard again
        if t == 118:
            # node-rank 6's daemon restarts (a join: every kept reply is stale)
            for one in (s, fresh):
                _join(one, 6, "i6b")
            reqs[6].incarnation = "i6b"
        if t == 120:
            del reqs[0].want_peers[:]
            reqs[0].want_peers.extend([6, 9])
        members = [q for q in reqs if q.rank not in quiet]
        batch = peer_pb2.SyncBatchRequest(members=members)
        got = asyncio.run(s.SyncBatch(batch, None))
        fresh._peer_replies.clear()
        want = asyncio.run(fresh.SyncBatch(batch, None))
        for q, a, b in zip(members, got.replies, want.replies, strict=True):
            assert list(a.peers) == list(b.peers), (t, q.rank)
            live[(t, q.rank)] = {p.rank: p.live for p in a.peers}
    # the replies went through those states (the test can fail)
    assert live[(108, 0)][1] and not live[(109, 0)][1] and not live[(115, 0)][1]
    assert live[(116, 0)][1]
    assert [p.incarnation for p in got.replies[5].peers if p.rank == 6] == ["i6b"]
    assert live[(119, 0)].keys() == {1, 5}
    assert live[(120, 0)].keys() == {6, 9}


def test_the_synced_step_follows_every_report_though_it_is_kept_between_them():
    clock = [100.0]
    c = Coordinator(clock=lambda: clock[0], live_seconds=5.0)
    roster = c.roster
    for r in range(3):
        roster.add(r, f"a{r}", f"i{r}")
    assert roster.least_step(3) is None
    roster.report_step(0, 4)
    roster.report_step(1, 6)
    assert roster.least_step(3) is None and roster.least_step(2) == 4
    roster.report_step(2, 5)
    assert roster.least_step(3) == 4
    roster.report_step(0, 7)
    assert roster.least_step(3) == 5
    roster.forget_step(2)
    assert roster.least_step(3) is None and roster.least_step(2) == 6
    roster.clear_steps()
    assert roster.least_step(0) is None


def test_a_peer_that_joins_after_a_kept_reply_is_named_at_the_next_heartbeat():
    """Regression (found by tests/unit/test_replication_inprocess.py): a reply kept
    while an asked-for peer had not joined yet left that peer out for good, and the
    nodes waited for their joins forever."""
    clock = [100.0]
    s = CoordinatorServicer(Coordinator(clock=lambda: clock[0], live_seconds=5.0))

    def join(r: int) -> None:
        q = peer_pb2.JoinRequest(
            job=JOB, nodes=3, rank=r, address=f"10.0.0.{r}:7000", incarnation=f"i{r}"
        )
        asyncio.run(s.Join(q, None))

    def peers_of_0() -> list[int]:
        q = sync_request(JOB, 0, "i0", -1, (), want_peers=[1, 2])
        return [p.rank for p in asyncio.run(s.Sync(q, None)).peers]

    join(0)
    join(1)
    assert peers_of_0() == [1]
    assert peers_of_0() == [1]  # kept
    join(2)
    assert peers_of_0() == [1, 2]
