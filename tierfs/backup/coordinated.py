"""Coordinator-driven backup rounds of a multi-node job, as the GCS tier sees them.

* Every node follows the coordinator's orders (the
  :class:`tierfs.core.ports.BackupOrders` port): the node's peer tier hands each
  ``Sync`` reply's round to :meth:`CoordinatedRounds.on_backup_round`, which
  starts uploading this node's part once per (round, step) and pins its step;
  the outcome goes back in the next ``Sync`` (:meth:`CoordinatedRounds.backup_outcome`).
* The node serving the coordinator (node-rank 0 unless ``--coordinator``
  names another node) drives the coordinator's
  round book (:class:`tierfs.cluster.backup_schedule.RoundBook`, built by
  :func:`tierfs.daemon.build_node`) through the :class:`tierfs.core.ports.CoordinatorHooks`
  port: seeds it from the bucket listing (round names grow, a restarted
  coordinator does not back the same step up twice), writes its lines (a
  skipped step, an incomplete round) to ``replicator.errors``, removes what
  failed rounds left, and installs the bucket reader the coordinator's restore
  decisions wait for (:meth:`CoordinatedRounds.install_hooks`).

The coordinator's hooks run in its gRPC thread with a bounded deadline and hand
lines for ``replicator.errors`` to the trio thread through
:meth:`tierfs.backup.progress.ErrorLines.fail_later`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from tierfs.backup.client import describe_error
from tierfs.backup.health import BucketAccess
from tierfs.backup.progress import ErrorLines, RoundMemory
from tierfs.backup.uploads import Uploads
from tierfs.core import rounds as S
from tierfs.core import settings
from tierfs.core.ports import CoordinatorHooks
from tierfs.core.types import BucketView

if TYPE_CHECKING:
    from tierfs.core.control import JobSpec

log = logging.getLogger(__name__)


class CoordinatedRounds:
    """The coordinator's rounds on this node (see the module docstring; trio thread).

    Args:
        coordinator: this node's coordinator service, or None without ``--listen``.
        access: the bucket.
        lines: ``replicator.errors``.
        memory: the rounds' state (orders, outcome, status entries).
        uploads: starts and supersedes uploads.
        delete_restore_version: ``restore.version``'s deletion when due (async).
    """

    def __init__(
        self,
        *,
        coordinator: CoordinatorHooks | None,
        access: BucketAccess,
        lines: ErrorLines,
        memory: RoundMemory,
        uploads: Uploads,
        delete_restore_version: Callable[[JobSpec], Any],
    ) -> None:
        self.coordinator = coordinator
        self.access = access
        self.lines = lines
        self.memory = memory
        self.uploads = uploads
        self.delete_restore_version = delete_restore_version

    async def _locked(self, fn: Any) -> Any:
        """``fn(coordinator)`` under the coordinator's lock, waited for in a worker thread
        (a gRPC thread may hold it through a bucket lookup)."""
        servicer = self.coordinator
        assert servicer is not None
        return await trio.to_thread.run_sync(servicer.locked, fn)

    async def install_hooks(self, read_bucket: Callable[..., BucketView]) -> None:
        """The bucket reader in this node's coordinator (used only while this node
        serves it): restore decisions wait for it. ``read_bucket(job, nodes, depth,
        *, deadline, report)``: :meth:`tierfs.backup.fetch.BucketRestore.read_bucket`."""
        servicer = self.coordinator
        if servicer is None:
            return
        await trio.to_thread.run_sync(
            servicer.set_bucket_reader,
            functools.partial(
                read_bucket,
                deadline=settings.GCS_FALLBACK_DEADLINE.get(),
                report=self.lines.fail_later,
            ),
        )
        log.info(
            "GCS tier: the coordinator decides backup rounds and restores from %s",
            self.access.spec,
        )

    async def coordinate(self, job: JobSpec) -> None:
        """The node serving the coordinator of a multi-node job: seed the coordinator's
        round book from the bucket, write its lines to replicator.errors, delete
        restore.version when due."""
        if self.coordinator is None:
            return
        mem = self.memory
        book_job, nodes, seeded = await self._locked(
            lambda c: (
                (c.backups.job, c.backups.nodes, c.backups.seeded)
                if c.backups is not None
                else (None, 0, True)
            )
        )
        if book_job is not None and not seeded:
            try:
                newest, complete, parts = await self.access.read_seed(book_job, nodes)
            except Exception as exc:
                if not mem.seed_failed:
                    mem.seed_failed = True
                    self.lines.fail(
                        f"backup rounds wait: the bucket cannot be listed ({describe_error(exc)})"
                    )
            else:
                mem.seed_failed = False
                self.access.ok()
                await self._locked(lambda c: c.backups.seed(book_job, newest, complete, parts))
        for line in await self._locked(lambda c: c.backups.drain() if c.backups else []):
            self.lines.fail(line)
        self.uploads.spawn_tidy(
            job, await self._locked(lambda c: c.backups.take_cleanup() if c.backups else [])
        )
        await self.delete_restore_version(job)

    # ------------------------------------------------------------------ following (BackupOrders)

    def backup_outcome(self) -> S.Outcome | None:
        """This node's outcome of the last round it was ordered into (trio thread)."""
        return self.memory.outcome

    def on_backup_round(
        self,
        job: JobSpec,
        order: tuple[str, int] | None,
        last: S.RoundView | None,
        dedup: bool = False,
    ) -> None:
        """The coordinator's reply (trio thread): start uploading ``order`` once per
        (round, step) -- a round that moved to a newer step is ordered again --
        and pin its step at once; note the newest round's state for the status.

        Args:
            dedup: this node's shard has its data-parallel uploader's checksums
                (the coordinator compared the digests): point at that data once
                the bucket proves it is there.
        """
        mem = self.memory
        mem.cluster_last = last
        mem.order = order
        if last is not None and last.state != S.RUNNING:
            entry = mem.entry(last.round)
            if entry is not None:
                entry["state"] = last.state
            if last.state == S.COMPLETE and job.node_rank == 0:
                self.uploads.spawn_index(job, last.round)
        if order is None:
            return
        rnd, step = order
        active = self.uploads.active
        for u in active.values():
            if u.round == rnd and u.step != step:  # the round moved on
                u.superseded = True
                u.cancel.set()
        if order in mem.ordered or any(u.round == rnd and u.step == step for u in active.values()):
            return
        mem.ordered.append(order)
        mem.state.last_round = rnd
        moved = any(o[0] == rnd and o[1] != step for o in mem.ordered)
        log.info(
            "backup round %s: the coordinator orders step %d%s%s",
            rnd,
            step,
            " (the round moved to a newer step)" if moved else "",
            "; this node's shard matches its data-parallel uploader's" if dedup else "",
        )
        entry = mem.entry(rnd)
        if entry is not None:
            entry.update(step=step, state="running")
        else:
            mem.history.append(
                {
                    "round": rnd,
                    "step": step,
                    "state": "running",
                    "started": time.time(),
                    "reason": "ordered by the coordinator",
                }
            )
        self.uploads.spawn(job, rnd, step, dedup)
