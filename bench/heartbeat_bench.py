"""Heartbeat round benchmark (#17 item 2): direct Syncs against group leaders' batches.

The coordinator (this tree's :class:`tierfs.cluster.servicer.CoordinatorServicer`
on the node daemon's ``grpc.aio`` server) runs in a process of its own, as in
``bench/coord_bench.py`` (its CPU time, from /proc, is the coordinator's).
N simulated nodes join (compact, two holdings each); then one heartbeat
round is measured both ways, alternating (ABAB), ``--repeat`` times each:

* ``direct``: every node one ``Sync`` (N calls at once), as jobs of at most
  :data:`tierfs.replication.groups.GROUP_SIZE` nodes still do;
* ``batched``: what the group leaders send (ARCHITECTURE.md "Heartbeat
  groups"): N/G ``SyncBatch`` calls of G members' SyncRequests each. The
  leaders' own relay work is not the coordinator's and is left out (the
  requests are built before the clock starts; the members' Relay calls go
  to their leaders, not here).

Printed per N and configuration: the coordinator's CPU seconds per round
(median, and every run), wall time, calls, and the 1-minute load average
before and after (the machine is shared). Every reply is checked (``known``,
the member's own peers). Configurations (``--config``, comma-separated):

* ``plain``: a coordinator without a backup book (a job without ``--bucket``);
* ``book`` (default): with the backup book node-rank 0 installs for a job with
  a bucket, seeded as for an empty bucket, no round running;
* ``active``: the same with a backup round running all along (node-rank 0's
  job asks for a round every synced step).

Rounds start at most once per ``--period`` seconds (default: the heartbeat
period, :data:`tierfs.replication.heartbeat.HEARTBEAT`, 1 s), as real
heartbeats come: the coordinator's backup book is ticked by calls at most
every 0.5 s above 256 nodes, so rounds run back to back (a batched round takes
~0.25 s) would share a tick between two rounds and show less than a real round
costs (up to stop 38 the bench ran them back to back).

``--gone G`` declares the last G ranks gone for good first (a lost rack); the
other nodes carry the ``gone_tag`` of their last reply as real nodes do, so the
gone ranks are listed to each node once, not in every reply.

Usage: ``python bench/heartbeat_bench.py [--nodes 1000,10000] [--repeat 3] [--group 100]
[--config book] [--gone 0] [--period 1.0]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc.aio  # noqa: E402
from coord_bench import CHANNELS, JOB, Server, holdings, join_request  # noqa: E402

from tierfs.replication.groups import GROUP_SIZE  # noqa: E402
from tierfs.replication.heartbeat import HEARTBEAT  # noqa: E402
from tierfs.rpc import peer_pb2, peer_pb2_grpc  # noqa: E402


def sync_request(rank: int, nodes: int) -> Any:
    """The SyncRequest a node sends each period (compact: its ring neighbour, the
    coordinator and its group's leader candidates)."""
    return peer_pb2.SyncRequest(
        job=JOB,
        rank=rank,
        incarnation=f"inc{rank}",
        step=5,
        inventory=holdings(rank, nodes),
        want_peers=sorted({0, (rank + 1) % nodes} - {rank}),
        compact=True,
    )


class Nodes:
    """N simulated nodes over a few channels to the coordinator at ``address``; the
    last ``gone`` ranks are declared gone for good and send nothing."""

    def __init__(self, address: str, nodes: int, group: int, gone: int = 0) -> None:
        self.nodes = nodes
        self.group = group
        self.gone = gone
        self.ordered = 0
        #: more JoinRequest fields of some ranks (rank -> field -> value)
        self.join_extra: dict[int, dict[str, Any]] = {}
        self.channels = [grpc.aio.insecure_channel(address) for _ in range(CHANNELS)]
        self.stubs = [peer_pb2_grpc.CoordinatorStub(c) for c in self.channels]
        self.requests = [sync_request(r, nodes) for r in range(nodes - gone)]
        self.batches = [
            peer_pb2.SyncBatchRequest(members=self.requests[g : g + group], leader=g)
            for g in range(0, nodes - gone, group)
        ]

    def stub(self, i: int) -> Any:
        return self.stubs[i % CHANNELS]

    async def join(self) -> None:
        sem = asyncio.Semaphore(200)

        async def one(r: int) -> None:
            request = join_request(r, self.nodes, True, "")
            for name, value in self.join_extra.get(r, {}).items():
                setattr(request, name, value)
            async with sem:
                await self.stub(r).Join(request, timeout=300)

        await asyncio.gather(*(one(r) for r in range(self.nodes)))
        if self.gone:
            await self.stub(0).Gone(
                peer_pb2.GoneRequest(
                    job=JOB, ranks=range(self.nodes - self.gone, self.nodes), reason="bench"
                ),
                timeout=300,
            )

    async def direct(self) -> int:
        # at most 1,000 calls in flight (10,000 at once get CANCELLED on loopback)
        sem = asyncio.Semaphore(1000)

        async def one(r: int, q: Any) -> Any:
            async with sem:
                return await self.stub(r).Sync(q, timeout=300)

        replies = await asyncio.gather(*(one(r, q) for r, q in enumerate(self.requests)))
        self._check(replies, self.requests)
        return len(replies)

    async def batched(self) -> int:
        out = await asyncio.gather(
            *(self.stub(i).SyncBatch(b, timeout=300) for i, b in enumerate(self.batches))
        )
        # (a batch holds copies of the requests: the ones it sent carry the tags)
        self._check(
            [r for b in out for r in b.replies], [q for b in self.batches for q in b.members]
        )
        return len(out)

    def _check(self, replies: list[Any], sent: list[Any]) -> None:
        assert len(replies) == self.nodes - self.gone
        #: replies ordering an upload into a running backup round (``active``)
        self.ordered = sum(1 for reply in replies if reply.HasField("backup_order"))
        for r, reply in enumerate(replies):
            assert reply.known, r
            want = sorted({0, (r + 1) % self.nodes} - {r})
            assert sorted(p.rank for p in reply.peers) == want, r
            assert reply.gone_same or len(reply.gone) == self.gone, r
            sent[r].gone_tag = reply.gone_tag  # as the node's AddressBook does

    async def close(self) -> None:
        for c in self.channels:
            await c.close()


async def measure(
    nodes: int,
    group: int,
    repeat: int,
    config: str = "book",
    gone: int = 0,
    period: float = HEARTBEAT,
) -> dict[str, Any]:
    server = Server("new", "main", book=config != "plain")
    sim = Nodes(server.address, nodes, group, gone)
    if config == "active":
        # node-rank 0's job setting: a backup round for every synced step
        sim.join_extra[0] = {"backup_interval_steps": 1}
    try:
        t0 = time.monotonic()
        await sim.join()
        joined = time.monotonic() - t0
        await sim.direct()  # warm-up: channels, code paths
        await sim.batched()
        runs: dict[str, list[dict[str, float]]] = {"direct": [], "batched": []}
        load = [os.getloadavg()[0]]
        started = 0.0
        for _ in range(repeat):
            for kind in ("direct", "batched"):
                # a round at most once per heartbeat period, as real heartbeats come
                await asyncio.sleep(max(0.0, started + period - time.monotonic()))
                started = time.monotonic()
                cpu0, t = server.cpu(), time.monotonic()
                calls = await (sim.direct() if kind == "direct" else sim.batched())
                runs[kind].append(
                    {"cpu_s": server.cpu() - cpu0, "wall_s": time.monotonic() - t, "calls": calls}
                )
        load.append(os.getloadavg()[0])
        ordered = sim.ordered
    finally:
        await sim.close()
        server.close()
    return {
        "nodes": nodes,
        "group": group,
        "config": config,
        "gone": gone,
        "backup_orders": ordered,
        "join_s": joined,
        "load1": load,
        **{
            kind: {
                "cpu_s": statistics.median(x["cpu_s"] for x in rs),
                "wall_s": statistics.median(x["wall_s"] for x in rs),
                "calls": rs[0]["calls"],
                "cpu_runs": [round(x["cpu_s"], 3) for x in rs],
            }
            for kind, rs in runs.items()
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nodes", default="1000,10000")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--group", type=int, default=GROUP_SIZE, help="members per batch")
    ap.add_argument("--config", default="book", help="plain, book, active (comma-separated)")
    ap.add_argument("--gone", type=int, default=0, help="ranks declared gone for good")
    ap.add_argument(
        "--period", type=float, default=HEARTBEAT, help="seconds from a round's start to the next"
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results = []
    for n in [int(x) for x in args.nodes.split(",") if x]:
        for config in args.config.split(","):
            r = asyncio.run(measure(n, args.group, args.repeat, config, args.gone, args.period))
            results.append(r)
            if not args.json:
                report(r)
    if args.json:
        print(json.dumps(results, indent=1))


def report(r: dict[str, Any]) -> None:
    d, b, n = r["direct"], r["batched"], r["nodes"]
    print(
        f"N={n:>6} G={r['group']} {r['config']} gone={r['gone']}: heartbeat round "
        "coordinator CPU "
        f"direct {d['cpu_s']:.3f} s ({d['calls']} Sync calls; runs {d['cpu_runs']}), "
        f"batched {b['cpu_s']:.3f} s ({b['calls']} SyncBatch calls; runs {b['cpu_runs']}); "
        f"wall direct {d['wall_s']:.2f} s, batched {b['wall_s']:.2f} s; "
        f"backup orders {r['backup_orders']}; "
        f"load1 {r['load1'][0]:.1f}->{r['load1'][1]:.1f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
