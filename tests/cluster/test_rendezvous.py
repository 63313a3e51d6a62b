"""Finding the coordinator through the bucket (no ``--coordinator``): the lookup
logic with fakes, the bucket records against fake-gcs-server, the coordinator
gate of a live daemon, and (slow) four daemons that restore a lost node and
find node-rank 0 again after it restarted on a new port."""

from __future__ import annotations

import json
from types import SimpleNamespace

import fake_ports
import grpc
import pytest
import trio
from conftest import tierfs
from fake_ports import FakeJob
from gcs_cluster import wait_for
from peer_cluster import Cluster, free_port

from tierfs.backup.bucket import GcsBackend, GcsSettings
from tierfs.backup.layout import parse_bucket
from tierfs.backup.tier import BucketRendezvous, GcsTier
from tierfs.core.config import NodeConfig
from tierfs.core.control import JobSpec
from tierfs.replication import peer as peer_mod
from tierfs.replication import rendezvous as rendezvous_mod
from tierfs.replication.client import PeerClient
from tierfs.replication.plane import PlaneState
from tierfs.rpc import peer_pb2 as pb2
from tierfs.rpc import peer_pb2_grpc as pb2_grpc
from tierfs.rpc.wire import WireStats

# ---------------------------------------------------------------------- lookup logic


class FakeAgent(FakeJob):
    """The node as the peer tier sees it: job, reporter, summons (fake_ports.FakeJob)."""

    def __init__(self, rank: int, nodes: int = 3) -> None:
        super().__init__(JobSpec("j", "orbax", rank, nodes))
        self.config = NodeConfig(
            mountpoint="/m",
            ram_dir="/r",
            listen=f"127.0.0.1:{7000 + rank}",
            peer_token="t",
            join_timeout=10,
            keep_local=2,
        )


class FakeRendezvous:
    def __init__(self) -> None:
        self.records: dict[tuple[str, int], tuple[str, str]] = {}
        self.lookups = 0
        self.down = False
        self.hang = False

    def where(self, job: str, rank: int) -> str:
        return f"gs://b/{job}/.tierfs/nodes/{rank}"

    async def publish(self, job: str, rank: int, address: str, incarnation: str) -> None:
        if self.hang:
            await trio.sleep_forever()
        if self.down:
            raise RuntimeError("bucket unreachable (ConnectionError: refused)")
        self.records[(job, rank)] = (address, incarnation)

    async def lookup(self, job: str, rank: int) -> tuple[str, str] | None:
        if self.down:
            raise RuntimeError("bucket unreachable (ConnectionError: refused)")
        self.lookups += 1
        return self.records.get((job, rank))


