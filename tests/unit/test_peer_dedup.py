"""The peer tier's manifest-only sends (data-parallel dedup) link a local copy only
when the checksums prove it identical (issue 19 case 1, the peer tier's rule).

The servicer is called directly with a host whose digest lookup returns a
shard with other files -- what a collision of the 32-bit manifest digest, or
a stale inventory, would hand it."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from gcs_fixtures import make_shard, tree_of

from tierfs.replication.service import PeerServicer
from tierfs.replication.transfer import identical_content
from tierfs.rpc import peer_pb2 as pb2
from tierfs.store.shards import ShardStore


class Stats:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n


class Host:
    """A node holding one shard, which its digest lookup returns for any digest."""

    incarnation = "inc"

    def __init__(self, src) -> None:
        self.src = src
        self.shards = ShardStore(src_ram(src))
        self.ram = self.shards.ram
        self.stats = Stats()
        self.adopted: list = []

    def own_rank(self, job: str) -> int:
        return 0

    def find_digest(self, job: str, digest: str):
        return self.src, True

    def find(self, key):
        return None  # no copy of the pushed part's own key held here

    def adopt(self, shard, linked_from=None) -> None:
        self.adopted.append((shard, linked_from))

    def check_space(self, nbytes: int) -> None:
        pass


def src_ram(shard):
    from tierfs.store.ramstore import RamStore

    # the shard lives at <ram>/store/shards/<job>/<rank>/<step>
    return RamStore(str(Path(shard.path).parents[4]))


class Context:
    def abort(self, code, detail):
        raise AssertionError(f"aborted: {code} {detail}")

    def is_active(self) -> bool:
        return True


def push_manifest_only(servicer: PeerServicer, manifest):
    header = pb2.PushHeader(
        job=manifest.job,
        rank=manifest.rank,
        step=manifest.step,
        digest=manifest.digest,
        sender_rank=manifest.rank,
        total_bytes=manifest.total_bytes,
        dedup=True,
    )
    msgs = [
        pb2.PushMessage(header=header),
        pb2.PushMessage(manifest=pb2.ShardManifest(json=manifest.to_json())),
    ]
    return servicer.PushShard(iter(msgs), Context())


def test_a_manifest_only_push_is_refused_unless_the_local_copy_lists_the_same_checksums(tmp_path):
    src = make_shard(tmp_path / "ram", "job", 1, 5, {"5/a": b"one", "5/b": os.urandom(100)})
    host = Host(src)
    servicer = PeerServicer(host)
    # rank 3 of the same column, but its bytes differ (a sharded array): refused,
    # the sender then streams the data
    other = make_shard(tmp_path / "other", "job", 3, 5, {"5/a": b"two", "5/b": b"x" * 100})
    assert not identical_content(other.manifest, src.manifest)
    reply = push_manifest_only(servicer, other.manifest)
    assert not reply.committed and "identical checksums" in reply.detail
    assert host.adopted == [] and os.listdir(host.ram.incoming) == []
    # identical files (same sizes and crc32c): linked, no data sent
    same = dataclasses.replace(src.manifest, rank=3)
    assert identical_content(same, src.manifest)
    reply = push_manifest_only(servicer, same)
    assert reply.committed and reply.deduped
    ((shard, linked_from),) = host.adopted
    assert linked_from == src.key and shard.key.rank == 3
    assert tree_of(Path(shard.data)) == tree_of(Path(src.data))
