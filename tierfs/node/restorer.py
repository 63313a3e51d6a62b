"""What one node does to restore a job: decide the step, bring its shard (PROTOCOL.md section 4).

:class:`Restorer` is the single place a restore is decided and fetched; the
node's :class:`tierfs.node.restore_driver.RestoreDriver` then writes the
prerestore file, the ``replicator.errors`` lines and the markers. Read top to bottom:

1. **Agreed** (a multi-node job with a peer plane, :meth:`Restorer._agree`):
   verify every copy this node holds, join the coordinator's round, get the
   decision, bring the own shard by trying the sources the decision names in
   order -- :class:`~tierfs.node.sources.LocalSource`, then the
   :class:`~tierfs.node.sources.PeerSource` of each peer holding the same
   bytes, then the :class:`~tierfs.node.sources.BucketSource` of each backup
   round holding them -- skipping a bad or failed copy; if none is usable,
   report the bad copies so the coordinator decides again for every node;
   barrier "ready"; later (:meth:`Restorer.finish`) barrier "done".
2. **Alone** (one node, or no peer plane): with a bucket the same rule as the
   coordinator's (:func:`tierfs.cluster.restore_choice.choose_restore`) over
   the own shards and the bucket's rounds of this node's rank, a bad copy
   excluded and the choice made again (:meth:`Restorer._decide_with_bucket`);
   without one the newest own step whose checksums verify
   (:meth:`Restorer._decide_local`).

Every plan says why (``detail``: reason, outcome, problems): no silent fresh
start. The restorer sees the node only through ports (:mod:`tierfs.core.ports`):
the catalog, a verifier, the reporter, the restore progress, the sources, the
bucket and the agreement; tests/unit/test_restorer.py drives it with fakes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tierfs.cluster.restore_choice import choose_restore, needs_deeper_read
from tierfs.core import control, settings
from tierfs.core.types import (
    FRESH,
    INCOMPLETE,
    OLDER,
    RESTORED,
    BucketView,
    CopyId,
    Holding,
    RestorePlan,
)
from tierfs.node.agreement import RestoreFailed
from tierfs.node.sources import CopyFailed
from tierfs.store.shards import ShardKey, needs_check
from tierfs.store.verdicts import eligibility

if TYPE_CHECKING:
    from tierfs.core.control import JobSpec
    from tierfs.core.ports import (
        Agreement,
        BucketRestore,
        Catalog,
        Decision,
        PeerSources,
        Reporter,
        RestoreProgress,
        RestoreSource,
        Verifier,
    )
    from tierfs.store.shards import Shard

log = logging.getLogger(__name__)

#: how often a node deciding alone chooses again after bad copies before it gives up
MAX_CHOICES = 64

#: a source to try with the copy it stands for (holder, shard rank, step)
Candidate = tuple["CopyId", "RestoreSource"]


@dataclass
class _Round:
    """The coordinated round whose "done" barrier is still ahead."""

    restore_id: str
    round: int
    version: int


def own_rank_view(view: BucketView, job: JobSpec) -> BucketView:
    """The bucket's parts of this node's rank, as rank 0, from rounds complete for every
    node of the job (a node deciding alone decides for its rank only). Pure."""
    if job.nodes <= 1:
        return view
    # another rank's parts only tell whether the round is complete for every node
    everyone = set(range(job.nodes))
    ranks: dict[tuple[str, int], set[int]] = {}
    for p in view.parts:
        ranks.setdefault((p.round, p.step), set()).add(p.rank)
    # (a file this rank's part lacks may be in another rank's part: not held against it)
    mine = tuple(
        dataclasses.replace(p, rank=0, missing="")
        for p in view.parts
        if p.rank == job.node_rank and ranks[(p.round, p.step)] >= everyone
    )
    return dataclasses.replace(view, parts=mine)


class Restorer:
    """Decides what this node restores and brings its shard (see the module docstring).

    Args:
        catalog: the held shards.
        verifier: re-checks a held copy's crc32c (a bad one is reported and dropped).
        reporter: ``replicator.errors``.
        progress: the restore state's ``phase`` (``tierfs status``).
        local: this node's own copy (:class:`tierfs.node.sources.LocalSource`).
        peers: the peer source of (node rank, address), None without a peer plane.
        bucket: the bucket (view, round sources, restore record), None without
            ``--bucket``.
        agreement: the coordinator's round, None when no coordinator can be
            found (no peer plane); used for jobs of more than one node.
    """

    def __init__(
        self,
        *,
        catalog: Catalog,
        verifier: Verifier,
        reporter: Reporter,
        progress: RestoreProgress,
        local: RestoreSource,
        peers: PeerSources | None = None,
        bucket: BucketRestore | None = None,
        agreement: Agreement | None = None,
    ) -> None:
        self.catalog = catalog
        self.verifier = verifier
        self.reporter = reporter
        self.progress = progress
        self.local = local
        self.peers = peers
        self.bucket = bucket
        self.agreement = agreement
        self._open: _Round | None = None

    def _phase(self, text: str, **extra: Any) -> None:
        log.debug("restore phase: %s %s", text, extra)
        self.progress.progress({"phase": text, **extra})

    # ------------------------------------------------------------------ the restore

    def written_by_more(self, job: JobSpec) -> bool:
        """True if this node holds a step of ``job`` written by more nodes than the job
        has now (a job shrunk to one node, issue #16): its restore must find every
        writer's part, not only this node's."""
        return any((s.manifest.nodes or 0) > job.nodes for s in self.catalog.shards_of(job.name))

    def agreed(self, job: JobSpec) -> bool:
        """True if ``job``'s restore is a coordinator round (with an agreement): a
        multi-node job, or one node holding steps written by more nodes (the round
        of one node decides over every part it holds, replicas included)."""
        return job.nodes > 1 or self.written_by_more(job)

    async def plan(self, job: JobSpec) -> RestorePlan:
        """Decide the step and bring this node's shard of it into the catalog.

        With an agreement (multi-node job) it returns once every node has its
        data for the decided step (barrier "ready"). With a bucket the GCS
        tier records the plan (its backup schedule restarts from it).

        Raises:
            tierfs.node.agreement.RestoreFailed: nodes did not join or finish in
                ``--join-timeout`` seconds, or the coordinator refuses this node;
                the reason is in ``replicator.errors``.
        """
        self._open = None
        if self.agreement is not None and self.agreed(job):
            plan = await self._agree(job, self.agreement)
        elif self.bucket is not None:
            plan = await self._decide_with_bucket(job, self.bucket)
        else:
            plan = await self._decide_local(job)
        if self.bucket is not None:
            self.bucket.note_restored(job, plan, plan.detail.get("forced"))
        return plan

    async def finish(self, job: JobSpec, plan: RestorePlan) -> None:
        """Barrier "done" after the prerestore file (agreed restores; nothing else).

        Every node already has its data ("ready" passed in :meth:`plan`), so a
        coordinator lost now only costs a warning: markers are published
        anyway. Releases the retention pin of the fetched shard.
        """
        cur, self._open = self._open, None
        agreement = self.agreement
        try:
            if cur is None or agreement is None:
                return
            try:
                state = await agreement.done(job, cur.restore_id, cur.round, cur.version)
            except RestoreFailed as exc:
                log.warning("restore-done barrier: %s; publishing anyway", exc)
                return
            if state != "passed":
                log.warning("restore-done barrier answered %s; publishing anyway", state)
        finally:
            if (
                agreement is not None
                and plan.shard is not None
                and plan.detail.pop("pinned", False)
            ):
                agreement.pin(plan.shard.key, -1)

    # ------------------------------------------------------------------ agreed

    async def _agree(self, job: JobSpec, agreement: Agreement) -> RestorePlan:
        """Join, decide, fetch, barrier "ready"; decide again after bad copies, join
        again when the coordinator moved."""
        strict = job.framework != control.GENERIC
        restore_id = uuid.uuid4().hex
        notes = await self._verify_held(job)
        while True:
            number = await agreement.join(job, restore_id, strict, notes)
            while True:
                decision = await agreement.decide(job, restore_id, number)
                if decision is None:
                    break  # rejoin
                plan, bad, detail = await self._fetch_decided(job, decision)
                # pinned from now on: retention must not drop the fetched step while
                # the abandoned newer ones (which it ranks above it) are still held
                held = plan.shard.key if plan is not None and plan.shard is not None else None
                if held is not None:
                    agreement.pin(held, +1)
                try:
                    self._phase(
                        "waiting for the other nodes' data",
                        round=number,
                        step=plan.step if plan else None,
                    )
                    state = await agreement.ready(
                        job, restore_id, number, decision.version, plan is not None, bad, detail
                    )
                except BaseException:
                    if held is not None:
                        agreement.pin(held, -1)
                    raise
                if state == "passed" and plan is not None:
                    self._open = _Round(restore_id, number, decision.version)
                    if held is not None:
                        plan.detail["pinned"] = True
                    plan.detail.update(
                        round=number,
                        reason=decision.reason,
                        forced=decision.forced,
                        outcome=decision.outcome,
                        problems=list(decision.problems),
                    )
                    return plan
                if held is not None:
                    agreement.pin(held, -1)
                if state == "rejoin":
                    break
                # replan (a copy was bad somewhere): ask again

    async def _verify_held(self, job: JobSpec) -> list[str]:
        """Verify the shards of ``job`` held here (own and replicas), newest first, but
        those checked within ``$TIERFS_REVERIFY_AFTER`` seconds (:func:`needs_check`);
        returns the notes for the coordinator on the copies discarded.

        A copy skipped here is still checked chunk by chunk by every node that
        fetches it (a bad one is refused there and the round decides again), so
        the window trades this node's join latency (about 0.5 s per GiB held) for
        a later fallback, never for wrong bytes.
        """
        window = settings.REVERIFY_AFTER.get()
        now = time.monotonic()
        held = sorted(self.catalog.shards_of(job.name), key=lambda s: s.key, reverse=True)
        due = [s for s in held if needs_check(s.checked_at, now, window)]
        self._phase(
            "verifying local copies", copies=len(due), recently_checked=len(held) - len(due)
        )
        notes = []
        for shard in due:
            if shard.key in self.catalog and not await self.verifier.verify(shard):
                notes.append(
                    f"node-rank {job.node_rank} discarded its copy of step "
                    f"{shard.key.step} of rank {shard.key.rank} (checksum mismatch)"
                )
        return notes

    async def _fetch_decided(
        self, job: JobSpec, decision: Decision
    ) -> tuple[RestorePlan | None, list[CopyId], str]:
        """This node's shard of the decided step from the sources the decision names.

        Returns:
            (plan, [], "") on success (a "nothing" decision included); else
            (None, the copies found bad or unusable, one line why).
        """
        if decision.step is None:
            nothing = {
                "reason": decision.reason,
                "outcome": decision.outcome,
                "problems": list(decision.problems),
                "forced": decision.forced,
            }
            return RestorePlan(None, source="none", detail=nothing), [], ""
        step, me = decision.step, job.node_rank
        if decision.writers and me >= decision.writers:
            # a node added since the step was written (issue #16): it has no part of
            # its own; the step's files reach it through the whole-step view
            return RestorePlan(step, source="none", writers=decision.writers), [], ""
        candidates: list[Candidate] = []
        if decision.local:
            candidates.append(((me, me, step), self.local))
        if self.peers is not None:
            candidates += [((h, me, step), self.peers(h, addr)) for h, addr in decision.peers]
        if self.bucket is not None:
            candidates += [((r, me, step), self.bucket.source(r)) for r in decision.rounds]
        got, bad, why = await self._fetch(job, step, decision.digest, candidates)
        if got is not None:
            source, shard = got
            plan = RestorePlan(
                step,
                shard=shard,
                source="gcs" if source.round else source.name,
                backup=source.round or decision.forced,
                writers=decision.writers,
            )
            return plan, [], ""
        if self.bucket is None and decision.rounds:
            why.append(f"backup round {decision.rounds[0]} holds it but this node has no --bucket")
        detail = f"no usable copy of step {step} of rank {me}: " + "; ".join(
            why or ["no copy was offered"]
        )
        self.reporter.error(f"restore: {detail}; asking the coordinator to decide again")
        return None, bad, detail

    # ------------------------------------------------------------------ the sources

    async def _fetch(
        self, job: JobSpec, step: int, digest: str, candidates: list[Candidate]
    ) -> tuple[tuple[RestoreSource, Shard] | None, list[CopyId], list[str]]:
        """Try ``candidates`` in order until one brings the shard of ``step`` with
        ``digest``; a failed one is skipped (its ``replicator.errors`` line written).

        Returns:
            ((source, shard) or None, the copies that failed, why each failed).
        """
        bad: list[CopyId] = []
        why: list[str] = []
        for copy, source in candidates:
            try:
                shard = await source.fetch(job, step, digest)
            except CopyFailed as exc:
                if exc.line:
                    self.reporter.error(exc.line)
                bad.append(copy)
                why.append(exc.reason)
                continue
            return (source, shard), bad, why
        return None, bad, why

    # ------------------------------------------------------------------ alone

    async def _decide_with_bucket(self, job: JobSpec, bucket: BucketRestore) -> RestorePlan:
        """Newest step of this node's rank among its own shards and the bucket's rounds
        complete for every node; a bad copy is excluded and the choice made again."""
        own = {s.key.step: s for s in self.catalog.own_shards(job)}
        holdings = [
            Holding(
                0,
                step,
                True,  # checked when chosen (below)
                s.manifest.digest,
                s.bytes,
                s.manifest.name,
                created=s.manifest.created,
                unloadable=unloadable,
                # deciding alone for one rank of a multi-node job: another rank may hold it
                missing=missing if job.nodes == 1 else "",
            )
            for step, s in own.items()
            for unloadable, missing in (eligibility(s.manifest),)
        ]
        bad: set[CopyId] = set()
        notes: list[str] = []
        view = own_rank_view(await bucket.view(job, 1), job)
        for _ in range(MAX_CHOICES):
            choice = choose_restore(1, {0: holdings}, bad, view, notes)
            if needs_deeper_read(choice, view, 1):
                view = own_rank_view(await bucket.view(job, view.depth + 2), job)
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
            candidates: list[Candidate] = []
            shard = own.get(step)
            if choice.holders.get(0) and shard is not None:
                if await self.verifier.verify(shard):
                    candidates.append(((0, 0, step), self.local))
                else:
                    bad.add((0, 0, step))
                    notes.append(f"the local copy of step {step} failed verification")
            candidates += [((r, 0, step), bucket.source(r)) for r in choice.rounds.get(0, ())]
            got, failed, why = await self._fetch(job, step, choice.digests.get(0, ""), candidates)
            if got is not None:
                source, fetched = got
                if source.round is None:  # its own copy
                    return RestorePlan(
                        step,
                        backup=choice.forced,
                        shard=fetched,
                        source="gcs" if choice.forced else "local",
                        detail=detail,
                        writers=choice.writers,
                    )
                # writers: a job shrunk to one node says so (regression: the bucket
                # restore of a 2-node step left "(written by 2 nodes; ...)" out)
                return RestorePlan(
                    step,
                    backup=source.round,
                    shard=fetched,
                    source="gcs",
                    detail=detail,
                    writers=choice.writers,
                )
            bad.update(failed)
            notes += why
            bad |= {(h, 0, step) for h in choice.holders.get(0, ())}
        reason = "no step could be restored: " + "; ".join(notes[-3:])
        return RestorePlan(
            None,
            source="none",
            detail={"reason": reason, "outcome": INCOMPLETE, "problems": [reason]},
        )

    async def _lacking_writers(self, job: JobSpec, step: int, writers: int) -> list[int]:
        """The ranks below ``writers``, other than this node's, of which no copy of
        their part of ``step`` held here verifies (a bad copy is reported and
        dropped by the verifier)."""
        lacks = []
        for rank in range(writers):
            if rank == job.node_rank:
                continue
            held = self.catalog.get(ShardKey(job.name, rank, step))
            if held is None or not await self.verifier.verify(held):
                lacks.append(rank)
        return lacks

    async def _decide_local(self, job: JobSpec) -> RestorePlan:
        """One node without a bucket: the newest own step whose checksums verify and
        that its framework could load (issue #15). A step written by more nodes (a
        job shrunk to one node without a peer plane, issue #16) also needs a verified
        copy of every other writer's part held here (each one verified; a rank
        without one: ``step N lacks rank(s) [...]``)."""
        failed: list[int] = []
        unloadable: list[str] = []
        for shard in self.catalog.own_shards(job):
            step = shard.key.step
            writers = max(shard.manifest.nodes or 0, job.nodes)
            verdict = shard.manifest.verdict
            why = verdict.reason(whole=writers == 1) if verdict is not None else ""
            if why:
                unloadable.append(f"step {step} is not loadable: {why}")
                continue
            lacks = await self._lacking_writers(job, step, writers)
            if lacks:
                unloadable.append(
                    f"step {step} lacks rank(s) {lacks} (written by {writers} nodes; "
                    f"this job has {job.nodes})"
                )
                continue
            if await self.verifier.verify(shard):
                got, _bad, _why = await self._fetch(
                    job, step, shard.manifest.digest, [((0, 0, step), self.local)]
                )
                if got is not None:
                    reason = f"step {step} is complete on this node"
                    if writers > job.nodes:
                        reason += f" (written by {writers} nodes; this job has {job.nodes})"
                    why_not = unloadable + (
                        [f"step(s) {failed} failed verification"] if failed else []
                    )
                    if why_not:
                        reason += " (" + "; ".join(why_not) + ")"
                    return RestorePlan(
                        step,
                        shard=got[1],
                        source="local",
                        detail={
                            "reason": reason,
                            "outcome": OLDER if why_not else RESTORED,
                            "problems": ([reason] if failed else []) + unloadable,
                        },
                        writers=writers,
                    )
            failed.append(step)
        if failed or unloadable:
            why_not = unloadable + ([f"step(s) {failed} failed verification"] if failed else [])
            lead = "no step is complete" if failed else "no step would load"
            reason = f"{lead}: " + "; ".join(why_not)
            return RestorePlan(
                None,
                source="none",
                detail={"reason": reason, "outcome": INCOMPLETE, "problems": [reason]},
            )
        return RestorePlan(
            None,
            source="none",
            detail={
                "reason": "no step of the job exists on this node (no peers, no bucket): a fresh "
                "start",
                "outcome": FRESH,
            },
        )
