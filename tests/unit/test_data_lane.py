"""The data lane (tierfs/replication/lane.py): file pulls whose bytes come over a TCP
stream beside gRPC, with every check of the gRPC path (issue #18 item 2, #14 goal 2).

A real :class:`AioServer` with the peer service and a real :class:`LaneServer` on
loopback; the puller is the real :class:`PeerClient`.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from pathlib import Path

import grpc
import pytest
from gcs_fixtures import make_shard

from tierfs.core.ports import FileTarget
from tierfs.replication import lane as lane_mod
from tierfs.replication.client import PeerClient
from tierfs.replication.lane import LaneServer, LaneStream
from tierfs.replication.service import PeerServicer, peer_handlers
from tierfs.replication.transfer import BadCopy
from tierfs.rpc import wire as peer_wire
from tierfs.rpc.aio_server import AioServer, with_sync_context
from tierfs.rpc.wire import WireStats
from tierfs.store.chunks import CHUNK
from tierfs.store.shards import Shard, ShardKey

JOB, TOKEN, STEP, RANK = "job", "secret", 7, 3
BIG = bytes(range(256)) * ((2 * CHUNK + 12345) // 256 + 1)  # three chunks, the last short
# larger than the sender's and receiver's socket buffers together (tcp_wmem, tcp_rmem)
HUGE_SIZE = 128 * 1024 * 1024
FILES = {
    "7/big.bin": BIG,
    "7/empty": b"",
    **{f"7/small/f{i:02d}": bytes([i]) * (1000 + i) for i in range(20)},
}
KEY = ShardKey(JOB, RANK, STEP)


class Host:
    """The PeerHost the servicer asks (pins and damage reports recorded)."""

    incarnation = "inc"

    def __init__(self, shard: Shard) -> None:
        self.shard = shard
        self.stats = WireStats()
        self.pins: list[int] = []
        self.damages: list[tuple[ShardKey, str]] = []
        self.lock = threading.Lock()

    def find(self, key: ShardKey) -> Shard | None:
        return self.shard if key == self.shard.key else None

    def pin(self, key: ShardKey, delta: int) -> None:
        with self.lock:
            self.pins.append(delta)

    def known_manifest(self, key: ShardKey) -> None:
        return None

    def resaving(self, key: ShardKey) -> bool:
        return False

    def damaged(self, key: ShardKey, path: str) -> None:
        with self.lock:
            self.damages.append((key, path))

    def pinned(self) -> int:
        with self.lock:
            return sum(self.pins)


class Holder:
    def __init__(self, tmp_path, lane: LaneServer | None, files: dict[str, bytes] = FILES) -> None:
        self.shard = make_shard(tmp_path / "holder", JOB, RANK, STEP, dict(files))
        self.host = Host(self.shard)
        self.lane = lane
        handlers = with_sync_context(peer_handlers(PeerServicer(self.host, lane)))  # type: ignore[arg-type]
        self.server = AioServer(
            lambda srv, loop: srv.add_generic_rpc_handlers((handlers,)),
            interceptors=[peer_wire.AioTokenInterceptor(TOKEN)],
            options=peer_wire.SERVER_OPTIONS,
            workers=4,
        )
        self.address = f"127.0.0.1:{self.server.start('127.0.0.1:0')}"

    def entry(self, path: str):
        return next(f for f in self.shard.manifest.files if f.path == path)

    def stop(self) -> None:
        self.server.stop(0)
        if self.lane is not None:
            self.lane.stop()


@pytest.fixture
def holder(tmp_path):
    lane = LaneServer("127.0.0.1")
    lane.start()
    h = Holder(tmp_path, lane)
    yield h
    h.stop()


def wait_for(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def pull_one(client: PeerClient, h: Holder, path: str, dest) -> int:
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        e = h.entry(path)
        return client.pull_file(
            h.address, KEY, "", path, fd, threading.Event(), expect=(e.size, e.crc32c)
        )
    finally:
        os.close(fd)


def target(path: str, size: int, crc32c: int, fd: int) -> FileTarget:
    def write(data: bytes, offset: int, crc: int | None = None) -> None:
        os.pwrite(fd, data, offset)

    return FileTarget(path, size, crc32c, write)


def test_a_file_pull_comes_over_the_lane_with_its_bytes_checked(holder, tmp_path):
    client = PeerClient(TOKEN, WireStats())
    try:
        n = pull_one(client, holder, "7/big.bin", tmp_path / "big")
    finally:
        client.close()
    assert n == len(BIG) and (tmp_path / "big").read_bytes() == BIG
    assert client.stats.snapshot()["lane_pulls"] == 1
    wait_for(lambda: holder.lane.served == 1)
    assert holder.lane.sent_bytes == len(BIG)
    wait_for(lambda: holder.host.stats.snapshot()["lane_served"] == 1)
    assert holder.host.stats.snapshot()["lane_served_bytes"] == len(BIG)
    wait_for(lambda: holder.host.pinned() == 0)
    assert holder.host.pins == [1, -1] and holder.host.damages == []
    assert holder.lane.outstanding() == 0


def test_a_batch_over_the_lane_lands_every_file_the_empty_one_too(holder, tmp_path):
    client = PeerClient(TOKEN, WireStats())
    targets, landed, fds = [], [], []
    for path in sorted(FILES):
        e = holder.entry(path)
        fds.append(os.open(tmp_path / path.replace("/", "_"), os.O_WRONLY | os.O_CREAT, 0o600))
        targets.append(target(path, e.size, e.crc32c, fds[-1]))
    try:
        done = client.pull_files(holder.address, KEY, "", targets, threading.Event(), landed.append)
    finally:
        client.close()
        for fd in fds:
            os.close(fd)
    assert done == set(FILES) and sorted(landed) == sorted(FILES)
    for path, data in FILES.items():
        assert (tmp_path / path.replace("/", "_")).read_bytes() == data
    wait_for(lambda: holder.lane.served == 1)
    wait_for(lambda: holder.host.pinned() == 0)


def test_a_damaged_byte_is_refused_and_the_holder_told(holder, tmp_path):
    """The holder sends the manifest's chunk crc32c and sendfile's bytes: a byte
    flipped in its copy after the seal fails the puller's check, which reports
    it; the holder checks its copy (PeerHost.damaged), as on the gRPC path."""
    f = os.path.join(holder.shard.data, "7/big.bin")
    with open(f, "r+b") as fh:
        fh.seek(CHUNK + 7)
        b = fh.read(1)
        fh.seek(CHUNK + 7)
        fh.write(bytes([b[0] ^ 0x40]))
    client = PeerClient(TOKEN, WireStats())
    try:
        with pytest.raises(BadCopy, match="crc32c mismatch"):
            pull_one(client, holder, "7/big.bin", tmp_path / "big")
    finally:
        client.close()
    wait_for(lambda: holder.host.damages == [(KEY, "7/big.bin")])
    wait_for(lambda: holder.host.pinned() == 0)


def test_a_lane_that_cannot_be_reached_falls_back_to_grpc_once(holder, tmp_path, caplog):
    with socket.socket() as s:  # offered on a port where nothing listens: refused
        s.bind(("127.0.0.1", 0))
        holder.lane.port = s.getsockname()[1]
    client = PeerClient(TOKEN, WireStats())
    try:
        with caplog.at_level("WARNING", logger="tierfs.replication.client"):
            assert pull_one(client, holder, "7/small/f03", tmp_path / "a") == 1003
            assert pull_one(client, holder, "7/small/f04", tmp_path / "b") == 1004
    finally:
        client.close()
    assert (tmp_path / "a").read_bytes() == FILES["7/small/f03"]
    assert (tmp_path / "b").read_bytes() == FILES["7/small/f04"]
    said = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(said) == 1 and "pulling over gRPC" in said[0].getMessage()
    assert holder.lane.served == 0
    holder.lane.stop()  # the one unused ticket is released
    wait_for(lambda: holder.host.pinned() == 0)


def test_an_unused_ticket_expires_and_unpins(holder, tmp_path, monkeypatch):
    monkeypatch.setattr(lane_mod, "TICKET_TTL", 0.2)
    grant = lane_mod.Grant(holder.shard.data, [], [], lambda d, s: released.append((d, s)))
    released: list[tuple[str, int]] = []
    assert holder.lane.offer(grant) is not None
    assert holder.lane.outstanding() == 1
    wait_for(lambda: released == [("", 0)])  # the accept loop's sweep, about a second
    assert holder.lane.outstanding() == 0


def test_a_wrong_ticket_gets_nothing(holder):
    released: list[tuple[str, int]] = []
    grant = lane_mod.Grant(
        holder.shard.data, [holder.entry("7/big.bin")], [None], lambda d, s: released.append(1)
    )
    ticket = holder.lane.offer(grant)
    assert ticket is not None
    with socket.create_connection(("127.0.0.1", holder.lane.port), timeout=10) as s:
        s.sendall(lane_mod.MAGIC + bytes(a ^ 1 for a in ticket))
        assert s.recv(100) == b""  # closed, nothing sent
    assert released == [] and holder.lane.outstanding() == 1
    stream = LaneStream("127.0.0.1:1", holder.lane.port, ticket, ["x"])
    got = list(stream)  # the right ticket still works, once
    stream.cancel()
    assert b"".join(c.data for c in got) == BIG and {c.path for c in got} == {"x"}
    wait_for(lambda: released == [1])


@pytest.fixture
def huge_holder(tmp_path):
    lane = LaneServer("127.0.0.1")
    lane.start()
    h = Holder(tmp_path, lane, {**FILES, "7/huge.bin": bytes(range(256)) * (HUGE_SIZE // 256)})
    yield h
    h.stop()


def test_a_puller_that_goes_away_mid_stream_unpins(huge_holder):
    """Regression (CI of 01a99f8): with the 8 MiB file the kernel's loopback socket
    buffers (tcp_rmem up to 32 MiB here) took the whole stream before the cancel, so
    "released mid-stream" did not hold; the file is now larger than any buffers."""
    holder = huge_holder
    e = holder.entry("7/huge.bin")
    grant_released: list[int] = []
    real_grant = holder.lane.offer
    offered = []

    def offer(grant):
        inner = grant.release

        def release(d: str, s: int) -> None:
            inner(d, s)
            grant_released.append(s)

        grant.release = release
        ticket = real_grant(grant)
        offered.append(ticket)
        return ticket

    holder.lane.offer = offer  # type: ignore[method-assign]
    client = PeerClient(TOKEN, WireStats())
    call, entries = client._pull_paths(holder.address, KEY, "", ["7/huge.bin"], 30)
    assert isinstance(call, LaneStream) and entries["7/huge.bin"].size == e.size
    first = next(iter(call))
    assert first.offset == 0 and len(first.data) == CHUNK
    call.cancel()
    client.close()
    wait_for(lambda: len(grant_released) == 1)
    assert grant_released[0] < HUGE_SIZE
    wait_for(lambda: holder.host.pinned() == 0)
    assert holder.host.damages == []


def test_a_busy_lane_serves_over_grpc(tmp_path):
    lane = LaneServer("127.0.0.1", streams=1)
    lane.start()
    h = Holder(tmp_path, lane)
    try:
        held = lane.offer(lane_mod.Grant(h.shard.data, [], [], lambda d, s: None))
        assert held is not None
        client = PeerClient(TOKEN, WireStats())
        try:
            assert pull_one(client, h, "7/big.bin", tmp_path / "big") == len(BIG)
        finally:
            client.close()
        assert (tmp_path / "big").read_bytes() == BIG and lane.served == 0
        wait_for(lambda: h.host.pinned() == 0)
    finally:
        h.stop()


def test_a_puller_with_the_lane_off_asks_for_none(holder, tmp_path):
    client = PeerClient(TOKEN, WireStats(), lane=False)
    try:
        assert pull_one(client, holder, "7/big.bin", tmp_path / "big") == len(BIG)
    finally:
        client.close()
    assert (tmp_path / "big").read_bytes() == BIG and holder.lane.served == 0


def test_a_whole_part_pull_over_the_lane_commits_the_same_part(holder, tmp_path):
    """A restore's pull of a whole part (no ``paths``) takes the lane too; the part
    committed on the puller has the holder's manifest and bytes."""
    from tierfs.store.ramstore import RamStore
    from tierfs.store.shards import ShardStore

    ram = RamStore(str(tmp_path / "puller"))
    shards = ShardStore(ram)
    client = PeerClient(TOKEN, WireStats())
    try:
        got = client.pull(
            holder.address, KEY, holder.shard.manifest.digest, 0, ram, shards, threading.Event()
        )
    finally:
        client.close()
    assert got.manifest.digest == holder.shard.manifest.digest
    for path, data in FILES.items():
        assert Path(got.data, path).read_bytes() == data
    wait_for(lambda: holder.lane.served == 1)
    assert holder.lane.sent_bytes == sum(len(d) for d in FILES.values())
    wait_for(lambda: holder.host.pinned() == 0)


