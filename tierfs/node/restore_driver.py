"""Running a restore on this node and presenting its result in the client's view.

:class:`RestoreDriver` asks the :class:`tierfs.node.restorer.Restorer` what
to restore and to fetch it, then writes what the client reads:

* protocol mode (PROTOCOL.md sections 2 and 4): ``replicator.prerestore``,
  then the restore marker (or the empty ``s0`` marker when nothing is
  restored); when the client renames the marker the step becomes a real
  directory (:meth:`RestoreDriver.materialize`);
* generic mode: the agreed step back in the view under its own names, after
  a daemon start or when the coordinator summons this node into a round.

The restore's progress is ``JobState.restore_state`` (plain data: ``state``,
``step``, ``source``, ``outcome`` ...), which ``tierfs wait`` and the status read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio

from tierfs.core import control, settings
from tierfs.core.control import JobSpec
from tierfs.core.types import RestorePlan
from tierfs.node.catalog import ShardCatalog
from tierfs.node.jobstate import JobState
from tierfs.node.resave import sealed_at
from tierfs.node.restorer import Restorer
from tierfs.node.steps import StepBook
from tierfs.node.tasks import TaskSpawner
from tierfs.node.trainer_start import (
    CURRENT,
    JOIN,
    NOTHING,
    ROUND,
    TrainerStart,
    trainer_start_action,
)
from tierfs.node.view import SIBLING_GRACE, ClientView, Published
from tierfs.store.shards import Shard

__all__ = [
    "FAILED",
    "FRESH",
    "INCOMPLETE",
    "MISSING",
    "OLDER",
    "REFUSED",
    "RESTORED",
    "TIMEOUT",
    "Abandoner",
    "RestoreDriver",
    "RestoreReporter",
]

log = logging.getLogger(__name__)

#: how a restore ended (``restore_state["outcome"]``, ``tierfs wait``'s exit code):
#: the newest step restored, an older one (newer ones could not be), nothing
#: exists anywhere, something exists but no step is complete -- and the
#: failures: a node never joined, a phase timed out, the coordinator refused
#: this node, anything else
RESTORED, OLDER, FRESH, INCOMPLETE = "restored", "older", "fresh", "incomplete"
MISSING, TIMEOUT, REFUSED, FAILED = "missing", "timeout", "refused", "failed"


class Abandoner(Protocol):
    """Drops this node's shards newer than the restored step (the keeper)."""

    def drop_abandoned(self, job: JobSpec, step: int) -> None: ...

    def superseded(self, job: JobSpec, step: int, writers: int) -> list[Shard]: ...

    def drop_superseded(self, job: JobSpec, shards: list[Shard], writers: int) -> None: ...


class RestoreReporter(Protocol):
    """``replicator.errors`` and ``replicator.failed`` (the node reporter)."""

    def error(self, message: str) -> None: ...

    def failure(self, message: str, *, job_context: bool = True) -> None: ...


