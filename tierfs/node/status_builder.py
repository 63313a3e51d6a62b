"""The node's status: ``tierfs status``, ``.tierfs/status.json`` and the metrics.

:class:`StatusBuilder` assembles a :class:`tierfs.core.status.NodeStatus`
from the agent's parts and the tiers' own status (read-only; trio thread):
steps being written, sealed and held by the tiers, the peers' replicas held
here, the budget, the ram-dir's usage by area and the filesystem under it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from tierfs.core.config import NodeConfig
from tierfs.core.control import JobSpec
from tierfs.core.status import (
    BudgetStatus,
    FilesystemStatus,
    JobStatus,
    NodeStatus,
    ReplicaStatus,
    RestoreStatus,
    StepStatus,
    TierStatus,
    UsageStatus,
)
from tierfs.core.status.whole import WholeViewStatus
from tierfs.node.catalog import ShardCatalog
from tierfs.node.jobstate import JobState
from tierfs.node.steps import StepBook
from tierfs.store.ramstore import Budget, RamStore
from tierfs.store.shards import Shard
from tierfs.store.verdicts import step_loads

__all__ = ["StatusBuilder", "StatusTier", "filesystem_status"]


class StatusTier(Protocol):
    """A tier as the status sees it: its name and its status."""

    name: str

    def status(self) -> TierStatus: ...


def filesystem_status(path: str) -> FilesystemStatus | None:
    """Size and free space (bytes) of the filesystem holding ``path`` (statvfs), which
    other programs may share: not tierfs's usage (that is the status's ``usage``).
    None when ``path`` cannot be statted."""
    try:
        vfs = os.statvfs(path)
    except OSError:
        return None
    return FilesystemStatus(
        total_bytes=vfs.f_blocks * vfs.f_frsize,
        free_bytes=vfs.f_bavail * vfs.f_frsize,
        used_bytes=(vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize,
    )


class StatusBuilder:
    """Builds the node's status from the agent's parts (read-only).

    Args:
        config: the node configuration (mountpoint, configured size).
        store: the RAM store (root, last usage count).
        budget: the RAM budget.
        state: the running job, mode and restore state.
        book: the steps in the view (names, candidates, withdrawn seals, namespace).
        catalog: the held shards (own steps and replicas).
        tiers: the tiers, whose status is shown under their name.
        errors: the last problem lines.
        whole_view: the status of other ranks' files in the view (issue #14).
    """

    def __init__(
        self,
        config: NodeConfig,
        store: RamStore,
        budget: Budget,
        state: JobState,
        book: StepBook,
        catalog: ShardCatalog,
        tiers: Sequence[StatusTier],
        errors: collections.deque[str],
        whole_view: Callable[[], WholeViewStatus] | None = None,
    ) -> None:
        self.whole_view = whole_view
        self.config = config
        self.store = store
        self.budget = budget
        self.state = state
        self.book = book
        self.catalog = catalog
        self.tiers = tiers
        self.errors = errors

    def status(self, started: float) -> NodeStatus:
        """The node's status; ``started``: Unix time (seconds) the agent was made."""
        job = self.state.job
        book = self.book
        steps = self._own_steps(job)
        tiers = {t.name: t.status() for t in self.tiers}
        for tier in tiers.values():
            for s in tier.steps:
                entry = steps.get(s.step)
                if entry is not None:
                    steps[s.step] = dataclasses.replace(
                        entry,
                        where=tuple(sorted(set(entry.where) | set(s.where))),
                        state=s.state or entry.state,
                    )
        replicas = tuple(
            ReplicaStatus(k.job, k.rank, k.step, s.bytes)
            for k, s in sorted(self.catalog.items())
            if job is None or k.rank != job.node_rank or k.job != job.name
        )
        restore = RestoreStatus(dict(self.state.restore_state))
        return NodeStatus(
            mountpoint=os.path.abspath(self.config.mountpoint),
            ram_dir=self.store.root,
            pid=os.getpid(),
            uptime_seconds=round(time.time() - started, 1),
            budget=BudgetStatus(
                mode=self.budget.mode,
                total_bytes=self.budget.size,
                used_bytes=self.budget.used(),
                free_bytes=self.budget.free(),
                size_bytes=self.config.size,
            ),
            usage=self.usage_status(job),
            filesystem=filesystem_status(self.store.root),
            passthrough=bool(book.ns and book.ns.passthrough),
            mode=self.state.mode,
            job=(
                JobStatus(job.name, job.framework, job.node_rank, job.nodes, restore.state)
                if job
                else None
            ),
            restore=restore,
            steps=tuple(steps[s] for s in sorted(steps, reverse=True)),
            replicas=replicas,
            tiers=tiers,
            errors=tuple(self.errors),
            whole_view=self.whole_view() if self.whole_view is not None else WholeViewStatus(),
        )

    def _own_steps(self, job: JobSpec | None) -> dict[int, StepStatus]:
        """This node's steps of ``job`` by number: being written or sealed here."""
        book = self.book
        steps: dict[int, StepStatus] = {}
        names = {k: n for n, k in book.view_steps.items()}
        if job is not None:
            for cand in book.pending.values():
                steps[cand.step] = StepStatus(cand.step, cand.name, "writing")
            for name, key in book.withdrawn_names.items():
                # a write withdrew the seal; the step seals again when the writer closes
                if key.job == job.name and key.rank == job.node_rank:
                    steps.setdefault(key.step, StepStatus(key.step, name, "writing"))
            for shard in self.catalog.own_shards(job):
                steps[shard.key.step] = StepStatus(
                    step=shard.key.step,
                    name=names.get(shard.key, shard.manifest.name),
                    state="verified" if shard.verified else "sealed",
                    bytes=shard.bytes,
                    where=("local",),
                    files=sum(1 for f in shard.manifest.files if f.kind == "file"),
                    backup_requested=shard.manifest.backup_requested,
                    visible=shard.key in names,
                    loads=self._loads(shard, job),
                )
        return steps

    def _loads(self, shard: Shard, job: JobSpec) -> str | None:
        """The ``loads`` words of an own step: judged across ranks where this node did."""
        writers = shard.manifest.nodes or job.nodes  # the count that wrote it (issue #16)
        return step_loads(
            shard.manifest.verdict,
            self.catalog.whole_verdict(shard.key),
            writers,
            self.catalog.unjudged(shard.key),
        )

    def usage_status(self, job: JobSpec | None) -> UsageStatus | None:
        """The last count of the ram-dir by area (bytes), or None before the first.

        ``snapshot_bytes``: this node's sealed steps beyond what the view
        shares with them; ``replica_bytes``: the peers' steps held here.
        """
        u = self.store.last_usage
        if u is None:
            return None
        own = sum(
            n
            for (j, rank), n in u.shards.items()
            if job is None or (j == job.name and rank == str(job.node_rank))
        )
        return UsageStatus(
            total_bytes=u.total,
            view_bytes=u.view,
            snapshot_bytes=own,
            replica_bytes=sum(u.shards.values()) - own,
            other_bytes=u.other,
            counted_at=round(u.counted_at, 3),
            age_seconds=round(max(0.0, time.time() - u.counted_at), 1),
        )

    def status_json(self, started: float) -> bytes:
        """``.tierfs/status.json``: the status as JSON (the contract readers rely on)."""
        status = self.status(started).to_json()
        return (json.dumps(status, indent=2, sort_keys=True, default=str) + "\n").encode()
