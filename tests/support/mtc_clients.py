"""Client simulators that follow the MTC clients' file sequences step by step.

They reproduce what docs/CLIENTS.md records of Orbax 0.12.8
(``initialize_multi_tier_checkpointing`` and ``ReplicatorCheckpointManager``)
and of the NeMo helper (``high_scale_ckpt_utils.py``): the same waits, file
names, renames and error-file handling, so a test that passes with them
exercises the same paths a real client does.
"""

from __future__ import annotations

import fcntl
import glob
import os
import re
import time
from pathlib import Path

import yaml
from step_bytes import dcp_metadata, torch_like_zip

MARKER_RE = re.compile(r"^.+-s(?P<step>\d+)-n\d+-w\d+\.restore$")


class ReplicatorFailed(RuntimeError):
    """replicator.failed was present: the client gives up (as Orbax and NeMo do)."""


def wait_for(cond, timeout: float, what: str, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def check_error_files(d: Path) -> str:
    """Orbax/NeMo: read+delete replicator.errors; replicator.failed raises."""
    errors = ""
    if (d / "replicator.errors").exists():
        errors = (d / "replicator.errors").read_text()
        (d / "replicator.errors").unlink(missing_ok=True)
    if (d / "replicator.failed").exists():
        failed = (d / "replicator.failed").read_text()
        (d / "replicator.failed").unlink(missing_ok=True)
        raise ReplicatorFailed(failed)
    return errors


def orbax_yaml(
    job: str,
    rank: int,
    nodes: int,
    peer_ranks: list[int] | None = None,
    dp: int = 1,
    minutes: int = 30,
) -> str:
    """The yaml exactly as Orbax renders it: stripped lines, flow list, no trailing newline."""
    lines = [
        f"job-name: {job}",
        "framework: orbax",
        f"assume-data-parallelism: {dp}",
        f"node-rank: {rank}",
        f"nodes: {nodes}",
        f"peer-ranks: {peer_ranks or []}",
        f"backup-interval-minutes: {minutes}",
    ]
    return "\n".join(line.strip() for line in lines)


def orbax_initialize(d: Path, text: str, timeout: float = 60) -> int | None:
    """Orbax's handshake; returns the restored step (renamed to ``d/<step>``) or None."""
    wait_for(lambda: not (d / "replicator.yaml").exists(), timeout, "no replicator.yaml")
    tmp = d / "replicator.yaml.tmp"
    tmp.write_text(text)
    os.replace(tmp, d / "replicator.yaml")
    wait_for(lambda: not (d / "replicator.yaml").exists(), timeout, "replicator.yaml consumed")
    check_error_files(d)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        markers = sorted(glob.glob(str(d / "*.restore")))
        check_error_files(d)
        if markers:
            restore, empty = [], []
            for m in markers:
                match = MARKER_RE.match(os.path.basename(m))
                if not match:
                    raise ValueError(f"unparsable marker {m}")
                step = int(match["step"])
                if step == 0 and os.path.isfile(m):
                    empty.append(m)
                else:
                    restore.append((step, m))
            if restore:
                step, marker = max(restore)
                os.replace(marker, d / str(step))
                for _, m in restore:
                    if m != marker:
                        os.unlink(m)
                for m in empty:
                    os.unlink(m)
                return step
            for m in empty:
                os.unlink(m)
            return None
        time.sleep(0.05)
    raise TimeoutError("no restore marker")


def ocdbt_manifest(body: bytes) -> bytes:
    """Bytes shaped like a tensorstore OCDBT manifest (magic, length, body, crc32c): what
    tierfs's Orbax rule needs to judge a step loadable (docs/SEMANTICS.md)."""
    import google_crc32c

    head = (0x0CDB3A2A).to_bytes(4, "big") + (4 + 8 + len(body) + 4).to_bytes(8, "little")
    return head + body + int(google_crc32c.value(head + body)).to_bytes(4, "little")


def orbax_save(d: Path, step: int, payload: dict[str, bytes]) -> None:
    """Orbax's save: tmp dir, items renamed inside, a tensorstore ``.__lock`` renamed
    onto its key while open and locked, commit_success.txt, final rename to ``<step>``."""
    tmp = d / f"{step}.orbax-checkpoint-tmp"
    state_tmp = tmp / "state.orbax-checkpoint-tmp"
    os.makedirs(state_tmp / "d")
    (tmp / "_CHECKPOINT_METADATA").write_text('{"init": true}')
    for name, data in payload.items():
        (state_tmp / "d" / name).write_bytes(data)
    lock = state_tmp / "manifest.ocdbt.__lock"
    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        os.write(fd, ocdbt_manifest(b"manifest-for-step-%d" % step))
        os.rename(lock, state_tmp / "manifest.ocdbt")
        fcntl.lockf(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    (state_tmp / "commit_success.txt").write_text("ok")
    os.rename(state_tmp, tmp / "state")
    (tmp / "_CHECKPOINT_METADATA").write_text('{"commit_timestamp_nsecs": 1}')
    (tmp / "commit_success.txt").write_text(f"Checkpoint commit was successful to {d / str(step)}")
    os.rename(tmp, d / str(step))


def orbax_read(d: Path, step: int, names: list[str]) -> dict[str, bytes]:
    return {n: (d / str(step) / "state" / "d" / n).read_bytes() for n in names}


def nemo_write_yaml(
    d: Path,
    job: str,
    rank: int,
    nodes: int,
    peers_per_node: int = 1,
    peer_ranks: list[int] | None = None,
    timeout: float = 60,
) -> None:
    """The NeMo helper: wait for no yaml, then write it in place in block style."""
    wait_for(lambda: not (d / "replicator.yaml").exists(), timeout, "no replicator.yaml")
    data = {
        "job-name": job,
        "framework": "pytorch.distributed",
        "node-rank": rank,
        "nodes": nodes,
        "peers-per-node": peers_per_node,
        "backup-interval-minutes": 30,
    }
    if peer_ranks is not None:
        data["peer-ranks"] = peer_ranks
    with open(d / "replicator.yaml", "w") as f:
        yaml.dump(data, f, default_flow_style=False, sort_keys=False)


def nemo_restore(d: Path, timeout: float = 60) -> int | None:
    """The NeMo helper's block_and_proces_restore_dir: first marker wins, s0 stays."""
    wait_for(lambda: not (d / "replicator.yaml").exists(), timeout, "replicator.yaml consumed")
    check_error_files(d)
    pre = wait_for(
        lambda: (
            (d / "replicator.prerestore").exists() and (d / "replicator.prerestore").read_text()
        ),
        timeout,
        "replicator.prerestore",
    )
    info = yaml.safe_load(pre)
    int(info.get("restore-step", 0))  # crashes on None, as the helper does
    marker = wait_for(lambda: glob.glob(str(d / "*.restore")), timeout, "a marker")[0]
    m = re.search(r"-s(\d+)-n\d+-w\d+", marker)
    step = int(m.group(1)) if m else 0
    if step == 0:
        return None
    os.rename(marker, d / f"step={step}")
    return step


def nemo_save(
    d: Path, step: int, payload: dict[str, bytes], *, rename_to: int | None = None
) -> None:
    """A NeMo DCP save: ``step=<N>-unfinished`` marker, per-rank files, finalize.

    With ``rename_to`` (async saves) the finalized ``step=<N>`` is renamed to digits.
    """
    unfinished = d / f"step={step}-unfinished"
    unfinished.touch()
    target = d / f"step={step}"
    os.makedirs(target / "0")
    for name, data in payload.items():
        (target / "0" / name).write_bytes(data)
    # a .metadata and common.pt tierfs judges loadable (docs/SEMANTICS.md)
    refs = [(name, f"0/{name}", 0, len(data)) for name, data in payload.items()]
    (target / ".metadata").write_bytes(dcp_metadata(refs))
    (target / "common.pt").write_bytes(torch_like_zip())
    (target / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    unfinished.unlink()
    if rename_to is not None:
        os.rename(target, d / str(rename_to))
