"""One file of another rank's part from a tier (the FileSource port, issue #14), without a
mount or a daemon.

Peers: four real PeerTiers over the in-process transport of
tests/support/fake_peers.py (real client, servicer, coordinator; faults injected
on the wire). Node-rank 3's part of a step is held by its own node and, by the
job's placement (2 peers per node), by nodes 2 and 1; node 0 (which serves the
coordinator, so it knows every member's address) fetches files of it:
``PullRequest.paths`` sends only the file asked for, a corrupt copy or one already
named in ``skip`` moves on to the next holder, holders of other bytes are asked
last, and when no holder serves the error names every one.

Also over real loopback gRPC (the servicer on :class:`tierfs.rpc.aio_server.AioServer`):
``PeerClient.pull_file``; and a holder that ignores ``paths`` (an older daemon) refused.

Bucket: :meth:`tierfs.backup.tier.GcsTier.fetch_file` on the in-memory bucket of
tests/support/fake_bucket.py (the real backend code): the round whose part has the
caller's digest first, bit rot skipped for an older round, the lookups cached (a
burst of fetches lists the bucket once, again once stale), a missing step and no
bucket refused, no room for the file ends the fetch.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import fake_bucket as fb
import fake_peers
import fake_ports
import google_crc32c
import grpc
import pytest
import trio
import trio.testing
from fake_ports import FakeBudget, FakeJob
from gcs_fixtures import make_shard

from tierfs.backup import fetch
from tierfs.backup.tier import GcsTier
from tierfs.cluster.coordinator import Coordinator
from tierfs.cluster.servicer import CoordinatorServicer
from tierfs.core.config import NodeConfig
from tierfs.core.control import JobSpec
from tierfs.core.errors import FetchFailed
from tierfs.core.ports import PART_SAVING, FileTarget
from tierfs.node.catalog import ShardCatalog
from tierfs.replication import heartbeat
from tierfs.replication.client import PeerClient
from tierfs.replication.peer import PeerTier
from tierfs.replication.plane import PlaneState
from tierfs.replication.service import PeerServicer, peer_handlers
from tierfs.replication.transfer import CHUNK, BadCopy, OtherBytes, Refused
from tierfs.rpc import peer_pb2
from tierfs.rpc import wire as peer_wire
from tierfs.rpc.aio_server import AioServer, with_sync_context
from tierfs.rpc.wire import WireStats
from tierfs.store.manifest import Manifest
from tierfs.store.ramstore import RamStore
from tierfs.store.shards import Shard, ShardKey, ShardStore

JOB = "job"
TOKEN = "secret"
STEP = 7
#: a part of three files; the big one spans two chunks of the wire
FILES = {
    "7/state/big.bin": bytes(range(256)) * (CHUNK // 256) + b"tail" * 250,
    "7/state/small.bin": b"small file of rank 3",
    "7/meta.json": b'{"step": 7}',
}
BIG, SMALL = "7/state/big.bin", "7/state/small.bin"


def address(rank: int) -> str:
    return f"10.0.0.{rank + 1}:7000"


def label(rank: int) -> str:
    return f"peer node-rank {rank} ({address(rank)})"


def target(tmp_path: Path, name: str = "out") -> int:
    """A fresh file for the fetched bytes (read-write, as the view opens it)."""
    return os.open(tmp_path / name, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)


def contents(fd: int) -> bytes:
    return os.pread(fd, os.fstat(fd).st_size + 1, 0)


# ---------------------------------------------------------------------- peers


class Node:
    """One node's parts as build_node makes them, with the fake transport; placement by
    count (2 peers per node), so every node can tell who holds a rank's replicas."""

    def __init__(self, net: fake_peers.PeerNetwork, root: Path, rank: int, nodes: int = 4):
        self.rank = rank
        self.ram_dir = root / f"n{rank}"
        self.store = RamStore(str(self.ram_dir))
        self.shards = ShardStore(self.store)
        self.catalog = ShardCatalog(self.shards, 2)
        self.job = FakeJob(JobSpec(JOB, "generic", rank, nodes, peers_per_node=2))
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

    def seal(self, step: int, content: dict[str, bytes]) -> Shard:
        shard = make_shard(self.ram_dir, JOB, self.rank, step, dict(content))
        self.catalog.add(shard)
        self.catalog.sealed(shard)
        return shard

    def states(self, step: int) -> dict[int, str]:
        send = self.tier._sends.get(ShardKey(JOB, self.rank, step))
        return dict(send.states) if send is not None else {}


async def wait_for(cond: Callable[[], object], what: str, timeout: float = 60.0) -> None:
    with trio.move_on_after(timeout):
        while not cond():
            await trio.sleep(0.02)
        return
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def net(monkeypatch):
    monkeypatch.setattr(heartbeat, "HEARTBEAT", 0.1)  # the members' addresses arrive sooner
    n = fake_peers.PeerNetwork()
    yield n
    n.close()


def cluster(net: fake_peers.PeerNetwork, root: Path, test: Callable[..., object]) -> None:
    """Four nodes; node 3 seals :data:`STEP` and it reaches nodes 2 and 1; then
    ``await test(nodes, shard)``."""

    async def main() -> None:
        nodes = [Node(net, root, r) for r in range(4)]
        async with trio.open_nursery() as nursery:
            for n in nodes:
                await nursery.start(n.tier.run)
            await wait_for(
                lambda: nodes[0].coordinator.locked(lambda c: all(c.live(r) for r in range(4))),
                "every node to join the coordinator",
            )
            shard = nodes[3].seal(STEP, FILES)
            await wait_for(
                lambda: nodes[3].states(STEP) == {2: "replicated", 1: "replicated"},
                "the replicas on nodes 2 and 1",
            )
            with trio.fail_after(120):
                await test(nodes, shard)  # type: ignore[misc]
            nursery.cancel_scope.cancel()

    trio.run(main)


