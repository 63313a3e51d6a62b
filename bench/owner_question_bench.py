"""How many "which part do you hold?" questions one node answers per second.

For 60 s after a part is sealed, an open of one of its files on another node
asks the part's node which part it holds (``RemoteView._owner_shown``, docs/
SEMANTICS.md rule (1) of a step saved again). In a DCP load every rank opens
rank 0's ``.metadata``, so node-rank 0 of an N-node job gets about N such
questions at once when a load follows a save within that minute (opens of one
rank's files on one node share them: ``tierfs.core.fresh``). This measures one
holder's answer rate on loopback and compares the two ways to ask:

* ``digest``: today's question, a manifest-only ``PullShard`` with
  ``trim_manifest`` (no file entries, the part's digest);
* ``manifest``: the whole manifest, as the question was asked before.

The holder serves a real :class:`tierfs.replication.service.PeerServicer` in
its own process; the askers are threads of this process, each with its own
client. Sides interleaved (ABAB), median of ``--repeat``.

Usage: ``python bench/owner_question_bench.py [--files 2,1000] [--questions 2000]
[--askers 16] [--repeat 3] [--json FILE]``
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]

from benchlib import write_json  # noqa: E402

JOB, TOKEN, STEP, RANK = "bench", "secret", 7, 3


def serve(files: int, conn: Any) -> None:
    """The holder process: one sealed part of ``files`` files, served until killed."""
    import threading

    from gcs_fixtures import make_shard

    from tierfs.replication.service import PeerServicer, peer_handlers
    from tierfs.rpc import wire as peer_wire
    from tierfs.rpc.aio_server import AioServer, with_sync_context
    from tierfs.rpc.wire import WireStats
    from tierfs.store.shards import Shard, ShardKey

    tmp = Path(tempfile.mkdtemp(prefix="tierfs-oq-"))
    shard = make_shard(
        tmp, JOB, RANK, STEP, {f"{STEP}/f{i:05d}.bin": b"x" * 100 for i in range(files)}
    )

    class Host:
        incarnation = "bench"
        stats = WireStats()

        def find(self, key: ShardKey) -> Shard | None:
            return shard if key == shard.key else None

        def pin(self, key: ShardKey, delta: int) -> None:
            pass

        def known_manifest(self, key: ShardKey) -> None:
            return None

        def resaving(self, key: ShardKey) -> bool:
            return False

    handlers = with_sync_context(peer_handlers(PeerServicer(Host())))  # type: ignore[arg-type]
    server = AioServer(
        lambda srv, loop: srv.add_generic_rpc_handlers((handlers,)),
        interceptors=[peer_wire.AioTokenInterceptor(TOKEN)],
        options=peer_wire.SERVER_OPTIONS,
    )
    port = server.start("127.0.0.1:0")
    conn.send((port, shard.manifest.digest))
    threading.Event().wait()


def cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(at: str, digest: str, mode: str, n: int, clients: list[Any], pid: int) -> dict:
    """``n`` questions by ``len(clients)`` askers at once: answers/s, holder CPU each."""
    from tierfs.store.shards import ShardKey

    key = ShardKey(JOB, RANK, STEP)

    def one(i: int) -> str:
        c = clients[i % len(clients)]
        return c.part_digest(at, key) if mode == "digest" else c.manifest(at, key).digest

    c0, t0 = cpu(pid), time.perf_counter()
    with cf.ThreadPoolExecutor(len(clients)) as ex:
        got = list(ex.map(one, range(n)))
    dt, used = time.perf_counter() - t0, cpu(pid) - c0
    assert all(g == digest for g in got), "a wrong digest"
    return {"per_s": n / dt, "holder_cpu_ms": used / n * 1000}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", default="2,1000", help="file counts of the part, comma-separated")
    ap.add_argument("--questions", type=int, default=2000)
    ap.add_argument("--askers", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()

    from tierfs.replication.client import PeerClient
    from tierfs.rpc.wire import WireStats

    results: dict[str, Any] = {}
    ctx = mp.get_context("spawn")
    for files in [int(f) for f in args.files.split(",")]:
        parent, child = ctx.Pipe()
        holder = ctx.Process(target=serve, args=(files, child), daemon=True)
        holder.start()
        port, digest = parent.recv()
        at = f"127.0.0.1:{port}"
        clients = [PeerClient(TOKEN, WireStats()) for _ in range(args.askers)]
        runs: dict[str, list[dict]] = {"digest": [], "manifest": []}
        measure(at, digest, "digest", 200, clients, holder.pid)  # warm the channels
        for r in range(args.repeat):
            order = ("digest", "manifest") if r % 2 == 0 else ("manifest", "digest")
            for mode in order:
                runs[mode].append(measure(at, digest, mode, args.questions, clients, holder.pid))
        for c in clients:
            c.close()
        holder.kill()
        row = {}
        for mode, rs in runs.items():
            row[mode] = {
                "per_s": statistics.median(x["per_s"] for x in rs),
                "per_s_all": [round(x["per_s"]) for x in rs],
                "holder_cpu_ms": statistics.median(x["holder_cpu_ms"] for x in rs),
            }
        row["ratio"] = row["digest"]["per_s"] / row["manifest"]["per_s"]
        results[str(files)] = row
        print(
            f"part of {files} files, {args.askers} askers: digest "
            f"{row['digest']['per_s']:.0f}/s {row['digest']['per_s_all']} "
            f"(holder CPU {row['digest']['holder_cpu_ms']:.2f} ms each), manifest "
            f"{row['manifest']['per_s']:.0f}/s {row['manifest']['per_s_all']} "
            f"({row['manifest']['holder_cpu_ms']:.2f} ms): {row['ratio']:.2f}x",
            flush=True,
        )
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
