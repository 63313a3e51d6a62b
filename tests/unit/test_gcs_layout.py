"""Pure GCS-tier policy: bucket specs, round names, MTC object names, completeness, retention."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from tierfs.backup import layout as L
from tierfs.backup.bucket import (
    NodeEntry,
    ObjectInfo,
    RoundInfo,
    crc_b64,
    crc_from_b64,
    judge_round,
)
from tierfs.backup.retention import RetentionPolicy, RoundState, select_rounds
from tierfs.store.manifest import FileEntry, Manifest

# ---------------------------------------------------------------------- bucket specs


@pytest.mark.parametrize(
    "text, bucket, prefix",
    [
        ("my-bucket", "my-bucket", ""),
        ("my-bucket/", "my-bucket", ""),
        ("gs://my-bucket", "my-bucket", ""),
        ("my-bucket/team/ckpt", "my-bucket", "team/ckpt"),
        ("gs://my.bucket_1/a/", "my.bucket_1", "a"),
    ],
)
def test_parse_bucket(text, bucket, prefix):
    spec = L.parse_bucket(text)
    assert (spec.bucket, spec.prefix) == (bucket, prefix)


@pytest.mark.parametrize("text", ["", "/", "UPPER", "a", "b/../x", "b//x", "gs://", "b/./x"])
def test_parse_bucket_rejects(text):
    with pytest.raises(L.LayoutError):
        L.parse_bucket(text)


def test_a_bucket_name_of_the_wrong_length_is_refused_with_the_rule():
    # regression: "--bucket b2" said only which characters a name may have
    with pytest.raises(L.LayoutError, match="3-63 characters"):
        L.parse_bucket("b2")
    with pytest.raises(L.LayoutError):
        L.parse_bucket("a" * 64)
    with pytest.raises(L.LayoutError):
        L.parse_bucket("a" * 64 + ".com")
    assert L.parse_bucket("a" * 63).bucket == "a" * 63
    dotted = ".".join(["a" * 60] * 3)  # 182 characters, 60 between dots
    assert L.parse_bucket(dotted + "/p").bucket == dotted


def test_object_names_follow_mtc_layout():
    spec = L.parse_bucket("bkt/pre")
    assert spec.job_dir("job") == "pre/job/"
    assert spec.round_dir("job", "2025-01-02_03-04") == "pre/job/2025-01-02_03-04/"
    assert spec.restore_version("job") == "pre/job/restore.version"
    assert spec.rendezvous("job", 3) == "pre/job/.tierfs/nodes/3"
    assert L.parse_bucket("bkt").round_dir("j", "2025-01-02_03-04") == "j/2025-01-02_03-04/"
    with pytest.raises(L.LayoutError):
        spec.round_dir("job", "2025-01-02")
    with pytest.raises(L.LayoutError):
        spec.job_dir("a/b")
    assert L.meta_name("job", 5, 2, 1) == "job-s5-n2-w1.meta"
    assert L.parse_meta_name("my-job-s5-n2-w1.meta") == ("my-job", 5, 2, 1)
    assert L.parse_meta_name("job-s5-n2-w1.meta.tmp") is None
    assert L.parse_tierfs_manifest_name("job-s5-n2.tierfs.json") == ("job", 5, 2)


def test_round_names_are_utc_minutes():
    t = dt.datetime(2025, 1, 2, 3, 4, 59, tzinfo=dt.UTC)
    assert L.round_name(t) == "2025-01-02_03-04"
    assert L.round_name(t.timestamp()) == "2025-01-02_03-04"
    local = t.astimezone(dt.timezone(dt.timedelta(hours=5)))
    assert L.round_name(local) == "2025-01-02_03-04"
    assert L.round_time("2025-01-02_03-04") == t.replace(second=0)
    assert L.is_round_name("2025-01-02_03-04")
    assert not L.is_round_name("2025-13-02_03-04")
    assert not L.is_round_name(".tierfs")
    # the same minute twice: the second round gets the next minute
    assert L.next_round_name(t.timestamp(), "2025-01-02_03-04") == "2025-01-02_03-05"
    assert L.next_round_name(t.timestamp(), "2025-01-02_03-03") == "2025-01-02_03-04"
    assert L.next_round_name(t.timestamp(), None) == "2025-01-02_03-04"


def test_crc_base64_roundtrip():
    for v in (0, 1, 0xDEADBEEF, 0xFFFFFFFF):
        assert crc_from_b64(crc_b64(v)) == v
    assert crc_b64(0xE3069283) == "4waSgw=="
    assert crc_from_b64("") is None and crc_from_b64("!!") is None


# ---------------------------------------------------------------------- data parallelism


def test_data_parallel_rows():
    # 8 nodes, D=2: a 2 x 4 grid; the last row (4..7) uploads data
    assert [L.uploads_data(r, 8, 2) for r in range(8)] == [False] * 4 + [True] * 4
    assert [L.uploader_of(r, 8, 2) for r in range(8)] == [4, 5, 6, 7, 4, 5, 6, 7]
    assert [L.data_column(r, 8, 2) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    # D=4 on 8 nodes: cols=2, last row 6,7
    assert [L.uploads_data(r, 8, 4) for r in range(8)] == [False] * 6 + [True] * 2
    for dp in (None, 0, 1):
        assert all(L.uploads_data(r, 4, dp) for r in range(4))
        assert [L.uploader_of(r, 4, dp) for r in range(4)] == [0, 1, 2, 3]


# ---------------------------------------------------------------------- layout


def _m(rank, files, framework="orbax", step=5, job="job"):
    return Manifest(
        job=job,
        rank=rank,
        step=step,
        name=files[0].path.split("/")[0],
        framework=framework,
        files=tuple(files),
        created=1.0,
    )


ORBAX = [
    FileEntry("5", "dir", mode=0o755),
    FileEntry("5/state", "dir", mode=0o755),
    FileEntry("5/state/a", "file", size=3, crc32c=7),
    FileEntry("5/_CHECKPOINT_METADATA", "file", size=2, crc32c=9),
    FileEntry("5/link", "symlink", mode=0o777, target="state/a"),
]


def test_layout_directory_framework_strips_the_step_dir():
    lay = L.node_layout(_m(0, ORBAX))
    h = lay.hashes[0]
    assert list(lay.hashes) == [0]
    assert h.startswith("D") and L.DATA_RE.match(L.data_name(h))
    assert lay.objects == {
        "5/state/a": f"{h}.data/state/a",
        "5/_CHECKPOINT_METADATA": f"{h}.data/_CHECKPOINT_METADATA",
    }
    assert [u.path for u in lay.uploads] == ["5/state/a", "5/_CHECKPOINT_METADATA"]
    assert lay.uploads[0].crc32c == 7 and lay.uploads[0].size == 3


def test_layout_hash_identity():
    base = L.node_layout(_m(0, ORBAX)).hashes[0]
    # same data, other rank of the same data-parallel column: same hash
    assert L.node_layout(_m(4, ORBAX), column=0).hashes[0] == base
    # other column, other step, other content: other hash
    assert L.node_layout(_m(1, ORBAX)).hashes[0] != base
    assert L.node_layout(_m(0, ORBAX, step=6)).hashes[0] != base
    changed = [*ORBAX[:2], FileEntry("5/state/a", "file", size=3, crc32c=8), *ORBAX[3:]]
    assert L.node_layout(_m(0, changed)).hashes[0] != base


def test_layout_pytorch_file_per_worker():
    files = [FileEntry(f"job-s5-n1-w{w}.save", "file", size=10 + w, crc32c=w) for w in range(3)]
    lay = L.node_layout(_m(1, files, framework="pytorch"))
    assert sorted(lay.hashes) == [0, 1, 2]
    for w in range(3):
        h = lay.hashes[w]
        assert not h.startswith("D") and L.DATA_RE.match(f"{h}.data")
        assert lay.objects[f"job-s5-n1-w{w}.save"] == f"{h}.data"
    assert len(set(lay.hashes.values())) == 3


def test_layout_generic_multiple_entries_keep_full_paths():
    files = [
        FileEntry("checkpoint-500", "dir"),
        FileEntry("checkpoint-500/model", "file", size=1, crc32c=1),
        FileEntry("latest", "file", size=3, crc32c=2),
    ]
    lay = L.node_layout(_m(0, files, framework="generic"))
    h = lay.hashes[0]
    assert lay.objects == {
        "checkpoint-500/model": f"{h}.data/checkpoint-500/model",
        "latest": f"{h}.data/latest",
    }


def test_node_backup_roundtrip_and_validation():
    m = _m(0, ORBAX)
    lay = L.node_layout(m)
    nb = L.NodeBackup(m, "2025-01-02_03-04", 4, 0, None, lay.hashes, lay.objects, 5.0)
    back = L.NodeBackup.from_json(nb.to_json())
    assert back == nb
    d = json.loads(nb.to_json())
    d["objects"]["5/state/a"] = "../escape"
    with pytest.raises(L.LayoutError):
        L.NodeBackup.from_json(json.dumps(d))
    d["objects"]["5/state/a"] = "notahash.data/x"
    with pytest.raises(L.LayoutError):
        L.NodeBackup.from_json(json.dumps(d))
    d = json.loads(nb.to_json())
    del d["objects"]["5/state/a"]
    with pytest.raises(L.LayoutError, match="object map"):
        L.NodeBackup.from_json(json.dumps(d))
    with pytest.raises(L.LayoutError):
        L.NodeBackup.from_json(b"{}")


def test_meta_content():
    h = "D" + "a" * 64
    assert L.check_meta_content(h) == h
    assert L.check_meta_content(h + "\n") == h
    for bad in ("", "D" + "A" * 64, "x" * 64, "D" + "a" * 63):
        with pytest.raises(L.LayoutError):
            L.check_meta_content(bad)


def test_rendezvous_records():
    rec = L.parse_rendezvous(
        L.rendezvous_record("10.0.0.1:7000", 0, incarnation="abc", written=12.5)
    )
    assert rec == L.RendezvousRecord("10.0.0.1:7000", 0, "abc", 12.5)
    assert L.parse_rendezvous(b"host:1234\n").address == "host:1234"
    for bad in (b"", b"nonsense", b'{"format": "other", "address": "a:1"}'):
        with pytest.raises(L.LayoutError):
            L.parse_rendezvous(bad)


# ---------------------------------------------------------------------- completeness (pure)


def _round(nodes, parts_spec, drop=(), corrupt=()):
    """A RoundInfo with tierfs parts for (rank, step) in parts_spec; objects as uploaded
    minus ``drop`` (names) and with a wrong crc for ``corrupt``."""
    parts = {}
    objects = {}
    for rank, step, with_meta in parts_spec:
        m = _m(
            rank,
            [FileEntry(str(step), "dir"), FileEntry(f"{step}/a", "file", size=3, crc32c=rank + 1)],
            step=step,
        )
        lay = L.node_layout(m)
        nb = L.NodeBackup(m, "2025-01-02_03-04", nodes, rank, None, lay.hashes, lay.objects)
        e = NodeEntry(rank, step, backup=nb)
        if with_meta:
            e.metas = dict(lay.hashes)
        parts[(rank, step)] = e
        for path, name in lay.objects.items():
            f = next(f for f in m.files if f.path == path)
            objects[name] = ObjectInfo(name, f.size, f.crc32c ^ (1 if name in corrupt else 0))
    for name in drop:
        objects.pop(name)
    return judge_round(RoundInfo("2025-01-02_03-04", nodes, parts, objects))


def test_judge_round_complete_and_partial():
    ok = _round(2, [(0, 5, True), (1, 5, True)])
    assert ok.complete_step == 5 and ok.problems() == []
    no_meta = _round(2, [(0, 5, True), (1, 5, False)])
    assert no_meta.complete_step is None
    assert any("rank 1" in p for p in no_meta.problems())
    missing_node = _round(3, [(0, 5, True), (1, 5, True)])
    assert missing_node.complete_step is None
    assert "rank 2: no pointer for step 5" in missing_node.problems()
    name = next(iter(ok.parts[(1, 5)].backup.objects.values()))
    dropped = _round(2, [(0, 5, True), (1, 5, True)], drop=[name])
    assert dropped.complete_step is None
    assert any("missing" in p for p in dropped.problems())
    bad = _round(2, [(0, 5, True), (1, 5, True)], corrupt=[name])
    assert bad.complete_step is None
    assert any("crc32c" in p for p in bad.problems())
    # two steps in one round: the newest step complete for every node wins
    mixed = _round(2, [(0, 5, True), (1, 5, True), (0, 6, True)])
    assert mixed.complete_step == 5


def test_judge_round_foreign_mtc_parts():
    h = "D" + "b" * 64
    info = RoundInfo(
        "2025-01-02_03-04",
        1,
        {(0, 5): NodeEntry(0, 5, metas={0: h})},
        {f"{h}.data/x": ObjectInfo(f"{h}.data/x", 4, 1)},
    )
    assert judge_round(info).complete_step == 5
    assert info.parts[(0, 5)].foreign
    empty = RoundInfo("2025-01-02_03-04", 1, {(0, 5): NodeEntry(0, 5, metas={0: h})}, {})
    assert judge_round(empty).complete_step is None


# ---------------------------------------------------------------------- retention (pure)


def _names(start: dt.datetime, minutes: list[int]) -> list[str]:
    return [L.round_name(start + dt.timedelta(minutes=m)) for m in minutes]


T0 = dt.datetime(2025, 3, 3, 0, 0, tzinfo=dt.UTC)  # a Monday


def test_retention_is_opt_in():
    with pytest.raises(ValueError):
        select_rounds([RoundState("2025-01-01_00-00", True)], RetentionPolicy())
    with pytest.raises(ValueError):
        RetentionPolicy(keep_last=-1)


def test_retention_keep_last():
    names = _names(T0, [0, 30, 60, 90, 120])
    sel = select_rounds([RoundState(n, True) for n in names], RetentionPolicy(keep_last=2))
    assert sorted(sel.keep) == names[3:]
    assert sel.delete == names[:3][::-1]


def test_retention_never_deletes_newest_complete_or_restore_version():
    names = _names(T0, [0, 10, 20, 30])
    rounds = [
        RoundState(names[0], True),
        RoundState(names[1], True),
        RoundState(names[2], True),
        RoundState(names[3], False),
    ]
    sel = select_rounds(
        rounds, RetentionPolicy(keep_last=1), protected={names[0]: "named in restore.version"}
    )
    assert names[2] in sel.keep and "newest complete round" in sel.keep[names[2]]
    assert names[0] in sel.keep  # restore.version
    assert names[3] in sel.keep  # partial, newer than the newest complete: may be uploading
    assert sel.delete == [names[1]]
    # restore.version naming a partial or unknown round protects it / is ignored
    sel = select_rounds(
        rounds,
        RetentionPolicy(keep_last=1),
        protected={"2024-01-01_00-00": "named in restore.version"},
    )
    assert "2024-01-01_00-00" not in sel.keep


def test_retention_partial_rounds():
    names = _names(T0, [0, 10, 20])
    sel = select_rounds(
        [RoundState(names[0], False), RoundState(names[1], True), RoundState(names[2], False)],
        RetentionPolicy(keep_last=5),
    )
    assert sel.delete == [names[0]]  # older than the newest complete round: dead
    # no complete round at all: nothing partial is deleted
    sel = select_rounds([RoundState(n, False) for n in names], RetentionPolicy(keep_last=1))
    assert sel.delete == [] and sorted(sel.keep) == names


def test_retention_hourly_daily_weekly():
    # every 20 minutes for 3 days
    names = _names(T0, list(range(0, 3 * 24 * 60, 20)))
    rounds = [RoundState(n, True) for n in names]
    sel = select_rounds(rounds, RetentionPolicy(hourly=3))
    # the newest round of each of the last 3 hours
    assert sorted(sel.keep) == ["2025-03-05_21-40", "2025-03-05_22-40", "2025-03-05_23-40"]
    sel = select_rounds(rounds, RetentionPolicy(daily=2))
    assert sorted(sel.keep) == ["2025-03-04_23-40", "2025-03-05_23-40"]
    sel = select_rounds([*rounds, RoundState("2025-02-28_12-00", True)], RetentionPolicy(weekly=2))
    assert sorted(sel.keep) == ["2025-02-28_12-00", "2025-03-05_23-40"]
    # rules combine as a union, reasons accumulate
    sel = select_rounds(rounds, RetentionPolicy(keep_last=1, hourly=1, daily=1))
    assert list(sel.keep) == ["2025-03-05_23-40"]
    assert len(sel.keep["2025-03-05_23-40"]) == 4
    assert len(sel.delete) == len(names) - 1
    # a gap: hourly counts hours that have rounds, not wall-clock hours
    gap = [RoundState(n, True) for n in _names(T0, [0, 5, 300, 600])]
    sel = select_rounds(gap, RetentionPolicy(hourly=3))
    assert sorted(sel.keep) == _names(T0, [5, 300, 600])


def test_infer_job_nodes_from_the_rounds():
    from tierfs.backup.bucket import apply_job_nodes, infer_job_nodes

    def mtc(name: str, ranks: list[int]) -> RoundInfo:
        parts = {(r, 7): NodeEntry(r, 7, metas={0: "D" + "a" * 64}) for r in ranks}
        objects = {f"D{'a' * 64}.data/x": ObjectInfo(f"D{'a' * 64}.data/x", 1, 0x1234)}
        return judge_round(RoundInfo(name, max(ranks) + 1, parts, objects))

    newest, older = mtc("2025-01-01_00-02", [0, 1]), mtc("2025-01-01_00-01", [0, 1, 2])
    assert newest.complete  # judged alone: 2 ranks, 2 nodes
    assert infer_job_nodes([newest, older]) == 3  # the most ranks any round holds
    apply_job_nodes([newest, older], 3)
    assert not newest.complete and newest.nodes == 3 and older.complete
    assert newest.problems() == ["rank 2: no pointer for step 7"]
    # a round that records its node count (tierfs manifest) gives the job's count
    recorded = RoundInfo("2025-01-01_00-00", 4, recorded_nodes=4)
    assert infer_job_nodes([mtc("2025-01-01_00-03", [0]), recorded]) == 4
    # and keeps its own count; a round with more ranks than inferred keeps those
    wide = mtc("2025-01-01_00-04", [0, 1, 2, 3, 4])
    apply_job_nodes([recorded, wide], 2)
    assert recorded.nodes == 4 and wide.nodes == 5
    assert infer_job_nodes([]) is None
    assert infer_job_nodes([RoundInfo("2025-01-01_00-05", 0, error="unreadable")]) is None
