"""A node with a representative state for the status tests (no mount, no process, no
bucket): every part of ``.tierfs/status.json`` has content -- steps being written,
withdrawn, sealed and verified, a replica, errors, a running restore with phase
details, peers with sends in each state, the coordinator's status, a backup upload,
rounds and a pending ``restore.version``.

:func:`frozen_status` gives the status JSON with the values that differ between
runs (pid, paths, statvfs, incarnation) replaced, at a fixed clock; the golden
file ``tests/unit/data/status/built-node.json`` is that JSON as the code before
the typed status wrote it.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import time
from typing import Any

from tierfs.backup.uploads import Upload
from tierfs.core.config import NodeConfig
from tierfs.core.control import JobSpec
from tierfs.core.types import RoundView
from tierfs.daemon import NodeParts, build_node
from tierfs.node.sealing import SealCandidate
from tierfs.replication.addresses import PeerInfo
from tierfs.replication.replicator import Send
from tierfs.store.ramstore import Budget, RamStore, StoreUsage
from tierfs.store.shards import ShardKey

#: the clock while the status is taken (Unix seconds)
NOW = 1_796_000_000.0


def _step(view: str, name: str, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = os.path.join(view, name, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)


def build_state(tmp_path: pathlib.Path, *, cluster: bool = True) -> NodeParts:
    """A node holding a representative state: with ``cluster`` a peer plane, a
    coordinator and a bucket, else a one-node cluster without a bucket."""
    options: dict[str, Any] = {}
    if cluster:
        options = {
            "listen": "127.0.0.1:7001",
            "coordinator": "127.0.0.1:7001",
            "bucket": "gs://bucket/prefix",
        }
    config = NodeConfig(mountpoint=str(tmp_path / "m"), ram_dir=str(tmp_path / "r"), **options)
    store = RamStore(config.ram_dir)
    parts = build_node(config, store, Budget(store.root, 1 << 30, 0))
    agent, peer, gcs = parts.agent, parts.peer, parts.gcs
    job = JobSpec("train", "orbax", 0, 3, peer_ranks=(1, 2), backup_interval_steps=10)
    parts.state.job = job
    parts.state.mode = "protocol"
    view = store.view
    # sealed steps: 10 verified, 20 sealed (a backup requested), visible under a name
    for step, extra in ((10, {}), (20, {"_BACKUP_REQUESTED": b""})):
        _step(view, str(step), {"a/x.bin": bytes(1000 + step), "meta.json": b"{}", **extra})
        key = ShardKey(job.name, job.node_rank, step)
        shard = parts.shards.snapshot(view, key, str(step), [str(step)], job.framework)
        shard.verified = step == 10
        parts.catalog.add(shard)
    agent.view_steps["20"] = ShardKey(job.name, job.node_rank, 20)
    # a replica of node-rank 1 and a step being written and one withdrawn
    _step(view, "r1", {"y.bin": bytes(333)})
    replica = parts.shards.snapshot(view, ShardKey(job.name, 1, 20), "20", ["r1"], job.framework)
    parts.catalog.add(replica)
    agent.pending["30.orbax-checkpoint-tmp"] = SealCandidate(
        30, "30.orbax-checkpoint-tmp", ("30.orbax-checkpoint-tmp",), "renamed"
    )
    agent.withdrawn_names["25"] = ShardKey(job.name, job.node_rank, 25)
    store.last_usage = StoreUsage(
        8192, {("train", "0"): 4096, ("train", "1"): 1024}, 512, NOW - 2.34567
    )
    parts.reporter.error("replication of step 20 to node-rank 2 failed: unavailable")
    parts.state.restore_state = {
        "state": "planning",
        "since": NOW - 5,
        "phase": "waiting for node-rank(s) [2]",
        "round": 4,
        "missing": [2],
    }
    if peer is None:
        return parts
    # the peer plane: two peers, one send replicated, one failed
    peer.peers.update(
        {
            1: PeerInfo(1, "127.0.0.1:7002", "inc-1", True),
            2: PeerInfo(2, "127.0.0.1:7003", "inc-2", False),
        }
    )
    peer.node_counts = (2, 3)
    peer.sync = {"step": 10, "at": NOW - 30, "steps": [10], "reported": 3}
    peer.last_error = "node-rank 2 did not answer"
    peer._server = object()  # type: ignore[assignment]  # serving: the coordinator's status
    assert parts.plane is not None
    parts.plane.server_up = True
    peer._pins[ShardKey(job.name, 0, 20)] += 1
    peer._sends[ShardKey(job.name, 0, 10)] = Send(
        states={1: "replicated", 2: "replicated (manifest only)"},
        timings={1: {"seconds": 0.25, "bytes": 1010.0}},
    )
    peer._sends[ShardKey(job.name, 0, 20)] = Send(states={1: "replicated", 2: "failed"})
    # the backup plane: a finished round, an upload waiting for the bucket
    gcs.backed_up[10] = "2026-12-01_10-00"
    gcs.history.append(
        {
            "round": "2026-12-01_10-00",
            "step": 10,
            "state": "complete",
            "started": NOW - 600,
            "reason": "ordered by the coordinator",
            "node": "done",
            "seconds": 1.5,
            "bytes": 2066,
        }
    )
    gcs.history.append(
        {
            "round": "2026-12-01_11-00",
            "step": 20,
            "state": "running",
            "started": NOW - 60,
            "reason": "ordered by the coordinator",
        }
    )
    gcs.memory.cluster_last = RoundView("2026-12-01_11-00", 20, "running")
    upload = Upload("2026-12-01_11-00", 20, 2000, None, NOW - 20)  # type: ignore[arg-type]
    upload.done, upload.attempt, upload.waiting_until = 500, 2, NOW + 30
    gcs._uploads[ShardKey(job.name, 0, 20)] = upload
    gcs.memory.forced = (job.name, "2026-12-01_09-00", 5, NOW - 100)
    gcs.lines.last_error = "backup of step 20 failed: 503"
    return parts


def normalized(status: dict[str, Any]) -> dict[str, Any]:
    """``status`` (its JSON) with the values that differ between runs replaced."""
    data: dict[str, Any] = json.loads(json.dumps(status, sort_keys=True, default=str))
    data["pid"] = data["mountpoint"] = data["ram_dir"] = "-"
    data["errors"] = [re.sub(r"^[\d-]+ [\d:]+ ", "", e) for e in data["errors"]]
    data["filesystem"] = {k: 0 for k in data["filesystem"]}
    for k in ("used_bytes", "free_bytes"):  # the sizes of directories count in the budget
        data["budget"][k] = 0
    if "peer" in data["tiers"]:
        data["tiers"]["peer"]["incarnation"] = "-"
    gcs = data["tiers"]["gcs"]
    gcs["summary"] = re.sub(r"at \d\d:\d\d:\d\d", "at HH:MM:SS", gcs["summary"])  # local time
    return data


def frozen_status(parts: NodeParts, to_json: Any) -> dict[str, Any]:
    """The normalized status JSON taken at :data:`NOW`; ``to_json`` turns what
    ``NodeAgent.status()`` returns into its JSON object."""
    real = time.time
    time.time = lambda: NOW  # every module calls time.time() through the module
    try:
        agent = parts.agent
        agent.started = NOW - 100
        return normalized(to_json(agent.status()))
    finally:
        time.time = real
