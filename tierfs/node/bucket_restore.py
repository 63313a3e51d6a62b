"""Restoring with the bucket: :class:`GcsCluster` wraps the node's cluster.

DESIGN.md "Durable plane", PROTOCOL.md section 4. With a coordinator
(multi-node job, peer plane) the inner cluster decides over every node's RAM
and the bucket; without one the node decides alone with the same rule
(:func:`tierfs.cluster.restore_choice.choose_restore`) over its own shards
and the bucket's rounds, bringing parts with the GCS tier's
:meth:`~tierfs.backup.tier.GcsTier.fetch_backup`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import trio

from tierfs.backup.tier import BackupCopyError, GcsTier
from tierfs.cluster.restore_choice import choose_restore, needs_deeper_read
from tierfs.core import settings
from tierfs.core.types import BucketView, CopyId, Holding, RestorePlan

if TYPE_CHECKING:
    from tierfs.core.control import JobSpec
    from tierfs.node.agent import NodeAgent


class GcsCluster:
    """Wraps the agent's cluster with the bucket (see the module docstring).

    With a coordinator (multi-node job, peer plane) the inner cluster does
    everything -- the coordinator reads the bucket and ``restore.version``
    itself, so every node restores the same step behind the same barrier --
    and this wrapper only records the restore. Without one (one node, or a
    multi-node job without a peer plane) the node decides alone with the same
    rule (:func:`tierfs.cluster.restore_choice.choose_restore` over its own shards and
    the bucket's parts of its rank).

    Args:
        inner: the cluster it wraps (:class:`tierfs.node.agent.LocalCluster` or the
            peer cluster).
        tier: the node's GCS tier.
    """

    def __init__(self, inner: Any, tier: GcsTier) -> None:
        self.inner = inner
        self.tier = tier
        self._used_inner = False

    async def plan_restore(self, agent: NodeAgent, job: JobSpec) -> RestorePlan:
        """The coordinator's decision (multi-node), else this node's own (see the class)."""
        tier = self.tier
        self._used_inner = tier.multi(job)
        if self._used_inner:
            plan = await self.inner.plan_restore(agent, job)
        else:
            plan = await self._plan_alone(agent, job)
        tier.note_restored(job, plan, plan.detail.get("forced"))
        return plan

    async def _plan_alone(self, agent: NodeAgent, job: JobSpec) -> RestorePlan:
        """Newest step of this node's rank among its own shards and the bucket's rounds
        complete for every node; a bad copy is excluded and the choice made again."""
        tier = self.tier
        own = {s.key.step: s for s in agent.own_shards(job)}
        holdings = [
            Holding(
                0,
                step,
                True,
                s.manifest.digest,
                s.bytes,
                s.manifest.name,
                created=s.manifest.created,
            )
            for step, s in own.items()
        ]
        bad: set[CopyId] = set()
        notes: list[str] = []
        depth = 1
        view = await self._read(job, depth)
        for _ in range(64):
            choice = choose_restore(1, {0: holdings}, bad, view, notes)
            if needs_deeper_read(choice, view, 1):
                depth = view.depth + 2
                view = await self._read(job, depth)
                continue
            detail = {
                "reason": choice.reason,
                "outcome": choice.outcome,
                "problems": list(choice.problems),
                "forced": choice.forced,
            }
            if choice.step is None:
                return RestorePlan(None, source="none", detail=detail)
            step = choice.step
            shard = own.get(step)
            if choice.holders.get(0) and shard is not None:
                if await agent.verify_shard(shard):
                    return RestorePlan(
                        step,
                        backup=choice.forced,
                        shard=shard,
                        source="gcs" if choice.forced else "local",
                        detail=detail,
                    )
                bad.add((0, 0, step))
                notes.append(f"the local copy of step {step} failed verification")
            for rnd in choice.rounds.get(0, ()):
                try:
                    got = await tier.fetch_backup(agent, job, step, rnd, choice.digests.get(0, ""))
                except BackupCopyError as exc:
                    tier._fail(f"restore: {exc}")
                    notes.append(str(exc))
                    bad.add((rnd, 0, step))
                    continue
                return RestorePlan(step, backup=rnd, shard=got, source="gcs", detail=detail)
            bad |= {(h, 0, step) for h in choice.holders.get(0, ())}
        reason = "no step could be restored: " + "; ".join(notes[-3:])
        return RestorePlan(
            None,
            source="none",
            detail={"reason": reason, "outcome": "incomplete", "problems": [reason]},
        )

    async def _read(self, job: JobSpec, depth: int) -> BucketView:
        """The bucket's parts of this node's rank, as rank 0, from rounds complete for
        every node of the job (worker thread)."""
        tier = self.tier
        view = await trio.to_thread.run_sync(
            functools.partial(
                tier.read_bucket,
                job.name,
                job.nodes,
                depth,
                deadline=settings.GCS_LOOKUP_DEADLINE.get(),
                report=tier._fail_later,
            ),
            abandon_on_cancel=True,
        )
        while tier._pending_errors:
            tier.reporter.error(tier._pending_errors.popleft())
        if job.nodes <= 1:
            return view
        # another rank's parts only tell whether the round is complete for every node
        everyone = set(range(job.nodes))
        ranks: dict[tuple[str, int], set[int]] = {}
        for p in view.parts:
            ranks.setdefault((p.round, p.step), set()).add(p.rank)
        mine = tuple(
            dataclasses.replace(p, rank=0)
            for p in view.parts
            if p.rank == job.node_rank and ranks[(p.round, p.step)] >= everyone
        )
        return dataclasses.replace(view, parts=mine)

    async def restore_done(self, agent: NodeAgent, job: JobSpec, plan: RestorePlan) -> None:
        """The inner cluster's barrier when it planned; nothing when this node decided."""
        if self._used_inner:
            await self.inner.restore_done(agent, job, plan)
