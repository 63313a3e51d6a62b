"""The GCS tier with four real daemons (peer plane on 127.0.0.1, fake-gcs-server):
backup rounds ordered by the coordinator, the loss of every RAM tier, a round
cut off by kill -9, restore.version through the coordinator's decision and
barrier, and the bucket going away during a round."""

from __future__ import annotations

import os
import shutil
import time

import pytest
from conftest import tierfs
from gcs_cluster import (
    all_nodes,
    backed_up,
    errors,
    gcs_status,
    handshake,
    save,
    status,
    step_files,
    wait_for,
)
from gcs_fixtures import FaultyProxy
from peer_cluster import Cluster

from tierfs.backup.bucket import GcsBackend, GcsSettings

pytestmark = pytest.mark.slow

N = 4
YAML = ("backup-interval-steps: 1",)


@pytest.fixture(autouse=True)
def _quick(monkeypatch):
    """The GCS tiers tick every half second."""
    monkeypatch.setenv("TIERFS_GCS_TICK", "0.5")


def start(make_mount, bucket: str, env_for=None) -> Cluster:
    """Four daemons with ``--bucket``; ``env_for(i)`` may give node i other environment."""
    c = Cluster(make_mount, N, extra=("--bucket", bucket), start=False)
    for i in range(N):
        saved = dict(os.environ)
        try:
            if env_for is not None:
                os.environ.update(env_for(i))
            c.mounts.append(make_mount(*c.args(i), name=f"node{i}"))
        finally:
            os.environ.clear()
            os.environ.update(saved)
    return c


def handshake_all(c: Cluster) -> list[dict]:
    return all_nodes(lambda r: handshake(c.root(r), r, N, extra=YAML), N)


def save_all(c: Cluster, step: int, seed: str = "g", size: int = 100_000) -> None:
    all_nodes(lambda r: save(c.root(r), step, step_files(r, step, size, seed)), N)


def round_of(c: Cluster, step: int, timeout: float = 60) -> str:
    """Wait until every node uploaded ``step``; returns the (common) round name."""
    names = [
        wait_for(
            lambda i=i: backed_up(c.root(i), step), timeout, f"node {i}: step {step} backed up"
        )
        for i in range(N)
    ]
    assert len(set(names)) == 1, names  # the same round name on every node
    return names[0]


def restart_all(c: Cluster, wipe: bool) -> None:
    for m in c.mounts:
        m.unmount()
        if wipe:
            shutil.rmtree(m.ram_dir)
    for m in c.mounts:
        m.mount()


@pytest.mark.long(minutes=2)
def test_four_nodes_survive_losing_every_ram_tier(make_mount, fake_gcs):
    g = GcsBackend(fake_gcs.bucket, settings=GcsSettings.from_env())
    c = start(make_mount, fake_gcs.bucket)
    assert [r["restored"] for r in handshake_all(c)] == [None] * N
    rounds = {}
    for step in (1, 2):
        save_all(c, step)
        rounds[step] = round_of(c, step)
    assert rounds[1] < rounds[2]
    info = g.inspect_round("job", rounds[2], N)
    assert info.complete_step == 2 and info.ranks_complete(2) == [0, 1, 2, 3]
    assert gcs_status(c.root(0))["role"] == "decides rounds"
    assert gcs_status(c.root(1))["role"] == "follows node-rank 0's rounds"
    # the rounds went through the coordinator's sync round, not through the bucket
    book = c.peer(0)["coordinator_state"]["backups"]
    assert [r["round"] for r in book["rounds"]] == [rounds[1], rounds[2]]
    wait_for(
        lambda: all(gcs_status(c.root(i))["last_state"] == "complete" for i in range(N)),
        30,
        "every node to learn that the round is complete",
    )
    # node-rank 0 indexed the complete round (#17): each node's part in two GETs
    wait_for(
        lambda: all(g.indexes.read_part("job", rounds[2], r, 2, N) is not None for r in range(N)),
        30,
        f"round {rounds[2]} indexed",
    )
    assert not [b.name for b in g.client.list_blobs(g.bucket, prefix="job/.tierfs/rounds")]
    out = " ".join(tierfs("status", str(c.root(1))).stdout.split())  # rich wraps lines
    assert f"last round {rounds[2]} step 2: complete" in out
    assert "(found through the bucket)" not in out and "replicates to [0]" in out

    # every daemon dies and every RAM tier is wiped: the bucket brings step 2 back
    for i in range(N):
        c.lose(i)
    for i in range(N):
        c.remount(i)
    again = handshake_all(c)
    for r, res in enumerate(again):
        assert res["restored"] == 2, c.logs()
        assert res["files"] == step_files(r, 2), f"node {r} restored other bytes"
        assert f"restore-backup: {rounds[2]}" in res["prerestore"]
        assert status(c.root(r))["restore"]["source"] == "gcs"
        # through the round index, not a listing of the whole round per node (#17)
        assert f"round {rounds[2]}: rank {r}'s part read through the round index" in (
            c.mounts[r].log()
        ), c.logs()

    # restore.version forces the older round for every node, although step 2 is
    # complete in the cluster
    g.write_restore_version("job", rounds[1])
    restart_all(c, wipe=False)
    forced = handshake_all(c)
    for r, res in enumerate(forced):
        assert res["restored"] == 1 and res["files"] == step_files(r, 1), c.logs()
        assert f"restore-backup: {rounds[1]}" in res["prerestore"]
    assert g.read_restore_version("job") == rounds[1]
    # training goes on from step 1; once every node sealed and replicated a newer
    # step, node-rank 0 deletes restore.version and the new step is backed up
    save_all(c, 2, seed="second timeline")
    wait_for(lambda: g.read_restore_version("job") is None, 60, "restore.version deleted")
    new2 = round_of(c, 2)
    assert new2 > rounds[2]

    # restore.version naming a round that does not exist: nothing, no fallback
    g.write_restore_version("job", "2031-01-01_00-00")
    restart_all(c, wipe=False)
    nothing = handshake_all(c)
    for r, res in enumerate(nothing):
        assert res["restored"] is None, c.logs()
        assert res["markers"] == [f"job-s0-n{r}-w0.restore"]
        assert "2031-01-01_00-00, which does not exist" in res["errors"]