def pulls(net: fake_peers.PeerNetwork) -> list[tuple[str, str]]:
    """(callee, outcome) of every PullShard call node 0 made."""
    return [(c[1], c[3]) for c in net.calls("PullShard") if c[0] == address(0)]


def test_pull_file_of_a_three_file_part_writes_exactly_that_file(net, tmp_path):
    async def test(nodes: list[Node], shard: Shard) -> None:
        client = nodes[0].tier.client
        key, digest = shard.key, shard.manifest.digest
        served = nodes[3].tier.stats.snapshot()["served_bytes"]
        fd = target(tmp_path)
        try:
            os.write(fd, b"x")  # the descriptor's own offset must not move
            got = await trio.to_thread.run_sync(
                client.pull_file, address(3), key, digest, BIG, fd, threading.Event()
            )
            assert got == len(FILES[BIG])
            assert contents(fd) == FILES[BIG]
            assert os.lseek(fd, 0, os.SEEK_CUR) == 1
        finally:
            os.close(fd)
        # only that file crossed the wire (its two chunks), not the other two
        assert nodes[3].tier.stats.snapshot()["served_bytes"] - served == len(FILES[BIG])
        assert client.stats.snapshot()["pulled_bytes"] == len(FILES[BIG])
        # the tier's fetch: the owner serves first; "" accepts any digest
        fd = target(tmp_path, "small")
        try:
            assert await nodes[0].tier.fetch_file(JOB, 3, STEP, "", SMALL, fd) == label(3)
            assert contents(fd) == FILES[SMALL]
        finally:
            os.close(fd)
        assert pulls(net) == [(address(3), "ok"), (address(3), "ok")]

    cluster(net, tmp_path, test)


def test_an_unknown_path_or_a_directory_is_not_found_and_named(net, tmp_path):
    async def test(nodes: list[Node], shard: Shard) -> None:
        client = nodes[0].tier.client
        fd = target(tmp_path)
        try:
            for path in ("7/state/nothing.bin", "7/state", "../7/meta.json"):
                with pytest.raises(grpc.RpcError) as err:
                    await trio.to_thread.run_sync(
                        client.pull_file,
                        address(3),
                        shard.key,
                        shard.manifest.digest,
                        path,
                        fd,
                        threading.Event(),
                    )
                assert err.value.code() == grpc.StatusCode.NOT_FOUND
                assert repr(path) in err.value.details()
            # the tier asks every holder, and says what each answered
            with pytest.raises(FetchFailed) as failed:
                await nodes[0].tier.fetch_file(
                    JOB, 3, STEP, shard.manifest.digest, "7/state/nothing.bin", fd
                )
            assert os.fstat(fd).st_size == 0
        finally:
            os.close(fd)
        message = str(failed.value)
        for r in (3, 2, 1):
            assert f"{label(r)}: NOT_FOUND" in message
        assert message.index(label(3)) < message.index(label(2)) < message.index(label(1))

    cluster(net, tmp_path, test)


def test_a_corrupt_copy_is_refused_and_the_next_holder_serves(net, tmp_path):
    async def test(nodes: list[Node], shard: Shard) -> None:
        client = nodes[0].tier.client
        damaged: dict[int, list[tuple[ShardKey, str]]] = {2: [], 3: []}
        for r, seen in damaged.items():
            nodes[r].tier.holdings.on_damaged(lambda k, p, seen=seen: seen.append((k, p)))
        fd = target(tmp_path)
        try:
            # a bit flipped in transit: the chunk's crc32c refuses it
            net.corrupt("PullShard", callee=address(3), chunk=1, at=5)
            with pytest.raises(BadCopy, match="chunk crc32c mismatch"):
                await trio.to_thread.run_sync(
                    client.pull_file,
                    address(3),
                    shard.key,
                    shard.manifest.digest,
                    BIG,
                    fd,
                    threading.Event(),
                )
            net.corrupt("PullShard", callee=address(3), chunk=0, at=5)
            served = await nodes[0].tier.fetch_file(JOB, 3, STEP, shard.manifest.digest, BIG, fd)
            assert served == label(2)
            assert contents(fd) == FILES[BIG]
            # bit rot at rest in node 2's replica: every chunk checks out, the file does not
            held = nodes[2].catalog[shard.key]
            rotten = Path(held.data, SMALL)
            data = bytearray(rotten.read_bytes())
            data[3] ^= 0x10
            rotten.write_bytes(bytes(data))
            os.ftruncate(fd, 0)
            served = await nodes[0].tier.fetch_file(
                JOB, 3, STEP, shard.manifest.digest, SMALL, fd, skip=frozenset({label(3)})
            )
            assert served == label(1)
            assert contents(fd) == FILES[SMALL]
            # node 2 read the wrong bytes from its RAM and told its node to check that
            # copy (#16 ninth trial FAIL 13); bytes flipped on the wire are no damage
            # of node 3's copy
            await wait_for(lambda: damaged[2], "node 2 to notice its damaged copy")
            assert damaged == {2: [(shard.key, SMALL)], 3: []}
        finally:
            os.close(fd)
        # (node 2's rotten file arrived whole; the client refused it at its end)
        assert pulls(net) == [
            (address(3), "corrupt"),
            (address(3), "corrupt"),
            (address(2), "ok"),
            (address(2), "ok"),
            (address(1), "ok"),
        ]

    cluster(net, tmp_path, test)


