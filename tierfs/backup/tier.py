"""The GCS tier inside the node daemon: backup rounds, restores from the bucket,
``restore.version``, the bucket rendezvous (DESIGN.md "Durable plane" and
"Peer plane", PROTOCOL.md sections 4 to 6).

Pieces:

* :class:`GcsTier` (the agent's :class:`tierfs.node.agent.Tier`, trio thread). It
  sees the node through the ports of :mod:`tierfs.core.ports` (catalog, current
  job, reporter, the peer plane, this node's coordinator), handed to it by
  :func:`tierfs.daemon.build_node`.

  - Multi-node job with a peer plane: the coordinator decides the rounds.
    Node-rank 0's tier installs a :class:`tierfs.cluster.backup_schedule.RoundBook`
    in its coordinator (seeded from the bucket listing, so round names grow
    and a restarted coordinator does not back the same step up twice); the
    coordinator runs ``decide_round`` in its sync round and each node's
    ``Sync`` reply carries the round that node still has to upload. The
    node's peer tier hands that order to :meth:`GcsTier.on_backup_round`,
    which uploads this node's part in a worker thread and reports the
    outcome in its next ``Sync`` (:meth:`GcsTier.backup_outcome`). Node-rank
    0's tier also writes the coordinator's lines (a skipped step, an
    incomplete round) to ``replicator.errors``.
  - One node (no peer plane needed): the tier decides its rounds itself
    with :func:`tierfs.cluster.backup_schedule.decide_round`.
  - A multi-node job without a peer plane takes no backups (it says so).

  The uploading shard is pinned against retention; a withdrawn shard's
  upload is cancelled. Failures become a line in ``replicator.errors`` and
  the tier's status; training never waits. An upload that failed because the
  bucket did not answer is tried again (backoff, or at once when the bucket
  answers) while its round still wants it.
* The bucket's health: the check at mount is bounded by
  ``$TIERFS_GCS_START_DEADLINE`` (only "does not exist" fails the mount); a bucket
  problem is reported while it lasts -- requests waiting without an answer
  for ``$TIERFS_GCS_STALL_SECONDS``, or the last failed request -- and cleared by the
  next answer (:meth:`GcsTier.bucket_problem`, fed by the backend's
  :class:`tierfs.backup.bucket.BucketMonitor`); meanwhile the tier checks the
  bucket itself in the background.
* Restores. :meth:`GcsTier.read_bucket` reads what the bucket holds for a
  restore (``restore.version``'s round, else the newest rounds with every
  complete node part and why incomplete rounds are incomplete). With a
  coordinator, node-rank 0's tier installs it as the coordinator's bucket
  reader: the coordinator decides over every node's RAM and the bucket at
  once (no decision before the reader answered), and each node brings the
  parts it needs with :meth:`GcsTier.fetch_backup` (the peer cluster's
  :class:`tierfs.core.ports.BackupFetch`). Without one (one node, or no peer
  plane), :class:`tierfs.node.bucket_restore.GcsCluster` decides with the
  same rule on the node alone.
* ``restore.version`` is deleted by the deciding node once every node has
  sealed and replicated a newer step than the one restored through it.
* :class:`BucketRendezvous`: ``gs://<bucket>/<job>/.tierfs/nodes/<rank>``
  records for :class:`tierfs.replication.peer.PeerTier` when there is no
  ``--coordinator``.

Threads: every GCS call runs in ``trio.to_thread.run_sync`` behind capacity
limiters (one upload at a time, a few control calls); the coordinator's
hooks run in its gRPC thread with a bounded deadline, and hand lines for
``replicator.errors`` to the trio thread through a queue.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from tierfs.backup import layout as L
from tierfs.backup.bucket import (
    Cancelled,
    GcsBackend,
    GcsError,
    GcsSettings,
    RoundInfo,
    describe_error,
    is_transient,
)
from tierfs.cluster import backup_schedule as S
from tierfs.core import retry, settings
from tierfs.core.errors import BackupError
from tierfs.core.ports import Catalog, CoordinatorHooks, CurrentJob, PeerPlane, RamBudget, Reporter
from tierfs.core.status import (
    BackupRoundStatus,
    BackupStatus,
    BackupStepStatus,
    UploadStatus,
)
from tierfs.core.types import BucketPart, BucketView, RestorePlan
from tierfs.store.shards import Shard, ShardKey, ShardStore

if TYPE_CHECKING:
    from tierfs.core.control import JobSpec

log = logging.getLogger(__name__)


#: the bucket problem while the bucket has not answered since the mount
START_PROBLEM = "bucket unreachable at start"


class BackupCopyError(BackupError):
    """A backup round's copy of a shard cannot be used (one line: why)."""


def _complete_parts(info: RoundInfo) -> list[BucketPart]:
    """Every complete node part of an inspected round (pure)."""
    return [
        BucketPart(
            info.name, rank, step, part.backup.manifest.digest if part.backup is not None else ""
        )
        for (rank, step), part in sorted(info.parts.items())
        if part.complete
    ]


@dataclass
class _Upload:
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


