"""The coordinator's own status (:class:`CoordinatorStatus`): its restore round, the
members, the sync round, the last restore decisions and the backup round book.

The node serving as coordinator carries it in its peer tier's status
(:attr:`tierfs.core.status.PeerStatus.coordinator_state`). The restore decisions
and the book's rounds are records their owners update with free-form keys: they
are kept as mappings, every key as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tierfs.core.status.coding import JsonObject, obj, objs, strs

__all__ = [
    "ActiveBackupStatus",
    "BackupBookStatus",
    "CoordinatorMemberStatus",
    "CoordinatorRoundStatus",
    "CoordinatorStatus",
    "CoordinatorSyncStatus",
]


def _ints(data: object) -> tuple[int, ...]:
    return tuple(int(x) for x in data) if isinstance(data, list | tuple) else ()


def _by_rank(data: object) -> dict[int, Any]:
    """A JSON object keyed by node rank (keys are text in JSON) with int keys; keys
    that are no rank are dropped."""
    if not isinstance(data, Mapping):
        return {}
    return {int(k): v for k, v in data.items() if str(k).lstrip("-").isdigit()}


def _by_count(data: object) -> dict[int, int]:
    """:func:`_by_rank` of whole numbers (other values dropped)."""
    return {r: v for r, v in _by_rank(data).items() if isinstance(v, int)}


def _records(data: object) -> tuple[Mapping[str, Any], ...]:
    return tuple(dict(d) for d in objs(data))


@dataclass(frozen=True, slots=True)
class CoordinatorRoundStatus:
    """The coordinator's restore round (the newest, open or finished)."""

    number: int
    #: the round's state (joining, deciding, ready, done...)
    state: str | None = None
    #: every node of the job must join before a decision
    strict: bool = False
    #: the ranks that joined, sorted
    joined: tuple[int, ...] = ()
    #: the first ranks that have not joined
    missing: tuple[int, ...] = ()
    #: the decision's version (+1 per decision taken again)
    version: int = 0
    #: what the decision waits for (e.g. ``the bucket``), None for nothing
    waiting_for: str | None = None
    #: the step chosen, None for none (or no decision yet)
    step: int | None = None
    reason: str | None = None
    outcome: str | None = None
    problems: tuple[str, ...] = ()
    #: the ranks past the ``ready`` and ``done`` barriers, sorted
    ready: tuple[int, ...] = ()
    done: tuple[int, ...] = ()
    #: the copies found bad: [holder, rank, step] each
    bad: tuple[tuple[Any, ...], ...] = ()
    #: the bucket read (``N round(s) read`` or its error), None before it
    bucket: str | None = None
    #: seconds since the round opened, rounded to 0.1 s
    age_seconds: float = 0.0

    def to_json(self) -> JsonObject:
        return {
            "number": self.number,
            "state": self.state,
            "strict": self.strict,
            "joined": list(self.joined),
            "missing": list(self.missing),
            "version": self.version,
            "waiting_for": self.waiting_for,
            "step": self.step,
            "reason": self.reason,
            "outcome": self.outcome,
            "problems": list(self.problems),
            "ready": list(self.ready),
            "done": list(self.done),
            "bad": [list(b) for b in self.bad],
            "bucket": self.bucket,
            "age_seconds": self.age_seconds,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CoordinatorRoundStatus:
        bad = data.get("bad")
        return cls(
            number=data.get("number", 0),
            state=data.get("state"),
            strict=bool(data.get("strict", False)),
            joined=_ints(data.get("joined")),
            missing=_ints(data.get("missing")),
            version=data.get("version", 0),
            waiting_for=data.get("waiting_for"),
            step=data.get("step"),
            reason=data.get("reason"),
            outcome=data.get("outcome"),
            problems=strs(data.get("problems")),
            ready=_ints(data.get("ready")),
            done=_ints(data.get("done")),
            bad=(
                tuple(tuple(b) for b in bad if isinstance(b, list | tuple))
                if isinstance(bad, list | tuple)
                else ()
            ),
            bucket=data.get("bucket"),
            age_seconds=data.get("age_seconds", 0.0),
        )


@dataclass(frozen=True, slots=True)
class CoordinatorMemberStatus:
    """A node of the job as the coordinator knows it."""

    rank: int
    #: ``host:port`` of its peer server
    address: str
    #: the coordinator heard from it lately
    live: bool
    #: seconds since the coordinator last heard from it, rounded to 0.1 s
    seen_seconds_ago: float
    #: the newest step it reported replicated (-1: none yet)
    replicated_step: int
    #: the shards in its last inventory
    shards: int

    def to_json(self) -> JsonObject:
        return {
            "rank": self.rank,
            "address": self.address,
            "live": self.live,
            "seen_seconds_ago": self.seen_seconds_ago,
            "replicated_step": self.replicated_step,
            "shards": self.shards,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CoordinatorMemberStatus:
        return cls(
            rank=data.get("rank", 0),
            address=str(data.get("address", "")),
            live=bool(data.get("live", False)),
            seen_seconds_ago=data.get("seen_seconds_ago", 0.0),
            replicated_step=data.get("replicated_step", -1),
            shards=data.get("shards", 0),
        )


@dataclass(frozen=True, slots=True)
class CoordinatorSyncStatus:
    """The sync round as the coordinator keeps it."""

    #: the newest step every node holds replicated, None before one
    step: int | None = None
    #: Unix time it was synced, None before
    at: float | None = None
    #: node rank -> the step it last reported
    steps: Mapping[int, int] = field(default_factory=dict)

    def to_json(self) -> JsonObject:
        return {
            "step": self.step,
            "at": self.at,
            "steps": {str(r): s for r, s in sorted(self.steps.items())},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CoordinatorSyncStatus:
        return cls(step=data.get("step"), at=data.get("at"), steps=_by_rank(data.get("steps")))


@dataclass(frozen=True, slots=True)
class ActiveBackupStatus:
    """The backup round the coordinator's book is running."""

    round: str
    step: int
    #: the ranks whose outcome came in, sorted
    reported: tuple[int, ...] = ()
    #: older steps the round was ordered for before it moved
    moved_from: tuple[int, ...] = ()
    #: node rank -> why it cannot upload the step
    lacking: Mapping[int, str] = field(default_factory=dict)
    #: the ranks that point at their column's uploader's data, sorted
    dedup: tuple[int, ...] = ()

    def to_json(self) -> JsonObject:
        return {
            "round": self.round,
            "step": self.step,
            "reported": list(self.reported),
            "moved_from": list(self.moved_from),
            # int keys, as the book keeps them (JSON writes them as text)
            "lacking": dict(self.lacking),
            "dedup": list(self.dedup),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ActiveBackupStatus:
        return cls(
            round=str(data.get("round", "")),
            step=data.get("step", 0),
            reported=_ints(data.get("reported")),
            moved_from=_ints(data.get("moved_from")),
            lacking=_by_rank(data.get("lacking")),
            dedup=_ints(data.get("dedup")),
        )


@dataclass(frozen=True, slots=True)
class BackupBookStatus:
    """The coordinator's backup round book (it decides when rounds run)."""

    #: the book has read the bucket's last round
    seeded: bool = False
    active: ActiveBackupStatus | None = None
    last_round: str | None = None
    last_step: int | None = None
    #: why the last round started or did not (one line, ``""`` before any)
    last_decision: str = ""
    #: the last rounds (``round``, ``step``, ``state``, ``started``, ``reason``, and
    #: once ended ``nodes``: rank -> its part's state), oldest first
    rounds: tuple[Mapping[str, Any], ...] = ()

    def to_json(self) -> JsonObject:
        return {
            "seeded": self.seeded,
            "active": self.active.to_json() if self.active is not None else None,
            "last_round": self.last_round,
            "last_step": self.last_step,
            "last_decision": self.last_decision,
            "rounds": [dict(r) for r in self.rounds],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BackupBookStatus:
        active = data.get("active")
        return cls(
            seeded=bool(data.get("seeded", False)),
            active=ActiveBackupStatus.from_json(active) if isinstance(active, Mapping) else None,
            last_round=data.get("last_round"),
            last_step=data.get("last_step"),
            last_decision=str(data.get("last_decision", "")),
            rounds=_records(data.get("rounds")),
        )


@dataclass(frozen=True, slots=True)
class CoordinatorStatus:
    """The coordinator's status (``coordinator_state`` of the peer tier of the node
    that serves it)."""

    #: the job the coordinator serves, None before a node joined
    job: str | None = None
    nodes: int = 0
    #: the job's membership generation at this coordinator (issue #16: one more per
    #: restart with another node count; 0 before a node joined) and its start (Unix s)
    generation: int = 0
    generation_since: float = 0.0
    #: node ranks declared gone for good in this generation (issue #16)
    gone: tuple[int, ...] = ()
    #: the newest restore round, None before one
    round: CoordinatorRoundStatus | None = None
    #: the nodes by rank
    members: tuple[CoordinatorMemberStatus, ...] = ()
    sync: CoordinatorSyncStatus = field(default_factory=CoordinatorSyncStatus)
    #: the last restore decisions (``round``, ``version``, ``step``, ``reason``,
    #: ``outcome``, ``at``), oldest first
    decisions: tuple[Mapping[str, Any], ...] = ()
    #: the backup round book, None on a node without the GCS tier
    backups: BackupBookStatus | None = None
    #: the synced step whose copies are counted (None: no synced step yet) and, by
    #: rank, how many live members hold a verified copy of its part (issue #16)
    copies_step: int | None = None
    copies: Mapping[int, int] = field(default_factory=dict)

    def to_json(self) -> JsonObject:
        out: JsonObject = {
            "job": self.job,
            "nodes": self.nodes,
            "round": self.round.to_json() if self.round is not None else None,
            "members": [m.to_json() for m in self.members],
            "sync": self.sync.to_json(),
            "decisions": [dict(d) for d in self.decisions],
            "backups": self.backups.to_json() if self.backups is not None else None,
        }
        if self.gone:  # issue #16; absent when no rank is gone
            out["gone"] = list(self.gone)
        if self.generation:  # a daemon from before generations wrote none
            out.update(generation=self.generation, generation_since=self.generation_since)
        if self.copies_step is not None:
            # int keys, as the coordinator counts them (JSON writes them as text)
            out["copies"] = {"step": self.copies_step, "counts": dict(self.copies)}
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CoordinatorStatus:
        rnd, backups, copies = data.get("round"), data.get("backups"), data.get("copies")
        return cls(
            job=data.get("job"),
            nodes=data.get("nodes", 0),
            generation=data.get("generation", 0),
            generation_since=data.get("generation_since", 0.0),
            gone=tuple(int(g) for g in data.get("gone") or ()),
            round=CoordinatorRoundStatus.from_json(rnd) if isinstance(rnd, Mapping) else None,
            members=tuple(CoordinatorMemberStatus.from_json(m) for m in objs(data.get("members"))),
            sync=CoordinatorSyncStatus.from_json(obj(data.get("sync") or {}, "sync")),
            decisions=_records(data.get("decisions")),
            backups=BackupBookStatus.from_json(backups) if isinstance(backups, Mapping) else None,
            copies_step=copies.get("step") if isinstance(copies, Mapping) else None,
            copies=_by_count(copies.get("counts")) if isinstance(copies, Mapping) else {},
        )
