"""Backups that hold only what the bytes prove, with two real daemons and the real
fake-gcs-server (issue 19 cases 1 and 2, plain files; the real Orbax client runs
the same input in tests/clients/test_orbax_real.py)."""

from __future__ import annotations

import json

import pytest
from conftest import tierfs
from gcs_cluster import all_nodes, backed_up, errors, handshake, save, step_files, wait_for
from peer_cluster import Cluster

from tierfs.backup.bucket import GcsBackend

pytestmark = pytest.mark.slow

N = 2


@pytest.fixture(autouse=True)
def _quick(monkeypatch):
    monkeypatch.setenv("TIERFS_GCS_TICK", "0.5")


def start(make_mount, bucket: str, *extra: str) -> Cluster:
    return Cluster(make_mount, N, extra=("--bucket", bucket, *extra))


def handshake_all(c: Cluster, *yaml: str) -> list[dict]:
    return all_nodes(lambda r: handshake(c.root(r), r, N, extra=yaml), N)


def rounds_of(g: GcsBackend) -> list:
    return g.list_rounds("job", N)


@pytest.mark.long
def test_data_parallel_nodes_with_different_bytes_each_back_up_their_own(make_mount, fake_gcs):
    """Case 1: assume-data-parallelism 2 on 2 nodes whose step directories differ.
    Before: node 0 wrote a .meta naming node 1's column hash, uploaded nothing, and a
    restart after losing both RAM stores found no complete round (fresh start)."""
    g = GcsBackend(fake_gcs.bucket)
    c = start(make_mount, fake_gcs.bucket)
    yaml = ("assume-data-parallelism: 2", "backup-interval-steps: 1")
    assert [r["restored"] for r in handshake_all(c, *yaml)] == [None, None]
    all_nodes(lambda r: save(c.root(r), 1, step_files(r, 1)), N)  # differ per rank
    names = [
        wait_for(lambda i=i: backed_up(c.root(i), 1), 60, f"node {i}: step 1 backed up")
        for i in range(N)
    ]
    assert names[0] == names[1]
    info = g.inspect_round("job", names[0], N)
    assert info.complete_step == 1
    assert {r: e.backup.uploader for (r, s), e in info.parts.items()} == {0: 0, 1: 1}
    assert info.bytes_of(1) == sum(len(b) for r in range(N) for b in step_files(r, 1).values())
    said = wait_for(
        lambda: [
            line
            for line in errors(c.root(0)).splitlines()
            if "assume-data-parallelism 2 did not hold" in line
        ],
        30,
        "the coordinator's line about the broken assumption",
    )
    assert len(said) == 1 and "node-ranks [0, 1] (uploader 1)" in said[0]
    # step 2: identical bytes on both nodes; node 0 points at node 1's data (proven)
    same = step_files(0, 2)
    all_nodes(lambda r: save(c.root(r), 2, same), N)
    r2, _ = (
        wait_for(lambda i=i: backed_up(c.root(i), 2), 90, f"node {i}: step 2 backed up")
        for i in range(N)
    )
    info = g.inspect_round("job", r2, N)
    assert info.complete_step == 2
    assert {r: e.backup.uploader for (r, s), e in info.parts.items()} == {0: 1, 1: 1}
    assert info.bytes_of(2) == sum(len(b) for b in same.values())  # uploaded once
    assert (
        "uploaded (" in c.mounts[0].log()
        and "data-parallel uploader's, proven" in c.mounts[0].log()
    )
    assert len([line for line in errors(c.root(0)).splitlines() if "did not hold" in line]) == 1
    # both daemons die, both RAM stores are wiped: step 2 comes back from the bucket
    for i in range(N):
        c.lose(i)
    for i in range(N):
        c.remount(i)
    again = handshake_all(c, *yaml)
    for res in again:
        assert res["restored"] == 2, c.logs()
        assert res["files"] == same
        assert f"restore-backup: {r2}" in res["prerestore"]


def held(root) -> set[int]:
    """The steps of its own a node holds in RAM, per its status."""
    st = json.loads((root / ".tierfs" / "status.json").read_text())
    return {s["step"] for s in st["steps"] if "local" in s["where"]}


@pytest.mark.long
def test_steps_sealed_back_to_back_never_leave_a_half_written_round(make_mount, fake_gcs):
    """Case 2, exact input: keep-local 1, backup every step, steps 1-3 sealed back to
    back on node 0 while node 1 is still at step 1. Before: the coordinator ordered
    step 1 (the newest step both had replicated), node 0 had dropped it ("step 1 is
    no longer held on this node"), and the round stayed in the bucket with node 1's
    part only. Now no round starts for a step a node no longer holds; the next
    synced step every node holds is backed up."""
    g = GcsBackend(fake_gcs.bucket)
    c = start(make_mount, fake_gcs.bucket, "--keep-local", "1")
    yaml = ("backup-interval-steps: 1",)
    handshake_all(c, *yaml)
    for step in (1, 2, 3):
        save(c.root(0), step, step_files(0, step))
    wait_for(lambda: held(c.root(0)) == {3}, 30, "node 0 to keep only step 3")
    save(c.root(1), 1, step_files(1, 1))
    c.wait_synced(1)
    for step in (2, 3):
        save(c.root(1), step, step_files(1, step))
    for i in range(N):
        wait_for(lambda i=i: backed_up(c.root(i), 3), 90, f"node {i}: step 3 backed up")

    # nothing half-written: every round in the bucket is complete, and holds the parts
    # of its step only (a round that moved to a newer step loses its older parts once
    # it completed)
    def tidy() -> bool:
        return all(
            r.complete and sorted(r.parts) == [(0, r.complete_step), (1, r.complete_step)]
            for r in rounds_of(g)
        )

    wait_for(tidy, 60, "every round in the bucket to be complete and tidy")
    assert rounds_of(g)[0].complete_step == 3
    listed = json.loads(
        tierfs("backups", "list", "--bucket", fake_gcs.bucket, "--job", "job", "--json").stdout
    )["rounds"]
    assert listed and all(x["complete"] for x in listed), listed
    for i in range(N):
        assert "no longer held" not in errors(c.root(i)), errors(c.root(i))
        assert "incomplete" not in errors(c.root(i)), errors(c.root(i))
    # the bucket's newest round restores step 3 with the right bytes on both nodes
    for i in range(N):
        c.lose(i)
    for i in range(N):
        c.remount(i)
    for r, res in enumerate(handshake_all(c, *yaml)):
        assert res["restored"] == 3, c.logs()
        assert res["files"] == step_files(r, 3)
