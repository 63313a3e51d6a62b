"""A stand-in for an Orbax multi-tier-checkpointing trainer on one node (used by test_peer_*).

It follows the file protocol of PROTOCOL.md exactly as Orbax 0.12.8 does
(docs/CLIENTS.md sections 1 and 2): write ``replicator.yaml.tmp`` and rename it
into place, wait for it to vanish, fail on ``replicator.failed``, wait for a
``*.restore`` marker, rename the newest one to ``<step>`` (or drop the s0 file),
then save steps as ``<step>.orbax-checkpoint-tmp`` directories renamed to
``<step>``. Prints one JSON line with what it restored and saved.

Step content is deterministic: ``content(seed, owner, step)``; with
``--column-of D`` the owner is the rank's column in a D-row grid, so the ranks
of a column write identical bytes (the data-parallel case).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import random
import re
import sys
import time

MARKER = re.compile(r"^.+-s(?P<step>\d+)-n\d+-w\d+\.restore$")


def content(seed: str, owner: int, step: int, size: int) -> dict[str, bytes]:
    """The files of one step: relative path -> bytes."""
    rnd = random.Random(f"{seed}/{owner}/{step}")
    return {
        "_CHECKPOINT_METADATA": json.dumps({"step": step}).encode(),
        "state/manifest.ocdbt": ocdbt_manifest(rnd.randbytes(1000)),
        "state/d/0a1b2c": rnd.randbytes(size),
        "state/ocdbt.process_0/manifest.ocdbt": ocdbt_manifest(rnd.randbytes(100)),
        "state/ocdbt.process_0/d/ff": rnd.randbytes(size // 3 + 7),
        "commit_success.txt": b"Checkpoint commit was successful.\n",
    }


def ocdbt_manifest(body: bytes) -> bytes:
    """Bytes shaped like a tensorstore OCDBT manifest (magic, length, body, crc32c), so
    tierfs judges the step loadable (docs/SEMANTICS.md, Orbax)."""
    import google_crc32c

    head = (0x0CDB3A2A).to_bytes(4, "big") + (4 + 8 + len(body) + 4).to_bytes(8, "little")
    return head + body + int(google_crc32c.value(head + body)).to_bytes(4, "little")


def digest(files: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
    return h.hexdigest()


def read_tree(root: str) -> dict[str, bytes]:
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, root)] = f.read()
    return out


def wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def check_failed(root: str) -> None:
    path = os.path.join(root, "replicator.failed")
    if os.path.exists(path):
        with open(path) as f:
            raise SystemExit(f"replicator.failed: {f.read().strip()}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--job", default="job")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--peers-per-node", type=int, default=1)
    p.add_argument("--dp", type=int, default=0, help="assume-data-parallelism (0: none)")
    p.add_argument("--steps", default="", help="steps to save, e.g. 1,2,3")
    p.add_argument("--seed", default="s")
    p.add_argument("--size", type=int, default=1 << 20)
    p.add_argument("--timeout", type=float, default=120)
    a = p.parse_args()
    root = a.root
    yaml_lines = [
        f"job-name: {a.job}",
        "framework: orbax",
        f"node-rank: {a.rank}",
        f"nodes: {a.nodes}",
        f"peers-per-node: {a.peers_per_node}",
        "backup-interval-minutes: 30",
    ]
    if a.dp:
        yaml_lines.insert(2, f"assume-data-parallelism: {a.dp}")
    yaml_path = os.path.join(root, "replicator.yaml")
    wait(lambda: not os.path.exists(yaml_path), a.timeout, "an earlier replicator.yaml")
    with open(yaml_path + ".tmp", "w") as f:
        f.write("\n".join(yaml_lines))
    os.replace(yaml_path + ".tmp", yaml_path)
    wait(lambda: not os.path.exists(yaml_path), a.timeout, "replicator.yaml to be consumed")
    check_failed(root)

    def markers() -> list[str]:
        check_failed(root)
        return sorted(glob.glob(os.path.join(root, "*.restore")))

    wait(lambda: bool(markers()), a.timeout, "a restore marker")
    found = markers()
    restored = None
    steps = []
    for m in found:
        match = MARKER.match(os.path.basename(m))
        if match is None:
            raise SystemExit(f"odd marker name {m}")
        steps.append((int(match["step"]), m))
    real = [
        (s, m) for s, m in steps if not (s == 0 and os.path.isfile(m) and not os.path.islink(m))
    ]
    owner = a.rank % (a.nodes // a.dp) if a.dp else a.rank
    result: dict = {"rank": a.rank, "markers": [os.path.basename(m) for m in found]}
    if real:
        step, marker = max(real)
        os.replace(marker, os.path.join(root, str(step)))
        for _s, m in steps:
            if m != marker and os.path.lexists(m):
                os.unlink(m)
        # tierfs swaps the renamed symlink for a real directory and then
        # removes the sibling it pointed at; a walk that started through the
        # symlink can lose that race (reported to the agent's owner), so
        # read once the step is a directory
        wait(
            lambda: not os.path.islink(os.path.join(root, str(step))),
            30,
            "the restored step to become a directory",
        )
        files = read_tree(os.path.join(root, str(step)))
        restored = step
        result["restored_digest"] = digest(files)
        result["restored_ok"] = files == content(a.seed, owner, step, a.size)
    else:
        for _s, m in steps:
            os.unlink(m)
    result["restored"] = restored
    saved = {}
    for step in [int(s) for s in a.steps.split(",") if s]:
        files = content(a.seed, owner, step, a.size)
        tmp = os.path.join(root, f"{step}.orbax-checkpoint-tmp")
        for path, data in files.items():
            full = os.path.join(tmp, path)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "wb") as f:
                f.write(data)
        os.rename(tmp, os.path.join(root, str(step)))
        saved[step] = digest(files)
    result["saved"] = saved
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as exc:
        if exc.code not in (None, 0):
            print(json.dumps({"error": str(exc.code)}), flush=True)
            sys.exit(1)
        raise
