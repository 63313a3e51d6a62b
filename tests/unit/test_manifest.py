"""Manifests: crc32c per file, verification, path safety; local shard store and retention."""

from __future__ import annotations

import os

import google_crc32c
import pytest

from tierfs.store.manifest import (
    FileEntry,
    Manifest,
    ManifestError,
    check_entries,
    scan_tree,
    verify_tree,
)
from tierfs.store.ramstore import RamStore
from tierfs.store.shards import SealBusy, ShardKey, ShardStore, retention


def _tree(root):
    os.makedirs(root / "5" / "state" / "d")
    (root / "5" / "state" / "d" / "a").write_bytes(b"A" * 5000)
    (root / "5" / "commit_success.txt").write_bytes(b"ok")
    os.symlink("state/d/a", root / "5" / "link")
    (root / "5" / "empty").write_bytes(b"")


def test_scan_tree_records_crc32c_sizes_and_links(tmp_path):
    _tree(tmp_path)
    files = {f.path: f for f in scan_tree(str(tmp_path), ["5"])}
    assert files["5/state/d/a"].crc32c == google_crc32c.value(b"A" * 5000)
    assert files["5/state/d/a"].size == 5000
    assert files["5/link"].kind == "symlink" and files["5/link"].target == "state/d/a"
    assert files["5"].kind == "dir"
    assert files["5/empty"].size == 0
    assert verify_tree(str(tmp_path), files.values()) == []


def test_verify_catches_a_flipped_byte_and_a_truncated_tail(tmp_path):
    _tree(tmp_path)
    files = scan_tree(str(tmp_path), ["5"])
    p = tmp_path / "5" / "state" / "d" / "a"
    data = bytearray(p.read_bytes())
    data[1234] ^= 1
    p.write_bytes(bytes(data))
    problems = verify_tree(str(tmp_path), files)
    assert len(problems) == 1 and problems[0].startswith("5/state/d/a: crc32c")
    p.write_bytes(bytes(data[:-1]))
    assert verify_tree(str(tmp_path), files) == ["5/state/d/a: size 4999 != 5000"]
    os.unlink(p)
    assert verify_tree(str(tmp_path), files) == ["5/state/d/a: missing"]


def test_manifest_json_round_trip_and_digest(tmp_path):
    _tree(tmp_path)
    m = Manifest("job", 1, 5, "5", "orbax", tuple(scan_tree(str(tmp_path), ["5"])))
    again = Manifest.from_json(m.to_json())
    assert again == m
    other_rank = Manifest("job", 2, 5, "5", "orbax", m.files)
    assert other_rank.digest == m.digest
    changed = Manifest(
        "job",
        1,
        5,
        "5",
        "orbax",
        tuple(
            f if f.kind != "file" or f.size != 2 else FileEntry(f.path, "file", 2, f.mode, 0)
            for f in m.files
        ),
    )
    assert changed.digest != m.digest
    assert m.top_level == ["5"]
    assert m.total_bytes == 5002


@pytest.mark.parametrize(
    "entry",
    [
        FileEntry("/etc/passwd", "file", 1, crc32c=0),
        FileEntry("a/../../x", "file", 1, crc32c=0),
        FileEntry("a//b", "file", 1, crc32c=0),
        FileEntry("..", "dir"),
        FileEntry("a/link", "symlink", target="/etc/passwd"),
        FileEntry("a/link", "symlink", target="../../outside"),
        FileEntry("a/file", "file", 1),
        FileEntry("a/dev", "chardev"),
    ],
)
def test_unsafe_entries_are_refused(entry):
    with pytest.raises(ManifestError):
        check_entries([entry])


def test_safe_relative_symlink_inside_the_shard_is_fine():
    check_entries(
        [FileEntry("a/b/link", "symlink", target="../c"), FileEntry("a/c", "file", 0, crc32c=0)]
    )


