"""Issue #16 with real daemons: a node declared gone for good without restarting the job.

Four generic-mode nodes (one peer each: pairs 0-1 and 2-3) save step 2; node 3
is killed and its RAM wiped. ``tierfs nodes gone`` declares it gone: the
survivors' sync round completes without it, node 2 replicates to a stand-in
(node 0) instead of the dead node, and the parts that lost a copy with node 3
(rank 3's replica on node 2, rank 2's replica that node 3 held) are copied
again to node 0. Then node 2 is lost too: its restore does not wait for rank
3 and brings back step 2 -- every rank's part from the copies made again --
bit for bit. Steps sealed after the loss lack rank 3's part, so that restore
is the older step 2 (exit 2 with the reason), never a silent fresh start.
Node 3 coming back in the same generation is refused (exit 5).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import tierfs
from peer_cluster import Cluster, job_args, tree_hashes, wait_until

pytestmark = pytest.mark.slow

JOB = "gone"


def save(c: Cluster, i: int, step: int) -> None:
    tmp = c.root(i) / f"tmp-checkpoint-{step}"
    tmp.mkdir()
    (tmp / "weights.bin").write_bytes(os.urandom(200_000))
    os.rename(tmp, c.root(i) / f"checkpoint-{step}")


def state(c: Cluster, i: int, step: int) -> str | None:
    return {s["step"]: s["state"] for s in c.status(i)["steps"]}.get(step)


def holds(c: Cluster, holder: int, rank: int, step: int) -> bool:
    shard = Path(c.mounts[holder].ram_dir) / "store" / "shards" / JOB / str(rank) / str(step)
    return (shard / "data").is_dir()


def test_a_node_declared_gone_unblocks_the_job_and_its_copies_are_made_again(
    make_mount, monkeypatch
):
    monkeypatch.setenv("TIERFS_REFUSAL_GRACE", "2")
    c = Cluster(make_mount, 4, node_args=job_args(JOB, 4))
    for i in range(4):
        save(c, i, 2)
    for i in range(4):
        wait_until(lambda i=i: state(c, i, 2) == "replicated", 90, f"node {i}'s step 2")
    before = {r: tree_hashes(c.root(r) / "checkpoint-2") for r in range(4)}
    c.lose(3)

    # refusals: the coordinator's node, a rank out of range; then node 3
    env = {**os.environ, "TIERFS_PEER_TOKEN": c.token}
    refused = tierfs("nodes", "gone", str(c.root(1)), "0", env=env, check=False)
    assert refused.returncode == 5 and "serves the coordinator" in refused.stderr
    refused = tierfs("nodes", "gone", str(c.root(1)), "4", env=env, check=False)
    assert refused.returncode == 5 and "out of range for 4 nodes" in refused.stderr
    wrong = tierfs("nodes", "gone", str(c.root(1)), "3", "--peer-token", "bad", check=False)
    assert wrong.returncode == 3 and "UNAUTHENTICATED" in wrong.stderr
    done = tierfs("nodes", "gone", str(c.root(1)), "3", env=env)
    assert done.stdout.strip() == f"job {JOB} generation 1 (4 nodes): gone [3]"
    assert "gone [3]" in tierfs("status", str(c.root(0))).stdout
    wait_until(lambda: c.peer(2).get("gone") == [3], 30, "node 2 to learn that 3 is gone")
    assert c.peer(2)["replicate_to"] == [0]  # the stand-in for node 3
    assert "node-rank(s) [3] declared gone for good by the coordinator" in c.errors(2)

    # a new step seals and replicates without node 3; the sync round completes
    for i in range(3):
        save(c, i, 4)
    for i in range(3):
        wait_until(lambda i=i: state(c, i, 4) == "replicated", 90, f"node {i}'s step 4")
    wait_until(lambda: (c.peer(0)["sync"].get("step") or -1) >= 4, 60, "sync round of step 4")
    # the copies lost with node 3 are made again on node 0 (node 2's stand-in)
    for rank in (2, 3):
        wait_until(lambda rank=rank: holds(c, 0, rank, 2), 90, f"rank {rank}'s step 2 on node 0")
    assert holds(c, 0, 2, 4)
    # the coordinator counts them: every live rank's part of step 4 has 2 copies, and
    # step 4 (saved after node 3 was gone) lacks rank 3's part: incomplete, never "ok"
    every = (
        "copies     step 4: incomplete: no copy of rank(s) [3]'s part on a live node; "
        "the others: 2 copies of every rank's part"
    )
    wait_until(lambda: every in tierfs("status", str(c.root(0))).stdout, 60, "2 copies of step 4")

    # a second node lost: its restore does not wait for rank 3 and restores step 2
    c.lose(2)
    c.remount(2)
    waited = tierfs("wait", str(c.root(2)), "--timeout", "120", check=False)
    assert waited.returncode == 2, (waited.stdout, waited.stderr, c.logs())
    assert waited.stdout.strip() == "restored step 2 from peer:0"
    assert "step 4 lacks rank(s) [3]" in waited.stderr
    assert "node-rank(s) [3] declared gone: not waited for" in waited.stderr
    assert tree_hashes(c.root(2) / "checkpoint-2") == before[2]
    assert "declared gone" in c.status(2)["restore"]["reason"]

    # the gone node comes back in the same generation: refused, exit 5
    c.remount(3)
    back = tierfs("wait", str(c.root(3)), "--timeout", "60", check=False)
    assert back.returncode == 5, (back.stdout, back.stderr)
    assert "node-rank 3 was declared gone for good in generation 1" in back.stderr


def test_gone_after_declares_a_silent_node_gone(make_mount):
    c = Cluster(make_mount, 3, node_args=job_args(JOB, 3, "--gone-after", "3"))
    for i in range(3):
        save(c, i, 1)
    for i in range(3):
        wait_until(lambda i=i: state(c, i, 1) == "replicated", 90, f"node {i}'s step 1")
    c.lose(2)
    wait_until(lambda: c.peer(1).get("gone") == [2], 60, "node 2 to be declared gone")
    coord = c.peer(0)["coordinator_state"]
    assert coord["gone"] == [2]
    assert "no heartbeat for more than 3 s (--gone-after)" in c.mounts[0].log()
    save(c, 0, 3)
    save(c, 1, 3)
    wait_until(lambda: (c.peer(0)["sync"].get("step") or -1) >= 3, 60, "sync round of step 3")


def test_after_two_nodes_declared_gone_the_view_reads_their_parts_from_the_stand_in(
    make_mount, monkeypatch
):
    """The new-user trial's job k end to end: pairs 0-1 and 2-3; node 3 declared gone,
    so node 2 sends its parts to its stand-in, node 0; then node 2 declared gone too:
    node 1 reads both lost ranks' files, verified. (In the trial node 1's view asked
    only nodes 2 and 3 and read EIO; here node 0 may also have copied the parts on to
    node 1 first, so the unit test of ``holders_of`` in test_writer_topology.py is
    the regression test of where the view asks.)"""
    monkeypatch.setenv("TIERFS_REFUSAL_GRACE", "2")
    c = Cluster(make_mount, 4, node_args=job_args(JOB, 4))
    data = {i: os.urandom(150_000) for i in range(4)}
    for i in range(4):
        tmp = c.root(i) / "tmp-checkpoint-2"
        tmp.mkdir()
        (tmp / f"rank{i}.bin").write_bytes(data[i])
        os.rename(tmp, c.root(i) / "checkpoint-2")
    for i in range(4):
        wait_until(lambda i=i: state(c, i, 2) == "replicated", 90, f"node {i}'s step 2")
    env = {**os.environ, "TIERFS_PEER_TOKEN": c.token}
    c.lose(3)
    tierfs("nodes", "gone", str(c.root(1)), "3", env=env)
    # node 2 copies its own part to its stand-in receiver, node 0
    wait_until(lambda: holds(c, 0, 2, 2), 90, "rank 2's step 2 on node 0")
    c.lose(2)
    tierfs("nodes", "gone", str(c.root(1)), "2", env=env)
    wait_until(lambda: c.peer(1).get("gone") == [2, 3], 30, "node 1 to learn that 2 is gone")
    for rank in (2, 3):
        f = c.root(1) / "checkpoint-2" / f"rank{rank}.bin"
        assert f.read_bytes() == data[rank], rank  # from node 0, verified
    assert "could not be read" not in c.errors(1), c.errors(1)
    assert "ERROR" not in c.mounts[1].log()
