"""The backup plane's status: backup rounds to the bucket and this node's uploads
(:class:`BackupStatus`, the ``gcs`` tier of a node's status)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tierfs.core.status.coding import JsonObject, objs, strs

__all__ = ["BackupRoundStatus", "BackupStatus", "BackupStepStatus", "UploadStatus"]


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
        where = strs(data.get("where"))
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
            uploads=tuple(UploadStatus.from_json(u) for u in objs(data.get("uploads"))),
            rounds=tuple(BackupRoundStatus.from_json(r) for r in objs(data.get("rounds"))),
            last_error=data.get("last_error"),
            retrying=data.get("retrying"),
            problem=data.get("problem"),
            stalled_seconds=data.get("stalled_seconds", 0.0),
            bucket_checked=bool(data.get("bucket_checked", True)),
            note=data.get("note"),
            restore_version_pending=list(pending) if isinstance(pending, list) else None,
            steps=tuple(BackupStepStatus.from_json(s) for s in objs(data.get("steps"))),
        )
