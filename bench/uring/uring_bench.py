"""FUSE round trips per second over /dev/fuse read/write against FUSE-over-io_uring, beside tmpfs.

Usage (root, kernel with ``CONFIG_FUSE_IO_URING``): ``python bench/uring/uring_bench.py
[--files 5000] [--repeat 3] [--sides tmpfs,dev,dev-pinned,uring-default,uring-default-pinned]
[--busy N] [--json FILE]``.

Each side is one mount: tmpfs (the reference), or ``bench/uring/spikefs.py``
(the same in-memory Python daemon) served over /dev/fuse read/write (``dev``)
or over io_uring with the ring's task-work mode ``default`` (signal-based),
``coop`` (``IORING_SETUP_COOP_TASKRUN``) or ``defer``
(``IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN``), one thread
for all queues, or with a ``-pinned`` suffix (``uring-default-pinned``) one
thread and ring per queue pinned to the queue's CPU; ``dev-pinned`` is the
control for those: one /dev/fuse reader thread per CPU, pinned. The sides run
interleaved (one round = every side once, ``--repeat`` rounds, medians), each
sample on a fresh mount; ``/sys/module/fuse/parameters/enable_uring`` is set to Y
only while an io_uring side's mount answers INIT, then restored.

Phases of a sample, all from ``bench/smallfiles.c`` (one C process, no
interpreter on the client side): ``getattr loop``: stat of ``--files`` files
whose attributes never stay cached (one GETATTR round trip each, after an
unmeasured warm-up pass that caches the names); then the small-files phases
of ``bench/small_bench.py`` on a new directory: create + write 4 KiB +
close, stat, unlink. The daemon's request counts (snapshots on SIGUSR1) give
the FUSE requests per file of each phase. Prints files/s, the ratio to tmpfs
and to ``dev``, and the load average before and after (the machine is shared;
``--busy N`` adds N spinning processes, a controlled load like other
sessions' test suites).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENABLE = Path("/sys/module/fuse/parameters/enable_uring")
PHASES = ("getattr loop", "create+write+close", "stat", "unlink")
C_KEYS = {"create_write_close": "create+write+close", "stat": "stat", "unlink": "unlink"}


def build_client(work: Path) -> Path:
    """Compile bench/smallfiles.c with the system C compiler; returns the executable."""
    exe = work / "smallfiles"
    subprocess.run(["cc", "-O2", "-o", str(exe), str(HERE.parent / "smallfiles.c")], check=True)
    return exe


def run_client(exe: Path, d: Path, files: int, size: int, phase: str) -> dict[str, float]:
    """One smallfiles run; returns its JSON (seconds per phase)."""
    out = subprocess.run(
        [str(exe), str(d), str(files), str(size), phase],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return json.loads(out.stdout)


def wait_for(cond, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    """Poll ``cond()`` every 10 ms until true; RuntimeError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.01)


class Side:
    """One mount to measure: tmpfs, or spikefs in one transport mode."""

    def __init__(self, name: str, work: Path, files: int) -> None:
        self.name, self.work, self.files = name, work, files
        self.mnt = work / f"mnt-{name}"
        self.stats = work / f"stats-{name}.json"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Side:
        self.mnt.mkdir(exist_ok=True)
        if self.name == "tmpfs":
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=1g", "bench-tmpfs", str(self.mnt)], check=True
            )
            (self.mnt / "pre").mkdir()
            for i in range(self.files):
                (self.mnt / "pre" / f"f{i:06d}").touch()
            return self
        mode, *rest = self.name.split("-")
        self.stats.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            str(HERE / "spikefs.py"),
            str(self.mnt),
            "--mode",
            mode,
            "--files",
            str(self.files),
            "--stats",
            str(self.stats),
        ]
        if rest and rest[0] != "pinned":
            cmd += ["--taskrun", rest[0]]
        if rest[-1:] == ["pinned"]:
            cmd.append("--pinned")
        old = ENABLE.read_text().strip() if mode == "uring" else None
        if old is not None:  # the kernel reads it at INIT only; the connection keeps io_uring
            ENABLE.write_text("Y")
        try:
            self.proc = proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
            wait_for(lambda: os.path.ismount(self.mnt) or proc.poll() is not None, 30, "mount")
            if proc.poll() is not None:
                raise RuntimeError(f"{self.name}: spikefs exited {proc.returncode}")
            os.stat(self.mnt / "pre")  # answered after INIT (and once the ring is ready)
        finally:
            if old is not None:
                ENABLE.write_text(old)
        return self

    def counts(self) -> Counter[str]:
        """A snapshot of the daemon's request counts by opcode (empty for tmpfs)."""
        if self.proc is None:
            return Counter()
        self.stats.unlink(missing_ok=True)
        self.proc.send_signal(signal.SIGUSR1)
        wait_for(self.stats.exists, 10, f"{self.name} stats")
        raw = json.loads(self.stats.read_text())
        return Counter({k.split(":", 1)[1]: v for k, v in raw.items()})

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["umount", str(self.mnt)], check=False)
        if self.proc is not None:
            self.proc.wait(timeout=30)
            if self.proc.returncode != 0:
                raise RuntimeError(f"{self.name}: spikefs exited {self.proc.returncode}")


