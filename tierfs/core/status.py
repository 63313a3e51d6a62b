"""A node's status as typed data (``tierfs status``, ``.tierfs/status.json``, metrics).

The agent assembles a :class:`NodeStatus` from the parts its tiers build
(:class:`PeerStatus` from the peer plane, :class:`BackupStatus` from the GCS
plane); the JSON is made from it at the one place it is written or served
(:meth:`NodeStatus.to_json`). That JSON is a contract: the CLI (``tierfs
status``/``wait``), the CSI node driver, the demo, the metrics exporter and
tests read it, and scripts may too. ``to_json`` keeps exactly its keys,
values and nesting; :meth:`NodeStatus.from_json` reads it back for the
readers, leniently: a key missing (a daemon of another version, a partial
status in a test) becomes its default, never an error.

Units: sizes are bytes (``*_bytes``, ``bytes``), durations seconds
(``*_seconds``, ``seconds``), points in time Unix time in seconds (``at``,
``since``, ``started``, ``counted_at``, ``waiting_until``).

The restore state and the backup rounds' records are mappings their owners
update with free-form keys (a phase, the round joined, the nodes missing...):
:class:`RestoreStatus` and :class:`BackupRoundStatus` keep every key as it
is and give the ones readers use as typed properties.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tierfs.core.errors import ProtocolError

__all__ = [
    "BackupRoundStatus",
    "BackupStatus",
    "BackupStepStatus",
    "BudgetStatus",
    "FilesystemStatus",
    "JobStatus",
    "NodeStatus",
    "PeerMemberStatus",
    "PeerStatus",
    "PeerStepStatus",
    "ReplicaStatus",
    "RestoreStatus",
    "StatusFormatError",
    "StepStatus",
    "SyncStatus",
    "TierStatus",
    "UploadStatus",
    "UsageStatus",
]

#: a JSON object as ``json.loads`` returns it
JsonObject = dict[str, Any]


class StatusFormatError(ProtocolError, ValueError):
    """A status (or a part of it) that is not a JSON object (a ``ValueError``, as a
    JSON decoding error is: readers catch both in one ``except ValueError``)."""


def _obj(data: object, what: str) -> Mapping[str, Any]:
    """``data`` as a JSON object; raises :class:`StatusFormatError` if it is none."""
    if not isinstance(data, Mapping):
        raise StatusFormatError(f"{what} is not a JSON object: {type(data).__name__}")
    return data


def _objs(data: object) -> list[Mapping[str, Any]]:
    """The JSON objects of a list (anything else in it, or a non-list, is dropped)."""
    if not isinstance(data, list | tuple):
        return []
    return [d for d in data if isinstance(d, Mapping)]


def _strs(data: object) -> tuple[str, ...]:
    return tuple(str(x) for x in data) if isinstance(data, list | tuple) else ()


def _with(out: JsonObject, **optional: Any) -> JsonObject:
    """``out`` plus the ``optional`` keys whose value is not None (keys today's JSON
    has only in some states)."""
    out.update({k: v for k, v in optional.items() if v is not None})
    return out


# ---------------------------------------------------------------------- node parts


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
        return _strs(self.fields.get("problems"))

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

    def to_json(self) -> JsonObject:
        out: JsonObject = {
            "step": self.step,
            "name": self.name,
            "state": self.state,
            "bytes": self.bytes,
            "where": list(self.where),
        }
        return _with(
            out, files=self.files, backup_requested=self.backup_requested, visible=self.visible
        )

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StepStatus:
        return cls(
            step=data.get("step", 0),
            name=str(data.get("name", "")),
            state=data.get("state"),
            bytes=data.get("bytes", 0),
            where=_strs(data.get("where")),
            files=data.get("files"),
            backup_requested=data.get("backup_requested"),
            visible=data.get("visible"),
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


# ---------------------------------------------------------------------- peer plane


@dataclass(frozen=True, slots=True)
class PeerStepStatus:
    """The replication of one of this node's steps to its replica peers."""

    step: int
    #: ``peer:<rank>`` for each peer that holds the step
    where: tuple[str, ...]
    #: ``replicated``, ``replicating`` or ``replication failed``
    state: str | None
    #: str(peer rank) -> that send's state (None: not started)
    peers: Mapping[str, str | None] = field(default_factory=dict)
    #: str(peer rank) -> {"seconds": transfer seconds, "bytes": data bytes sent}
    transfers: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def to_json(self) -> JsonObject:
        return {
            "step": self.step,
            "where": list(self.where),
            "state": self.state,
            "peers": dict(self.peers),
            "transfers": {p: dict(t) for p, t in self.transfers.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PeerStepStatus:
        return cls(
            step=data.get("step", 0),
            where=_strs(data.get("where")),
            state=data.get("state"),
            peers=dict(data.get("peers") or {}),
            transfers={str(p): dict(t) for p, t in (data.get("transfers") or {}).items()},
        )


@dataclass(frozen=True, slots=True)
class PeerMemberStatus:
    """Another node as the coordinator last described it."""

    rank: int
    #: ``host:port`` of its peer server
    address: str
    #: the coordinator heard from it lately
    live: bool
    #: this node replicates its steps to it
    target: bool

    def to_json(self) -> JsonObject:
        return {
            "rank": self.rank,
            "address": self.address,
            "live": self.live,
            "target": self.target,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PeerMemberStatus:
        return cls(
            rank=data.get("rank", 0),
            address=str(data.get("address", "")),
            live=bool(data.get("live", False)),
            target=bool(data.get("target", False)),
        )


@dataclass(frozen=True, slots=True)
class SyncStatus:
    """The last sync round the coordinator answered."""

    #: the newest step every node holds replicated, None before one
    step: int | None = None
    #: Unix time the coordinator synced it, None before
    at: float | None = None
    #: the steps of the round (empty from a coordinator answering compact)
    steps: tuple[int, ...] = ()
    #: how many nodes reported in the round (absent before the first answer)
    reported: int | None = None

    def to_json(self) -> JsonObject:
        return _with(
            {"step": self.step, "at": self.at, "steps": list(self.steps)}, reported=self.reported
        )

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SyncStatus:
        steps = data.get("steps")
        return cls(
            step=data.get("step"),
            at=data.get("at"),
            steps=tuple(steps) if isinstance(steps, list | tuple) else (),
            reported=data.get("reported"),
        )


@dataclass(frozen=True, slots=True)
class PeerStatus:
    """The peer tier (replication to other nodes, the coordinator)."""

    #: one line for ``tierfs status``
    summary: str
    #: ``host:port`` other nodes reach this node's server at, None without a server
    address: str | None = None
    #: the ``--listen`` address
    listen: str | None = None
    port: int | None = None
    #: ``host:port`` of the coordinator, None while not known
    coordinator: str | None = None
    #: how the coordinator is found: static, bucket or none
    rendezvous: str = ""
    rendezvous_note: str | None = None
    publish_note: str | None = None
    #: this node serves as the coordinator
    is_coordinator: bool = False
    #: this daemon's incarnation id
    incarnation: str = ""
    #: a multi-node job runs
    active: bool = False
    #: the node ranks this node replicates to
    replicate_to: tuple[int, ...] = ()
    peers: tuple[PeerMemberStatus, ...] = ()
    steps: tuple[PeerStepStatus, ...] = ()
    sync: SyncStatus = field(default_factory=SyncStatus)
    #: byte and call counters of the peer plane (name -> count; bytes for ``*_bytes``)
    wire: Mapping[str, int] = field(default_factory=dict)
    #: the shard keys pinned for transfers, as text
    pinned: tuple[str, ...] = ()
    last_error: str | None = None
    #: the coordinator's own status (plain data), on the node that serves it
    coordinator_state: Mapping[str, Any] | None = None

    def to_json(self) -> JsonObject:
        out: JsonObject = {
            "summary": self.summary,
            "address": self.address,
            "listen": self.listen,
            "port": self.port,
            "coordinator": self.coordinator,
            "rendezvous": self.rendezvous,
            "rendezvous_note": self.rendezvous_note,
            "publish_note": self.publish_note,
            "is_coordinator": self.is_coordinator,
            "incarnation": self.incarnation,
            "active": self.active,
            "replicate_to": list(self.replicate_to),
            "peers": [p.to_json() for p in self.peers],
            "steps": [s.to_json() for s in self.steps],
            "sync": self.sync.to_json(),
            "wire": dict(self.wire),
            "pinned": list(self.pinned),
            "last_error": self.last_error,
        }
        if self.coordinator_state is not None:
            out["coordinator_state"] = self.coordinator_state
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PeerStatus:
        coord = data.get("coordinator_state")
        return cls(
            summary=str(data.get("summary", "")),
            address=data.get("address"),
            listen=data.get("listen"),
            port=data.get("port"),
            coordinator=data.get("coordinator"),
            rendezvous=str(data.get("rendezvous", "")),
            rendezvous_note=data.get("rendezvous_note"),
            publish_note=data.get("publish_note"),
            is_coordinator=bool(data.get("is_coordinator", False)),
            incarnation=str(data.get("incarnation", "")),
            active=bool(data.get("active", False)),
            replicate_to=tuple(data.get("replicate_to") or ()),
            peers=tuple(PeerMemberStatus.from_json(p) for p in _objs(data.get("peers"))),
            steps=tuple(PeerStepStatus.from_json(s) for s in _objs(data.get("steps"))),
            sync=SyncStatus.from_json(_obj(data.get("sync") or {}, "sync")),
            wire=dict(data.get("wire") or {}),
            pinned=_strs(data.get("pinned")),
            last_error=data.get("last_error"),
            coordinator_state=dict(coord) if isinstance(coord, Mapping) else None,
        )


# ---------------------------------------------------------------------- backup plane


@dataclass(frozen=True, slots=True)
class UploadStatus:
    """An upload of this node's part of a backup round."""

    round: str
    step: int
    #: bytes uploaded so far
    bytes_done: int
    #: bytes of the shard
    bytes_total: int
    #: seconds since the upload started, rounded to 0.1 s
    seconds: float
    #: 1 for the first try, +1 per retry
    attempt: int
    #: Unix time of the next attempt while the upload waits for the bucket, else None
    waiting_until: float | None = None

    def to_json(self) -> JsonObject:
        return {
            "round": self.round,
            "step": self.step,
            "bytes_done": self.bytes_done,
            "bytes_total": self.bytes_total,
            "seconds": self.seconds,
            "attempt": self.attempt,
            "waiting_until": self.waiting_until,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> UploadStatus:
        return cls(
            round=str(data.get("round", "")),
            step=data.get("step", 0),
            bytes_done=data.get("bytes_done", 0),
            bytes_total=data.get("bytes_total", 0),
            seconds=data.get("seconds", 0.0),
            attempt=data.get("attempt", 1),
            waiting_until=data.get("waiting_until"),
        )


@dataclass(frozen=True, slots=True)
class BackupRoundStatus:
    """A backup round this node took part in, every key kept as the GCS tier recorded
    it: ``round``, ``step``, ``state`` (running, complete, incomplete...),
    ``started`` (Unix time), ``reason``; after this node's part ended ``node``
    (its part's state), ``seconds`` and ``bytes``."""

    fields: Mapping[str, Any]

    @property
    def round(self) -> str | None:
        return self.fields.get("round")

    @property
    def step(self) -> int | None:
        return self.fields.get("step")

    @property
    def state(self) -> str | None:
        return self.fields.get("state")

    def to_json(self) -> JsonObject:
        return dict(self.fields)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BackupRoundStatus:
        return cls(dict(data))


@dataclass(frozen=True, slots=True)
class BackupStepStatus:
    """A step of this node backed up: the newest round holding it."""

    step: int
    round: str

    @property
    def where(self) -> tuple[str, ...]:
        return (f"gcs:{self.round}",)

    @property
    def state(self) -> str | None:
        """A backup names no step state (the agent keeps the other tiers' word)."""
        return None

    def to_json(self) -> JsonObject:
        return {"step": self.step, "where": list(self.where)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BackupStepStatus:
        where = _strs(data.get("where"))
        rnd = next((w.removeprefix("gcs:") for w in where if w.startswith("gcs:")), "")
        return cls(step=data.get("step", 0), round=rnd)


@dataclass(frozen=True, slots=True)
class BackupStatus:
    """The GCS tier (backup rounds to the bucket). Off (no ``--bucket``), only
    ``summary``, ``enabled`` and ``steps`` are in the JSON."""

    #: one line for ``tierfs status``
    summary: str
    enabled: bool = True
    #: ``gs://bucket/prefix/``
    bucket: str | None = None
    #: ``decides rounds`` or ``follows node-rank 0's rounds``, None without a job
    role: str | None = None
    #: the job's backup interval in minutes / steps (None: not by that measure)
    interval_minutes: float | None = None
    interval_steps: int | None = None
    #: the round running now, if any
    active_round: str | None = None
    last_round: str | None = None
    last_step: int | None = None
    last_state: str | None = None
    uploads: tuple[UploadStatus, ...] = ()
    #: the last rounds (at most 10), oldest first
    rounds: tuple[BackupRoundStatus, ...] = ()
    last_error: str | None = None
    #: the last failure while it is retried (one line with the time), else None
    retrying: str | None = None
    #: the bucket's current problem (one line), else None
    problem: str | None = None
    #: seconds requests have waited without any answer (0.0: the bucket answers)
    stalled_seconds: float = 0.0
    #: the bucket was reached since the daemon started
    bucket_checked: bool = True
    note: str | None = None
    #: ``restore.version`` being honoured: [job, round, step, Unix time], else None
    restore_version_pending: list[Any] | None = None
    steps: tuple[BackupStepStatus, ...] = ()

    @classmethod
    def off(cls) -> BackupStatus:
        """The status of a node without ``--bucket``."""
        return cls(summary="off (no --bucket)", enabled=False)

    def to_json(self) -> JsonObject:
        steps = [s.to_json() for s in self.steps]
        if not self.enabled:
            return {"summary": self.summary, "enabled": False, "steps": steps}
        return {
            "summary": self.summary,
            "enabled": True,
            "bucket": self.bucket,
            "role": self.role,
            "interval_minutes": self.interval_minutes,
            "interval_steps": self.interval_steps,
            "active_round": self.active_round,
            "last_round": self.last_round,
            "last_step": self.last_step,
            "last_state": self.last_state,
            "uploads": [u.to_json() for u in self.uploads],
            "rounds": [r.to_json() for r in self.rounds],
            "last_error": self.last_error,
            "retrying": self.retrying,
            "problem": self.problem,
            "stalled_seconds": self.stalled_seconds,
            "bucket_checked": self.bucket_checked,
            "note": self.note,
            "restore_version_pending": (
                None if self.restore_version_pending is None else list(self.restore_version_pending)
            ),
            "steps": steps,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BackupStatus:
        pending = data.get("restore_version_pending")
        return cls(
            summary=str(data.get("summary", "")),
            enabled=bool(data.get("enabled", True)),
            bucket=data.get("bucket"),
            role=data.get("role"),
            interval_minutes=data.get("interval_minutes"),
            interval_steps=data.get("interval_steps"),
            active_round=data.get("active_round"),
            last_round=data.get("last_round"),
            last_step=data.get("last_step"),
            last_state=data.get("last_state"),
            uploads=tuple(UploadStatus.from_json(u) for u in _objs(data.get("uploads"))),
            rounds=tuple(BackupRoundStatus.from_json(r) for r in _objs(data.get("rounds"))),
            last_error=data.get("last_error"),
            retrying=data.get("retrying"),
            problem=data.get("problem"),
            stalled_seconds=data.get("stalled_seconds", 0.0),
            bucket_checked=bool(data.get("bucket_checked", True)),
            note=data.get("note"),
            restore_version_pending=list(pending) if isinstance(pending, list) else None,
            steps=tuple(BackupStepStatus.from_json(s) for s in _objs(data.get("steps"))),
        )


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
        }

    @classmethod
    def from_json(cls, data: object) -> NodeStatus:
        """Read a status JSON object; keys missing get their defaults, tiers of an
        unknown name are left out (a daemon from before ``tiers`` had ``peer`` and
        ``gcs`` at the top: read there too).

        Raises:
            StatusFormatError: ``data`` (or one of its parts) is not a JSON object.
        """
        d = _obj(data, "the status")
        usage, job, fs = d.get("usage"), d.get("job"), d.get("filesystem")
        tiers: dict[str, TierStatus] = {}
        for name, tier in _obj(d.get("tiers") or {}, "tiers").items():
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
            budget=BudgetStatus.from_json(_obj(d.get("budget") or {}, "budget")),
            usage=UsageStatus.from_json(usage) if isinstance(usage, Mapping) and usage else None,
            filesystem=FilesystemStatus.from_json(fs) if isinstance(fs, Mapping) else None,
            passthrough=bool(d.get("passthrough", False)),
            mode=d.get("mode"),
            job=JobStatus.from_json(job) if isinstance(job, Mapping) and job else None,
            restore=RestoreStatus.from_json(_obj(d.get("restore") or {}, "restore")),
            steps=tuple(StepStatus.from_json(s) for s in _objs(d.get("steps"))),
            replicas=tuple(ReplicaStatus.from_json(r) for r in _objs(d.get("replicas"))),
            tiers=tiers,
            errors=_strs(d.get("errors")),
        )
