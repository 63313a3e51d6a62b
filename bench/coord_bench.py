"""Coordinator scale benchmark (#17 item 1): N simulated nodes against the coordinator.

Two coordinators in the same run:

* ``new``: this tree's :class:`tierfs.cluster.servicer.CoordinatorServicer` on
  the ``grpc.aio`` server the node daemon runs (:class:`tierfs.rpc.aio_server.AioServer`),
  with compact requests (``want_peers``) as the node daemon sends them;
* ``old``: the baseline, ``main``'s ``tierfs/cluster/coordinator.py`` (read
  with ``git show``, ``--baseline-ref``) on the thread-pool server of 32
  threads the node daemon ran before, with the old requests (every reply
  lists every member).

Each server runs in a process of its own (its CPU time, from /proc, is the
coordinator's); the nodes are grpc.aio clients in this process (one task
per node, a few channels), calling as tierfs.node.agreement does (Join,
Decide long polls of 2 s, Barrier ready, Barrier done; a failed call is
retried after 0.5 s). Measured per N:

* restore round: wall time to the ready barrier (every node passed it) and
  to the end, and the coordinator's CPU for the round;
* idle wait: N-1 nodes joined and long-polling Decide for the missing last
  node, ``--idle`` seconds: coordinator CPU per second;
* heartbeat round: every node one Sync (two holdings each): coordinator CPU;
* in-process (no gRPC, ``--inproc``, default 10,000 nodes): the pure
  Coordinator's CPU for a whole restore round and one heartbeat round.

Runs alternate old/new (ABAB) and each figure is the median of ``--repeat``.
A run that does not pass its barrier within ``--limit`` seconds is reported
as such (the old server at 1,000 nodes: #17 saw 400-600 s).

Usage: ``python bench/coord_bench.py [--nodes 100,1000] [--repeat 3] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # no GOAWAY lines when a server stops

import grpc  # noqa: E402
import grpc.aio  # noqa: E402

from tierfs.rpc import peer_pb2, peer_pb2_grpc  # noqa: E402

JOB = "bench"
#: long polls as each side's node sends them: 2 s before #17, 25 s after (client.POLL_MS)
POLL_MS = {"old": 2000, "new": 25_000}
CHANNELS = 8
#: Sync calls of the old in-process heartbeat round that are timed (then scaled)
OLD_HEARTBEAT_CALLS = 1000


# ---------------------------------------------------------------------- servers


def load_baseline(ref: str) -> Any:
    """``ref``'s coordinator module (the one-file coordinator before #17), or None.
    ``ref``: a git ref of this repository, or the path of that file."""
    if ref.endswith(".py") and Path(ref).is_file():
        src = Path(ref).read_text()
    else:
        try:
            src = subprocess.run(
                ["git", "-C", str(ROOT), "show", f"{ref}:tierfs/cluster/coordinator.py"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        except subprocess.CalledProcessError:
            return None
    if "class CoordinatorServicer" not in src:
        return None  # ref already has the new coordinator
    path = Path(tempfile.mkdtemp(prefix="coord-baseline-")) / "coord_baseline.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("coord_baseline", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["coord_baseline"] = mod
    spec.loader.exec_module(mod)
    return mod


def serve(kind: str, ref: str, book: bool = False) -> None:
    """The server process: print the port, serve until stdin closes. With ``book`` the
    coordinator has the backup book node-rank 0 installs for a job with a bucket
    (``tierfs/daemon.py``), seeded as an empty bucket once the job has joined."""
    if kind == "new":
        from tierfs.cluster.backup_schedule import RoundBook
        from tierfs.cluster.coordinator import Coordinator
        from tierfs.cluster.servicer import CoordinatorServicer
        from tierfs.rpc import wire
        from tierfs.rpc.aio_server import AioServer

        servicer = CoordinatorServicer(
            Coordinator(live_seconds=600.0, backups=RoundBook() if book else None)
        )
        if book:
            threading.Thread(target=_seed_book, args=(servicer,), daemon=True).start()
        server = AioServer(servicer.attach, options=wire.SERVER_OPTIONS)
        port = server.start("127.0.0.1:0")
        stop = server.stop
    else:
        from concurrent import futures

        from tierfs.rpc import wire

        old = load_baseline(ref)
        if old is None:
            raise SystemExit(f"no baseline coordinator at {ref}")
        gs = grpc.server(
            futures.ThreadPoolExecutor(max_workers=32), options=list(wire.SERVER_OPTIONS)
        )
        peer_pb2_grpc.add_CoordinatorServicer_to_server(
            old.CoordinatorServicer(old.Coordinator(live_seconds=600.0)), gs
        )
        port = gs.add_insecure_port("127.0.0.1:0")
        gs.start()

        def stop(grace: float | None = 0) -> None:
            gs.stop(grace)

    print(f"PORT {port}", flush=True)
    sys.stdin.read()
    stop(0)


def _seed_book(servicer: Any) -> None:
    """Seed the backup book as the GCS tier does for an empty bucket, as soon as the
    job is known (a thread of the server process)."""
    while not servicer.locked(lambda c: c.backups.job == JOB):
        time.sleep(0.01)
    servicer.locked(lambda c: c.backups.seed(JOB, None, None))


class Server:
    """A coordinator in a child process (``book``: with a backup book, :func:`serve`)."""

    def __init__(self, kind: str, ref: str, book: bool = False) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", kind, "--baseline-ref", ref]
            + (["--book"] if book else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            raise RuntimeError(f"{kind} server did not start: {line!r}")
        self.address = f"127.0.0.1:{int(line.split()[1])}"

    def cpu(self) -> float:
        """The server's CPU seconds (user + system) so far."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/task"))

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------------- nodes


