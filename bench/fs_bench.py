"""RAM-tier benchmark: the same workload through a tierfs mount and straight on tmpfs.

Run as root: ``python bench/fs_bench.py [--size-mib 2048] [--repeat 3]
[--modes passthrough,no_passthrough,size,size_managed]``. It mounts tierfs once
per mode on a fresh ram-dir under /dev/shm, runs each workload alternately on
tmpfs and on the mount (``--repeat`` times, median kept, so memory warm-up and
noise hit both sides alike) and prints the ratio tierfs / tmpfs for each
(throughput; higher is better, 1.0 = tmpfs). Modes:

* ``passthrough``: the default (FUSE passthrough, the ram-dir's tmpfs is the budget);
* ``no_passthrough``: ``-o no_passthrough``, the daemon serves the data itself;
* ``size``: ``--size`` below /dev/shm's size (a budget every user sets): tierfs
  mounts a tmpfs of that size on the ram-dir and keeps passthrough;
* ``size_managed``: the same ``--size`` on a ram-dir that already holds a
  store, where tierfs counts the budget itself (what ``--size`` always did
  before issue 13).

Workloads (issue 2): 1 MiB sequential writes of a 2 GiB file with 1 and 4
writers (4 writers: 4 files of size/4 in parallel processes), cold reads
(page cache dropped first) and warm reads, and a metadata workload: 10,000
small files created, stat'ed, their directory renamed, all removed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import drop_caches, write_json

MIB = 1 << 20
BLOCK = MIB


def _write_file(path: str, size: int) -> None:
    buf = os.urandom(BLOCK)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(size // BLOCK):
            os.write(fd, buf)
    finally:
        os.close(fd)


def _read_file(path: str) -> int:
    fd = os.open(path, os.O_RDONLY)
    total = 0
    buf = bytearray(BLOCK)
    try:
        while True:
            n = os.readv(fd, [buf])
            if n == 0:
                return total
            total += n
    finally:
        os.close(fd)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def write_1(root: Path, size: int) -> float:
    path = root / "seq.bin"
    t = timed(lambda: _write_file(str(path), size))
    return size / t


def write_4(root: Path, size: int) -> float:
    paths = [str(root / f"par{i}.bin") for i in range(4)]
    ctx = mp.get_context("fork")
    start = time.perf_counter()
    procs = [ctx.Process(target=_write_file, args=(p, size // 4)) for p in paths]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return size / (time.perf_counter() - start)


def read_cold(root: Path, size: int) -> float:
    drop_caches()
    t = timed(lambda: _read_file(str(root / "seq.bin")))
    return size / t


def read_warm(root: Path, size: int) -> float:
    _read_file(str(root / "seq.bin"))
    t = timed(lambda: _read_file(str(root / "seq.bin")))
    return size / t


def metadata(root: Path, files: int = 10_000) -> float:
    base = root / f"meta-{uuid.uuid4().hex[:6]}"
    start = time.perf_counter()
    os.mkdir(base)
    for i in range(files):
        fd = os.open(base / f"f{i:05d}", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"x" * 64)
        os.close(fd)
    for i in range(files):
        os.stat(base / f"f{i:05d}")
    moved = root / f"{base.name}-renamed"
    os.rename(base, moved)
    shutil.rmtree(moved)
    return files / (time.perf_counter() - start)


def cleanup(root: Path) -> None:
    for name in os.listdir(root):
        if name.startswith((".tierfs",)):
            continue
        p = root / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def mount_tierfs(mnt: Path, ram: Path, *opts: str, tree: str | None = None) -> None:
    """``tierfs mount``; with ``tree``, the tierfs of that source tree (a `before` side)."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree)) if tree else None
    subprocess.run(
        [sys.executable, "-m", "tierfs", "mount", str(mnt), "--ram-dir", str(ram), *opts],
        check=True,
        env=env,
    )


def unmount(mnt: Path) -> None:
    subprocess.run([sys.executable, "-m", "tierfs", "unmount", str(mnt), "--lazy"], check=False)


