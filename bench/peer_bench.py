"""Peer replication benchmark (issue 4): throughput vs a raw gRPC stream, trainer slowdown.

Two real node daemons on 127.0.0.1 (generic mode, 2 nodes, peers-per-node 1).
Node 0 seals a step of ``--gib`` GiB written through its mount; the step is
pushed to node 1 (crc32c per chunk and per file, written into node 1's RAM
store, committed). In the same run a raw gRPC client-stream carries the same
bytes (read from the same sealed snapshot, same chunk size) between two
processes to a handler that discards them: the transport's ceiling.

1. ``replication / raw`` throughput ratio (goal >= 0.8).
2. A "trainer" writing through node 0's mount (``--trainer-gib`` GiB in 4 MiB
   writes) alone, then while node 0 replicates a freshly sealed step:
   ``slowdown = t_with / t_alone - 1`` (goal <= 10 %).

Usage: ``python bench/peer_bench.py [--gib 1] [--repeat 3]`` (root, /dev/fuse).
Prints one line per measurement and the ratios; ``--json`` adds a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import cpu_seconds, status, two_nodes, wait

MiB = 1 << 20
GiB = 1 << 30
CHUNK = 4 * MiB


def write_step(root: Path, name: str, total: int, block: bytes) -> Path:
    """A step of ``total`` bytes in 256 MiB files, written through the mount under a
    temporary name; returns that directory. Renaming it to ``name`` seals the step."""
    tmp = root / f"tmp-{name}"
    tmp.mkdir()
    left, i = total, 0
    while left > 0:
        size = min(left, 256 * MiB)
        with open(tmp / f"shard-{i:03d}.bin", "wb") as f:
            for off in range(0, size, len(block)):
                f.write(block[: min(len(block), size - off)])
        left -= size
        i += 1
    return tmp


def step_entry(mnt: Path, step: int) -> dict | None:
    """The peer tier's view of a step (state, peers, per-peer transfer time and bytes)."""
    for s in status(mnt)["tiers"]["peer"]["steps"]:
        if s["step"] == step:
            return s
    return None


def replicated(mnt: Path, step: int) -> dict | None:
    s = step_entry(mnt, step)
    return s if s and s.get("state") == "replicated" else None


# ---------------------------------------------------------------------- raw stream

RAW_SERVER = r"""
import os, sys, grpc
from concurrent import futures
SINK = sys.argv[1] if len(sys.argv) > 1 else ""
def handler(it, ctx):
    n = 0
    fd = os.open(SINK, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if SINK else -1
    for m in it:
        n += len(m)
        if fd >= 0:
            os.write(fd, m)
    if fd >= 0:
        os.close(fd)
        os.unlink(SINK)
    return str(n).encode()
srv = grpc.server(futures.ThreadPoolExecutor(4), options=[
    ("grpc.max_receive_message_length", 16 << 20)])
srv.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
    "bench.Raw", {"Push": grpc.stream_unary_rpc_method_handler(handler)}),))
port = srv.add_insecure_port("127.0.0.1:0")
srv.start()
print(port, flush=True)
sys.stdin.read()
"""


def raw_stream(files: list[str], sink: str = "") -> tuple[int, float]:
    """Send the files' bytes in CHUNK messages to a server in another process.

    The server discards them, or with ``sink`` writes them to that file (on
    tmpfs: the cost of putting the bytes into the peer's RAM, which
    replication cannot avoid).
    """
    import grpc

    proc = subprocess.Popen(
        [sys.executable, "-c", RAW_SERVER, sink],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(proc.stdout.readline())
        ch = grpc.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 16 << 20)]
        )
        push = ch.stream_unary("/bench.Raw/Push")

        def gen():
            for path in files:
                fd = os.open(path, os.O_RDONLY)
                try:
                    while True:
                        data = os.read(fd, CHUNK)
                        if not data:
                            break
                        yield data
                finally:
                    os.close(fd)

        t = time.perf_counter()
        n = int(push(gen(), timeout=600))
        dt = time.perf_counter() - t
        ch.close()
        return n, dt
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)


# ---------------------------------------------------------------------- trainer