def test_skip_is_honoured_and_holders_of_other_bytes_are_asked_last(net, tmp_path):
    async def test(nodes: list[Node], shard: Shard) -> None:
        fd = target(tmp_path)
        try:
            skip = frozenset({label(3), label(2)})
            served = await nodes[0].tier.fetch_file(
                JOB, 3, STEP, shard.manifest.digest, SMALL, fd, skip=skip
            )
            assert served == label(1) and contents(fd) == FILES[SMALL]
            assert [c for c, _ in pulls(net)] == [address(1)]
            # every copy named in skip: nothing is asked, and the message says so
            with pytest.raises(FetchFailed, match="skipped") as failed:
                await nodes[0].tier.fetch_file(JOB, 3, STEP, "", SMALL, fd, skip=skip | {label(1)})
            assert all(label(r) in str(failed.value) for r in (1, 2, 3))
            assert len(pulls(net)) == 1
            # a digest nobody holds: every holder refuses it, then the owner serves
            # its own bytes (the caller checks them against its manifest)
            served = await nodes[0].tier.fetch_file(JOB, 3, STEP, "0badd1e5", SMALL, fd)
            assert served == label(3) and contents(fd) == FILES[SMALL]
            assert [o for _, o in pulls(net)[1:]] == ["FAILED_PRECONDITION"] * 3 + ["ok"]
        finally:
            os.close(fd)

    cluster(net, tmp_path, test)


def test_the_owners_newer_part_ends_a_fetch_of_the_earlier_one(net, tmp_path):
    """Regression (#14 trial 60 M1a, silent wrong values): rank 3's node sealed a newer
    part of the step (the step saved again); node 0's view still knew the earlier
    part. Node 3 refused the earlier digest, the replica on node 2 served the earlier
    bytes, checked against the earlier manifest: a load read the first save's values.
    Now node 3 is asked again for the file itself: the same bytes are served from it,
    other bytes end the fetch (``superseded``) and no replica is asked."""

    def crc(data: bytes) -> tuple[int, int]:
        return len(data), google_crc32c.value(data)

    async def test(nodes: list[Node], shard: Shard) -> None:
        newer = make_shard(nodes[3].ram_dir, JOB, 3, STEP, {**FILES, SMALL: b"saved again"})
        nodes[3].catalog.add(newer)  # held by its node only: the replicas are the earlier
        assert nodes[3].catalog[ShardKey(JOB, 3, STEP)].manifest.digest != shard.manifest.digest
        fd = target(tmp_path)
        try:
            with pytest.raises(FetchFailed) as failed:
                await nodes[0].tier.fetch_file(
                    JOB, 3, STEP, shard.manifest.digest, SMALL, fd, expect=crc(FILES[SMALL])
                )
            assert failed.value.superseded and failed.value.other_bytes, failed.value
            assert "newer part" in str(failed.value)
            assert [c for c, _ in pulls(net)] == [address(3), address(3)]  # no replica
            assert contents(fd) == b""
            # a file the newer part holds as it was: served by the owner
            served = await nodes[0].tier.fetch_file(
                JOB, 3, STEP, shard.manifest.digest, BIG, fd, expect=crc(FILES[BIG])
            )
            assert served == label(3) and contents(fd) == FILES[BIG]
            assert [c for c, _ in pulls(net)][2:] == [address(3), address(3)]
        finally:
            os.close(fd)

    cluster(net, tmp_path, test)


def test_a_part_its_node_writes_again_is_never_served_from_its_replicas(net, tmp_path):
    """#14 trial 60 M1a: rank 3's node withdrew its part (its client writes the step
    again, the seal to come). Its node answers "being saved again" to a file pull and
    to the question what part it holds (``owner_part``); the fetch ends there
    (``superseded``): the replicas on nodes 2 and 1 hold the save before."""

    async def test(nodes: list[Node], shard: Shard) -> None:
        key = ShardKey(JOB, 3, STEP)
        nodes[3].tier.holdings.resaving_now = lambda k: k == key
        nodes[3].catalog.drop(key, "a sealed file was opened for writing")
        owner = await nodes[0].tier.owner_part(JOB, 3, STEP)
        assert owner == PART_SAVING
        fd = target(tmp_path)
        try:
            with pytest.raises(FetchFailed) as failed:
                await nodes[0].tier.fetch_file(
                    JOB,
                    3,
                    STEP,
                    shard.manifest.digest,
                    SMALL,
                    fd,
                    expect=(len(FILES[SMALL]), google_crc32c.value(FILES[SMALL])),
                )
            assert failed.value.superseded, failed.value
            assert [c for c, _ in pulls(net)] == [address(3)] * 3  # owner_part, no replica
        finally:
            os.close(fd)
        # sealed again: its node names the part it holds
        again = make_shard(nodes[3].ram_dir, JOB, 3, STEP, {**FILES, SMALL: b"saved again"})
        nodes[3].tier.holdings.resaving_now = None
        nodes[3].catalog.add(again)
        assert await nodes[0].tier.owner_part(JOB, 3, STEP) == again.manifest.digest

    cluster(net, tmp_path, test)


def test_every_holder_down_fails_naming_each_of_them(net, tmp_path):
    async def test(nodes: list[Node], shard: Shard) -> None:
        for r in (1, 2, 3):
            net.down(address(r))
        fd = target(tmp_path)
        try:
            with pytest.raises(FetchFailed) as failed:
                await nodes[0].tier.fetch_file(JOB, 3, STEP, shard.manifest.digest, SMALL, fd)
        finally:
            os.close(fd)
        message = str(failed.value)
        assert message.startswith(f"{SMALL} of step {STEP} of node-rank 3 from peers: ")
        for r in (3, 2, 1):
            assert f"{label(r)}: UNAVAILABLE" in message
        # another job's part: only its owner is asked, and node 1 (not the coordinator's
        # node, rank 2 not one of its partners) has no address for it
        with pytest.raises(FetchFailed, match="peer node-rank 2: no address known"):
            await nodes[1].tier.fetch_file("other-job", 2, STEP, "", SMALL, -1)

    cluster(net, tmp_path, test)