def test_a_whole_part_pull_of_a_damaged_copy_commits_nothing(holder, tmp_path):
    from tierfs.store.ramstore import RamStore
    from tierfs.store.shards import ShardStore

    f = Path(holder.shard.data, "7/small/f05")
    f.write_bytes(b"\x00" + f.read_bytes()[1:])  # same size, other bytes
    ram = RamStore(str(tmp_path / "puller"))
    shards = ShardStore(ram)
    client = PeerClient(TOKEN, WireStats())
    try:
        with pytest.raises(BadCopy):
            client.pull(holder.address, KEY, "", 0, ram, shards, threading.Event())
    finally:
        client.close()
    assert not os.path.exists(shards.path_of(KEY))
    assert os.listdir(ram.incoming) == []
    wait_for(lambda: holder.host.damages == [(KEY, "7/small/f05")])
    wait_for(lambda: holder.host.pinned() == 0)


# ---------------------------------------------------------------------- Replicate


class ReceiverHost(Host):
    """A node taking replicas: a real RAM store and shard store, adoptions recorded."""

    def __init__(self, root: Path) -> None:
        from tierfs.store.ramstore import RamStore
        from tierfs.store.shards import ShardStore

        self.ram = RamStore(str(root))
        self.shards = ShardStore(self.ram)
        self.adopted: list[Shard] = []
        self.space_asked: list[int] = []
        super().__init__(None)  # type: ignore[arg-type]

    def find(self, key: ShardKey) -> Shard | None:
        return next((s for s in self.adopted if s.key == key), None)

    def own_rank(self, job: str) -> int:
        return 0

    def check_space(self, nbytes: int) -> None:
        self.space_asked.append(nbytes)

    def adopt(self, shard: Shard, linked_from: ShardKey | None = None) -> None:
        self.adopted.append(shard)