@pytest.mark.long
def test_round_cut_off_by_kill_9_is_never_chosen(make_mount, fake_gcs):
    g = GcsBackend(fake_gcs.bucket, settings=GcsSettings.from_env())

    def slow_uploads(method, path, n):
        return 1.0 if path.startswith("/upload/") else None

    with FaultyProxy(fake_gcs.url, slow_uploads) as proxy:
        # node 3 reaches the bucket through a proxy that delays every upload by 1 s
        c = start(
            make_mount,
            fake_gcs.bucket,
            env_for=lambda i: {"STORAGE_EMULATOR_HOST": proxy.url} if i == 3 else {},
        )
        handshake_all(c)
        save_all(c, 1)
        first = round_of(c, 1, timeout=90)
        save_all(c, 2)
        wait_for(
            lambda: any(u["step"] == 2 for u in gcs_status(c.root(3))["uploads"]),
            60,
            "node 3 uploading step 2",
        )
        c.mounts[3].kill9()
        second = wait_for(lambda: backed_up(c.root(0), 2), 60, "node 0 uploaded step 2")
    for i in (1, 2):
        assert wait_for(lambda i=i: backed_up(c.root(i), 2), 60, "step 2 uploaded") == second
    info = g.inspect_round("job", second, N)
    assert not info.complete and 3 not in info.ranks_present(2)
    # lose every RAM tier: the newest *complete* round is restored, not the cut-off one
    for i in range(3):
        c.lose(i)
    shutil.rmtree(c.mounts[3].ram_dir)
    for i in range(N):
        c.remount(i)
    again = handshake_all(c)
    for r, res in enumerate(again):
        assert res["restored"] == 1, c.logs()
        assert res["files"] == step_files(r, 1)
        assert f"restore-backup: {first}" in res["prerestore"]


@pytest.mark.long
def test_bucket_lost_during_a_round(make_mount, fake_gcs, monkeypatch):
    monkeypatch.setenv("TIERFS_GCS_RETRY_DEADLINE", "3")
    g = GcsBackend(fake_gcs.bucket, settings=GcsSettings.from_env())

    def slow_uploads(method, path, n):
        return 0.7 if path.startswith("/upload/") else None

    with FaultyProxy(fake_gcs.url, slow_uploads) as proxy:
        c = start(
            make_mount, fake_gcs.bucket, env_for=lambda i: {"STORAGE_EMULATOR_HOST": proxy.url}
        )
        handshake_all(c)
        save_all(c, 1)
        round_of(c, 1, timeout=90)
        save_all(c, 2)
        wait_for(
            lambda: any(gcs_status(c.root(i))["uploads"] for i in range(N)),
            60,
            "a node uploading step 2",
        )
        fake_gcs.stop()
        # training goes on: saves land in RAM and are replicated while the bucket is gone
        save_all(c, 3)
        c.wait_synced(3)

        def lost_step_2(i: int) -> bool:
            # that line, not any "bucket unreachable" (a busy node may also have
            # written one at mount, when its first bucket check timed out)
            return any(
                "backup of step 2" in line and "bucket unreachable" in line
                for line in errors(c.root(i)).splitlines()
            )

        failed = wait_for(
            lambda: [i for i in range(N) if lost_step_2(i)],
            60,
            "a node reporting the unreachable bucket for step 2",
        )
        for i in failed:
            assert "bucket unreachable" in (gcs_status(c.root(i))["last_error"] or "")
        for i in range(N):
            steps = {s["step"]: s for s in status(c.root(i))["steps"]}
            assert steps[3]["state"] == "replicated"  # nothing lost, nothing waited
        fake_gcs.start()
        # the cut-off round is closed once the outcomes reach the bucket; the next
        # round then backs up the newest replicated step
        save_all(c, 4)
        last = round_of(c, 4, timeout=90)
    choice = g.choose_restore("job", N)
    assert (choice.round, choice.step) == (last, 4)


