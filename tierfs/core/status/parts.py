"""The parts of a node's own status: its RAM budget and usage, the filesystem, the job,
the restore, its steps and the peers' shards it holds (:class:`tierfs.core.status.NodeStatus`
puts them together)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tierfs.core.status.coding import JsonObject, strs, with_optional

__all__ = [
    "BudgetStatus",
    "FilesystemStatus",
    "JobStatus",
    "ReplicaStatus",
    "RestoreStatus",
    "StepStatus",
    "UsageStatus",
]


@dataclass(frozen=True, slots=True)
class BudgetStatus:
    """The RAM budget (:class:`tierfs.store.ramstore.Budget`)."""

    #: ``managed`` (tierfs counts against --size) or ``native`` (the filesystem's limit)
    mode: str | None = None
    #: bytes the budget allows in all
    total_bytes: int = 0
    #: bytes used as the budget counts them
    used_bytes: int = 0
    #: bytes left
    free_bytes: int = 0
    #: ``--size`` in bytes, None without it
    size_bytes: int | None = None

    def to_json(self) -> JsonObject:
        return {
            "mode": self.mode,
            "total_bytes": self.total_bytes,
            "used_bytes": self.used_bytes,
            "free_bytes": self.free_bytes,
            "size_bytes": self.size_bytes,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BudgetStatus:
        return cls(
            mode=data.get("mode"),
            total_bytes=data.get("total_bytes", 0),
            used_bytes=data.get("used_bytes", 0),
            free_bytes=data.get("free_bytes", 0),
            size_bytes=data.get("size_bytes"),
        )


@dataclass(frozen=True, slots=True)
class UsageStatus:
    """tierfs's own bytes in the ram-dir by area, as last counted (not the
    filesystem's free space, which other programs share: :class:`FilesystemStatus`)."""

    #: bytes of every area together
    total_bytes: int
    #: bytes of the client's view (the files of the mount)
    view_bytes: int
    #: bytes of this node's sealed steps beyond what the view shares with them
    snapshot_bytes: int
    #: bytes of the peers' steps held here
    replica_bytes: int
    #: bytes of trash and transfers in progress
    other_bytes: int
    #: Unix time (seconds) of the count, rounded to ms
    counted_at: float
    #: seconds since the count, rounded to 0.1 s
    age_seconds: float

    def to_json(self) -> JsonObject:
        return {
            "total_bytes": self.total_bytes,
            "view_bytes": self.view_bytes,
            "snapshot_bytes": self.snapshot_bytes,
            "replica_bytes": self.replica_bytes,
            "other_bytes": self.other_bytes,
            "counted_at": self.counted_at,
            "age_seconds": self.age_seconds,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> UsageStatus:
        return cls(
            total_bytes=data.get("total_bytes", 0),
            view_bytes=data.get("view_bytes", 0),
            snapshot_bytes=data.get("snapshot_bytes", 0),
            replica_bytes=data.get("replica_bytes", 0),
            other_bytes=data.get("other_bytes", 0),
            counted_at=data.get("counted_at", 0.0),
            age_seconds=data.get("age_seconds", 0.0),
        )


@dataclass(frozen=True, slots=True)
class FilesystemStatus:
    """The filesystem holding the ram-dir (statvfs), shared with other programs."""

    #: size in bytes
    total_bytes: int
    #: bytes free for unprivileged writers (``f_bavail``)
    free_bytes: int
    #: bytes used by anyone
    used_bytes: int

    def to_json(self) -> JsonObject:
        return {
            "total_bytes": self.total_bytes,
            "free_bytes": self.free_bytes,
            "used_bytes": self.used_bytes,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FilesystemStatus | None:
        """None for ``{}`` (statvfs failed)."""
        if not data:
            return None
        return cls(
            total_bytes=data.get("total_bytes", 0),
            free_bytes=data.get("free_bytes", 0),
            used_bytes=data.get("used_bytes", 0),
        )


@dataclass(frozen=True, slots=True)
class JobStatus:
    """The running job (``replicator.yaml`` or ``--job``)."""

    name: str
    framework: str
    node_rank: int
    nodes: int
    #: the restore's state (:attr:`RestoreStatus.state`)
    state: str | None

    def to_json(self) -> JsonObject:
        return {
            "name": self.name,
            "framework": self.framework,
            "node_rank": self.node_rank,
            "nodes": self.nodes,
            "state": self.state,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JobStatus:
        return cls(
            name=data.get("name", ""),
            framework=data.get("framework", ""),
            node_rank=data.get("node_rank", 0),
            nodes=data.get("nodes", 0),
            state=data.get("state"),
        )


@dataclass(frozen=True, slots=True)
class RestoreStatus:
    """The restore's state: every key the restore code set, kept as it is.

    ``state`` is idle, pending, cleanup, planning, barrier, done or failed;
    the other keys depend on it (``since``/``at``: Unix time; ``step``,
    ``source``, ``backup``, ``outcome``, ``reason``, ``problems``, ``error``,
    ``phase``, and the phase's details such as ``round`` or ``missing``).
    """

    fields: Mapping[str, Any] = field(default_factory=lambda: {"state": "idle"})

    @property
    def state(self) -> str | None:
        return self.fields.get("state")

    @property
    def step(self) -> int | None:
        """The step restored or being restored, None for none (also 0 is none)."""
        return self.fields.get("step")

    @property
    def source(self) -> str | None:
        """Where the step came from: ``local``, ``peer``, ``gcs``..."""
        return self.fields.get("source")

    @property
    def backup(self) -> str | None:
        """The backup round restored from, if any."""
        return self.fields.get("backup")

    @property
    def writers(self) -> int:
        """The node count that wrote the restored step (issue #16; 0 unknown)."""
        return int(self.fields.get("writers") or 0)

    @property
    def outcome(self) -> str | None:
        """restored, fresh, incomplete, missing, timeout, refused or failed (None: a
        status from before outcomes, or a restore still running)."""
        return self.fields.get("outcome")

    @property
    def reason(self) -> str | None:
        return self.fields.get("reason")

    @property
    def error(self) -> str | None:
        return self.fields.get("error")

    @property
    def phase(self) -> str | None:
        """What a running restore does or waits for (one line)."""
        return self.fields.get("phase")

    @property
    def problems(self) -> tuple[str, ...]:
        return strs(self.fields.get("problems"))

    @property
    def at(self) -> float | None:
        """Unix time the restore ended."""
        return self.fields.get("at")

    def to_json(self) -> JsonObject:
        return dict(self.fields)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RestoreStatus:
        return cls(dict(data))


@dataclass(frozen=True, slots=True)
class StepStatus:
    """One step of this node's job: being written, sealed, verified or replicated."""

    step: int
    #: the step's name in the mount (e.g. ``100`` or ``checkpoint-100``)
    name: str
    #: ``writing``, ``sealed``, ``verified``, or a tier's word (``replicated``...)
    state: str | None
    #: bytes of the step's shard on this node (0 while writing)
    bytes: int = 0
    #: where copies are: ``local``, ``peer:<rank>``, ``gcs:<round>`` (sorted)
    where: tuple[str, ...] = ()
    #: number of regular files (sealed steps only)
    files: int | None = None
    #: the trainer asked for a backup of this step (sealed steps only)
    backup_requested: bool | None = None
    #: the step is presented in the view (sealed steps only)
    visible: bool | None = None
    #: would the framework load it, judged at seal time (sealed steps only;
    #: :func:`tierfs.store.verdicts.loads_summary`), e.g. ``yes (dcp)``
    loads: str | None = None

    def to_json(self) -> JsonObject:
        out: JsonObject = {
            "step": self.step,
            "name": self.name,
            "state": self.state,
            "bytes": self.bytes,
            "where": list(self.where),
        }
        return with_optional(
            out,
            files=self.files,
            backup_requested=self.backup_requested,
            visible=self.visible,
            loads=self.loads,
        )

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StepStatus:
        return cls(
            step=data.get("step", 0),
            name=str(data.get("name", "")),
            state=data.get("state"),
            bytes=data.get("bytes", 0),
            where=strs(data.get("where")),
            files=data.get("files"),
            backup_requested=data.get("backup_requested"),
            visible=data.get("visible"),
            loads=data.get("loads"),
        )


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """A peer's shard held on this node."""

    job: str
    #: the peer's node rank
    rank: int
    step: int
    #: bytes of the shard
    bytes: int

    def to_json(self) -> JsonObject:
        return {"job": self.job, "rank": self.rank, "step": self.step, "bytes": self.bytes}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ReplicaStatus:
        return cls(
            job=data.get("job", ""),
            rank=data.get("rank", 0),
            step=data.get("step", 0),
            bytes=data.get("bytes", 0),
        )