class Refused(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection refused"


def make_tier(
    rank: int,
    rdv: FakeRendezvous,
    daemons: dict[str, tuple[str, int]],
    coordinator: str | None = None,
) -> tuple[peer_mod.PeerTier, FakeAgent]:
    """A PeerTier of node ``rank`` whose probes see ``daemons`` (address -> incarnation, rank),
    wired as the daemon wires it with the bucket rendezvous (or a static ``coordinator``)."""
    agent = FakeAgent(rank)

    def inventory(address, job, timeout=10.0, **kw):
        if address not in daemons:
            raise Refused()
        inc, r = daemons[address]
        return SimpleNamespace(incarnation=inc, node_rank=r, shards=[])

    client = PeerClient("t", WireStats())
    client.inventory = inventory  # type: ignore[method-assign]
    if coordinator is not None:
        agent.config.coordinator = coordinator
    plane = PlaneState(
        agent,
        coordinator=agent.config.coordinator,
        listen=agent.config.listen,
        bucket_rendezvous=True,
    )
    tier = peer_mod.PeerTier(
        agent.config,
        store=None,  # type: ignore[arg-type]
        shards=None,  # type: ignore[arg-type]
        catalog=fake_ports.catalog(),
        job=agent,
        reporter=agent,
        budget=fake_ports.FakeBudget(),
        summons=agent,
        plane=plane,
        client=client,
        rendezvous=rdv if coordinator is None else None,
    )

    return tier, agent


def test_rank_zero_publishes_itself_and_is_the_coordinator(monkeypatch):
    monkeypatch.setattr(rendezvous_mod, "LOOKUP_INTERVAL", 0.0)
    rdv = FakeRendezvous()

    async def main() -> None:
        tier, agent = make_tier(0, rdv, {})
        assert await tier.find_coordinator(agent.job) == "127.0.0.1:7000"
        assert await tier.finder.publish_once(agent.job)  # what its publisher task does
        assert rdv.records[("j", 0)] == ("127.0.0.1:7000", tier.incarnation)
        assert rdv.lookups == 0  # rank 0 never reads its own record
        assert tier.coordinator_gate() is None  # and serves the coordinator calls
        agent.job = JobSpec("j", "orbax", 2, 3)
        assert tier.coordinator_gate() == "this node is node-rank 2 of job j"

    trio.run(main)


def test_rank_zero_that_cannot_publish_reports_it_once(monkeypatch):
    monkeypatch.setattr(rendezvous_mod, "LOOKUP_INTERVAL", 0.0)
    rdv = FakeRendezvous()
    rdv.down = True

    async def main() -> None:
        tier, agent = make_tier(0, rdv, {})
        for _ in range(3):  # it still coordinates itself; the others cannot find it yet
            assert not await tier.finder.publish_once(agent.job)
            assert await tier.find_coordinator(agent.job) == "127.0.0.1:7000"
        assert len(agent.errors) == 1
        assert "cannot publish this node's address to gs://b/j/.tierfs/nodes/0" in agent.errors[0]
        rdv.down = False
        assert await tier.finder.publish_once(agent.job)
        assert ("j", 0) in rdv.records and tier.publish_note is None

    trio.run(main)


def test_stale_records_are_never_used(monkeypatch):
    monkeypatch.setattr(rendezvous_mod, "LOOKUP_INTERVAL", 0.0)
    rdv = FakeRendezvous()
    daemons: dict[str, tuple[str, int]] = {}

    async def main() -> None:
        tier, agent = make_tier(1, rdv, daemons)
        job = agent.job
        assert await tier.find_coordinator(job) is None
        assert tier.rendezvous_note == "waiting for node-rank 0 to publish gs://b/j/.tierfs/nodes/0"
        assert await tier.finder.publish_once(job)  # every node publishes its own record
        assert rdv.records[("j", 1)] == ("127.0.0.1:7001", tier.incarnation)
        # a record of a daemon that is gone (killed, its port closed)
        rdv.records[("j", 0)] = ("127.0.0.1:6000", "dead")
        assert await tier.find_coordinator(job) is None
        assert "is stale (127.0.0.1:6000: UNAVAILABLE: connection refused)" in tier.rendezvous_note
        # its port taken by a new daemon that has not published yet
        daemons["127.0.0.1:6000"] = ("restarted", -1)
        assert await tier.find_coordinator(job) is None
        assert "another daemon answers there" in tier.rendezvous_note
        # the same daemon, but in this job it is another rank now
        rdv.records[("j", 0)] = ("127.0.0.1:6000", "restarted")
        daemons["127.0.0.1:6000"] = ("restarted", 2)
        assert await tier.find_coordinator(job) is None
        assert "not node-rank 0 of job j (it is node-rank 2)" in tier.rendezvous_note
        # node-rank 0 published and answers with the record's incarnation
        daemons["127.0.0.1:7000"] = ("zero", 0)
        rdv.records[("j", 0)] = ("127.0.0.1:7000", "zero")
        assert await tier.find_coordinator(job) == "127.0.0.1:7000"
        assert tier.coordinator_address == "127.0.0.1:7000" and tier.rendezvous_note is None
        looked = rdv.lookups
        assert await tier.find_coordinator(job) == "127.0.0.1:7000"
        assert rdv.lookups == looked  # found: no bucket read per call
        # rank 0 restarts elsewhere: a failed call makes the node look again
        del daemons["127.0.0.1:7000"]
        daemons["127.0.0.1:7100"] = ("zero-again", 0)
        rdv.records[("j", 0)] = ("127.0.0.1:7100", "zero-again")
        tier.coordinator_lost()
        assert await tier.find_coordinator(job) == "127.0.0.1:7100"
        # an unreadable bucket leaves the reason, not an exception
        rdv.down = True
        tier.coordinator_lost()
        assert await tier.find_coordinator(job) is None
        assert "cannot read gs://b/j/.tierfs/nodes/0: bucket unreachable" in tier.rendezvous_note
        assert agent.errors == []

    trio.run(main)


def test_a_hanging_bucket_write_never_delays_finding_the_coordinator(monkeypatch):
    monkeypatch.setattr(rendezvous_mod, "LOOKUP_INTERVAL", 0.0)
    rdv = FakeRendezvous()
    rdv.records[("j", 0)] = ("127.0.0.1:7000", "zero")
    rdv.hang = True

    async def main() -> None:
        tier, agent = make_tier(1, rdv, {"127.0.0.1:7000": ("zero", 0)})
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tier.finder.publisher)  # stuck in its first write
            with trio.fail_after(5):
                assert await tier.find_coordinator(agent.job) == "127.0.0.1:7000"
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_lookups_are_rate_limited(monkeypatch):
    monkeypatch.setattr(rendezvous_mod, "LOOKUP_INTERVAL", 60.0)
    rdv = FakeRendezvous()

    async def main() -> None:
        tier, agent = make_tier(1, rdv, {})
        for _ in range(5):
            assert await tier.find_coordinator(agent.job) is None
        assert rdv.lookups == 1

    trio.run(main)


