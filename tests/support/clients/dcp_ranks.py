"""One rank of a stock torch.distributed.checkpoint save or load over gloo, each rank
on its own directory (as on a node-local mount per node).

Usage: dcp_ranks.py save|load RANK WORLD PORT DIR
Saves (or loads and checks) a model and optimizer state at DIR/step_10 with
``FileSystemWriter``: rank 0 writes ``__0_0.distcp`` and ``.metadata``, rank 1
only ``__1_0.distcp``. Prints ``SAVED`` or ``LOADED_OK``; a failed load exits 3.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


def state(rank: int, fill: float | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    out = {
        f"layer{rank}.weight": torch.randn(64, 32, generator=g),
        f"layer{rank}.bias": torch.randn(64, generator=g),
        "shared.step": torch.tensor(10),
    }
    if fill is not None:
        out = {k: torch.full_like(v, fill) for k, v in out.items()}
    return out


def main() -> None:
    mode, rank, world, port, root = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    path = os.path.join(root, "step_10")
    try:
        if mode == "save":
            dcp.save(state(rank), checkpoint_id=path)
            print("SAVED", flush=True)
        else:
            target = state(rank, fill=0.0)
            try:
                dcp.load(target, checkpoint_id=path)
            except BaseException as exc:  # CheckpointException is a BaseException
                if isinstance(exc, KeyboardInterrupt):
                    raise
                print("LOAD_FAILED", type(exc).__name__, str(exc)[:200], flush=True)
                sys.exit(3)
            for key, value in state(rank).items():
                assert torch.equal(target[key], value), key
            print("LOADED_OK", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
