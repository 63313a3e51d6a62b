"""The peer plane of several nodes in one process: real PeerTiers, their servicers and
the coordinator, over the in-process transport of tests/support/fake_peers.py (no
mount, no process, no socket). Replication of a sealed step (bytes and crc32c
verified on the receiver), a manifest-only push to a peer holding identical bytes,
a copy corrupted in transit or at rest refused and another holder used, a transfer
reset midway, an unreachable peer skipped and caught up, re-replication to a peer
that comes back as a new daemon, and a restore round (Join, Decide, pull, Barrier)
through the coordinator."""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fake_peers
import grpc
import pytest
import trio
from fake_ports import FakeBudget, FakeJob
from gcs_fixtures import make_shard

from tierfs.cluster.coordinator import Coordinator
from tierfs.cluster.servicer import CoordinatorServicer
from tierfs.core.config import NodeConfig
from tierfs.core.control import JobSpec
from tierfs.node.catalog import ShardCatalog
from tierfs.replication import heartbeat
from tierfs.replication.peer import PeerTier
from tierfs.replication.plane import PlaneState
from tierfs.replication.service import later_save_held
from tierfs.replication.transfer import BadCopy
from tierfs.rpc import peer_pb2 as pb
from tierfs.store.manifest import FileEntry, Manifest
from tierfs.store.ramstore import RamStore
from tierfs.store.shards import Shard, ShardKey, ShardStore

JOB = "job"
TOKEN = "secret"
#: node-rank 0 replicates to both others
PEERS = {0: (1, 2), 1: (0,), 2: (0,)}


def address(rank: int) -> str:
    return f"10.0.0.{rank + 1}:7000"


def files(step: int, rank: int = 0) -> dict[str, bytes]:
    """A step's files on ``rank`` (every rank's bytes differ: no data-parallel dedup)."""
    return {
        "state/shard-0.bin": bytes(range(256)) * (40 + step) + bytes([rank]) * 7,
        "state/meta.json": f'{{"step": {step}, "rank": {rank}}}'.encode(),
    }


class Node:
    """One node's parts as build_node makes them, with the fake transport."""

    def __init__(self, net: fake_peers.PeerNetwork, root: Path, rank: int, nodes: int = 3):
        self.rank = rank
        self.ram_dir = root / f"n{rank}"
        self.store = RamStore(str(self.ram_dir))
        self.shards = ShardStore(self.store)
        self.catalog = ShardCatalog(self.shards, 2)
        self.job = FakeJob(JobSpec(JOB, "orbax", rank, nodes, peer_ranks=PEERS[rank]))
        config = NodeConfig(
            mountpoint=str(root / f"m{rank}"),
            ram_dir=str(self.ram_dir),
            listen=address(rank),
            coordinator=address(0),
            peer_token=TOKEN,
            keep_local=2,
            join_timeout=10,
        )
        self.plane = PlaneState(self.job, coordinator=config.coordinator, listen=config.listen)
        self.coordinator = CoordinatorServicer(Coordinator(), gate=self.plane.coordinator_gate)
        self.tier = PeerTier(
            config,
            store=self.store,
            shards=self.shards,
            catalog=self.catalog,
            job=self.job,
            reporter=self.job,
            budget=FakeBudget(),
            summons=self.job,
            plane=self.plane,
            client=net.client(address(rank), TOKEN),
            coordinator=self.coordinator,
            server=net.server,
        )
        self.cancel = trio.CancelScope()

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with self.cancel:
            await self.tier.run(task_status=task_status)

    def seal(self, step: int, content: dict[str, bytes] | None = None) -> Shard:
        """Seal ``step`` of this node's rank (trio thread), as the agent does."""
        content = files(step, self.rank) if content is None else content
        shard = make_shard(self.ram_dir, JOB, self.rank, step, content)
        self.catalog.add(shard)
        self.catalog.sealed(shard)
        return shard

    def states(self, step: int) -> dict[int, str]:
        return dict(self.tier._sends[ShardKey(JOB, self.rank, step)].states)


async def wait_for(
    cond: Callable[[], object],
    what: str,
    timeout: float = 60.0,
    debug: Callable[[], object] | None = None,
) -> None:
    with trio.move_on_after(timeout):
        while not cond():
            await trio.sleep(0.02)
        return
    raise AssertionError(f"timed out waiting for {what}: {debug() if debug else ''}")


