"""The composition root (issue #12): which objects a node builds for each configuration,
what each was handed, and that the ports carry events between them (no mount, no
process, no bucket; ``build_node`` does no I/O beyond creating the ram-dir)."""

from __future__ import annotations

import ast
import pathlib
import threading
import time
from types import SimpleNamespace

import fake_ports
import pytest
import trio

import tierfs
from tierfs.backup.tier import BucketRendezvous, GcsTier
from tierfs.backup.uploads import Upload
from tierfs.core.config import ConfigError, NodeConfig
from tierfs.core.control import JobSpec
from tierfs.daemon import NodeParts, build_node
from tierfs.node.agreement import CoordinatorAgreement
from tierfs.node.sources import BucketRestoreSide, LocalSource, PeerSources
from tierfs.replication.peer import PeerTier
from tierfs.replication.plane import PlaneState
from tierfs.replication.replicator import Send
from tierfs.store.ramstore import Budget, RamStore
from tierfs.store.shards import ShardKey


def build(tmp_path: pathlib.Path, **options: object) -> NodeParts:
    config = NodeConfig(mountpoint=str(tmp_path / "m"), ram_dir=str(tmp_path / "r"), **options)
    store = RamStore(config.ram_dir)
    return build_node(config, store, Budget(store.root, 1 << 30, 0))


def assert_shared(parts: NodeParts) -> None:
    """The agent and every tier got the same catalog, job state and reporter."""
    agent = parts.agent
    assert agent.catalog is parts.catalog and agent.state is parts.state
    assert agent.reporter is parts.reporter and agent.view is parts.view
    assert agent.shards is parts.shards and parts.catalog.shards is parts.shards
    assert agent.restorer is parts.restorer and agent.tiers == parts.tiers
    restorer = parts.restorer
    assert restorer.catalog is parts.catalog and restorer.reporter is parts.reporter
    assert restorer.progress is parts.state and restorer.verifier is parts.verifier
    assert parts.verifier.catalog is parts.catalog and parts.verifier.shards is parts.shards
    assert parts.verifier.limiter is agent._io_limiter  # verification and recounts share it
    assert isinstance(restorer.local, LocalSource) and restorer.local.catalog is parts.catalog
    assert restorer.agreement is parts.agreement
    if parts.gcs.enabled:
        assert isinstance(restorer.bucket, BucketRestoreSide) and restorer.bucket.tier is parts.gcs
    else:
        assert restorer.bucket is None
    gcs = parts.gcs
    assert gcs.catalog is parts.catalog and gcs.current is parts.state
    assert gcs.reporter is parts.reporter and gcs.shards is parts.shards
    assert gcs.plane is parts.plane and gcs.coordinator is parts.coordinator
    peer = parts.peer
    if peer is not None:
        assert peer.catalog is parts.catalog and peer.current is parts.state
        assert peer.reporter is parts.reporter and peer.summons is parts.state
        assert peer.plane is parts.plane and peer.shards is parts.shards
        assert peer.coordinator is parts.coordinator
        assert peer.rendezvous is parts.rendezvous


def test_a_node_without_a_peer_plane_is_a_one_node_cluster(tmp_path):
    parts = build(tmp_path)
    assert parts.plane is None and parts.peer is None and parts.coordinator is None
    assert parts.rendezvous is None
    assert parts.restorer.agreement is None and parts.restorer.peers is None
    assert parts.tiers == [parts.gcs] and not parts.gcs.enabled
    assert parts.gcs.status().summary == "off (no --bucket)"
    assert_shared(parts)


def test_listen_and_coordinator_build_the_peer_plane(tmp_path):
    parts = build(tmp_path, listen="127.0.0.1:7001", coordinator="127.0.0.1:7001")
    peer, plane, coord = parts.peer, parts.plane, parts.coordinator
    assert isinstance(peer, PeerTier) and isinstance(plane, PlaneState)
    assert coord is not None and coord.gate == plane.coordinator_gate
    assert coord.coordinator.bucket is False  # no bucket: decisions never wait for one
    assert parts.tiers == [peer, parts.gcs]
    agreement = parts.restorer.agreement
    assert isinstance(agreement, CoordinatorAgreement) and agreement.tier is peer
    assert parts.restorer.bucket is None
    peers = parts.restorer.peers
    assert isinstance(peers, PeerSources) and peers.tier is peer
    assert peers(3, "10.0.0.3:7000").name == "peer:3"
    assert peer.backup is None and parts.rendezvous is None
    # the static coordinator's own node serves it, whatever its job
    assert plane.coordinator_gate() is None and peer.has_plane()
    assert_shared(parts)