@pytest.fixture
def receiver(tmp_path):
    host = ReceiverHost(tmp_path / "receiver")
    puller = PeerClient(TOKEN, WireStats())
    handlers = with_sync_context(peer_handlers(PeerServicer(host, None, puller)))  # type: ignore[arg-type]
    server = AioServer(
        lambda srv, loop: srv.add_generic_rpc_handlers((handlers,)),
        interceptors=[peer_wire.AioTokenInterceptor(TOKEN)],
        options=peer_wire.SERVER_OPTIONS,
        workers=4,
    )
    port = server.start("127.0.0.1:0")
    yield f"127.0.0.1:{port}", host
    server.stop(0)
    puller.close()


def test_a_replica_is_handed_over_by_its_receiver_pulling_it_over_the_lane(holder, receiver):
    """#18 item 2: with a data lane, the sender's push is one Replicate call and the
    receiver pulls the bytes over the sender's lane, checks them, commits them."""
    address, host = receiver
    sender = PeerClient(TOKEN, WireStats())
    sender.pull_from = holder.address
    try:
        reply = sender.push(address, holder.shard, RANK, False, threading.Event())
    finally:
        sender.close()
    assert reply.committed and reply.bytes_received == sum(len(d) for d in FILES.values())
    [got] = host.adopted
    assert got.key == KEY and got.manifest.digest == holder.shard.manifest.digest
    for path, data in FILES.items():
        assert Path(got.data, path).read_bytes() == data
    assert host.space_asked == [reply.bytes_received]
    wait_for(lambda: holder.lane.served == 1)
    wait_for(lambda: holder.host.pinned() == 0)
    assert sender.stats.snapshot()["sent_bytes"] == reply.bytes_received


