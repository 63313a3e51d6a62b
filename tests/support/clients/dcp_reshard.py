"""One rank of a stock torch.distributed.checkpoint save or load of a sharded state over
gloo, where the world size may differ between save and load (resharding, as an elastic
job restarted on fewer or more nodes does; no tierfs-specific code).

Usage: dcp_reshard.py save|load|saveload RANK WORLD PORT ROOT STEP

The state: ``model.weight`` (250x512, 500 KiB) and ``model.bias`` (250,), both derived
from STEP (and ``$DCP_RESHARD_SEED``, default 0) only and sharded on dim 0 as DTensors
over a 1-D CPU device mesh of WORLD ranks (250 rows split unevenly for most worlds),
plus a replicated ``step`` tensor. ``save`` writes ``ROOT/checkpoint-STEP/`` with
``dcp.save`` and prints ``SAVED``; ``load`` fills zeroed DTensors sharded over the
current WORLD with ``dcp.load`` from the same path, checks this rank's local shards
against the same rows of the full tensors and the step, and prints ``LOADED_OK`` (a
failed load or a wrong value prints ``LOAD_FAILED <type> <why>`` and exits 3).
``saveload`` saves, waits for every rank (``dist.barrier``) and loads at once.

``$DCP_RESHARD_BIG_MB`` (default 0): rank 1 also saves ``extra.big``, a tensor of that
many MiB only it holds, which every rank then loads: rank 1's node seals its part
later than the others (its checksum at close takes longer), and every other rank
reads rank 1's file (#14 trial 53 B1).
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

ROWS = 250  # not divisible by 3, 4 or 6: exercises uneven shards


def full_state(step: int) -> dict[str, torch.Tensor]:
    # $DCP_RESHARD_SEED (default 0) gives other values for the same step (a step saved again)
    seed = int(os.environ.get("DCP_RESHARD_SEED", "0"))
    g = torch.Generator().manual_seed(step + 1_000_003 * seed)
    return {
        "model.weight": torch.randn(ROWS, 512, generator=g),
        "model.bias": torch.randn(ROWS, generator=g),
    }


def big(step: int, rank: int) -> dict[str, torch.Tensor]:
    """``extra.big`` of $DCP_RESHARD_BIG_MB MiB: rank 1's own, and what every rank loads."""
    mib = int(os.environ.get("DCP_RESHARD_BIG_MB", "0"))
    if not mib:
        return {}
    g = torch.Generator().manual_seed(7 * step + 1)
    return {"extra.big": torch.randn(mib << 18, generator=g)}


def sharded(full: dict[str, torch.Tensor], mesh: DeviceMesh) -> dict[str, DTensor]:
    return {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}


def local_rows(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    chunks = full.chunk(world)  # DTensor's Shard(0) splits as torch.chunk does
    return chunks[rank] if rank < len(chunks) else full[:0]


def main() -> None:
    mode, rank, world, port = sys.argv[1], *map(int, sys.argv[2:5])
    root, step = sys.argv[5], int(sys.argv[6])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    path = os.path.join(root, f"checkpoint-{step}")
    try:
        mesh = init_device_mesh("cpu", (world,))
        full = full_state(step)
        if mode in ("save", "saveload"):
            extra = big(step, rank) if rank == 1 else {}
            dcp.save(
                {**sharded(full, mesh), **extra, "step": torch.tensor(step)}, checkpoint_id=path
            )
            print("SAVED", flush=True)
            if mode == "save":
                return
            dist.barrier()
        shards = sharded({k: torch.zeros_like(v) for k, v in full.items()}, mesh)
        expect_big = big(step, 1)
        loaded_big = {k: torch.zeros_like(v) for k, v in expect_big.items()}
        target: dict[str, torch.Tensor] = {**shards, **loaded_big, "step": torch.tensor(-1)}
        try:
            dcp.load(target, checkpoint_id=path)
            for key, value in full.items():
                if not torch.equal(shards[key].to_local(), local_rows(value, rank, world)):
                    raise ValueError(f"{key}: rank {rank}/{world} shard != saved rows")
            for key, value in expect_big.items():
                if not torch.equal(target[key], value):
                    raise ValueError(f"{key}: rank 1's tensor != what it saved")
            if int(target["step"]) != step:
                raise ValueError(f"step {int(target['step'])} != {step}")
        except BaseException as exc:  # CheckpointException is a BaseException
            if isinstance(exc, KeyboardInterrupt):
                raise
            print("LOAD_FAILED", type(exc).__name__, str(exc)[:300], flush=True)
            sys.exit(3)
        print("LOADED_OK", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
