"""In-memory implementations of the node's ports (:mod:`tierfs.core.ports`) for unit tests.

Each fake records what the plane under test did with it, so a test asserts
the lines reported, the summons and heartbeats asked for, the retention
requests; the catalog is the real :class:`tierfs.node.catalog.ShardCatalog`
(pure dict work) over a store that only records removals.
"""

from __future__ import annotations

from typing import Any

from tierfs.core.control import JobSpec
from tierfs.node.catalog import ShardCatalog
from tierfs.store.shards import Shard


class FakeJob:
    """:class:`~tierfs.core.ports.CurrentJob` + :class:`~tierfs.core.ports.Summons`
    + :class:`~tierfs.core.ports.Reporter` in one object (tests change ``job``)."""

    def __init__(self, job: JobSpec | None = None, mode: str = "generic") -> None:
        self.job = job
        self.mode = mode if job is not None else "none"
        self.timeline_since = 0.0
        self.restore_state: dict[str, Any] = {"state": "idle"}
        self.errors: list[str] = []
        self.failures: list[str] = []
        self.summons: list[JobSpec] = []

    def restoring(self) -> bool:
        return self.restore_state.get("state") in ("cleanup", "planning", "barrier")

    def summoned(self, job: JobSpec) -> None:
        self.summons.append(job)

    def error(self, message: str) -> None:
        self.errors.append(message)

    def failure(self, message: str, *, job_context: bool = True) -> None:
        self.failures.append(message)


class RecordingShardStore:
    """The part of :class:`tierfs.store.shards.ShardStore` the catalog uses: ``remove``."""

    def __init__(self) -> None:
        self.removed: list[Shard] = []

    def remove(self, shard: Shard) -> None:
        self.removed.append(shard)


class FakeBudget:
    """:class:`~tierfs.core.ports.RamBudget` with a fixed number of free bytes."""

    def __init__(self, free: int = 1 << 30) -> None:
        self._free = free

    def check_growth(self, nbytes: int) -> None:
        if nbytes > self._free:
            raise OSError(28, "no space")

    def free(self) -> int:
        return self._free


def catalog(keep_local: int = 2) -> ShardCatalog:
    """A real catalog over a store that only records removals."""
    return ShardCatalog(RecordingShardStore(), keep_local)  # type: ignore[arg-type]