def test_restore_version_goes_through_the_coordinator(make_mount, fake_gcs):
    """restore.version names an older round while newer steps are complete in the
    cluster: every node restores that round's step in one coordinator round (same
    decision, same barrier); a missing round means the empty s0 marker everywhere."""
    g = GcsBackend(fake_gcs.bucket, settings=GcsSettings.from_env())
    c = start(make_mount, fake_gcs.bucket)
    handshake_all(c)
    rounds = {}
    for step in (1, 2):
        save_all(c, step)
        rounds[step] = round_of(c, step)
    save_all(c, 3)
    c.wait_synced(3)  # step 3 is complete in the cluster
    g.write_restore_version("job", rounds[1])
    forced = handshake_all(c)  # the job restarts; the daemons keep their RAM
    for r, res in enumerate(forced):
        assert res["restored"] == 1, c.logs()
        assert res["markers"] == [f"job-s1-n{r}-w0.restore"]
        assert res["files"] == step_files(r, 1)
        assert f"restore-backup: {rounds[1]}" in res["prerestore"]
        assert "restore-step: 1" in res["prerestore"]
        assert status(c.root(r))["restore"]["backup"] == rounds[1]
    coord = c.peer(0)["coordinator_state"]
    rnd = coord["round"]
    assert rnd["joined"] == [0, 1, 2, 3] and rnd["done"] == [0, 1, 2, 3]
    assert rnd["step"] == 1 and f"restore.version: round {rounds[1]} step 1" in rnd["reason"]
    assert [d["step"] for d in coord["decisions"] if d["round"] == rnd["number"]] == [1]

    # a round that does not exist: every node publishes the empty s0 marker and says why
    g.write_restore_version("job", "2031-01-01_00-00")
    nothing = handshake_all(c)
    for r, res in enumerate(nothing):
        assert res["restored"] is None, c.logs()
        assert res["markers"] == [f"job-s0-n{r}-w0.restore"]
        assert res["prerestore"].strip() == "{}"
        assert "restore.version names round 2031-01-01_00-00, which does not exist" in res["errors"]
    rnd = c.peer(0)["coordinator_state"]["round"]
    assert rnd["step"] is None and rnd["done"] == [0, 1, 2, 3]
    assert "2031-01-01_00-00, which does not exist" in rnd["reason"]


@pytest.mark.long
def test_after_a_restore_to_an_older_step_new_steps_replicate_and_win(make_mount, fake_gcs):
    """Regression (found by trying it as a user): restore.version rolled the job back
    to an older round while newer steps were complete in the cluster. The abandoned
    newer steps stayed in RAM, retention kept them instead of the job's new steps,
    which were therefore never replicated or backed up, restore.version was never
    deleted, and the next restart went back to the abandoned history."""
    g = GcsBackend(fake_gcs.bucket, settings=GcsSettings.from_env())
    c = start(make_mount, fake_gcs.bucket)
    handshake_all(c)
    save_all(c, 1)
    first = round_of(c, 1)
    for step in (2, 3, 4):
        save_all(c, step)
    c.wait_synced(4)
    g.write_restore_version("job", first)
    assert [res["restored"] for res in handshake_all(c)] == [1] * N
    # the job goes on from step 1: its new step 2 replaces the abandoned 2, 3 and 4
    save_all(c, 2, seed="new")
    c.wait_synced(2)
    for r in range(N):
        wait_for(lambda r=r: backed_up(c.root(r), 2), 60, f"node {r}: new step 2 backed up")
    wait_for(lambda: g.read_restore_version("job") is None, 60, "restore.version deleted")
    again = handshake_all(c)
    for r, res in enumerate(again):
        assert res["restored"] == 2, c.logs()
        assert res["files"] == step_files(r, 2, seed="new")