def mode_options(mode: str, ram: Path, size: int) -> list[str]:
    """``tierfs mount`` options of a benchmark mode (see the module docstring)."""
    if mode == "no_passthrough":
        return ["-o", "no_passthrough"]
    if mode in ("size", "size_managed"):
        budget = 2 * size + 512 * MIB  # the 1- and 4-writer files coexist in a round
        if budget >= shutil.disk_usage("/dev/shm").total:
            sys.exit(
                f"--size-mib {size // MIB} needs a /dev/shm larger than "
                f"{budget // MIB} MiB for the size modes"
            )
        if mode == "size_managed":
            (ram / "view").mkdir(parents=True)  # an existing store: no tmpfs of its own
        return ["--size", str(budget)]
    if mode != "passthrough":
        sys.exit(f"unknown mode {mode!r}")
    return []


def release_ram_tmpfs(ram: Path) -> None:
    """Unmount the tmpfs tierfs put on the ram-dir for ``--size`` (if it did)."""
    shutil.rmtree(ram, ignore_errors=True)
    subprocess.run(["umount", str(ram)], check=False, capture_output=True)


WORKLOADS: list[tuple[str, str]] = [
    ("write 1 MiB x1 writer", "write_1"),
    ("write 1 MiB x4 writers", "write_4"),
    ("read cold", "read_cold"),
    ("read warm", "read_warm"),
    ("metadata 10k files", "metadata"),
]


def run_suite(
    name: str, target: Path, baseline: Path, size: int, repeat: int
) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}
    funcs = {
        "write_1": lambda r: write_1(r, size),
        "write_4": lambda r: write_4(r, size),
        "read_cold": lambda r: read_cold(r, size),
        "read_warm": lambda r: read_warm(r, size),
        "metadata": metadata,
    }
    samples: dict[str, dict[str, list[float]]] = {
        k: {"tmpfs": [], "tierfs": []} for _, k in WORKLOADS
    }
    for _ in range(repeat):
        for side, root in (("tmpfs", baseline), ("tierfs", target)):
            for _label, key in WORKLOADS:
                samples[key][side].append(funcs[key](root))
            cleanup(root)
    for label, key in WORKLOADS:
        tmpfs = statistics.median(samples[key]["tmpfs"])
        tier = statistics.median(samples[key]["tierfs"])
        results[label] = {"tmpfs": tmpfs, "tierfs": tier, "ratio": tier / tmpfs}
    print(f"\n== {name} ==")
    print(f"{'workload':<26}{'tmpfs':>14}{'tierfs':>14}{'ratio':>8}")
    for label, key in WORKLOADS:
        r = results[label]
        unit = "files/s" if key == "metadata" else "MB/s"
        scale = 1 if key == "metadata" else 1e-6
        print(
            f"{label:<26}{r['tmpfs'] * scale:>10.0f} {unit:<3}{r['tierfs'] * scale:>10.0f} "
            f"{unit:<3}{r['ratio']:>8.2f}"
        )
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default="bench-out/fs_bench.json")
    ap.add_argument(
        "--modes",
        default="passthrough,no_passthrough,size,size_managed",
        help="comma-separated; a mode prefixed before_ (before_passthrough) runs "
        "the tierfs of --before",
    )
    ap.add_argument(
        "--before",
        metavar="TREE",
        help="source tree of an older tierfs for before_* modes (git archive)",
    )
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root (mounts and drop_caches)")
    size = args.size_mib * MIB
    work = Path(tempfile.mkdtemp(prefix="tierfs-bench-"))
    shm = Path("/dev/shm") / f"tierfs-bench-{uuid.uuid4().hex[:6]}"
    baseline = shm / "plain"
    baseline.mkdir(parents=True)
    # fault the memory in once so the first measured side does not pay for it
    _write_file(str(baseline / "warm"), size)
    os.unlink(baseline / "warm")
    report: dict[str, object] = {
        "size_bytes": size,
        "repeat": args.repeat,
        "kernel": os.uname().release,
        "cpus": os.cpu_count(),
    }
    try:
        for mode in args.modes.split(","):
            mnt = work / mode
            mnt.mkdir()
            ram = shm / f"ram-{mode}"
            opts = mode_options(mode.removeprefix("before_"), ram, size)
            mount_tierfs(mnt, ram, *opts, tree=args.before if mode.startswith("before_") else None)
            try:
                report[mode] = run_suite(
                    f"tierfs ({mode} {' '.join(opts)}) vs tmpfs", mnt, baseline, size, args.repeat
                )
            finally:
                unmount(mnt)
                release_ram_tmpfs(ram)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    write_json(args.json, report)


if __name__ == "__main__":
    main()
