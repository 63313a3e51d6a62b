"""One rank of a stock torch.distributed.checkpoint save or load over gloo, each rank on
its own node's mount (no tierfs-specific code).

Usage: dcp_step.py save|load RANK WORLD PORT ROOT STEP

The state: ``layer<r>.*`` per rank, and ``shared.embedding`` (2 MiB, the same on every
rank: DCP's planner saves it once, in one rank's file -- on torch 2.13 the rank whose
plan is smallest so far, not always rank 0 -- so the other ranks read that rank's
file on load). ``save`` writes ``ROOT/checkpoint-STEP/`` with
``dcp.save`` and prints ``SAVED``; ``load`` fills zeroed tensors with ``dcp.load``
from the same path, checks every value and prints ``LOADED_OK`` (a failed load
prints ``LOAD_FAILED <why>`` and exits 3).
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


def state(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    shared = torch.Generator().manual_seed(step)
    return {
        f"layer{rank}.weight": torch.randn(256, 128, generator=g),
        f"layer{rank}.bias": torch.randn(256, generator=g),
        "shared.embedding": torch.randn(1024, 512, generator=shared),
        "shared.step": torch.tensor(step),
    }


def main() -> None:
    mode, rank, world, port = sys.argv[1], *map(int, sys.argv[2:5])
    root, step = sys.argv[5], int(sys.argv[6])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    path = os.path.join(root, f"checkpoint-{step}")
    try:
        if mode == "save":
            dcp.save(state(rank, step), checkpoint_id=path)
            print("SAVED", flush=True)
            return
        want = state(rank, step)
        target = {k: torch.zeros_like(v) for k, v in want.items()}
        try:
            dcp.load(target, checkpoint_id=path)
        except BaseException as exc:  # CheckpointException is a BaseException
            if isinstance(exc, KeyboardInterrupt):
                raise
            print("LOAD_FAILED", type(exc).__name__, str(exc)[:300], flush=True)
            sys.exit(3)
        for key, value in want.items():
            assert torch.equal(target[key], value), key
        print("LOADED_OK", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
