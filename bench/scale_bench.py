"""Bucket scale benchmark (#17 items 3 and 4): N simulated nodes against the bucket
layer over a request-rate-limited fake bucket.

For each N (default 100, 1,000, 10,000) and F data objects per node part
(default 64):

* **counted**: the requests of one backup round and of one restore, before the
  round index (every node judges the whole round) and after it, from
  :mod:`tierfs.backup.budget`, and the seconds they take at least at GCS's
  base rates (1,000 writes/s, 5,000 reads/s; lists count as reads);
* **measured** for N up to ``--measure`` (default 100): the real backend
  (:class:`tierfs.backup.bucket.GcsBackend`, one client per simulated node, so
  one shared backoff gate per node as in the daemons) against
  ``tests/support/rated_bucket.RatedGcs`` at the base rates (scaled by
  ``--rate-scale``): every node uploads its sealed part (tiny files, in
  ``--parallel`` nodes at a time), node-rank 0 writes the round index; then a
  restore: node-rank 0 judges the round (the coordinator's read), every node
  fetches its part -- the old way (``inspect_round``) and the new way
  (``inspect_part`` through the index) -- and downloads it. Printed: the
  requests the fake counted (they must equal the counted ones), the 429s it
  answered, the wall time, and the time at the rate (wall x rate scale).

* **judged** for N up to ``--judge`` (default 0: off): the coordinator's read of
  one complete round of N parts (``inspect_round``: one listing, N manifest GETs,
  every manifest parsed and checked against the listing), the round's objects
  written straight into the fake (rates unlimited: this is the CPU of the read;
  building 10,000 parts by uploading them would take an hour). Printed: wall and
  CPU seconds of the read, the requests, and a profile's top entries with
  ``--profile``.

Usage: ``.venv/bin/python bench/scale_bench.py [--nodes 100,1000,10000] [--files 64]
[--measure 100] [--parallel 16] [--rate-scale 1] [--judge 10000] [--profile]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "support"))

from fake_bucket import FakeClient, fast_settings, seal
from rated_bucket import RatedGcs

from tierfs.backup import budget as B
from tierfs.backup.bucket import GcsBackend
from tierfs.store.ramstore import RamStore
from tierfs.store.shards import ShardStore

JOB = "job"
RND = "2026-12-04_07-00"
STEP = 7


def _fmt(r: B.Requests) -> str:
    return f"{r.writes:>10,} w {r.reads:>12,} r {r.lists:>10,} l"


def counted(nodes: int, files: int) -> None:
    for what, cost in (
        ("backup round, before", B.backup_round(nodes, files, index=False)),
        ("backup round, after ", B.backup_round(nodes, files)),
        ("restore, before     ", B.restore(nodes, files, index=False)),
        ("restore, after      ", B.restore(nodes, files)),
    ):
        t = cost.total
        print(f"  counted  N={nodes:>6,} {what} {_fmt(t)}  {t.seconds():>9,.1f} s at base rates")


def measured(nodes: int, files: int, parallel: int, scale: float, tmp: str) -> None:
    server = RatedGcs(B.BASE_WRITES_PER_S * scale, B.BASE_READS_PER_S * scale)

    def backend() -> GcsBackend:
        s = fast_settings(600.0, threads=2)
        return GcsBackend("bkt", client=FakeClient(server), settings=s, widen_pool=False)

    shards = []
    for rank in range(nodes):
        ram = RamStore(os.path.join(tmp, f"n{rank}"))
        data = {f"f{i:02d}": b"%d/%d" % (rank, i) for i in range(files)}
        shards.append(seal(ram, JOB, rank, STEP, data))

    def report(what: str, t0: float, expect: B.Requests) -> None:
        wall = time.monotonic() - t0
        refused = server.refused
        got = server.reset_counts()
        ok = "=" if got == expect else f"!= counted {_fmt(expect)}"
        print(
            f"  measured N={nodes:>6,} {what} {_fmt(got)} {ok}  {refused:>6,} x 429  "
            f"{wall:6.1f} s wall, {wall * scale:7.1f} s at base rates"
        )

    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(parallel) as pool:
        list(pool.map(lambda s: backend().upload_shard(s, RND, nodes=nodes), shards))
    backend().write_round_index(JOB, RND)
    report("backup round, after ", t0, B.backup_round(nodes, files).total)

    for new in (False, True):
        t0 = time.monotonic()
        coord = backend()
        coord.read_restore_version(JOB)
        coord.list_round_names(JOB)
        assert coord.inspect_round(JOB, RND, fallback=nodes).complete_step == STEP

        def fetch(rank: int, new: bool = new) -> None:
            be = backend()
            if new:
                info = be.inspect_part(JOB, RND, rank, STEP, fallback=nodes)
            else:
                info = be.inspect_round(JOB, RND, fallback=nodes)
            store = ShardStore(RamStore(os.path.join(tmp, f"restore{int(new)}-{rank}")))
            be.restore_shard(store, JOB, RND, rank, STEP, info=info)

        with cf.ThreadPoolExecutor(parallel) as pool:
            list(pool.map(fetch, range(nodes)))
        what = "restore, after      " if new else "restore, before     "
        report(what, t0, B.restore(nodes, files, index=new).total)


def _synthetic_round(server: RatedGcs, nodes: int, files: int) -> None:
    """Write a complete round of ``nodes`` parts of ``files`` tiny data objects each into
    ``server`` directly: what :meth:`GcsBackend.upload_shard` writes (data objects, the
    ``.meta`` pointer, the ``.tierfs.json`` manifest), without the requests."""
    import hashlib

    import google_crc32c

    from tierfs.backup.layout import NodeBackup
    from tierfs.store.manifest import FileEntry, Manifest

    prefix = f"{JOB}/{RND}/"
    for rank in range(nodes):
        data_name = "D" + hashlib.sha256(b"%d" % rank).hexdigest()
        entries = [FileEntry(str(STEP), "dir", mode=0o755)]
        objects = {}
        for i in range(files):
            body = b"%d/%d" % (rank, i)
            crc = google_crc32c.value(body)
            path = f"{STEP}/f{i:02d}"
            entries.append(FileEntry(path, "file", len(body), 0o644, crc))
            objects[path] = f"{data_name}.data/f{i:02d}"
            server._store("bkt", prefix + objects[path], body, crc, "application/octet-stream")
        m = Manifest(
            JOB,
            rank,
            STEP,
            str(STEP),
            "generic",
            tuple(entries),
            created=1.0,
            nodes=nodes,
            chunk_size=4 << 20,
        )
        nb = NodeBackup(m, RND, nodes, rank, None, {0: data_name}, objects, created=1.0)
        meta = data_name.encode()
        server._store(
            "bkt",
            f"{prefix}{JOB}-s{STEP}-n{rank}-w0.meta",
            meta,
            google_crc32c.value(meta),
            "text/plain",
        )
        doc = nb.to_json()
        server._store(
            "bkt",
            f"{prefix}{JOB}-s{STEP}-n{rank}.tierfs.json",
            doc,
            google_crc32c.value(doc),
            "application/json",
        )


def judged(nodes: int, files: int, profile: bool) -> None:
    server = RatedGcs(1e12, 1e12)
    t0 = time.monotonic()
    _synthetic_round(server, nodes, files)
    built = time.monotonic() - t0
    be = GcsBackend(
        "bkt",
        client=FakeClient(server),
        settings=fast_settings(600.0, threads=2),
        widen_pool=False,
    )
    server.reset_counts()
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    w0, c0 = time.monotonic(), time.process_time()
    info = be.inspect_round(JOB, RND, fallback=nodes)
    wall, cpu = time.monotonic() - w0, time.process_time() - c0
    if prof is not None:
        prof.disable()
    assert info.complete_step == STEP, info
    got = server.reset_counts()
    print(
        f"  judged   N={nodes:>6,} x {files} files: inspect_round {wall:6.2f} s wall, "
        f"{cpu:6.2f} s CPU (this process, the fake bucket's handling included); "
        f"{_fmt(got)}; round built in {built:.1f} s"
    )
    if prof is not None:
        import pstats

        pstats.Stats(prof).sort_stats("tottime").print_stats(12)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="100,1000,10000")
    ap.add_argument("--files", type=int, default=64)
    ap.add_argument("--measure", type=int, default=100, help="measure N up to this")
    ap.add_argument("--parallel", type=int, default=16, help="simulated nodes at once")
    ap.add_argument("--rate-scale", type=float, default=1.0)
    ap.add_argument("--judge", type=int, default=0, help="judge a round of N parts, N up to this")
    ap.add_argument("--profile", action="store_true", help="profile the judged read")
    args = ap.parse_args()
    for n in (int(x) for x in args.nodes.split(",")):
        counted(n, args.files)
        if n <= args.measure:
            with tempfile.TemporaryDirectory() as tmp:
                measured(n, args.files, args.parallel, args.rate_scale, tmp)
        if n <= args.judge:
            judged(n, args.files, args.profile)


if __name__ == "__main__":
    main()