def content_of(shard: Shard) -> dict[str, bytes]:
    """Every file of a committed shard: manifest path -> bytes."""
    out = {}
    for f in shard.manifest.files:
        if f.kind == "file":
            out[f.path] = Path(shard.data, f.path).read_bytes()
    return out


def leftovers(node: Node) -> list[str]:
    """What a failed transfer may have left in the node's incoming directory."""
    return os.listdir(node.store.incoming) if os.path.isdir(node.store.incoming) else []


@pytest.fixture
def net(monkeypatch):
    monkeypatch.setattr(heartbeat, "HEARTBEAT", 0.1)  # the peers' addresses arrive sooner
    n = fake_peers.PeerNetwork()
    yield n
    n.close()


def cluster(net: fake_peers.PeerNetwork, root: Path, test: Callable[..., object]) -> None:
    """Run three nodes' tiers, then ``await test(nodes)``."""

    async def main() -> None:
        nodes = [Node(net, root, r) for r in range(3)]
        async with trio.open_nursery() as nursery:
            for n in nodes:
                await nursery.start(n.run)
            await wait_for(lambda: all(len(n.tier.peers) >= 1 for n in nodes), "the joins")
            with trio.fail_after(120):
                await test(nodes)  # type: ignore[misc]
            nursery.cancel_scope.cancel()

    trio.run(main)


# ---------------------------------------------------------------------- replication


def test_a_sealed_step_reaches_its_peers_with_every_crc32c_verified(net, tmp_path):
    async def test(nodes: list[Node]) -> None:
        shard = nodes[0].seal(5)
        await wait_for(
            lambda: nodes[0].states(5) == {1: "replicated", 2: "replicated"}, "replication"
        )
        key = ShardKey(JOB, 0, 5)
        for r in (1, 2):
            copy = nodes[r].catalog[key]
            assert copy.verified and copy.manifest.digest == shard.manifest.digest
            assert nodes[r].shards.verify(copy) == []  # every file's crc32c and size
            assert content_of(copy) == files(5)
            assert copy.manifest.name == shard.manifest.name
            assert leftovers(nodes[r]) == []
        pushes = [c for c in net.calls("PushShard")]
        assert sorted(c[1] for c in pushes) == [address(1), address(2)]
        assert {c[3] for c in pushes} == {"ok"}
        assert nodes[1].tier.stats.snapshot()["pushes_received"] == 1
        step = next(s for s in nodes[0].tier.status().steps if s.step == 5)
        assert step.state == "replicated" and step.where == ("peer:1", "peer:2")
        # the receivers' inventories now name the copy (what the coordinator is told)
        held = {(h.rank, h.step, h.digest) for h in nodes[1].tier.holdings.holdings(JOB)}
        assert (0, 5, shard.manifest.digest) in held

    cluster(net, tmp_path, test)


def test_a_peer_holding_identical_bytes_gets_only_the_manifest(net, tmp_path):
    async def test(nodes: list[Node]) -> None:
        same = files(13, 0)
        own = nodes[1].seal(13, same)  # data parallelism: rank 1 saved the same bytes
        nodes[0].seal(13, same)
        await wait_for(lambda: nodes[0].states(13).get(1, "").startswith("replicated"), "a push")
        assert nodes[0].states(13)[1] == "replicated (manifest only)"
        assert nodes[1].tier.stats.snapshot()["manifest_only_received"] == 1
        replica = nodes[1].catalog[ShardKey(JOB, 0, 13)]
        assert content_of(replica) == same and nodes[1].shards.verify(replica) == []
        for f in ("state/shard-0.bin", "state/meta.json"):  # hard links of its own copy
            assert os.stat(Path(replica.data, f)).st_ino == os.stat(Path(own.data, f)).st_ino

    cluster(net, tmp_path, test)