def holdings(rank: int, nodes: int) -> list[Any]:
    """The node's own shard of step 5 and the replica of its ring neighbour's."""
    peer = (rank - 1) % nodes
    return [
        peer_pb2.HeldShard(rank=rank, step=5, verified=True, digest=f"d{rank}", bytes=1 << 30),
        peer_pb2.HeldShard(rank=peer, step=5, verified=True, digest=f"d{peer}", bytes=1 << 30),
    ]


def join_request(rank: int, nodes: int, compact: bool, restore_id: str) -> Any:
    extra: dict[str, Any] = {}
    if compact:
        extra = {"want_peers": sorted({0, (rank + 1) % nodes} - {rank}), "compact": True}
    return peer_pb2.JoinRequest(
        job=JOB,
        nodes=nodes,
        rank=rank,
        address=f"10.{rank // 65536}.{rank // 256 % 256}.{rank % 256}:7000",
        incarnation=f"inc{rank}",
        restore_id=restore_id,
        mode="protocol",
        inventory=holdings(rank, nodes),
        **extra,
    )


async def retry(call: Any, stop_at: float) -> Any:
    """``call()`` until it answers (a failed call is retried after 0.5 s, as a node does)."""
    while True:
        try:
            return await call()
        except grpc.aio.AioRpcError:
            if time.monotonic() > stop_at:
                raise
            await asyncio.sleep(0.5)


async def restore_node(
    stub: Any, rank: int, nodes: int, compact: bool, stop_at: float, poll_ms: int
) -> float:
    """One node's restore round; returns the time it passed the ready barrier."""
    rid = uuid.uuid4().hex
    await retry(lambda: stub.Join(join_request(rank, nodes, compact, rid), timeout=30), stop_at)
    while True:
        d = await retry(
            lambda: stub.Decide(
                peer_pb2.DecideRequest(job=JOB, rank=rank, restore_id=rid, wait_ms=poll_ms),
                timeout=poll_ms / 1000 + 10,
            ),
            stop_at,
        )
        if d.state == peer_pb2.DecideReply.DECIDED:
            break
        if time.monotonic() > stop_at:
            raise TimeoutError
    ready_at = 0.0
    for phase in ("ready", "done"):
        while True:
            b = await retry(
                lambda phase=phase: stub.Barrier(
                    peer_pb2.BarrierRequest(
                        job=JOB,
                        rank=rank,
                        restore_id=rid,
                        round=d.round,
                        version=d.version,
                        phase=phase,
                        ok=True,
                        wait_ms=poll_ms,
                    ),
                    timeout=poll_ms / 1000 + 10,
                ),
                stop_at,
            )
            if b.state == peer_pb2.BarrierReply.PASSED:
                break
            if b.state != peer_pb2.BarrierReply.WAITING:
                raise RuntimeError(f"node {rank}: barrier {phase} answered {b.state}")
            if time.monotonic() > stop_at:
                raise TimeoutError
        if phase == "ready":
            ready_at = time.monotonic()
    return ready_at