def test_no_room_for_the_file_ends_the_fetch_at_once(net, tmp_path):
    async def test(nodes: list[Node], shard: Shard) -> None:
        fd = os.open("/dev/full", os.O_RDWR | os.O_CLOEXEC)  # every write: ENOSPC
        try:
            with pytest.raises(FetchFailed, match="no room") as failed:
                await nodes[0].tier.fetch_file(JOB, 3, STEP, shard.manifest.digest, SMALL, fd)
        finally:
            os.close(fd)
        assert isinstance(failed.value.__cause__, OSError)
        assert failed.value.__cause__.errno == errno.ENOSPC
        assert [c for c, _ in pulls(net)] == [address(3)]  # no other holder would fit either

    cluster(net, tmp_path, test)


# ---------------------------------------------------------------------- loopback gRPC


class Host:
    """A :class:`~tierfs.replication.service.PeerHost` holding one shard."""

    incarnation = "inc"

    def __init__(self, shard: Shard) -> None:
        self.shard = shard
        self.stats = WireStats()
        self.pins: list[int] = []

    def find(self, key: ShardKey) -> Shard | None:
        return self.shard if key == self.shard.key else None

    def pin(self, key: ShardKey, delta: int) -> None:
        self.pins.append(delta)


class IgnoresPaths(PeerServicer):
    """A holder from before ``PullRequest.paths``: it streams every file."""

    def PullShard(self, request, context):  # type: ignore[no-untyped-def]
        request.ClearField("paths")
        return super().PullShard(request, context)


@pytest.fixture
def served(tmp_path) -> Iterator[Callable[[type[PeerServicer]], tuple[str, Host]]]:
    """``served(servicer_class)`` -> (address, host) of a real gRPC server on loopback
    holding node-rank 3's part of :data:`STEP`."""
    shard = make_shard(tmp_path / "holder", JOB, 3, STEP, dict(FILES))
    servers: list[AioServer] = []

    def start(kind: type[PeerServicer]) -> tuple[str, Host]:
        host = Host(shard)
        handlers = with_sync_context(peer_handlers(kind(host)))  # type: ignore[arg-type]
        server = AioServer(
            lambda srv, loop: srv.add_generic_rpc_handlers((handlers,)),
            interceptors=[peer_wire.AioTokenInterceptor(TOKEN)],
            options=peer_wire.SERVER_OPTIONS,
        )
        port = server.start("127.0.0.1:0")
        servers.append(server)
        return f"127.0.0.1:{port}", host

    yield start
    for server in servers:
        server.stop(0)


def test_pull_file_over_loopback_grpc(served, tmp_path):
    at, host = served(PeerServicer)
    client = PeerClient(TOKEN, WireStats())
    key = host.shard.key
    fd = target(tmp_path)
    try:
        n = client.pull_file(at, key, host.shard.manifest.digest, BIG, fd, threading.Event())
        assert n == len(FILES[BIG]) and contents(fd) == FILES[BIG]
        assert host.stats.snapshot()["served_bytes"] == len(FILES[BIG])
        assert host.pins == [1, -1]  # pinned while it was sent
        with pytest.raises(grpc.RpcError) as err:
            client.pull_file(at, key, "", "7/nope", fd, threading.Event())
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "'7/nope'" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            client.pull_file(at, key, "0badd1e5", SMALL, fd, threading.Event())
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as err:
            PeerClient("wrong", WireStats()).pull_file(at, key, "", SMALL, fd, threading.Event())
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        os.close(fd)
        client.close()


class IgnoresTrim(PeerServicer):
    """A holder from before ``PullRequest.trim_manifest``: it sends the whole manifest."""

    def PullShard(self, request, context):  # type: ignore[no-untyped-def]
        request.ClearField("trim_manifest")
        return super().PullShard(request, context)


def pull_messages(at: str, request: peer_pb2.PullRequest) -> list[peer_pb2.PullMessage]:
    """Every message a PullShard call answers (a raw call, as any puller makes it)."""
    client = PeerClient(TOKEN, WireStats())
    try:
        pull = client.channel(at).unary_stream(
            "/tierfs.peer.v1.Peer/PullShard",
            request_serializer=peer_wire.serialize,
            response_deserializer=peer_wire.chunk_deserializer(peer_pb2.PullMessage),
        )
        return list(pull(request, metadata=client.md, timeout=30))
    finally:
        client.close()


def test_a_trimmed_pull_sends_only_that_files_entry_and_the_whole_digest(served, tmp_path):
    at, host = served(PeerServicer)
    key, whole = host.shard.key, host.shard.manifest
    req = peer_pb2.PullRequest(
        job=JOB, rank=3, step=STEP, digest=whole.digest, puller_rank=-1, paths=[SMALL]
    )
    # an older puller (no trim_manifest): the whole manifest, no digest field
    full = pull_messages(at, req)
    assert full[0].manifest.digest == ""
    assert Manifest.from_json(full[0].manifest.json) == whole
    req.trim_manifest = True
    msgs = pull_messages(at, req)
    head = msgs[0].manifest
    trimmed = Manifest.from_json(head.json)
    assert [f.path for f in trimmed.files] == [SMALL]
    assert trimmed.files[0] == next(f for f in whole.files if f.path == SMALL)
    assert head.digest == whole.digest != trimmed.digest
    assert b"".join(peer_wire.as_chunk(m).data for m in msgs[1:]) == FILES[SMALL]
    # the client reads it, and an older holder's whole manifest too
    old_at, _ = served(IgnoresTrim)
    client = PeerClient(TOKEN, WireStats())
    try:
        for where in (at, old_at):
            fd = target(tmp_path, f"out-{where.rsplit(':', 1)[1]}")
            try:
                n = client.pull_file(where, key, whole.digest, BIG, fd, threading.Event())
                assert n == len(FILES[BIG]) and contents(fd) == FILES[BIG]
            finally:
                os.close(fd)
        # a digest the holder does not have: refused before any byte (as untrimmed)
        fd = target(tmp_path, "wrong")
        try:
            with pytest.raises(grpc.RpcError) as err:
                client.pull_file(at, key, "0badd1e5-10", SMALL, fd, threading.Event())
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        finally:
            os.close(fd)
    finally:
        client.close()