def test_a_later_save_by_another_node_count_is_kept_against_an_older_push(net, tmp_path):
    """Regression (#16 fifth trial F8): a node renumbered back to the rank it had in a
    4-node save pushed its part of that save; node 0 replaced its replica of the later
    3-node save of the same step (same job, rank, step) and its view showed the old
    part. The receiver keeps the later save (ALREADY_EXISTS); the sender calls that
    peer's copy ``superseded`` and writes no error."""
    later = time.time()

    async def test(nodes: list[Node]) -> None:
        old = make_shard(nodes[0].ram_dir, JOB, 0, 5, files(5), nodes=4, created=later - 600)
        kept = make_shard(nodes[1].ram_dir, JOB, 0, 5, files(5, 9), nodes=3, created=later)
        assert kept.manifest.sealed > old.manifest.sealed  # sealed after: the later save
        nodes[1].catalog.add(kept)
        nodes[0].catalog.add(old)
        nodes[0].catalog.sealed(old)
        await wait_for(
            lambda: nodes[0].states(5) == {1: "superseded", 2: "replicated"},
            "the pushes",
            debug=lambda: nodes[0].states(5),
        )
        assert nodes[1].catalog[ShardKey(JOB, 0, 5)].manifest.digest == kept.manifest.digest
        assert content_of(nodes[1].catalog[ShardKey(JOB, 0, 5)]) == files(5, 9)
        assert nodes[2].catalog[ShardKey(JOB, 0, 5)].manifest.digest == old.manifest.digest
        assert not any("replication of step 5" in e for e in nodes[0].job.errors)

    cluster(net, tmp_path, test)


def test_a_later_save_of_the_same_count_is_kept_against_a_late_push_of_the_earlier(net, tmp_path):
    """Regression (#14 trial 65, EIO after 10 s): a step saved three times in a row;
    node 0's pull of rank 1's second save ended after its pull of the third and
    replaced it, so node 0 held an earlier save than rank 1's node. A part that lists
    the pushed part as replaced is kept (ALREADY_EXISTS, ``superseded``, no error)."""
    later = time.time()

    async def test(nodes: list[Node]) -> None:
        old = make_shard(nodes[0].ram_dir, JOB, 0, 5, files(5), nodes=3, created=later - 1)
        kept = make_shard(
            nodes[1].ram_dir,
            JOB,
            0,
            5,
            files(5, 9),
            nodes=3,
            created=later,
            replaces=[(0, old.manifest.digest)],
        )
        nodes[1].catalog.add(kept)
        nodes[0].catalog.add(old)
        nodes[0].catalog.sealed(old)
        await wait_for(
            lambda: nodes[0].states(5) == {1: "superseded", 2: "replicated"},
            "the pushes",
            debug=lambda: nodes[0].states(5),
        )
        assert nodes[1].catalog[ShardKey(JOB, 0, 5)].manifest.digest == kept.manifest.digest
        assert not any("replication of step 5" in e for e in nodes[0].job.errors)

    cluster(net, tmp_path, test)


def test_later_save_held_needs_another_node_count_and_a_later_seal():
    a = Manifest(JOB, 2, 20, "20", "generic", (), created=100.0, nodes=4)
    b = dataclasses.replace(a, files=(FileEntry("20", "dir"),), created=200.0, nodes=3)
    assert later_save_held(b, a) and not later_save_held(a, b)
    assert not later_save_held(dataclasses.replace(b, nodes=4), a)  # a re-save: newest wins
    assert not later_save_held(dataclasses.replace(b, nodes=0), a)  # unknown: as before
    assert not later_save_held(dataclasses.replace(a, created=300.0, nodes=3), a)  # same bytes


def test_later_save_held_when_it_lists_the_incoming_part_as_replaced():
    """Regression (#14 trial 65): three saves of a step in a row; the pull of rank 1's
    second save ended after the pull of its third and replaced it on node 0."""
    second = Manifest(JOB, 1, 20, "20", "generic", (), created=100.0, sealed=101.0, nodes=3)
    third = dataclasses.replace(
        second, files=(FileEntry("20", "dir"),), sealed=102.0, replaces=((1, second.digest),)
    )
    assert later_save_held(third, second) and not later_save_held(second, third)
    # identical bytes saved again: each lists the other, the later seal wins
    again = dataclasses.replace(second, sealed=103.0, replaces=((1, third.digest),))
    assert not later_save_held(third, again) and later_save_held(again, third)


