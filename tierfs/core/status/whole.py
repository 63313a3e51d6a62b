"""The whole-step view in a node's status (issue #14): other ranks' files of each step.

Written by :meth:`tierfs.node.remote_view.RemoteView.status`; read by ``tierfs
status`` and ``tierfs wait --bytes``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tierfs.core.status.coding import JsonObject, objs

__all__ = ["WholeStepStatus", "WholeViewStatus"]


@dataclass(frozen=True, slots=True)
class WholeStepStatus:
    """Other ranks' files of one step in this node's view."""

    step: int
    #: ranks whose part's files are in the view (ascending)
    ranks_known: tuple[int, ...] = ()
    #: ranks of the job whose part is not known here yet (ascending)
    ranks_missing: tuple[int, ...] = ()
    #: files whose bytes are here (a replica held here, or fetched)
    local: int = 0
    #: files whose bytes are fetched on first read
    remote: int = 0
    #: files being fetched now
    fetching: int = 0
    #: bytes still to fetch
    bytes_remote: int = 0
    #: paths whose bytes differ between ranks (reported once in replicator.errors)
    conflicts: tuple[str, ...] = ()
    #: paths whose last fetch failed
    failed: tuple[str, ...] = ()
    #: the node count that wrote the step (its writer topology, issue #16; 0 unknown)
    writers: int = 0
    #: this node holds a part of its own of the step
    own_part: bool = True
    #: ranks whose part was placed again here with other bytes (that rank saved the
    #: step again; its changed files were replaced), since this daemon started
    resaved: tuple[int, ...] = ()
    #: ranks whose files are not served (EIO): the part their node shows is of an
    #: earlier save of the step than the other parts (ascending; issue #16)
    refused: tuple[int, ...] = ()

    @property
    def names_ready(self) -> bool:
        """Every rank's files are in the view, and served."""
        return not self.ranks_missing and not self.refused

    @property
    def bytes_ready(self) -> bool:
        """Every rank's files are in the view and their bytes are here."""
        return self.names_ready and self.remote == 0 and self.fetching == 0

    def to_json(self) -> JsonObject:
        return {
            "step": self.step,
            "ranks_known": list(self.ranks_known),
            "ranks_missing": list(self.ranks_missing),
            "local": self.local,
            "remote": self.remote,
            "fetching": self.fetching,
            "bytes_remote": self.bytes_remote,
            "conflicts": list(self.conflicts),
            "failed": list(self.failed),
            # written only when known (a daemon from before issue #16 wrote neither)
            **({"writers": self.writers, "own_part": self.own_part} if self.writers else {}),
            **({"resaved": list(self.resaved)} if self.resaved else {}),
            **({"refused": list(self.refused)} if self.refused else {}),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> WholeStepStatus:
        return cls(
            step=d.get("step", 0),
            ranks_known=tuple(d.get("ranks_known") or ()),
            ranks_missing=tuple(d.get("ranks_missing") or ()),
            local=d.get("local", 0),
            remote=d.get("remote", 0),
            fetching=d.get("fetching", 0),
            bytes_remote=d.get("bytes_remote", 0),
            conflicts=tuple(d.get("conflicts") or ()),
            failed=tuple(d.get("failed") or ()),
            writers=d.get("writers", 0),
            own_part=d.get("own_part", True),
            resaved=tuple(d.get("resaved") or ()),
            refused=tuple(d.get("refused") or ()),
        )


@dataclass(frozen=True, slots=True)
class WholeViewStatus:
    """The whole-step view of one node."""

    #: per step, newest first
    steps: tuple[WholeStepStatus, ...] = ()
    #: bytes fetched since the daemon started, by tier name (``peer``, ``gcs``)
    fetched_bytes: Mapping[str, int] = field(default_factory=dict)
    #: fetches that no copy could serve
    fetch_errors: int = 0
    #: bytes of fetched files dropped since the daemon started (a cache: room for a
    #: fetch, or the reserve for this node's own saves; fetched again on the next open)
    dropped_bytes: int = 0
    #: bytes of fetched files the last drop for room had to keep because a handle or a
    #: memory map held them (a map of a closed descriptor holds the RAM too)
    pinned_bytes: int = 0
    #: the running job's steps show other ranks' files here (multi-node, generic or
    #: ``pytorch.distributed`` mode, with a peer tier)
    active: bool = False

    def step(self, step: int) -> WholeStepStatus | None:
        """The status of ``step``, or None if the view holds no other rank's files of it."""
        return next((s for s in self.steps if s.step == step), None)

    def to_json(self) -> JsonObject:
        return {
            "steps": [s.to_json() for s in self.steps],
            "fetched_bytes": dict(self.fetched_bytes),
            "fetch_errors": self.fetch_errors,
            "dropped_bytes": self.dropped_bytes,
            "pinned_bytes": self.pinned_bytes,
            "active": self.active,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> WholeViewStatus:
        return cls(
            steps=tuple(WholeStepStatus.from_json(s) for s in objs(d.get("steps"))),
            fetched_bytes=dict(d.get("fetched_bytes") or {}),
            fetch_errors=d.get("fetch_errors", 0),
            dropped_bytes=d.get("dropped_bytes", 0),
            pinned_bytes=d.get("pinned_bytes", 0),
            active=bool(d.get("active", False)),
        )
