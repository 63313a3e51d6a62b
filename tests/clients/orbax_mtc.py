"""A real, unmodified Orbax multi-tier checkpointing client (run as a subprocess).

Usage: orbax_mtc.py CHECKPOINT_DIR PHASE EXPECTED_NPZ [STEPS...]

PHASE ``save``: initialize MTC, restore whatever the replicator offers, save
STEPS with sharded arrays, store the arrays of the last step in EXPECTED_NPZ.
PHASE ``restore``: initialize MTC, restore the latest step and compare with
EXPECTED_NPZ, then save STEPS (with a LatestN(2) preservation policy, so
Orbax's own garbage collection runs on the restored step too).

Running Orbax MTC on CPU in one process needs (docs/CLIENTS.md section 3): a
cluster environment giving the process count (Open MPI variables), parsed
absl flags, an absolute checkpoint path and ``num_slices``.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OMPI_MCA_orte_hnp_uri", "1.0;tcp://127.0.0.1:1")
os.environ.setdefault("OMPI_COMM_WORLD_SIZE", "1")
os.environ.setdefault("OMPI_COMM_WORLD_RANK", "0")
os.environ.setdefault("OMPI_COMM_WORLD_LOCAL_RANK", "0")

import jax
import jax.numpy as jnp
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


def make_state(step: int, mesh: jax.sharding.Mesh) -> dict:
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    rng = np.random.default_rng(step)
    return {
        "w": jax.device_put(jnp.asarray(rng.standard_normal((64, 32), dtype=np.float32)),
                            sharding),
        "b": jax.device_put(jnp.arange(16, dtype=jnp.int32) * step, sharding),
        "step": jax.device_put(jnp.asarray(step, dtype=jnp.int32),
                               jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())),
    }


def main() -> None:
    directory = epath.Path(os.path.abspath(sys.argv[1]))
    phase, expected_path = sys.argv[2], sys.argv[3]
    steps = [int(s) for s in sys.argv[4:]]
    initialization.initialize_multi_tier_checkpointing(
        directory, run_name="orbaxjob", backup_interval_minutes=5, num_slices=1)
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(-1), ("x",))
    policy = preservation_policy.LatestN(n=2) if phase == "restore" else None
    options = rcm.ReplicatorCheckpointManagerOptions(save_interval_steps=1,
                                                     preservation_policy=policy)
    manager = rcm.ReplicatorCheckpointManager(directory, options, global_mesh=mesh)
    latest = manager.latest_step()
    print("LATEST", latest, flush=True)
    if phase == "restore":
        restored = manager.restore(latest, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore()))["state"]
        expected = np.load(expected_path)
        np.testing.assert_array_equal(np.asarray(restored["w"]), expected["w"])
        np.testing.assert_array_equal(np.asarray(restored["b"]), expected["b"])
        assert int(restored["step"]) == int(expected["step"]), restored["step"]
        print("RESTORED_OK", latest, flush=True)
    state = None
    for step in steps:
        state = make_state(step, mesh)
        manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
        manager.wait_until_finished()
    manager.close()
    if state is not None:
        np.savez(expected_path, w=np.asarray(state["w"]), b=np.asarray(state["b"]),
                 step=np.asarray(state["step"]))
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