class GcsTier:
    """The GCS tier of one node (see the module docstring).

    Args:
        spec: the bucket, or None (the tier is off and says so).
        catalog: the held shards; the tier registers its sealed and withdrawn
            listeners there.
        job: the current job (read only).
        reporter: ``replicator.errors``.
        shards: the store of committed shards (downloads are committed there).
        budget: the RAM budget (a download must fit).
        plane: the node's peer plane (multi-node rounds), or None without one.
        coordinator: this node's coordinator service (node-rank 0 installs its
            round book and bucket reader there), or None without ``--listen``.
        settings: transfer tuning (default :meth:`GcsSettings.from_env`).

    Attributes:
        cluster_last: (multi-node) the newest round the coordinator ordered,
            with its state, as the last ``Sync`` reply said.
        forced: (job, round, restored step, when) of a restore through
            ``restore.version``, until the file is deleted.
    """

    name = "gcs"

    def __init__(
        self,
        spec: L.BucketSpec | None,
        *,
        catalog: Catalog,
        job: CurrentJob,
        reporter: Reporter,
        shards: ShardStore,
        budget: RamBudget,
        plane: PeerPlane | None = None,
        coordinator: CoordinatorHooks | None = None,
        settings: GcsSettings | None = None,
    ) -> None:
        self.spec = spec
        self.catalog = catalog
        self.current = job
        self.reporter = reporter
        self.shards = shards
        self.budget = budget
        self.plane = plane
        self.coordinator = coordinator
        self.settings = settings or GcsSettings.from_env()
        self.backend: GcsBackend | None = None
        self.incarnation = uuid.uuid4().hex
        self.state = S.ScheduleState(started_at=time.time())
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=10)
        self.backed_up: dict[int, str] = {}
        self.last_error: str | None = None
        #: the current bucket problem (set by a failed request, cleared by an answer)
        self.retrying: str | None = None
        self._retrying_at = 0.0
        #: False while the bucket check at mount could not get an answer
        self.bucket_checked = True
        self._missing_reported = False
        self._stall_logged = False
        #: the round the coordinator last ordered this node into (multi-node)
        self._order: tuple[str, int] | None = None
        self.note: str | None = None
        self.forced: tuple[str, str, int, float] | None = None
        self.cluster_last: S.RoundView | None = None
        self._outcome: S.Outcome | None = None
        #: (round, step) orders already taken up (a round that moves is ordered again)
        self._ordered: collections.deque[tuple[str, int]] = collections.deque(maxlen=64)
        #: one node: rounds whose upload failed, tidied once a later round is done
        self._untidy: list[str] = []
        self._uploads: dict[ShardKey, _Upload] = {}
        self._job_id: tuple[str, int, int] | None = None
        #: after a failed GCS client creation: the next try waits (monotonic s)
        self._client_backoff: retry.Backoff | None = None
        self._client_retry_at = 0.0
        self._seeded = False
        self._seed_failed = False
        self._restored_here = False
        self._epoch = 0.0
        self._fallback_tried: dict[int, set[str]] = {}
        #: lines for replicator.errors from the coordinator's gRPC threads
        self._pending_errors: collections.deque[str] = collections.deque(maxlen=50)
        self._poke = trio.Event()
        self._control = trio.CapacityLimiter(2)
        self._upload_limiter = trio.CapacityLimiter(1)
        self._nursery: trio.Nursery | None = None
        self._backend_lock = threading.Lock()
        self._bounded: dict[float, GcsBackend] = {}
        catalog.on_sealed(self.on_sealed)
        catalog.on_withdrawn(self.on_withdrawn)

    # ------------------------------------------------------------------ helpers

    @property
    def enabled(self) -> bool:
        return self.spec is not None

    def _on_retry(self, exc: Exception) -> None:
        self._problem(describe_error(exc))

    def _problem(self, text: str) -> None:
        """Note a current bucket problem (any thread); an answer clears it.

        Until the bucket has answered once since the mount (``bucket_checked``),
        the problem keeps saying so: a later failure (the background check, a
        rendezvous write) adds its own line to "bucket unreachable at start"
        instead of replacing it."""
        if not self.bucket_checked and not text.startswith(START_PROBLEM):
            text = f"{START_PROBLEM}, still: {text}"
        self._retrying_at = time.monotonic()
        self.retrying = f"{text} (retrying, at {time.strftime('%H:%M:%S')})"

    def _monitor(self) -> Any:
        backend = self.backend
        return backend.monitor if backend is not None else None

    def _answered_since(self, when: float) -> bool:
        """The bucket answered a request after ``time.monotonic()`` time ``when``."""
        mon = self._monitor()
        return mon is not None and mon.last_answer > when

    def stalled(self) -> float:
        """Seconds requests have waited for the bucket without any answer, if at
        least ``$TIERFS_GCS_STALL_SECONDS``; else 0.0."""
        mon = self._monitor()
        waited = mon.stalled_for() if mon is not None else 0.0
        return waited if waited >= settings.GCS_STALL_SECONDS.get() else 0.0

    def bucket_problem(self) -> str | None:
        """The bucket's current problem as one line, or None: requests waiting
        without an answer (slow or stalled), else the last failure not followed
        by an answer (any thread)."""
        if self.retrying is not None and self._answered_since(self._retrying_at):
            self.retrying = None
        waited = self.stalled()
        if waited:
            mon = self._monitor()
            n = mon.in_flight() if mon is not None else 0
            line = f"bucket slow or stalled: no answer for {waited:.0f} s ({n} request(s) waiting)"
            return line if self.bucket_checked else f"{START_PROBLEM}, still: {line}"
        return self.retrying

    def get_backend(self) -> GcsBackend:
        """The backend, created on first use (blocking: credential discovery)."""
        with self._backend_lock:
            if self.backend is None:
                assert self.spec is not None
                self.backend = GcsBackend(
                    self.spec, settings=self.settings, on_retry=self._on_retry
                )
            return self.backend

    def bounded(self, deadline: float) -> GcsBackend:
        """The backend with requests that give up after ``deadline`` seconds (cached;
        blocking on first use)."""
        backend = self.get_backend()
        with self._backend_lock:
            b = self._bounded.get(deadline)
            if b is None:
                b = self._bounded[deadline] = backend.bounded(deadline)
            return b

    def _bucket_exists(self, deadline: float) -> bool:
        """Whether the bucket exists, asked within ``deadline`` seconds (blocking)."""
        return self.bounded(deadline).bucket_exists()

    async def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a blocking backend call in a worker thread (control limiter)."""
        async with self._control:
            return await trio.to_thread.run_sync(
                functools.partial(fn, *args, **kwargs), abandon_on_cancel=True
            )

    def _ok(self) -> None:
        self.retrying = None
        self.bucket_checked = True

    def _fail(self, message: str) -> None:
        """A line in ``replicator.errors`` and the status (trio thread)."""
        self.last_error = f"{time.strftime('%H:%M:%S')} {message}"
        self.reporter.error(message)

    def _fail_later(self, message: str) -> None:
        """:meth:`_fail` from another thread: written by the next tick."""
        self.last_error = f"{time.strftime('%H:%M:%S')} {message}"
        self._pending_errors.append(message)

    def multi(self, job: JobSpec) -> bool:
        """A multi-node job coordinated by the peer plane."""
        plane = self.plane
        return job.nodes > 1 and plane is not None and plane.active_job() is not None

    def coordinating(self, job: JobSpec) -> bool:
        """This node's coordinator serves ``job`` (it decides the rounds)."""
        return self.multi(job) and self.plane is not None and self.plane.serving

    def synced_step(self, job: JobSpec) -> int | None:
        """The newest step every node sealed and replicated (one node: sealed)."""
        if job.nodes <= 1:
            own = self.catalog.own_shards(job)
            return own[0].key.step if own else None
        return self.plane.synced_step() if self.plane is not None else None

    def decider(self, job: JobSpec) -> bool:
        """This node decides the rounds: one node, or the coordinator's node."""
        return job.nodes <= 1 or self.coordinating(job)

    # ------------------------------------------------------------------ Tier

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Install the coordinator's hooks, then decide and follow rounds until cancelled."""
        if not self.enabled:
            task_status.started()
            return
        await self._check_bucket()
        await self._install_coordinator_hooks()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._loop)
                nursery.start_soon(self._watch_bucket)
                task_status.started()
        finally:
            for up in self._uploads.values():
                up.cancel.set()

    async def _check_bucket(self) -> None:
        """Fail the mount for a bucket that does not exist; a bucket that does not
        answer within ``$TIERFS_GCS_START_DEADLINE`` seconds is reported (status,
        ``replicator.errors``) and checked again in the background.

        Raises:
            GcsError: the bucket does not exist (a typo would otherwise show up
                only as a stream of failed rounds).
        """
        assert self.spec is not None
        exists = None
        problem = "no answer"
        # the thread is abandoned if even the capped request outlives the deadline
        # (name resolution, for one, has no socket timeout)
        deadline = settings.GCS_START_DEADLINE.get()
        with trio.move_on_after(deadline + 1.0):
            try:
                exists = await trio.to_thread.run_sync(
                    lambda: self.bounded(deadline).bucket_exists(), abandon_on_cancel=True
                )
            except Exception as exc:  # unreachable now: training must not wait for it
                problem = describe_error(exc)
        if exists is None:
            self.bucket_checked = False
            self._problem(f"{START_PROBLEM} ({problem})")
            self._fail(
                f"{START_PROBLEM} ({problem}); mounted anyway, checking it again in the background"
            )
            return
        if not exists:
            raise GcsError(f"bucket {self.spec.bucket!r} does not exist")

    async def _watch_bucket(self) -> None:
        """While the bucket has a problem (or the check at mount got no answer):
        check it again, every ``$TIERFS_GCS_UPLOAD_RETRY_FIRST`` s doubling up to
        ``$TIERFS_GCS_UPLOAD_RETRY_MAX`` s, so the problem clears as soon as it answers even
        when nothing else calls it. A bucket that turns out not to exist is
        reported once. Policy ``gcs-bucket-check`` (:mod:`tierfs.core.retry`)."""
        backoff = retry.gcs_bucket_check().backoff()
        delay = backoff.next()
        while True:
            if self.bucket_checked and self.bucket_problem() is None:
                backoff = retry.gcs_bucket_check().backoff()
                delay = backoff.next()
                await trio.sleep(settings.GCS_TICK.get())
                continue
            since = time.monotonic()
            with trio.move_on_after(delay):
                while not self._answered_since(since):
                    await trio.sleep(min(settings.GCS_TICK.get(), 0.5))
            try:
                exists = await self.call(self._bucket_exists, settings.GCS_START_DEADLINE.get())
            except Exception as exc:
                if not self._answered_since(since):
                    self._problem(describe_error(exc))
                delay = backoff.next()
                continue
            if not exists:
                if not self._missing_reported:
                    self._missing_reported = True
                    self._fail(
                        f"bucket {self.spec.bucket!r} does not exist; backups "
                        "fail until it is created"
                    )
                self._problem(f"bucket {self.spec.bucket!r} does not exist")
                delay = backoff.policy.max_wait
                continue
            if not self.bucket_checked or self.retrying is not None:
                log.info("GCS tier: bucket %s answers again", self.spec)
            self._missing_reported = False
            self._ok()
            backoff = retry.gcs_bucket_check().backoff()
            delay = backoff.next()

    async def _locked(self, fn: Any) -> Any:
        """``fn(coordinator)`` under the coordinator's lock, waited for in a worker thread
        (a gRPC thread may hold it through a bucket lookup)."""
        servicer = self.coordinator
        assert servicer is not None
        return await trio.to_thread.run_sync(servicer.locked, fn)

    async def _install_coordinator_hooks(self) -> None:
        """The round book and the bucket reader in this node's coordinator (used only
        while this node serves it). Restore decisions wait for the reader."""
        servicer = self.coordinator
        if servicer is None:
            return
        timeout = settings.GCS_ROUND_TIMEOUT.get()
        await self._locked(lambda coord: coord.set_backups(S.RoundBook(timeout=timeout)))
        await trio.to_thread.run_sync(
            servicer.set_bucket_reader,
            functools.partial(
                self.read_bucket,
                deadline=settings.GCS_FALLBACK_DEADLINE.get(),
                report=self._fail_later,
            ),
        )
        log.info("GCS tier: the coordinator decides backup rounds and restores from %s", self.spec)

    def on_sealed(self, shard: Shard) -> None:
        """A step of this node was sealed: decide soon (trio thread)."""
        self._poke.set()

    def on_withdrawn(self, key: ShardKey) -> None:
        """A shard left the catalog: stop uploading it (its bytes changed)."""
        up = self._uploads.get(key)
        if up is not None:
            up.cancel.set()

    def pinned(self) -> set[ShardKey]:
        """Shards being uploaded (not those waiting to try again) and, multi-node, every
        step a backup order names or may soon name: the step of the open round
        (until the coordinator says it ended, also after this node's part is
        done), the synced step, and the steps this node reported replicated in
        its last two ``Sync`` calls -- the coordinator orders one of those."""
        keep = {k for k, u in self._uploads.items() if u.waiting_until is None}
        job = self.current.job
        if not self.enabled or job is None or job.nodes <= 1:
            return keep
        steps: set[int] = set()
        last = self.cluster_last
        done = last.step if last is not None else -1
        if last is not None and last.state == S.RUNNING:
            steps.add(last.step)
        if self._order is not None:
            steps.add(self._order[1])
        candidates = [self.synced_step(job)]
        if self.plane is not None:
            candidates += list(self.plane.reported_steps())
        steps |= {c for c in candidates if c is not None and c > done and c not in self.backed_up}
        for step in steps:
            key = ShardKey(job.name, job.node_rank, step)
            if key in self.catalog:
                keep.add(key)
        return keep

    def status(self) -> BackupStatus:
        """Bucket, role, uploads in flight, the last rounds and errors."""
        if not self.enabled:
            return BackupStatus.off()
        job = self.current.job
        multi = job is not None and self.multi(job)
        uploads = [
            UploadStatus(
                round=u.round,
                step=u.step,
                bytes_done=u.done,
                bytes_total=u.total,
                seconds=round(time.time() - u.started, 1),
                attempt=u.attempt,
                waiting_until=u.waiting_until,
            )
            for u in self._uploads.values()
        ]
        if multi and self.cluster_last is not None:
            c = self.cluster_last
            last: dict[str, Any] | None = {"round": c.round, "step": c.step, "state": c.state}
        else:
            last = self.history[-1] if self.history else None
        parts = [str(self.spec)]
        if uploads:
            u = uploads[0]
            pct = 100 * u.bytes_done / u.bytes_total if u.bytes_total else 100
            if u.waiting_until is not None:
                at = time.strftime("%H:%M:%S", time.localtime(u.waiting_until))
                parts.append(
                    f"step {u.step} of {u.round} waits for the bucket "
                    f"(attempt {u.attempt + 1} at {at} or when it answers)"
                )
            else:
                again = f", attempt {u.attempt}" if u.attempt > 1 else ""
                parts.append(f"uploading step {u.step} to {u.round} ({pct:.0f}%{again})")
        if last is not None:
            parts.append(f"last round {last['round']} step {last['step']}: {last['state']}")
        else:
            parts.append("no round yet")
        problem = self.bucket_problem()
        if problem:
            parts.append(f"bucket problem: {problem}")
        elif self.last_error:
            parts.append(f"last error: {self.last_error}")
        if self.note:
            parts.append(self.note)
        role = None
        if job is not None:
            role = "decides rounds" if self.decider(job) else "follows node-rank 0's rounds"
        minutes, steps = (
            S.intervals(job.backup_interval_minutes, job.backup_interval_steps)
            if job
            else (None, None)
        )
        active = None
        if multi:
            if self.cluster_last is not None and self.cluster_last.state == S.RUNNING:
                active = self.cluster_last.round
        else:
            active = self.state.active
        return BackupStatus(
            summary="; ".join(parts),
            enabled=True,
            bucket=str(self.spec),
            role=role,
            interval_minutes=minutes,
            interval_steps=steps,
            active_round=active,
            last_round=last["round"] if last else None,
            last_step=last["step"] if last else None,
            last_state=last["state"] if last else None,
            uploads=tuple(uploads),
            rounds=tuple(BackupRoundStatus(dict(h)) for h in self.history),
            last_error=self.last_error,
            retrying=self.retrying,
            problem=problem,
            stalled_seconds=round(self.stalled(), 1),
            bucket_checked=self.bucket_checked,
            note=self.note,
            restore_version_pending=list(self.forced) if self.forced else None,
            steps=tuple(
                BackupStepStatus(s, r) for s, r in sorted(self.backed_up.items(), reverse=True)
            ),
        )

    # ------------------------------------------------------------------ loop

    async def _loop(self) -> None:
        while True:
            try:
                await self._tick()
            except Exception:
                log.exception("GCS tier: tick failed")
            with trio.move_on_after(settings.GCS_TICK.get()):
                await self._poke.wait()
            self._poke = trio.Event()

    def _restoring(self) -> bool:
        return self.current.restoring()

    async def _tick(self) -> None:
        while self._pending_errors:
            self.reporter.error(self._pending_errors.popleft())
        waited = self.stalled()
        if waited and not self._stall_logged:
            self._stall_logged = True
            log.warning("GCS tier: %s", self.bucket_problem())
        elif not waited and self._stall_logged:
            self._stall_logged = False
            log.info("GCS tier: the bucket answers again")
        job = self.current.job
        if job is None or self.current.mode == "none":
            return
        ident = (job.name, job.nodes, job.node_rank)
        if ident != self._job_id:
            self._job_id = ident
            self.state = S.ScheduleState(started_at=time.time())
            self._seeded = False
            self.backed_up.clear()
            self.cluster_last = None
        if time.monotonic() < self._client_retry_at:
            return
        try:
            await self.call(self.get_backend)
        except Exception as exc:
            # credential discovery failing logs a warning per try: not every tick
            self.note = f"cannot create the GCS client: {describe_error(exc)}"
            if self._client_backoff is None:
                self._client_backoff = retry.gcs_bucket_check().backoff()
            self._client_retry_at = time.monotonic() + self._client_backoff.next()
            return
        self._client_backoff = None
        if self.multi(job):
            self.note = None
            if self.coordinating(job):
                await self._coordinate(job)
            return
        if job.nodes > 1:
            self.note = (
                "no backup rounds: a multi-node job needs the peer plane "
                "(--listen with --coordinator or the bucket rendezvous) to agree "
                "on them"
            )
            return
        self.note = None
        if self._restoring():
            return
        await self._decide(job)
        await self._maybe_delete_restore_version(job)

    # ------------------------------------------------------------------ coordinator (rank 0)

    async def _coordinate(self, job: JobSpec) -> None:
        """Node-rank 0 of a multi-node job: seed the coordinator's round book from the
        bucket, write its lines to replicator.errors, delete restore.version when due."""
        if self.coordinator is None:
            return
        book_job, nodes, seeded = await self._locked(
            lambda c: (
                (c.backups.job, c.backups.nodes, c.backups.seeded)
                if c.backups is not None
                else (None, 0, True)
            )
        )
        if book_job is not None and not seeded:
            try:
                newest, complete = await self._read_seed(book_job, nodes)
            except Exception as exc:
                if not self._seed_failed:
                    self._seed_failed = True
                    self._fail(
                        f"backup rounds wait: the bucket cannot be listed ({describe_error(exc)})"
                    )
            else:
                self._seed_failed = False
                self._ok()
                await self._locked(lambda c: c.backups.seed(book_job, newest, complete))
        for line in await self._locked(lambda c: c.backups.drain() if c.backups else []):
            self._fail(line)
        self._spawn_tidy(
            job, await self._locked(lambda c: c.backups.take_cleanup() if c.backups else [])
        )
        await self._maybe_delete_restore_version(job)

    async def _read_seed(self, job: str, nodes: int) -> tuple[str | None, tuple[str, int] | None]:
        """The bucket's newest round name and newest complete (round, step) of the last 3."""
        backend = self.bounded(settings.GCS_LOOKUP_DEADLINE.get())
        names = await self.call(backend.list_round_names, job)
        complete = None
        for name in names[:3]:
            info = await self.call(backend.inspect_round, job, name, nodes)
            if info.complete_step is not None:
                complete = (name, info.complete_step)
                break
        return (names[0] if names else None), complete

    # ------------------------------------------------------------------ deciding (one node)

    async def _decide(self, job: JobSpec) -> None:
        step = self.synced_step(job)
        shard = (
            self.catalog.get(ShardKey(job.name, job.node_rank, step)) if step is not None else None
        )
        if shard is None or shard.manifest.created < self._epoch:
            step = None  # not held here, or sealed before this job's restore
        minutes, steps = S.intervals(job.backup_interval_minutes, job.backup_interval_steps)
        now = time.time()
        requested = bool(shard and shard.manifest.backup_requested)
        decision = S.decide_round(
            self.state,
            now=now,
            step=step,
            backup_requested=requested,
            interval_minutes=minutes,
            interval_steps=steps,
        )
        if decision.action == S.SKIP:
            for line in S.skipped(self.state, decision):
                self._fail(line)
            return
        if decision.action != S.START:
            return
        if not self._seeded:
            # a restarted daemon: never redo a step the bucket already holds, never
            # reuse a round name, count the period from the newest round
            try:
                newest, complete = await self._read_seed(job.name, job.nodes)
            except Exception as exc:
                self._fail(f"backup of step {decision.step} not started: {describe_error(exc)}")
                return
            if newest is not None:
                self.state.last_round = max(newest, self.state.last_round or "")
            S.apply_seed(self.state, complete, after_restore=self._restored_here)
            self._seeded = True
            decision = S.decide_round(
                self.state,
                now=now,
                step=step,
                backup_requested=requested,
                interval_minutes=minutes,
                interval_steps=steps,
            )
            if decision.action != S.START:
                return
        assert decision.round is not None and decision.step is not None
        for line in S.started(self.state, decision, now):
            self._fail(line)
        log.info("backup round %s: step %d (%s)", decision.round, decision.step, decision.reason)
        self.history.append(
            {
                "round": decision.round,
                "step": decision.step,
                "state": "running",
                "started": now,
                "reason": decision.reason,
            }
        )
        self._spawn_upload(job, decision.round, decision.step)

    def _history(self, rnd: str) -> dict[str, Any] | None:
        return next((h for h in reversed(self.history) if h["round"] == rnd), None)

    # ------------------------------------------------------------------ following (BackupOrders)

    def backup_outcome(self) -> S.Outcome | None:
        """This node's outcome of the last round it was ordered into (trio thread)."""
        return self._outcome

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
        self.cluster_last = last
        self._order = order
        if last is not None and last.state != S.RUNNING:
            entry = self._history(last.round)
            if entry is not None:
                entry["state"] = last.state
        if order is None or not self.enabled:
            return
        rnd, step = order
        for u in self._uploads.values():
            if u.round == rnd and u.step != step:  # the round moved on
                u.superseded = True
                u.cancel.set()
        if order in self._ordered or any(
            u.round == rnd and u.step == step for u in self._uploads.values()
        ):
            return
        self._ordered.append(order)
        self.state.last_round = rnd
        moved = any(o[0] == rnd and o[1] != step for o in self._ordered)
        log.info(
            "backup round %s: the coordinator orders step %d%s%s",
            rnd,
            step,
            " (the round moved to a newer step)" if moved else "",
            "; this node's shard matches its data-parallel uploader's" if dedup else "",
        )
        entry = self._history(rnd)
        if entry is not None:
            entry.update(step=step, state="running")
        else:
            self.history.append(
                {
                    "round": rnd,
                    "step": step,
                    "state": "running",
                    "started": time.time(),
                    "reason": "ordered by the coordinator",
                }
            )
        self._spawn_upload(job, rnd, step, dedup)

    # ------------------------------------------------------------------ uploading

    def _spawn_upload(self, job: JobSpec, rnd: str, step: int, dedup: bool = False) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(self._upload, job, rnd, step, dedup)

    def _still_wanted(self, job: JobSpec, rnd: str, step: int, up: _Upload) -> str | None:
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
            if self.multi(job) and self._order != (rnd, step):
                return "the coordinator no longer orders the round"
        elif self.state.active != rnd:
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
        entry = self._history(rnd)
        up = _Upload(rnd, step, 0, threading.Event(), time.time())
        backoff = retry.gcs_upload().backoff()
        try:
            while True:
                shard = self.catalog.get(key)
                if shard is None and job.nodes <= 1:
                    shard = self._move_round(job, rnd, step, entry)
                    if shard is not None:
                        if self._uploads.get(key) is up:
                            del self._uploads[key]
                        step, key, up.step = shard.key.step, shard.key, shard.key.step
                if shard is None:
                    msg = f"backup round {rnd}: step {step} is no longer held on this node"
                    if job.nodes > 1:
                        log.info("%s; the coordinator moves the round to a newer step", msg)
                        self._finish(
                            job, rnd, step, S.MISSING, msg, up.done, time.time() - up.started, None
                        )
                        return
                    self._fail(msg)
                    self._finish(
                        job, rnd, step, S.FAILED, msg, up.done, time.time() - up.started, entry
                    )
                    return
                up.total, up.done, up.waiting_until = shard.bytes, 0, None
                self._uploads[key] = up
                try:
                    async with self._upload_limiter:
                        if up.cancel.is_set():
                            raise Cancelled("upload cancelled")
                        backend = await self.call(self.get_backend)
                        result = await trio.to_thread.run_sync(
                            functools.partial(
                                backend.upload_shard,
                                shard,
                                rnd,
                                nodes=job.nodes,
                                data_parallelism=job.assume_data_parallelism,
                                dedup=dedup,
                                cancel=up.cancel,
                                on_bytes=up.add,
                            ),
                            abandon_on_cancel=True,
                        )
                except Cancelled:
                    if up.superseded:
                        log.info(
                            "backup of step %d to round %s stopped: the round moved to "
                            "a newer step",
                            step,
                            rnd,
                        )
                        return
                    msg = (
                        f"backup of step {step} to round {rnd} stopped: the step was "
                        "written to after it was sealed"
                    )
                    self._fail(msg)
                    self._finish(
                        job, rnd, step, S.FAILED, msg, up.done, time.time() - up.started, entry
                    )
                    return
                except Exception as exc:
                    if up.superseded:
                        log.info(
                            "backup of step %d to round %s stopped: the round moved to "
                            "a newer step",
                            step,
                            rnd,
                        )
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
                        self._fail(msg)
                        self._finish(
                            job, rnd, step, S.FAILED, msg, up.done, time.time() - up.started, entry
                        )
                        return
                    delay = backoff.next()
                    msg += f"; trying again within {delay:.0f} s or when the bucket answers"
                    if up.attempt == 1:
                        self._fail(msg)  # one line in replicator.errors per round
                    else:
                        self.last_error = f"{time.strftime('%H:%M:%S')} {msg}"
                        log.info("%s (attempt %d)", msg, up.attempt)
                    if not self.bucket_problem():
                        self._problem(describe_error(exc))
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
                        self._fail(msg)
                        self._finish(
                            job, rnd, step, S.FAILED, msg, up.done, time.time() - up.started, entry
                        )
                        return
                    up.attempt += 1
                    continue
                self._ok()
                self.backed_up[step] = rnd
                for old in sorted(self.backed_up)[:-8]:
                    del self.backed_up[old]
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
                self._finish(
                    job, rnd, step, S.DONE, "", result.bytes, time.time() - up.started, entry
                )
                return
        finally:
            up.cancel.set()
            if self._uploads.get(key) is up:
                del self._uploads[key]
            self._poke.set()

    async def _pause(self, job: JobSpec, rnd: str, step: int, up: _Upload, delay: float) -> bool:
        """Wait up to ``delay`` seconds before the next attempt, unpinned; end early
        when the bucket answers or the shard leaves the catalog (the caller then
        reports it). False if the upload is no longer wanted."""
        since = time.monotonic()
        up.waiting_until = time.time() + delay
        key = ShardKey(job.name, job.node_rank, step)
        with trio.move_on_after(delay):
            while not self._answered_since(since) and key in self.catalog:
                if self._still_wanted(job, rnd, step, up) is not None:
                    return False
                await trio.sleep(min(settings.GCS_TICK.get(), 0.5))
        return self._still_wanted(job, rnd, step, up) is None

    def _finish(
        self,
        job: JobSpec,
        rnd: str,
        step: int,
        state: str,
        error: str,
        nbytes: int,
        seconds: float,
        entry: dict[str, Any] | None,
    ) -> None:
        if entry is not None:
            entry.update(node=state, seconds=round(seconds, 1), bytes=nbytes)
            if job.nodes <= 1 or state == S.FAILED:
                entry["state"] = S.COMPLETE if state == S.DONE else S.INCOMPLETE
        if job.nodes <= 1:
            S.finished(self.state, rnd)
            if state != S.DONE or (entry is not None and entry.get("moved_from")):
                self._untidy.append(rnd)
            if state == S.DONE and self._untidy:
                # this node's earlier uploads are over (one at a time): their leftovers
                # are final
                names, self._untidy = self._untidy, []
                self._spawn_tidy(job, names)
            return
        # reported to the coordinator in the next Sync (repeated until a newer round)
        self._outcome = S.Outcome(rnd, step, state, error, nbytes, round(seconds, 3))
        if self.plane is not None:
            self.plane.heartbeat_now()

    def _move_round(
        self, job: JobSpec, rnd: str, step: int, entry: dict[str, Any] | None
    ) -> Shard | None:
        """One node: the round's step is gone (the cadence outran the backups); back up
        the newest step sealed since, into the same round (None: there is none)."""
        if self.state.active != rnd:
            return None
        newer = [
            s
            for s in self.catalog.own_shards(job)
            if s.key.step > step and s.manifest.created >= self._epoch
        ]
        if not newer:
            return None
        shard = newer[0]
        for line in S.superseded(self.state, shard.key.step):
            self._fail(line)
        self.state.last_step = max(shard.key.step, self.state.last_step or 0)
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

    def _spawn_tidy(self, job: JobSpec, names: list[str]) -> None:
        if self._nursery is not None and names:
            self._nursery.start_soon(self._tidy, job.name, job.nodes, names)

    async def _tidy(self, job: str, nodes: int, names: list[str]) -> None:
        """Remove what failed or moved rounds left in the bucket (each judged again
        by :meth:`tierfs.backup.bucket.GcsBackend.tidy_round`)."""
        for name in names:
            try:
                n = await self.call(lambda n=name: self.get_backend().tidy_round(job, n, nodes))
            except Exception as exc:
                log.info("backup round %s: leftovers not removed: %s", name, describe_error(exc))
                continue
            if n:
                log.info(
                    "backup round %s: removed %d object(s) a failed or moved round left behind",
                    name,
                    n,
                )

    # ------------------------------------------------------------------ restore

    def note_restored(self, job: JobSpec, plan: RestorePlan, forced: str | None) -> None:
        """Record a finished restore plan (trio thread): the one-node schedule restarts
        from it (:func:`tierfs.cluster.backup_schedule.restart_timeline`); a restore
        through ``restore.version`` is remembered for its deletion."""
        if self._job_id != (job.name, job.nodes, job.node_rank):
            self._job_id = (job.name, job.nodes, job.node_rank)
            self.state = S.ScheduleState(started_at=time.time())
            self.backed_up.clear()
            self.cluster_last = None
        self._seeded = False
        self._restored_here = True
        # steps sealed before the restore belong to the old timeline (see _decide)
        self._epoch = time.time()
        self.state = S.restart_timeline(
            self.state, backup=plan.backup, step=plan.step, now=self._epoch
        )
        if forced is not None:
            self.forced = (job.name, forced, plan.step or 0, time.time())

    async def fetch_backup(
        self, agent: Any, job: JobSpec, step: int, backup: str, digest: str = ""
    ) -> Shard:
        """Bring this node's shard of ``step`` from round ``backup``
        (:class:`tierfs.core.ports.BackupFetch`): the node's own copy when it holds the
        same bytes, else a verified download. ``digest``: the bytes the decision
        chose ("": any). ``agent``: the restoring node (``verify_shard``,
        ``restore_state``).

        Returns:
            the committed shard (in the catalog).

        Raises:
            BackupCopyError: one line why this round's copy cannot be used (corrupt,
                incomplete, other bytes, unreadable, no room).
        """
        key = ShardKey(job.name, job.node_rank, step)
        try:
            backend = await self.call(self.get_backend)
            info = await self.call(
                self.bounded(settings.GCS_LOOKUP_DEADLINE.get()).inspect_round,
                job.name,
                backup,
                job.nodes,
            )
        except Exception as exc:
            raise BackupCopyError(
                f"backup round {backup} cannot be read: {describe_error(exc)}"
            ) from None
        part = info.parts.get((job.node_rank, step))
        if (
            digest
            and part is not None
            and part.backup is not None
            and part.backup.manifest.digest != digest
        ):
            raise BackupCopyError(
                f"backup round {backup} holds other bytes of step {step} for rank {job.node_rank}"
            )
        local = self.catalog.get(key)
        if (
            local is not None
            and part is not None
            and part.backup is not None
            and part.backup.manifest.digest == local.manifest.digest
            and await agent.verify_shard(local)
        ):
            log.info("restore: step %d of round %s is already here", step, backup)
            return local
        cancel = threading.Event()
        up = _Upload(backup, step, part.bytes if part else 0, cancel, time.time())
        agent.restore_state.update(
            {"phase": f"downloading step {step} from backup round {backup}", "source": "gcs"}
        )
        try:
            async with self._upload_limiter:
                shard = await trio.to_thread.run_sync(
                    functools.partial(
                        backend.restore_shard,
                        self.shards,
                        job.name,
                        backup,
                        job.node_rank,
                        step,
                        info=info,
                        framework=job.framework,
                        cancel=cancel,
                        on_bytes=up.add,
                        free_bytes=self.budget.free(),
                    ),
                    abandon_on_cancel=True,
                )
        except Exception as exc:
            raise BackupCopyError(
                f"step {step} of node-rank {job.node_rank} from backup "
                f"round {backup} failed: {describe_error(exc)}"
            ) from None
        finally:
            cancel.set()
        self.catalog.add(shard)
        self._ok()
        log.info(
            "restored step %d of rank %d from backup round %s (%d bytes, verified)",
            step,
            job.node_rank,
            backup,
            shard.bytes,
        )
        return shard

    def read_bucket(
        self,
        job: str,
        nodes: int,
        depth: int = 1,
        *,
        deadline: float | None = None,
        report: Callable[[str], None] | None = None,
    ) -> BucketView:
        """What the bucket holds for a restore of ``job`` with ``nodes`` nodes (blocking;
        the coordinator's reader, or the node's own on one node).

        ``restore.version`` first: if it names a round, only that round (its
        step complete for every node, or why it cannot be restored). Else the
        rounds newest first until ``depth`` complete ones were read, with
        every complete node part found and, for each round without a complete
        step, why. Each request gives up after ``deadline`` seconds (default
        ``$TIERFS_GCS_LOOKUP_DEADLINE``).

        Returns:
            the view; a bucket that cannot be read gives a view with ``error``
            (and ``report(line)`` is called with a line for replicator.errors).
        """
        try:
            backend = self.bounded(
                settings.GCS_LOOKUP_DEADLINE.get() if deadline is None else deadline
            )
        except Exception as exc:
            return self._unreadable(
                f"cannot create the GCS client: {describe_error(exc)}", depth, report
            )
        try:
            forced = backend.read_restore_version(job)
        except Exception as exc:
            return self._unreadable(
                f"cannot read restore.version from {self.spec} ({describe_error(exc)})",
                depth,
                report,
            )
        try:
            if forced is not None:
                choice = backend.choose_restore(job, nodes)
                if choice.forced:
                    log.info("restore: %s", choice.reason)
                    info = choice.info
                    parts = _complete_parts(info) if info is not None else []
                    return BucketView(
                        tuple(p for p in parts if p.step == choice.step),
                        rounds=(forced,),
                        forced=forced,
                        forced_step=choice.step,
                        forced_problem=None if choice.step is not None else choice.reason,
                        depth=depth,
                    )
            names = backend.list_round_names(job)
            parts = []
            incomplete = []
            read = []
            complete = 0
            for name in names:
                if complete >= depth:
                    break
                info = backend.inspect_round(job, name, nodes)
                read.append(name)
                parts.extend(_complete_parts(info))
                if info.complete_step is not None:
                    complete += 1
                elif info.parts:
                    incomplete.append(
                        (name, info.step_for_display(), "; ".join(info.problems()[:3]))
                    )
        except Exception as exc:
            return self._unreadable(
                f"the backup rounds of {self.spec}{job} could not be "
                f"listed ({describe_error(exc)})",
                depth,
                report,
            )
        self._ok()
        return BucketView(
            tuple(parts),
            tuple(incomplete),
            tuple(read),
            exhausted=len(read) == len(names),
            depth=depth,
        )

    def _unreadable(
        self, line: str, depth: int, report: Callable[[str], None] | None
    ) -> BucketView:
        log.warning("restore: %s", line)
        if report is not None:
            report(f"restore: {line}; deciding without the bucket")
        return BucketView(error=line, depth=depth)

    # ------------------------------------------------------------------ restore.version

    async def _maybe_delete_restore_version(self, job: JobSpec) -> None:
        if self.forced is None or self.forced[0] != job.name:
            return
        _job, rnd, step, since = self.forced
        synced = self.synced_step(job)
        if synced is None or synced <= step:
            return
        own = self.catalog.get(ShardKey(job.name, job.node_rank, synced))
        if own is None or own.manifest.created < since:
            return  # a sync round from before that restore
        try:
            existed = await self.call(self.get_backend().delete_restore_version, job.name)
        except Exception as exc:
            log.info("deleting restore.version: %s", describe_error(exc))
            return
        self.forced = None
        if existed:
            log.info(
                "restore.version (%s) deleted: every node sealed and replicated step %d "
                "after restoring step %d",
                rnd,
                synced,
                step,
            )