def test_a_copy_corrupted_in_transit_is_refused_and_sent_again(net, tmp_path):
    net.corrupt("PushShard", callee=address(1), at=7)

    async def test(nodes: list[Node]) -> None:
        nodes[0].seal(6)
        await wait_for(lambda: nodes[0].states(6).get(1) == "replicated", "the second push")
        outcomes = [c[3] for c in net.calls("PushShard") if c[1] == address(1)]
        assert outcomes == ["DATA_LOSS", "ok"]
        assert nodes[1].tier.stats.snapshot()["corrupt_copies"] == 1
        copy = nodes[1].catalog[ShardKey(JOB, 0, 6)]
        assert content_of(copy) == files(6) and nodes[1].shards.verify(copy) == []
        assert leftovers(nodes[1]) == []  # the refused copy left nothing behind
        assert nodes[0].job.errors == []

    cluster(net, tmp_path, test)


def test_a_transfer_reset_midway_is_retried(net, tmp_path):
    net.reset("PushShard", callee=address(2), after_chunks=0)

    async def test(nodes: list[Node]) -> None:
        nodes[0].seal(7)
        await wait_for(lambda: nodes[0].states(7).get(2) == "replicated", "the retried push")
        outcomes = [c[3] for c in net.calls("PushShard") if c[1] == address(2)]
        assert outcomes == ["reset", "ok"]
        assert content_of(nodes[2].catalog[ShardKey(JOB, 0, 7)]) == files(7)
        assert leftovers(nodes[2]) == []

    cluster(net, tmp_path, test)


# ---------------------------------------------------------------------- pulls (restores)


@pytest.mark.parametrize("where", ["in transit", "at rest", "reset"])
def test_a_bad_copy_or_transfer_is_refused_and_another_holder_used(net, tmp_path, where):
    async def test(nodes: list[Node]) -> None:
        shard = nodes[0].seal(8)
        await wait_for(lambda: nodes[0].states(8) == {1: "replicated", 2: "replicated"}, "copies")
        key, digest = shard.key, shard.manifest.digest
        if where == "in transit":
            net.corrupt("PullShard", callee=address(1), chunk=0, at=3)
        elif where == "reset":  # the connection breaks after the first file's chunk
            net.reset("PullShard", callee=address(1), after_chunks=1)
        else:  # bit rot in node 1's copy: the chunk's crc32c is of the rotten bytes
            victim = Path(nodes[1].catalog[key].data, "state/shard-0.bin")
            data = bytearray(victim.read_bytes())
            data[100] ^= 0x10
            victim.write_bytes(bytes(data))
        # node 0 lost its RAM: a new daemon pulls its own step back, holder by holder
        fresh = Node(net, tmp_path / "fresh", 0)
        cancel = threading.Event()
        if where == "reset":
            with pytest.raises(grpc.RpcError) as err:
                await fresh.tier.pull(address(1), key, digest, cancel)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        else:
            with pytest.raises(BadCopy):
                await fresh.tier.pull(address(1), key, digest, cancel)
        assert leftovers(fresh) == [] and not os.path.exists(fresh.shards.path_of(key))
        got = await fresh.tier.pull(address(2), key, digest, cancel)
        assert got.key == key and got.verified and got.manifest.digest == digest
        assert content_of(got) == files(8) and fresh.shards.verify(got) == []
        pulls = [(c[1], c[3]) for c in net.calls("PullShard")]
        # at rest: the transfer itself is fine; the file crc32c at the end refuses it
        first = {"in transit": "corrupt", "reset": "reset", "at rest": "ok"}[where]
        assert pulls == [(address(1), first), (address(2), "ok")]
        assert fresh.tier.stats.snapshot().get("pulls") == 1

    cluster(net, tmp_path, test)


def test_a_pull_of_a_digest_the_holder_does_not_have_is_refused(net, tmp_path):
    async def test(nodes: list[Node]) -> None:
        shard = nodes[0].seal(9)
        await wait_for(lambda: nodes[0].states(9).get(1) == "replicated", "a copy")
        fresh = Node(net, tmp_path / "fresh", 0)
        with pytest.raises(grpc.RpcError) as err:
            await fresh.tier.pull(address(1), shard.key, "not-the-digest", threading.Event())
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert leftovers(fresh) == []

    cluster(net, tmp_path, test)


# ---------------------------------------------------------------------- unreachable peers