def test_a_replica_with_a_damaged_byte_is_refused_with_data_loss(holder, receiver):
    address, host = receiver
    f = Path(holder.shard.data, "7/small/f07")
    f.write_bytes(b"\xff" + f.read_bytes()[1:])
    sender = PeerClient(TOKEN, WireStats())
    sender.pull_from = holder.address
    try:
        with pytest.raises(grpc.RpcError) as err:
            sender.push(address, holder.shard, RANK, False, threading.Event())
    finally:
        sender.close()
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert "7/small/f07" in err.value.details() and host.adopted == []
    assert os.listdir(host.ram.incoming) == []
    wait_for(lambda: holder.host.damages == [(KEY, "7/small/f07")])


def test_a_receiver_without_replicate_gets_a_push(holder, tmp_path):
    """An older receiver (or one without a lane) answers UNIMPLEMENTED: the sender
    pushes with PushShard, and remembers it."""
    host = ReceiverHost(tmp_path / "old")
    handlers = with_sync_context(peer_handlers(PeerServicer(host)))  # type: ignore[arg-type]
    server = AioServer(
        lambda srv, loop: srv.add_generic_rpc_handlers((handlers,)),
        interceptors=[peer_wire.AioTokenInterceptor(TOKEN)],
        options=peer_wire.SERVER_OPTIONS,
        workers=4,
    )
    address = f"127.0.0.1:{server.start('127.0.0.1:0')}"
    sender = PeerClient(TOKEN, WireStats())
    sender.pull_from = holder.address
    try:
        assert sender.push(address, holder.shard, RANK, False, threading.Event()).committed
        assert address in sender._push_only
    finally:
        sender.close()
        server.stop(0)
    [got] = host.adopted
    assert Path(got.data, "7/big.bin").read_bytes() == BIG and holder.lane.served == 0