def sample(
    side: Side, exe: Path, files: int, round_no: int
) -> tuple[dict[str, float], dict[str, Counter[str]]]:
    """One mount's phases: files/s per phase and the requests of each phase by opcode."""
    rates: dict[str, float] = {}
    reqs: dict[str, Counter[str]] = {}
    pre = side.mnt / "pre"
    run_client(exe, pre, files, 0, "stat")  # warm-up: caches the names
    before = side.counts()
    rates["getattr loop"] = files / run_client(exe, pre, files, 0, "stat")["stat"]
    after = side.counts()
    reqs["getattr loop"] = after - before
    d = side.mnt / f"d{round_no}"
    for phase in ("create", "stat", "unlink"):
        before = after
        result = run_client(exe, d, files, 4096, phase)
        after = side.counts()
        for key, secs in result.items():
            rates[C_KEYS[key]] = files / secs
            reqs[C_KEYS[key]] = after - before
    return rates, reqs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=5000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sides", default="tmpfs,dev,dev-pinned,uring-default,uring-default-pinned")
    ap.add_argument(
        "--busy", type=int, default=0, help="run this many busy loops (CPU load) meanwhile"
    )
    ap.add_argument("--json", help="write the medians and samples here")
    args = ap.parse_args()
    sides = args.sides.split(",")
    work = Path(tempfile.mkdtemp(prefix="uring-bench-"))
    old = ENABLE.read_text().strip() if ENABLE.exists() else None  # restored at the end anyway
    load_before = os.getloadavg()
    samples: dict[str, list[dict[str, float]]] = {s: [] for s in sides}
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    requests: dict[str, dict[str, Counter[str]]] = {}
    try:
        if any(s.startswith("uring") for s in sides) and old is None:
            raise SystemExit("this kernel has no FUSE over io_uring (no enable_uring parameter)")
        exe = build_client(work)
        for r in range(args.repeat):
            for name in sides:
                with Side(name, work, args.files) as side:
                    rates, reqs = sample(side, exe, args.files, r)
                samples[name].append(rates)
                requests[name] = reqs
                print(
                    f"round {r + 1} {name}: " + ", ".join(f"{p} {rates[p]:.0f}/s" for p in PHASES),
                    flush=True,
                )
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
        if old is not None:
            ENABLE.write_text(old)
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    med = {s: {p: statistics.median(x[p] for x in samples[s]) for p in PHASES} for s in sides}
    print(
        f"\nload average before {load_before[0]:.2f}, after {load_after[0]:.2f}; "
        f"{args.files} files, medians of {args.repeat}, {args.busy} busy loops"
    )
    print(
        f"{'phase':20} {'side':20} {'files/s':>9} {'/tmpfs':>7} {'/dev':>6}  FUSE requests per file"
    )
    for p in PHASES:
        for s in sides:
            rate = med[s][p]
            tmp = f"{rate / med['tmpfs'][p]:.3f}" if "tmpfs" in med else "-"
            dev = f"{rate / med['dev'][p]:.2f}" if "dev" in med else "-"
            per = ", ".join(
                f"{op} {n / args.files:.2f}"
                for op, n in sorted(requests[s][p].items())
                if n / args.files >= 0.01
            )
            print(f"{p:20} {s:20} {rate:9.0f} {tmp:>7} {dev:>6}  {per}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "files": args.files,
                    "load": [load_before, load_after],
                    "busy": args.busy,
                    "medians": med,
                    "samples": samples,
                    "requests": {
                        s: {p: dict(c) for p, c in v.items()} for s, v in requests.items()
                    },
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
