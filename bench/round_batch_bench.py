"""The batched restore round at scale (issue #17; ARCHITECTURE.md "Batched restore round").

The coordinator (this tree's servicer on the daemon's ``grpc.aio`` server)
runs in a child process (its CPU and peak RSS, ``VmHWM``, from /proc). Two
ways of driving one restore round of N nodes, alternated (ABAB), each the
median of ``--repeat``:

* ``direct``: N simulated nodes (grpc.aio tasks in this process over a few
  channels), each Join, Decide (immediate, then long polls), Barrier ready,
  Barrier done, as ``tierfs.node.agreement`` calls them in a job of at most
  G nodes (``bench/coord_bench.py``'s client);
* ``batched``: the Joins are direct (a member knows its leader only from its
  Join reply), then N/G simulated *leaders*, each carrying its G members'
  requests in one ``DecideBatch`` long poll, one ``BarrierBatch`` "ready"
  and one "done" (the coordinator's side exactly as with real leaders; the
  members' calls to their leaders are NOT simulated here: 10,000 member
  clients in one Python process would measure the simulator).

Measured from the moment the last Join was answered: every plan (every
member has its DECIDED reply), the ready barrier passed for every member,
the done barrier; the coordinator's CPU for the whole round (Joins included)
and up to the last Join (``join_cpu_s``: the long polls waiting meanwhile
cost nothing, so this is the Joins), and its peak RSS.

``--leader G``: the other half, separately: one real leader
(:class:`tierfs.replication.relay.SyncRelay` on an ``AioServer`` in a child
process) and G real member clients calling ``RelayDecide``/``RelayBarrier``
for a job of G+1 nodes (rank G joins last, so the members long-poll): the
leader's CPU for the round and the members' time from the last join to
their plans and barriers, against the same G members calling directly.

Usage: ``python bench/round_batch_bench.py [--nodes 1000,10000] [--group 100] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc.aio  # noqa: E402
from coord_bench import CHANNELS, JOB, Server, join_request, retry  # noqa: E402

from tierfs.rpc import peer_pb2, peer_pb2_grpc  # noqa: E402

POLL_MS = 25_000
#: Joins in flight at once (the simulator's; the round is measured after the last)
JOINS = 500
pb_d, pb_b = peer_pb2.DecideReply, peer_pb2.BarrierReply


def peak_rss(pid: int) -> int:
    """The process's peak resident set (bytes)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def serve_relay() -> None:
    """Child process: a group leader's SyncRelay; print the port, serve until stdin closes."""
    from tierfs.replication.relay import SyncRelay
    from tierfs.rpc import wire
    from tierfs.rpc.aio_server import AioServer

    relay = SyncRelay(None, rank=lambda: 0)
    server = AioServer(relay.attach, options=wire.SERVER_OPTIONS)
    print(f"PORT {server.start('127.0.0.1:0')}", flush=True)
    sys.stdin.read()
    server.stop(0)


