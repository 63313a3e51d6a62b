"""This node's uploads into backup rounds, inside the node daemon (trio thread).

:class:`Uploads` runs each upload of this node's part of a round in a worker
thread (one transfer at a time, :meth:`tierfs.backup.bucket.GcsBackend.upload_shard`),
and decides what its failure means:

* an upload that failed because the bucket did not answer
  (:func:`tierfs.backup.client.is_transient`) is tried again -- after
  ``$TIERFS_GCS_UPLOAD_RETRY_FIRST`` s doubling up to
  ``$TIERFS_GCS_UPLOAD_RETRY_MAX`` s, or as soon as the bucket answers -- while
  its round still wants it (policy ``gcs-upload``);
* a step no longer held (retention dropped it before the order came) is not
  a failure: multi-node, the node reports :data:`tierfs.core.rounds.MISSING` and the
  coordinator moves the round to a newer step; one node moves its round to
  its newest sealed step itself;
* the outcome goes to the coordinator (multi-node, in the next ``Sync``) or
  to the one-node schedule, once; what failed or moved rounds left behind
  is removed once a later round completed (:meth:`Uploads.spawn_tidy`).

A withdrawn shard's upload is cancelled (:meth:`Uploads.cancel`); failures
become a line in ``replicator.errors`` and the status; training never waits.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from tierfs.backup.client import describe_error, is_transient
from tierfs.backup.errors import Cancelled
from tierfs.backup.health import BucketAccess
from tierfs.backup.progress import ErrorLines, Roles, RoundMemory
from tierfs.core import retry, settings
from tierfs.core import rounds as S
from tierfs.core.ports import Catalog, CurrentJob, PeerPlane
from tierfs.store.shards import Shard, ShardKey

if TYPE_CHECKING:
    from tierfs.core.control import JobSpec

log = logging.getLogger(__name__)


@dataclass
class Upload:
    """An upload of this node's part of a round (trio thread owns it).

    Attributes:
        attempt: 1 for the first try, +1 for each retry after the bucket failed.
        waiting_until: Unix time of the next attempt while the upload waits
            for the bucket (the shard is not pinned then), else None.
    """

    round: str
    step: int
    total: int
    cancel: threading.Event
    started: float
    done: int = 0
    attempt: int = 1
    waiting_until: float | None = None
    #: the round moved to a newer step: this upload stops without an outcome
    superseded: bool = False

    def add(self, n: int) -> None:  # any thread; a lost increment only skews the status
        self.done += n


def _stopped_by_move(step: int, rnd: str) -> None:
    log.info("backup of step %d to round %s stopped: the round moved to a newer step", step, rnd)


class Uploads:
    """This node's uploads (see the module docstring; trio thread).

    Args:
        current: the current job.
        catalog: the held shards (an upload reads its shard from there).
        access: the bucket (backend, worker threads, health).
        lines: ``replicator.errors``.
        memory: the rounds' state (schedule, status entries, outcome).
        roles: multi-node or not.
        plane: the peer plane (a heartbeat carries an outcome), or None.
        limiter: one transfer at a time (shared with restores).
        wake: called when an upload ended (the schedule decides again).

    Attributes:
        active: shard key -> its upload in flight (or waiting to try again).
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
        plane: PeerPlane | None,
        limiter: trio.CapacityLimiter,
        wake: Callable[[], None],
    ) -> None:
        self.current = current
        self.catalog = catalog
        self.access = access
        self.lines = lines
        self.memory = memory
        self.roles = roles
        self.plane = plane
        self.limiter = limiter
        self.wake = wake
        self.active: dict[ShardKey, Upload] = {}
        self._nursery: trio.Nursery | None = None
        #: rounds whose index this node wrote or is writing (node-rank 0, one node)
        self.indexed: set[tuple[str, str]] = set()

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Host the uploads' tasks until cancelled; then cancel every upload."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            for up in self.active.values():
                up.cancel.set()

    def cancel(self, key: ShardKey) -> None:
        """The shard ``key`` left the catalog: stop uploading it (its bytes changed)."""
        up = self.active.get(key)
        if up is not None:
            up.cancel.set()

    def pinned(self) -> set[ShardKey]:
        """Shards being uploaded (not those waiting to try again)."""
        return {k for k, u in self.active.items() if u.waiting_until is None}

    def spawn(self, job: JobSpec, rnd: str, step: int, dedup: bool = False) -> None:
        """Start uploading this node's part of ``step`` to round ``rnd`` (a task; nothing
        before :meth:`run` started). ``dedup``: see
        :meth:`tierfs.backup.upload.Uploader.upload_shard`."""
        if self._nursery is not None:
            self._nursery.start_soon(self._upload, job, rnd, step, dedup)

    def _still_wanted(self, job: JobSpec, rnd: str, step: int, up: Upload) -> str | None:
        """Why a failed upload of ``step`` to ``rnd`` should not be tried again (None:
        try again): cancelled, another job, the round is over, too old."""
        if up.cancel.is_set():
            return "the step was written to after it was sealed"
        cur = self.current.job
        if cur is None or (cur.name, cur.nodes, cur.node_rank) != (
            job.name,
            job.nodes,
            job.node_rank,
        ):
            return "the job changed"
        if job.nodes > 1:
            if self.roles.multi(job) and self.memory.order != (rnd, step):
                return "the coordinator no longer orders the round"
        elif self.memory.state.active != rnd:
            return "the round is no longer running"
        if time.time() - up.started > settings.GCS_ROUND_TIMEOUT.get():
            return f"the round is older than {settings.GCS_ROUND_TIMEOUT.get():.0f} s"
        return None

    async def _upload(self, job: JobSpec, rnd: str, step: int, dedup: bool = False) -> None:
        """Upload this node's part of round ``rnd``; while the bucket fails
        (:func:`tierfs.backup.bucket.is_transient`) try again -- after
        ``$TIERFS_GCS_UPLOAD_RETRY_FIRST`` s doubling up to
        ``$TIERFS_GCS_UPLOAD_RETRY_MAX`` s, or as soon as
        the bucket answers -- as long as the round still wants it
        (:meth:`_still_wanted`) and the step is still held. The outcome goes
        to the coordinator (multi-node) or the schedule (one node) once.

        A step no longer held (retention dropped it before the order came)
        is not a failure: multi-node, the node reports :data:`S.MISSING` and
        the coordinator moves the round to a newer step every node holds; one
        node moves its round to its newest sealed step itself.
        Policy ``gcs-upload`` (:mod:`tierfs.core.retry`)."""
        key = ShardKey(job.name, job.node_rank, step)
        entry = self.memory.entry(rnd)
        up = Upload(rnd, step, 0, threading.Event(), time.time())
        backoff = retry.gcs_upload().backoff()
        try:
            while True:
                shard = self.catalog.get(key)
                if shard is None and job.nodes <= 1:
                    shard = self._move_round(job, rnd, step, entry)
                    if shard is not None:
                        if self.active.get(key) is up:
                            del self.active[key]
                        step, key, up.step = shard.key.step, shard.key, shard.key.step
                if shard is None:
                    msg = f"backup round {rnd}: step {step} is no longer held on this node"
                    if job.nodes > 1:
                        log.info("%s; the coordinator moves the round to a newer step", msg)
                        self.finish(
                            job, rnd, step, S.MISSING, msg, up.done, time.time() - up.started, None
                        )
                        return
                    self.lines.fail(msg)
                    self.finish(
                        job, rnd, step, S.FAILED, msg, up.done, time.time() - up.started, entry
                    )
                    return
                up.total, up.done, up.waiting_until = shard.bytes, 0, None
                self.active[key] = up
                try:
                    async with self.limiter:
                        if up.cancel.is_set():
                            raise Cancelled("upload cancelled")
                        backend = await self.access.call(self.access.get_backend)
                        result = await trio.to_thread.run_sync(
                            functools.partial(
                                backend.upload_shard,
                                shard,
                                rnd,
                                # the step's writer topology (a restored step
                                # written by another node count keeps it)
                                nodes=shard.manifest.nodes or job.nodes,
                                data_parallelism=job.assume_data_parallelism,
                                dedup=dedup,
                                cancel=up.cancel,
                                on_bytes=up.add,
                            ),
                            abandon_on_cancel=True,
                        )
                except Cancelled:
                    if up.superseded:
                        _stopped_by_move(step, rnd)
                        return
                    msg = (
                        f"backup of step {step} to round {rnd} stopped: the step was "
                        "written to after it was sealed"
                    )
                    self.lines.fail(msg)
                    self.finish(
                        job, rnd, step, S.FAILED, msg, up.done, time.time() - up.started, entry
                    )
                    return
                except Exception as exc:
                    if up.superseded:
                        _stopped_by_move(step, rnd)
                        return
                    msg = f"backup of step {step} to round {rnd} failed: {describe_error(exc)}"
                    why = (
                        self._still_wanted(job, rnd, step, up)
                        if is_transient(exc)
                        else "not a bucket outage"
                    )
                    if why is not None:
                        if up.attempt > 1:
                            msg += f" (attempt {up.attempt}; not tried again: {why})"
                        self.lines.fail(msg)
                        self.finish(
                            job, rnd, step, S.FAILED, msg, up.done, time.time() - up.started, entry
                        )
                        return
                    delay = backoff.next()
                    msg += f"; trying again within {delay:.0f} s or when the bucket answers"
                    if up.attempt == 1:
                        self.lines.fail(msg)  # one line in replicator.errors per round
                    else:
                        self.lines.note(msg)
                        log.info("%s (attempt %d)", msg, up.attempt)
                    if not self.access.bucket_problem():
                        self.access.problem(describe_error(exc))
                    if not await self._pause(job, rnd, step, up, delay):
                        if up.superseded:
                            log.info(
                                "backup of step %d to round %s not tried again: the "
                                "round moved to a newer step",
                                step,
                                rnd,
                            )
                            return
                        why = self._still_wanted(job, rnd, step, up) or "stopped"
                        msg = (
                            f"backup of step {step} to round {rnd} given up after "
                            f"{up.attempt} attempt(s): {why}"
                        )
                        self.lines.fail(msg)
                        self.finish(
                            job, rnd, step, S.FAILED, msg, up.done, time.time() - up.started, entry
                        )
                        return
                    up.attempt += 1
                    continue
                self.access.ok()
                self.memory.backed_up[step] = rnd
                for old in sorted(self.memory.backed_up)[:-8]:
                    del self.memory.backed_up[old]
                log.info(
                    "backup round %s: step %d uploaded (%d objects, %d bytes, %d skipped, "
                    "%.1f s, attempt %d%s)",
                    rnd,
                    step,
                    result.objects,
                    result.bytes,
                    result.skipped,
                    result.seconds,
                    up.attempt,
                    ""
                    if result.data_uploaded
                    else "; data: the data-parallel uploader's, proven in the bucket",
                )
                if result.note:
                    log.warning("backup round %s: %s", rnd, result.note)
                self.finish(
                    job,
                    rnd,
                    step,
                    S.DONE,
                    "",
                    result.bytes,
                    time.time() - up.started,
                    entry,
                    digest=shard.manifest.digest,
                )
                return
        finally:
            up.cancel.set()
            if self.active.get(key) is up:
                del self.active[key]
            self.wake()

    async def _pause(self, job: JobSpec, rnd: str, step: int, up: Upload, delay: float) -> bool:
        """Wait up to ``delay`` seconds before the next attempt, unpinned; end early
        when the bucket answers or the shard leaves the catalog (the caller then
        reports it). False if the upload is no longer wanted."""
        since = time.monotonic()
        up.waiting_until = time.time() + delay
        key = ShardKey(job.name, job.node_rank, step)
        with trio.move_on_after(delay):
            while not self.access.answered_since(since) and key in self.catalog:
                if self._still_wanted(job, rnd, step, up) is not None:
                    return False
                await trio.sleep(min(settings.GCS_TICK.get(), 0.5))
        return self._still_wanted(job, rnd, step, up) is None

    def finish(
        self,
        job: JobSpec,
        rnd: str,
        step: int,
        state: str,
        error: str,
        nbytes: int,
        seconds: float,
        entry: dict[str, Any] | None,
        digest: str = "",
    ) -> None:
        """Record an upload's outcome once: ``state`` (:data:`tierfs.core.rounds.DONE`,
        ``FAILED``, ``MISSING``), ``error`` (one line), ``nbytes`` sent in
        ``seconds``, in the status ``entry``; ``digest``: the manifest digest of the
        part uploaded (done). One node: the schedule's round ends (and earlier
        rounds' leftovers are tidied after a done one) and the schedule counts the
        bytes uploaded as the step's backed-up bytes; multi-node: the outcome goes
        to the coordinator with a heartbeat now."""
        if entry is not None:
            entry.update(node=state, seconds=round(seconds, 1), bytes=nbytes)
            if job.nodes <= 1 or state == S.FAILED:
                entry["state"] = S.COMPLETE if state == S.DONE else S.INCOMPLETE
        if job.nodes <= 1:
            S.finished(self.memory.state, rnd)
            if state == S.DONE:
                S.took(self.memory.state, step, job.node_rank, digest)
            if state != S.DONE or (entry is not None and entry.get("moved_from")):
                self.memory.untidy.append(rnd)
            if state == S.DONE and not (entry is not None and entry.get("moved_from")):
                self.spawn_index(job, rnd)
            if state == S.DONE and self.memory.untidy:
                # this node's earlier uploads are over (one at a time): their leftovers
                # are final
                names, self.memory.untidy = self.memory.untidy, []
                self.spawn_tidy(job, names)
            return
        # reported to the coordinator in the next Sync (repeated until a newer round)
        self.memory.outcome = S.Outcome(rnd, step, state, error, nbytes, round(seconds, 3), digest)
        if self.plane is not None:
            self.plane.heartbeat_now()

    def _move_round(
        self, job: JobSpec, rnd: str, step: int, entry: dict[str, Any] | None
    ) -> Shard | None:
        """One node: the round's step is gone (the cadence outran the backups); back up
        the newest step sealed since, into the same round (None: there is none)."""
        if self.memory.state.active != rnd:
            return None
        newer = [
            s
            for s in self.catalog.own_shards(job)
            if s.key.step > step and s.manifest.created >= self.memory.epoch
        ]
        if not newer:
            return None
        shard = newer[0]
        for line in S.superseded(self.memory.state, shard.key.step):
            self.lines.fail(line)
        self.memory.state.last_step = max(shard.key.step, self.memory.state.last_step or 0)
        self.memory.state.last_parts = ((shard.key.rank, shard.manifest.digest),)
        if entry is not None:
            entry["step"] = shard.key.step
            entry.setdefault("moved_from", []).append(step)
        log.info(
            "backup round %s: step %d is no longer held here; the round moves to step %d",
            rnd,
            step,
            shard.key.step,
        )
        return shard

    def spawn_index(self, job: JobSpec, rnd: str) -> None:
        """Write the index of the complete round ``rnd`` (a task, once per round;
        :mod:`tierfs.backup.round_index`). Node-rank 0 calls it when the coordinator
        reports the round complete, one node when its upload is done."""
        if self._nursery is None or (job.name, rnd) in self.indexed:
            return
        self.indexed.add((job.name, rnd))
        self._nursery.start_soon(self._index, job.name, rnd)

    async def _index(self, job: str, rnd: str) -> None:
        try:
            index = await self.access.call(
                lambda: self.access.get_backend().write_round_index(job, rnd)
            )
        except Exception as exc:  # restores then judge the round from its listing
            log.info("backup round %s: index not written: %s", rnd, describe_error(exc))
            return
        log.info("backup round %s: index written (%d parts)", rnd, len(index.parts))

    def spawn_tidy(self, job: JobSpec, names: list[str]) -> None:
        """Remove what the rounds ``names`` left behind (a task)."""
        if self._nursery is not None and names:
            self._nursery.start_soon(self._tidy, job.name, job.nodes, names)

    async def _tidy(self, job: str, nodes: int, names: list[str]) -> None:
        """Remove what failed or moved rounds left in the bucket (each judged again
        by :meth:`tierfs.backup.bucket.GcsBackend.tidy_round`)."""
        for name in names:
            try:
                n = await self.access.call(
                    lambda n=name: self.access.get_backend().tidy_round(job, n, nodes)
                )
            except Exception as exc:
                log.info("backup round %s: leftovers not removed: %s", name, describe_error(exc))
                continue
            if n:
                log.info(
                    "backup round %s: removed %d object(s) a failed or moved round left behind",
                    name,
                    n,
                )