def test_a_file_shorter_than_its_manifest_ends_the_stream_with_the_reason(holder, tmp_path):
    """The holder's copy lost bytes after the seal (truncated): sendfile sends fewer
    than the frame promised, so the holder fills the frame and ends the stream
    with an error frame; the puller's check refuses the chunk (BadCopy, the next
    copy is tried); the holder has its copy checked; nothing stays pinned."""
    os.truncate(Path(holder.shard.data, "7/big.bin"), CHUNK + 10)
    client = PeerClient(TOKEN, WireStats())
    try:
        with pytest.raises(BadCopy, match=r"chunk 1 \(offset 4194304\): chunk crc32c mismatch"):
            pull_one(client, holder, "7/big.bin", tmp_path / "big")
    finally:
        client.close()
    wait_for(lambda: holder.host.damages == [(KEY, "7/big.bin")])
    wait_for(lambda: holder.host.pinned() == 0)
    assert holder.lane.outstanding() == 0


def test_a_vanished_file_is_named_in_the_error_frame(holder, tmp_path):
    from tierfs.replication.lane import LaneFailed

    os.unlink(Path(holder.shard.data, "7/small/f02"))
    client = PeerClient(TOKEN, WireStats())
    try:
        with pytest.raises(LaneFailed, match="7/small/f02 vanished here"):
            pull_one(client, holder, "7/small/f02", tmp_path / "x")
    finally:
        client.close()
    wait_for(lambda: holder.host.damages == [(KEY, "7/small/f02")])
    wait_for(lambda: holder.host.pinned() == 0)