class Relay(Server):
    """A leader in a child process."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve-relay"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        self.address = f"127.0.0.1:{int(line.split()[1])}"


def _barrier(rank: int, rid: str, d: Any, phase: str, wait_ms: int) -> Any:
    return peer_pb2.BarrierRequest(
        job=JOB,
        rank=rank,
        restore_id=rid,
        round=d.round,
        version=d.version,
        phase=phase,
        ok=True,
        wait_ms=wait_ms,
    )


class Sim:
    """Clients of one coordinator (a few channels)."""

    def __init__(self, address: str, channels: int = CHANNELS) -> None:
        self.channels = [
            grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(channels)
        ]
        self.stubs = [peer_pb2_grpc.CoordinatorStub(ch) for ch in self.channels]

    def stub(self, i: int) -> Any:
        return self.stubs[i % len(self.stubs)]

    async def close(self) -> None:
        for ch in self.channels:
            await ch.close()

    async def join(self, ranks: range, nodes: int) -> None:
        """Every rank's Join (at most :data:`JOINS` at once; a failed one is retried
        after 0.5 s, as a node does)."""
        gate = asyncio.Semaphore(JOINS)
        stop_at = time.monotonic() + 600

        async def one(r: int) -> None:
            async with gate:
                await retry(
                    lambda: self.stub(r).Join(join_request(r, nodes, True, f"r{r}"), timeout=60),
                    stop_at,
                )

        await asyncio.gather(*(one(r) for r in ranks))


async def _direct_node(sim: Sim, r: int, marks: dict[str, list[float]], poll: bool) -> None:
    stub = sim.stub(r)
    wait = 0
    while True:
        d = await retry(
            lambda wait=wait: stub.Decide(
                peer_pb2.DecideRequest(job=JOB, rank=r, restore_id=f"r{r}", wait_ms=wait),
                timeout=wait / 1000 + 60,
            ),
            time.monotonic() + 300,
        )
        if d.state == pb_d.DECIDED:
            break
        wait = POLL_MS
    marks["plan"].append(time.monotonic())
    for phase in ("ready", "done"):
        wait = 0
        while True:
            b = await retry(
                lambda wait=wait, phase=phase: stub.Barrier(
                    _barrier(r, f"r{r}", d, phase, wait), timeout=wait / 1000 + 60
                ),
                time.monotonic() + 300,
            )
            if b.state == pb_b.PASSED:
                break
            wait = POLL_MS
        marks[phase].append(time.monotonic())


async def _leader(sim: Sim, g: int, ranks: list[int], marks: dict[str, list[float]]) -> None:
    """One simulated leader: its members' Decide, ready, done in one batch each
    (and a repeat while any member waits)."""
    stub = sim.stub(g)
    while True:
        reply = await stub.DecideBatch(
            peer_pb2.DecideBatchRequest(
                members=[
                    peer_pb2.DecideRequest(job=JOB, rank=r, restore_id=f"r{r}") for r in ranks
                ],
                wait_ms=POLL_MS,
                leader=ranks[0],
            ),
            timeout=POLL_MS / 1000 + 60,
        )
        if all(d.state == pb_d.DECIDED for d in reply.replies):
            break
    now = time.monotonic()
    marks["plan"].extend([now] * len(ranks))
    decided = list(reply.replies)
    for phase in ("ready", "done"):
        while True:
            b = await stub.BarrierBatch(
                peer_pb2.BarrierBatchRequest(
                    members=[
                        _barrier(r, f"r{r}", d, phase, 0)
                        for r, d in zip(ranks, decided, strict=True)
                    ],
                    wait_ms=POLL_MS,
                    leader=ranks[0],
                ),
                timeout=POLL_MS / 1000 + 60,
            )
            if all(x.state == pb_b.PASSED for x in b.replies):
                break
        now = time.monotonic()
        marks[phase].extend([now] * len(ranks))


async def one_round(mode: str, nodes: int, group: int) -> dict[str, Any]:
    """One restore round of ``nodes`` nodes against a fresh coordinator."""
    server = Server("new", "main")
    sim = Sim(server.address, max(CHANNELS, nodes // 250))
    marks: dict[str, list[float]] = {"plan": [], "ready": [], "done": []}
    try:
        cpu0 = server.cpu()
        await sim.join(range(nodes - 1), nodes)
        if mode == "direct":
            tasks = [
                asyncio.ensure_future(_direct_node(sim, r, marks, True)) for r in range(nodes - 1)
            ]
        else:
            groups = [list(range(s, min(s + group, nodes - 1))) for s in range(0, nodes - 1, group)]
            tasks = [
                asyncio.ensure_future(_leader(sim, i, ranks, marks))
                for i, ranks in enumerate(groups)
                if ranks
            ]
        await asyncio.sleep(1.0 + nodes / 5000)  # every call is in its long poll
        await sim.join(range(nodes - 1, nodes), nodes)
        last_join = time.monotonic()
        join_cpu = server.cpu() - cpu0
        # the last node: its own calls (directly; in the batched design a batch of one)
        tasks.append(asyncio.ensure_future(_direct_node(sim, nodes - 1, marks, False)))
        await asyncio.gather(*tasks)
        out = {
            "mode": mode,
            "nodes": nodes,
            "plan_s": max(marks["plan"]) - last_join,
            "ready_s": max(marks["ready"]) - last_join,
            "done_s": max(marks["done"]) - last_join,
            "cpu_s": server.cpu() - cpu0,
            "join_cpu_s": join_cpu,
            "peak_rss_mib": peak_rss(server.proc.pid) / 2**20,
        }
        assert len(marks["done"]) == nodes, len(marks["done"])
        return out
    finally:
        await sim.close()
        server.close()


async def leader_round(group: int, relayed: bool) -> dict[str, Any]:
    """G real members through one real leader (or directly) in a job of G+1 nodes."""
    server = Server("new", "main")
    relay = Relay() if relayed else None
    sim = Sim(server.address)
    nodes = group + 1
    coord = server.address
    marks: dict[str, list[float]] = {"plan": [], "ready": [], "done": []}
    ch = grpc.aio.insecure_channel(relay.address) if relay else None
    stub = peer_pb2_grpc.SyncRelayStub(ch) if ch else None
    try:
        await sim.join(range(nodes - 1), nodes)
        cpu0 = relay.cpu() if relay else 0.0

        async def member(r: int) -> None:
            wait = 0
            while True:
                req = peer_pb2.DecideRequest(job=JOB, rank=r, restore_id=f"r{r}", wait_ms=wait)
                if stub is not None:
                    d = await stub.RelayDecide(
                        peer_pb2.RelayDecideRequest(coordinator=coord, decide=req),
                        timeout=wait / 1000 + 3,
                    )
                else:
                    d = await sim.stub(r).Decide(req, timeout=wait / 1000 + 10)
                if d.state == pb_d.DECIDED:
                    break
                wait = POLL_MS
            marks["plan"].append(time.monotonic())
            for phase in ("ready", "done"):
                wait = 0
                while True:
                    breq = _barrier(r, f"r{r}", d, phase, wait)
                    if stub is not None:
                        b = await stub.RelayBarrier(
                            peer_pb2.RelayBarrierRequest(coordinator=coord, barrier=breq),
                            timeout=wait / 1000 + 3,
                        )
                    else:
                        b = await sim.stub(r).Barrier(breq, timeout=wait / 1000 + 10)
                    if b.state == pb_b.PASSED:
                        break
                    wait = POLL_MS
                marks[phase].append(time.monotonic())

        tasks = [asyncio.ensure_future(member(r)) for r in range(group)]
        await asyncio.sleep(1.0)
        await sim.join(range(group, nodes), nodes)
        last_join = time.monotonic()
        tasks.append(asyncio.ensure_future(_direct_node(sim, group, {k: [] for k in marks}, False)))
        await asyncio.gather(*tasks)
        return {
            "mode": "leader" if relayed else "direct",
            "members": group,
            "plan_s": max(marks["plan"]) - last_join,
            "ready_s": max(marks["ready"]) - last_join,
            "done_s": max(marks["done"]) - last_join,
            "leader_cpu_s": (relay.cpu() - cpu0) if relay else 0.0,
        }
    finally:
        await sim.close()
        if ch is not None:
            await ch.close()
        if relay is not None:
            relay.close()
        server.close()


def median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(runs[0])
    for k, v in runs[0].items():
        if isinstance(v, float):
            out[k] = statistics.median(r[k] for r in runs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--serve-relay", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--nodes", default="1000,10000")
    ap.add_argument("--group", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--modes", default="direct,batched")
    ap.add_argument("--leader", action="store_true", help="also measure one real leader")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.serve_relay:
        serve_relay()
        return
    results = []
    print(f"load average: {os.getloadavg()}", flush=True)
    for n in (int(x) for x in a.nodes.split(",")):
        runs: dict[str, list[dict[str, Any]]] = {}
        for _ in range(a.repeat):  # ABAB
            for mode in a.modes.split(","):
                r = asyncio.run(one_round(mode, n, a.group))
                print(json.dumps(r), flush=True)
                runs.setdefault(mode, []).append(r)
        for mode, rs in runs.items():
            m = median(rs)
            results.append(m)
            print(
                f"N={n:>6} {mode:>8}: plans {m['plan_s']:.2f} s, ready {m['ready_s']:.2f} s, "
                f"done {m['done_s']:.2f} s after the last join; coordinator CPU "
                f"{m['cpu_s']:.2f} s ({m.get('join_cpu_s', 0):.2f} s to the last join), "
                f"peak RSS {m['peak_rss_mib']:.0f} MiB",
                flush=True,
            )
    if a.leader:
        lr: dict[str, list[dict[str, Any]]] = {}
        for _ in range(a.repeat):
            for relayed in (False, True):
                r = asyncio.run(leader_round(a.group, relayed))
                print(json.dumps(r), flush=True)
                lr.setdefault(r["mode"], []).append(r)
        for mode, rs in lr.items():
            m = median(rs)
            results.append(m)
            print(
                f"G={a.group} members {mode:>7}: plans {m['plan_s']:.3f} s, ready "
                f"{m['ready_s']:.3f} s, done {m['done_s']:.3f} s after the last join; "
                f"leader CPU {m['leader_cpu_s']:.3f} s",
                flush=True,
            )
    print(f"load average: {os.getloadavg()}", flush=True)
    if a.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