def test_a_peer_that_is_down_is_skipped_then_caught_up_after_it_comes_back(
    net, tmp_path, monkeypatch
):
    monkeypatch.setenv("TIERFS_PEER_PUSH_PATIENCE", "0.5")  # give up on node 2 soon

    async def test(nodes: list[Node]) -> None:
        down = net.down(address(2))
        nodes[0].seal(10)
        await wait_for(lambda: nodes[0].states(10).get(2) == "failed", "giving up on node 2")
        # node 1 got its copy meanwhile; node 2 has nothing, the failure is reported
        assert nodes[0].states(10)[1] == "replicated"
        assert ShardKey(JOB, 0, 10) in nodes[1].catalog
        assert ShardKey(JOB, 0, 10) not in nodes[2].catalog
        assert any(
            "replication of step 10 to node-rank 2" in e and "UNAVAILABLE" in e
            for e in nodes[0].job.errors
        )
        step = next(s for s in nodes[0].tier.status().steps if s.step == 10)
        assert step.state == "replication failed" and step.where == ("peer:1",)
        # node 2 answers again: the catch-up round sends what it lacks
        net.heal(down)
        nodes[0].tier.replicator.catch_up()
        await wait_for(lambda: nodes[0].states(10).get(2) == "replicated", "the catch-up")
        assert content_of(nodes[2].catalog[ShardKey(JOB, 0, 10)]) == files(10)

    cluster(net, tmp_path, test)


def test_a_peer_restarted_as_a_new_daemon_gets_the_newest_step_again(net, tmp_path):
    async def test(nodes: list[Node]) -> None:
        nodes[0].seal(11)
        await wait_for(lambda: nodes[0].states(11).get(2) == "replicated", "replication")
        old = nodes[2].tier.incarnation
        # node 2 dies (its server goes away) and comes back with empty RAM
        nodes[2].cancel.cancel()
        await wait_for(lambda: address(2) not in net._servers, "node 2 to stop")
        reborn = Node(net, tmp_path / "reborn", 2)
        assert reborn.tier.incarnation != old
        async with trio.open_nursery() as nursery:
            await nursery.start(reborn.run)
            await wait_for(
                lambda: (
                    ShardKey(JOB, 0, 11) in reborn.catalog and len(net.calls("PushShard")) == 3
                ),  # (the reply is logged after the commit)
                "step 11 on the new daemon",
            )
            nursery.cancel_scope.cancel()
        assert content_of(reborn.catalog[ShardKey(JOB, 0, 11)]) == files(11)
        assert nodes[0].tier.peers[2].incarnation == reborn.tier.incarnation
        pushes = [c[3] for c in net.calls("PushShard") if c[1] == address(2)]
        assert pushes == ["ok", "ok"]

    cluster(net, tmp_path, test)


def test_a_wrong_token_is_refused_by_the_servers(net, tmp_path):
    async def test(nodes: list[Node]) -> None:
        intruder = net.client("10.9.9.9:1", "wrong")
        with pytest.raises(grpc.RpcError) as err:
            await trio.to_thread.run_sync(intruder.inventory, address(1), JOB)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = await trio.to_thread.run_sync(nodes[1].tier.client.inventory, address(2), JOB)
        assert reply.node_rank == 2 and reply.incarnation == nodes[2].tier.incarnation

    cluster(net, tmp_path, test)


# ---------------------------------------------------------------------- a restore round


