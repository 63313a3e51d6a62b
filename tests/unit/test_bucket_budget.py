"""The request count per backup round and restore (tierfs.backup.budget), checked
against the requests the real backend makes on the counting, rate-limited fake."""

from __future__ import annotations

import pytest
from fake_bucket import FakeClient, fast_settings, seal
from rated_bucket import RatedGcs, TokenBucket

from tierfs.backup import budget as B
from tierfs.backup.bucket import GcsBackend
from tierfs.store.ramstore import RamStore


def test_pages_and_seconds() -> None:
    assert [B.pages(n) for n in (0, 1, 1000, 1001, 660000)] == [1, 1, 1, 2, 660]
    assert B.Requests(writes=2000, reads=1000, lists=4000).seconds() == 2.0
    assert B.Requests(reads=9000, lists=1000).seconds() == 2.0


def test_counts_at_10000_nodes() -> None:
    r = B.backup_round(10000, 64)
    assert r.node == B.Requests(writes=66, lists=1)
    assert r.total.writes == 660001
    before = B.restore(10000, 64, index=False)
    after = B.restore(10000, 64)
    # every node lists the whole round and reads every manifest without the index
    assert before.node == B.Requests(reads=10000 + 64, lists=660)
    assert after.node == B.Requests(reads=2 + 64)
    # (node-rank 0: restore.version and the index found, beside the round's manifests)
    assert after.total.reads == 10000 * 66 + 2 + 10000
    assert after.total.lists == 661
    assert before.total.seconds() > 100 * after.total.seconds()


def test_table_in_docs() -> None:
    import pathlib

    doc = (pathlib.Path(__file__).parents[2] / "docs" / "BACKUPS.md").read_text()
    assert B.markdown_table() in doc


def test_token_bucket() -> None:
    now = [0.0]
    b = TokenBucket(10, clock=lambda: now[0])
    assert all(b.take() for _ in range(10))
    assert not b.take()
    now[0] = 0.25
    assert b.take() and b.take() and not b.take()


def test_rated_fake_answers_429_and_scales() -> None:
    now = [0.0]
    server = RatedGcs(writes_per_s=3, reads_per_s=5, clock=lambda: now[0])
    client = FakeClient(server)
    bucket = client.bucket("bkt")
    for i in range(3):
        bucket.blob(f"o{i}").upload_from_string(b"x")
    with pytest.raises(Exception) as e:
        bucket.blob("o3").upload_from_string(b"x")
    assert getattr(e.value, "code", None) == 429
    assert server.refused == 1
    server.scale(2)
    now[0] = 1.0
    for i in range(6):
        bucket.blob(f"p{i}").upload_from_string(b"x")
    assert server.counts == B.Requests(writes=9)


def _backend(server: RatedGcs) -> GcsBackend:
    return GcsBackend(
        "bkt", client=FakeClient(server), settings=fast_settings(5.0), widen_pool=False
    )


@pytest.mark.parametrize("index", [False, True])
def test_real_backend_makes_the_counted_requests(tmp_path, index: bool) -> None:
    nodes, files = 3, 5
    server = RatedGcs(writes_per_s=1e6, reads_per_s=1e6)
    be = _backend(server)
    rnd = "2026-12-04_07-00"
    shards = []
    for rank in range(nodes):
        ram = RamStore(str(tmp_path / f"r{rank}"))
        shards.append(
            seal(ram, "job", rank, 7, {f"f{i}": bytes([rank, i]) * 10 for i in range(files)})
        )
    for rank, shard in enumerate(shards):
        be.upload_shard(shard, rnd, nodes=nodes)
        if rank == 0:
            one = server.counts
    assert one == B.backup_round(nodes, files, index=False).node
    if index:
        be.write_round_index("job", rnd)
    assert server.reset_counts() == B.backup_round(nodes, files, index=index).total


@pytest.mark.parametrize("index", [False, True])
def test_real_restore_makes_the_counted_requests(tmp_path, index: bool) -> None:
    """The coordinator's bucket read on node-rank 0, then every node's part:
    inspect_part (the index, else the whole round) and its data GETs."""
    from tierfs.store.shards import ShardStore

    nodes, files = 3, 5
    server = RatedGcs(writes_per_s=1e6, reads_per_s=1e6)
    be = _backend(server)
    rnd = "2026-12-04_07-00"
    for rank in range(nodes):
        ram = RamStore(str(tmp_path / f"r{rank}"))
        shard = seal(ram, "job", rank, 7, {f"f{i}": bytes([rank, i]) * 10 for i in range(files)})
        be.upload_shard(shard, rnd, nodes=nodes)
    if index:
        be.write_round_index("job", rnd)
    server.reset_counts()
    assert be.read_restore_version("job") is None
    assert be.list_round_names("job") == [rnd]
    assert be.inspect_round("job", rnd, fallback=nodes).complete_step == 7
    if index:  # the reader finds the index (BucketRestore.read_bucket)
        assert be.ensure_round_index("job", rnd) is None
    for rank in range(nodes):
        if index:
            info = be.inspect_part("job", rnd, rank, 7, fallback=nodes)
        else:  # what each node did before the index
            info = be.inspect_round("job", rnd, fallback=nodes)
        assert info.parts[(rank, 7)].complete
        ram = RamStore(str(tmp_path / f"restore{rank}"))
        shard = be.restore_shard(ShardStore(ram), "job", rnd, rank, 7, info=info)
        assert shard.manifest.rank == rank
    assert server.reset_counts() == B.restore(nodes, files, index=index).total


def test_data_names_spread_over_the_key_range_after_the_round_prefix() -> None:
    """GCS splits key ranges: the character after ``JOB/ROUND/D`` of 1,600 parts'
    data objects is a hash digit, every one of the 16 about equally often."""
    from collections import Counter

    from tierfs.backup.layout import node_layout
    from tierfs.store.manifest import FileEntry, Manifest

    firsts: Counter[str] = Counter()
    for rank in range(1600):
        m = Manifest(
            job="job",
            rank=rank,
            step=3,
            name="3",
            framework="generic",
            files=(FileEntry("3", "dir"), FileEntry("3/a", "file", 5, crc32c=rank)),
        )
        (name,) = node_layout(m).objects.values()
        assert name.startswith("D")
        firsts[name[1]] += 1
    assert sorted(firsts) == list("0123456789abcdef")
    assert max(firsts.values()) < 2 * min(firsts.values())
