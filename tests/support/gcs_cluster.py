"""Helpers for the GCS-tier tests with real daemons: the MTC client protocol
(PROTOCOL.md sections 2 to 4) driven from the test process, one thread per node."""

from __future__ import annotations

import glob
import json
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mtc_client import content, read_tree

MARKER = re.compile(r"^.+-s(?P<step>\d+)-n\d+-w\d+\.restore$")


def wait_for(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll ``cond`` until truthy; returns its value."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = cond()
            if value:
                return value
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            last = exc
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout:.0f} s waiting for {what}"
        + (f" (last error: {last!r})" if last else "")
    )


def handshake(
    root: Path,
    rank: int,
    nodes: int,
    *,
    job: str = "job",
    extra: tuple[str, ...] = (),
    timeout: float = 90,
) -> dict[str, Any]:
    """Write replicator.yaml as Orbax does, wait for the restore marker and take it.

    Returns {"restored": step or None, "files": {...}, "prerestore": text, "errors": text,
    "markers": the marker names found}.
    """
    lines = [
        f"job-name: {job}",
        "framework: orbax",
        f"node-rank: {rank}",
        f"nodes: {nodes}",
        "peers-per-node: 1",
        *extra,
    ]
    yml = root / "replicator.yaml"
    wait_for(lambda: not yml.exists(), timeout, "an earlier replicator.yaml to go")
    tmp = root / "replicator.yaml.tmp"
    tmp.write_text("\n".join(lines))
    os.replace(tmp, yml)
    wait_for(lambda: not yml.exists(), timeout, f"node {rank}: replicator.yaml consumed")
    failed = root / "replicator.failed"
    if failed.exists():
        raise AssertionError(f"node {rank}: replicator.failed: {failed.read_text()}")
    markers = wait_for(
        lambda: sorted(glob.glob(str(root / "*.restore"))),
        timeout,
        f"node {rank}: a restore marker",
    )
    prerestore = (
        (root / "replicator.prerestore").read_text()
        if (root / "replicator.prerestore").exists()
        else ""
    )
    errors_path = root / "replicator.errors"
    out: dict[str, Any] = {
        "restored": None,
        "files": {},
        "prerestore": prerestore,
        "errors": errors_path.read_text() if errors_path.exists() else "",
        "markers": [os.path.basename(m) for m in markers],
    }
    real = []
    for m in markers:
        step = int(MARKER.match(os.path.basename(m))["step"])  # type: ignore[index]
        if step == 0 and not os.path.islink(m):
            os.unlink(m)
            continue
        real.append((step, m))
    if real:
        step, marker = max(real)
        os.replace(marker, root / str(step))
        wait_for(lambda: not os.path.islink(root / str(step)), 30, "the step as a directory")
        out["restored"] = step
        out["files"] = read_tree(str(root / str(step)))
    return out


def save(root: Path, step: int, files: dict[str, bytes]) -> None:
    """Save a step as Orbax does: ``<step>.orbax-checkpoint-tmp`` renamed to ``<step>``."""
    tmp = root / f"{step}.orbax-checkpoint-tmp"
    for path, data in files.items():
        full = tmp / path
        full.parent.mkdir(parents=True, exist_ok=True)
        full.write_bytes(data)
    os.rename(tmp, root / str(step))


def step_files(rank: int, step: int, size: int = 100_000, seed: str = "g") -> dict[str, bytes]:
    return content(seed, rank, step, size)


def status(root: Path) -> dict[str, Any]:
    return json.loads((root / ".tierfs" / "status.json").read_text())


def gcs_status(root: Path) -> dict[str, Any]:
    return status(root)["tiers"]["gcs"]


def backed_up(root: Path, step: int) -> str | None:
    """The round this node uploaded ``step`` to, per its status."""
    for s in gcs_status(root).get("steps", []):
        if s["step"] == step:
            return s["where"][0].removeprefix("gcs:")
    return None


def errors(root: Path) -> str:
    p = root / "replicator.errors"
    return p.read_text() if p.exists() else ""


def all_nodes(fn: Callable[[int], Any], n: int) -> list[Any]:
    """Run ``fn(rank)`` for every rank at once (threads); returns results by rank."""
    results: list[Any] = [None] * n
    problems: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = fn(i)
        except BaseException as exc:
            problems.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if problems:
        raise problems[0]
    return results
