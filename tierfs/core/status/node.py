"""The whole status of one node (:class:`NodeStatus`, ``.tierfs/status.json``): its own
parts (:mod:`tierfs.core.status.parts`) and its tiers' (:class:`PeerStatus`,
:class:`BackupStatus`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tierfs.core.status.backup import BackupStatus
from tierfs.core.status.coding import JsonObject, obj, objs, strs
from tierfs.core.status.parts import (
    BudgetStatus,
    FilesystemStatus,
    JobStatus,
    ReplicaStatus,
    RestoreStatus,
    StepStatus,
    UsageStatus,
)
from tierfs.core.status.peer import PeerStatus
from tierfs.core.status.whole import WholeViewStatus

__all__ = ["NodeStatus", "TierStatus"]

#: what a tier's ``status()`` returns
TierStatus = PeerStatus | BackupStatus

#: the tier status type of each tier name in ``tiers``
_TIER_TYPES: dict[str, type[PeerStatus] | type[BackupStatus]] = {
    "peer": PeerStatus,
    "gcs": BackupStatus,
}


# ---------------------------------------------------------------------- the node


@dataclass(frozen=True, slots=True)
class NodeStatus:
    """The whole status of one node (``.tierfs/status.json``)."""

    #: absolute path of the mount
    mountpoint: str | None = None
    #: the ram-dir's root
    ram_dir: str | None = None
    #: the daemon's process id
    pid: int | None = None
    #: seconds the daemon has run, rounded to 0.1 s
    uptime_seconds: float = 0.0
    budget: BudgetStatus = field(default_factory=BudgetStatus)
    #: tierfs's own bytes by area, None before the first count
    usage: UsageStatus | None = None
    #: the filesystem holding the ram-dir, None if statvfs failed (``{}`` in the JSON)
    filesystem: FilesystemStatus | None = None
    #: FUSE passthrough is on
    passthrough: bool = False
    #: ``protocol``, ``generic`` or ``none``
    mode: str | None = None
    job: JobStatus | None = None
    restore: RestoreStatus = field(default_factory=RestoreStatus)
    #: this node's steps, newest first
    steps: tuple[StepStatus, ...] = ()
    #: the peers' shards held here, by (job, rank, step)
    replicas: tuple[ReplicaStatus, ...] = ()
    #: tier name (``peer``, ``gcs``) -> its status, in the order the tiers run
    tiers: Mapping[str, TierStatus] = field(default_factory=dict)
    #: the last problem lines (``replicator.errors`` and internal errors), oldest first
    errors: tuple[str, ...] = ()
    #: other ranks' files of each step in this node's view (issue #14)
    whole_view: WholeViewStatus = field(default_factory=WholeViewStatus)

    @property
    def peer(self) -> PeerStatus | None:
        tier = self.tiers.get("peer")
        return tier if isinstance(tier, PeerStatus) else None

    @property
    def gcs(self) -> BackupStatus | None:
        tier = self.tiers.get("gcs")
        return tier if isinstance(tier, BackupStatus) else None

    def to_json(self) -> JsonObject:
        """The status as the JSON object of ``.tierfs/status.json`` (the contract)."""
        return {
            "mountpoint": self.mountpoint,
            "ram_dir": self.ram_dir,
            "pid": self.pid,
            "uptime_seconds": self.uptime_seconds,
            "budget": self.budget.to_json(),
            "usage": self.usage.to_json() if self.usage is not None else None,
            "filesystem": self.filesystem.to_json() if self.filesystem is not None else {},
            "passthrough": self.passthrough,
            "mode": self.mode,
            "job": self.job.to_json() if self.job is not None else None,
            "restore": self.restore.to_json(),
            "steps": [s.to_json() for s in self.steps],
            "replicas": [r.to_json() for r in self.replicas],
            "tiers": {name: t.to_json() for name, t in self.tiers.items()},
            "errors": list(self.errors),
            "whole_view": self.whole_view.to_json(),
        }

    @classmethod
    def from_json(cls, data: object) -> NodeStatus:
        """Read a status JSON object; keys missing get their defaults, tiers of an
        unknown name are left out (a daemon from before ``tiers`` had ``peer`` and
        ``gcs`` at the top: read there too).

        Raises:
            StatusFormatError: ``data`` (or one of its parts) is not a JSON object.
        """
        d = obj(data, "the status")
        usage, job, fs = d.get("usage"), d.get("job"), d.get("filesystem")
        tiers: dict[str, TierStatus] = {}
        for name, tier in obj(d.get("tiers") or {}, "tiers").items():
            kind = _TIER_TYPES.get(name)
            if kind is not None and isinstance(tier, Mapping):
                tiers[name] = kind.from_json(tier)
        for name, kind in _TIER_TYPES.items():  # a daemon from before ``tiers``
            legacy = d.get(name)
            if name not in tiers and isinstance(legacy, Mapping) and legacy:
                tiers[name] = kind.from_json(legacy)
        return cls(
            mountpoint=d.get("mountpoint"),
            ram_dir=d.get("ram_dir"),
            pid=d.get("pid"),
            uptime_seconds=d.get("uptime_seconds", 0.0),
            budget=BudgetStatus.from_json(obj(d.get("budget") or {}, "budget")),
            usage=UsageStatus.from_json(usage) if isinstance(usage, Mapping) and usage else None,
            filesystem=FilesystemStatus.from_json(fs) if isinstance(fs, Mapping) else None,
            passthrough=bool(d.get("passthrough", False)),
            mode=d.get("mode"),
            job=JobStatus.from_json(job) if isinstance(job, Mapping) and job else None,
            restore=RestoreStatus.from_json(obj(d.get("restore") or {}, "restore")),
            steps=tuple(StepStatus.from_json(s) for s in objs(d.get("steps"))),
            replicas=tuple(ReplicaStatus.from_json(r) for r in objs(d.get("replicas"))),
            tiers=tiers,
            errors=strs(d.get("errors")),
            whole_view=WholeViewStatus.from_json(obj(d.get("whole_view") or {}, "whole_view")),
        )
