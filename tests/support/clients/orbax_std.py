"""Orbax's standard ``CheckpointManager`` on node-local storage, in JAX processes on CPU
(run as a subprocess, one per tierfs node).

Usage: orbax_std.py CHECKPOINT_DIR PHASE PROCESS_ID PROCESSES PORT STEP

PHASE ``save``: save STEP with arrays sharded over every process's device (rows of
``w`` and ``b`` split across processes: every node's step directory holds other
bytes); prints ``SAVED``. PHASE ``load``: restore the latest step onto another
sharding (``w`` split by columns, ``b`` replicated; with one process over 2
local devices) and compare every shard this process holds with the values saved
(bit for bit); prints ``LOADED_OK <step>``. PROCESSES > 1 joins
``jax.distributed`` at 127.0.0.1:PORT.

Node-local storage (each process's directory is its own node's tierfs mount, not a
shared filesystem) needs two Orbax options, both documented by Orbax for it:
``MultiprocessingOptions(primary_host=None)`` ("all hosts will be considered as
primary ... useful in the case that all hosts are only working with local
storage": each process creates, finalizes and renames its own step directory;
with the default primary host 0, process 1's directory is never renamed) and
``use_ocdbt=False`` (OCDBT's finalize merges every process's manifest in the
shared directory, which a node-local directory does not have: the save hangs).
tierfs's whole-step view then shows every process's files on every node.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import orbax.checkpoint as ocp

P = jax.sharding.PartitionSpec


def values(step: int) -> dict[str, np.ndarray]:
    """The arrays saved at ``step`` (deterministic)."""
    rng = np.random.default_rng(step)
    return {
        "w": rng.standard_normal((64, 32), dtype=np.float32),
        "b": np.arange(16, dtype=np.int32) * step,
    }


def main() -> None:
    directory, phase = os.path.abspath(sys.argv[1]), sys.argv[2]
    pid, processes, port, step = (int(a) for a in sys.argv[3:7])
    if processes > 1:
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=processes, process_id=pid)
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(-1), ("x",))
    mp = ocp.options.MultiprocessingOptions(primary_host=None)
    manager = ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(
            enable_async_checkpointing=False, multiprocessing_options=mp, create=True
        ),
        item_handlers=ocp.StandardCheckpointHandler(use_ocdbt=False, multiprocessing_options=mp),
    )
    if phase == "save":
        state = {}
        for name, value in values(step).items():
            sharding = jax.sharding.NamedSharding(mesh, P("x"))
            state[name] = jax.make_array_from_callback(
                value.shape, sharding, lambda idx, v=value: v[idx]
            )
        manager.save(step, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
        print("SAVED", flush=True)
    else:
        latest = manager.latest_step()
        expected = values(latest)
        specs = {"w": P(None, "x"), "b": P()}  # another sharding than the save's
        abstract = {
            name: jax.ShapeDtypeStruct(
                v.shape, v.dtype, sharding=jax.sharding.NamedSharding(mesh, specs[name])
            )
            for name, v in expected.items()
        }
        got = manager.restore(latest, args=ocp.args.StandardRestore(abstract))
        for name, value in expected.items():
            for shard in got[name].addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index])
        print("LOADED_OK", latest, flush=True)
    manager.close()


if __name__ == "__main__":
    main()