class Nodes:
    """N simulated nodes over a few channels to one coordinator."""

    def __init__(self, address: str, nodes: int, compact: bool, poll_ms: int) -> None:
        self.poll_ms = poll_ms
        self.channels = [
            grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(CHANNELS)
        ]
        self.stubs = [peer_pb2_grpc.CoordinatorStub(ch) for ch in self.channels]
        self.nodes = nodes
        self.compact = compact

    def stub(self, rank: int) -> Any:
        return self.stubs[rank % len(self.stubs)]

    async def close(self) -> None:
        for ch in self.channels:
            await ch.close()

    async def restore(self, limit: float) -> tuple[float | None, float | None]:
        """(seconds to the ready barrier, to the end); None: not within ``limit``."""
        start = time.monotonic()
        stop_at = start + limit
        tasks = [
            asyncio.ensure_future(
                restore_node(self.stub(r), r, self.nodes, self.compact, stop_at, self.poll_ms)
            )
            for r in range(self.nodes)
        ]
        try:
            readies = await asyncio.wait_for(asyncio.gather(*tasks), limit + 15)
        except (TimeoutError, grpc.aio.AioRpcError):
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return None, None
        return max(readies) - start, time.monotonic() - start

    async def register(self) -> None:
        await asyncio.gather(
            *(
                self.stub(r).Join(join_request(r, self.nodes, self.compact, ""), timeout=120)
                for r in range(self.nodes)
            )
        )

    async def heartbeat(self) -> None:
        def req(r: int) -> Any:
            extra: dict[str, Any] = {}
            if self.compact:
                extra = {"want_peers": sorted({0, (r + 1) % self.nodes} - {r}), "compact": True}
            return peer_pb2.SyncRequest(
                job=JOB,
                rank=r,
                incarnation=f"inc{r}",
                step=5,
                inventory=holdings(r, self.nodes),
                **extra,
            )

        await asyncio.gather(*(self.stub(r).Sync(req(r), timeout=120) for r in range(self.nodes)))

    async def idle(self, seconds: float, server: Server) -> tuple[float, int]:
        """N-1 nodes wait in Decide for the last one: (server CPU per second, threads)."""
        stop_at = time.monotonic() + seconds + 60
        rids = {r: uuid.uuid4().hex for r in range(1, self.nodes)}
        await asyncio.gather(
            *(
                retry(
                    lambda r=r: self.stub(r).Join(
                        join_request(r, self.nodes, self.compact, rids[r]), timeout=30
                    ),
                    stop_at,
                )
                for r in rids
            )
        )

        async def poll(r: int, until: float) -> None:
            while time.monotonic() < until:
                try:
                    await self.stub(r).Decide(
                        peer_pb2.DecideRequest(
                            job=JOB, rank=r, restore_id=rids[r], wait_ms=self.poll_ms
                        ),
                        timeout=self.poll_ms / 1000 + 10,
                    )
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.5)

        until = time.monotonic() + seconds + 3.0
        tasks = [asyncio.ensure_future(poll(r, until)) for r in rids]
        await asyncio.sleep(3.0)  # every node is in its long poll
        cpu0, t0 = server.cpu(), time.monotonic()
        threads = server.threads()
        await asyncio.sleep(seconds)
        cpu = (server.cpu() - cpu0) / (time.monotonic() - t0)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return cpu, threads


