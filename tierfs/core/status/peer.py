"""The peer plane's status: replication of this node's steps, the other nodes, the sync
round (:class:`PeerStatus`, the ``peer`` tier of a node's status)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tierfs.core.status.cluster import CoordinatorStatus
from tierfs.core.status.coding import JsonObject, obj, objs, strs, with_optional

__all__ = ["PeerMemberStatus", "PeerStatus", "PeerStepStatus", "SyncStatus"]


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
            where=strs(data.get("where")),
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
        return with_optional(
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
    #: node ranks the coordinator declared gone for good (issue #16)
    gone: tuple[int, ...] = ()
    peers: tuple[PeerMemberStatus, ...] = ()
    steps: tuple[PeerStepStatus, ...] = ()
    sync: SyncStatus = field(default_factory=SyncStatus)
    #: byte and call counters of the peer plane (name -> count; bytes for ``*_bytes``)
    wire: Mapping[str, int] = field(default_factory=dict)
    #: the shard keys pinned for transfers, as text
    pinned: tuple[str, ...] = ()
    last_error: str | None = None
    #: the coordinator's own status, on the node that serves it
    coordinator_state: CoordinatorStatus | None = None

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
        if self.gone:  # issue #16; absent when no rank is gone (older daemons wrote none)
            out["gone"] = list(self.gone)
        if self.coordinator_state is not None:
            out["coordinator_state"] = self.coordinator_state.to_json()
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
            gone=tuple(int(g) for g in data.get("gone") or ()),
            peers=tuple(PeerMemberStatus.from_json(p) for p in objs(data.get("peers"))),
            steps=tuple(PeerStepStatus.from_json(s) for s in objs(data.get("steps"))),
            sync=SyncStatus.from_json(obj(data.get("sync") or {}, "sync")),
            wire=dict(data.get("wire") or {}),
            pinned=strs(data.get("pinned")),
            last_error=data.get("last_error"),
            coordinator_state=(
                CoordinatorStatus.from_json(coord) if isinstance(coord, Mapping) else None
            ),
        )
