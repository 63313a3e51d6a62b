"""Small files through tierfs and on tmpfs, side by side, with FUSE round trips per file.

Usage (root, /dev/fuse): ``python bench/small_bench.py [--files 10000] [--size 4096]
[--repeat 3] [--mount-arg=-o --mount-arg=no_passthrough] [--json FILE]``.

Three phases on ``--files`` files in one directory, as Orbax, NeMo or HF
writers do per step (``_sharding``, ``commit_success.txt``, OCDBT pieces):
create + write ``--size`` bytes + close, stat, unlink. Each phase runs in one
process without an interpreter in the way (``bench/smallfiles.c``, built with
the system C compiler) and again through Python's ``os`` calls (what a Python
trainer pays). tmpfs and tierfs alternate (ABAB..., ``--repeat`` pairs, medians).

The daemon's own counters (``.tierfs/fuse.json``) give the FUSE requests per
file of each phase by opcode; the requests the counter read itself costs are
measured once and subtracted.
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
from benchlib import write_json

PHASES = ("create", "stat", "unlink")
LABELS = {"create": "create+write+close", "stat": "stat", "unlink": "unlink"}


def build_c(work: Path) -> Path | None:
    """Compile bench/smallfiles.c; None if there is no C compiler."""
    src = Path(__file__).with_name("smallfiles.c")
    exe = work / "smallfiles"
    for cc in ("cc", "gcc", "clang"):
        if shutil.which(cc):
            subprocess.run([cc, "-O2", "-o", str(exe), str(src)], check=True)
            return exe
    return None


def python_phase(d: Path, files: int, size: int, phase: str) -> float:
    """The C program's phase through Python's os module; returns seconds."""
    names = [os.path.join(d, f"f{i:06d}") for i in range(files)]
    buf = b"x" * size
    start = time.perf_counter()
    if phase == "create":
        for name in names:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            os.write(fd, buf)
            os.close(fd)
    elif phase == "stat":
        for name in names:
            if os.stat(name).st_size != size:
                raise SystemExit(f"{name}: wrong size")
    else:
        for name in names:
            os.unlink(name)
    return time.perf_counter() - start


def run_phase(exe: Path | None, lang: str, d: Path, files: int, size: int, phase: str) -> float:
    """One phase in directory ``d`` (made by "create", removed by "unlink"); seconds."""
    if lang == "c" and exe is not None:
        out = subprocess.run(
            [str(exe), str(d), str(files), str(size), phase],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        return next(iter(json.loads(out).values()))
    if phase == "create":
        d.mkdir()
    took = python_phase(d, files, size, phase)
    if phase == "unlink":
        d.rmdir()
    return took


def counters(mnt: Path) -> dict[str, int]:
    with open(mnt / ".tierfs" / "fuse.json") as f:
        return json.load(f)["requests"]


def per_file(
    before: dict[str, int], after: dict[str, int], overhead: dict[str, int], files: int
) -> dict[str, float]:
    out = {}
    for op in sorted(set(before) | set(after)):
        n = after.get(op, 0) - before.get(op, 0) - overhead.get(op, 0)
        if n > 0:
            out[op] = round(n / files, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--mount-arg",
        action="append",
        default=[],
        help="extra `tierfs mount` argument (repeatable)",
    )
    ap.add_argument("--json", default="bench-out/small_bench.json")
    ap.add_argument(
        "--before",
        metavar="TREE",
        help="also run a tierfs from this source tree (e.g. `git archive` of an "
        "older commit) as a third side, for before/after in one run",
    )
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root (mounts)")
    work = Path(tempfile.mkdtemp(prefix="tierfs-sbench-"))
    shm = Path("/dev/shm") / f"tierfs-sbench-{uuid.uuid4().hex[:6]}"
    plain, ram, mnt = shm / "plain", shm / "ram", work / "mnt"
    plain.mkdir(parents=True)
    mnt.mkdir()
    exe = build_c(work)
    langs = ["c", "python"] if exe else ["python"]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tierfs",
            "mount",
            str(mnt),
            "--ram-dir",
            str(ram),
            "-o",
            "allow_other",
            *a.mount_arg,
        ],
        check=True,
    )
    sides: list[tuple[str, Path]] = [("tmpfs", plain), ("tierfs", mnt)]
    if a.before:
        old_mnt, old_ram = work / "before", shm / "ram-before"
        old_mnt.mkdir()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "tierfs",
                "mount",
                str(old_mnt),
                "--ram-dir",
                str(old_ram),
                "-o",
                "allow_other",
                *a.mount_arg,
            ],
            check=True,
            env=dict(os.environ, PYTHONPATH=os.path.abspath(a.before)),
        )
        sides.append(("before", old_mnt))
    report: dict = {
        "files": a.files,
        "size": a.size,
        "repeat": a.repeat,
        "mount_args": a.mount_arg,
        "kernel": os.uname().release,
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg(),
    }
    try:
        c0 = counters(mnt)
        overhead = {k: v - c0.get(k, 0) for k, v in counters(mnt).items() if v - c0.get(k, 0)}
        samples = {(lang, side, ph): [] for lang in langs for side, _ in sides for ph in PHASES}
        requests: dict[str, dict[str, float]] = {}
        for _ in range(a.repeat):
            for lang in langs:
                for side, root in sides:
                    d = root / f"d-{uuid.uuid4().hex[:6]}"
                    for ph in PHASES:
                        before = counters(mnt) if side == "tierfs" else {}
                        samples[(lang, side, ph)].append(
                            run_phase(exe, lang, d, a.files, a.size, ph)
                        )
                        if side == "tierfs" and lang == langs[0]:
                            requests[ph] = per_file(before, counters(mnt), overhead, a.files)
        report["load_after"] = os.getloadavg()
        rows = []
        print(
            f"small_bench: {a.files} files of {a.size} bytes, {a.repeat} ABAB pairs, "
            f"load {report['load_before'][0]:.1f} -> {report['load_after'][0]:.1f}"
        )
        before_cols = f"{'before files/s':>16}{'ratio':>7}" if a.before else ""
        print(
            f"{'phase':<22}{'client':<8}{'tmpfs files/s':>15}{'tierfs files/s':>16}"
            f"{'ratio':>7}{before_cols}  FUSE requests per file"
        )
        for ph in PHASES:
            for lang in langs:
                t = statistics.median(samples[(lang, "tmpfs", ph)])
                f = statistics.median(samples[(lang, "tierfs", ph)])
                row = {
                    "phase": ph,
                    "client": lang,
                    "tmpfs_files_s": a.files / t,
                    "tierfs_files_s": a.files / f,
                    "ratio": t / f,
                    "requests_per_file": requests[ph],
                    "samples": {side: samples[(lang, side, ph)] for side, _ in sides},
                }
                extra = ""
                if a.before:
                    b = statistics.median(samples[(lang, "before", ph)])
                    row |= {"before_files_s": a.files / b, "before_ratio": t / b}
                    extra = f"{a.files / b:>16.0f}{t / b:>7.3f}"
                rows.append(row)
                reqs = ", ".join(f"{k} {v:g}" for k, v in requests[ph].items())
                print(
                    f"{LABELS[ph]:<22}{lang:<8}{row['tmpfs_files_s']:>15.0f}"
                    f"{row['tierfs_files_s']:>16.0f}{row['ratio']:>7.3f}{extra}  "
                    f"{sum(requests[ph].values()):.2f} ({reqs})"
                )
        report["rows"] = rows
    finally:
        for _side, root in sides[1:]:
            subprocess.run(
                [sys.executable, "-m", "tierfs", "unmount", str(root), "--lazy"], check=False
            )
        shutil.rmtree(shm, ignore_errors=True)
        subprocess.run(["umount", str(ram)], check=False, capture_output=True)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    write_json(a.json, report)


if __name__ == "__main__":
    main()