async def measure(
    kind: str, nodes: int, ref: str, limit: float, idle: float, poll_ms: int | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": kind, "nodes": nodes, "poll_ms": poll_ms or POLL_MS[kind]}
    compact = kind == "new"
    server = Server(kind, ref)
    try:
        sim = Nodes(server.address, nodes, compact, poll_ms or POLL_MS[kind])
        cpu0 = server.cpu()
        out["ready_s"], out["round_s"] = await sim.restore(limit)
        out["round_cpu_s"] = server.cpu() - cpu0
        await sim.close()
    finally:
        server.close()
    server = Server(kind, ref)
    try:
        sim = Nodes(server.address, nodes, compact, poll_ms or POLL_MS[kind])
        await sim.register()
        cpu0, t0 = server.cpu(), time.monotonic()
        await sim.heartbeat()
        out["heartbeat_s"] = time.monotonic() - t0
        out["heartbeat_cpu_s"] = server.cpu() - cpu0
        out["idle_cpu_per_s"], out["idle_threads"] = await sim.idle(idle, server)
        await sim.close()
    finally:
        server.close()
    return out


# ---------------------------------------------------------------------- in-process


def inproc(mod: Any, nodes: int) -> dict[str, float]:
    """The pure Coordinator of ``mod`` for one restore round and one heartbeat round
    of ``nodes`` nodes (CPU seconds, no gRPC)."""
    from tierfs.cluster.restore_choice import Holding

    c = mod.Coordinator(live_seconds=600.0)
    inv = {
        r: (Holding(r, 5, True, f"d{r}"), Holding((r - 1) % nodes, 5, True, f"d{(r - 1) % nodes}"))
        for r in range(nodes)
    }
    t0 = time.process_time()
    for r in range(nodes):
        c.join(JOB, nodes, r, f"a{r}", f"i{r}", inv[r], f"r{r}", "protocol")
    t1 = time.process_time()
    views = [c.decide(JOB, r, f"r{r}") for r in range(nodes)]
    t2 = time.process_time()
    assert all(v.step == 5 for v in views)
    for phase in ("ready", "done"):
        for r in range(nodes):
            c.barrier(JOB, r, f"r{r}", views[r].round, views[r].version, phase)
    t3 = time.process_time()
    assert c.round.finished
    old = hasattr(mod, "CoordinatorServicer")
    # the old round costs O(nodes) per call: time its first calls, scale to the round
    calls = min(nodes, OLD_HEARTBEAT_CALLS) if old else nodes
    for r in range(calls):
        if old:
            c.sync(JOB, r, f"i{r}", 5, inv[r])
            c.peers()  # every member: what each of its replies carried
        else:
            c.sync(JOB, r, f"i{r}", 5, inv[r], compact=True)
            c.peers([0, (r + 1) % nodes])  # the node's peers: what a compact reply carries
            c.live_count()
    t4 = time.process_time()
    return {
        "join_s": t1 - t0,
        "decide_s": t2 - t1,
        "barrier_s": t3 - t2,
        "round_s": t3 - t0,
        "heartbeat_s": (t4 - t3) * nodes / calls,
        "heartbeat_calls_timed": calls,
    }


# ---------------------------------------------------------------------- main


def fmt(v: Any, unit: str = "s") -> str:
    if v is None:
        return "n/a"
    return f"{v:.3f} {unit}" if isinstance(v, float) else str(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--serve", choices=["old", "new"], help=argparse.SUPPRESS)
    ap.add_argument("--baseline-ref", default="main")
    ap.add_argument("--book", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--nodes", default="100,1000")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--limit", type=float, default=60.0, help="seconds a restore round may take")
    ap.add_argument(
        "--idle", type=float, default=30.0, help="seconds of idle waiting measured (>= a poll)"
    )
    ap.add_argument(
        "--inproc", type=int, default=10_000, help="nodes of the in-process run (0: skip)"
    )
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--poll-ms", type=int, help="long poll of both sides (default: each its own)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.baseline_ref, args.book)
        return
    kinds = (
        ["new"] if args.no_baseline or load_baseline(args.baseline_ref) is None else ["old", "new"]
    )
    results: list[dict[str, Any]] = []
    for n in [int(x) for x in args.nodes.split(",") if x]:
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
        for i in range(args.repeat):
            for kind in kinds if i % 2 == 0 else kinds[::-1]:  # ABBA...
                if kind == "old" and runs["old"] and runs["old"][-1]["ready_s"] is None:
                    continue  # the baseline did not pass in time: once is enough
                r = asyncio.run(
                    measure(kind, n, args.baseline_ref, args.limit, args.idle, args.poll_ms)
                )
                runs[kind].append(r)
                print(json.dumps(r), flush=True)
        for kind, rs in runs.items():
            med: dict[str, Any] = {"kind": kind, "nodes": n, "runs": len(rs)}
            for key in ("ready_s", "round_s", "round_cpu_s", "heartbeat_cpu_s", "idle_cpu_per_s"):
                vals = [r[key] for r in rs if r.get(key) is not None]
                med[key] = statistics.median(vals) if len(vals) == len(rs) and vals else None
            med["idle_threads"] = max(r["idle_threads"] for r in rs)
            results.append(med)
            print(
                f"{kind:>3} N={n:>6}: ready barrier {fmt(med['ready_s'])} "
                f"(limit {args.limit:.0f} s), round {fmt(med['round_s'])}, coordinator CPU "
                f"{fmt(med['round_cpu_s'])}; heartbeat round CPU {fmt(med['heartbeat_cpu_s'])}; "
                f"idle wait CPU {fmt(med['idle_cpu_per_s'], 's/s')} with "
                f"{med['idle_threads']} server threads",
                flush=True,
            )
    if args.inproc:
        n = args.inproc
        from tierfs.cluster import coordinator as new

        mods = {"new": new}
        if "old" in kinds:
            mods["old"] = sys.modules["coord_baseline"]
        for kind, mod in mods.items():
            r = inproc(mod, n)
            r |= {"kind": kind, "nodes": n, "inproc": True}
            results.append(r)
            print(
                f"{kind:>3} N={n:>6} in-process: restore round CPU {r['round_s']:.3f} s "
                f"(join {r['join_s']:.3f}, decide {r['decide_s']:.3f}, barrier "
                f"{r['barrier_s']:.3f}); heartbeat round CPU "
                f"{r['heartbeat_s']:.3f} s"
                + (
                    f" (scaled from {r['heartbeat_calls_timed']} calls)"
                    if r["heartbeat_calls_timed"] < n
                    else ""
                ),
                flush=True,
            )
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
