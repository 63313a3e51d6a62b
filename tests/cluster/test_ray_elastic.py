"""Issue #16 with the real Ray Train v2: an elastic ``TorchTrainer`` on CPU shrinks
after a node is lost and grows back, resuming each time from tierfs.

A local Ray cluster (``ray.cluster_utils.Cluster``): a head without CPUs and three
raylets of one CPU each, raylet ``i`` carrying the custom resource
``tierfs_node_<i>`` so a worker finds its node's tierfs mount; one tierfs daemon per
node (a 3-node job). ``TorchTrainer`` with ``ScalingConfig(num_workers=(2, 4))``
(elastic, gloo): each worker saves its DCP shard of a tiny model/optimizer state into
its node's mount every step (tests/support/ray_elastic.py). Then node 2 is lost: its
raylet removed, its daemon killed with its RAM; the survivors' daemons restart with
``--nodes 2`` (node-rank 0 first) and Ray restarts the group with 2 workers, which
``tierfs wait --nodes 2`` and ``dcp.load`` the newest step, resharded, bit for bit.
Then capacity returns (a raylet with ``tierfs_node_2``, a fresh daemon, all three
daemons restarted with ``--nodes 3``): Ray grows the group to 3 and they load again.

Ray private API: the AutoscalingCoordinator actor (``ray.data``'s, which Ray Train
v2's elastic policy asks for the resources it may use) refreshes its view of the
cluster every 20 s; the test asks it to refresh at once (``_tick``) after a node
change. Without that (another Ray version) the test still passes, 20 s slower.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from peer_cluster import Cluster, job_args, wait_until

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.long(minutes=3), pytest.mark.ray]

JOB = "rayjob"
STORE = 80 << 20  # bytes of object store per Ray node (Ray's minimum is 75 MiB)
SUPPORT = str(Path(__file__).resolve().parents[1] / "support")


def files(world: int) -> list[str]:
    return [".metadata", *(f"__{r}_0.distcp" for r in range(world))]


def whole(c: Cluster, i: int, step: int, world: int) -> bool:
    try:
        return sorted(os.listdir(c.root(i) / f"checkpoint-{step}")) == files(world)
    except OSError:
        return False


def replicated(c: Cluster, nodes: list[int], step: int) -> bool:
    """Every node's part of ``step`` has a sealed copy on another node of ``nodes``."""
    store = lambda h: c.mounts[h].ram_dir / "store" / "shards" / JOB  # noqa: E731
    return all(
        any((store(h) / str(r) / str(step) / "manifest.json").exists() for h in nodes if h != r)
        for r in nodes
    )


def restart(c: Cluster, n: int, nodes: list[int]) -> None:
    """Each of ``nodes`` remounted with ``--nodes n`` (RAM kept), node-rank 0 first."""
    c.node_args = job_args(JOB, n)
    for i in nodes:
        c.mounts[i].unmount()
    for i in nodes:
        c.mounts[i].args = c.args(i)
        c.remount(i)


def refresh_resources(alive: int) -> None:
    """Once Ray's GCS counts ``alive`` nodes (the head included), ask Ray's
    AutoscalingCoordinator to see them now (private API; without it, its own 20 s tick
    does, and a worker group may first time out starting on a node that is gone)."""
    wait_until(lambda: sum(n["Alive"] for n in ray.nodes()) == alive, 60, f"{alive} live Ray nodes")
    try:
        actor = ray.get_actor("AutoscalingCoordinator", namespace="AutoscalingCoordinator")
        ray.get(actor._tick.remote(), timeout=30)
    except Exception as exc:  # another Ray version: the periodic tick does it
        print(f"AutoscalingCoordinator._tick: {exc!r}; its periodic tick refreshes")


def gone(run: list[dict[str, Any]]) -> bool:
    """Every worker process of ``run`` has exited."""
    for r in run:
        try:
            os.kill(r["pid"], 0)
            return False
        except ProcessLookupError:
            pass
    return True


def results(d: Path, world: int, restored: int) -> list[dict[str, Any]]:
    """The run's outcomes once all ``world`` ranks wrote theirs, else []."""
    out = [json.loads(p.read_text()) for p in sorted(d.glob(f"{world}-{restored}-*.json"))]
    return out if len(out) == world else []


