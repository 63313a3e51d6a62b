"""Ray Train v2 elastic training over tierfs mounts (tests/cluster/test_ray_elastic.py).

A local multi-"node" Ray cluster: a head without CPUs and one raylet per simulated
node, each with one CPU and the custom resource ``tierfs_node_<i>`` naming its tierfs
node (whose mount is ``mounts[i]`` in the train loop's config). :func:`train_loop` is
the per-worker function of a ``TorchTrainer`` (gloo on CPU): it waits for its node's
restore (``tierfs wait --nodes WORLD``), loads the restored step with ``dcp.load``
(resharded to the current world size), checks it bit for bit, then saves
:data:`STEPS_PER_RUN` steps of its DCP shard into its node's mount, reporting each.
A run that restored nothing or ran on fewer than ``final_world`` workers then idles
until Ray resizes the group; a run of ``final_world`` workers that restored a step
returns (the trainer finishes). Each run's outcome is a JSON file per rank in
``config["results"]``: ``<world>-<restored step>-<rank>.json``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from typing import Any

ROWS = 10  # tiny: uneven shards over 2 and 3 ranks
STEPS_PER_RUN = 2
RESOURCE = "tierfs_node_"


def full_state(step: int) -> dict[str, Any]:
    """The model and optimizer state of ``step`` (full tensors, float32; a function of
    the step only, so any rank can tell what was saved)."""
    import torch

    g = torch.Generator().manual_seed(step)
    return {
        "model.weight": torch.randn(ROWS, 4, generator=g),
        "optim.exp_avg": torch.randn(ROWS, 4, generator=g),
    }


def my_node() -> int:
    """The tierfs node of the Ray node this worker runs on (its ``tierfs_node_<i>``)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for n in ray.nodes():
        if n["NodeID"] == node_id:
            names = [k for k in n["Resources"] if k.startswith(RESOURCE)]
            if names:
                return int(names[0][len(RESOURCE) :])
    raise RuntimeError(f"Ray node {node_id} has no {RESOURCE}<i> resource")


def wait_restore(mount: str, world: int) -> tuple[int, str]:
    """``tierfs wait MOUNT --nodes WORLD``: (exit code, stdout + stderr without the
    ``tierfs: note:`` lines, e.g. where other ranks' files were fetched from)."""
    w = subprocess.run(
        [sys.executable, "-m", "tierfs", "wait", mount, "--nodes", str(world), "--timeout", "400"],
        capture_output=True,
        text=True,
        timeout=460,
        check=False,
    )
    err = "".join(
        line for line in w.stderr.splitlines(keepends=True) if not line.startswith("tierfs: note:")
    )
    return w.returncode, (w.stdout + err).strip()


def train_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker (see the module docstring)."""
    import ray.train
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    ctx = ray.train.get_context()
    world, rank = ctx.get_world_size(), ctx.get_world_rank()
    node = my_node()
    mount = config["mounts"][str(node)]
    code, line = wait_restore(mount, world)
    found = re.match(r"restored step (\d+)", line)
    restored = int(found.group(1)) if found and code == 0 else 0
    result: dict[str, Any] = {
        "world": world,
        "node": node,
        "wait": [code, line],
        "pid": os.getpid(),
    }
    mesh = init_device_mesh("cpu", (world,))
    if restored:
        full = full_state(restored)
        shards = {
            k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in full.items()
        }
        target: dict[str, Any] = {**shards, "step": torch.tensor(-1)}
        dcp.load(target, checkpoint_id=os.path.join(mount, f"checkpoint-{restored}"))
        result["loaded_step"] = int(target["step"])
        result["equal"] = {k: torch.equal(shards[k].full_tensor(), v) for k, v in full.items()}
    result["restored"] = restored
    for step in range(restored + 1, restored + 1 + STEPS_PER_RUN):
        state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full_state(step).items()}
        dcp.save(
            {**state, "step": torch.tensor(step)},
            checkpoint_id=os.path.join(mount, f"checkpoint-{step}"),
        )
        dist.barrier()
        ray.train.report({"step": step, "world": world})
    result["saved"] = restored + STEPS_PER_RUN
    with open(os.path.join(config["results"], f"{world}-{restored}-{rank}.json"), "w") as f:
        json.dump(result, f)
    if restored and world == config["final_world"]:
        return
    while True:  # until Ray tears the group down to resize it
        time.sleep(0.5)
