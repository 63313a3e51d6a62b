"""Issue #16 with real daemons: a job restarted on fewer, then more nodes.

Four nodes save a sharded state with stock ``torch.distributed.checkpoint``
(DTensors over a CPU mesh, one rank per node, each into its own mount); node
3 is lost for good with its RAM; the job restarts on the 3 survivors (each
daemon remounted with ``--nodes 3``, RAM kept), which restore the 4-node
step, see rank 3's files through the whole-step view (its replica on a
survivor) and load it resharded onto 3 ranks; the parts that lost a copy with node 3
are copied again to a live peer. They save a 3-node step; the
job grows to 5 nodes (two new, empty ones): the 3-node step -- newer than
the 4-node one -- is restored on all five, the new nodes hold no part of it
and read every file from their peers, and the 5 ranks load it resharded.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import tierfs
from mtc_clients import wait_for
from peer_cluster import Cluster, job_args, run_ranks

from tierfs.demo.emulator import free_port

pytestmark = [pytest.mark.slow, pytest.mark.long]

CLIENT = str(Path(__file__).resolve().parents[1] / "support" / "clients" / "dcp_reshard.py")
JOB = "elastic"


def elastic(n: int) -> Callable[[int], list[str]]:
    return job_args(JOB, n)


def dcp(
    c: Cluster, mode: str, step: int, nodes: list[int], seed: int = 0, big_mb: int = 0
) -> list[str]:
    """One stock DCP rank per node (rank = position in ``nodes``, world = len(nodes));
    ``seed`` gives the step other values (a step saved again); ``big_mb``: rank 1 also
    saves a tensor of that many MiB, which every rank loads."""

    def args(r: int, world: int, port: int) -> list[str]:
        return [mode, str(r), str(world), str(port), str(c.root(nodes[r])), str(step)]

    env = {"DCP_RESHARD_SEED": str(seed), "DCP_RESHARD_BIG_MB": str(big_mb)}
    return run_ranks(c, CLIENT, args, nodes, env)


def files(world: int) -> list[str]:
    return [".metadata", *(f"__{r}_0.distcp" for r in range(world))]


def whole(c: Cluster, i: int, step: int, world: int) -> bool:
    try:
        return sorted(os.listdir(c.root(i) / f"checkpoint-{step}")) == files(world)
    except OSError:
        return False


def holds(c: Cluster, holder: int, rank: int, step: int) -> bool:
    """Node ``holder``'s RAM store holds a sealed copy of rank ``rank``'s part of ``step``."""
    shard = c.mounts[holder].ram_dir / "store" / "shards" / JOB / str(rank) / str(step)
    return (shard / "manifest.json").exists()


def restart(c: Cluster, n: int, nodes: list[int]) -> None:
    """The job restarts with ``n`` nodes: each of ``nodes`` is remounted with ``--nodes n``
    (its RAM kept); node-rank 0 first, as a job scheduler starts them."""
    c.node_args = elastic(n)
    for i in nodes:
        c.mounts[i].unmount()
    for i in nodes:
        c.mounts[i].args = c.args(i)
        c.remount(i)


def restart_restores_older(c: Cluster, step: int) -> list[str]:
    """The 3 nodes restart (RAM kept); each one's ``tierfs wait`` must restore ``step``
    from local with exit 2 (an older step than the newest). Returns each one's stderr
    (the reason)."""
    for i in range(3):
        c.mounts[i].unmount()
    for i in range(3):
        c.remount(i)
    said = []
    for i in range(3):
        w = tierfs("wait", str(c.root(i)), "--timeout", "180", check=False, timeout=240)
        assert (w.returncode, w.stdout.strip()) == (2, f"restored step {step} from local"), (
            i,
            w.stdout,
            w.stderr,
        )
        said.append(w.stderr)
    return said


def wait_restore(c: Cluster, i: int) -> str:
    w = tierfs("wait", str(c.root(i)), "--timeout", "180", check=False, timeout=240)
    assert w.returncode == 0, (i, w.stdout, w.stderr, c.logs())
    return w.stdout.strip()


def test_a_job_shrinks_to_three_nodes_then_grows_to_five_and_loads_resharded(make_mount):
    c = Cluster(make_mount, 4, node_args=elastic(4))
    assert dcp(c, "save", 30, [0, 1, 2, 3]) == ["SAVED"] * 4
    for i in range(4):
        wait_for(lambda i=i: whole(c, i, 30, 4), 90, f"the whole step 30 on node {i}")
    # rank 3's part has a replica on a survivor before node 3 is lost
    wait_for(lambda: any(holds(c, h, 3, 30) for h in range(3)), 90, "a replica of rank 3")

    # node 3 is lost for good; the job restarts on the 3 survivors
    c.lose(3)
    restart(c, 3, [0, 1, 2])
    for i in range(3):
        line = wait_restore(c, i)
        assert line == "restored step 30 from local (written by 4 nodes; this job has 3)", line
        # rank 3's files are in every survivor's view (from its replica), and load
        assert whole(c, i, 30, 4), os.listdir(c.root(i) / "checkpoint-30")
        s = c.status(i)
        assert s["restore"]["writers"] == 4, s["restore"]
        view = {v["step"]: v for v in s["whole_view"]["steps"]}
        assert view[30]["writers"] == 4 and view[30]["ranks_missing"] == [], view
    assert dcp(c, "load", 30, [0, 1, 2]) == ["LOADED_OK"] * 3
    # re-replication: rank 2's part lost its copy with node 3 (pairs 0-1 and 2-3 on 4
    # nodes), rank 3's has only node 2's: node 2 sends both to its receiver on 3
    # nodes, node 0, so a second loss (node 2) would not lose step 30
    wait_for(lambda: holds(c, 0, 2, 30) and holds(c, 0, 3, 30), 90, "step 30 copied again")
    coord = c.peer(0)["coordinator_state"]
    # node-rank 0 keeps the generation across its restarts: 1 was the 4-node job
    assert (coord["nodes"], coord["generation"]) == (3, 2), coord

    # a 3-node step, then the job grows to 5 nodes: two new ones with empty RAM
    assert dcp(c, "save", 40, [0, 1, 2]) == ["SAVED"] * 3
    for i in range(3):
        wait_for(lambda i=i: whole(c, i, 40, 3), 90, f"the whole step 40 on node {i}")
    c.n = 5
    c.ports.append(free_port())
    restart(c, 5, [0, 1, 2])
    c.mounts[3].args = c.args(3)
    c.remount(3)
    c.mounts.append(make_mount(*c.args(4), name="node4"))
    for i in range(3):
        line = wait_restore(c, i)
        # the newest complete step, although written by 3 nodes (regression: the
        # 4-node step 30 was restored and step 40 dropped as abandoned)
        assert line == "restored step 40 from local (written by 3 nodes; this job has 5)", line
    coord = c.peer(0)["coordinator_state"]
    assert (coord["nodes"], coord["generation"]) == (5, 3), coord
    for i in (3, 4):
        line = wait_restore(c, i)
        assert line.startswith("restored step 40 (written by 3 nodes: this node holds no part"), (
            line
        )
    for i in range(5):
        wait_for(lambda i=i: whole(c, i, 40, 3), 60, f"the whole step 40 on node {i}")
    assert dcp(c, "load", 40, [0, 1, 2, 3, 4]) == ["LOADED_OK"] * 5
    for i in range(5):
        assert "abandon" not in c.errors(i), (i, c.errors(i))
    # a new node's daemon restarts (RAM kept): the step's directory in its view holds
    # only other ranks' files, never sealed as a part of its own (regression: an empty
    # part of rank 3 was sealed and every later restore exited 2)
    c.mounts[3].unmount()
    c.remount(3)
    line = wait_restore(c, 3)
    assert line.startswith("restored step 40 (written by 3 nodes: this node holds no part"), line
    assert not holds(c, 3, 3, 40)
    assert "only other ranks' files" in c.mounts[3].log()


def test_survivors_renumbered_after_a_middle_node_is_lost_restore_and_load(make_mount):
    # node 1 of 4 is lost; the job restarts on 3 nodes and node 3 takes node-rank 1 (as
    # a scheduler renumbers its workers): its old part (rank 3) counts as a copy it
    # holds, rank 1's part comes from its replica on node 0
    c = Cluster(make_mount, 4, node_args=elastic(4))
    assert dcp(c, "save", 30, [0, 1, 2, 3]) == ["SAVED"] * 4
    for i in range(4):
        wait_for(lambda i=i: whole(c, i, 30, 4), 90, f"the whole step 30 on node {i}")
    wait_for(lambda: holds(c, 0, 1, 30), 90, "rank 1's replica on node 0")
    c.lose(1)
    ranks = {0: 0, 2: 2, 3: 1}
    c.node_args = lambda i: elastic(3)(ranks[i])
    for i in ranks:
        c.mounts[i].unmount()
    for i in ranks:
        c.mounts[i].args = c.args(i)
        c.remount(i)
    for i in ranks:
        line = wait_restore(c, i)
        assert line.startswith("restored step 30 from "), line
        assert line.endswith("(written by 4 nodes; this job has 3)"), line
        assert whole(c, i, 30, 4), os.listdir(c.root(i) / "checkpoint-30")
    # node 3's old part stays rank 3's, never sealed again as node-rank 1's (regression:
    # sealed at start as rank 1's part of step 30 with rank 3's files, a second
    # "step 30" written by 3 nodes that made the restore report an older step)
    part = c.mounts[3].ram_dir / "store" / "shards" / JOB / "1" / "30" / "data" / "checkpoint-30"
    wait_for(part.exists, 60, "rank 1's part of step 30 on node 3")
    assert sorted(p.name for p in part.iterdir()) == ["__1_0.distcp"]
    assert "not sealed again as node-rank 1's" in c.mounts[3].log()
    # the world-3 ranks in node-rank order: mounts 0, 3, 2
    assert dcp(c, "load", 30, [0, 3, 2]) == ["LOADED_OK"] * 3
    for i in ranks:
        assert c.errors(i) == "", (i, c.errors(i))
    # regression (stop 32 trial, finding 1): saving step 30 again into its directory
    # failed on the renumbered job with EROFS (node 3, now rank 1, writes __1_0.distcp:
    # the old rank 1's file in its view) and sealed a torn step. Now the path becomes
    # the node's own. Node 3's old __3_0.distcp, which it wrote as rank 3, is rank
    # 3's file in its view (regression, third trial: it stayed a plain file of its own
    # and "own copy wins" could show old bytes), so it leaves the view with every
    # other file of rank 3 once the step is written by 3 nodes.
    assert dcp(c, "save", 30, [0, 3, 2], seed=1) == ["SAVED"] * 3
    for i in ranks:
        wait_for(
            lambda i=i: sorted(os.listdir(c.root(i) / "checkpoint-30")) == files(3),
            90,
            f"the 3-node step 30 (and no __3_0.distcp) on node {i}",
        )
    assert dcp(c, "load", 30, [0, 3, 2], seed=1) == ["LOADED_OK"] * 3
    for i in ranks:
        assert c.errors(i) == "", (i, c.errors(i))


def save_files(c: Cluster, step: int, nodes: list[int]) -> None:
    """Each of ``nodes`` writes its part of ``checkpoint-<step>/`` with a commit marker
    under a temp name and renames it into place (a save)."""
    for i in nodes:
        tmp = c.root(i) / f"tmp-{step}"
        tmp.mkdir()
        (tmp / f"part-{i}.bin").write_bytes(os.urandom(50_000))
        (tmp / "commit_success.txt").write_text("ok")  # what a start finds complete
        os.rename(tmp, c.root(i) / f"checkpoint-{step}")


def test_a_step_abandoned_by_a_restore_is_not_sealed_again_at_the_next_start(make_mount):
    c = Cluster(make_mount, 3, node_args=elastic(3))
    save_files(c, 30, [0, 1, 2])
    save_files(c, 40, [0, 1])  # node 2 never saved step 40
    for i in range(3):
        wait_for(lambda i=i: holds(c, i, i, 30), 60, f"node {i}'s part of step 30")
    for i in range(2):
        wait_for(lambda i=i: holds(c, i, i, 40), 60, f"node {i}'s part of step 40")
    restart(c, 3, [0, 1, 2])
    for i in range(3):
        w = tierfs("wait", str(c.root(i)), "--timeout", "180", check=False, timeout=240)
        assert w.returncode == 2, (i, w.stdout, w.stderr)  # an older step: said
        assert "step 40 lacks rank(s) [2]" in w.stderr, w.stderr
    # the next start of the job: step 40 is still in the views of nodes 0 and 1, but
    # it was abandoned (regression: sealed again at every start, stamped with the
    # running job's node count, and every restore exited 2)
    restart(c, 3, [0, 1, 2])
    for i in range(3):
        assert wait_restore(c, i) == "restored step 30 from local"
    for i in range(2):
        assert not holds(c, i, i, 40)
        assert "abandoned by a restore; not sealed again" in c.mounts[i].log()
    # saved again, the step seals as usual
    for i in range(2):
        shutil.rmtree(c.root(i) / "checkpoint-40")
    save_files(c, 40, [0, 1, 2])
    for i in range(3):
        wait_for(lambda i=i: holds(c, i, i, 40), 60, f"node {i}'s part of step 40 again")


def test_a_step_removed_on_every_node_and_saved_again_loads_the_new_values(make_mount):
    """Regression (#14 trial 66 H1, silent wrong values in 2 of 6 runs): ``rm -rf`` of a
    loaded step on every node, then a stock ``dcp.save`` of that step number and a load
    right after. A node went on naming its earlier part until its new seal (new files
    are no write into a sealed one), and a rank loaded rank 0's earlier values from a
    replica. Making the step directory again now begins another save on each node
    (said in its log); the load reads the new values everywhere."""
    c = Cluster(make_mount, 3, node_args=elastic(3))
    assert dcp(c, "save", 30, [0, 1, 2]) == ["SAVED"] * 3
    for i in range(3):
        wait_for(lambda i=i: whole(c, i, 30, 3), 90, f"the whole step 30 on node {i}")
    assert dcp(c, "load", 30, [0, 1, 2]) == ["LOADED_OK"] * 3
    for i in range(3):
        shutil.rmtree(c.root(i) / "checkpoint-30")
    assert dcp(c, "save", 30, [0, 1, 2], seed=1) == ["SAVED"] * 3
    assert dcp(c, "load", 30, [0, 1, 2], seed=1) == ["LOADED_OK"] * 3
    for i in range(3):
        assert "checkpoint-30 made again after its removal" in c.mounts[i].log()
        assert c.errors(i) == "", (i, c.errors(i))


def part_digest(c: Cluster, holder: int, rank: int, step: int) -> str:
    """The manifest digest of rank ``rank``'s part of ``step`` held by node ``holder``."""
    from tierfs.store.manifest import Manifest

    path = c.mounts[holder].ram_dir / "store" / "shards" / JOB / str(rank) / str(step)
    try:
        return Manifest.from_json((path / "manifest.json").read_bytes()).digest
    except (OSError, ValueError):
        return ""


def test_a_step_saved_again_seals_on_every_node_and_loads_the_new_values(make_mount):
    # after an older step is restored a job saves the abandoned step number again, into
    # the directory that already shows every rank's files. Regressions (a new user's
    # trial): node 1 never sealed its new part (rank 0's file of the whole-step view
    # made it look like rank 0's node), and the views kept the old files of the other
    # ranks (reads failed with EIO against the old checksums)
    c = Cluster(make_mount, 3, node_args=elastic(3))
    assert dcp(c, "save", 30, [0, 1, 2]) == ["SAVED"] * 3
    for i in range(3):
        wait_for(lambda i=i: whole(c, i, 30, 3), 90, f"the whole step 30 on node {i}")
    before = {i: part_digest(c, i, i, 30) for i in range(3)}
    assert all(before.values()), before
    assert dcp(c, "save", 30, [0, 1, 2], seed=1) == ["SAVED"] * 3
    for i in range(3):
        wait_for(
            lambda i=i: part_digest(c, i, i, 30) not in ("", before[i]),
            90,
            f"node {i}'s new part of step 30",
        )
    wait_for(
        lambda: dcp(c, "load", 30, [0, 1, 2], seed=1) == ["LOADED_OK"] * 3,
        90,
        "the new values loaded on every rank",
        poll=2,
    )


def test_nodes_swapping_ranks_see_the_new_bytes_of_a_step_saved_again(make_mount):
    """Regression (issue #16, third trial, finding 1): three nodes restarted with
    ranks swapped (RAM kept) save the restored step again into its directory. Each
    node kept the files it wrote under its old rank as files of its own; "the own
    copy wins" then showed them instead of that rank's new part, and stock
    ``dcp.load`` read the old values without an error."""
    c = Cluster(make_mount, 3, node_args=elastic(3))
    assert dcp(c, "save", 40, [0, 1, 2]) == ["SAVED"] * 3
    for i in range(3):
        wait_for(lambda i=i: whole(c, i, 40, 3), 90, f"the whole step 40 on node {i}")
    ranks = {0: 2, 1: 1, 2: 0}  # nodes 0 and 2 swap ranks
    c.node_args = lambda i: elastic(3)(ranks[i])
    for i in (2, 1, 0):
        c.mounts[i].unmount()
    for i in (2, 1, 0):  # the new node-rank 0 first
        c.mounts[i].args = c.args(i)
        c.remount(i)
    for i in range(3):
        line = wait_restore(c, i)
        assert line.startswith("restored step 40 from "), line
    by_rank = [2, 1, 0]  # the mounts in node-rank order
    assert dcp(c, "load", 40, by_rank) == ["LOADED_OK"] * 3
    assert dcp(c, "save", 40, by_rank, seed=1) == ["SAVED"] * 3

    def written(rank: int) -> dict[str, bytes]:
        top = c.root(by_rank[rank]) / "checkpoint-40"
        own = [f"__{rank}_0.distcp"] + ([".metadata"] if rank == 0 else [])
        return {name: (top / name).read_bytes() for name in own}

    new = {name: data for r in range(3) for name, data in written(r).items()}
    assert sorted(new) == files(3)

    def shows_new(i: int) -> bool:
        top = c.root(i) / "checkpoint-40"
        try:
            return all((top / name).read_bytes() == data for name, data in new.items())
        except OSError:
            return False

    for i in range(3):
        wait_for(lambda i=i: shows_new(i), 90, f"node {i} to show every rank's new bytes")
    assert dcp(c, "load", 40, by_rank, seed=1) == ["LOADED_OK"] * 3
    for i in range(3):
        assert "differs between ranks" not in c.errors(i), (i, c.errors(i))


def own_manifest(c: Cluster, holder: int, rank: int, step: int):  # type: ignore[no-untyped-def]
    """Rank ``rank``'s manifest of ``step`` held by node ``holder``, or None."""
    from tierfs.store.manifest import Manifest

    path = c.mounts[holder].ram_dir / "store" / "shards" / JOB / str(rank) / str(step)
    try:
        return Manifest.from_json((path / "manifest.json").read_bytes())
    except (OSError, ValueError):
        return None


def test_a_lost_ranks_part_of_an_earlier_save_is_never_combined_with_the_new_save(make_mount):
    """Regression (issue #16, fourth trial F9): a step saved again in place by the
    same node count, a node lost before its new part reached a peer: the survivors
    restored the step with exit 0 from their new parts and the lost rank's replica of
    the first save, and ``dcp.load`` returned a mix of the two saves. Now the step is
    incomplete (the survivors' new parts record the parts they replaced, rank 2's
    replica among them) and the older complete step comes back, said."""
    from tierfs.node.resave import RESAVE_GAP

    c = Cluster(make_mount, 3, node_args=elastic(3))
    save_files(c, 10, [0, 1, 2])
    save_files(c, 20, [0, 1, 2])
    # one replica per node
    for step in (10, 20):
        for i in range(3):
            wait_for(
                lambda i=i, s=step: any(holds(c, h, i, s) for h in range(3) if h != i),
                60,
                f"a replica of rank {i}'s step {step}",
            )
    keeper = next(h for h in (0, 1) if holds(c, h, 2, 20))  # a survivor with rank 2's part
    first = own_manifest(c, keeper, 2, 20)
    assert first is not None
    c.lose(2)  # before its part of the next save reaches any peer
    sealed = max(own_manifest(c, i, i, 20).sealed for i in (0, 1))  # type: ignore[union-attr]
    # the next save of step 20 comes a training interval after the first one
    wait_for(lambda: time.time() > sealed + RESAVE_GAP + 0.5, RESAVE_GAP + 30, "the interval")
    for i in (0, 1):
        top = c.root(i) / "checkpoint-20"
        (top / f"part-{i}.bin").write_bytes(os.urandom(50_000))  # in place
        (top / "commit_success.txt").write_text("ok")
    new = {}
    for i in (0, 1):
        wait_for(
            lambda i=i: (m := own_manifest(c, i, i, 20)) is not None and m.began > 0,
            60,
            f"node {i}'s part of the new save",
        )
        new[i] = own_manifest(c, i, i, 20)
    assert (2, first.digest) in new[keeper].replaces, new[keeper].replaces
    restart(c, 2, [0, 1])
    for i in (0, 1):
        w = tierfs("wait", str(c.root(i)), "--timeout", "180", check=False, timeout=240)
        assert w.returncode == 2, (i, w.stdout, w.stderr)  # an older step: said
        assert w.stdout.startswith("restored step 10 from "), w.stdout
        why = "(rank(s) [2]: only a part of an earlier save of step 20 is left"
        assert why in w.stderr, w.stderr
        assert why in c.errors(i), c.errors(i)
    # fifth trial F4: the abandoned step 20 stays in each mount with that node's own
    # files only (before, every view showed other ranks' parts of it, of both saves)
    for i in (0, 1):
        top = c.root(i) / "checkpoint-20"
        wait_for(
            lambda top=top, i=i: sorted(os.listdir(top)) == ["commit_success.txt", f"part-{i}.bin"],
            60,
            f"node {i}'s abandoned step 20 showing its own files only",
        )


def test_a_load_right_after_a_save_of_a_new_step_finds_rank_0s_metadata(make_mount):
    """Regression (issue #16, fifth trial F1): every rank ran stock ``dcp.save`` into a
    new step, ``dist.barrier`` and ``dcp.load``; ranks 1 and 2 failed with
    ``FileNotFoundError`` on ``.metadata`` (rank 0's part reached their views a few
    seconds later; 3 runs of 3 in the trial). Now their lookup of ``.metadata`` waits
    for the other ranks' parts for a few seconds after their own part sealed."""
    c = Cluster(make_mount, 3, node_args=elastic(3))
    out = dcp(c, "saveload", 50, [0, 1, 2], seed=2)
    assert out == ["SAVED\nLOADED_OK"] * 3, out


def test_a_load_right_after_a_save_where_one_rank_seals_later_finds_every_file(make_mount):
    """Regression (#14 trial 53 B1, HIGH): stock ``dcp.save``, ``dist.barrier`` and
    ``dcp.load`` on 3 nodes, rank 1's part much bigger than the others' (its node
    checksums and seals it later). Rank 1's own node answered the lookup of
    ``.metadata`` with ENOENT before its own part was sealed, and the other nodes
    answered ``__1_0.distcp`` with ENOENT once ``.metadata`` was placed but rank 1's
    part was not known yet (43 of 55 steps in the trial's script; DCP's
    ``CheckpointException`` ended the job). Now both lookups wait, a few seconds at
    most, for the part that brings the file."""
    c = Cluster(make_mount, 3, node_args=elastic(3))
    race = str(Path(CLIENT).with_name("dcp_race.py"))

    def args(r: int, world: int, port: int) -> list[str]:
        return [str(r), str(world), str(port), str(c.root(r)), "60", "67", "64"]

    out = run_ranks(c, race, args, [0, 1, 2])
    assert out == ["OK 8"] * 3, out
    out = dcp(c, "saveload", 70, [0, 1, 2], big_mb=64)  # DTensor shards and reshard code
    assert out == ["SAVED\nLOADED_OK"] * 3, out
    for i in range(3):
        assert c.errors(i) == "", (i, c.errors(i))

    # #14 trial 54 F1: two ranks per node, rank 0 beginning its saves 0.5 s late: node 0
    # sealed a part with rank 1's file only and sealed it again a moment later; the
    # other nodes' lookups ended at once on "every part known" (12 of 12 steps failed)
    def two_per_node(r: int, world: int, port: int) -> list[str]:
        return [str(r), str(world), str(port), str(c.root(r // 2)), "80", "83", "8"]

    out = run_ranks(c, race, two_per_node, [0, 0, 1, 1, 2, 2], {"DCP_RACE_LATE": "0:0.5"})
    assert out == ["OK 4"] * 6, out
    # F4: from its second such save on, each node seals its part once, with both ranks'
    # files (node 0 sealed rank 1's file alone first, then the whole part)
    for i in range(3):
        log = c.mounts[i].log()
        for step in (81, 82, 83):
            seals = re.findall(rf"sealed step {step} \(checkpoint-{step}, (\d+) files", log)
            assert seals == [str(3 if i else 4)], (i, step, seals)

    # #14 trial 58 H1: back to one rank per node on the same daemons, rank 1's part big.
    # Nodes 1 and 2 held their first such part the whole 15 s rank grace (fewer of their
    # ranks than in their previous DCP part); node 0's lookup of __1_0.distcp beside
    # .metadata waited 10 s and answered ENOENT. A load's lookup of .metadata now ends
    # the grace.
    def one_per_node(r: int, world: int, port: int) -> list[str]:
        return [str(r), str(world), str(port), str(c.root(r)), "84", "85", "100"]

    out = run_ranks(c, race, one_per_node, [0, 1, 2])
    assert out == ["OK 2"] * 3, out
    for i in range(3):
        assert c.errors(i) == "", (i, c.errors(i))
    for i in (1, 2):  # whether the ENOENT came depended on timing; the 15 s hold did not
        log = c.mounts[i].log()
        assert "step 84 (checkpoint-84): a load of it began here: sealed now" in log, i
        seals = re.findall(r"sealed step 84 \(checkpoint-84, (\d+) files", log)
        assert len(seals) == 1, (i, seals)  # once, not again when the grace ends


def test_a_load_waits_for_a_coordinator_rank_that_writes_long_after_the_others(make_mount):
    """Regression (#14 trial 54 F2): stock ``dcp.save``, ``dist.barrier`` and ``dcp.load``
    on 3 nodes, rank 0 (the coordinator, which writes ``.metadata`` last) keeping its data
    file open 13 s after the others finished theirs, as a rank with a much bigger part
    would. The other nodes waited for ``.metadata`` only 10 s after their own writes, so
    their load failed with ``FileNotFoundError``. Now their lookup also waits while node
    0 reports, through the coordinator's heartbeats, that it is saving that step; and a
    lookup past its window waits for two heartbeat replies, which name the directories
    the other nodes changed in the last seconds (trial 55 F1: a rank 12 s late)."""
    c = Cluster(make_mount, 3, node_args=elastic(3))
    race = str(Path(CLIENT).with_name("dcp_race.py"))

    def args(r: int, world: int, port: int) -> list[str]:
        return [str(r), str(world), str(port), str(c.root(r)), "90", "91", "1"]

    out = run_ranks(c, race, args, [0, 1, 2], {"DCP_RACE_SLOW": "0:13"})
    assert out == ["OK 2"] * 3, out
    for i in range(3):
        assert c.errors(i) == "", (i, c.errors(i))

    # #14 trial 55 F1: rank 1 begins writing 12 s after the others; its node and the
    # coordinator's save in milliseconds, between two heartbeats, and node 2 (holding
    # none of the late data) answered .metadata with ENOENT at once
    def later(r: int, world: int, port: int) -> list[str]:
        return [str(r), str(world), str(port), str(c.root(r)), "92", "93", "1"]

    out = run_ranks(c, race, later, [0, 1, 2], {"DCP_RACE_LATE": "1:12"})
    assert out == ["OK 2"] * 3, out

    # #14 trial 56 N1: in the directory of a failed save (own data file, no .metadata
    # ever), a lookup of .metadata waited afresh each time the session ran it again and
    # was answered EIO; DCP's save retried into it failed on every non-coordinator rank
    failed = c.root(1) / "checkpoint-99"
    failed.mkdir()
    (failed / "__1_0.distcp").write_bytes(b"a failed save's data")
    began = time.monotonic()
    with pytest.raises(FileNotFoundError):  # not EIO
        os.stat(failed / ".metadata")
    # the 10 s after its part's seal, then two heartbeat replies (3.5 s at most)
    assert time.monotonic() - began < 20


def test_a_load_right_after_a_save_in_place_reads_every_ranks_new_bytes(make_mount):
    """Regression (issue #16, fourth trial F1): every rank saved a step again in place
    with stock DCP, waited for the others (``dist.barrier``) and loaded it at once. A
    node showing another rank's earlier part (a replica, or files fetched by an earlier
    load) served its old bytes until the coordinator's notice arrived, and ``dcp.load``
    returned the earlier save's values without an error. Now an open of such a file
    waits until that rank's node shows its part of the new save. The race is not
    forced here (it hit 1 run in 2 of the trial's script): the deterministic checks are
    tests/unit/test_remote_view.py and test_node_parts.py; this one checks the values
    end to end with stock DCP."""
    from tierfs.node.resave import RESAVE_GAP

    c = Cluster(make_mount, 3, node_args=elastic(3))
    assert dcp(c, "save", 30, [0, 1, 2]) == ["SAVED"] * 3
    for i in range(3):
        wait_for(lambda i=i: whole(c, i, 30, 3), 90, f"the whole step 30 on node {i}")
    # every node reads every rank's file once: the old bytes are here afterwards
    wait_for(
        lambda: dcp(c, "load", 30, [0, 1, 2]) == ["LOADED_OK"] * 3,
        90,
        "step 30 loaded on every rank",
        poll=2,
    )
    sealed = max(own_manifest(c, i, i, 30).sealed for i in range(3))  # type: ignore[union-attr]
    # the next save of step 30, a training interval after the first one
    wait_for(lambda: time.time() > sealed + RESAVE_GAP + 0.5, RESAVE_GAP + 30, "the interval")
    out = dcp(c, "saveload", 30, [0, 1, 2], seed=1)
    assert out == ["SAVED\nLOADED_OK"] * 3, out
    for i in range(3):
        assert "showed no part" not in c.errors(i), c.errors(i)


def test_a_rank_whose_new_save_never_came_is_never_read_beside_the_new_save(make_mount, tmp_path):
    """Regression (issue #16, ninth trial FAIL 15/16, silent wrong data): 3 nodes
    saved step 30 with stock DCP and loaded it (every node read every rank's file);
    then the job saved step 30 again in place, but rank 2's new part never reached its
    node (here its process writes into a scratch directory: a trainer whose save never
    reached tierfs). Nodes 0 and 1 kept serving rank 2's part of the first save beside
    the new parts, an open waiting for rank 2's new part failed once and then served
    the old bytes, and node 0 judged the mix ``loads: yes``. Now rank 2's files are
    not served (EIO, said in ``replicator.errors`` and status) and node 0 judges the
    step not loadable: its parts are of two saves."""
    from tierfs.node.resave import RESAVE_GAP

    c = Cluster(make_mount, 3, node_args=elastic(3))
    assert dcp(c, "save", 30, [0, 1, 2]) == ["SAVED"] * 3
    for i in range(3):
        wait_for(lambda i=i: whole(c, i, 30, 3), 90, f"the whole step 30 on node {i}")
    wait_for(
        lambda: dcp(c, "load", 30, [0, 1, 2]) == ["LOADED_OK"] * 3,
        90,
        "step 30 loaded on every rank",
        poll=2,
    )
    sealed = max(own_manifest(c, i, i, 30).sealed for i in range(3))  # type: ignore[union-attr]
    wait_for(lambda: time.time() > sealed + RESAVE_GAP + 0.5, RESAVE_GAP + 30, "the interval")
    scratch = tmp_path / "scratch"
    scratch.mkdir()

    def again(r: int, world: int, port: int) -> list[str]:
        root = scratch if r == 2 else c.root(r)
        return ["save", str(r), str(world), str(port), str(root), "30"]

    assert run_ranks(c, CLIENT, again, [0, 1, 2], {"DCP_RESHARD_SEED": "1"}) == ["SAVED"] * 3

    def refused(i: int) -> bool:
        steps = c.status(i)["whole_view"]["steps"]
        return any(s["step"] == 30 and s.get("refused") == [2] for s in steps)

    for i in (0, 1):
        wait_for(lambda i=i: refused(i), 120, f"node {i} refusing rank 2's earlier part")
        with pytest.raises(OSError) as read:
            (c.root(i) / "checkpoint-30" / "__2_0.distcp").read_bytes()
        assert read.value.errno == errno.EIO, read.value
        assert "rank 2's files are not served" in c.errors(i), c.errors(i)
        # a load of the new save fails; it never returns rank 2's rows of the first one
        out = run_ranks(
            c,
            CLIENT,
            lambda r, world, port, i=i: ["load", "0", "1", str(port), str(c.root(i)), "30"],
            [i],
            {"DCP_RESHARD_SEED": "1"},
        )
        assert out[0].startswith("LOAD_FAILED") and "ValueError" not in out[0], out
    wait_for(
        lambda: "its parts are of two saves" in loads(c, 0, 30),
        120,
        "node 0 judging step 30's parts to be of two saves",
    )
    assert loads(c, 0, 30).startswith("no, across its 3 ranks"), loads(c, 0, 30)


def loads(c: Cluster, i: int, step: int) -> str:
    for s in c.status(i)["steps"]:
        if s["step"] == step:
            return s.get("loads") or ""
    return ""


def test_a_restart_soon_after_a_resave_a_rank_never_made_restores_the_older_step(
    make_mount, tmp_path
):
    """Regression (tenth #16 trial FAIL A, silent wrong data, exit 0): with the default
    ``--peers-per-node 0`` no node holds another rank's part, so no new part listed
    rank 2's part of the first save as replaced; a job restarted within a minute of a
    re-save of step 30 in place that rank 2 never made (before node 0's verdict)
    restored step 30 from local on every node, and ``dcp.load`` returned rank 2's rows
    of the first save beside the others' new ones. Now every new part lists the parts
    its node's whole-step view showed when its save began: the restore takes step 20
    and says why (exit 2)."""
    from tierfs.node.resave import RESAVE_GAP

    def ppn0(n: int) -> Callable[[int], list[str]]:
        return job_args(JOB, n, "--peers-per-node", "0")

    c = Cluster(make_mount, 3, node_args=ppn0(3))
    for step in (20, 30):
        assert dcp(c, "save", step, [0, 1, 2]) == ["SAVED"] * 3
    for i in range(3):
        wait_for(lambda i=i: whole(c, i, 30, 3), 90, f"the whole step 30 on node {i}")
    wait_for(
        lambda: dcp(c, "load", 30, [0, 1, 2]) == ["LOADED_OK"] * 3,
        90,
        "step 30 loaded on every rank",
        poll=2,
    )
    first = {i: own_manifest(c, i, i, 30) for i in range(3)}
    assert all(m is not None for m in first.values())
    sealed = max(m.sealed for m in first.values())  # type: ignore[union-attr]
    wait_for(lambda: time.time() > sealed + RESAVE_GAP + 0.5, RESAVE_GAP + 30, "the interval")
    scratch = tmp_path / "scratch"
    scratch.mkdir()

    def again(r: int, world: int, port: int) -> list[str]:
        root = scratch if r == 2 else c.root(r)
        return ["save", str(r), str(world), str(port), str(root), "30"]

    assert run_ranks(c, CLIENT, again, [0, 1, 2], {"DCP_RESHARD_SEED": "1"}) == ["SAVED"] * 3
    old2 = first[2].digest  # type: ignore[union-attr]
    for i in (0, 1):

        def resealed(i: int = i) -> bool:
            m = own_manifest(c, i, i, 30)
            return m is not None and m.digest != first[i].digest  # type: ignore[union-attr]

        wait_for(resealed, 90, f"node {i}'s new part of step 30 sealed")
        m = own_manifest(c, i, i, 30)
        assert (2, old2) in m.replaces, (i, m.replaces)  # type: ignore[union-attr]
    assert own_manifest(c, 2, 2, 30).digest == old2  # type: ignore[union-attr]
    # the job restarts at once (node 0 has not judged the step yet), RAM kept
    for why in restart_restores_older(c, 20):
        assert "earlier save of step 30" in why, why
    assert dcp(c, "load", 20, [0, 1, 2]) == ["LOADED_OK"] * 3


def test_a_step_saved_again_at_once_after_its_load_is_read_from_the_new_save(make_mount):
    """Regression (#14 trial 55 F3, HIGH): stock ``dcp.save``, barrier, ``dcp.load`` of
    every rank's tensors, then the same step saved again into the same directory at once
    with new values, and loaded again (3 saves per step). The second save's writes came
    less than RESAVE_GAP after the first seal and counted as the same save: a node's
    load returned other ranks' values of the earlier save with no error (``wrong values:
    ['r1.small']``), or EIO. A write into a node's part after its client read other
    ranks' files of the step now begins another save, and opens of those ranks' files
    wait for their parts of it."""
    c = Cluster(make_mount, 3, node_args=elastic(3))
    race = str(Path(CLIENT).with_name("dcp_race.py"))

    def args(r: int, world: int, port: int) -> list[str]:
        return [str(r), str(world), str(port), str(c.root(r)), "40", "41", "8"]

    out = run_ranks(c, race, args, [0, 1, 2], {"DCP_RACE_REPEAT": "3"})
    assert out == ["OK 2"] * 3, out
    for i in range(3):
        assert c.errors(i) == "", (i, c.errors(i))


def test_a_save_cut_short_on_a_node_of_two_ranks_is_never_loaded_nor_restored(make_mount):
    """Regression (#14 trial 60, silent wrong data): two ranks per node, stock DCP, a step
    saved, loaded and saved again in place; the trainers died in the second save after
    rank 3 (node 1) wrote its file and before rank 2 (node 1) wrote its own. Node 1
    sealed its part with rank 2's file of the first save after the rank grace and said
    so in its own replicator.errors only; node-rank 0 judged the step ``yes (dcp, all 3
    ranks)``, a restart restored it with exit 0 and every load returned rank 2's values
    of the first save beside the others' second. Now the part's verdict names rank 2's
    file as of an earlier save: the other nodes refuse that file (EIO), node-rank 0
    judges the step not loadable and a restart restores the step before, exit 2, saying
    why."""
    c = Cluster(make_mount, 3, node_args=elastic(3))
    race = str(Path(CLIENT).with_name("dcp_race.py"))

    def two_per_node(r: int, world: int, port: int) -> list[str]:
        return [str(r), str(world), str(port), str(c.root(r // 2)), "40", "41", "1"]

    env = {"DCP_RACE_REPEAT": "2", "DCP_RACE_CUT": "2"}
    out = run_ranks(c, race, two_per_node, [0, 0, 1, 1, 2, 2], env)
    assert out == ["CUT"] * 6, out
    wait_for(
        lambda: "__2_0.distcp of the earlier save" in c.errors(1),
        90,
        "node 1 sealing its part with rank 2's file of the first save",
    )
    wait_for(
        lambda: loads(c, 0, 41).startswith("no, across its 3 ranks: unfinished: "),
        120,
        "node 0 judging step 41 not loadable",
    )
    assert "checkpoint-41/__2_0.distcp: of an earlier save" in loads(c, 0, 41), loads(c, 0, 41)
    assert loads(c, 0, 40).startswith("yes (dcp, all 3 ranks)"), loads(c, 0, 40)
    # the other nodes never serve that file beside the new save (node 1 shows its own)
    for i in (0, 2):

        def refused(i: int = i) -> bool:
            try:
                (c.root(i) / "checkpoint-41" / "__2_0.distcp").read_bytes()
            except OSError as exc:
                assert exc.errno == errno.EIO, exc
                return True
            return False

        wait_for(refused, 60, f"node {i} refusing rank 2's file of the first save")
        assert "checkpoint-41/__2_0.distcp is not served (EIO)" in c.errors(i), c.errors(i)
    # the job restarts (RAM kept): step 40, the last complete one, with the reason
    for i, why in enumerate(restart_restores_older(c, 40)):
        assert "step 41" in why and "__2_0.distcp" in why, (i, why)
    for i in range(3):
        wait_for(lambda i=i: whole(c, i, 40, 6), 90, f"the whole step 40 on node {i}")


def test_a_load_right_after_two_saves_of_a_step_in_a_row_reads_the_second(make_mount):
    """Regression (#14 trial 60 M1a/M1b, silent wrong values): stock ``dcp.save`` of a
    step twice in a row (no load between, less than RESAVE_GAP apart: one save by the
    rules), then ``dist.barrier`` and ``dcp.load``. A node holding another rank's part of
    the first save (its replica, or a copy fetched) served those bytes until it learned
    of the second save, and a fetch the rank's node refused fell back on a replica of the
    first save: the load returned the first save's values with no error (several steps
    of 10 here); a file replaced meanwhile made a load fail with ENOENT. Now an open of
    a part sealed moments before asks that rank's node what it holds, a fetch ends at a
    node holding a newer part, and a replaced file is renamed over its name."""
    c = Cluster(make_mount, 3, node_args=elastic(3))
    race = str(Path(CLIENT).with_name("dcp_race.py"))
    env = {"DCP_RACE_REPEAT": "2", "DCP_RACE_NOLOAD": "1"}
    for per_node, first, last in ((1, 230, 235), (2, 240, 245)):

        def args(r: int, world: int, port: int, n: int = per_node, a: int = first) -> list[str]:
            return [str(r), str(world), str(port), str(c.root(r // n)), str(a), str(a + 5), "8"]

        nodes = [r // per_node for r in range(3 * per_node)]
        out = run_ranks(c, race, args, nodes, env)
        assert out == [f"OK {last - first + 1}"] * (3 * per_node), out
    for i in range(3):
        assert c.errors(i) == "", (i, c.errors(i))
