"""The peer plane's wire: proto paths, token, receiver safety (no mounts unless marked)."""

from __future__ import annotations

import json
import os
import time

import google_crc32c
import grpc
import pytest
from conftest import tierfs
from peer_cluster import Cluster, free_port, wait_until

from tierfs.replication.transfer import BadCopy, Refused, ShardReceiver, iter_chunks
from tierfs.rpc import peer_pb2 as pb2
from tierfs.rpc import peer_pb2_grpc as pb2_grpc
from tierfs.rpc import wire as peer_wire
from tierfs.store.manifest import FileEntry, Manifest, scan_tree


def test_method_paths_are_pinned():
    assert peer_wire.METHOD_PATHS == (
        "/tierfs.peer.v1.Peer/Inventory",
        "/tierfs.peer.v1.Peer/PushShard",
        "/tierfs.peer.v1.Peer/PullShard",
        "/tierfs.peer.v1.Peer/Replicate",
        "/tierfs.peer.v1.Coordinator/Join",
        "/tierfs.peer.v1.Coordinator/Decide",
        "/tierfs.peer.v1.Coordinator/Barrier",
        "/tierfs.peer.v1.Coordinator/Sync",
        "/tierfs.peer.v1.Coordinator/Gone",
        "/tierfs.peer.v1.Coordinator/SyncBatch",
        "/tierfs.peer.v1.Coordinator/DecideBatch",
        "/tierfs.peer.v1.Coordinator/BarrierBatch",
        "/tierfs.peer.v1.SyncRelay/Relay",
        "/tierfs.peer.v1.SyncRelay/RelayDecide",
        "/tierfs.peer.v1.SyncRelay/RelayBarrier",
        "/tierfs.peer.v1.SyncRelay/Nudge",
    )
    # ... and they are the generated module's (tierfs/rpc/peer.proto, package tierfs.peer.v1)
    assert pb2.DESCRIPTOR.package == "tierfs.peer.v1"
    assert (
        tuple(
            f"/{s.full_name}/{m.name}"
            for s in pb2.DESCRIPTOR.services_by_name.values()
            for m in s.methods
        )
        == peer_wire.METHOD_PATHS
    )
    assert hasattr(pb2_grpc, "PeerStub") and hasattr(pb2_grpc, "CoordinatorStub")


def test_same_endpoint():
    assert peer_wire.same_endpoint("localhost:7000", "127.0.0.1:7000")
    assert not peer_wire.same_endpoint("127.0.0.1:7000", "127.0.0.1:7001")
    assert not peer_wire.same_endpoint(None, "127.0.0.1:7001")


# ---------------------------------------------------------------------- receiver


def make_shard(tmp_path, files: dict[str, bytes], links: dict[str, str] | None = None):
    root = tmp_path / "src"
    for path, data in files.items():
        p = root / path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    for path, target in (links or {}).items():
        os.symlink(target, root / path)
    entries = sorted({p.split("/")[0] for p in [*files, *(links or {})]})
    m = Manifest(
        job="j",
        rank=1,
        step=5,
        name="5",
        framework="orbax",
        files=tuple(scan_tree(str(root), entries)),
    )
    return str(root), m


def receive(tmp_path, root, m, manifest_first=False):
    inc = tmp_path / "inc"
    rx = ShardReceiver(str(inc), m if manifest_first else None)
    for path, off, data, crc in iter_chunks(root, m.files, chunk=1000):
        rx.chunk(path, off, data, crc)
    rx.finish(m)
    return inc / "data"


@pytest.mark.parametrize("manifest_first", [False, True])
def test_receiver_round_trip(tmp_path, manifest_first):
    root, m = make_shard(
        tmp_path,
        {"5/a/b.bin": os.urandom(5000), "5/empty": b"", "5/c": b"x" * 3},
        {"5/a/link": "b.bin"},
    )
    data = receive(tmp_path, root, m, manifest_first)
    assert (data / "5/a/b.bin").read_bytes() == (tmp_path / "src/5/a/b.bin").read_bytes()
    assert (data / "5/empty").read_bytes() == b""
    assert os.readlink(data / "5/a/link") == "b.bin"


def test_corrupt_chunk_is_caught(tmp_path):
    rx = ShardReceiver(str(tmp_path / "inc"))
    data = b"hello world"
    with pytest.raises(BadCopy, match="chunk crc32c"):
        rx.chunk("5/x", 0, data, google_crc32c.value(data) ^ 1)


def test_corrupt_file_is_caught_at_the_end(tmp_path):
    root, m = make_shard(tmp_path, {"5/x": b"a" * 4000})
    with open(os.path.join(root, "5/x"), "r+b") as f:  # flipped after the manifest was made
        f.seek(10)
        f.write(b"b")
    with pytest.raises(BadCopy, match="crc32c"):
        receive(tmp_path, root, m)


