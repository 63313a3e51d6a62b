"""One rank of the demo training job (a small MLP, DDP on gloo, CPU).

Each rank is one "node": it talks to its own tierfs mount through the
PyTorch/NeMo side of the control protocol (PROTOCOL.md; docs/CLIENTS.md
section 4): writes ``replicator.yaml`` in place, waits for
``replicator.prerestore`` and a marker, renames the marker to ``step=<N>``
and loads its shard with ``torch.distributed.checkpoint``. It saves every
``--save-every`` steps as ``step=<N>/<rank>/`` (rank-local DCP, like NeMo's
local checkpoints) with a ``step=<N>-unfinished`` marker beside it.

Events go to ``--events`` as JSON lines (save/restore with a digest of the
model and optimizer state, loss per step) so the orchestrator can draw the
timeline and check that every restore returned exactly what was saved.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tierfs.demo.lifetime import die_with

MODEL_SIZES = {"tiny": 64, "small": 256, "medium": 1024, "large": 2048}


def log_event(path: Path, **event: Any) -> None:
    event["t"] = time.time()
    with open(path, "a") as f:
        f.write(json.dumps(event) + "\n")


def state_digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """sha256 over every tensor of the model and optimizer state, in a stable order."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    for key, st in sorted(opt.state_dict()["state"].items()):
        for name, t in sorted(st.items()):
            h.update(f"{key}.{name}".encode())
            h.update(torch.as_tensor(t).cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def wait(cond, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


def check_errors(d: Path) -> None:
    """Consume replicator.errors (logged) and replicator.failed (fatal), as NeMo does."""
    for name in ("replicator.errors", "replicator.failed"):
        p = d / name
        if p.exists():
            text = p.read_text(errors="replace")
            p.unlink(missing_ok=True)
            if name == "replicator.failed":
                raise RuntimeError(f"replicator failed: {text}")
            print(f"[trainer] replicator.errors: {text.strip()}", flush=True)


def handshake(
    d: Path, job: str, rank: int, world: int, backup_steps: int, timeout: float
) -> tuple[int | None, dict[str, Any]]:
    """The NeMo helper's sequence; returns (step to restore or None, prerestore)."""
    wait(lambda: not (d / "replicator.yaml").exists(), timeout, "no replicator.yaml")
    config = {
        "job-name": job,
        "framework": "pytorch.distributed",
        "node-rank": rank,
        "nodes": world,
        "peers-per-node": 1,
        "backup-interval-steps": backup_steps,
    }
    with open(d / "replicator.yaml", "w") as f:
        yaml.dump(config, f, default_flow_style=False, sort_keys=False)
    wait(lambda: not (d / "replicator.yaml").exists(), timeout, "replicator.yaml consumed")
    check_errors(d)
    pre = wait(
        lambda: (
            (d / "replicator.prerestore").exists() and (d / "replicator.prerestore").read_text()
        ),
        timeout,
        "prerestore",
    )
    info = yaml.safe_load(pre) or {}
    marker = wait(lambda: sorted(glob.glob(str(d / "*.restore"))), timeout, "marker")[0]
    m = re.search(r"-s(\d+)-n\d+-w\d+", marker)
    step = int(m.group(1)) if m else 0
    if step == 0:
        os.unlink(marker)
        return None, info
    os.rename(marker, d / f"step={step}")
    return step, info


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mount", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master-port", type=int, required=True)
    ap.add_argument("--job", default="demo")
    ap.add_argument("--until", type=int, required=True, help="train until this step")
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--backup-every", type=int, default=10)
    ap.add_argument("--model-size", default="small", choices=sorted(MODEL_SIZES))
    ap.add_argument("--events", required=True)
    ap.add_argument("--step-delay", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--parent", type=int, help="die with this process (the demo's pid)")
    args = ap.parse_args()
    if args.parent:
        die_with(args.parent)
    d = Path(args.mount)
    events = Path(args.events)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.master_port))
    # a peer that never comes (its start was cut short) ends this trainer within
    # --timeout, not torch's default 30 minutes
    dist.init_process_group(
        "gloo",
        rank=args.rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    torch.manual_seed(0)
    hidden = MODEL_SIZES[args.model_size]
    model = torch.nn.Sequential(
        torch.nn.Linear(64, hidden),
        torch.nn.GELU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.GELU(),
        torch.nn.Linear(hidden, 1),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    step, info = handshake(d, args.job, args.rank, args.world, args.backup_every, args.timeout)
    start = 0
    if step is not None:
        # get_state_dict initialises the optimizer's state so DCP has tensors to load into
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(0)}
        t0 = time.time()
        dcp.load(state, checkpoint_id=str(d / f"step={step}" / str(args.rank)), no_dist=True)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = int(state["step"])
        nbytes = sum(p.stat().st_size for p in (d / f"step={step}").rglob("*") if p.is_file())
        log_event(
            events,
            event="restore",
            rank=args.rank,
            step=start,
            digest=state_digest(model, opt),
            bytes=nbytes,
            seconds=time.time() - t0,
            backup=info.get("restore-backup"),
        )
    steps_seen = [0] * args.world
    dist.all_gather_object(steps_seen, start)
    if len(set(steps_seen)) != 1:
        raise RuntimeError(f"ranks restored different steps: {steps_seen}")
    if args.rank == 0:
        log_event(events, event="start", step=start)
    gen = torch.Generator().manual_seed(1234)
    x_all = torch.randn(4096, 64, generator=gen)
    w_true = torch.randn(64, 1, generator=gen) / 4
    y_all = x_all @ w_true + 0.2 * torch.tanh(x_all[:, :1] * x_all[:, 1:2])
    for i in range(start + 1, args.until + 1):
        idx = torch.randint(
            0, 4096, (256,), generator=torch.Generator().manual_seed(i * 1000 + args.rank)
        )
        loss = torch.nn.functional.mse_loss(ddp(x_all[idx]), y_all[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.rank == 0:
            log_event(events, event="loss", step=i, loss=loss.item())
        if i % args.save_every == 0:
            unfinished = d / f"step={i}-unfinished"
            unfinished.touch()
            t0 = time.time()
            model_sd, optim_sd = get_state_dict(model, opt)
            state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(i)}
            dcp.save(state, checkpoint_id=str(d / f"step={i}" / str(args.rank)), no_dist=True)
            seconds = time.time() - t0
            nbytes = sum(p.stat().st_size for p in (d / f"step={i}").rglob("*") if p.is_file())
            # the event before the commit: a trainer killed in between leaves an
            # unfinished step (never restored), not a restorable step without its digest
            log_event(
                events,
                event="save",
                rank=args.rank,
                step=i,
                digest=state_digest(model, opt),
                bytes=nbytes,
                seconds=seconds,
            )
            unfinished.unlink()
            check_errors(d)
        if args.step_delay:
            time.sleep(args.step_delay)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