def test_snapshot_commit_materialize(tmp_path):
    ram = RamStore(str(tmp_path / "ram"))
    _tree(tmp_path / "ram" / "view")
    store = ShardStore(ram)
    key = ShardKey("job", 0, 5)
    shard = store.snapshot(ram.view, key, "5", ["5"], "orbax")
    a_view = os.stat(os.path.join(ram.view, "5/state/d/a"))
    a_snap = os.stat(os.path.join(shard.data, "5/state/d/a"))
    assert a_view.st_ino == a_snap.st_ino  # a hard link, no data copy
    assert a_snap.st_ino in shard.inodes
    assert store.verify(shard) == []
    # the client deleting its directory leaves the snapshot intact
    import shutil

    shutil.rmtree(os.path.join(ram.view, "5"))
    loaded = store.load()
    assert list(loaded) == [key]
    assert store.verify(loaded[key]) == []
    created = store.materialize(loaded[key], ram.view, {"5": ".restored"})
    assert created == [".restored"]
    assert open(os.path.join(ram.view, ".restored/state/d/a"), "rb").read() == b"A" * 5000


def test_snapshot_refuses_a_file_open_for_writing(tmp_path):
    ram = RamStore(str(tmp_path / "ram"))
    _tree(tmp_path / "ram" / "view")
    busy = os.stat(os.path.join(ram.view, "5/state/d/a")).st_ino
    with pytest.raises(SealBusy):
        ShardStore(ram).snapshot(
            ram.view,
            ShardKey("job", 0, 5),
            "5",
            ["5"],
            "orbax",
            writers=lambda ino: 1 if ino == busy else 0,
        )
    assert os.listdir(ram.incoming) == []
    assert os.listdir(ram.shards) == []


def test_retention_keeps_newest_per_owner_and_pinned():
    keys = [ShardKey("j", r, s) for r in (0, 1) for s in (1, 2, 3, 4)]
    assert retention(keys, 2, set()) == [
        ShardKey("j", 0, 1),
        ShardKey("j", 0, 2),
        ShardKey("j", 1, 1),
        ShardKey("j", 1, 2),
    ]
    assert retention(keys, 2, {ShardKey("j", 0, 1)}) == [
        ShardKey("j", 0, 2),
        ShardKey("j", 1, 1),
        ShardKey("j", 1, 2),
    ]
    assert retention(keys, 10, set()) == []


def test_retention_by_seal_time_keeps_the_steps_written_after_a_rollback():
    """After a rollback to step 20 the job writes 30 and 40 again while abandoned
    50 and 60 exist: by seal time the new steps are the newest."""
    keys = [ShardKey("j", 0, s) for s in (20, 50, 60, 30, 40)]
    sealed_at = {k: t for t, k in enumerate(keys)}  # 20, 50, 60, then 30, 40
    drop = retention(keys, 2, set(), age=lambda k: sealed_at[k])
    assert drop == [ShardKey("j", 0, 20), ShardKey("j", 0, 50), ShardKey("j", 0, 60)]
    # by step number (the old rule) the job's new steps would have been dropped
    assert retention(keys, 2, set()) == [
        ShardKey("j", 0, 20),
        ShardKey("j", 0, 30),
        ShardKey("j", 0, 40),
    ]


def test_a_step_must_not_link_into_a_sibling_step():
    """Regression: checkpoint-6/sub/link -> ../../checkpoint-1/data.bin was sealed."""
    from tierfs.store.manifest import check_self_contained

    def link(path: str, target: str) -> FileEntry:
        return FileEntry(path=path, kind="symlink", mode=0o777, size=0, target=target)

    step = [
        FileEntry(path="checkpoint-6", kind="dir", mode=0o755, size=0),
        FileEntry(path="checkpoint-6/sub", kind="dir", mode=0o755, size=0),
    ]
    check_self_contained([*step, link("checkpoint-6/sub/ok", "../data.bin")])
    for target in ("../../checkpoint-1/data.bin", "../..", "../../checkpoint-6x/a"):
        with pytest.raises(ManifestError, match="leaves the step"):
            check_self_contained([*step, link("checkpoint-6/sub/bad", target)])


def test_the_crc_cache_keeps_its_newest_entries_up_to_its_limit():
    """Noticed in #14 trials: the seals' crc32c cache grew by every file ever sealed
    for as long as the daemon ran; it now keeps the newest entries up to a limit."""
    from tierfs.store.manifest import trim_crc_cache

    cache = {(i, 10, 1): (i, None) for i in range(10)}
    assert trim_crc_cache(cache, 4) == 6
    assert list(cache) == [(6, 10, 1), (7, 10, 1), (8, 10, 1), (9, 10, 1)]
    assert trim_crc_cache(cache, 4) == 0 and len(cache) == 4