def test_static_coordinator_wins(monkeypatch):
    async def main() -> None:
        tier, agent = make_tier(1, FakeRendezvous(), {}, coordinator="10.0.0.1:1")
        assert await tier.find_coordinator(agent.job) == "10.0.0.1:1"
        assert tier.coordinator_gate() == "the coordinator is at 10.0.0.1:1"

    trio.run(main)


# ---------------------------------------------------------------------- bucket records


def test_bucket_records(fake_gcs):
    spec = parse_bucket(f"{fake_gcs.bucket}/pre")
    node = FakeJob()
    tier = GcsTier(
        spec,
        catalog=fake_ports.catalog(),
        job=node,
        reporter=node,
        shards=None,  # type: ignore[arg-type]
        budget=fake_ports.FakeBudget(),
    )
    rdv = BucketRendezvous(tier, deadline=5)
    assert rdv.where("job", 0) == f"gs://{fake_gcs.bucket}/pre/job/.tierfs/nodes/0"

    async def main() -> None:
        assert await rdv.lookup("job", 0) is None
        await rdv.publish("job", 0, "10.0.0.1:7000", "inc-a")
        await rdv.publish("job", 3, "10.0.0.4:7000", "inc-d")
        assert await rdv.lookup("job", 0) == ("10.0.0.1:7000", "inc-a")
        assert await rdv.lookup("job", 3) == ("10.0.0.4:7000", "inc-d")
        await rdv.publish("job", 0, "10.0.0.1:7001", "inc-b")  # a restart overwrites
        assert await rdv.lookup("job", 0) == ("10.0.0.1:7001", "inc-b")

    trio.run(main)
    # the records are the backend's (tierfs backups never lists them as rounds)
    g = GcsBackend(spec, settings=GcsSettings.from_env())
    assert g.read_address("job", 0).incarnation == "inc-b"
    assert g.list_round_names("job") == []


# ---------------------------------------------------------------------- a live daemon