def test_a_node_that_only_knows_the_coordinator_has_no_server(tmp_path):
    parts = build(tmp_path, coordinator="10.0.0.1:7000")
    assert parts.peer is not None and parts.coordinator is None
    assert parts.plane is not None
    assert parts.plane.coordinator_gate() == "the coordinator is at 10.0.0.1:7000"
    assert isinstance(parts.restorer.agreement, CoordinatorAgreement)
    assert_shared(parts)


def test_a_bucket_without_a_peer_plane_decides_alone(tmp_path):
    parts = build(tmp_path, bucket="ckpt-bucket/pre")
    gcs = parts.gcs
    assert gcs.enabled and str(gcs.spec).startswith("gs://ckpt-bucket/pre")
    assert gcs.plane is None and gcs.coordinator is None
    assert parts.restorer.agreement is None and parts.restorer.peers is None
    assert isinstance(parts.restorer.bucket, BucketRestoreSide)
    assert parts.restorer.bucket.source("2026-12-01_21-00").name == "gcs:2026-12-01_21-00"
    assert parts.peer is None and parts.rendezvous is None
    assert_shared(parts)


def test_a_bucket_without_coordinator_finds_it_through_the_bucket(tmp_path):
    parts = build(tmp_path, bucket="ckpt-bucket", listen="127.0.0.1:7001")
    peer, gcs, plane = parts.peer, parts.gcs, parts.plane
    assert peer is not None and plane is not None and parts.coordinator is not None
    assert isinstance(parts.rendezvous, BucketRendezvous) and parts.rendezvous.tier is gcs
    assert plane.bucket_rendezvous and peer.has_plane()
    assert peer.backup is gcs  # the peer tier hands the coordinator's orders to it
    assert parts.coordinator.coordinator.bucket is True  # decisions wait for the bucket
    restorer = parts.restorer
    assert isinstance(restorer.agreement, CoordinatorAgreement) and restorer.agreement.tier is peer
    assert isinstance(restorer.bucket, BucketRestoreSide) and restorer.bucket.tier is gcs
    # node-rank 0 of a multi-node job serves the coordinator, the others do not
    assert plane.coordinator_gate() == "no multi-node job runs on this node"
    parts.state.job = JobSpec("j", "orbax", 0, 2)
    assert plane.coordinator_gate() is None
    parts.state.job = JobSpec("j", "orbax", 1, 2)
    assert plane.coordinator_gate() == "this node is node-rank 1 of job j"
    assert_shared(parts)


def test_a_bucket_with_a_static_coordinator_needs_no_rendezvous(tmp_path):
    parts = build(
        tmp_path, bucket="ckpt-bucket", listen="127.0.0.1:7001", coordinator="127.0.0.1:7000"
    )
    assert parts.rendezvous is None and parts.peer is not None
    assert parts.plane is not None and not parts.plane.bucket_rendezvous
    assert parts.peer.backup is parts.gcs
    assert isinstance(parts.restorer.agreement, CoordinatorAgreement)
    assert isinstance(parts.restorer.bucket, BucketRestoreSide)
    assert_shared(parts)


def test_an_invalid_bucket_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="--bucket"):
        build(tmp_path, bucket="Not A Bucket!")


# ---------------------------------------------------------------------- events through ports


def test_a_withdrawn_shard_stops_its_transfer_and_its_upload(tmp_path):
    parts = build(tmp_path, bucket="ckpt-bucket", listen="127.0.0.1:7001")
    assert parts.peer is not None
    key = ShardKey("j", 0, 5)
    shard = SimpleNamespace(key=key, inodes={11, 12}, path=str(tmp_path / "gone"))
    parts.catalog.add(shard)  # type: ignore[arg-type]
    assert parts.agent.sealed_inos == {11: key, 12: key}
    send = parts.peer._sends[key] = Send()
    up = parts.gcs.uploads.active[key] = Upload("r", 5, 10, threading.Event(), time.time())
    removed: list[object] = []
    parts.shards.remove = removed.append  # type: ignore[method-assign]
    parts.catalog.drop(key, "a sealed file was opened for writing")
    assert send.cancel.is_set() and up.cancel.is_set()
    assert key not in parts.peer._sends and removed == [shard]
    assert parts.agent.sealed_inos == {} and key not in parts.catalog


