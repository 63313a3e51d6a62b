"""A PyTorch training loop saving with torch.distributed.checkpoint through the NeMo flow.

Usage: dcp_mtc.py CHECKPOINT_DIR STEPS EXPECTED_PT

It follows the NeMo helper (docs/CLIENTS.md section 4): writes replicator.yaml
in place, waits for replicator.prerestore and the first marker, renames it to
``step=<N>``, loads the model and optimizer from it with DCP, then trains
STEPS more steps saving every step as ``step=<N>/`` with a ``-unfinished``
marker (odd steps are finalized like async saves: renamed to digits).
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mtc_clients import nemo_restore, nemo_write_yaml


def main() -> None:
    d = Path(sys.argv[1])
    steps = int(sys.argv[2])
    expected_path = Path(sys.argv[3])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    nemo_write_yaml(d, "dcpjob", 0, 1)
    start = 0
    step = nemo_restore(d)
    if step is not None:
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=str(d / f"step={step}"))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = int(state["step"])
        expected = torch.load(expected_path)
        for k, v in model.state_dict().items():
            assert torch.equal(v, expected[k]), k
        print("RESTORED_OK", step, start, flush=True)
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(1))
    y = x.sum(dim=1, keepdim=True)
    for i in range(start + 1, start + steps + 1):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        unfinished = d / f"step={i}-unfinished"
        unfinished.touch()
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": torch.tensor(i)}
        dcp.save(state, checkpoint_id=str(d / f"step={i}"))
        unfinished.unlink()
        if i % 2 == 1:  # async-style finalize: step=<N> -> <N> (digits)
            os.rename(d / f"step={i}", d / str(i))
        torch.save(model.state_dict(), expected_path)
        print("SAVED", i, float(loss), flush=True)


if __name__ == "__main__":
    main()
