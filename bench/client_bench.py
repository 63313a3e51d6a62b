"""Real checkpoint clients through tierfs and through tmpfs, side by side (issue 13, part 3).

Usage (root, /dev/fuse): ``python bench/client_bench.py [--sizes 64,1024] [--repeat 3]
[--clients torch,safetensors,dcp1,dcp2,orbax] [--json FILE]``.

Two node daemons run on loopback (generic mode, job ``bench``, 2 nodes,
peers-per-node 1): node 0's mount is the one measured, node 1 receives its
replicas. The baseline is a plain directory on /dev/shm. For every client and
state size (MiB) the same save and load run alternately on tmpfs and on
tierfs (ABAB..., ``--repeat`` pairs; medians kept), each in a fresh process
so that memory, imports and caches start alike; the page cache is dropped
before every load. Clients and the names they write:

* ``torch``: ``torch.save`` into ``tmp-checkpoint-N/model.pt``, renamed to
  ``checkpoint-N`` (Hugging Face style); ``torch.load(weights_only=True)``.
* ``safetensors``: ``safetensors.torch.save_file``, same names; ``load_file``.
* ``dcp1``: ``torch.distributed.checkpoint.save`` to ``step_N`` from one
  process (no process group); ``dcp.load`` into a state of the same shapes.
* ``dcp2``: the same from 2 processes in a gloo group, each saving its own half.
* ``orbax``: Orbax's standard ``CheckpointManager`` (``StandardSave`` /
  ``StandardRestore``) on the mount root: ``N.orbax-checkpoint-tmp-*`` renamed to ``N``.

The state is float32 tensors of 16 MiB plus eight small ones. For each tierfs
save the benchmark also records when node 0 reports the step sealed and when
it reports it replicated to node 1, counted from the moment the client's save
returned. Ratios are tierfs / tmpfs throughput (1.0 = as fast as tmpfs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import cpu_seconds, drop_caches, free_port, status, two_nodes, write_json

MiB = 1 << 20
TENSOR = 16 * MiB
CLIENTS = ("torch", "safetensors", "dcp1", "dcp2", "orbax")


# ---------------------------------------------------------------------- worker side


def torch_state(total: int, rank: int = 0, world: int = 1) -> dict:
    """``total`` bytes of float32 tensors (16 MiB each, split over ``world`` ranks) and
    eight small ones; the same values for the same arguments."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    n = max(1, total // TENSOR)
    state = {}
    for i in range(n):
        t = torch.rand(TENSOR // 4, generator=gen)
        if i % world == rank:
            state[f"layer{i:04d}.weight"] = t
    for i in range(8):
        state[f"r{rank}.small{i}"] = torch.full((256,), float(i))
    return state


def orbax_state(total: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(1234)
    n = max(1, total // TENSOR)
    state = {f"layer{i:04d}": rng.random(TENSOR // 4, dtype=np.float32) for i in range(n)}
    state["small"] = {f"b{i}": np.full((256,), float(i), dtype=np.float32) for i in range(8)}
    return state


def save_torch(root: Path, step: int, total: int, fmt: str) -> float:
    import torch

    state = torch_state(total)
    tmp, final = root / f"tmp-checkpoint-{step}", root / f"checkpoint-{step}"
    start = time.perf_counter()
    tmp.mkdir()
    if fmt == "torch":
        torch.save(state, tmp / "model.pt")
    else:
        from safetensors.torch import save_file

        save_file(state, str(tmp / "model.safetensors"))
    os.rename(tmp, final)  # the commit: seals the step on tierfs
    return time.perf_counter() - start


def load_torch(root: Path, step: int, total: int, fmt: str) -> float:
    import torch

    start = time.perf_counter()
    if fmt == "torch":
        state = torch.load(root / f"checkpoint-{step}" / "model.pt", weights_only=True)
    else:
        from safetensors.torch import load_file

        state = load_file(str(root / f"checkpoint-{step}" / "model.safetensors"))
    touch(state)
    took = time.perf_counter() - start
    _check_torch(state, torch_state(total))
    return took


def touch(state: dict) -> None:
    """Read one byte of every 4 KiB page of every tensor: ``load_file`` maps the file
    and faults pages in on first use, so a load is only done once they are touched."""
    import torch

    for t in state.values():
        int(t.view(-1).view(dtype=torch.uint8)[::4096].sum())


def _check_torch(got: dict, want: dict) -> None:
    import torch

    assert got.keys() == want.keys(), "loaded keys differ"
    for k, v in want.items():
        assert torch.equal(got[k], v), f"loaded {k} differs"


def _dcp_group(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)


def dcp_worker(
    rank: int, world: int, port: int, phase: str, root: str, step: int, total: int, out: str
) -> None:
    """One DCP rank: save or load ``step_<step>``; rank 0 writes the timing to ``out``."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    _dcp_group(rank, world, port)
    state = torch_state(total, rank, world)
    path = os.path.join(root, f"step_{step}")
    if phase == "load":
        target = {k: torch.empty_like(v) for k, v in state.items()}
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    if phase == "save":
        dcp.save(state, checkpoint_id=path)
    else:
        dcp.load(target, checkpoint_id=path)
    if world > 1:
        dist.barrier()
    took = time.perf_counter() - start
    if phase == "load":
        _check_torch(target, state)
    if rank == 0:
        Path(out).write_text(json.dumps({"seconds": took, "done_at": time.monotonic()}))
    if world > 1:
        dist.destroy_process_group()


def run_dcp(phase: str, root: Path, step: int, total: int, world: int) -> dict:
    with tempfile.NamedTemporaryFile(prefix="dcp-", suffix=".json", delete=False) as f:
        out = f.name
    port = free_port()
    if world == 1:
        dcp_worker(0, 1, port, phase, str(root), step, total, out)
    else:
        import torch.multiprocessing as tmp

        tmp.spawn(
            dcp_worker,
            args=(world, port, phase, str(root), step, total, out),
            nprocs=world,
            join=True,
        )
    result = json.loads(Path(out).read_text())
    os.unlink(out)
    return result


def _orbax_manager(root: Path):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import orbax.checkpoint as ocp

    return ocp, ocp.CheckpointManager(
        root,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=None, create=False, enable_async_checkpointing=True
        ),
    )


def save_orbax(root: Path, step: int, total: int) -> float:
    state = orbax_state(total)
    ocp, mgr = _orbax_manager(root)
    import jax

    state = jax.tree_util.tree_map(jax.numpy.asarray, state)
    start = time.perf_counter()
    mgr.save(step, args=ocp.args.StandardSave(state))
    mgr.wait_until_finished()
    took = time.perf_counter() - start
    mgr.close()
    return took


def load_orbax(root: Path, step: int, total: int) -> float:
    import numpy as np

    want = orbax_state(total)
    ocp, mgr = _orbax_manager(root)
    import jax

    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), want)
    start = time.perf_counter()
    got = mgr.restore(step, args=ocp.args.StandardRestore(abstract))
    jax.block_until_ready(got)
    took = time.perf_counter() - start
    mgr.close()
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(want), jax.tree_util.tree_leaves(got), strict=True
    ):
        assert np.array_equal(a, np.asarray(b)), f"loaded {path} differs"
    return took


def worker(client: str, phase: str, root: Path, step: int, total: int) -> dict:
    """Run one save or load in this process; returns {"seconds", "done_at"}."""
    if client in ("dcp1", "dcp2"):
        return run_dcp(phase, root, step, total, 1 if client == "dcp1" else 2)
    if client in ("torch", "safetensors"):
        fn = save_torch if phase == "save" else load_torch
        took = fn(root, step, total, client)
    elif client == "orbax":
        took = (save_orbax if phase == "save" else load_orbax)(root, step, total)
    else:
        raise SystemExit(f"unknown client {client!r}")
    return {"seconds": took, "done_at": time.monotonic()}


# ---------------------------------------------------------------------- orchestrator


def step_dir(client: str, step: int) -> str:
    if client in ("torch", "safetensors"):
        return f"checkpoint-{step}"
    if client in ("dcp1", "dcp2"):
        return f"step_{step}"
    return str(step)


def run_worker(
    client: str, phase: str, root: Path, step: int, total: int, watch: Path | None = None
) -> dict:
    """Run one save or load in a fresh process; returns its result.

    With ``watch`` (a tierfs mount), ``step``'s state there is polled every
    10 ms while the process runs and afterwards, and the result gains
    ``sealed_at`` / ``replicated_at`` (``time.monotonic()`` when first seen).
    """
    proc = subprocess.Popen(
        [sys.executable, __file__, "--worker", client, phase, str(root), str(step), str(total)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: dict[str, float] = {}
    deadline = time.monotonic() + 1800
    while watch is not None and "replicated_at" not in seen and time.monotonic() < deadline:
        try:
            state = step_state(watch, step)
        except (OSError, ValueError):
            state = None
        now = time.monotonic()
        if state in SEALED:
            seen.setdefault("sealed_at", now)
        if state == "replicated":
            seen["replicated_at"] = now
        time.sleep(0.01)
    out, err = proc.communicate(timeout=max(1, deadline - time.monotonic()))
    if proc.returncode != 0:
        raise SystemExit(f"{client} {phase} on {root} failed:\n{err[-4000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    if watch is not None and "replicated_at" not in seen:
        raise SystemExit(f"step {step} was not replicated within the deadline")
    return result | seen


def step_state(mnt: Path, step: int) -> str | None:
    for s in status(mnt)["steps"]:
        if s["step"] == step:
            return s["state"]
    return None


SEALED = ("sealed", "verified", "replicating", "replicated")


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def settle(pids: list[int], timeout: float = 30.0) -> None:
    """Wait until the daemons use under 5 % of a CPU over 0.3 s (a replication or a
    retention pass of the previous run is over)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = sum(cpu_seconds(p) for p in pids)
        time.sleep(0.3)
        if sum(cpu_seconds(p) for p in pids) - before < 0.015:
            return


def measure(
    client: str, total: int, repeat: int, mnt: Path, plain: Path, pids: list[int], steps: list[int]
) -> dict:
    samples: dict[str, list[float]] = {
        "save_tmpfs": [],
        "save_tierfs": [],
        "load_tmpfs": [],
        "load_tierfs": [],
        "sealed": [],
        "replicated": [],
    }
    for _ in range(repeat):
        for side, root in (("tmpfs", plain), ("tierfs", mnt)):
            steps[0] += 1
            step = steps[0]
            settle(pids)
            saved = run_worker(
                client, "save", root, step, total, watch=mnt if side == "tierfs" else None
            )
            samples[f"save_{side}"].append(saved["seconds"])
            if side == "tierfs":
                samples["sealed"].append(max(0.0, saved["sealed_at"] - saved["done_at"]))
                samples["replicated"].append(max(0.0, saved["replicated_at"] - saved["done_at"]))
                settle(pids)
            drop_caches()
            loaded = run_worker(client, "load", root, step, total)
            samples[f"load_{side}"].append(loaded["seconds"])
            remove(root / step_dir(client, step))
    med = {k: statistics.median(v) for k, v in samples.items()}
    mb = total / 1e6
    row = {
        "client": client,
        "size_mib": total // MiB,
        "samples": samples,
        "save_tmpfs_mbs": mb / med["save_tmpfs"],
        "save_tierfs_mbs": mb / med["save_tierfs"],
        "load_tmpfs_mbs": mb / med["load_tmpfs"],
        "load_tierfs_mbs": mb / med["load_tierfs"],
        "save_ratio": med["save_tmpfs"] / med["save_tierfs"],
        "load_ratio": med["load_tmpfs"] / med["load_tierfs"],
        "sealed_s": med["sealed"],
        "replicated_s": med["replicated"],
    }
    print(
        f"{client:<12}{total // MiB:>6} MiB  save {row['save_tmpfs_mbs']:7.0f} / "
        f"{row['save_tierfs_mbs']:7.0f} MB/s = {row['save_ratio']:.2f}   load "
        f"{row['load_tmpfs_mbs']:7.0f} / {row['load_tierfs_mbs']:7.0f} MB/s = "
        f"{row['load_ratio']:.2f}   sealed +{row['sealed_s']:.2f} s, replicated "
        f"+{row['replicated_s']:.2f} s",
        flush=True,
    )
    return row


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        client, phase, root, step, total = sys.argv[2:7]
        print(json.dumps(worker(client, phase, Path(root), int(step), int(total))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,1024", help="state sizes in MiB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--clients", default=",".join(CLIENTS))
    ap.add_argument("--json", default="bench-out/client_bench.json")
    ap.add_argument(
        "--mount-option",
        action="append",
        default=[],
        help="extra tierfs mount arguments for both nodes (e.g. --size=8GiB)",
    )
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root (mounts and drop_caches)")
    plain = Path("/dev/shm") / f"tierfs-cbench-plain-{uuid.uuid4().hex[:6]}"
    plain.mkdir()
    rows = []
    try:
        with two_nodes("tierfs-cbench", *a.mount_option) as nodes:
            mounts, pids = nodes.mounts, nodes.pids
            print(
                f"client_bench: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, "
                f"passthrough {status(mounts[0])['passthrough']}; tmpfs / tierfs",
                flush=True,
            )
            steps = [0]
            for size in [int(s) for s in a.sizes.split(",")]:
                for client in a.clients.split(","):
                    rows.append(
                        measure(client, size * MiB, a.repeat, mounts[0], plain, pids, steps)
                    )
    finally:
        shutil.rmtree(plain, ignore_errors=True)
    write_json(a.json, {"kernel": os.uname().release, "cpus": os.cpu_count(), "rows": rows})


if __name__ == "__main__":
    main()