def test_a_backup_outcome_asks_the_peer_tier_for_a_heartbeat(tmp_path):
    parts = build(tmp_path, bucket="ckpt-bucket", listen="127.0.0.1:7001")
    assert parts.peer is not None
    assert not parts.peer.heartbeat.wake.is_set()
    job = JobSpec("j", "orbax", 1, 2)
    parts.gcs.uploads.finish(job, "2026-12-01_21-00", 5, "done", "", 10, 1.0, None)
    assert parts.peer.heartbeat.wake.is_set()
    assert parts.peer.heartbeat.backup_outcome() == parts.gcs.backup_outcome()
    assert parts.gcs.backup_outcome() is not None and parts.gcs.backup_outcome().step == 5


def test_the_coordinators_summons_reach_the_agent(tmp_path):
    parts = build(tmp_path, listen="127.0.0.1:7001", coordinator="127.0.0.1:7001")
    job = JobSpec("j", "generic", 1, 2)
    parts.state.job, parts.state.mode = job, "generic"
    assert parts.peer is not None
    parts.agent.restores._fresh = False  # its own start-up restore ended earlier
    parts.peer.summons.summoned(job)
    assert parts.agent.restore_state["state"] == "pending"
    assert parts.agent.restore_state["summoned"] is True


def test_an_adopted_replica_is_cataloged_and_asks_for_retention(tmp_path):
    parts = build(tmp_path, listen="127.0.0.1:7001", coordinator="127.0.0.1:7001")
    assert parts.peer is not None
    ran: list[str] = []

    async def retention() -> None:
        ran.append("retention")

    parts.agent.keeper.apply_retention = retention  # type: ignore[method-assign]
    replica = SimpleNamespace(key=ShardKey("j", 1, 3), inodes={7})

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            parts.agent.tasks.nursery = nursery
            parts.peer.holdings.register(replica)  # type: ignore[arg-type]
        parts.agent.tasks.nursery = None

    trio.run(main)
    assert parts.catalog.get(replica.key) is replica and ran == ["retention"]


def test_reporter_lines_name_the_job_and_reach_the_status(tmp_path):
    parts = build(tmp_path)
    parts.state.job = JobSpec("train", "orbax", 3, 4)
    parts.reporter.error("replication of step 5 to node-rank 1 failed")
    parts.reporter.error("replication of step 5 to node-rank 1 failed")  # once a minute
    text = (pathlib.Path(parts.agent.store.view) / "replicator.errors").read_text()
    assert text.count("replication of step 5") == 1 and "train" in text
    assert len(parts.agent.errors) == 1 and "node-rank 1 failed" in parts.agent.errors[0]
    parts.reporter.failure("restore failed: boom", job_context=False)
    failed = (pathlib.Path(parts.agent.store.view) / "replicator.failed").read_text()
    assert "restore failed: boom" in failed and "train" not in failed


# ---------------------------------------------------------------------- tiers with fake ports


def test_the_gcs_tier_with_fake_ports_follows_the_plane():
    node = fake_ports.FakeJob(JobSpec("j", "orbax", 0, 2))
    plane = PlaneState(node, coordinator=None, listen="127.0.0.1:1", bucket_rendezvous=True)
    catalog = fake_ports.catalog()
    tier = GcsTier(
        None,
        catalog=catalog,
        job=node,
        reporter=node,
        shards=None,  # type: ignore[arg-type]
        budget=fake_ports.FakeBudget(),
        plane=plane,
    )
    job = node.job
    assert job is not None
    assert tier.multi(job) and not tier.coordinating(job)  # no server runs yet
    plane.server_up = True
    assert tier.coordinating(job) and tier.decider(job)
    plane.sync["step"] = 7
    assert tier.synced_step(job) == 7
    tier._fail("backup of step 7 failed: 503")
    assert node.errors == ["backup of step 7 failed: 503"]