def test_a_stall_mid_frame_fails_within_the_timeout_not_twice_it():
    """Trial 46: part of a chunk arrived, then the holder stalled; the puller noticed
    only after twice its receive timeout (the partial recv, then a full one more)."""
    from tierfs.replication.lane import LaneFailed, _recv_exact

    a, b = socket.socketpair()
    with a, b:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 2, 0))
        b.sendall(b"x" * 1000)  # part of a 4 MiB chunk, then nothing
        t = time.monotonic()
        with pytest.raises(LaneFailed, match="stalled for 2 s mid-frame"):
            _recv_exact(a, 4 << 20)
        took = time.monotonic() - t
        assert took < 3.5, took  # one timeout (it was two, 4 s, before)
        # the socket's timeout is the whole one again for the next frame
        sec, _ = struct.unpack("ll", a.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16))
        assert sec == 2


def test_a_receiver_that_cannot_reach_the_sender_gets_a_push(holder, receiver):
    """A one-way network (the receiver cannot reach the sender's address): Replicate
    fails UNAVAILABLE; the sender pushes the replica instead, and keeps pushing to
    that receiver for a while."""
    address, host = receiver
    sender = PeerClient(TOKEN, WireStats())
    with socket.socket() as s:  # an address where nothing listens
        s.bind(("127.0.0.1", 0))
        sender.pull_from = f"127.0.0.1:{s.getsockname()[1]}"
    try:
        assert sender.push(address, holder.shard, RANK, False, threading.Event()).committed
        assert address in sender._push_only  # for LANE_RETRY seconds
        assert not sender._pulls_from_here(address)
    finally:
        sender.close()
    [got] = host.adopted
    assert Path(got.data, "7/big.bin").read_bytes() == BIG


def test_a_lane_flooded_with_idle_connections_serves_over_grpc(tmp_path, monkeypatch, caplog):
    """Trial 46: idle connections without a ticket filled the lane's handshake slots;
    the real puller's connection was closed at once, which it took for a broken
    stream (the pull failed, and replication from that node for as long as the
    flood lasted). A lane that sends no first frame is now taken as unreachable:
    the bytes come over gRPC."""
    monkeypatch.setattr(lane_mod, "HANDSHAKES", 2)
    # the idle connections keep their slots for the whole test, however slow the machine
    monkeypatch.setattr(lane_mod, "HANDSHAKE_TIMEOUT", 120.0)
    lane = LaneServer("127.0.0.1")
    lane.start()
    h = Holder(tmp_path, lane)
    idle = [socket.create_connection(("127.0.0.1", lane.port)) for _ in range(2)]
    client = PeerClient(TOKEN, WireStats())
    try:
        wait_for(lambda: lane._handshakes._value == 0)  # both slots taken
        with caplog.at_level("WARNING", logger="tierfs.replication.client"):
            assert pull_one(client, h, "7/big.bin", tmp_path / "big") == len(BIG)
        assert (tmp_path / "big").read_bytes() == BIG and lane.served == 0
        assert any("served nothing" in r.getMessage() for r in caplog.records)
    finally:
        client.close()
        for s in idle:
            s.close()
        h.stop()