def test_a_node_that_is_not_rank_zero_refuses_coordinator_calls(make_mount, fake_gcs):
    port = free_port()
    m = make_mount(
        "--listen",
        f"127.0.0.1:{port}",
        "--bucket",
        fake_gcs.bucket,
        "--peer-token",
        "t",
        "--job",
        "j",
        "--nodes",
        "2",
        "--node-rank",
        "1",
        "--peers-per-node",
        "1",
        "--join-timeout",
        "30",
    )
    md = (("x-tierfs-token", "t"),)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        inc = (
            pb2_grpc.PeerStub(ch)
            .Inventory(pb2.InventoryRequest(job="j"), metadata=md, timeout=5)
            .incarnation
        )
        with pytest.raises(grpc.RpcError) as err:
            pb2_grpc.CoordinatorStub(ch).Join(
                pb2.JoinRequest(job="j", nodes=2, rank=0), metadata=md, timeout=5
            )
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert err.value.details() == "not the coordinator: this node is node-rank 1 of job j"
    # its own record is in the bucket; node-rank 0 has published nothing
    g = GcsBackend(fake_gcs.bucket, settings=GcsSettings.from_env())
    rec = wait_for(lambda: g.read_address("j", 1), 60, "node 1's rendezvous record")
    assert (rec.address, rec.incarnation, rec.rank) == (f"127.0.0.1:{port}", inc, 1)
    data = json.loads(tierfs("status", str(m.path), "--json").stdout)
    peer = data["tiers"]["peer"]
    assert peer["rendezvous"] == "bucket" and not peer["is_coordinator"]
    assert "waiting for node-rank 0 to publish" in peer["rendezvous_note"]
    out = " ".join(tierfs("status", str(m.path)).stdout.split())
    assert "coordinator not found yet (waiting for node-rank 0 to publish" in out
    assert f"gcs gs://{fake_gcs.bucket}/; no round yet (one every 30 min)" in out
    # generic mode with node 0 absent: the restore waits visibly, looking for it
    state = wait_for(
        lambda: json.loads(tierfs("status", str(m.path), "--json").stdout)["restore"],
        10,
        "the restore's phase",
    )
    assert state["state"] == "planning"


# ---------------------------------------------------------------------- four daemons


@pytest.mark.long
@pytest.mark.slow
def test_four_nodes_without_coordinator_flag_restore_from_peers_and_follow_rank_zero(
    make_mount, fake_gcs
):
    c = Cluster(make_mount, 4, extra=("--bucket", fake_gcs.bucket), coordinator=False)
    first = c.clients(steps="1,2,3", size=200_000)
    assert [r["restored"] for r in first] == [None] * 4
    c.wait_synced(3)
    for i in range(4):
        peer = c.peer(i)
        assert peer["coordinator"] == f"127.0.0.1:{c.ports[0]}", peer
        assert peer["is_coordinator"] == (i == 0) and peer["rendezvous"] == "bucket"
    # node 3 loses its RAM: restored from its peer, every node agrees on step 3
    c.lose(3)
    c.remount(3)
    again = c.clients(size=200_000)
    assert [r["restored"] for r in again] == [3, 3, 3, 3], c.logs()
    assert again[3]["restored_digest"] == first[3]["saved"]["3"]
    assert c.status(3)["restore"]["source"] == "peer:2"

    # node 0, the coordinator, loses its RAM and comes back on another port
    old = f"127.0.0.1:{c.ports[0]}"
    c.lose(0)
    for i in (1, 2, 3):  # the old record is not used: its daemon is gone
        wait_for(
            lambda i=i: "is stale" in (c.peer(i)["rendezvous_note"] or ""),
            30,
            f"node {i} to find the rendezvous record stale",
        )
    c.move(0)
    c.remount(0)
    again = c.clients(size=200_000)
    assert [r["restored"] for r in again] == [3, 3, 3, 3], c.logs()
    assert again[0]["restored_digest"] == first[0]["saved"]["3"]
    assert c.status(0)["restore"]["source"] == "peer:1"
    new = f"127.0.0.1:{c.ports[0]}"
    assert new != old
    for i in range(4):
        assert c.peer(i)["coordinator"] == new
    assert c.peer(0)["coordinator_state"]["round"]["joined"] == [0, 1, 2, 3]