@pytest.mark.long(minutes=2)
def test_a_step_saved_again_after_a_restore_is_backed_up_again(make_mount, fake_gcs):
    """Regression (issue #16, third trial): after a restore the coordinator's backup
    schedule knew the restored step's number but not its bytes, so the same step
    saved again with other bytes was never backed up; after a cluster-wide loss the
    bucket's first save of it was restored with exit 0 (wrong data, no reason)."""
    g = GcsBackend(fake_gcs.bucket, settings=GcsSettings.from_env())
    c = start(make_mount, fake_gcs.bucket)
    handshake_all(c)
    save_all(c, 1)
    first = round_of(c, 1)
    # every daemon restarts (RAM kept): step 1 restored, then saved again in place
    restart_all(c, wipe=False)
    assert [res["restored"] for res in handshake_all(c)] == [1] * N, c.logs()
    for r in range(N):
        shutil.rmtree(c.root(r) / "1")
    save_all(c, 1, seed="second")
    again = [
        wait_for(
            lambda i=i: (backed_up(c.root(i), 1) or first) > first and backed_up(c.root(i), 1),
            90,
            f"node {i}: the second save of step 1 backed up",
        )
        for i in range(N)
    ]
    assert len(set(again)) == 1, again
    assert g.inspect_round("job", again[0], N).complete_step == 1
    # the whole cluster's RAM is lost: the bucket brings back the second save
    for i in range(N):
        c.lose(i)
    for i in range(N):
        c.remount(i)
    for r, res in enumerate(handshake_all(c)):
        assert res["restored"] == 1, c.logs()
        assert res["files"] == step_files(r, 1, seed="second"), f"node {r}: the first save"
        assert f"restore-backup: {again[0]}" in res["prerestore"]


@pytest.mark.long
def test_hanging_bucket_costs_at_most_its_deadlines(make_mount, fake_gcs, monkeypatch):
    """Regressions with the emulator SIGSTOPped (connections hang): (1) the round of
    step 2 failed on the nodes and was never tried again once the bucket came
    back; (2) a job restart with every step in the cluster's RAM waited for the
    coordinator's restore.version read, 120 s (the read timeout) instead of
    TIERFS_GCS_FALLBACK_DEADLINE, and failed with --join-timeout below that."""
    monkeypatch.setenv("TIERFS_GCS_FALLBACK_DEADLINE", "4")
    monkeypatch.setenv("TIERFS_GCS_RETRY_DEADLINE", "4")
    monkeypatch.setenv("TIERFS_GCS_UPLOAD_RETRY_MAX", "3")
    monkeypatch.setenv("TIERFS_GCS_STALL_SECONDS", "2")
    g = GcsBackend(fake_gcs.bucket, settings=GcsSettings.from_env())
    c = start(make_mount, fake_gcs.bucket)
    handshake_all(c)
    save_all(c, 1)
    round_of(c, 1)
    fake_gcs.freeze()
    try:
        save_all(c, 2)
        c.wait_synced(2)
        failed = wait_for(
            lambda: [i for i in range(N) if "backup of step 2" in errors(c.root(i))],
            30,
            "a failed upload of step 2",
        )
        assert all("trying again" in errors(c.root(i)) for i in failed)
        assert any(gcs_status(c.root(i))["problem"] for i in range(N))
    finally:
        fake_gcs.thaw()
    t0 = time.monotonic()
    second = round_of(c, 2, timeout=40)  # no new save: the failed parts are tried again
    print(f"round of step 2 complete {time.monotonic() - t0:.1f} s after the bucket came back")
    assert g.inspect_round("job", second, N).complete_step == 2
    wait_for(
        lambda: all(gcs_status(c.root(i))["problem"] is None for i in range(N)),
        20,
        "every node's bucket problem to clear",
    )

    fake_gcs.freeze()
    try:
        t0 = time.monotonic()
        again = handshake_all(c)  # the job restarts; every step is in the cluster's RAM
        took = time.monotonic() - t0
        print(f"restart with a hanging bucket decided in {took:.1f} s")
        for r, res in enumerate(again):
            assert res["restored"] == 2 and res["files"] == step_files(r, 2), c.logs()
        assert took < 60  # 4 s of fallback deadline, not the 120 s read timeout (busy CI: slack)
        assert "cannot read restore.version" in (gcs_status(c.root(0))["last_error"] or "")
        wait_for(
            lambda: "cannot read restore.version" in errors(c.root(0)),
            60,
            "the line in replicator.errors",
        )
    finally:
        fake_gcs.thaw()
