"""The GCS tier's loop: every tick, follow the job and decide one node's rounds.

Each tick (every ``$TIERFS_GCS_TICK`` seconds, or at once after a seal or an
upload's end) :class:`ScheduleFollower`:

* writes the lines the coordinator's threads queued, logs a stalling bucket;
* takes up a new job (a fresh schedule) and creates the GCS client (a failed
  creation waits the ``gcs-bucket-check`` policy's pause before the next try);
* multi-node job with a peer plane: the coordinator decides the rounds; the
  node serving it seeds and drains the coordinator's round book
  (:meth:`tierfs.backup.coordinated.CoordinatedRounds.coordinate`);
* one node: decides its rounds itself with :func:`tierfs.core.rounds.decide_round`
  (a restarted daemon first reads the bucket's newest rounds, so it never
  redoes a step the bucket holds nor reuses a round name) and starts the
  upload; deletes ``restore.version`` when due;
* a multi-node job without a peer plane takes no backups (it says so).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import trio

from tierfs.backup.client import describe_error
from tierfs.backup.coordinated import CoordinatedRounds
from tierfs.backup.fetch import BucketRestore
from tierfs.backup.health import BucketAccess
from tierfs.backup.progress import ErrorLines, Roles, RoundMemory
from tierfs.backup.uploads import Uploads
from tierfs.core import retry, settings
from tierfs.core import rounds as S
from tierfs.core.ports import Catalog, CurrentJob
from tierfs.store.shards import ShardKey

if TYPE_CHECKING:
    from tierfs.core.control import JobSpec

log = logging.getLogger(__name__)


class ScheduleFollower:
    """The tier's tick (see the module docstring; trio thread).

    Args:
        current: the current job.
        catalog: the held shards (the step to back up).
        access: the bucket.
        lines: ``replicator.errors``.
        memory: the rounds' state.
        roles: who decides the rounds.
        uploads: starts an upload.
        coordinated: the coordinator side (multi-node).
        restore: ``restore.version``'s deletion.
    """

    def __init__(
        self,
        *,
        current: CurrentJob,
        catalog: Catalog,
        access: BucketAccess,
        lines: ErrorLines,
        memory: RoundMemory,
        roles: Roles,
        uploads: Uploads,
        coordinated: CoordinatedRounds,
        restore: BucketRestore,
    ) -> None:
        self.current = current
        self.catalog = catalog
        self.access = access
        self.lines = lines
        self.memory = memory
        self.roles = roles
        self.uploads = uploads
        self.coordinated = coordinated
        self.restore = restore
        self._poke = trio.Event()
        #: after a failed GCS client creation: the next try waits (monotonic s)
        self._client_backoff: retry.Backoff | None = None
        self._client_retry_at = 0.0

    def wake(self) -> None:
        """Decide soon (a seal, an upload's end; trio thread)."""
        self._poke.set()

    async def loop(self) -> None:
        """Tick until cancelled."""
        while True:
            try:
                await self.tick()
            except Exception:
                log.exception("GCS tier: tick failed")
            with trio.move_on_after(settings.GCS_TICK.get()):
                await self._poke.wait()
            self._poke = trio.Event()

    async def tick(self) -> None:
        """One tick (see the module docstring)."""
        self.lines.flush()
        self.access.log_stall()
        job = self.current.job
        if job is None or self.current.mode == "none":
            return
        if self.memory.take_job(job):
            self.memory.seeded = False
        if time.monotonic() < self._client_retry_at:
            return
        try:
            await self.access.call(self.access.get_backend)
        except Exception as exc:
            # credential discovery failing logs a warning per try: not every tick
            self.memory.note = f"cannot create the GCS client: {describe_error(exc)}"
            if self._client_backoff is None:
                self._client_backoff = retry.gcs_bucket_check().backoff()
            self._client_retry_at = time.monotonic() + self._client_backoff.next()
            return
        self._client_backoff = None
        if self.roles.multi(job):
            self.memory.note = None
            if self.roles.coordinating(job):
                await self.coordinated.coordinate(job)
            return
        if job.nodes > 1:
            self.memory.note = (
                "no backup rounds: a multi-node job needs the peer plane "
                "(--listen with --coordinator or the bucket rendezvous) to agree "
                "on them"
            )
            return
        self.memory.note = None
        if self.current.restoring():
            return
        await self._decide(job)
        await self.restore.maybe_delete_restore_version(job)

    async def _decide(self, job: JobSpec) -> None:
        mem = self.memory
        step = self.roles.synced_step(job)
        shard = (
            self.catalog.get(ShardKey(job.name, job.node_rank, step)) if step is not None else None
        )
        if shard is None or shard.manifest.created < mem.epoch:
            step = None  # not held here, or sealed before this job's restore
        minutes, steps = S.intervals(job.backup_interval_minutes, job.backup_interval_steps)
        now = time.time()
        requested = bool(shard and shard.manifest.backup_requested)
        # this node's part now: the step number saved again (other bytes) is due again
        parts = {job.node_rank: shard.manifest.digest} if shard is not None else {}
        decision = S.decide_round(
            mem.state,
            now=now,
            step=step,
            backup_requested=requested,
            interval_minutes=minutes,
            interval_steps=steps,
            parts=parts,
        )
        if decision.action == S.SKIP:
            for line in S.skipped(mem.state, decision):
                self.lines.fail(line)
            return
        if decision.action != S.START:
            return
        if not mem.seeded:
            # a restarted daemon: never redo a step the bucket already holds, never
            # reuse a round name, count the period from the newest round
            try:
                newest, complete, seeded = await self.access.read_seed(job.name, job.nodes)
            except Exception as exc:
                self.lines.fail(
                    f"backup of step {decision.step} not started: {describe_error(exc)}"
                )
                return
            if newest is not None:
                mem.state.last_round = max(newest, mem.state.last_round or "")
            S.apply_seed(mem.state, complete, after_restore=mem.restored_here, parts=seeded)
            mem.seeded = True
            decision = S.decide_round(
                mem.state,
                now=now,
                step=step,
                backup_requested=requested,
                interval_minutes=minutes,
                interval_steps=steps,
                parts=parts,
            )
            if decision.action != S.START:
                return
        assert decision.round is not None and decision.step is not None
        for line in S.started(mem.state, decision, now):
            self.lines.fail(line)
        mem.state.last_parts = S.parts_key(parts)
        log.info("backup round %s: step %d (%s)", decision.round, decision.step, decision.reason)
        mem.history.append(
            {
                "round": decision.round,
                "step": decision.step,
                "state": "running",
                "started": now,
                "reason": decision.reason,
            }
        )
        self.uploads.spawn(job, decision.round, decision.step)