def test_a_trimmed_manifest_with_another_digest_than_asked_is_a_bad_copy(tmp_path, served):
    # a holder that answers a trimmed manifest whose whole digest is not the one asked
    class WrongDigest(PeerServicer):
        def PullShard(self, request, context):  # type: ignore[no-untyped-def]
            asked, request.digest = request.digest, ""
            for i, msg in enumerate(super().PullShard(request, context)):
                if i == 0:
                    m = peer_pb2.PullMessage.FromString(msg)
                    m.manifest.digest = "0badd1e5-10"
                    msg = m.SerializeToString()
                yield msg
            assert asked

    at, host = served(WrongDigest)
    client = PeerClient(TOKEN, WireStats())
    fd = target(tmp_path)
    try:
        with pytest.raises(BadCopy, match="manifest digest 0badd1e5-10 != announced"):
            client.pull_file(
                at, host.shard.key, host.shard.manifest.digest, SMALL, fd, threading.Event()
            )
        assert os.fstat(fd).st_size == 0
    finally:
        os.close(fd)
        client.close()


def test_a_holder_whose_file_is_not_the_expected_one_sends_no_byte(served, tmp_path):
    at, host = served(PeerServicer)
    client = PeerClient(TOKEN, WireStats())
    fd = target(tmp_path)
    size = len(FILES[BIG])
    right = google_crc32c.value(FILES[BIG])
    try:
        with pytest.raises(OtherBytes, match=f"the manifest here says {size} bytes crc32c"):
            client.pull_file(
                at, host.shard.key, "", BIG, fd, threading.Event(), expect=(size, right ^ 1)
            )
        assert os.fstat(fd).st_size == 0
        assert client.stats.snapshot().get("pulled_bytes", 0) == 0
        n = client.pull_file(
            at, host.shard.key, "", BIG, fd, threading.Event(), expect=(size, right)
        )
        assert n == size and contents(fd) == FILES[BIG]
    finally:
        os.close(fd)
        client.close()


def test_a_held_pull_writes_nothing_until_released(served, tmp_path):
    at, host = served(PeerServicer)
    client = PeerClient(TOKEN, WireStats())
    fd = target(tmp_path)
    go = threading.Event()
    asked = []

    def hold() -> bool:
        asked.append(os.fstat(fd).st_size)
        return not go.is_set()

    got: list[int] = []
    t = threading.Thread(
        target=lambda: got.append(
            client.pull_file(at, host.shard.key, "", BIG, fd, threading.Event(), hold=hold)
        )
    )
    t.start()
    try:
        deadline = time.monotonic() + 30
        while len(asked) < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(asked) >= 20 and set(asked) == {0}  # asked again and again, nothing written
        go.set()
        t.join(30)
        assert got == [len(FILES[BIG])] and contents(fd) == FILES[BIG]
    finally:
        go.set()
        t.join(30)
        os.close(fd)
        client.close()


def test_a_holder_that_ignores_paths_is_refused(net, tmp_path):
    # on the in-process transport, the handler served as it is (a plain generator;
    # a real AioServer steps it through with_sync_context, see test_aio_stream_cancel)
    shard = make_shard(tmp_path / "holder", JOB, 3, STEP, dict(FILES))
    handlers = peer_handlers(IgnoresPaths(Host(shard)))  # type: ignore[arg-type]
    server = net.server(lambda srv, loop: srv.add_generic_rpc_handlers((handlers,)))
    server.start(address(3))
    client = net.client(address(0))
    fd = target(tmp_path)
    try:
        # the manifest lists 7/meta.json first: its chunk arrives instead of small.bin's
        with pytest.raises(Refused, match=r"does not know PullRequest\.paths"):
            client.pull_file(address(3), shard.key, "", SMALL, fd, threading.Event())
        assert os.fstat(fd).st_size == 0  # nothing of another file was written
    finally:
        os.close(fd)
        server.stop()


# ---------------------------------------------------------------------- the bucket

R1, R2, R3 = "2026-12-01_10-01", "2026-12-01_10-02", "2026-12-01_10-03"


def part(rank: int, step: int, version: int = 0) -> dict[str, bytes]:
    return {
        "state/big.bin": bytes([rank, step, version]) * 5000,
        "state/small.bin": f"rank {rank} step {step} version {version}".encode(),
        "meta.json": f'{{"step": {step}}}'.encode(),
    }


def bucket_tier(server: fb.FakeGcs | None, deadline: float = 2.0) -> GcsTier:
    spec = fb.backend(server).spec if server is not None else None
    t = GcsTier(
        spec,
        catalog=fake_ports.catalog(),
        job=fake_ports.FakeJob(),
        reporter=fake_ports.FakeJob(),
        shards=None,  # type: ignore[arg-type]
        budget=fake_ports.FakeBudget(),
        settings=fb.fast_settings(deadline),
    )
    if server is not None:
        t.access.backend = fb.backend(server, deadline=deadline)  # get_backend() returns it
    return t


@pytest.fixture
def rounds(tmp_path):
    """Rank 1's step 5 in R1 and (other bytes) in R3; step 4 in R2; returns
    (server, digest of R1's part, digest of R3's part)."""
    server = fb.FakeGcs()
    b = fb.backend(server)
    ram = RamStore(str(tmp_path / "uploader"))
    digests = []
    for rnd, step, version in ((R1, 5, 0), (R2, 4, 0), (R3, 5, 1)):
        shard = fb.seal(ram, JOB, 1, step, part(1, step, version))
        b.upload_shard(shard, rnd, nodes=2)
        if step == 5:
            digests.append(shard.manifest.digest)
    return server, digests[0], digests[1]


def gets(server: fb.FakeGcs, suffix: str) -> int:
    return sum(1 for op, name, _ in server.log if op == "get" and name.endswith(suffix))