def test_tier_modules_import_nothing_inside_functions():
    """The wiring needs no import inside a function to dodge a cycle (issue #12)."""
    root = pathlib.Path(tierfs.__file__).parent
    modules = [
        "daemon.py",
        "core/ports.py",
        "core/types.py",
        "node/agent.py",
        "node/intake.py",
        "node/jobcontrol.py",
        "node/keeper.py",
        "node/restore_driver.py",
        "node/sealer.py",
        "node/status_builder.py",
        "node/steps.py",
        "node/tasks.py",
        "node/catalog.py",
        "node/jobstate.py",
        "node/reporter.py",
        "node/agreement.py",
        "node/restorer.py",
        "node/sources.py",
        "node/statefile.py",
        "replication/peer.py",
        "replication/plane.py",
        "backup/tier.py",
    ]
    found = []
    for name in modules:
        tree = ast.parse((root / name).read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                found += [
                    f"{name}:{node.lineno}"
                    for node in ast.walk(fn)
                    if isinstance(node, ast.Import | ast.ImportFrom)
                ]
    assert found == []


def test_a_gcs_client_that_cannot_be_created_is_tried_again_with_backoff(monkeypatch):
    """Regression (a new-user trial): with --bucket and no credentials, the GCS tier
    tried to create its client on every 1 s tick, and google-auth logged a warning each
    time, forever. A failed creation now waits the gcs-bucket-check policy's pause."""
    from tierfs.backup import layout

    node = fake_ports.FakeJob(JobSpec("j", "generic", 0, 1))
    tier = GcsTier(
        layout.parse_bucket("nosuch"),
        catalog=fake_ports.catalog(),
        job=node,
        reporter=node,
        shards=None,  # type: ignore[arg-type]
        budget=fake_ports.FakeBudget(),
    )
    tries = []

    def no_credentials():
        tries.append(1)
        raise RuntimeError("Your default credentials were not found")

    monkeypatch.setattr(tier.access, "get_backend", no_credentials)
    clock = [1000.0]
    monkeypatch.setattr("tierfs.backup.tier.time.monotonic", lambda: clock[0])

    async def ticks(n: int) -> None:
        for _ in range(n):
            await tier.follower.tick()

    trio.run(ticks, 5)
    assert len(tries) == 1
    assert "cannot create the GCS client" in (tier.note or "")
    clock[0] += 2.5  # past the first pause (2 s)
    trio.run(ticks, 3)
    assert len(tries) == 2
    clock[0] += 3.0  # the second pause is 4 s: not yet
    trio.run(ticks, 3)
    assert len(tries) == 2


class HeldTier:
    """A tier whose start waits for ``release`` (a peer tier still reaching its
    coordinator), recording what the node's status said meanwhile."""

    def __init__(self, inner: object, release: trio.Event) -> None:
        self.inner, self.release, self.seen = inner, release, trio.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.seen.set()
        await self.release.wait()
        task_status.started()
        await trio.sleep_forever()


def test_a_starting_node_reports_its_restore_pending_before_its_tiers_started(tmp_path):
    # regression (a Ray Train worker resized onto this node): while the daemon started
    # its tiers, the mount answered with restore "idle"; `tierfs wait` printed "no
    # restore needed" (exit 0) and the trainer started from step 0
    from tierfs.cli.wait import RESTORE_SETTLED, wait_outcome

    parts = build(
        tmp_path, listen="127.0.0.1:7001", coordinator="127.0.0.1:7001", nodes=2, node_rank=1
    )
    agent = parts.agent
    seen: list[tuple[str, tuple[int, str]]] = []

    async def main() -> None:
        release = trio.Event()
        held = HeldTier(agent.tiers[0], release)
        agent.tiers = [held, *agent.tiers[1:]]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(agent.run)
            await held.seen.wait()
            restore = agent.status().restore
            seen.append((restore.state, wait_outcome(restore)))
            nursery.cancel_scope.cancel()

    trio.run(main)
    state, outcome = seen[0]
    assert state == "pending" and state not in RESTORE_SETTLED, seen
    assert outcome != (0, "no restore needed")


def test_the_daemon_log_in_a_small_budget_takes_a_small_part_of_it():
    """#14 trial 53 D1: with ``--size 64MiB`` the log (3 files of 16 MiB) could take 48 MiB
    of the budget it lies in."""
    from tierfs.daemon import log_bytes

    assert log_bytes(None) == 16 << 20  # the ram-dir's own filesystem: the full size
    assert log_bytes(64 << 20) == 1 << 20
    assert log_bytes(8 << 20) == 256 << 10
    assert log_bytes(64 << 30) == 16 << 20
