"""What the benchmarks in bench/ share: tierfs mounts, status polling, CPU time, result files.

Each benchmark measures tierfs against a baseline in the same run, interleaved
(ABAB), median of >= 3; this module holds only the plumbing around that.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tierfs(*args: str) -> None:
    """Run this checkout's ``tierfs ARGS`` (raises CalledProcessError on failure)."""
    subprocess.run(
        [sys.executable, "-P", "-m", "tierfs", *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )


def unmount(mnt: Path) -> None:
    """``tierfs unmount --lazy MNT``; a mount already gone is no error."""
    subprocess.run(
        [sys.executable, "-P", "-m", "tierfs", "unmount", str(mnt), "--lazy"],
        capture_output=True,
        check=False,
    )


def status(mnt: Path) -> dict[str, Any]:
    """The node's status (``MNT/.tierfs/status.json``)."""
    return json.loads((mnt / ".tierfs" / "status.json").read_text())


def wait(cond: Callable[[], T], timeout: float, what: str) -> T:
    """Poll ``cond`` until it returns something true; exit the benchmark after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            v = cond()
        except (OSError, ValueError, KeyError):
            v = None
        if v:
            return v
        time.sleep(0.02)
    raise SystemExit(f"timed out waiting for {what}")


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) a process has used so far, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def daemon_pid(ram: Path) -> int:
    """The pid of the daemon whose ram-dir is ``ram``."""
    return int((ram / "store" / "daemon.pid").read_text().split()[0])


def drop_caches() -> None:
    """Write back and drop the page cache (a cold read after this reads the store)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass


def write_json(path: str, data: object) -> None:
    """Write a benchmark's results to ``path`` (parents created) and say where."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    print(f"results written to {path}")


@dataclass
class TwoNodes:
    """Two tierfs nodes of one job on loopback (rank 0 runs the coordinator)."""

    mounts: list[Path]
    rams: list[Path]
    pids: list[int]


@contextlib.contextmanager
def two_nodes(prefix: str, *extra: str) -> Iterator[TwoNodes]:
    """Mount two replicating nodes (peers-per-node 1, keep-local 1), wait for their
    startup restore, and unmount and remove them on exit.

    Args:
        prefix: names the temporary mountpoints and ram-dirs (``/dev/shm/PREFIX-*``).
        extra: more ``tierfs mount`` arguments for both nodes (e.g. ``--size=8GiB``).
    """
    work = Path(tempfile.mkdtemp(prefix=f"{prefix}-"))
    ports = [free_port(), free_port()]
    mounts: list[Path] = []
    rams: list[Path] = []
    try:
        for i in range(2):
            mnt, ram = work / f"node{i}", Path(f"/dev/shm/{prefix}-{uuid.uuid4().hex[:8]}")
            mnt.mkdir()
            rams.append(ram)
            tierfs(
                "mount", str(mnt), "--ram-dir", str(ram),
                "--listen", f"127.0.0.1:{ports[i]}", "--coordinator", f"127.0.0.1:{ports[0]}",
                "--peer-token", "bench", "--job", "bench", "--nodes", "2",
                "--node-rank", str(i), "--peers-per-node", "1", "--keep-local", "1",
                *extra,
            )  # fmt: skip
            mounts.append(mnt)
        for m in mounts:
            wait(lambda m=m: status(m)["restore"].get("state") == "done", 60, "startup restore")
        yield TwoNodes(mounts, rams, [daemon_pid(ram) for ram in rams])
    finally:
        for m in mounts:
            unmount(m)
        for ram in rams:
            shutil.rmtree(ram, ignore_errors=True)  # its files (a --size tmpfs: its content)
            subprocess.run(["umount", str(ram)], check=False, capture_output=True)
            shutil.rmtree(ram, ignore_errors=True)  # the emptied mount point
        shutil.rmtree(work, ignore_errors=True)