# ---------------------------------------------------------------------- rendezvous


class BucketRendezvous:
    """The bucket rendezvous of :class:`tierfs.replication.peer.PeerTier` (DESIGN.md "Peer plane").

    Records live at ``gs://<bucket>/[<prefix>/]<job>/.tierfs/nodes/<rank>``
    (:func:`tierfs.backup.layout.rendezvous_record`: address, rank,
    incarnation, time written). Both calls run in the tier's worker threads
    and give up after ``deadline`` seconds of retries; the peer tier polls
    again and decides whether a record is current (it probes the address).

    Args:
        tier: the node's GCS tier (backend, limiter).
        deadline: seconds one read or write keeps retrying.
    """

    def __init__(self, tier: GcsTier, deadline: float | None = None) -> None:
        self.tier = tier
        self.deadline = settings.GCS_RENDEZVOUS_DEADLINE.get() if deadline is None else deadline

    def where(self, job: str, rank: int) -> str:
        """``gs://`` name of node ``rank``'s record (for messages)."""
        spec = self.tier.spec
        assert spec is not None
        return f"gs://{spec.bucket}/{spec.rendezvous(job, rank)}"

    async def publish(self, job: str, rank: int, address: str, incarnation: str) -> None:
        """Write this node's record.

        Raises:
            RuntimeError: one line (bucket unreachable, access denied...).
        """

        def work() -> None:
            self.tier.bounded(self.deadline).publish_address(
                job, rank, address, incarnation=incarnation
            )

        try:
            await self.tier.call(work)
        except Exception as exc:
            raise RuntimeError(describe_error(exc)) from None

    async def lookup(self, job: str, rank: int) -> tuple[str, str] | None:
        """Node ``rank``'s record as (address, incarnation), None if absent or malformed.

        Raises:
            RuntimeError: one line (bucket unreachable...).
        """
        try:
            rec = await self.tier.call(
                lambda: self.tier.bounded(self.deadline).read_address(job, rank)
            )
        except Exception as exc:
            raise RuntimeError(describe_error(exc)) from None
        return (rec.address, rec.incarnation) if rec is not None else None


# ---------------------------------------------------------------------- wiring


def preflight_bucket(bucket: str, deadline: float | None = None) -> str | None:
    """Check ``--bucket NAME[/PREFIX]`` before a mount creates anything (blocking).

    For ``tierfs mount``, so that a bucket the daemon would refuse fails the
    command before the ram-dir is created. The daemon checks again at start
    (:meth:`GcsTier._check_bucket`), with the same rule.

    Args:
        deadline: seconds the check may wait for the bucket (default
            ``$TIERFS_GCS_START_DEADLINE``).

    Returns:
        a one-line error for an invalid name or a bucket that definitely does
        not exist; None if it exists or did not answer in time (an
        unreachable bucket never stops a mount).
    """
    try:
        spec = L.parse_bucket(bucket)
    except L.LayoutError as exc:
        return f"--bucket: {exc}"
    try:
        backend = GcsBackend(spec, widen_pool=False).bounded(
            settings.GCS_START_DEADLINE.get() if deadline is None else deadline
        )
        exists = backend.bucket_exists()
    except Exception as exc:  # unreachable, credentials: the daemon reports it
        log.info("bucket check before mounting: %s", describe_error(exc))
        return None
    return None if exists else f"bucket {spec.bucket!r} does not exist"