def test_the_bucket_serves_a_file_from_the_round_with_the_callers_bytes(
    rounds, tmp_path, monkeypatch
):
    monkeypatch.setattr(fetch, "FILE_LOOKUP_TTL", 3600.0)  # however slow the machine
    server, old, _new = rounds
    tier = bucket_tier(server)
    fd = target(tmp_path)
    server.log.clear()

    async def main() -> None:
        small = "5/state/small.bin"
        # the newest round holding the digest asked for, even if a newer one holds the step
        assert await tier.fetch_file(JOB, 1, 5, old, small, fd) == f"bucket round {R1}"
        assert contents(fd) == part(1, 5, 0)["state/small.bin"]
        os.ftruncate(fd, 0)
        # any digest: the newest round
        assert await tier.fetch_file(JOB, 1, 5, "", "5/state/big.bin", fd) == f"bucket round {R3}"
        assert contents(fd) == part(1, 5, 1)["state/big.bin"]
        os.ftruncate(fd, 0)
        # R1 named in skip: the round with other bytes serves (the caller checks them)
        served = await tier.fetch_file(
            JOB, 1, 5, old, small, fd, skip=frozenset({f"bucket round {R1}"})
        )
        assert served == f"bucket round {R3}"
        assert contents(fd) == part(1, 5, 1)["state/small.bin"]

    try:
        trio.run(main)
    finally:
        os.close(fd)
    # three fetches, one listing of the rounds and one GET of each round's manifest
    assert sum(1 for op, _name, _ in server.log if op == "list") == 1
    for rnd in (R1, R2, R3):
        assert gets(server, f"{rnd}/{JOB}-s5-n1.tierfs.json") == 1
    assert gets(server, "small.bin") == 2 and gets(server, "big.bin") == 1


def test_bit_rot_in_the_newest_round_moves_on_to_an_older_one(rounds, tmp_path):
    server, _old, new = rounds
    rotten = next(n for n in server.objects() if R3 in n and n.endswith("small.bin"))
    server.rot("bkt", rotten)
    tier = bucket_tier(server)
    fd = target(tmp_path)

    async def main() -> None:
        # R3 has the digest asked for, but its object's bytes are not the manifest's
        served = await tier.fetch_file(JOB, 1, 5, new, "5/state/small.bin", fd)
        assert served == f"bucket round {R1}"
        assert contents(fd) == part(1, 5, 0)["state/small.bin"]

    try:
        trio.run(main)
    finally:
        os.close(fd)


def test_a_step_no_round_holds_and_a_tier_without_bucket_fail(rounds, tmp_path):
    server, _old, _new = rounds
    tier = bucket_tier(server)
    fd = target(tmp_path)

    async def main() -> None:
        with pytest.raises(FetchFailed, match="no backup round holds it"):
            await tier.fetch_file(JOB, 1, 9, "", "9/meta.json", fd)
        with pytest.raises(FetchFailed, match=f"bucket round {R3}: .*not a file"):
            await tier.fetch_file(JOB, 1, 5, "", "5/state/nothing", fd)
        with pytest.raises(FetchFailed, match=r"^no bucket$"):
            await bucket_tier(None).fetch_file(JOB, 1, 5, "", "5/meta.json", fd)
        server.inject("status", "list", status=403, times=None)
        with pytest.raises(FetchFailed, match="could not be listed"):
            await bucket_tier(server).fetch_file(JOB, 1, 5, "", "5/meta.json", fd)

    try:
        trio.run(main)
    finally:
        os.close(fd)


def test_the_lookups_are_read_again_once_stale_and_no_room_ends_the_fetch(rounds, tmp_path):
    server, old, _new = rounds
    tier = bucket_tier(server)
    now = [1000.0]
    tier.restore._files.clock = lambda: now[0]  # the lookups' clock, moved by hand
    fd = target(tmp_path)
    full = os.open("/dev/full", os.O_RDWR | os.O_CLOEXEC)  # every write: ENOSPC
    server.log.clear()

    def lists() -> int:
        return sum(1 for op, _name, _ in server.log if op == "list")

    async def main() -> None:
        for _ in range(3):  # a burst: one listing
            await tier.fetch_file(JOB, 1, 5, old, "5/meta.json", fd)
        assert lists() == 1
        now[0] += fetch.FILE_LOOKUP_TTL + 0.1
        await tier.fetch_file(JOB, 1, 5, old, "5/meta.json", fd)
        assert lists() == 2
        with pytest.raises(FetchFailed, match="no room") as failed:
            await tier.fetch_file(JOB, 1, 5, "", "5/state/small.bin", full)
        assert isinstance(failed.value.__cause__, OSError)
        assert failed.value.__cause__.errno == errno.ENOSPC
        assert gets(server, "small.bin") == 1  # the older round was not tried

    try:
        trio.run(main)
    finally:
        os.close(fd)
        os.close(full)


def test_a_round_written_after_a_cached_lookup_serves_at_once(tmp_path, monkeypatch):
    # regression: the whole-step view looked for a part's manifest before its round
    # existed; the cached "no round" made the next file read fail for 5 s with EIO
    monkeypatch.setattr(fetch, "FILE_LOOKUP_TTL", 3600.0)  # a stale cache, however slow
    server = fb.FakeGcs()
    b = fb.backend(server)
    ram = RamStore(str(tmp_path / "uploader"))
    b.upload_shard(fb.seal(ram, JOB, 1, 4, part(1, 4, 0)), R1, nodes=2)
    tier = bucket_tier(server)
    fd = target(tmp_path)

    async def main() -> None:
        assert await tier.part_manifest(JOB, 1, 5) is None  # cached: no round holds it
        shard = fb.seal(ram, JOB, 1, 5, part(1, 5, 0))
        b.upload_shard(shard, R2, nodes=2)
        got = await tier.fetch_file(JOB, 1, 5, shard.manifest.digest, "5/meta.json", fd)
        assert got == f"bucket round {R2}"
        with pytest.raises(FetchFailed, match="no backup round holds it"):
            await tier.fetch_file(JOB, 1, 6, "", "6/meta.json", fd)

    try:
        trio.run(main)
    finally:
        os.close(fd)


