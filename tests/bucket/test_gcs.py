"""The GCS tier against the real fake-gcs-server: uploads, restores, partial rounds,
corruption, restore.version, rendezvous, retries and outages."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from gcs_fixtures import FaultyProxy, make_shard, tree_of

from tierfs.backup.bucket import (
    Cancelled,
    ChecksumMismatch,
    GcsBackend,
    GcsSettings,
    IncompleteRound,
    describe_error,
)
from tierfs.store.ramstore import RamStore
from tierfs.store.shards import ShardStore

MiB = 1 << 20
R1, R2, R3 = "2025-01-02_03-04", "2025-01-02_03-34", "2025-01-02_04-04"


def backend(fake_gcs, prefix: str = "", **settings) -> GcsBackend:
    s = GcsSettings.from_env(**{"chunk_size": MiB, "threads": 4, **settings})
    spec = fake_gcs.bucket + (f"/{prefix}" if prefix else "")
    return GcsBackend(spec, settings=s)


def orbax_files(seed: int, big: int = 3 * MiB + 123) -> dict[str, bytes | str]:
    rnd = os.urandom
    return {
        "5/_CHECKPOINT_METADATA": b'{"seed": %d}' % seed,
        "5/state/manifest.ocdbt": rnd(1000),
        "5/state/d/big": bytes([seed]) * 10 + rnd(big),  # resumable, several chunks
        "5/state/d/zero": b"",
        "5/empty": "/",
        "5/link": "->state/manifest.ocdbt",
        "5/commit_success.txt": b"ok",
    }


def restore_into(g: GcsBackend, tmp: Path, job: str, rnd: str, rank: int, step: int, **kw):
    ram = RamStore(str(tmp))
    return g.restore_shard(ShardStore(ram), job, rnd, rank, step, **kw)


def test_upload_then_restore_is_byte_exact(fake_gcs, tmp_path):
    g = backend(fake_gcs, "pre/fix")
    shard = make_shard(
        tmp_path / "n0",
        "job",
        0,
        5,
        orbax_files(1),
        modes={"5/state/manifest.ocdbt": 0o600, "5/state": 0o750},
    )
    seen = []
    res = g.upload_shard(shard, R1, nodes=1, on_bytes=seen.append)
    assert res.data_uploaded and res.objects == 5 + 2 and res.skipped == 0
    assert sum(seen) == shard.bytes
    names = {b.name for b in fake_gcs.client().list_blobs(fake_gcs.bucket)}
    h = res.hashes[0]
    assert f"pre/fix/job/{R1}/job-s5-n0-w0.meta" in names
    assert f"pre/fix/job/{R1}/job-s5-n0.tierfs.json" in names
    assert f"pre/fix/job/{R1}/{h}.data/state/d/big" in names
    assert f"pre/fix/job/{R1}/{h}.data/_CHECKPOINT_METADATA" in names
    meta = (
        fake_gcs.client()
        .bucket(fake_gcs.bucket)
        .blob(f"pre/fix/job/{R1}/job-s5-n0-w0.meta")
        .download_as_bytes()
    )
    assert meta == h.encode()  # MTC: the hash, no newline
    info = g.inspect_round("job", R1)
    assert info.complete_step == 5 and info.nodes == 1
    restored = restore_into(g, tmp_path / "new", "job", R1, 0, 5)
    assert restored.verified and restored.manifest == shard.manifest
    assert tree_of(Path(restored.data)) == tree_of(Path(shard.data))
    # nothing left behind in incoming/
    assert os.listdir(tmp_path / "new" / "store" / "incoming") == []
    # uploading again resumes: every data object is already there
    again = g.upload_shard(shard, R1, nodes=1)
    assert again.skipped == 5 and again.bytes == 0


def test_pytorch_file_per_gpu_layout(fake_gcs, tmp_path):
    g = backend(fake_gcs)
    files = {f"job-s7-n1-w{w}.save": os.urandom(1000 + w) for w in range(2)}
    shard = make_shard(tmp_path / "n1", "job", 1, 7, files, framework="pytorch")
    res = g.upload_shard(shard, R1, nodes=2)
    assert sorted(res.hashes) == [0, 1]
    objs = {b.name.split("/", 2)[2] for b in fake_gcs.client().list_blobs(fake_gcs.bucket)}
    for w in (0, 1):
        assert f"job-s7-n1-w{w}.meta" in objs
        assert f"{res.hashes[w]}.data" in objs  # one object per GPU file
    restored = restore_into(g, tmp_path / "new", "job", R1, 1, 7)
    assert tree_of(Path(restored.data)) == tree_of(Path(shard.data))


def test_corrupted_object_is_detected_by_crc32c(fake_gcs, tmp_path):
    g = backend(fake_gcs)
    shard = make_shard(tmp_path / "n0", "job", 0, 5, orbax_files(2))
    res = g.upload_shard(shard, R1, nodes=1)
    info = g.inspect_round("job", R1)
    assert info.complete
    name = f"job/{R1}/{res.hashes[0]}.data/state/manifest.ocdbt"
    blob = fake_gcs.client().bucket(fake_gcs.bucket).blob(name)
    data = bytearray(blob.download_as_bytes())
    data[10] ^= 0xFF  # same size, one flipped byte
    blob.upload_from_string(bytes(data))
    # a listing sees GCS's crc32c differ from the manifest: the round is not usable
    again = g.inspect_round("job", R1)
    assert not again.complete
    assert any("crc32c" in p for p in again.problems())
    assert g.choose_restore("job", 1).round is None
    # a download that started from the old listing checks every byte itself
    with pytest.raises(ChecksumMismatch, match=r"manifest\.ocdbt"):
        restore_into(g, tmp_path / "new", "job", R1, 0, 5, info=info)
    store = tmp_path / "new" / "store"
    assert os.listdir(store / "incoming") == [] and not (store / "shards" / "job").exists()


def test_changed_local_file_is_refused_by_crc32c(fake_gcs, tmp_path):
    """A snapshot file whose bytes no longer match the manifest is never backed up."""
    g = backend(fake_gcs)
    shard = make_shard(tmp_path / "n0", "job", 0, 5, orbax_files(3))
    path = os.path.join(shard.data, "5/state/manifest.ocdbt")
    with open(path, "r+b") as f:  # the first byte flipped (regression: writing b"X"
        first = f.read(1)[0]  # over random bytes changed nothing 1 time in 256, CI)
        f.seek(0)
        f.write(bytes([first ^ 0xFF]))
    with pytest.raises(ChecksumMismatch):
        g.upload_shard(shard, R1, nodes=1)
    info = g.inspect_round("job", R1, nodes=1)
    assert not info.complete and info.ranks_present() == []
    names = [b.name for b in fake_gcs.client().list_blobs(fake_gcs.bucket)]
    assert not any(n.endswith("manifest.ocdbt") for n in names)  # the bad object was removed


def test_partial_rounds_are_reported_and_never_chosen(fake_gcs, tmp_path):
    g = backend(fake_gcs)
    shards = [make_shard(tmp_path / f"n{r}", "job", r, 5, orbax_files(10 + r)) for r in (0, 1)]
    for s in shards:
        g.upload_shard(s, R1, nodes=2)
    assert g.inspect_round("job", R1).complete_step == 5
    b = fake_gcs.client().bucket(fake_gcs.bucket)
    # R2: rank 1 never wrote its pointer (killed before the last step)
    res = [g.upload_shard(s, R2, nodes=2) for s in shards]
    b.blob(f"job/{R2}/job-s5-n1-w0.meta").delete()
    # R3: both pointers, but one data object of rank 0 is gone
    res = [g.upload_shard(s, R3, nodes=2) for s in shards]
    b.blob(f"job/{R3}/{res[0].hashes[0]}.data/state/d/big").delete()
    rounds = {r.name: r for r in g.list_rounds("job")}
    assert list(rounds) == [R3, R2, R1]
    assert rounds[R1].complete and rounds[R1].nodes == 2
    assert not rounds[R2].complete and rounds[R2].ranks_present(5) == [0]
    assert "rank 1: no pointer for step 5" in rounds[R2].problems()
    assert not rounds[R3].complete and rounds[R3].ranks_present(5) == [0, 1]
    assert any("big: missing" in p for p in rounds[R3].problems())
    choice = g.choose_restore("job", 2)
    assert (choice.round, choice.step, choice.forced) == (R1, 5, False)
    with pytest.raises(IncompleteRound):
        restore_into(g, tmp_path / "x", "job", R2, 1, 5)
    # judged against more nodes than uploaded, nothing is complete
    assert g.inspect_round("job", R1, 3).complete_step is None
    # but a restore judges a round against the node count that wrote it (issue #16):
    # a job grown to 3 nodes restores the 2-node round
    choice = g.choose_restore("job", 3)
    assert (choice.round, choice.step) == (R1, 5)


def test_data_parallelism_dedups_only_what_the_bucket_proves(fake_gcs, tmp_path):
    g = backend(fake_gcs)
    # 4 nodes, D=2: columns {0,2} and {1,3} hold identical data; ranks 2,3 upload
    content = {0: orbax_files(20), 1: orbax_files(21)}
    shards = {r: make_shard(tmp_path / f"n{r}", "job", r, 5, content[r % 2]) for r in range(4)}
    results = {}
    # rows 0/1 start first and wait for the uploaders' objects (threads, as on nodes)
    waiting = {
        r: threading.Thread(
            target=lambda r=r: results.__setitem__(
                r,
                g.upload_shard(
                    shards[r], R1, nodes=4, data_parallelism=2, dedup=True, dedup_wait=60
                ),
            )
        )
        for r in (0, 1)
    }
    for t in waiting.values():
        t.start()
    info = g.inspect_round("job", R1, nodes=4)
    assert not info.complete and info.ranks_present() == []  # no pointer before the data
    for r in (2, 3):
        results[r] = g.upload_shard(shards[r], R1, nodes=4, data_parallelism=2)
        assert results[r].data_uploaded
    for t in waiting.values():
        t.join(60)
    assert not results[0].data_uploaded and results[0].bytes == 0 and not results[0].note
    assert results[0].hashes == results[2].hashes != results[1].hashes
    info = g.inspect_round("job", R1, nodes=4)
    assert info.complete_step == 5
    assert info.bytes_of(5) == shards[2].bytes + shards[3].bytes
    restored = restore_into(g, tmp_path / "new0", "job", R1, 0, 5)
    assert restored.key.rank == 0
    assert tree_of(Path(restored.data)) == tree_of(Path(shards[0].data))


def test_data_parallel_ranks_whose_bytes_differ_upload_their_own(fake_gcs, tmp_path):
    """Exact input of issue 19 case 1 at the backend: 2 nodes, D=2, the nodes'
    step directories differ (an array sharded across them). Before: node 0 uploaded
    nothing and wrote a .meta naming D...data that never existed."""
    g = backend(fake_gcs)
    shards = {r: make_shard(tmp_path / f"n{r}", "job", r, 3, orbax_files(30 + r)) for r in range(2)}
    # the coordinator saw the digests differ: no dedup for node 0
    res0 = g.upload_shard(shards[0], R1, nodes=2, data_parallelism=2)
    assert res0.data_uploaded and res0.bytes == shards[0].bytes
    res1 = g.upload_shard(shards[1], R1, nodes=2, data_parallelism=2)
    assert res0.hashes != res1.hashes
    info = g.inspect_round("job", R1, nodes=2)
    assert info.complete_step == 3
    assert info.parts[(0, 3)].backup.uploader == 0
    for r in range(2):
        restored = restore_into(g, tmp_path / f"new{r}", "job", R1, r, 3)
        assert tree_of(Path(restored.data)) == tree_of(Path(shards[r].data))


def test_a_dedup_the_bucket_never_proves_uploads_its_own_data(fake_gcs, tmp_path):
    """A claim of identical data (dedup) that the bucket does not back up within
    the wait: the node uploads its own data; its pointer never names a missing
    object. Here the bytes differ (a digest collision would look like this), and
    the uploader never comes."""
    g = backend(fake_gcs)
    shard = make_shard(tmp_path / "n0", "job", 0, 3, orbax_files(40))
    t0 = time.monotonic()
    res = g.upload_shard(shard, R1, nodes=2, data_parallelism=2, dedup=True, dedup_wait=1.0)
    assert time.monotonic() - t0 < 30
    assert res.data_uploaded and res.bytes == shard.bytes
    assert "node-rank 1's data for step 3 was not in round" in res.note
    info = g.inspect_round("job", R1, nodes=2)
    assert info.parts[(0, 3)].complete and info.ranks_complete(3) == [0]
    # a cancel ends the wait at once
    cancel = threading.Event()
    cancel.set()
    other = make_shard(tmp_path / "n2", "job", 0, 4, orbax_files(41))
    with pytest.raises(Cancelled):
        g.upload_shard(other, R2, nodes=2, data_parallelism=2, dedup=True, cancel=cancel)
    assert g.inspect_round("job", R2, nodes=2).ranks_present() == []


def test_judging_reads_one_listing_and_the_manifests(fake_gcs, tmp_path, monkeypatch):
    """One listing per round; the .meta pointers are judged from the listing (size and
    crc32c of the hash the manifest names), not read one by one."""
    g = backend(fake_gcs)
    for r in range(3):
        g.upload_shard(make_shard(tmp_path / f"n{r}", "job", r, 5, {"5/x": b"%d" % r}), R1, nodes=3)
    calls = {"list": 0, "get": []}
    real_list, real_get = g.objects.listing, g.objects.get_bytes
    monkeypatch.setattr(
        g.objects,
        "listing",
        lambda *a, **k: (calls.__setitem__("list", calls["list"] + 1), real_list(*a, **k))[1],
    )
    monkeypatch.setattr(
        g.objects, "get_bytes", lambda name: (calls["get"].append(name), real_get(name))[1]
    )
    assert g.inspect_round("job", R1).complete_step == 5
    assert calls["list"] == 1
    assert sorted(n.rsplit("/", 1)[1] for n in calls["get"]) == [
        f"job-s5-n{r}.tierfs.json" for r in range(3)
    ]
    # a pointer that does not hold the manifest's hash is read and reported
    fake_gcs.client().bucket(fake_gcs.bucket).blob(
        f"job/{R1}/job-s5-n1-w0.meta"
    ).upload_from_string("D" + "0" * 64)
    info = g.inspect_round("job", R1)
    assert info.complete_step is None
    assert any(".meta for worker 0 names D000" in p for p in info.problems())


def test_tidy_round_removes_a_failed_round_and_a_moved_rounds_older_parts(fake_gcs, tmp_path):
    g = backend(fake_gcs)

    def names(rnd):
        return sorted(
            b.name for b in fake_gcs.client().list_blobs(fake_gcs.bucket, prefix=f"job/{rnd}/")
        )

    s = {
        (r, st): make_shard(tmp_path / f"n{r}s{st}", "job", r, st, {f"{st}/x": b"%d%d" % (r, st)})
        for r in range(2)
        for st in (1, 3)
    }
    # a failed round: only node 1's part of step 1
    g.upload_shard(s[(1, 1)], R1, nodes=2)
    # a moved round: node 1's part of step 1, then both nodes' parts of step 3
    for key in ((1, 1), (0, 3), (1, 3)):
        g.upload_shard(s[key], R2, nodes=2)
    g.write_restore_version("job", R2)
    assert g.tidy_round("job", R2, 2) == 0  # restore.version's round is never touched
    g.delete_restore_version("job")
    assert g.tidy_round("job", R1, 2) == 3 and names(R1) == []
    before = g.inspect_round("job", R2, 2)
    assert before.complete_step == 3 and (1, 1) in before.parts
    assert g.tidy_round("job", R2, 2) == 3
    after = g.inspect_round("job", R2, 2)
    assert after.complete_step == 3 and sorted(after.parts) == [(0, 3), (1, 3)]
    assert all("-s3-" in n or "/D" in n for n in names(R2))
    assert g.tidy_round("job", R2, 2) == 0
    # judged against the node count the round records, not the caller's
    assert g.tidy_round("job", R2, 5) == 0 and g.inspect_round("job", R2).complete_step == 3
    for r in range(2):
        restored = restore_into(g, tmp_path / f"new{r}", "job", R2, r, 3)
        assert tree_of(Path(restored.data)) == tree_of(Path(s[(r, 3)].data))
    # a round with two complete steps keeps both
    for key in sorted(s):
        g.upload_shard(s[key], R3, nodes=2)
    assert g.tidy_round("job", R3, 2) == 0
    assert sorted(g.inspect_round("job", R3).parts) == sorted(s)


def test_cancel_stops_an_upload_before_the_pointer(fake_gcs, tmp_path):
    g = backend(fake_gcs, threads=1)
    shard = make_shard(tmp_path / "n0", "job", 0, 5, orbax_files(4, big=6 * MiB))
    cancel = threading.Event()
    with pytest.raises(Cancelled):
        g.upload_shard(shard, R1, nodes=1, cancel=cancel, on_bytes=lambda n: cancel.set())
    assert g.inspect_round("job", R1, nodes=1).ranks_present() == []


def test_restore_version(fake_gcs, tmp_path):
    g = backend(fake_gcs)
    s5 = make_shard(tmp_path / "a", "job", 0, 5, orbax_files(5))
    g.upload_shard(s5, R1, nodes=1)
    s6 = make_shard(tmp_path / "b", "job", 0, 6, {"6/x": b"six"})
    g.upload_shard(s6, R2, nodes=1)
    assert g.read_restore_version("job") is None
    assert g.choose_restore("job", 1).round == R2
    g.write_restore_version("job", R1)
    blob = fake_gcs.client().bucket(fake_gcs.bucket).blob("job/restore.version")
    assert blob.download_as_bytes() == R1.encode()
    choice = g.choose_restore("job", 1)
    assert (choice.round, choice.step, choice.forced) == (R1, 5, True)
    # an operator's file with a trailing newline works too
    blob.upload_from_string(R1 + "\n")
    assert g.choose_restore("job", 1).round == R1
    # a missing round: nothing, no fallback
    g.write_restore_version("job", R3)
    choice = g.choose_restore("job", 1)
    assert choice.round is None and choice.forced and "does not exist" in choice.reason
    # an incomplete round: nothing, no fallback
    fake_gcs.client().bucket(fake_gcs.bucket).blob(f"job/{R2}/job-s6-n0-w0.meta").delete()
    g.write_restore_version("job", R2)
    choice = g.choose_restore("job", 1)
    assert choice.round is None and "incomplete" in choice.reason
    blob.upload_from_string("garbage")
    assert g.choose_restore("job", 1).round is None
    assert g.delete_restore_version("job") is True
    assert g.delete_restore_version("job") is False
    assert g.choose_restore("job", 1).round == R1


def test_rendezvous(fake_gcs):
    g = backend(fake_gcs, "p")
    assert g.read_address("job", 0) is None
    t0 = time.time()
    with pytest.raises(TimeoutError):
        g.wait_for_address("job", 0, timeout=0.3, poll=0.1)
    g.publish_address("job", 0, "10.1.2.3:7000", incarnation="one")
    g.publish_address("job", 2, "10.1.2.5:7000", incarnation="two")
    rec = g.read_address("job", 0)
    assert rec.address == "10.1.2.3:7000" and rec.rank == 0 and rec.written >= t0 - 1
    assert g.wait_for_address("job", 0, timeout=1).incarnation == "one"
    # a record older than this start is a previous run's: keep waiting
    with pytest.raises(TimeoutError):
        g.wait_for_address("job", 0, timeout=0.3, poll=0.1, newer_than=time.time() + 60)
    names = {b.name for b in fake_gcs.client().list_blobs(fake_gcs.bucket)}
    assert names == {"p/job/.tierfs/nodes/0", "p/job/.tierfs/nodes/2"}
    # the rendezvous directory is not a round
    assert g.list_round_names("job") == []


def test_retries_on_429_503_and_connection_resets(fake_gcs, tmp_path, monkeypatch):
    faults = {0: 503, 1: 429, 2: "reset", 5: 503, 9: "reset", 12: 500}
    with FaultyProxy(fake_gcs.url, lambda method, path, n: faults.get(n)) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        g = backend(fake_gcs, retry_deadline=30)
        shard = make_shard(tmp_path / "n0", "job", 0, 5, orbax_files(6))
        g.upload_shard(shard, R1, nodes=1)
        restored = restore_into(g, tmp_path / "new", "job", R1, 0, 5)
        assert tree_of(Path(restored.data)) == tree_of(Path(shard.data))
        assert len(proxy.faults) == len(faults)


def test_gives_up_after_the_deadline(fake_gcs, tmp_path, monkeypatch):
    with FaultyProxy(fake_gcs.url, lambda method, path, n: 503) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        g = backend(fake_gcs, retry_deadline=1.5)
        t0 = time.monotonic()
        with pytest.raises(Exception) as exc:
            g.list_round_names("job")
        assert time.monotonic() - t0 < 10
        assert len(proxy.faults) >= 2  # it did retry
        assert "503" in describe_error(exc.value) or "unreachable" in describe_error(exc.value)


def test_emulator_stopped_then_back(fake_gcs, tmp_path):
    g = backend(fake_gcs, retry_deadline=1.0)
    shard = make_shard(tmp_path / "n0", "job", 0, 5, orbax_files(7))
    fake_gcs.stop()
    t0 = time.monotonic()
    with pytest.raises(Exception) as exc:
        g.upload_shard(shard, R1, nodes=1)
    assert time.monotonic() - t0 < 15
    assert "unreachable" in describe_error(exc.value)
    fake_gcs.start()  # same port, objects kept
    g.upload_shard(shard, R1, nodes=1)
    assert g.inspect_round("job", R1).complete


def test_delete_round(fake_gcs, tmp_path):
    g = backend(fake_gcs)
    shard = make_shard(tmp_path / "n0", "job", 0, 5, orbax_files(8))
    g.upload_shard(shard, R1, nodes=1)
    g.upload_shard(shard, R2, nodes=1)
    deleted = []
    assert g.delete_round("job", R1, on_object=deleted.append) == 7
    assert deleted[0].endswith(".meta")  # the pointer goes first
    assert g.list_round_names("job") == [R2]


def test_round_written_by_mtc_is_readable(fake_gcs, tmp_path):
    """A round without tierfs manifests (MTC's replicator wrote it) restores from the
    crc32c GCS keeps per object."""
    b = fake_gcs.client().bucket(fake_gcs.bucket)
    h = "D" + "c" * 64
    b.blob(f"job/{R1}/job-s9-n0-w0.meta").upload_from_string(h)
    b.blob(f"job/{R1}/{h}.data/state/a").upload_from_string(b"alpha")
    b.blob(f"job/{R1}/{h}.data/_CHECKPOINT_METADATA").upload_from_string(b"{}")
    g = backend(fake_gcs)
    choice = g.choose_restore("job", 1)
    assert (choice.round, choice.step) == (R1, 9)
    shard = restore_into(g, tmp_path / "new", "job", R1, 0, 9, framework="orbax")
    assert shard.manifest.name == "9"
    assert Path(shard.data, "9/state/a").read_bytes() == b"alpha"


# ---------------------------------------------------------------------- a hanging bucket


#: how much longer than its deadline a bounded call may take on a busy machine (a
#: deadline of a few seconds; the bug these tests catch took the 120 s read timeout)
SLACK = 3.0


def _timed(fn) -> tuple[float, BaseException | None]:
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return time.monotonic() - t0, exc
    return time.monotonic() - t0, None


def test_bounded_calls_end_within_their_deadline_when_the_bucket_hangs(fake_gcs, tmp_path):
    """Regression: bounded() only shortened the retry deadline; every request still
    waited up to the 120 s read timeout, so with the emulator SIGSTOPped a
    restore.version read bounded to 3 s took 120 s."""
    g = backend(fake_gcs)  # retry deadline 15 s (the fixture's), read timeout 120 s
    shard = make_shard(tmp_path / "n0", "job", 0, 5, orbax_files(9))
    g.upload_shard(shard, R1, nodes=1)
    assert g.monitor is not None and g.monitor.last_answer > 0
    fake_gcs.freeze()
    try:
        b = g.bounded(3)
        for call in (
            lambda: b.read_restore_version("job"),
            lambda: b.bucket_exists(),
            lambda: b.choose_restore("job", 1),
            lambda: b.list_rounds("job"),
        ):
            took, exc = _timed(call)
            assert 2.5 < took < SLACK * 3, took
            if exc is not None:  # list_rounds reports per round; the listing itself raises
                assert "unreachable" in describe_error(exc), describe_error(exc)
                from tierfs.backup.bucket import is_transient

                assert is_transient(exc)
        # the plain backend: each request within its retry deadline, not 120 s
        short = backend(fake_gcs, retry_deadline=2)
        took, exc = _timed(lambda: short.list_round_names("job"))
        assert exc is not None and 1.5 < took < SLACK * 2, took
        # an upload: the resumable session start and each chunk within the deadline
        big = make_shard(tmp_path / "n1", "job", 0, 6, {"6/big": os.urandom(9 * MiB)})
        took, exc = _timed(lambda: short.upload_shard(big, R2, nodes=1))
        assert exc is not None and took < SLACK * 2, took
        # requests waiting without an answer show up in the monitor
        waiting = backend(fake_gcs, retry_deadline=6)
        t = threading.Thread(target=lambda: _timed(lambda: waiting.read_restore_version("job")))
        t.start()
        monitor = waiting.monitor
        assert monitor is not None
        seen = False
        while t.is_alive() and not seen:  # the request waits up to its 6 s deadline
            seen = monitor.in_flight() >= 1 and monitor.stalled_for() >= 1.0
            time.sleep(0.01)
        t.join()
        assert seen, "the monitor never showed the waiting request"
        assert b.monitor is g.monitor  # one monitor per client session
    finally:
        fake_gcs.thaw()
    before = g.monitor.last_answer
    assert g.read_restore_version("job") is None
    assert g.monitor.last_answer > before and g.monitor.stalled_for() == 0.0


def test_each_resumable_chunk_gets_the_whole_retry_deadline(fake_gcs, tmp_path):
    """The per-request deadline caps every HTTP attempt; a resumable upload's chunks
    are separate requests, so a file whose upload as a whole lasts longer than
    the deadline still goes through (here each 1 MiB chunk is held 0.4 s before
    it is sent, through the progress callback)."""
    g = backend(fake_gcs, retry_deadline=1.5)
    shard = make_shard(tmp_path / "n0", "job", 0, 5, {"5/big": os.urandom(10 * MiB)})
    took, exc = _timed(
        lambda: g.upload_shard(shard, R1, nodes=1, on_bytes=lambda n: time.sleep(0.4))
    )
    assert exc is None, describe_error(exc)
    assert took > 3  # ten chunks at 0.4 s each: longer than the 1.5 s deadline
    assert g.inspect_round("job", R1).complete


def test_is_transient():
    from google.api_core import exceptions as gexc
    from requests.exceptions import ConnectionError as RequestsConnectionError

    from tierfs.backup.bucket import BucketTimeout, is_transient

    assert is_transient(gexc.RetryError("gave up", None))
    assert is_transient(BucketTimeout("no answer"))
    assert is_transient(gexc.ServiceUnavailable("503"))
    assert is_transient(RequestsConnectionError("refused"))
    assert not is_transient(gexc.NotFound("no bucket"))
    assert not is_transient(gexc.Forbidden("denied"))
    assert not is_transient(ChecksumMismatch("differs"))
    assert not is_transient(Cancelled("cancelled"))
    assert not is_transient(FileNotFoundError("gone"))
