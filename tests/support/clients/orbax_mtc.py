"""A real, unmodified Orbax multi-tier checkpointing client (run as a subprocess).

Usage: orbax_mtc.py [OPTIONS] CHECKPOINT_DIR PHASE EXPECTED_NPZ [STEPS...]

PHASE ``save``: initialize MTC, restore whatever the replicator offers, save
STEPS with sharded arrays, store the arrays of the last step in EXPECTED_NPZ.
PHASE ``restore``: initialize MTC, restore the latest step and compare with
EXPECTED_NPZ, then save STEPS (with a LatestN(2) preservation policy, so
Orbax's own garbage collection runs on the restored step too).

A job of several processes, one per tierfs node: set ``OMPI_COMM_WORLD_SIZE``
and ``OMPI_COMM_WORLD_RANK`` (the Open MPI variables JAX reads; the
coordinator address and process id come from the node's
``jax-init-info.txt``). OPTIONS: ``--data-parallelism D``: what
``initialize_multi_tier_checkpointing`` writes as ``assume-data-parallelism``;
``--backup-steps S``: ``backup-interval-steps`` instead of 5 minutes. The
arrays are sharded across all processes, so every node's step directory
holds different bytes. Each process compares the shards it holds after a
restore.

Running Orbax MTC on CPU needs (docs/CLIENTS.md section 3): a cluster
environment giving the process count (Open MPI variables), parsed absl
flags, an absolute checkpoint path and ``num_slices``.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OMPI_MCA_orte_hnp_uri", "1.0;tcp://127.0.0.1:1")
os.environ.setdefault("OMPI_COMM_WORLD_SIZE", "1")
os.environ.setdefault("OMPI_COMM_WORLD_RANK", "0")
os.environ.setdefault("OMPI_COMM_WORLD_LOCAL_RANK", "0")

import jax
import numpy as np
import orbax.checkpoint as ocp
import orbax.checkpoint.experimental.emergency.multihost  # noqa: F401
from absl import flags
from etils import epath
from orbax.checkpoint._src.checkpoint_managers import preservation_policy
from orbax.checkpoint.experimental.emergency.multi_tier_checkpointing import (
    initialization,
)
from orbax.checkpoint.experimental.emergency.multi_tier_checkpointing import (
    replicator_checkpoint_manager as rcm,
)

flags.FLAGS(sys.argv[:1])


def _options(argv: list[str]) -> tuple[dict[str, int], list[str]]:
    opts = {"data-parallelism": 0, "backup-steps": 0}
    rest = []
    it = iter(argv)
    for a in it:
        if a.startswith("--") and a[2:] in opts:
            opts[a[2:]] = int(next(it))
        else:
            rest.append(a)
    return opts, rest


OPTS, ARGS = _options(sys.argv[1:])


def host_values(step: int) -> dict[str, np.ndarray]:
    """The arrays of ``step`` as numpy (the same on every process)."""
    rng = np.random.default_rng(step)
    return {
        "w": rng.standard_normal((64, 32), dtype=np.float32),
        "b": np.arange(16, dtype=np.int32) * step,
        "step": np.asarray(step, dtype=np.int32),
    }


def make_state(step: int, mesh: jax.sharding.Mesh) -> dict:
    """``w`` and ``b`` sharded over every process's device, ``step`` replicated."""
    values = host_values(step)
    out = {}
    for name, value in values.items():
        spec = jax.sharding.PartitionSpec("x") if value.ndim else jax.sharding.PartitionSpec()
        sharding = jax.sharding.NamedSharding(mesh, spec)
        out[name] = jax.make_array_from_callback(value.shape, sharding, lambda idx, v=value: v[idx])
    return out


def check_restored(restored: dict, expected: dict[str, np.ndarray]) -> None:
    """Every shard this process holds has the expected bytes."""
    for name in ("w", "b", "step"):
        arr = restored[name]
        for shard in arr.addressable_shards:
            np.testing.assert_array_equal(
                np.asarray(shard.data), expected[name][shard.index], err_msg=f"{name}{shard.index}"
            )


def main() -> None:
    directory = epath.Path(os.path.abspath(ARGS[0]))
    phase, expected_path = ARGS[1], ARGS[2]
    steps = [int(s) for s in ARGS[3:]]
    interval = (
        {"backup_interval_steps": OPTS["backup-steps"]}
        if OPTS["backup-steps"]
        else {"backup_interval_minutes": 5}
    )
    initialization.initialize_multi_tier_checkpointing(
        directory,
        run_name="orbaxjob",
        num_slices=1,
        data_parallelism=OPTS["data-parallelism"] or None,
        **interval,
    )
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(-1), ("x",))
    policy = preservation_policy.LatestN(n=2) if phase == "restore" else None
    options = rcm.ReplicatorCheckpointManagerOptions(
        save_interval_steps=1, preservation_policy=policy
    )
    manager = rcm.ReplicatorCheckpointManager(directory, options, global_mesh=mesh)
    latest = manager.latest_step()
    print("LATEST", latest, flush=True)
    if phase == "restore":
        restored = manager.restore(latest, args=ocp.args.Composite(state=ocp.args.PyTreeRestore()))[
            "state"
        ]
        expected = dict(np.load(expected_path))
        check_restored(restored, expected)
        print("RESTORED_OK", latest, flush=True)
    state = None
    for step in steps:
        state = make_state(step, mesh)
        manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
        manager.wait_until_finished()
    manager.close()
    if steps:
        np.savez(expected_path, **host_values(steps[-1]))
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