def test_a_parts_manifest_comes_from_the_round_the_restore_decided(tmp_path):
    """Regression (#16 fourth trial): restored from round R1 (step 5 saved by 2 nodes),
    the view took a lost rank's manifest from the newest round holding step 5: R3,
    another save of step 5, once by 2 nodes and once (R4) by 3 nodes; the file had the
    same size and dcp.load returned that rank's values of the other save."""
    server = fb.FakeGcs()
    b = fb.backend(server)
    ram = RamStore(str(tmp_path / "uploader"))
    digests = {}
    for rnd, version, nodes in ((R1, 0, 2), (R2, 1, 2), (R3, 2, 3)):
        shard = fb.seal(ram, JOB, 1, 5, part(1, 5, version))
        b.upload_shard(shard, rnd, nodes=nodes)
        digests[rnd] = shard.manifest.digest
    tier = bucket_tier(server)

    async def main() -> None:
        async def digest(**kw: object) -> str | None:
            m = await tier.part_manifest(JOB, 1, 5, **kw)  # type: ignore[arg-type]
            return m.digest if m is not None else None

        assert await digest() == digests[R3]  # nothing known: the newest round
        assert await digest(round_name=R1) == digests[R1]
        assert await digest(writers=2, round_name=R1) == digests[R1]
        # a save by another node count is never taken for a step of 2 writers
        assert await digest(writers=2) == digests[R2]
        assert await digest(writers=2, round_name="2026-12-01_09-00") == digests[R2]
        assert await digest(writers=4) is None

    trio.run(main)


def test_a_round_holding_another_part_of_the_asking_rank_is_of_another_save(tmp_path):
    """Regression (fault campaign seed 29 #14): step 5 saved again after a restore to
    an older step; the abandoned history's save of step 5 was in the newest round.
    Node 1 was restarting, and node 0's view took rank 1's part from that round beside
    its own new part. A round whose part of the asking node's rank is not that node's
    own part is another save of the step: its parts are not taken."""
    server = fb.FakeGcs()
    b = fb.backend(server)
    ram = RamStore(str(tmp_path / "uploader"))
    own: dict[str, str] = {}
    other: dict[str, str] = {}
    for rnd, version in ((R1, 0), (R2, 1)):
        for rank, into in ((0, own), (1, other)):
            shard = fb.seal(ram, JOB, rank, 5, part(rank, 5, version))
            b.upload_shard(shard, rnd, nodes=2)
            into[rnd] = shard.manifest.digest
    lone = fb.seal(ram, JOB, 1, 6, part(1, 6, 0))
    b.upload_shard(lone, R3, nodes=2)  # a round without rank 0's part of step 6
    tier = bucket_tier(server)

    async def main() -> None:
        async def digest(step: int = 5, **kw: object) -> str | None:
            m = await tier.part_manifest(JOB, 1, step, **kw)  # type: ignore[arg-type]
            return m.digest if m is not None else None

        assert await digest() == other[R2]  # nothing known: the newest round
        assert await digest(beside=(0, own[R1])) == other[R1]  # R2 is another save
        assert await digest(beside=(0, own[R2])) == other[R2]
        assert await digest(beside=(0, "0" * 64)) is None  # no round of this save
        assert await digest(beside=(1, other[R1])) == other[R2]  # its own rank: ignored
        assert await digest(6, beside=(0, "0" * 64)) == lone.manifest.digest

    trio.run(main)


def test_the_status_names_the_ranks_a_shrunk_jobs_round_lacks(tmp_path, monkeypatch):
    """#16 fourth trial F4: after a 4-node step 20 was restored by a 2-node job, its
    round (ranks 0 and 1 only) was "complete" in `tierfs status` while `tierfs backups
    list` said incomplete (no pointer for ranks 2, 3)."""
    import dataclasses

    from tierfs.core.control import JobSpec
    from tierfs.core.types import RoundView

    tier = bucket_tier(fb.FakeGcs())
    tier.current.job = JobSpec(JOB, "generic", 0, 2)  # type: ignore[attr-defined]
    monkeypatch.setattr(tier.roles, "multi", lambda job: True)
    shard = fb.seal(RamStore(str(tmp_path / "r")), JOB, 0, 20, part(0, 20))
    tier.catalog.add(
        dataclasses.replace(shard, manifest=dataclasses.replace(shard.manifest, nodes=4))
    )
    tier.memory.cluster_last = RoundView(R1, 20, "complete")
    assert (
        f"last round {R1} step 20: complete for this job's 2 node(s), without rank(s) "
        "2..3 of the 4-node step" in tier.status().summary
    )
    tier.memory.cluster_last = RoundView(R1, 20, "incomplete")
    assert f"last round {R1} step 20: incomplete;" in tier.status().summary + ";"


# ---------------------------------------------------------------------- batches (goal 2)


class Into:
    """A :class:`tierfs.core.ports.FileTarget` ``write`` into a fresh file each."""

    def __init__(self, tmp_path: Path, path: str) -> None:
        self.fd = target(tmp_path, path.replace("/", "_"))

    def __call__(self, data: bytes, offset: int, crc32c: int | None = None) -> None:
        os.pwrite(self.fd, data, offset)


def targets(tmp_path: Path, paths: list[str], wrong: str = "") -> dict[str, FileTarget]:
    """FileTargets of ``paths`` by :data:`FILES` (``wrong``: that one's crc32c is not
    the holder's, as after a re-save the caller has not seen)."""
    out = {}
    for p in paths:
        crc = google_crc32c.value(FILES[p]) ^ (1 if p == wrong else 0)
        out[p] = FileTarget(p, len(FILES[p]), crc, Into(tmp_path, p))
    return out


