"""A small torch training loop that checkpoints like the HF Trainer (used by test_peer_generic).

Saves ``checkpoint-<step>/`` by writing ``tmp-checkpoint-<step>/`` and renaming
it; resumes from the newest ``checkpoint-*`` it finds, as frameworks that list
their own output directory do. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re

import torch

CKPT = re.compile(r"^checkpoint-(\d+)$")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--until", type=int, required=True)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.manual_seed(a.seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(256, 32)
    y = x.sum(dim=1, keepdim=True)
    step = 0
    found = sorted((int(m[1]), n) for n in os.listdir(a.root) if (m := CKPT.match(n)))
    resumed = None
    if found:
        step, name = found[-1]
        d = os.path.join(a.root, name)
        model.load_state_dict(torch.load(os.path.join(d, "model.pt")))
        opt.load_state_dict(torch.load(os.path.join(d, "optimizer.pt")))
        with open(os.path.join(d, "trainer_state.json")) as f:
            assert json.load(f)["global_step"] == step
        resumed = step
    loss = None
    while step < a.until:
        opt.zero_grad()
        out = torch.nn.functional.mse_loss(model(x), y)
        out.backward()
        opt.step()
        step += 1
        loss = float(out)
        if step % a.save_every == 0:
            tmp = os.path.join(a.root, f"tmp-checkpoint-{step}")
            os.makedirs(tmp)
            torch.save(model.state_dict(), os.path.join(tmp, "model.pt"))
            torch.save(opt.state_dict(), os.path.join(tmp, "optimizer.pt"))
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump({"global_step": step, "loss": loss}, f)
            os.rename(tmp, os.path.join(a.root, f"checkpoint-{step}"))
    print(json.dumps({"resumed_from": resumed, "step": step, "loss": loss}), flush=True)


if __name__ == "__main__":
    main()