def test_truncated_file_is_caught(tmp_path):
    root, m = make_shard(tmp_path, {"5/x": b"a" * 4000})
    os.truncate(os.path.join(root, "5/x"), 3000)
    with pytest.raises(BadCopy, match="size 3000 != 4000"):
        receive(tmp_path, root, m)


@pytest.mark.parametrize("path", ["../escape", "/etc/passwd", "5/../../x", "5//x", "5/./x"])
def test_unsafe_chunk_paths_are_refused(tmp_path, path):
    rx = ShardReceiver(str(tmp_path / "inc"))
    with pytest.raises(Refused):
        rx.chunk(path, 0, b"x", google_crc32c.value(b"x"))
    assert not (tmp_path / "escape").exists()


def test_files_not_in_the_manifest_are_refused(tmp_path):
    _root, m = make_shard(tmp_path, {"5/x": b"abc"})
    rx = ShardReceiver(str(tmp_path / "inc"), m)
    with pytest.raises(Refused, match="not a file of the manifest"):
        rx.chunk("5/y", 0, b"abc", google_crc32c.value(b"abc"))
    rx = ShardReceiver(str(tmp_path / "inc2"))
    rx.chunk("5/y", 0, b"abc", google_crc32c.value(b"abc"))
    with pytest.raises(Refused, match="not a file of the manifest"):
        rx.finish(m)


@pytest.mark.parametrize("target", ["../../outside", "/etc", "a/../../../x"])
def test_escaping_symlinks_are_refused(tmp_path, target):
    m = Manifest(
        job="j",
        rank=1,
        step=5,
        name="5",
        framework="orbax",
        files=(
            FileEntry("5", "dir", mode=0o755),
            FileEntry("5/l", "symlink", mode=0o777, target=target),
        ),
    )
    with pytest.raises(Refused, match="escapes"):
        ShardReceiver(str(tmp_path / "inc")).finish(m)


def test_symlink_over_a_received_directory_is_refused(tmp_path):
    """A chunk path through an entry the manifest declares as a symlink."""
    rx = ShardReceiver(str(tmp_path / "inc"))
    rx.chunk("5/l/x", 0, b"abc", google_crc32c.value(b"abc"))
    m = Manifest(
        job="j",
        rank=1,
        step=5,
        name="5",
        framework="orbax",
        files=(
            FileEntry("5", "dir", mode=0o755),
            FileEntry("5/l", "symlink", mode=0o777, target="."),
            FileEntry("5/l/x", "file", size=3, crc32c=google_crc32c.value(b"abc")),
        ),
    )
    with pytest.raises(Refused):
        rx.finish(m)


def test_out_of_order_chunks_are_refused(tmp_path):
    rx = ShardReceiver(str(tmp_path / "inc"))
    rx.chunk("5/x", 0, b"abc", google_crc32c.value(b"abc"))
    with pytest.raises(Refused, match="offset"):
        rx.chunk("5/x", 10, b"abc", google_crc32c.value(b"abc"))


# ---------------------------------------------------------------------- a live daemon