def test_pull_files_brings_several_files_in_one_call_each_landed_as_it_ends(served, tmp_path):
    at, host = served(PeerServicer)
    client = PeerClient(TOKEN, WireStats())
    key, digest = host.shard.key, host.shard.manifest.digest
    want = targets(tmp_path, [SMALL, BIG, "7/meta.json"])
    landed: list[tuple[str, int]] = []

    def on_landed(path: str) -> None:  # every byte of it is written when it lands
        landed.append((path, os.fstat(want[path].write.fd).st_size))  # type: ignore[attr-defined]

    try:
        got = client.pull_files(at, key, digest, list(want.values()), threading.Event(), on_landed)
        assert got == set(want)
        # in the holder's manifest order, one call
        assert landed == [("7/meta.json", 11), (BIG, len(FILES[BIG])), (SMALL, 20)]
        for p, t in want.items():
            assert contents(t.write.fd) == FILES[p]  # type: ignore[attr-defined]
        assert host.stats.snapshot()["pulls_served"] == 1
        assert host.stats.snapshot()["served_bytes"] == sum(len(d) for d in FILES.values())
        # a file whose bytes are not the caller's is not written; the others are
        (tmp_path / "again").mkdir()
        other = targets(tmp_path / "again", [SMALL, "7/meta.json"], wrong=SMALL)
        landed.clear()
        got = client.pull_files(
            at, key, "", list(other.values()), threading.Event(), lambda p: landed.append((p, 0))
        )
        assert got == {"7/meta.json"} and landed == [("7/meta.json", 0)]
        assert os.fstat(other[SMALL].write.fd).st_size == 0  # type: ignore[attr-defined]
        # another digest than the holder's: refused before any byte
        with pytest.raises(grpc.RpcError) as err:
            client.pull_files(at, key, "0badd1e5-10", list(want.values()), threading.Event(), print)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        for t in want.values():
            os.close(t.write.fd)  # type: ignore[attr-defined]
        client.close()


def test_a_batch_whose_copy_breaks_midway_keeps_what_landed_and_asks_the_next_copy(net, tmp_path):
    async def test(nodes: list[Node], shard: Shard) -> None:
        want = targets(tmp_path, [SMALL, BIG, "7/meta.json"])
        by: dict[str, str] = {}
        try:
            # the second chunk of node 3's stream (the big file's first) flipped: the
            # first file landed from node 3, the rest come from node 2
            net.corrupt("PullShard", callee=address(3), chunk=1, at=5)
            await nodes[0].tier.fetch_files(
                JOB,
                3,
                STEP,
                shard.manifest.digest,
                list(want.values()),
                lambda p, label: by.__setitem__(p, label),
            )
            assert by == {"7/meta.json": label(3), BIG: label(2), SMALL: label(2)}
            for p, t in want.items():
                assert contents(t.write.fd) == FILES[p]  # type: ignore[attr-defined]
        finally:
            for t in want.values():
                os.close(t.write.fd)  # type: ignore[attr-defined]
        assert pulls(net) == [(address(3), "corrupt"), (address(2), "ok")]
        # said once, as a single file's fetch says it (review of 2569809: only logged)
        said = [e for e in nodes[0].job.errors if "a nearer copy is damaged" in e]
        assert len(said) == 1 and f"read from {label(2)}" in said[0], nodes[0].job.errors
        assert "2 of rank 3's files" in said[0] and f"{label(3)}: bad copy" in said[0]
        # no copy reachable: nothing lands, nothing is raised (each file's own fetch
        # then tries every tier and reports)
        for r in (3, 2, 1):
            net.down(address(r))
        (tmp_path / "down").mkdir()
        again = targets(tmp_path / "down", [SMALL])
        by.clear()
        try:
            await nodes[0].tier.fetch_files(
                JOB, 3, STEP, "", list(again.values()), lambda p, lb: by.__setitem__(p, lb)
            )
        finally:
            os.close(again[SMALL].write.fd)  # type: ignore[attr-defined]
        assert by == {}

    cluster(net, tmp_path, test)


def test_a_nearer_copy_that_kept_the_read_waiting_is_said_once_another_served(monkeypatch):
    """Regression (#14 trial 49 F6): with the node holding rank 1's part stopped
    (SIGSTOP), reads of its files waited 77 s for its call to give up, then node 0's
    replica served, and nothing in replicator.errors said why the read waited. A copy
    that fails fast (a node known down, NOT_FOUND) stays unsaid, as before."""
    from tierfs.replication import files as files_mod

    class Lines:
        def __init__(self) -> None:
            self.lines: list[str] = []

        def error(self, line: str) -> None:
            self.lines.append(line)

    def run(first_takes: float) -> list[str]:
        lines = Lines()
        pf = files_mod.PeerFiles(None, None, None, None, None, lines)  # type: ignore[arg-type]

        async def copies(job, rank, writers=0):
            return [(1, "10.0.0.2:7000"), (0, "10.0.0.1:7000")]

        async def pull(address, key, digest, path, fd, expect, write):
            if address.startswith("10.0.0.2"):
                await trio.sleep(first_takes)
                return "UNAVAILABLE: Stream removed (ping timeout)", grpc.StatusCode.UNAVAILABLE
            return None

        monkeypatch.setattr(pf, "_file_copies", copies)
        monkeypatch.setattr(pf, "_pull_file", pull)

        async def main() -> str:
            return await pf.fetch_file("job", 1, 30, "d", "30/r1.bin", -1)

        label = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
        assert label == "peer node-rank 0 (10.0.0.1:7000)"
        return lines.lines

    assert run(77.5) == [
        "step 30: rank 1's 30/r1.bin was read from peer node-rank 0 (10.0.0.1:7000); a "
        "nearer copy kept the read waiting: peer node-rank 1 (10.0.0.2:7000): "
        "UNAVAILABLE: Stream removed (ping timeout) (after 78 s)"
    ]
    assert run(0.2) == []