def trainer(root: Path, total: int, block: bytes) -> float:
    """Write ``total`` bytes through the mount in 4 MiB writes; returns seconds."""
    path = root / f"trainer-{uuid.uuid4().hex[:6]}.bin"
    t = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(total // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t
    path.unlink()
    return dt


def busy_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine so far, from /proc/stat, in ticks."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def quiesce(pids: list[int], timeout: float = 30.0) -> None:
    """Wait until the daemons use under 5 % of a CPU and the machine under 10 % of
    its CPUs, over half a second.

    Each timed trainer run starts from the same quiet machine, not while a
    daemon still commits the previous step or drops an old one, nor while the
    kernel still returns freed memory (page reporting runs in kernel workers).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = sum(cpu_seconds(p) for p in pids)
        b0, t0 = busy_jiffies()
        time.sleep(0.5)
        b1, t1 = busy_jiffies()
        if sum(cpu_seconds(p) for p in pids) - before < 0.025 and (b1 - b0) <= 0.1 * max(
            1, t1 - t0
        ):
            return


def pin_process(pid: int, cpus: set[int]) -> None:
    """Pin every thread of ``pid`` (threads started later inherit it) to ``cpus``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="size of the replicated step")
    p.add_argument("--trainer-gib", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--pin",
        action="store_true",
        help="pin both daemons to the last CPU and the trainer to CPU 0: "
        "replication on a core of its own, as on a many-core training host",
    )
    a = p.parse_args()
    total = int(a.gib * GiB)
    block = os.urandom(CHUNK)
    with two_nodes("tierfs-bench") as nodes:
        mounts, rams, pids = nodes.mounts, nodes.rams, nodes.pids
        if a.pin:
            cpus = sorted(os.sched_getaffinity(0))
            for pid in pids:
                pin_process(pid, {cpus[-1]})
            os.sched_setaffinity(0, {cpus[0]})
            print(f"pinned: daemons on CPU {cpus[-1]}, trainer on CPU {cpus[0]}")
        print(
            f"peer_bench: step of {total / GiB:.2f} GiB, {CHUNK // MiB} MiB chunks, "
            f"{os.cpu_count()} CPUs"
        )

        results: dict[str, list[float]] = {
            "replication": [],
            "raw": [],
            "raw_write": [],
            "alone": [],
            "during": [],
            "cpu_sender": [],
            "cpu_receiver": [],
        }
        step = 0
        for r in range(a.repeat):
            step += 1
            quiesce(pids)
            tmp = write_step(mounts[0], f"checkpoint-{step}", total, block)
            cpu0 = [cpu_seconds(p) for p in pids]
            os.rename(tmp, mounts[0] / f"checkpoint-{step}")
            entry = wait(lambda s=step: replicated(mounts[0], s), 600, f"step {step}")
            cpu = [cpu_seconds(p) - c for p, c in zip(pids, cpu0, strict=True)]
            results["cpu_sender"].append(cpu[0] / (total / GiB))
            results["cpu_receiver"].append(cpu[1] / (total / GiB))
            t = entry["transfers"]["1"]
            assert t["bytes"] == total, t
            rate = t["bytes"] / t["seconds"]
            results["replication"].append(rate)
            shard = rams[0] / "store" / "shards" / "bench" / "0" / str(step) / "data"
            files = sorted(str(f) for f in shard.rglob("*.bin"))
            n, dt = raw_stream(files)
            assert n == total
            results["raw"].append(n / dt)
            n2, dt2 = raw_stream(files, f"/dev/shm/tierfs-bench-sink-{uuid.uuid4().hex[:6]}")
            results["raw_write"].append(n2 / dt2)
            print(
                f"  run {r + 1}: replication {rate / 1e6:5.0f} MB/s   raw gRPC stream "
                f"{n / dt / 1e6:5.0f} MB/s (ratio {rate / (n / dt):.2f})   raw stream "
                f"written to tmpfs {n2 / dt2 / 1e6:5.0f} MB/s (ratio {rate / (n2 / dt2):.2f})"
            )
            print(
                f"         CPU per GiB: node 0 (seal + send) {cpu[0] / (total / GiB):.2f} s, "
                f"node 1 (receive + verify + commit) {cpu[1] / (total / GiB):.2f} s"
            )

        trainer_bytes = int(a.trainer_gib * GiB)
        for _ in range(a.repeat):
            quiesce(pids)
            alone = trainer(mounts[0], trainer_bytes, block)
            step += 1
            tmp = write_step(mounts[0], f"checkpoint-{step}", total, block)
            os.rename(tmp, mounts[0] / f"checkpoint-{step}")
            wait(
                lambda s=step: (
                    (step_entry(mounts[0], s) or {}).get("state") in ("replicating", "replicated")
                ),
                120,
                "replication to start",
            )
            during = trainer(mounts[0], trainer_bytes, block)
            entry = wait(lambda s=step: replicated(mounts[0], s), 600, f"step {step}")
            overlap = entry["transfers"]["1"]["seconds"]
            results["alone"].append(alone)
            results["during"].append(during)
            print(
                f"  trainer {trainer_bytes / GiB:.2f} GiB through the mount: alone "
                f"{alone:.2f} s, during replication {during:.2f} s (transfer "
                f"{overlap:.2f} s) -> slowdown {during / alone - 1:+.1%}"
            )

        def median(xs: list[float]) -> float:
            return sorted(xs)[len(xs) // 2]

        ratio = median(results["replication"]) / median(results["raw"])
        ratio_w = median(results["replication"]) / median(results["raw_write"])
        slowdown = median(results["during"]) / median(results["alone"]) - 1
        print(
            f"replication throughput {median(results['replication']) / 1e6:.0f} MB/s, "
            f"raw gRPC stream {median(results['raw']) / 1e6:.0f} MB/s: ratio {ratio:.2f} "
            f"(goal >= 0.80) {'OK' if ratio >= 0.8 else 'BELOW GOAL'}"
        )
        print(
            f"against a raw stream whose receiver writes the bytes to tmpfs "
            f"({median(results['raw_write']) / 1e6:.0f} MB/s): ratio {ratio_w:.2f}"
        )
        print(
            f"daemon CPU per replicated GiB: sender {median(results['cpu_sender']):.2f} s, "
            f"receiver {median(results['cpu_receiver']):.2f} s"
        )
        print(
            f"trainer slowdown while replicating: {slowdown:+.1%} (goal <= 10%) "
            f"{'OK' if slowdown <= 0.10 else 'ABOVE GOAL'}"
        )
        if a.json:
            print(
                json.dumps(
                    {
                        "ratio": ratio,
                        "ratio_write": ratio_w,
                        "slowdown": slowdown,
                        **{k: [round(x, 4) for x in v] for k, v in results.items()},
                    }
                )
            )


if __name__ == "__main__":
    main()