def test_token_is_required_on_every_call(make_mount):
    port = free_port()
    make_mount(
        "--listen",
        f"127.0.0.1:{port}",
        "--coordinator",
        f"127.0.0.1:{port}",
        "--peer-token",
        "secret",
    )
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        peer, coord = pb2_grpc.PeerStub(ch), pb2_grpc.CoordinatorStub(ch)
        calls = [
            lambda md: peer.Inventory(pb2.InventoryRequest(job="j"), metadata=md, timeout=5),
            lambda md: coord.Join(
                pb2.JoinRequest(job="j", nodes=2, rank=1), metadata=md, timeout=5
            ),
            lambda md: coord.Sync(pb2.SyncRequest(job="j"), metadata=md, timeout=5),
            lambda md: list(
                peer.PullShard(pb2.PullRequest(job="j", rank=1, step=1), metadata=md, timeout=5)
            ),
            lambda md: peer.PushShard(
                iter([pb2.PushMessage(header=pb2.PushHeader(job="j", rank=1, step=1))]),
                metadata=md,
                timeout=5,
            ),
        ]
        for call in calls:
            for md in [(), (("x-tierfs-token", "wrong"),)]:
                with pytest.raises(grpc.RpcError) as err:
                    call(md)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = peer.Inventory(
            pb2.InventoryRequest(job="j"), metadata=(("x-tierfs-token", "secret"),), timeout=5
        )
        assert list(reply.shards) == []
        # a push with an unsafe path is refused and leaves nothing behind
        bad = [
            pb2.PushMessage(header=pb2.PushHeader(job="j", rank=1, step=1, total_bytes=1)),
            pb2.PushMessage(
                chunk=pb2.FileChunk(
                    path="../x", offset=0, data=b"x", crc32c=google_crc32c.value(b"x")
                )
            ),
        ]
        with pytest.raises(grpc.RpcError) as err:
            peer.PushShard(iter(bad), metadata=(("x-tierfs-token", "secret"),), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        rejected = coord.Join(
            pb2.JoinRequest(job="j", nodes=2, rank=0, address="a:1", incarnation="i"),
            metadata=(("x-tierfs-token", "secret"),),
            timeout=5,
        )
        assert rejected.round == 0
        with pytest.raises(grpc.RpcError) as err:
            coord.Join(
                pb2.JoinRequest(job="j", nodes=2, rank=2, address="a:2", incarnation="k"),
                metadata=(("x-tierfs-token", "secret"),),
                timeout=5,
            )
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "out of range" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            coord.Join(
                pb2.JoinRequest(job="other", nodes=2, rank=1, address="a:2", incarnation="k"),
                metadata=(("x-tierfs-token", "secret"),),
                timeout=5,
            )
        assert "job-name mismatch" in err.value.details()


@pytest.mark.slow
def test_a_node_that_never_joins_times_out_visibly(make_mount):
    c = Cluster(make_mount, 1, join_timeout=4)
    root = c.root(0)
    (root / "replicator.yaml.tmp").write_text(
        "job-name: job\nframework: orbax\nnode-rank: 0\nnodes: 2\npeers-per-node: 1"
    )
    start = time.monotonic()
    os.replace(root / "replicator.yaml.tmp", root / "replicator.yaml")
    state = wait_until(
        lambda: c.status(0)["restore"].get("missing") == [1] and c.status(0)["restore"],
        10,
        "the waiting status",
    )
    assert state["phase"] == "waiting for node-rank(s) [1] to join"
    wait_until(lambda: (root / "replicator.failed").exists(), 20, "replicator.failed")
    assert time.monotonic() - start >= 4
    errors = (root / "replicator.errors").read_text()
    assert "node-rank(s) [1] did not join within 4 s" in errors
    assert c.status(0)["restore"]["state"] == "failed"
    assert not list(root.glob("*.restore"))


def test_status_shows_the_peer_plane(make_mount):
    port = free_port()
    m = make_mount(
        "--listen",
        f"127.0.0.1:{port}",
        "--coordinator",
        f"127.0.0.1:{port}",
        "--peer-token",
        "t",
        "--job",
        "j",
        "--nodes",
        "2",
        "--node-rank",
        "0",
        "--peers-per-node",
        "1",
        "--join-timeout",
        "30",
    )
    data = json.loads(tierfs("status", str(m.path), "--json").stdout)
    peer = data["tiers"]["peer"]
    assert peer["is_coordinator"] and peer["replicate_to"] == [1]
    assert peer["address"] == f"127.0.0.1:{port}"
    out = " ".join(tierfs("status", str(m.path)).stdout.split())  # rich wraps lines
    assert "peer" in out and "replicates to [1]" in out
    # generic mode, 2 nodes, node 1 absent: the daemon's own restore waits visibly
    wait_until(
        lambda: (
            json.loads(tierfs("status", str(m.path), "--json").stdout)["restore"].get("missing")
            == [1]
        ),
        10,
        "the waiting generic restore",
    )


@pytest.mark.parametrize(
    ("path", "offset", "data", "crc"),
    [
        ("a/b", 0, b"", 0),
        ("x", 5, b"\x00" * 300, 123456789),
        ("é/ü", 1 << 40, b"z" * 200_000, 0xFFFFFFFF),
    ],
)
def test_hand_encoded_chunks_are_the_proto_encoding(path, offset, data, crc):
    chunk = pb2.FileChunk(path=path, offset=offset, data=data, crc32c=crc)
    fast = peer_wire.encode_chunk(path, offset, data, crc)
    assert fast == pb2.PushMessage(chunk=chunk).SerializeToString()
    assert pb2.PullMessage.FromString(fast).chunk == chunk
    # and the receiver's hand decoder reads exactly what protobuf reads
    assert peer_wire.decode_chunk(fast) == peer_wire.Chunk(path, offset, data, crc)


def test_hand_decoder_agrees_with_protobuf_or_defers_to_it():
    """decode_chunk either returns what protobuf parses or None (protobuf parses it then)."""
    import random

    from google.protobuf.message import DecodeError

    rng = random.Random(4)
    messages = [
        pb2.PushMessage(chunk=pb2.FileChunk(path="p", offset=-3, data=b"ab", crc32c=7)),
        pb2.PushMessage(header=pb2.PushHeader(job="j", rank=1, step=2)),
        pb2.PushMessage(manifest=pb2.ShardManifest(json=b"{}")),
        pb2.PullMessage(chunk=pb2.FileChunk(path="q/r", data=b"\x12\x00" * 50)),
        pb2.PushMessage(chunk=pb2.FileChunk()),
    ]
    raws = [m.SerializeToString() for m in messages]
    # fields in another order, a repeated field (the last wins), an unknown field 9
    inner = b"\x1a\x02hi" + b"\x0a\x01a" + b"\x20\x05" + b"\x10\x07" + b"\x0a\x01b"
    raws.append(b"\x12" + bytes([len(inner)]) + inner)
    raws.append(b"\x12\x04" + b"\x48\x01\x0a\x00")
    raws.append(b"\x12\x06\x20\xff\xff\xff\xff\x1f")  # crc32c beyond 32 bits
    raws.append(b"\x12\x03\x0a\x01\xff")  # path that is not UTF-8
    base = peer_wire.encode_chunk("dir/f.bin", 1 << 33, bytes(range(256)) * 4, 0xABCDEF01)
    raws.append(base)
    raws += [base[:n] for n in (0, 1, 2, 5, 17, len(base) - 1)]  # truncated
    for _ in range(300):  # flipped bytes
        b = bytearray(base)
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        raws.append(bytes(b))
    decoded = 0
    for raw in raws:
        fast = peer_wire.decode_chunk(raw)
        try:
            ref = pb2.PushMessage.FromString(raw)
        except DecodeError:
            assert fast is None, raw[:40]
            continue
        if fast is None:
            continue
        decoded += 1
        assert ref.WhichOneof("kind") == "chunk", raw[:40]
        c = ref.chunk
        assert fast == peer_wire.Chunk(c.path, c.offset, c.data, c.crc32c), raw[:40]
        assert peer_wire.as_chunk(ref) == fast and peer_wire.kind_of(fast) == "chunk"
    assert decoded > 250
    assert peer_wire.decode_chunk(raws[5]) == peer_wire.Chunk("b", 7, b"hi", 5)
    assert peer_wire.decode_chunk(raws[1]) is None and peer_wire.decode_chunk(raws[6]) is None
    deserialize = peer_wire.chunk_deserializer(pb2.PushMessage)
    assert peer_wire.kind_of(deserialize(raws[1])) == "header"
    assert deserialize(raws[0]) == peer_wire.Chunk("p", -3, b"ab", 7)


@pytest.mark.slow
def test_a_node_the_coordinator_refuses_fails_fast(make_mount, monkeypatch):
    """Regression: a wrong peer token (or another job-name or node count) made the
    restore wait the whole --join-timeout (10 min by default) before failing."""
    monkeypatch.setenv("TIERFS_REFUSAL_GRACE", "2")
    c = Cluster(
        make_mount,
        2,
        join_timeout=600,
        node_args=lambda i: ["--peer-token", "wrong"] if i == 1 else [],
    )
    root = c.root(1)
    start = time.monotonic()
    (root / "replicator.yaml.tmp").write_text(
        "job-name: job\nframework: orbax\nnode-rank: 1\nnodes: 2\npeers-per-node: 1"
    )
    os.replace(root / "replicator.yaml.tmp", root / "replicator.yaml")
    wait_until(lambda: (root / "replicator.failed").exists(), 30, "replicator.failed")
    assert time.monotonic() - start < 30
    failed = (root / "replicator.failed").read_text()
    assert "refused this node" in failed and "refused the peer token" in failed
    assert "the coordinator refuses this node" in (root / "replicator.errors").read_text()


@pytest.mark.slow
def test_two_nodes_with_one_rank_is_a_refusal(make_mount):
    """Regression (issue #16 trial): a node whose node-rank another live node
    serves retried until --join-timeout and then exited 6 ("timed out"), where the
    README's table says a rank the coordinator refuses exits 5."""
    c = Cluster(make_mount, 3, join_timeout=4)
    for i, rank in ((0, 0), (1, 1), (2, 1)):
        root = c.root(i)
        (root / "replicator.yaml.tmp").write_text(
            f"job-name: job\nframework: orbax\nnode-rank: {rank}\nnodes: 3\npeers-per-node: 1"
        )
        os.replace(root / "replicator.yaml.tmp", root / "replicator.yaml")
        if i == 1:
            # joined, not merely begun (CI ci20: node 2's yaml, written 11 ms after
            # node 1's, registered rank 1 first and node 1 was the one refused)
            wait_until(lambda: "round" in c.status(1)["restore"], 60, "node 1 joined")
    waited = tierfs("wait", str(c.root(2)), "--timeout", "60", check=False)
    assert waited.returncode == 5, (waited.returncode, waited.stderr)
    assert "node-rank 1 is taken" in waited.stderr
    assert "node-rank 1 is taken" in (c.root(2) / "replicator.failed").read_text()
