"""One table for a job of N nodes (#17 item 4): the restore round, the heartbeat
round and the bucket, for N = 100, 1,000, 10,000.

Each row runs the measurements of the three scale benchmarks in the
configuration a job of that size gets by default (jobs of more than
:data:`tierfs.replication.groups.GROUP_SIZE` nodes go through group leaders,
smaller ones call the coordinator directly):

* **restore round** (``bench/round_batch_bench.py``): N simulated nodes
  against the real coordinator service on loopback in a child process; from
  the last Join: every node's plan (the decision included), the ready
  barrier passed, the done barrier; the coordinator's CPU for the round and
  its peak RSS; median of ``--repeat``;
* **heartbeat round** (``bench/heartbeat_bench.py``, configuration ``book``:
  the backup book node-rank 0 has for a job with a bucket): the coordinator's
  CPU for one round of every node's heartbeat; median of ``--repeat``
  (direct and batched rounds alternate, ABAB; the row shows the default
  route's);
* **bucket** (``bench/scale_bench.py``, counted by :mod:`tierfs.backup.budget`,
  which that bench checks against a rate-limited fake bucket at N = 100):
  requests of one backup round and of one restore with ``--files`` data
  objects per node part, and the seconds they take at least at GCS's base
  rates (1,000 writes/s, 5,000 reads/s).

Goals (issue #17, at 10,000 nodes): plans within 5 s of the last join,
barrier within 10 s, peak RSS < 2 GiB, a heartbeat round < 0.2 s of
coordinator CPU, a backup round and a restore within the base request rates.

Usage: ``.venv/bin/python bench/scale_summary.py [--nodes 100,1000,10000]
[--repeat 3] [--files 64]``. About 10 minutes on the 2-vCPU VM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import heartbeat_bench  # noqa: E402
import round_batch_bench  # noqa: E402

from tierfs.backup import budget  # noqa: E402
from tierfs.replication.groups import GROUP_SIZE  # noqa: E402


def row(nodes: int, repeat: int, files: int) -> dict[str, Any]:
    """The measured and counted figures of one N (see the module docstring)."""
    mode = "batched" if nodes > GROUP_SIZE else "direct"
    rounds = [
        asyncio.run(round_batch_bench.one_round(mode, nodes, GROUP_SIZE)) for _ in range(repeat)
    ]
    r = round_batch_bench.median(rounds)
    hb = asyncio.run(heartbeat_bench.measure(nodes, GROUP_SIZE, repeat, "book"))
    backup, restore = budget.backup_round(nodes, files).total, budget.restore(nodes, files).total
    return {
        "nodes": nodes,
        "route": mode,
        "plans_s": r["plan_s"],
        "ready_s": r["ready_s"],
        "done_s": r["done_s"],
        "round_cpu_s": r["cpu_s"],
        "peak_rss_mib": r["peak_rss_mib"],
        "heartbeat_cpu_s": hb[mode]["cpu_s"],
        "heartbeat_runs": hb[mode]["cpu_runs"],
        "backup_requests": (backup.writes, backup.reads + backup.lists),
        "backup_s": backup.seconds(),
        "restore_requests": (restore.writes, restore.reads + restore.lists),
        "restore_s": restore.seconds(),
        "load1": os.getloadavg()[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", default="100,1000,10000")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--files", type=int, default=64, help="data objects per node part")
    a = ap.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.1f}", flush=True)
    print(
        f"{'N':>7} {'route':>7} | {'plans':>6} {'ready':>6} {'done':>6} {'CPU':>6} {'RSS':>7} |"
        f" {'heartbeat CPU':>13} | {'backup round (w, r)':>22} {'at base':>8} |"
        f" {'restore (w, r)':>18} {'at base':>8} | load",
        flush=True,
    )
    for n in (int(x) for x in a.nodes.split(",") if x):
        x = row(n, a.repeat, a.files)
        print(
            f"{n:>7,} {x['route']:>7} | {x['plans_s']:>5.2f}s {x['ready_s']:>5.2f}s "
            f"{x['done_s']:>5.2f}s {x['round_cpu_s']:>5.2f}s {x['peak_rss_mib']:>4.0f} MiB |"
            f" {x['heartbeat_cpu_s']:>11.3f} s |"
            f" {x['backup_requests'][0]:>9,} w {x['backup_requests'][1]:>8,} r"
            f" {x['backup_s']:>7.0f}s |"
            f" {x['restore_requests'][0]:>5,} w {x['restore_requests'][1]:>9,} r"
            f" {x['restore_s']:>7.0f}s | {x['load1']:.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