class RestoreDriver:
    """Runs protocol and generic restores and presents the restored step (trio thread).

    Args:
        state: the running job; its ``restore_state`` is the progress. The driver
            registers :meth:`summoned` as its summons listener.
        restorer: plans and fetches the restore.
        view: the client view (prerestore file, markers, links, materializing).
        book: the steps in the view (a restored step is recorded there; saved).
        catalog: the held shards (the shard behind a renamed marker).
        keeper: drops the abandoned newer steps.
        reporter: ``replicator.errors``/``failed``.
        tasks: where restores and delayed hiding run.
        before: awaited before a generic restore plans (the sealer's start-up
            seals: the restore's inventory must hold the steps they seal).
    """

    def __init__(
        self,
        state: JobState,
        restorer: Restorer,
        view: ClientView,
        book: StepBook,
        catalog: ShardCatalog,
        keeper: Abandoner,
        reporter: RestoreReporter,
        tasks: TaskSpawner,
        before: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.before = before
        self.state = state
        self.restorer = restorer
        self.view = view
        self.book = book
        self.catalog = catalog
        self.keeper = keeper
        self.reporter = reporter
        self.tasks = tasks
        self._scope: trio.CancelScope | None = None
        self._generic_running = False
        #: no generic restore has ended since this daemon started: the first one is
        #: this node's own (a restarted node), even when a summons starts it
        self._fresh = True
        #: when the first trainer start waiting for the running restore came (Unix
        #: seconds; :meth:`trainer_start`): the restore is that trainer's, newer
        #: steps are abandoned even when summoned; None: no trainer waits
        self._waiting_start: float | None = None
        #: (``at`` of the settled restore a trainer start got, when that start came,
        #: the steps this node held or was sealing then)
        self._handed: tuple[float, float, frozenset[int]] | None = None
        #: the steps held or sealing at the first trainer start waiting for a restore
        self._waiting_steps: frozenset[int] = frozenset()
        #: the last trainer start (``.tierfs/restart``): plain data
        self.last_trainer_start: dict[str, Any] = {}
        #: told of each other rank's part a restore supersedes, before it is dropped
        self._on_superseded: list[Callable[[Shard], Awaitable[None]]] = []
        state.on_summoned(self.summoned)

    def on_superseded(self, listener: Callable[[Shard], Awaitable[None]]) -> None:
        """Await ``listener(shard)`` for each other rank's part held here that a generic
        restore supersedes (an earlier save of the restored step by another node
        count), before it is dropped: the whole-step view unlinks its files."""
        self._on_superseded.append(listener)

    def cancel(self) -> None:
        """Cancel the protocol restore that runs now, if any (a new yaml arrived)."""
        if self._scope is not None:
            self._scope.cancel()

    async def resume(self, job: JobSpec) -> None:
        """Restore ``job`` again after the previous daemon stopped during its restore."""
        log.info(
            "resuming the restore of job %s (the previous daemon stopped in state %s)",
            job.name,
            self.state.restore_state.get("state"),
        )
        self.state.restore_state = {"state": "cleanup", "since": time.time()}
        await trio.to_thread.run_sync(self.view.cleanup, self.book.view_steps)
        self.book.save()
        await self.restore(job)

    async def restore(self, job: JobSpec) -> None:
        """Protocol mode: restore ``job`` and publish its marker; a failure ends in the
        ``failed`` state with an ``outcome`` and a ``replicator.failed`` line. Cancelled
        by :meth:`cancel`."""
        with trio.CancelScope() as scope:
            self._scope = scope
            try:
                await self._restore_inner(job)
            except Exception as exc:
                log.exception("restore failed")
                self.reporter.failure(f"restore failed: {exc}")
                self.state.restore_state = {
                    "state": "failed",
                    "error": str(exc),
                    "outcome": getattr(exc, "outcome", FAILED),
                    "at": time.time(),
                }
            finally:
                if self._scope is scope:
                    self._scope = None
                self.book.save()

    async def _restore_inner(self, job: JobSpec) -> None:
        state = self.state
        state.restore_state = {"state": "planning", "since": time.time()}
        plan = await self.restorer.plan(job)
        step = plan.step or None
        if step:
            self.keeper.drop_abandoned(job, step)
        await trio.to_thread.run_sync(
            self.view.write_file,
            control.REPLICATOR_PRERESTORE,
            control.prerestore_text(step, plan.backup).encode(),
        )
        state.restore_state = {
            "state": "barrier",
            "step": step,
            "source": plan.source,
            "since": time.time(),
        }
        await self.restorer.finish(job, plan)
        outcome = self.report_plan(plan)
        if step is None or plan.shard is None:
            await trio.to_thread.run_sync(
                self.view.write_file, control.marker_name(job.name, 0, job.node_rank, 0), b""
            )
            state.restore_state = {"state": "done", "step": None, "at": time.time(), **outcome}
            log.info(
                "nothing restored (%s): published the empty s0 marker",
                outcome.get("reason") or outcome["outcome"],
            )
            return
        await trio.to_thread.run_sync(self.view.publish, job, plan.shard)
        state.restore_state = {
            "state": "done",
            "step": step,
            "source": plan.source,
            "backup": plan.backup,
            "at": time.time(),
            **outcome,
        }
        log.info("restore of step %d published (%s)", step, plan.source)

    def report_plan(self, plan: RestorePlan) -> dict[str, Any]:
        """Say in ``replicator.errors`` why the restore is not the newest step, or
        nothing although something exists; returns the outcome fields of the
        restore state (``outcome``, ``reason``, ``problems``)."""
        d = plan.detail
        outcome = d.get("outcome") or (RESTORED if plan.step else INCOMPLETE)
        reason = str(d.get("reason") or "")
        problems = [str(p) for p in d.get("problems") or []]
        if plan.step is None and outcome == INCOMPLETE:
            self.reporter.error(f"restore: nothing restored: {reason or 'no step is complete'}")
        elif problems:
            self.reporter.error(f"restore: step {plan.step} restored: {reason}")
        for line in problems:
            if line not in reason:
                self.reporter.error(f"restore: {line}")
        return {"outcome": outcome, "reason": reason, "problems": problems}

    async def _generic_restore(self, job: JobSpec, summoned: bool = False) -> None:
        """Generic mode: take part in a restore round and present the agreed step in the
        view under its own names.

        Run after a node loss (this daemon started) and, with ``summoned``, on a
        node that kept running when the coordinator asks it to join another
        node's round: every node must be able to present the agreed step, so
        a survivor that no longer holds it fetches it too. Frameworks that
        resume by listing their directory (HF Trainer, Lightning, Megatron)
        then find ``checkpoint-<N>/``, ``iter_<N>/`` and their tracker files
        as they left them. A survivor keeps its newer steps.
        """
        state = self.state
        self._generic_running = True
        state.restore_state = {"state": "planning", "since": time.time(), "summoned": summoned}
        try:
            if self.before is not None:
                await self.before()
            plan = await self.restorer.plan(job)
            if plan.step and not summoned:
                self.keeper.drop_abandoned(job, plan.step)
            await self.restorer.finish(job, plan)
            if plan.step and summoned and self._waiting_start is not None:
                # a trainer started here during the round: it is this trainer's restore
                self.keeper.drop_abandoned(job, plan.step)
        except Exception as exc:
            log.exception("generic restore failed")
            self.reporter.error(f"restore failed: {exc}")
            state.restore_state = {
                "state": "failed",
                "error": str(exc),
                "at": time.time(),
                "outcome": getattr(exc, "outcome", FAILED),
                "summoned": summoned,
            }
            return
        finally:
            self._generic_running = False
            self._fresh = False
        outcome = self.report_plan(plan)
        if plan.step and plan.writers:
            # parts of an earlier save of the step by another node count must not
            # anchor or fill this node's view of the save restored (#16 sixth trial
            # N2: they kept the view on the earlier save's files and bytes)
            stale = self.keeper.superseded(job, plan.step, plan.writers)
            for old in stale:
                if old.key.rank == job.node_rank:
                    await trio.to_thread.run_sync(self.view.withdraw_superseded, old)
                else:
                    for listener in self._on_superseded:
                        await listener(old)
            self.keeper.drop_superseded(job, stale, plan.writers)
        if plan.shard is None:
            # None, or a step written by fewer nodes than this node's rank (issue #16):
            # the step is restored, this node has no part of it (the whole-step view
            # shows the others' files)
            state.restore_state = {
                "state": "done",
                "step": plan.step,
                "at": time.time(),
                "summoned": summoned,
                **outcome,
            }
            if plan.step is not None:
                state.restore_state.update(source="none", writers=plan.writers)
                log.info(
                    "generic restore: step %d (written by %d nodes) has no part of node-rank %d",
                    plan.step,
                    plan.writers,
                    job.node_rank,
                )
            self.book.save()
            return
        shard = plan.shard
        created = await trio.to_thread.run_sync(self.view.link_missing, shard)
        self.book.view_steps[shard.manifest.name] = shard.key
        self.book.sealed_times[shard.key] = time.time()  # files placed now are not a save
        state.restore_state = {
            "state": "done",
            "step": shard.key.step,
            "source": plan.source,
            "backup": plan.backup,
            "at": time.time(),
            "created": created,
            "summoned": summoned,
            "writers": plan.writers or job.nodes,
            **outcome,
        }
        if created:
            log.info(
                "generic restore: step %d back in the view as %s (%s)",
                shard.key.step,
                ", ".join(created),
                plan.source,
            )
        self.book.save()

    def summoned(self, job: JobSpec) -> None:
        """The coordinator asks this node to join a restore round (generic mode; trio
        thread): join it unless a restore already runs here.

        A node whose own restore (after its daemon started) gave up, e.g. a node
        missing past ``--join-timeout``, takes the summons as that restore again:
        like a restarted node it drops its steps newer than the agreed one. So
        does a node whose daemon started and has not restored yet: a summons
        that reaches it before its own start-up restore begins is that restore.

        Regression (#16 sixth trial N1): with the README's order (node 0 first),
        every other restarted node was summoned before its own restore began,
        so it never marked the newer steps abandoned: their other ranks' files
        (a mix of two saves) stayed in its view and a one-process ``dcp.load``
        of that directory returned rank 3's earlier values without an error.
        """
        if self.state.mode != "generic" or self.state.job is not job:
            return
        last = self.state.restore_state
        own = self._fresh or (last.get("state") == "failed" and last.get("summoned") is False)
        if self.start_generic(job, not own):
            log.info("the coordinator asks this node to join a restore round")

    def trainer_start(self) -> TrainerStart:
        """A trainer starts on this node (``tierfs wait`` opened ``.tierfs/restart`` for
        writing; FUSE thread, never blocks): join the running restore, keep the settled
        one, or start a new round when the job went on since it settled
        (:func:`tierfs.node.trainer_start.trainer_start_action`; #16 sixth trial N4).
        The decision is also :attr:`last_trainer_start`."""
        job = self.state.job
        now = time.time()
        last = self.state.restore_state
        own: list[tuple[int, float]] = []
        if job is not None:
            own = [(s.key.step, sealed_at(s.manifest)) for s in self.catalog.own_shards(job)]
            # a step renamed into place whose seal waits (a file of it still open) is
            # written since, too (#16 seventh trial B)
            own += [(c.step, now) for c in self.book.pending.values()]
        handed = self._handed
        handed_ago = None
        known: frozenset[int] = frozenset()
        if handed is not None and last.get("at") is not None and handed[0] == last.get("at"):
            handed_ago, known = now - handed[1], handed[2]
        decision = trainer_start_action(
            self.state.mode if job is not None else "none",
            self._generic_running,
            last,
            own,
            handed_ago,
            settings.TRAINER_SAME_START.get(),
            known,
        )
        steps = frozenset(s for s, _ in own)
        if job is not None and decision.action in (JOIN, ROUND):
            if self._waiting_start is None:
                # the first start of a burst of local ranks
                self._waiting_start, self._waiting_steps = now, steps
            if decision.action == ROUND:
                self.start_generic(job, summoned=False)
        elif job is not None and last.get("state") in ("done", "failed"):
            if handed_ago is None:
                self._handed = (float(last.get("at") or 0.0), now, steps)
            if decision.drop_after is not None:
                self.keeper.drop_abandoned(job, decision.drop_after)
        quiet = decision.action in (CURRENT, NOTHING) and decision.drop_after is None
        # (another local rank of the same start: no line each)
        (log.debug if quiet else log.info)("trainer start: %s (%s)", decision.action, decision.why)
        self.last_trainer_start = {
            "at": time.time(),
            "action": decision.action,
            "why": decision.why,
        }
        return decision

    def start_generic(self, job: JobSpec, summoned: bool = False) -> bool:
        """Start a generic restore unless one runs (one at a time: two restore ids of one
        rank would take turns superseding each other's round). True if started."""
        if self._generic_running:
            return False
        self._generic_running = True
        self.state.restore_state = {
            "state": "pending",
            "since": time.time(),
            "summoned": summoned,
        }
        self.tasks.spawn(self._generic_restore_for_trainer, job, summoned)
        return True

    async def _generic_restore_for_trainer(self, job: JobSpec, summoned: bool) -> None:
        """:meth:`_generic_restore`; its result is then the one handed to the trainer
        start that waited for it, if any (:meth:`trainer_start`)."""
        try:
            await self._generic_restore(job, summoned)
        finally:
            if self._waiting_start is not None:
                at = self.state.restore_state.get("at")
                self._handed = (float(at or 0.0), self._waiting_start, self._waiting_steps)
                self._waiting_start = None

    async def materialize(self, name: str, pub: Published) -> None:
        """After the client renamed a marker to ``name``: make ``name`` a real entry
        (:meth:`tierfs.node.view.ClientView.materialize`), then retire the sibling."""
        shard = self.catalog.get(pub.key)
        if await trio.to_thread.run_sync(self.view.materialize, name, pub, shard):
            self.book.view_steps[name] = pub.key
            self.book.sealed_times[pub.key] = time.time()  # as placed, not a save
            log.info("restored step %d presented as %s", pub.key.step, name)
            # the sibling stays a while for readers that resolved the symlink before
            self.tasks.spawn(self.view.hide_after, pub.sibling, SIBLING_GRACE)
        self.book.save()