def test_a_restore_round_through_the_coordinator_fetches_the_lost_shard_from_its_holder(
    net, tmp_path
):
    """Join, Decide (a long poll woken by the last join), pull from the decided holder,
    both barrier phases: every call through the in-process coordinator."""

    async def test(nodes: list[Node]) -> None:
        sealed = {n.rank: n.seal(12) for n in nodes}
        await wait_for(
            lambda: (
                nodes[0].states(12) == {1: "replicated", 2: "replicated"}
                and nodes[1].states(12) == {0: "replicated"}
                and nodes[2].states(12) == {0: "replicated"}
            ),
            "every step 12 on its peers",
            debug=lambda: ([n.states(12) for n in nodes], net.log[-5:], nodes[1].job.errors),
        )
        # node 1 loses its RAM: a new daemon with an empty store comes back
        nodes[1].cancel.cancel()
        await wait_for(lambda: address(1) not in net._servers, "node 1 to stop")
        reborn = Node(net, tmp_path / "reborn", 1)
        everyone = [nodes[0], reborn, nodes[2]]
        coordinator = nodes[0].coordinator

        async def join(n: Node) -> int:
            job = n.job.job
            assert job is not None
            coord = await n.tier.find_coordinator(job)
            assert coord == address(0)
            reply = await n.tier.call(
                functools.partial(
                    n.tier.client.join,
                    coord,
                    restore_id=f"restore-{n.rank}",
                    mode="generic",
                    **n.tier.join_fields(job),
                )
            )
            n.tier.update_peers(reply.peers, reply)
            return int(reply.round)

        async def decide(n: Node, out: dict[int, object]) -> None:
            out[n.rank] = await n.tier.call(
                n.tier.client.decide, address(0), JOB, n.rank, f"restore-{n.rank}", 30.0
            )

        async def barrier(n: Node, d: Any, phase: str, out: dict[int, Any]) -> None:
            out[n.rank] = await n.tier.call(
                functools.partial(
                    n.tier.client.barrier,
                    address(0),
                    (),
                    30.0,
                    job=JOB,
                    rank=n.rank,
                    restore_id=f"restore-{n.rank}",
                    round=d.round,
                    version=d.version,
                    phase=phase,
                    ok=True,
                )
            )

        async with trio.open_nursery() as nursery:
            await nursery.start(reborn.run)
            rounds = {n.rank: await join(n) for n in everyone[:2]}
            decisions: dict[int, object] = {}
            nursery.start_soon(decide, nodes[0], decisions)
            await wait_for(lambda: coordinator.waiting == 1, "node 0's Decide to wait")
            rounds[2] = await join(nodes[2])
            await wait_for(lambda: 0 in decisions, "the decision")
            assert coordinator.wakeups >= 1  # woken by the join, not by its deadline
            for n in everyone[1:]:
                await decide(n, decisions)
            assert len(set(rounds.values())) == 1
            d1: Any = decisions[1]
            assert d1.step == 12 and not d1.local
            assert [s.holder for s in d1.sources] == [0]
            assert d1.sources[0].address == address(0)
            assert d1.digest == sealed[1].manifest.digest
            for r in (0, 2):
                assert decisions[r].step == 12 and decisions[r].local  # type: ignore[attr-defined]
            got = await reborn.tier.pull(
                d1.sources[0].address, ShardKey(JOB, 1, 12), d1.digest, threading.Event()
            )
            assert content_of(got) == files(12, 1) and reborn.shards.verify(got) == []
            for phase in ("ready", "done"):
                replies: dict[int, Any] = {}
                async with trio.open_nursery() as phases:
                    for n in everyone:
                        phases.start_soon(barrier, n, decisions[n.rank], phase, replies)
                states = {r: rep.state for r, rep in replies.items()}
                assert states == {r: pb.BarrierReply.PASSED for r in (0, 1, 2)}, phase
            nursery.cancel_scope.cancel()
        pulls = [(c[0], c[1], c[3]) for c in net.calls("PullShard")]
        assert pulls == [(address(1), address(0), "ok")]
        assert {c[2] for c in net.log} >= {"Join", "Decide", "Barrier", "Sync", "PullShard"}

    cluster(net, tmp_path, test)


def test_a_lost_ranks_part_held_here_is_copied_again_to_this_nodes_peers(net, tmp_path):
    # issue #16: the job runs on 3 nodes now; node 1 holds the replica of rank 3's part
    # of step 5, written by 4 nodes: its node is gone, so node 1 copies it again to its
    # own receiver (node 0), and only the newest such step of that rank
    async def test(nodes: list[Node]) -> None:
        for step in (4, 5):
            orphan = make_shard(nodes[1].ram_dir, JOB, 3, step, files(step, 3))
            orphan.verified = True  # a received replica was checked on receipt
            nodes[1].catalog.add(orphan)
        nodes[1].tier.replicator.catch_up()
        key = ShardKey(JOB, 3, 5)
        await wait_for(lambda: key in nodes[0].catalog, "rank 3's part on node 0")
        assert content_of(nodes[0].catalog[key]) == files(5, 3)
        assert ShardKey(JOB, 3, 4) not in nodes[0].catalog
        assert ShardKey(JOB, 3, 5) not in nodes[2].catalog  # not a receiver of node 1

    cluster(net, tmp_path, test)
