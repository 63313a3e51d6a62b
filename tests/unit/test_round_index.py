"""The round index (tierfs.backup.round_index): a node's part in two GETs, checked
against the crc32c the index records, and the listing as the fallback whenever
the index is absent or does not verify."""

from __future__ import annotations

import json

import pytest
from fake_bucket import FakeClient, fast_settings, seal
from rated_bucket import RatedGcs

from tierfs.backup import layout as L
from tierfs.backup.bucket import GcsBackend
from tierfs.backup.layout import LayoutError
from tierfs.backup.round_index import IndexedPart, RoundIndex, index_from_listing, index_name
from tierfs.store.ramstore import RamStore

RND = "2026-12-04_07-00"
PREFIX = f"job/{RND}/"


@pytest.fixture
def bucket(tmp_path):
    server = RatedGcs(writes_per_s=1e6, reads_per_s=1e6)
    be = GcsBackend("bkt", client=FakeClient(server), settings=fast_settings(2.0), widen_pool=False)
    for rank in range(2):
        ram = RamStore(str(tmp_path / f"r{rank}"))
        shard = seal(ram, "job", rank, 4, {"a": b"A%d" % rank, "d/b": b"B" * 100})
        be.upload_shard(shard, RND, nodes=2)
    return server, be


def test_json_round_trip_and_refusals() -> None:
    idx = RoundIndex("job", RND, (IndexedPart(1, 4, "m", 10, 77, {0: 5}),), 3.0)
    assert RoundIndex.from_json(idx.to_json()) == idx
    for bad in (b"nope", b"{}", b'{"format": "tierfs.round-index/1", "parts": [{}]}'):
        with pytest.raises(LayoutError):
            RoundIndex.from_json(bad)


def test_index_from_listing_names_manifests_with_their_pointers() -> None:
    listed = {
        L.tierfs_manifest_name("job", 4, 0): (120, 11),
        L.meta_name("job", 4, 0, 0): (65, 12),
        L.tierfs_manifest_name("job", 4, 1): (130, None),  # no crc32c: not named
        L.tierfs_manifest_name("other", 4, 2): (5, 13),
        "leftover": (1, 2),
    }
    idx = index_from_listing("job", RND, listed)
    assert idx.parts == (IndexedPart(0, 4, L.tierfs_manifest_name("job", 4, 0), 120, 11, {0: 12}),)


def test_a_part_through_the_index_costs_two_gets(bucket) -> None:
    server, be = bucket
    idx = be.write_round_index("job", RND)
    assert [(p.rank, p.step) for p in idx.parts] == [(0, 4), (1, 4)]
    assert PREFIX + index_name("job") in server.objects()
    server.reset_counts()
    info = be.inspect_part("job", RND, 1, 4, fallback=2)
    assert server.reset_counts().reads == 2
    part = info.parts[(1, 4)]
    assert part.complete and part.backup is not None
    assert part.backup.manifest.rank == 1
    assert list(info.parts) == [(1, 4)]


def _falls_back(server, be) -> None:
    server.reset_counts()
    info = be.inspect_part("job", RND, 1, 4, fallback=2)
    counts = server.reset_counts()
    assert counts.lists == 1  # the round judged from its listing
    assert set(info.parts) == {(0, 4), (1, 4)}
    assert info.complete_step == 4


def test_no_index_falls_back_to_the_listing(bucket) -> None:
    _falls_back(*bucket)


def test_a_manifest_that_changed_after_the_index_falls_back(bucket) -> None:
    server, be = bucket
    be.write_round_index("job", RND)
    name = PREFIX + L.tierfs_manifest_name("job", 4, 1)
    data = json.loads(server.objects()[name].data)
    data["created"] = 1.0  # other bytes, still a valid manifest of that part
    server.put_object("bkt", name, json.dumps(data).encode())
    assert be.indexes.read_part("job", RND, 1, 4, 2) is None
    _falls_back(server, be)


def test_an_unreadable_or_foreign_index_falls_back(bucket) -> None:
    server, be = bucket
    server.put_object("bkt", PREFIX + index_name("job"), b"{not json")
    _falls_back(server, be)
    idx = be.write_round_index("job", RND)
    other = RoundIndex("job", "2026-12-04_06-00", idx.parts)
    server.put_object("bkt", PREFIX + index_name("job"), other.to_json())
    _falls_back(server, be)


def test_a_pointer_not_recorded_falls_back(bucket) -> None:
    server, be = bucket
    idx = be.write_round_index("job", RND)
    parts = tuple(IndexedPart(p.rank, p.step, p.manifest, p.size, p.crc32c, {}) for p in idx.parts)
    server.put_object("bkt", PREFIX + index_name("job"), RoundIndex("job", RND, parts).to_json())
    _falls_back(server, be)


def test_a_part_the_index_does_not_name_falls_back(bucket) -> None:
    server, be = bucket
    idx = be.write_round_index("job", RND)
    parts = tuple(p for p in idx.parts if p.rank == 0)
    server.put_object("bkt", PREFIX + index_name("job"), RoundIndex("job", RND, parts).to_json())
    _falls_back(server, be)


def test_the_judge_ignores_the_index(bucket) -> None:
    _server, be = bucket
    be.write_round_index("job", RND)
    info = be.inspect_round("job", RND)
    assert info.complete_step == 4 and set(info.parts) == {(0, 4), (1, 4)}


def test_the_restore_reader_writes_the_index_a_complete_round_lacks(bucket) -> None:
    """Review of #17: a round whose index was never written (node-rank 0 died before
    it, or the write failed) cost every restoring node a listing of the whole round.
    The coordinator's reader, which judges the round anyway, writes it: one GET when
    the index is there, one listing and one write more when it is not."""
    server, be = bucket
    server.reset_counts()
    idx = be.ensure_round_index("job", RND)
    counts = server.reset_counts()
    assert idx is not None and [(p.rank, p.step) for p in idx.parts] == [(0, 4), (1, 4)]
    assert (counts.reads, counts.lists, counts.writes) == (1, 1, 1)
    assert be.ensure_round_index("job", RND) is None  # there now: one GET
    assert server.reset_counts().reads == 1
    info = be.inspect_part("job", RND, 1, 4, fallback=2)
    assert server.reset_counts().reads == 2 and list(info.parts) == [(1, 4)]
    # a round with no tierfs manifest to name (MTC's) gets no index
    assert be.ensure_round_index("job", "2026-12-04_08-00") is None
    assert f"job/2026-12-04_08-00/{index_name('job')}" not in server.objects()
