"""A cluster of real node daemons on 127.0.0.1 for the peer-plane tests.

Each node is a ``tierfs mount`` (own mountpoint, own ram-dir, own gRPC
port); node 0 listens on the coordinator address (or, with
``coordinator=False``, the nodes find it through the bucket rendezvous and
need ``--bucket`` in ``extra``). Trainers are separate
processes running ``tests/support/mtc_client.py`` on every node at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierfs.demo.emulator import free_port

CLIENT = str(Path(__file__).with_name("mtc_client.py"))


def wait_until(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll ``cond`` until it returns something truthy; returns it."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = cond()
            if value:
                return value
        except (OSError, ValueError, KeyError, TypeError) as exc:
            last_exc = exc
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout:.0f}s waiting for {what}"
        + (f" (last error: {last_exc})" if last_exc else "")
    )


class Cluster:
    """``n`` node daemons forming one peer plane.

    Args:
        make_mount: the conftest fixture.
        n: number of nodes.
        extra: more ``tierfs mount`` arguments for every node.
        token: the peer token.
        join_timeout: ``--join-timeout`` seconds.
        coordinator: pass ``--coordinator`` (node 0's address) to every node.
    """

    def __init__(
        self,
        make_mount: Any,
        n: int,
        *,
        extra: tuple[str, ...] = (),
        token: str = "t",
        join_timeout: float = 60,
        start: bool = True,
        node_args: Callable[[int], list[str]] | None = None,
        coordinator: bool = True,
    ) -> None:
        self.make_mount = make_mount
        self.n = n
        self.coordinator = coordinator
        self.node_args = node_args
        self.ports = [free_port() for _ in range(n)]
        self.token = token
        self.extra = extra
        self.join_timeout = join_timeout
        self.mounts: list[Any] = []
        if start:
            for i in range(n):
                self.mounts.append(make_mount(*self.args(i), name=f"node{i}"))

    def args(self, i: int) -> list[str]:
        coord = ["--coordinator", f"127.0.0.1:{self.ports[0]}"] if self.coordinator else []
        return [
            "--listen",
            f"127.0.0.1:{self.ports[i]}",
            *coord,
            "--peer-token",
            self.token,
            "--join-timeout",
            str(self.join_timeout),
            *self.extra,
            *(self.node_args(i) if self.node_args else []),
        ]

    def move(self, i: int) -> None:
        """Give node ``i`` a new port for its next mount (a restart elsewhere)."""
        self.ports[i] = free_port()
        self.mounts[i].args = self.args(i)

    def root(self, i: int) -> Path:
        return self.mounts[i].path

    def status(self, i: int) -> dict[str, Any]:
        return json.loads((self.root(i) / ".tierfs" / "status.json").read_text())

    def peer(self, i: int) -> dict[str, Any]:
        return self.status(i)["tiers"]["peer"]

    def errors(self, i: int) -> str:
        p = self.mounts[i].view / "replicator.errors"
        return p.read_text() if p.exists() else ""

    def clients(
        self, *, steps: str = "", ranks: list[int] | None = None, timeout: float = 120, **kw: Any
    ) -> list[dict[str, Any]]:
        """Run one trainer per node at once; returns their JSON results by rank."""
        ranks = list(range(self.n)) if ranks is None else ranks
        procs = []
        for r in ranks:
            cmd = [
                sys.executable,
                CLIENT,
                str(self.root(r)),
                "--rank",
                str(r),
                "--nodes",
                str(self.n),
                "--steps",
                steps,
                "--timeout",
                str(timeout),
            ]
            for k, v in kw.items():
                cmd += [f"--{k.replace('_', '-')}", str(v)]
            procs.append(
                subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            )
        results = []
        for r, proc in zip(ranks, procs, strict=True):
            out, err = proc.communicate(timeout=timeout + 60)
            line = out.strip().splitlines()[-1] if out.strip() else "{}"
            result = json.loads(line)
            if proc.returncode != 0 or "error" in result:
                raise AssertionError(
                    f"trainer on node {r} failed: {result} {err[-2000:]}\n" + self.logs()
                )
            results.append(result)
        return results

    def wait_synced(self, step: int, timeout: float = 60) -> None:
        """Until every node reports ``step`` as the cluster's last sync round."""
        for i in range(self.n):
            wait_until(
                lambda i=i: (self.peer(i)["sync"].get("step") or -1) >= step,
                timeout,
                f"node {i} to report sync round {step}",
            )

    def lose(self, i: int) -> None:
        """kill -9 node ``i``'s daemon and wipe its RAM (its ram-dir)."""
        m = self.mounts[i]
        m.kill9()
        shutil.rmtree(m.ram_dir)

    def remount(self, i: int) -> None:
        self.mounts[i].mount()

    def logs(self) -> str:
        out = []
        for i, m in enumerate(self.mounts):
            out.append(f"----- node {i} log -----\n{m.log()[-6000:]}")
        return "\n".join(out)


def job_args(job: str, n: int, *more: str) -> Callable[[int], list[str]]:
    """``node_args`` for :class:`Cluster`: a generic-mode job of ``n`` nodes, one replica
    per node, plus ``more`` arguments."""
    return lambda i: [
        "--job",
        job,
        "--nodes",
        str(n),
        "--node-rank",
        str(i),
        "--peers-per-node",
        "1",
        *more,
    ]


def run_ranks(
    c: Cluster,
    client: str,
    args: Callable[[int, int, int], list[str]],
    nodes: list[int],
    env: dict[str, str] | None = None,
) -> list[str]:
    """One process of the client script ``client`` per node of ``nodes`` at once, rank
    = its position there; ``args(rank, world, port)`` gives its arguments (``port``: one
    free port for the ranks' rendezvous). Returns each one's stdout, stripped, with the
    exit code and the end of stderr after it when it failed."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, client, *args(r, len(nodes), port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=None if env is None else {**os.environ, **env},
        )
        for r in range(len(nodes))
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        outs.append(out.strip() + (f" (rc {p.returncode}) {err[-1500:]}" if p.returncode else ""))
    return outs


def tree_hashes(root: Path) -> dict[str, str]:
    """Every file under ``root``: relative path -> sha256 of its bytes."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def flip_byte(path: str | os.PathLike[str], offset: int = 100) -> None:
    """Corrupt one byte of a file in place (what a bad DIMM or a stray write does)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