def test_ray_train_v2_shrinks_after_a_node_loss_and_grows_back_resuming_from_tierfs(
    make_mount, tmp_path, monkeypatch
):
    monkeypatch.setenv("RAY_TRAIN_V2_ENABLED", "1")
    # no OOM killer: the machine's memory is mostly other programs' tmpfs, and Ray's
    # monitor killed the tiny workers at its 95% threshold
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "0")
    # Ray starts its worker processes at niceness 15: beside any busy process at 0 (a
    # CPU hog, the suite's other tests) they got ~3% of a core and the test timed out
    monkeypatch.setenv("RAY_worker_niceness", "0")
    # a worker group's start (3 processes importing torch) may outlast Ray Train's 60 s on
    # a busy 2-core machine; each such timeout costs one of max_failures
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "180")
    # the raylets' worker processes import tests/support/ray_elastic.py
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([SUPPORT, *sys.path]))
    from ray.cluster_utils import Cluster as RayCluster
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray_elastic import train_loop

    c = Cluster(make_mount, 3, node_args=job_args(JOB, 3))
    rc = RayCluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": STORE}
    )
    out = tmp_path / "results"
    out.mkdir()
    try:
        raylets = [
            rc.add_node(num_cpus=1, resources={f"tierfs_node_{i}": 1}, object_store_memory=STORE)
            for i in range(3)
        ]
        ray.init(address=rc.address)
        rc.wait_for_nodes()
        # the first group starts with all 3 nodes, not fewer (the AutoscalingCoordinator
        # is made by the first trainer: here only the live nodes are waited for)
        refresh_resources(4)
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={
                "mounts": {str(i): str(c.root(i)) for i in range(3)},
                "results": str(out),
                "final_world": 3,
            },
            scaling_config=ScalingConfig(
                num_workers=(2, 4), use_gpu=False, elastic_resize_monitor_interval_s=2
            ),
            run_config=RunConfig(
                storage_path=str(tmp_path / "ray"), failure_config=FailureConfig(max_failures=3)
            ),
        )
        done: dict[str, Any] = {}

        def fit() -> None:
            try:
                done["result"] = trainer.fit()
            except BaseException as exc:  # reported by the test thread
                done["error"] = exc

        runner = threading.Thread(target=fit, daemon=True)
        runner.start()

        def running(world: int, restored: int) -> list[dict[str, Any]]:
            assert "error" not in done, (done["error"], c.logs())
            return results(out, world, restored)

        # 3 workers, a fresh start: steps 1 and 2 saved, each rank's part replicated
        first = wait_until(lambda: running(3, 0), 300, "the 3-worker run's steps")
        assert all(r["restored"] == 0 and r["wait"][0] == 0 for r in first), first
        assert sorted(r["node"] for r in first) == [0, 1, 2], first
        for i in range(3):
            wait_until(lambda i=i: whole(c, i, 2, 3), 120, f"step 2 whole on node {i}")
        wait_until(lambda: replicated(c, [0, 1, 2], 2), 120, "step 2's parts replicated")

        # node 2 is lost (raylet, daemon and RAM); once Ray has stopped the old group
        # (its workers keep the mounts busy), the survivors restart as a 2-node job
        rc.remove_node(raylets[2])
        c.lose(2)
        refresh_resources(3)
        wait_until(lambda: gone(first), 120, "Ray to stop the 3-worker group", interval=0.5)
        restart(c, 2, [0, 1])
        second = wait_until(lambda: running(2, 2), 400, "the 2-worker run", interval=1)
        for r in second:
            assert r["wait"] == [
                0,
                "restored step 2 from local (written by 3 nodes; this job has 2)",
            ], r
            assert r["restored"] == r["loaded_step"] == 2, r
            assert r["equal"] == {"model.weight": True, "optim.exp_avg": True}, r
        assert sorted(r["node"] for r in second) == [0, 1], second
        for i in range(2):
            wait_until(lambda i=i: whole(c, i, 4, 2), 120, f"step 4 whole on node {i}")
        wait_until(lambda: replicated(c, [0, 1], 4), 120, "step 4's parts replicated")

        # capacity returns: Ray grows the group (it stops the 2 workers, starts 3, which
        # wait for a 3-node job); every daemon restarts as a 3-node job, node 2 fresh
        rc.add_node(num_cpus=1, resources={"tierfs_node_2": 1}, object_store_memory=STORE)
        rc.wait_for_nodes()
        refresh_resources(4)
        wait_until(lambda: gone(second), 120, "Ray to stop the 2-worker group", interval=0.5)
        restart(c, 3, [0, 1])
        c.mounts[2].args = c.args(2)
        c.remount(2)
        runner.join(timeout=400)
        assert not runner.is_alive(), "the 3-worker run did not finish\n" + c.logs()
        assert "error" not in done, (done.get("error"), c.logs())
        third = results(out, 3, 4)
        assert len(third) == 3 and sorted(r["node"] for r in third) == [0, 1, 2], third
        for r in third:
            assert r["restored"] == r["loaded_step"] == 4, r
            assert r["equal"] == {"model.weight": True, "optim.exp_avg": True}, r
            assert r["saved"] == 6
        lines = {r["node"]: r["wait"] for r in third}
        for i in (0, 1):
            assert lines[i] == [
                0,
                "restored step 4 from local (written by 2 nodes; this job has 3)",
            ]
        assert lines[2][0] == 0 and lines[2][1].startswith(
            "restored step 4 (written by 2 nodes: this node holds no part"
        ), lines[2]
        assert done["result"].error is None, done["result"]
        for i in range(3):  # the steps the grown group saved are whole on every node
            wait_until(lambda i=i: whole(c, i, 6, 3), 120, f"step 6 whole on node {i}")
        for i in range(3):
            assert "abandon" not in c.errors(i), (i, c.errors(i))
    finally:
        ray.shutdown()
        rc.shutdown()
