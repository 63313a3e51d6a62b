"""Issue #19 cases 3 to 6: every node of a job restores the same step, the newest one
complete counting every copy in RAM, on peers and in the bucket, and every fresh start
is either truly fresh or explained (real daemons on 127.0.0.1, real fake-gcs-server)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import tierfs
from gcs_cluster import wait_for
from gcs_fixtures import FaultyProxy
from peer_cluster import Cluster, flip_byte, job_args, tree_hashes

from tierfs.backup.bucket import GcsBackend, GcsSettings

pytestmark = pytest.mark.slow

N = 4


def generic(n: int, *more: str):
    return job_args("hf", n, *more)


def write_step(root: Path, step: int, rank: int, size: int = 50_000) -> dict[str, str]:
    """An HF-style step (tmp dir renamed to checkpoint-N); returns its files' sha256."""
    tmp = root / f"tmp-checkpoint-{step}"
    tmp.mkdir()
    data = hashlib.sha256(f"{rank}-{step}".encode()).digest() * (size // 32)
    (tmp / "weights.bin").write_bytes(data)
    (tmp / "trainer_state.json").write_text(json.dumps({"global_step": step, "rank": rank}))
    os.rename(tmp, root / f"checkpoint-{step}")
    return tree_hashes(root / f"checkpoint-{step}")


def steps_of(c: Cluster, i: int) -> dict[int, dict]:
    return {s["step"]: s for s in c.status(i)["steps"]}


def backed_up(c: Cluster, i: int, step: int) -> str | None:
    for s in c.status(i)["tiers"]["gcs"].get("steps", []):
        if s["step"] == step:
            return s["where"][0].removeprefix("gcs:")
    return None


def wait_restored(c: Cluster, i: int, timeout: float = 120) -> dict:
    wait_for(
        lambda: c.status(i)["restore"].get("state") in ("done", "failed"),
        timeout,
        f"node {i}'s restore to finish",
    )
    return c.status(i)["restore"]


@pytest.mark.long
def test_generic_restore_waits_for_a_slow_bucket_and_every_node_restores_the_same_step(
    make_mount, fake_gcs, monkeypatch
):
    """Case 3: 4 nodes with a bucket, every RAM store wiped, all remounted at about the
    same time. Node 0's bucket check answered late, the coordinator decided before its
    GCS tier was up (with node 0 counted through its heartbeat's empty inventory):
    nodes 1-3 started from nothing while node 0 restored the step from the bucket.
    The bucket's first answer to node 0 is delayed here, so it failed every time."""
    monkeypatch.setenv("TIERFS_GCS_TICK", "0.5")
    c = Cluster(
        make_mount,
        N,
        extra=("--bucket", fake_gcs.bucket),
        node_args=generic(N, "--backup-interval-steps", "1"),
    )
    saved = write_all(c, 1)
    rnd = backed_up(c, 0, 1)
    for i in range(N):
        c.lose(i)

    def slow_first_answer(method, path, n):
        # n 0: `tierfs mount`'s check before it starts the daemon; n 1: the daemon's own
        # check at start. Meanwhile nodes 1-3 join (they retry every 2 s at most).
        return 12.0 if n == 1 else None

    with FaultyProxy(fake_gcs.url, slow_first_answer) as proxy:
        for i in (1, 2, 3):
            c.remount(i)
        saved_env = dict(os.environ)
        try:
            os.environ["STORAGE_EMULATOR_HOST"] = proxy.url
            os.environ["TIERFS_GCS_START_DEADLINE"] = "20"
            c.remount(0)
        finally:
            os.environ.clear()
            os.environ.update(saved_env)
        outcomes = [wait_restored(c, i) for i in range(N)]
    for i, restore in enumerate(outcomes):
        assert (restore["state"], restore["step"]) == ("done", 1), (i, restore, c.logs())
        assert restore["backup"] == rnd
        assert tree_hashes(c.root(i) / "checkpoint-1") == saved[i]
        assert wait_code(c, i, 10) == (0, f"restored step 1 from GCS round {rnd}", "")
    decisions = c.peer(0)["coordinator_state"]["decisions"]
    assert [d["step"] for d in decisions] == [1], decisions


# ---------------------------------------------------------------------- helpers


def gcs(fake_gcs) -> GcsBackend:
    return GcsBackend(fake_gcs.bucket, settings=GcsSettings.from_env())


def data_objects(g: GcsBackend, job: str, rnd: str, rank: int, step: int, nodes: int) -> list[str]:
    """Object names (under the round dir) of node ``rank``'s data in round ``rnd``."""
    part = g.inspect_round(job, rnd, nodes).parts[(rank, step)]
    assert part.backup is not None
    return sorted(part.backup.objects.values())


def flip_object(fake_gcs, g: GcsBackend, job: str, rnd: str, name: str) -> None:
    """Flip a bit in an object as the emulator stores it (its recorded crc32c stays)."""
    path = Path(fake_gcs.root) / "data" / fake_gcs.bucket / g.spec.round_dir(job, rnd) / name
    flip_byte(path, offset=10)


def wait_code(c: Cluster, i: int, timeout: float = 120) -> tuple[int, str, str]:
    """`tierfs wait` on node i: (exit code, stdout, stderr)."""
    p = tierfs("wait", str(c.root(i)), "--timeout", str(timeout), check=False, timeout=timeout + 30)
    return p.returncode, p.stdout.strip(), p.stderr.strip()


def status_text(c: Cluster, i: int) -> str:
    """`tierfs status` as one line (a wide terminal: rich wraps long names otherwise)."""
    out = tierfs("status", str(c.root(i)), env={**os.environ, "COLUMNS": "1000"}).stdout
    return " ".join(out.split())


def write_all(c: Cluster, step: int, ranks=None, backed=True) -> dict[int, dict[str, str]]:
    ranks = range(c.n) if ranks is None else ranks
    saved = {i: write_step(c.root(i), step, i) for i in ranks}
    if backed:
        for i in ranks:
            wait_for(lambda i=i: backed_up(c, i, step), 90, f"node {i}: step {step} backed up")
    return saved


def shard_data(c: Cluster, holder: int, rank: int, step: int) -> Path:
    return (
        c.mounts[holder].ram_dir
        / "store"
        / "shards"
        / "hf"
        / str(rank)
        / str(step)
        / "data"
        / f"checkpoint-{step}"
        / "weights.bin"
    )


# ---------------------------------------------------------------------- cases 4 and 5


@pytest.mark.long
def test_wait_outcomes_fresh_restored_missing_refused(make_mount, monkeypatch):
    """Case 5: `tierfs wait` printed "nothing to restore" and exited 0 after a node never
    joined and after the coordinator refused the node (node count mismatch)."""
    monkeypatch.setenv("TIERFS_REFUSAL_GRACE", "2")
    c = Cluster(make_mount, 3, node_args=generic(3))
    for i in range(3):  # nothing of the job exists anywhere: a true fresh start
        code, out, _err = wait_code(c, i)
        assert code == 0 and out.startswith("nothing to restore: no step of the job exists"), (
            i,
            out,
        )
        assert c.status(i)["restore"]["outcome"] == "fresh"
    saved = write_all(c, 1, backed=False)
    wait_for(
        lambda: all(steps_of(c, i).get(1, {}).get("state") == "replicated" for i in range(3)),
        60,
        "step 1 replicated",
    )
    c.lose(1)
    c.remount(1)
    assert wait_code(c, 1) == (0, "restored step 1 from peer:0", "")
    assert tree_hashes(c.root(1) / "checkpoint-1") == saved[1]

    c.mounts[2].unmount()  # node 2 is gone for good: the round cannot be agreed
    c.lose(1)
    args = c.mounts[1].args
    args[args.index("--join-timeout") + 1] = "8"
    c.remount(1)
    code, out, err = wait_code(c, 1)
    assert code == 4 and out == "", (code, out, err)
    assert "a node did not join: node-rank(s) [2] did not join within 8 s" in err
    assert "node-rank(s) [2] did not join" in c.errors(1)
    st = c.status(1)["restore"]
    assert (st["state"], st["outcome"]) == ("failed", "missing")
    status = status_text(c, 1)
    assert "restore failed [missing]" in status and "did not join" in status

    c.mounts[1].kill9()
    c.mounts[1].args = [
        *c.args(1)[:-6],
        "--nodes",
        "4",
        "--node-rank",
        "1",
        "--peers-per-node",
        "1",
    ]
    c.remount(1)
    code, out, err = wait_code(c, 1)
    assert code == 5, (code, out, err)
    assert "the coordinator refused this node" in err and "node count mismatch" in err
    assert "node count mismatch" in c.errors(1)


@pytest.mark.long
def test_nodes_that_gave_up_on_a_missing_node_restore_once_it_joins(make_mount):
    """#11 trial: nodes 0 and 1 restarted while node 2 was away; after their join
    timeout both exited 4 ("missing"). When node 2 came back, its join completed the
    round, but the two that had given up were never asked into it again (the
    coordinator summoned only nodes outside an undecided round): node 2 waited out its
    barrier and nodes 0 and 1 stayed failed until someone remounted them. Now the
    coordinator summons them: every node restores the same step, `tierfs wait` exits
    0, and the earlier failure stays in replicator.errors."""
    c = Cluster(make_mount, 3, node_args=generic(3))
    saved = write_all(c, 1, backed=False)
    wait_for(
        lambda: all(steps_of(c, i).get(1, {}).get("state") == "replicated" for i in range(3)),
        60,
        "step 1 replicated",
    )
    c.mounts[2].unmount()  # node 2 goes away (its RAM stays)
    for i in (0, 1):  # a step node 2 never wrote: it can never be complete
        write_step(c.root(i), 2, i)
    wait_for(
        lambda: all(
            steps_of(c, i).get(2, {}).get("state") not in (None, "writing") for i in (0, 1)
        ),
        60,
        "step 2 sealed on nodes 0 and 1",
    )
    for i in (0, 1):
        c.mounts[i].kill9()
    for i in (0, 1):
        args = c.mounts[i].args
        args[args.index("--join-timeout") + 1] = "12"
        c.remount(i)
    for i in (0, 1):
        code, out, err = wait_code(c, i)
        assert code == 4 and out == "", (i, code, out, err, c.logs())
        assert "node-rank(s) [2] did not join within 12 s" in err
        assert c.status(i)["restore"]["outcome"] == "missing"

    c.remount(2)
    for i in (2, 0, 1):
        restore = wait_for(
            lambda i=i: c.status(i)["restore"].get("state") == "done" and c.status(i)["restore"],
            120,
            f"node {i} to restore once node 2 joined",
        )
        assert restore["step"] == 1, (i, restore, c.logs())
        code, out, err = wait_code(c, i, 30)
        # step 2 exists (nodes 0 and 1) but can never be complete: an older step, exit 2
        assert (code, out) == (2, "restored step 1 from local"), (i, code, out, err)
        assert "step 2 lacks rank(s) [2]" in err, err
        assert tree_hashes(c.root(i) / "checkpoint-1") == saved[i]
        assert "restore done: step 1 from local" in status_text(c, i)
    for i in (0, 1):
        # restarted nodes: the step the cluster could not complete is abandoned
        assert 2 not in steps_of(c, i), (i, steps_of(c, i))
        assert "node-rank(s) [2] did not join within 12 s" in c.errors(i)


def test_an_incomplete_bucket_says_why_and_wait_fails(make_mount, fake_gcs, monkeypatch):
    """Case 4: the bucket holds a round of the job, but node 0's data object is missing
    from it (as the data-parallel dedup once left it): nothing is restored, and
    replicator.errors, `tierfs status` and `tierfs wait` say exactly why."""
    monkeypatch.setenv("TIERFS_GCS_TICK", "0.5")
    c = Cluster(
        make_mount,
        2,
        extra=("--bucket", fake_gcs.bucket),
        node_args=generic(2, "--backup-interval-steps", "1"),
    )
    write_all(c, 1)
    rnd = backed_up(c, 0, 1)
    g = gcs(fake_gcs)
    lost = data_objects(g, "hf", rnd, 0, 1, 2)[0]
    g.bucket.blob(g.spec.round_dir("hf", rnd) + lost).delete()
    for i in range(2):
        c.lose(i)
    for i in range(2):
        c.remount(i)
    for i in range(2):
        code, out, err = wait_code(c, i)
        assert code == 3, (i, code, out, err, c.logs())
        assert f"backup round {rnd} (step 1) is incomplete" in err and lost in err
        errors = c.errors(i)
        assert "restore: nothing restored" in errors
        assert f"backup round {rnd} (step 1) is incomplete: rank 0: {lost}: missing" in errors
        st = c.status(i)["restore"]
        assert (st["state"], st["step"], st["outcome"]) == ("done", None, "incomplete")
        status = status_text(c, i)
        assert "nothing restored (incomplete)" in status and lost in status


# ---------------------------------------------------------------------- case 6


@pytest.mark.long
def test_a_corrupt_bucket_object_moves_every_node_to_the_same_older_step(
    make_mount, fake_gcs, monkeypatch
):
    """Case 6, split restore: cluster loss; a bit flipped in one data object of node 3's
    part of the newest round. Node 3 detected it and asked for another step; it
    restored an older step than nodes 0-2, and every `tierfs wait` said 0."""
    monkeypatch.setenv("TIERFS_GCS_TICK", "0.5")
    c = Cluster(
        make_mount,
        N,
        extra=("--bucket", fake_gcs.bucket),
        node_args=generic(N, "--backup-interval-steps", "1"),
    )
    saved = {step: write_all(c, step) for step in (1, 2)}
    rounds = {step: backed_up(c, 0, step) for step in (1, 2)}
    g = gcs(fake_gcs)
    flip_object(fake_gcs, g, "hf", rounds[2], data_objects(g, "hf", rounds[2], 3, 2, N)[0])
    for i in range(N):
        c.lose(i)
    for i in range(N):
        c.remount(i)
    for i in range(N):
        code, out, err = wait_code(c, i)
        # an older step than the ones written (their copies were bad): exit 2
        assert (code, out) == (2, f"restored step 1 from GCS round {rounds[1]}"), (
            i,
            code,
            out,
            err,
            c.logs(),
        )
        assert tree_hashes(c.root(i) / "checkpoint-1") == saved[1][i]
        assert not (c.root(i) / "checkpoint-2").exists()
        assert f"step 2 lacks rank(s) [3] (bad copies: backup round {rounds[2]})" in c.errors(i)
        assert "step 2 lacks rank(s) [3]" in err  # the note on stderr
    assert "crc32c" in c.errors(3)
    decisions = c.peer(0)["coordinator_state"]["decisions"]
    assert [d["step"] for d in decisions][-2:] == [2, 1], decisions


@pytest.mark.long
def test_a_peer_replica_completes_a_step_whose_bucket_object_is_corrupt(
    make_mount, fake_gcs, monkeypatch
):
    """Case 6: nodes 0, 1 and 3 lose their RAM; node 3's part of step 2 in the bucket is
    corrupt, node 2 still holds a replica of it. Step 2 is complete counting every
    copy: ranks 0 and 1 from the bucket, rank 3 from node 2 (it used to fall back to
    step 1 for everyone)."""
    from gcs_cluster import all_nodes, handshake, save, status, step_files

    monkeypatch.setenv("TIERFS_GCS_TICK", "0.5")
    c = Cluster(make_mount, N, extra=("--bucket", fake_gcs.bucket))
    yaml = ("backup-interval-steps: 1",)
    all_nodes(lambda r: handshake(c.root(r), r, N, extra=yaml), N)
    rounds = {}
    for step in (1, 2):
        all_nodes(lambda r, step=step: save(c.root(r), step, step_files(r, step)), N)
        for i in range(N):
            wait_for(lambda i=i, step=step: backed_up(c, i, step), 90, f"step {step} backed up")
        rounds[step] = backed_up(c, 0, step)
    c.wait_synced(2)
    g = gcs(fake_gcs)
    flip_object(fake_gcs, g, "job", rounds[2], data_objects(g, "job", rounds[2], 3, 2, N)[0])
    for i in (0, 1, 3):
        c.lose(i)
    for i in (0, 1, 3):
        c.remount(i)
    again = all_nodes(lambda r: handshake(c.root(r), r, N, extra=yaml), N)
    for r, res in enumerate(again):
        assert res["restored"] == 2, (r, res, c.logs())
        assert res["files"] == step_files(r, 2)
    sources = [status(c.root(r))["restore"]["source"] for r in range(N)]
    assert sources == ["gcs", "gcs", "local", "peer:2"]
    reason = c.peer(0)["coordinator_state"]["round"]["reason"]
    assert f"rank(s) [0, 1] from backup round {rounds[2]}" in reason


def test_retention_keeps_the_steps_a_restore_needs(make_mount, fake_gcs, monkeypatch):
    """Case 6, falling back too far: a bit flipped in node 0's replica of node 1's step 3,
    then node 1 lost; node 0 kept training (step 4) and its --keep-local retention
    dropped its step 2, so node 1 restored step 1 from the bucket although step 2 had
    been complete and replicated. The last complete steps stay until a restore."""
    monkeypatch.setenv("TIERFS_GCS_TICK", "0.5")
    c = Cluster(
        make_mount,
        2,
        extra=("--bucket", fake_gcs.bucket),
        node_args=generic(2, "--backup-interval-steps", "1"),
    )
    saved = {}
    for step in (1, 2, 3):
        saved[step] = write_all(c, step)
        c.wait_synced(step)
    rounds = {step: backed_up(c, 0, step) for step in (1, 2, 3)}
    g = gcs(fake_gcs)
    for step in (2, 3):  # the bucket holds step 1 only
        g.delete_round("hf", rounds[step])
    flip_byte(shard_data(c, 0, 1, 3), offset=10)
    c.lose(1)
    write_step(c.root(0), 4, 0)
    # retention runs right after the seal (and every 2 s)
    wait_for(
        lambda: steps_of(c, 0).get(4, {}).get("state") not in (None, "writing"),
        30,
        "node 0's step 4 sealed",
    )
    assert {2, 3, 4} <= set(steps_of(c, 0)), "retention dropped a step a restore needs"
    c.remount(1)
    # the restarted node first: once it restored, the survivor took part in the round
    # (before the coordinator summoned it, a survivor reports its previous restore)
    for i in (1, 0):
        code, out, err = wait_code(c, i)
        assert (code, out) == (
            2,  # an older step: newer ones lack rank 1
            "restored step 2 from local" if i == 0 else "restored step 2 from peer:0",
        ), (i, code, out, err, c.logs())
    assert tree_hashes(c.root(1) / "checkpoint-2") == saved[2][1]
    assert "step 3 lacks rank(s) [1]" in c.errors(1)


def test_every_node_can_present_the_agreed_step(make_mount, fake_gcs, monkeypatch):
    """Case 6, agreed step missing on a survivor: node 1 fell back to step 3 from the
    bucket while node 0, which kept running, no longer had checkpoint-3 (its trainer
    rotated old checkpoints away, retention dropped the snapshot): node 0 could not
    resume at the agreed step. The survivor takes part and brings step 3 back too."""
    monkeypatch.setenv("TIERFS_GCS_TICK", "0.5")
    c = Cluster(
        make_mount,
        2,
        extra=("--bucket", fake_gcs.bucket),
        node_args=generic(2, "--backup-interval-steps", "1"),
    )
    saved = {step: write_all(c, step) for step in (1, 2, 3, 4, 5)}
    c.wait_synced(5)
    rounds = {step: backed_up(c, 0, step) for step in (3, 4, 5)}
    g = gcs(fake_gcs)
    for step in (4, 5):
        g.delete_round("hf", rounds[step])
        flip_byte(shard_data(c, 0, 1, step), offset=10)  # node 0's replicas of rank 1
    for step in (1, 2, 3):  # the trainer's rotation (save_total_limit 2)
        shutil.rmtree(c.root(0) / f"checkpoint-{step}")
    wait_for(lambda: sorted(steps_of(c, 0)) == [4, 5], 30, "node 0 to keep steps 4 and 5")
    c.lose(1)
    c.remount(1)
    for i in (1, 0):  # the restarted node first (see above)
        code, out, err = wait_code(c, i)
        assert (code, out) == (2, f"restored step 3 from GCS round {rounds[3]}"), (
            i,
            code,
            out,
            err,
            c.logs(),
        )
        assert tree_hashes(c.root(i) / "checkpoint-3") == saved[3][i]
    survivor = c.status(0)["restore"]
    assert survivor["summoned"] and survivor["created"] == ["checkpoint-3"]
    assert (c.root(0) / "checkpoint-5").exists()  # the survivor keeps its newer steps
