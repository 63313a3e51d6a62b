"""Seal lag: from a step's rename to "sealed" and to "replicated" (issue #18).

Two real daemons (``benchlib.two_nodes``: generic mode, peers-per-node 1). Node 0
writes ``--files`` files of ``--mib`` MiB each into ``tmp-checkpoint-N/`` (each
closed before the next is written), renames it to ``checkpoint-N`` (the rename
seals it), and the benchmark reads node 0's log for the "sealed step N" and "step
N replicated" lines; both are counted from the rename (the log's clock has
millisecond resolution). ``--steps`` steps per run; each is removed after.

To compare two versions of tierfs, run it with ``PYTHONPATH`` set to each
checkout in turn (A B A B), e.g. the commit before and after a change of the
seal path: ``PYTHONPATH=/tmp/a python bench/seal_lag_bench.py``.

Usage: ``python bench/seal_lag_bench.py [--files 4] [--mib 128] [--steps 3]``
(root, /dev/fuse).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import two_nodes

MiB = 1 << 20


def logged_at(log: Path, pattern: re.Pattern[str], timeout: float = 60.0) -> float:
    """Unix time of the first line of ``log`` matching ``pattern`` (waits for it)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for line in log.read_text().splitlines():
            m = pattern.match(line)
            if m:
                stamp = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
                return stamp.timestamp()
        time.sleep(0.02)
    raise SystemExit(f"no line matching {pattern.pattern!r} in {log} within {timeout} s")


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--mib", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    data = os.urandom(a.mib * MiB)
    sealed: list[float] = []
    replicated: list[float] = []
    with two_nodes("seal-lag", "--size=8GiB") as nodes:
        m, log = nodes.mounts[0], nodes.rams[0] / "store" / "daemon.log"
        for step in range(1, a.steps + 1):
            tmp = m / f"tmp-checkpoint-{step}"
            tmp.mkdir()
            for k in range(a.files):
                (tmp / f"f{k}.bin").write_bytes(data)
            t = time.time()
            os.rename(tmp, m / f"checkpoint-{step}")
            stamp = r"^(\S+ \S+) INFO tierfs."
            seal_line = re.compile(stamp + rf"node.sealer: sealed step {step} ")
            copy_line = re.compile(stamp + rf"replication.replicator: step {step} replicated")
            sealed.append(logged_at(log, seal_line) - t)
            replicated.append(logged_at(log, copy_line) - t)
            for mount in nodes.mounts:
                shutil.rmtree(mount / f"checkpoint-{step}", ignore_errors=True)
            time.sleep(1)
    print(
        f"{a.files} x {a.mib} MiB, load {os.getloadavg()[0]:.1f}: rename -> sealed "
        f"{[round(x, 3) for x in sealed]} (median {statistics.median(sealed):.3f} s), "
        f"rename -> replicated {[round(x, 3) for x in replicated]} "
        f"(median {statistics.median(replicated):.3f} s)"
    )


if __name__ == "__main__":
    main()
