"""The coordinator service at scale, in-process over loopback gRPC (#17 item 1).

Hundreds of simulated nodes (one ``grpc.aio`` client, no daemons) against the
real servicer on the real :class:`tierfs.rpc.aio_server.AioServer`: waiting
calls hold no thread and are woken only by progress (counted, not timed);
replies carry the peers a node asks for, not the whole membership.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import grpc.aio
import pytest

from tierfs.cluster.coordinator import Coordinator, Holding
from tierfs.cluster.rounds import SHOWN_RANKS, RankSet
from tierfs.cluster.servicer import CoordinatorServicer
from tierfs.replication.relay import SyncRelay
from tierfs.rpc import peer_pb2, peer_pb2_grpc
from tierfs.rpc import wire as peer_wire
from tierfs.rpc.aio_server import AioServer

NODES = 300
JOB = "job"


@pytest.fixture
def service() -> Iterator[tuple[CoordinatorServicer, str]]:
    servicer = CoordinatorServicer(Coordinator(live_seconds=600.0))
    servicer.max_wait = 120.0  # long polls outlast the slowest machine: only progress ends them
    server = AioServer(
        servicer.attach,
        interceptors=[peer_wire.AioTokenInterceptor("t")],
        options=peer_wire.SERVER_OPTIONS,
    )
    port = server.start("127.0.0.1:0")
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        server.stop(0)


MD = peer_wire.metadata("t")


def until(cond: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def join_req(rank: int, restore_id: str = "", **kw) -> peer_pb2.JoinRequest:
    return peer_pb2.JoinRequest(
        job=JOB,
        nodes=NODES,
        rank=rank,
        address=f"10.0.{rank // 250}.{rank % 250}:7000",
        incarnation=f"inc{rank}",
        restore_id=restore_id,
        mode="protocol",
        inventory=[peer_wire.held_shard(Holding(rank, 5, True, f"d{rank}-5"))],
        **kw,
    )


async def _in_waiting(servicer: CoordinatorServicer, n: int) -> None:
    while servicer.waiting < n:
        await asyncio.sleep(0.01)


def test_waiting_calls_hold_no_thread_and_wake_only_on_progress(service):
    """299 nodes wait for the last join: no thread each, one evaluation each while
    idle, no wake-up until the decision, then exactly one each; the same for the
    barrier. (Before #17 every call woke every other one, and each held one of 32
    server threads.)"""
    servicer, address = service

    async def run() -> None:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = peer_pb2_grpc.CoordinatorStub(ch)
            for r in range(1, NODES):
                await stub.Join(join_req(r, f"r{r}"), metadata=MD)
            threads = threading.active_count()

            def decide(r: int):
                return stub.Decide(
                    peer_pb2.DecideRequest(job=JOB, rank=r, restore_id=f"r{r}", wait_ms=120_000),
                    metadata=MD,
                )

            calls = [asyncio.ensure_future(decide(r)) for r in range(1, NODES)]
            await _in_waiting(servicer, NODES - 1)
            # idle: every call was evaluated once and sleeps; nothing wakes them
            assert servicer.evaluations == NODES - 1
            assert servicer.wakeups == 0
            assert threading.active_count() - threads <= 2  # no thread per waiting call
            # an idle second of 299 waiting calls costs the process (the server and
            # this client) next to no CPU: the busy-wait before #17 burnt a core, 4.0 s
            # of CPU in 4.0 s with only two waiting calls
            cpu = time.process_time()
            await asyncio.sleep(1.0)
            idle_cpu = time.process_time() - cpu
            assert idle_cpu < 0.25, f"{idle_cpu:.3f} s of CPU in an idle second"
            assert servicer.wakeups == 0 and servicer.evaluations == NODES - 1
            assert not any(c.done() for c in calls)
            await stub.Join(join_req(0, "r0"), metadata=MD)  # the last join decides
            replies = await asyncio.gather(*calls)
            assert {r.state for r in replies} == {peer_pb2.DecideReply.DECIDED}
            assert {r.step for r in replies} == {5}
            assert servicer.wakeups == NODES - 1  # one each, on the decision

            version = replies[0].version
            woken = servicer.wakeups

            def ready(r: int):
                return stub.Barrier(
                    peer_pb2.BarrierRequest(
                        job=JOB,
                        rank=r,
                        restore_id=f"r{r}",
                        round=replies[0].round,
                        version=version,
                        phase="ready",
                        ok=True,
                        wait_ms=120_000,
                    ),
                    metadata=MD,
                )

            barriers = [asyncio.ensure_future(ready(r)) for r in range(1, NODES)]
            await _in_waiting(servicer, NODES - 1)
            assert servicer.wakeups == woken
            waiting = await ready(0)  # the last one passes and wakes the others
            assert waiting.state == peer_pb2.BarrierReply.PASSED
            states = {b.state for b in await asyncio.gather(*barriers)}
            assert states == {peer_pb2.BarrierReply.PASSED}
            assert servicer.wakeups == woken + NODES - 1

    asyncio.run(run())


def test_a_bucket_answer_from_its_thread_wakes_the_waiting_calls(service):
    """Progress made off the loop (the bucket reader's thread) wakes the waiters once."""
    servicer, address = service
    servicer.coordinator.restores.bucket = True
    release = threading.Event()

    def reader(job: str, nodes: int, depth: int):
        from tierfs.cluster.coordinator import BucketView

        release.wait(120)
        return BucketView(depth=depth, exhausted=True)

    servicer.set_bucket_reader(reader)

    async def run() -> None:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = peer_pb2_grpc.CoordinatorStub(ch)
            for r in range(NODES):
                await stub.Join(join_req(r, f"r{r}"), metadata=MD)
            calls = [
                asyncio.ensure_future(
                    stub.Decide(
                        peer_pb2.DecideRequest(
                            job=JOB, rank=r, restore_id=f"r{r}", wait_ms=120_000
                        ),
                        metadata=MD,
                    )
                )
                for r in range(NODES)
            ]
            await _in_waiting(servicer, NODES)
            assert servicer.wakeups == 0
            release.set()
            replies = await asyncio.gather(*calls)
            assert {r.step for r in replies} == {5}
            assert servicer.wakeups == NODES

    asyncio.run(run())


def test_replies_list_the_peers_asked_for_and_counts(service):
    """A compact Join/Sync lists only ``want_peers``; an older node (no ``compact``)
    still gets every member; Decide lists at most SHOWN_RANKS missing ranks."""
    _, address = service
    with grpc.insecure_channel(address) as ch:
        stub = peer_pb2_grpc.CoordinatorStub(ch)
        for r in range(NODES - 1):
            stub.Join(join_req(r), metadata=MD)
        reply = stub.Join(join_req(NODES - 1, want_peers=[0, 7, 9999], compact=True), metadata=MD)
        assert [p.rank for p in reply.peers] == [0, 7]
        assert reply.peers[1].address == "10.0.0.7:7000" and reply.peers[1].live
        assert (reply.live_nodes, reply.known_nodes) == (NODES, NODES)
        old = stub.Join(join_req(5), metadata=MD)
        assert [p.rank for p in old.peers] == list(range(NODES))
        sync = stub.Sync(
            peer_pb2.SyncRequest(
                job=JOB, rank=3, incarnation="inc3", step=4, want_peers=[2, 4], compact=True
            ),
            metadata=MD,
        )
        assert sync.known and [p.rank for p in sync.peers] == [2, 4]
        assert list(sync.steps) == [] and sync.reported == 1 and sync.known_nodes == NODES
        full = stub.Sync(
            peer_pb2.SyncRequest(job=JOB, rank=3, incarnation="inc3", step=4), metadata=MD
        )
        assert len(full.steps) == NODES and len(full.peers) == NODES
        stub.Join(join_req(8, "a"), metadata=MD)
        stub.Join(join_req(1, "b"), metadata=MD)
        d = stub.Decide(
            peer_pb2.DecideRequest(job=JOB, rank=1, restore_id="b", wait_ms=0), metadata=MD
        )
        assert d.state == peer_pb2.DecideReply.WAITING
        assert d.missing_count == NODES - 2
        assert list(d.missing) == [0, *range(2, 8), *range(9, SHOWN_RANKS + 2)]


def test_sync_replies_name_only_the_parts_saved_again_in_the_steps_a_view_shows(service):
    """Issue #14 (a re-save noticed on every node) within #17's limits: a node's Sync names
    the steps its whole-step view shows; the reply lists only the own parts changed
    since the version it knows them at, not the 300 ranks' digests."""
    _, address = service

    def sync(rank: int, digest: str, view=(), epoch: str = ""):
        return stub.Sync(
            peer_pb2.SyncRequest(
                job=JOB,
                rank=rank,
                incarnation=f"inc{rank}",
                step=5,
                inventory=[peer_wire.held_shard(Holding(rank, 5, True, digest))],
                view_steps=[peer_pb2.ViewStep(step=s, version=v) for s, v in view],
                parts_epoch=epoch,
                compact=True,
            ),
            metadata=MD,
        )

    def changes(reply) -> list[tuple[int, int, str]]:
        return [(c.step, c.rank, c.digest) for c in reply.part_changes]

    with grpc.insecure_channel(address) as ch:
        stub = peer_pb2_grpc.CoordinatorStub(ch)
        for r in range(NODES):
            stub.Join(join_req(r), metadata=MD)
        first = sync(3, "d3-5", [(5, 0)])
        assert changes(first) == [] and first.parts_epoch and first.parts_version == 0
        epoch = first.parts_epoch
        # rank 7 saves step 5 again; node 3 (no replica of rank 7) learns it, once
        sync(7, "d7-5-again")
        second = sync(3, "d3-5", [(5, first.parts_version)], epoch)
        assert changes(second) == [(5, 7, "d7-5-again")] and second.parts_version == 1
        assert changes(sync(3, "d3-5", [(5, second.parts_version)], epoch)) == []
        assert changes(sync(3, "d3-5", [(6, 0)], epoch)) == []  # only the steps asked
        # an older node asks nothing and is told nothing
        old = sync(4, "d4-5")
        assert changes(old) == [] and old.parts_epoch == "" and old.parts_version == 0
        # a node that knew a former coordinator is told to ask every rank of its steps
        # again itself: one LOST change per step, not the 300 ranks' digests (review B1)
        again = sync(3, "d3-5", [(5, 9)], "a-former-coordinator")
        assert changes(again) == [(5, -1, "")] and again.parts_epoch == epoch


def test_a_wrong_token_is_refused(service):
    _, address = service
    with grpc.insecure_channel(address) as ch:
        stub = peer_pb2_grpc.CoordinatorStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Join(join_req(0), metadata=peer_wire.metadata("wrong"))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


# ---------------------------------------------------------------------- pure parts


def test_rank_set_counts_and_lacking():
    s = RankSet(10)
    assert s.lacking(3) == (0, 1, 2) and s.lacking_count == 10
    assert s.add(0) and s.add(2) and not s.add(2)
    assert len(s) == 2 and 2 in s and 1 not in s and 11 not in s
    assert s.lacking(3) == (1, 3, 4) and list(s) == [0, 2]
    for r in range(10):
        s.add(r)
    assert s.lacking() == () and s.lacking_count == 0
    s.clear()
    assert len(s) == 0 and s.lacking(1) == (0,)
    with pytest.raises(IndexError):
        s.add(10)


def test_the_synced_step_and_backup_requests_are_counted_not_walked():
    """The incremental counts give what a walk over every rank gives."""
    rng = random.Random(17)
    nodes = 40
    c = Coordinator()
    for r in range(nodes):
        c.join(JOB, nodes, r, f"a{r}", f"i{r}", (), "", "protocol")
    steps: dict[int, int] = {}
    best = -1
    for _ in range(2000):
        r = rng.randrange(nodes)
        step = rng.choice([-1, *range(rng.randrange(1, 9))])
        flag = rng.random() < 0.1
        c.sync(JOB, r, f"i{r}", step, [Holding(r, 3, True, "d", backup_requested=flag)])
        if step >= 0:
            steps[r] = step
        if len(steps) == nodes:
            best = max(best, min(steps.values()))  # the synced step never goes back
        assert c.synced_step == best
        assert set(c.roster.requested) == (
            {3} if any(m.requested for m in c.members.values()) else set()
        )
    assert sorted(c.sync_steps.items()) == sorted(steps.items())
    assert sum(c.roster.step_counts.values()) == len(steps)


def test_declaring_a_node_gone_that_still_heartbeats_says_so(service):
    """``Gone`` names the newly declared ranks that were heard from within the live
    window (regression, new-user trial: a live node was declared gone without a word);
    a silent one, or one declared again, is not named."""
    servicer, address = service
    with grpc.insecure_channel(address) as ch:
        stub = peer_pb2_grpc.CoordinatorStub(ch)
        for r in range(NODES):
            stub.Join(join_req(r), metadata=MD)
        servicer.coordinator.members[7].last_seen -= 10_000  # silent for ages
        reply = stub.Gone(peer_pb2.GoneRequest(job=JOB, ranks=[5, 7], reason="t"), metadata=MD)
        assert list(reply.gone) == [5, 7] and list(reply.live) == [5]
        again = stub.Gone(peer_pb2.GoneRequest(job=JOB, ranks=[5], reason="t"), metadata=MD)
        assert list(again.gone) == [5, 7] and list(again.live) == []


def test_a_join_opening_a_round_nudges_the_summoned_nodes_over_grpc(service):
    """Stop 32: the survivors of a generic job are nudged (``SyncRelay.Nudge``, token
    checked) when a restarted node's join opens a round, so the summons reaches them
    at once instead of at their next heartbeat; the joiner itself is not nudged."""
    servicer, address = service
    got: list[str] = []
    node = SyncRelay("t", on_nudge=got.append)
    node_server = AioServer(
        node.attach,
        interceptors=[peer_wire.AioTokenInterceptor("t")],
        options=peer_wire.SERVER_OPTIONS,
    )
    node_address = f"127.0.0.1:{node_server.start('127.0.0.1:0')}"
    sender = SyncRelay("t")
    servicer.set_nudger(sender.nudge)
    try:
        with grpc.insecure_channel(address) as ch:
            stub = peer_pb2_grpc.CoordinatorStub(ch)

            def join(rank: int, rid: str) -> None:
                stub.Join(
                    peer_pb2.JoinRequest(
                        job="small", nodes=3, rank=rank, address=node_address,
                        incarnation=f"inc{rank}", restore_id=rid, mode="generic",
                    ),
                    metadata=MD,
                )  # fmt: skip

            for r in range(3):
                join(r, "")
            assert servicer.nudges == 0
            join(1, "restart")
            until(lambda: len(got) == 2, "two nudges to arrive", 60)
            assert got == ["small", "small"] and servicer.nudges == 2
            join(0, "summoned")
            assert servicer.nudges == 2  # once per round and node
    finally:
        node_server.stop(0)


def test_sync_replies_name_the_step_directories_the_other_nodes_are_saving(service):
    """#14 trial 54 F2: a node's Sync names the step directories it is saving; every
    other node's reply lists them (its own never), and a node that stopped saving
    drops out at its next Sync."""
    _, address = service

    def sync(rank: int, saving: list[str]):
        return stub.Sync(
            peer_pb2.SyncRequest(
                job=JOB, rank=rank, incarnation=f"inc{rank}", step=5, saving=saving, compact=True
            ),
            metadata=MD,
        )

    with grpc.insecure_channel(address) as ch:
        stub = peer_pb2_grpc.CoordinatorStub(ch)
        for r in range(NODES):
            stub.Join(join_req(r), metadata=MD)
        first = sync(0, ["checkpoint-20"])
        assert first.saving_known and list(first.saving) == []
        assert list(sync(1, []).saving) == ["checkpoint-20"]
        assert list(sync(0, ["checkpoint-20"]).saving) == []  # never its own
        sync(0, [])  # rank 0's save ended
        assert list(sync(1, []).saving) == []
