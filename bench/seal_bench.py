"""What judging a step at seal time (issue #15) adds to the seal (issue #18's latency).

Usage: ``python bench/seal_bench.py [--repeat 5] [--json FILE]`` (no root, no mount).

A seal is :meth:`tierfs.store.shards.ShardStore.snapshot`: hard-link the step's
files into a snapshot, crc32c every byte, write the manifest -- and since #15
judge the part with the format validators (headers, DCP ``.metadata``, Orbax
metadata). This benchmark seals the same step twice per repeat, with the
judgement (``judge=True``, what the daemon does) and without (``judge=False``),
alternating which goes first (ABBA...), and prints the medians and their
ratio. Three layouts in a RAM store under /dev/shm:

* ``dcp-1gib``: DCP, ``.metadata`` plus 4 shards of 256 MiB (the judgement
  reads ``.metadata`` only; the checksums read every byte);
* ``orbax-600``: an Orbax step with 600 small files (OCDBT pieces, ``_METADATA``,
  ``_sharding``, ``commit_success.txt``), 4 KiB to 64 KiB;
* ``safetensors-64``: 64 safetensors files of 1 MiB (every header is read).

The page cache is warm for both variants (the files were just written and
stay in RAM): the seal's cost on a training host.
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
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "support")
)
from benchlib import write_json
from mtc_clients import ocdbt_manifest
from step_bytes import dcp_metadata, safetensors_bytes

from tierfs.store.ramstore import RamStore
from tierfs.store.shards import ShardKey, ShardStore

MiB = 1 << 20


def dcp_layout() -> dict[str, bytes]:
    shard = os.urandom(MiB) * 256
    refs = [(f"w{i}", f"__{i}_0.distcp", 0, len(shard)) for i in range(4)]
    files = {".metadata": dcp_metadata(refs)}
    files.update({f"__{i}_0.distcp": shard for i in range(4)})
    return files


def orbax_layout() -> dict[str, bytes]:
    meta = {"item_handlers": {"state": "PyTreeCheckpointHandler"}, "commit_timestamp_nsecs": 1}
    files = {
        "_CHECKPOINT_METADATA": json.dumps(meta).encode(),
        "commit_success.txt": b"Checkpoint commit was successful",
        "state/_METADATA": b'{"tree_metadata": {}, "use_ocdbt": true}',
        "state/_sharding": b"{}",
        "state/manifest.ocdbt": ocdbt_manifest(b"m" * 30),
        "state/ocdbt.process_0/manifest.ocdbt": ocdbt_manifest(b"p" * 30),
    }
    for i in range(594):
        size = 4096 << (i % 5)  # 4 KiB .. 64 KiB
        files[f"state/ocdbt.process_0/d/{i:04x}"] = os.urandom(size)
    return files


def safetensors_layout() -> dict[str, bytes]:
    files = {}
    for i in range(64):
        files[f"model-{i:05d}-of-00064.safetensors"] = safetensors_bytes(
            {f"layer{i}.w": ("F32", [256, 1024], os.urandom(MiB))}
        )
    return files


LAYOUTS = {"dcp-1gib": dcp_layout, "orbax-600": orbax_layout, "safetensors-64": safetensors_layout}


def seal_once(shards: ShardStore, view: str, step: int, judge: bool) -> float:
    key = ShardKey("bench", 0, step)
    t = time.perf_counter()
    shard = shards.snapshot(view, key, str(step), [str(step)], "generic", judge=judge)
    elapsed = time.perf_counter() - t
    assert (shard.manifest.verdict is not None) == judge
    if judge:
        assert shard.manifest.verdict is not None
        assert shard.manifest.verdict.state == "complete", shard.manifest.verdict
    shards.remove(shard)
    return elapsed


def run(repeat: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, make in LAYOUTS.items():
        root = Path(
            tempfile.mkdtemp(prefix=f"tierfs-seal-bench-{uuid.uuid4().hex[:6]}-", dir="/dev/shm")
        )
        try:
            ram = RamStore(str(root / "ram"))
            shards = ShardStore(ram)
            step = 1
            for rel, data in make().items():
                p = Path(ram.view) / str(step) / rel
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(data)
            seal_once(shards, ram.view, step, True)  # warm-up (imports, caches)
            times: dict[bool, list[float]] = {True: [], False: []}
            for i in range(repeat):
                order = (True, False) if i % 2 == 0 else (False, True)
                for judge in order:
                    times[judge].append(seal_once(shards, ram.view, step, judge))
            with_ = statistics.median(times[True])
            without = statistics.median(times[False])
            out[name] = {
                "seal_with_verdict_s": with_,
                "seal_without_verdict_s": without,
                "ratio": with_ / without,
                "verdict_ms": (with_ - without) * 1000,
            }
            print(
                f"{name:16s} seal with verdict {with_ * 1000:8.1f} ms, without "
                f"{without * 1000:8.1f} ms: ratio {with_ / without:.3f} "
                f"(+{(with_ - without) * 1000:.1f} ms)",
                flush=True,
            )
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", help="write the figures to this file")
    args = p.parse_args()
    out = run(args.repeat)
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
