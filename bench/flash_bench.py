"""Safe on a peer: tierfs against ML Flashpoint and NVRx local checkpointing (issue 18, item 3).

Usage (root, /dev/fuse)::

    .venv/bin/python bench/flash_bench.py [--size 1GiB] [--repeats 3]
        [--systems tierfs-dcp,tierfs-files,mlf,nvrx] [--json FILE]

The same 2-process save on loopback (2 processes = 2 "nodes", a gloo group on
CPU, ``--size`` bytes of float32 tensors in 16 MiB pieces, half per process)
runs through every system, interleaved (ABCD ABCD ...), each run in fresh
processes; medians of ``--repeats``. Two columns per system, both counted
from the start of the save call (after a barrier), the slower rank deciding:

* **save call returned**: the save call returned on both ranks;
* **saved + replicated**: both ranks' parts are held by their peer.

Systems:

* ``tierfs-dcp``: two tierfs daemons (generic mode, 2 nodes,
  ``--peers-per-node 1``, ``--keep-local 1``; ``benchlib.two_nodes``), each
  rank runs stock ``torch.distributed.checkpoint.save`` into
  ``<its node's mount>/step_N``. Replicated = ``.tierfs/status.json`` of each
  rank's node lists step N in state ``replicated`` (crc32c-checked and
  committed on the peer).
  After each tierfs run the measured step is removed from both mounts (the
  daemons keep sealed steps until a backup round; with no bucket the RAM
  budget would fill and replication fail with ENOSPC).
* ``tierfs-files``: the same nodes; each rank writes one file of SIZE/2 into
  ``tmp-checkpoint-N/`` on its node's mount and renames it to
  ``checkpoint-N`` (the rename seals).
* ``mlf``: ML Flashpoint 0.0.10, its PyTorch DCP adapter
  (``MemoryStorageWriter`` + ``DefaultMLFlashpointCheckpointSaver`` + its
  ``ReplicationManager``: mmap buffers on tmpfs, pairwise C++ TCP transfer).
  Replicated = every future its ``ReplicationManager.async_replicate``
  returned during the save is done (recorded by wrapping that method; the
  futures complete when the peer has received the object).
* ``nvrx``: nvidia-resiliency-ext 0.7.0 ``LocalCheckpointManager`` with
  ``CliqueReplicationStrategy`` (factor 2, jump 1: the two ranks form one
  clique, the exchange is a gloo all-gather), synchronous ``save``: it
  returns after both the own part and the peer's copy are written to the
  rank's local directory, so both columns are the same time.

Every worker first saves a 1 MiB warm-up state through its system, untimed
(on tierfs into a directory that matches no seal pattern, removed at once),
so that one-time costs of a fresh process (gloo and DCP planner caches, ML
Flashpoint's multiprocessing manager proxies, NVRx's replication groups) are
not counted: a trainer pays them once, not at every save.

Trainer slowdown: each worker first measures the rate of a CPU-bound
pure-Python loop while idle, then runs the same loop after its save returned
until its part is replicated (tierfs, ML Flashpoint: replication runs in the
background; the loop polls for "replicated" every 20 ms);
``slowdown = 1 - rate_during / rate_idle`` (median over ranks and repeats;
negative = faster than idle, i.e. noise). NVRx blocks the save call until replicated: no background
window, shown as "blocked". On a shared 2-core VM this figure is noisy.

Installing the competitors (never needed by ``make install`` or the tests;
the benchmark skips a system that is not installed and prints these lines):

* ML Flashpoint (its own venv, ``/work/flash-venv``)::

      python3 -m venv /work/flash-venv
      /work/flash-venv/bin/pip install scikit-build-core==0.11.6 pybind11==3.0.1 \\
          setuptools-scm setuptools wheel cmake ninja
      /work/flash-venv/bin/pip download --no-deps --no-build-isolation \\
          ml-flashpoint==0.0.10 -d /tmp/mlf && tar xzf /tmp/mlf/*.tar.gz -C /work/flash-src
      # abseil 20250814.1 source in /work/flash-src/abseil-cpp (here: from a
      # mirror of github.com/abseil/abseil-cpp, ``git archive 20250814.1``)
      cd /work/flash-src/ml_flashpoint-0.0.10 && git init -q && \\
      SETUPTOOLS_SCM_PRETEND_VERSION=0.0.10 /work/flash-venv/bin/pip install \\
          --no-deps --no-build-isolation -e . \\
          -C cmake.define.FETCHCONTENT_SOURCE_DIR_ABSEIL-CPP=/work/flash-src/abseil-cpp \\
          -C cmake.define.FETCHCONTENT_FULLY_DISCONNECTED=ON \\
          -C cmake.define.BUILD_TESTING=OFF

* NVRx (pure-Python checkpointing code out of the cp312 wheel)::

      pip download --no-deps --python-version 3.12 --only-binary=:all: \\
          --platform manylinux_2_39_x86_64 nvidia-resiliency-ext==0.7.0 -d /tmp/nv
      pip install --no-deps --target /work/nvrx-pkgs --python-version 3.12 \\
          --only-binary=:all: --platform manylinux_2_39_x86_64 /tmp/nv/*.whl

Workarounds (every one is needed on this CPU-only Python 3.11 machine):

* ML Flashpoint's CMake build clones abseil with FetchContent at install time
  (no GitHub access here): the abseil source is given with
  ``FETCHCONTENT_SOURCE_DIR_ABSEIL-CPP``; googletest is only fetched with
  ``BUILD_TESTING`` on, so that is off. ``pip download`` of the sdist
  prepares metadata, which needs ``setuptools_scm`` importable:
  ``--no-build-isolation`` with the build requirements installed first (a
  plain ``pip download --no-binary :all:`` tries to build its build
  dependencies from source and fails). The sdist has no ``.git``:
  ``SETUPTOOLS_SCM_PRETEND_VERSION``. Editable install (``-e``).
* ML Flashpoint's venv does not get its own torch (its ``pytorch`` extra pins
  torch 2.8.0 with CUDA wheels, gigabytes): the worker runs with
  ``PYTHONPATH`` = this checkout's ``.venv`` site-packages (torch 2.13 CPU).
* ML Flashpoint's default replication strategy (``PairwiseReplicationStrategy``)
  and its node-local-rank-0 logic divide by ``torch.cuda.device_count()``
  (0 on CPU): the worker sets ``torch.cuda.device_count = lambda: 1`` before
  importing it (each process is a node with one accelerator), ``NNODES=2``,
  ``LOCAL_RANK=0``.
* ML Flashpoint's replicas use the same path as the original: two ranks on
  one machine would write each other's objects into the same file. Each
  worker runs in its own mount namespace (``unshare -m``) with a private
  tmpfs mounted at the same base path: each "node" has its own tmpfs.
* ML Flashpoint 0.0.10's ``MemoryStorageWriter`` takes ``mp_manager_future``
  (a ``concurrent.futures.Future`` of a ``torch.multiprocessing`` manager),
  not the ``mp_manager=`` of its user guide: given a resolved future of a
  spawn-context manager.
* ML Flashpoint's default write buffer is 16 GB per rank: set to the rank's
  bytes + 64 MiB (``initial_buffer_size_bytes``).
* NVRx 0.7.0 ships wheels for CPython 3.12/3.14 only; this machine's Python
  is 3.11. Its checkpointing code is pure Python: the wheel is unpacked with
  ``pip install --no-deps --target /work/nvrx-pkgs`` and matching platform
  tags (``--python-version 3.12 --platform manylinux_2_39_x86_64``) and put
  on ``sys.path`` of the worker (the project's ``.venv`` python).
* NVRx's ``BasicTensorAwareStateDict`` asserts every tensor ``is_cuda`` and
  restores tensors to CUDA: the worker subclasses it without the assert and
  with a no-op ``restore_tensor_device``.
* NVRx's replication jump defaults to ``torch.cuda.device_count()`` (0 on
  CPU): ``CliqueReplicationStrategy.from_replication_params(
  replication_jump=1, replication_factor=2)``. Each rank gets its own local
  directory (``/dev/shm/...-nvrx/node<r>``), standing for its node's tmpfs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MiB = 1 << 20
GiB = 1 << 30
TENSOR = 16 * MiB
SYSTEMS = ("tierfs-dcp", "tierfs-files", "mlf", "nvrx")
LABELS = {
    "tierfs-dcp": "tierfs, DCP into its mounts (peers-per-node 1)",
    "tierfs-files": "tierfs, plain files + rename (peers-per-node 1)",
    "mlf": "ML Flashpoint 0.0.10 (DCP adapter, mmap tmpfs + pairwise TCP)",
    "nvrx": "NVRx 0.7.0 local checkpointing (clique, gloo)",
}
MLF_VENV = Path(os.environ.get("FLASH_BENCH_MLF_VENV", "/work/flash-venv"))
NVRX_DIR = Path(os.environ.get("FLASH_BENCH_NVRX_DIR", "/work/nvrx-pkgs"))
MLF_BASE = "/mnt/flash-bench-mlf"


# ---------------------------------------------------------------------- pure parts


def parse_size(text: str) -> int:
    """``"1GiB"``, ``"512MiB"``, ``"2G"`` or plain bytes -> bytes (ValueError if malformed)."""
    t = text.strip()
    for suffix, mult in (("GiB", GiB), ("MiB", MiB), ("G", GiB), ("M", MiB)):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)


def median(xs: list[float]) -> float | None:
    """The median of ``xs``, or None for an empty list."""
    return statistics.median(xs) if xs else None


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float | None]]:
    """Medians per system of the run records ``{"returned": s, "replicated": s,
    "slowdown": fraction or None}`` (seconds; slowdown as a fraction of the idle rate)."""
    out: dict[str, dict[str, float | None]] = {}
    for system, recs in runs.items():
        slow = [r["slowdown"] for r in recs if r.get("slowdown") is not None]
        out[system] = {
            "returned": median([r["returned"] for r in recs]),
            "replicated": median([r["replicated"] for r in recs]),
            "slowdown": median(slow),
            "runs": len(recs),
        }
    return out


def _fmt_s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} s"


def format_table(
    summary: dict[str, dict[str, float | None]],
    skipped: dict[str, str],
    labels: dict[str, str] = LABELS,
) -> str:
    """A Markdown table (one row per system: save returned, saved + replicated,
    trainer slowdown) and the ratio of each tierfs variant to the faster
    competitor on "saved + replicated" (goal <= 0.8); skipped systems listed
    with their reason."""
    lines = [
        "| system | save call returned | saved + replicated | trainer slowdown while replicating |",
        "|---|---|---|---|",
    ]
    for system, s in summary.items():
        if s.get("slowdown") is not None:
            slow = f"{s['slowdown']:+.0%}"
        else:
            slow = "blocked (save returns replicated)" if system == "nvrx" else "n/a"
        lines.append(
            f"| {labels.get(system, system)} | {_fmt_s(s['returned'])} | "
            f"{_fmt_s(s['replicated'])} | {slow} |"
        )
    competitors = [
        (s["replicated"], name)
        for name, s in summary.items()
        if not name.startswith("tierfs") and s["replicated"] is not None
    ]
    lines.append("")
    if competitors:
        best, best_name = min(competitors)
        for name, s in summary.items():
            if name.startswith("tierfs") and s["replicated"] is not None and best:
                ratio = s["replicated"] / best
                verdict = "goal met" if ratio <= 0.8 else "goal not met"
                lines.append(
                    f"{name} / {best_name} (the faster competitor), saved + replicated: "
                    f"{ratio:.2f}x (goal <= 0.80: {verdict})"
                )
    else:
        lines.append("no competitor ran: no ratio")
    for name, why in skipped.items():
        lines.append(f"skipped {name}: {why}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- worker side


def make_state(total: int, rank: int, world: int) -> dict[str, Any]:
    """This rank's share of ``total`` bytes of float32 tensors (16 MiB each, round robin)."""
    import torch

    gen = torch.Generator().manual_seed(1234 + rank)
    n = max(world, total // TENSOR)
    return {
        f"layer{i:04d}.weight": torch.rand(TENSOR // 4, generator=gen)
        for i in range(n)
        if i % world == rank
    }


def spin(n: int = 20000) -> int:
    """One unit of CPU-bound "training" work (pure Python, ~ms)."""
    return sum(i * i for i in range(n))


def idle_rate(seconds: float = 0.5) -> float:
    """Units of ``spin`` per second with nothing else going on in this process."""
    t0, k = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        spin()
        k += 1
    return k / (time.perf_counter() - t0)


def spin_until(done: Callable[[], bool], timeout: float = 600) -> tuple[float, float | None]:
    """Run ``spin`` until ``done()``; returns (monotonic time it became true, rate
    during the wait or None when the wait was too short to measure)."""
    t0, k = time.perf_counter(), 0
    deadline = time.monotonic() + timeout
    next_check = 0.0
    while True:
        now = time.monotonic()
        if now >= next_check:  # poll every 20 ms: the poll is not the trainer's work
            if done():
                break
            next_check = now + 0.02
        if now > deadline:
            raise TimeoutError("not replicated in time")
        spin()
        k += 1
    t = time.monotonic()
    dt = time.perf_counter() - t0
    return t, (k / dt if dt >= 0.05 and k >= 3 else None)


def tierfs_replicated(mnt: Path, step: int) -> bool:
    """Node status (``MNT/.tierfs/status.json``) lists ``step`` as replicated."""
    try:
        st = json.loads((mnt / ".tierfs" / "status.json").read_text())
    except (OSError, ValueError):
        return False
    return any(
        s["step"] == step and s.get("state") == "replicated" for s in st["tiers"]["peer"]["steps"]
    )


Saver = Callable[[dict[str, Any], bool], Callable[[], bool]]


def worker(a: dict[str, Any]) -> None:
    """One rank of one run; prints a JSON line with monotonic times and rates.

    Every system first saves a 1 MiB warm-up state (untimed; not a step on
    tierfs) so that one-time costs (process-group and planner caches, ML
    Flashpoint's manager proxies, NVRx's replication groups) are not
    counted; then the timed save of the rank's share of ``size`` bytes.
    """
    import torch
    import torch.distributed as dist

    rank, world, system = a["rank"], 2, a["system"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a["port"]))
    if system == "mlf":
        torch.cuda.device_count = lambda: 1  # workaround: 1 "accelerator" per node
        os.environ.update(NNODES="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    savers: dict[str, Callable[[dict[str, Any]], Saver]] = {
        "tierfs-dcp": _tierfs_saver,
        "tierfs-files": _tierfs_saver,
        "mlf": _mlf_saver,
        "nvrx": _nvrx_saver,
    }
    if system not in savers:
        raise SystemExit(f"unknown system {system}")
    save = savers[system](a)
    warm_done = save({f"warmup.r{rank}": torch.rand(MiB // 4)}, True)
    spin_until(warm_done)
    state = make_state(a["size"], rank, world)
    rate0 = idle_rate()
    dist.barrier()
    t0 = time.monotonic()
    done = save(state, False)
    t_ret = time.monotonic()
    t_rep, rate1 = spin_until(done)
    dist.barrier()
    dist.destroy_process_group()
    print(
        json.dumps(
            {
                "rank": rank,
                "returned": t_ret - t0,
                "replicated": t_rep - t0,
                "rate_idle": rate0,
                "rate_during": rate1,
            }
        ),
        flush=True,
    )


def _tierfs_saver(a: dict[str, Any]) -> Saver:
    import shutil

    import torch.distributed.checkpoint as dcp

    root, step, rank = Path(a["root"]), a["step"], a["rank"]

    def save(state: dict[str, Any], warm: bool) -> Callable[[], bool]:
        # a warm-up directory matches no seal pattern: never a step, removed at once
        final = root / (f"warmup-{step}" if warm else f"step_{step}")
        if a["system"] == "tierfs-dcp":
            dcp.save(state, checkpoint_id=str(final))
        else:
            final = root / (f"warmup-{step}" if warm else f"checkpoint-{step}")
            tmp = root / f"tmp-{final.name}"
            tmp.mkdir()
            with open(tmp / f"shard-{rank}.bin", "wb") as f:
                for t in state.values():
                    f.write(t.numpy().data)
            os.rename(tmp, final)
        if warm:
            shutil.rmtree(final, ignore_errors=True)
            return lambda: True
        return lambda: tierfs_replicated(root, step)

    return save


def _mlf_saver(a: dict[str, Any]) -> Saver:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from ml_flashpoint.adapter.pytorch.memory_storage_writer import MemoryStorageWriter
    from ml_flashpoint.checkpoint_object_manager.checkpoint_object_manager import (
        CheckpointObjectManager,
    )
    from ml_flashpoint.core.checkpoint_id_types import CheckpointContainerId
    from ml_flashpoint.core.checkpoint_saver import DefaultMLFlashpointCheckpointSaver
    from ml_flashpoint.replication.replication_manager import ReplicationManager
    from torch import multiprocessing as torch_mp

    futures: list[Any] = []
    original = ReplicationManager.async_replicate

    def recording(self: Any, buffer_io: Any) -> list[Any]:
        fs = original(self, buffer_io)
        futures.extend(fs)
        return fs

    ReplicationManager.async_replicate = recording  # type: ignore[method-assign]
    manager: concurrent.futures.Future[Any] = concurrent.futures.Future()
    manager.set_result(torch_mp.get_context("spawn").Manager())
    com = CheckpointObjectManager()
    rm = ReplicationManager()
    rm.initialize(com)
    writer = MemoryStorageWriter(
        checkpoint_saver=DefaultMLFlashpointCheckpointSaver(
            global_rank_getter=dist.get_rank,
            local_rank_getter=lambda: 0,
            global_barrier_func=dist.barrier,
            ckpt_obj_manager=com,
            replication_manager=rm,
            initial_buffer_size_bytes=a["size"] // 2 + 64 * MiB,
        ),
        mp_manager_future=manager,
    )
    base = CheckpointContainerId(f"{a['root']}/job-bench")

    def save(state: dict[str, Any], warm: bool) -> Callable[[], bool]:
        version = 2 * a["step"] + (0 if warm else 1)
        ckpt = CheckpointContainerId.create_child(
            base, CheckpointContainerId.format_version_container(version)
        )
        futures.clear()
        dcp.save(state, checkpoint_id=str(ckpt), storage_writer=writer)
        if not futures:
            raise SystemExit("ML Flashpoint started no replication")
        mine = list(futures)
        return lambda: all(f.done() for f in mine)

    return save


def _nvrx_saver(a: dict[str, Any]) -> Saver:
    sys.path.append(str(NVRX_DIR))
    from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import (
        BasicTensorAwareStateDict,
    )
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
        LocalCheckpointManager,
    )
    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import (
        CliqueReplicationStrategy,
    )

    class CPUStateDict(BasicTensorAwareStateDict):  # type: ignore[misc]
        """BasicTensorAwareStateDict without its CUDA assertion (workaround)."""

        def __init__(self, sd: dict[str, Any]) -> None:
            self.state_dict = sd
            self._is_hollow = False

        def restore_tensor_device(self, non_blocking: bool = True) -> None:
            pass

    # all_gather_object pickles the hollow state dict: its class must be found by name
    CPUStateDict.__qualname__ = CPUStateDict.__name__
    globals()["CPUStateDict"] = CPUStateDict
    strategy = CliqueReplicationStrategy.from_replication_params(
        replication_jump=1, replication_factor=2
    )
    mgr = LocalCheckpointManager(a["root"], session_id="bench", repl_strategy=strategy)

    def save(state: dict[str, Any], warm: bool) -> Callable[[], bool]:
        # synchronous: returns once the own part and the peer's copy are written
        mgr.save(CPUStateDict(state), 2 * a["step"] + (0 if warm else 1), is_async=False)
        return lambda: True

    return save


# ---------------------------------------------------------------------- orchestrator


def site_packages() -> str:
    """This interpreter's site-packages (torch for the ML Flashpoint venv)."""
    return sysconfig.get_paths()["purelib"]


def installed(system: str) -> str | None:
    """None if ``system`` can run here, else why not (with the install hint)."""
    if system == "mlf":
        py = MLF_VENV / "bin" / "python"
        if not py.exists():
            return f"no {py}: install ML Flashpoint as the docstring says"
        r = subprocess.run(
            [str(py), "-c", "import ml_flashpoint.replication.transfer_service"],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": site_packages()},
        )
        if r.returncode:
            return "ml_flashpoint does not import: " + r.stderr.strip().splitlines()[-1]
    if system == "nvrx" and not (NVRX_DIR / "nvidia_resiliency_ext").is_dir():
        return f"no {NVRX_DIR}/nvidia_resiliency_ext: unpack the NVRx wheel as the docstring says"
    return None


def worker_cmd(system: str, args: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """The command and environment of one worker process."""
    me = [os.path.abspath(__file__), "--worker", json.dumps(args)]
    env = dict(os.environ)
    if system == "mlf":
        env["PYTHONPATH"] = site_packages()
        py = str(MLF_VENV / "bin" / "python")
        inner = f'mount -t tmpfs -o size={2 * args["size"] + GiB} mlf {MLF_BASE} && exec "$@"'
        return ["unshare", "-m", "--propagation", "private", "sh", "-c", inner, "sh", py, *me], env
    return [sys.executable, *me], env


def run_once(system: str, roots: list[Path], step: int, size: int) -> dict[str, Any]:
    """One 2-process save through ``system``; the slower rank's times."""
    from benchlib import free_port

    port = free_port()
    procs = []
    for rank in range(2):
        args = {
            "system": system,
            "rank": rank,
            "port": port,
            "root": str(roots[rank]),
            "step": step,
            "size": size,
        }
        cmd, env = worker_cmd(system, args)
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    results = []
    for rank, p in enumerate(procs):
        out, err = p.communicate(timeout=900)
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if p.returncode or not lines:
            raise RuntimeError(f"{system} rank {rank} failed ({p.returncode}):\n{err[-3000:]}")
        results.append(json.loads(lines[-1]))
        log = Path(tempfile.gettempdir()) / f"flash-bench-{system}-rank{rank}.log"
        log.write_text(err)  # the worker's own logging, kept for a look after the run
    slow = [1 - r["rate_during"] / r["rate_idle"] for r in results if r["rate_during"] is not None]
    return {
        "returned": max(r["returned"] for r in results),
        "replicated": max(r["replicated"] for r in results),
        "slowdown": statistics.median(slow) if slow else None,
        "ranks": results,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--size", default="1GiB", help="state size of both ranks together")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--json", default="")
    p.add_argument(
        "--mount-arg",
        action="append",
        default=[],
        help="one more argument of both tierfs mounts (repeatable; an A/B of a "
        "setting, e.g. --mount-arg=--data-port=-1: replicas pushed over gRPC)",
    )
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(json.loads(a.worker))
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchlib import two_nodes

    size = parse_size(a.size)
    systems = [s for s in a.systems.split(",") if s]
    skipped = {s: why for s in systems if (why := installed(s))}
    for s, why in skipped.items():
        print(f"skipping {s}: {why}", flush=True)
    systems = [s for s in systems if s not in skipped]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    work = Path(tempfile.mkdtemp(prefix="flash-bench-", dir="/dev/shm"))
    os.makedirs(MLF_BASE, exist_ok=True)
    print(
        f"flash_bench: {size / GiB:.2f} GiB over 2 ranks, {a.repeats} repeats, "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    with two_nodes("flash-bench", "--size=8GiB", *a.mount_arg) as nodes:
        step = 0
        for r in range(a.repeats):
            for system in systems:
                step += 1
                if system.startswith("tierfs"):
                    roots = nodes.mounts
                elif system == "mlf":
                    roots = [Path(MLF_BASE), Path(MLF_BASE)]
                else:
                    roots = [work / f"nvrx-{step}" / f"node{i}" for i in range(2)]
                rec = run_once(system, roots, step, size)
                runs[system].append(rec)
                slow = "n/a" if rec["slowdown"] is None else f"{rec['slowdown']:+.0%}"
                print(
                    f"  run {r + 1} {system:13s} returned {rec['returned']:6.2f} s  "
                    f"replicated {rec['replicated']:6.2f} s  slowdown {slow}  "
                    f"(load {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
                if system == "nvrx":
                    subprocess.run(["rm", "-rf", str(work / f"nvrx-{step}")], check=False)
                if system.startswith("tierfs"):
                    # tierfs keeps sealed steps until a backup round (there is no
                    # bucket here): without this the RAM budget fills after a few
                    # runs and replication fails with ENOSPC on the peer
                    for mnt in nodes.mounts:
                        for name in (f"step_{step}", f"checkpoint-{step}"):
                            shutil.rmtree(mnt / name, ignore_errors=True)
    subprocess.run(["rm", "-rf", str(work)], check=False)
    summary = summarize(runs)
    print(format_table(summary, skipped))
    if a.json:
        from benchlib import write_json

        write_json(a.json, {"size": size, "runs": runs, "summary": summary, "skipped": skipped})


if __name__ == "__main__":
    main()
