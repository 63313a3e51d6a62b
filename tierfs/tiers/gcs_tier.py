"""The GCS tier inside the node daemon: backup rounds, restores from the bucket,
``restore.version`` (DESIGN.md "Durable plane", PROTOCOL.md sections 4 and 5).

Pieces:

* :class:`GcsTier` (the agent's :class:`tierfs.agent.Tier`, trio thread). Its
  loop decides rounds on node-rank 0 (:mod:`tierfs.tiers.gcs_schedule`: every
  ``backup-interval-minutes``/``-steps`` or at once for ``_BACKUP_REQUESTED``,
  never while the previous round runs) for the newest step every node has
  sealed and replicated (the peer tier's sync round; one node: its newest
  sealed step), and uploads this node's part of each round
  (:meth:`tierfs.tiers.gcs.GcsBackend.upload_shard`) in a worker thread. The
  shard is pinned against retention while it uploads; a withdrawn shard's
  upload is cancelled. Failures become a line in ``replicator.errors`` and
  the tier's status; training never waits.
* How a round reaches the other nodes: node-rank 0 writes the order to
  ``gs://<bucket>/<job>/.tierfs/rounds/order``; the others poll it, upload,
  and report their outcome to ``.tierfs/rounds/<round>/<rank>``, which
  node-rank 0 watches to know when the round is over. (The coordinator's
  ``Sync`` reply does not carry round orders yet; when it does, only
  :meth:`GcsTier.order_round` has to be called from there.)
* :class:`GcsCluster` (wraps the agent's :class:`tierfs.agent.Cluster`): if
  ``restore.version`` exists, every node restores exactly that round (or
  nothing, with a line in ``replicator.errors``: no fallback); else the
  inner cluster decides, with the bucket as fallback: through the
  coordinator's ``fallback`` hook (node-rank 0) and the peer cluster's
  ``fetch_backup`` hook for a multi-node job, directly on one node.
* ``restore.version`` is deleted by node-rank 0 once every node has sealed
  and replicated a newer step than the one restored through it.

Threads: every GCS call runs in ``trio.to_thread.run_sync`` behind capacity
limiters (one upload at a time, a few control calls); the coordinator
fallback runs in the coordinator's gRPC thread with a bounded deadline.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from tierfs.config import ConfigError
from tierfs.tiers import gcs_layout as L
from tierfs.tiers import gcs_schedule as S
from tierfs.tiers.gcs import (
    Cancelled,
    GcsBackend,
    GcsSettings,
    describe_error,
)
from tierfs.tiers.local import Shard, ShardKey

if TYPE_CHECKING:
    from tierfs.agent import NodeAgent, RestorePlan
    from tierfs.control import JobSpec

log = logging.getLogger(__name__)


def _env(name: str, default: float) -> float:
    try:
        return float(os.environ[name])
    except (KeyError, ValueError):
        return default


#: seconds between the tier's decisions (also woken by seals)
TICK = _env("TIERFS_GCS_TICK", 1.0)
#: seconds between polls of the round order on nodes other than node-rank 0
ORDER_POLL = _env("TIERFS_GCS_ORDER_POLL", 2.0)
#: a round not finished by every node after this many seconds is given up
ROUND_TIMEOUT = _env("TIERFS_GCS_ROUND_TIMEOUT", 1800.0)
#: retry deadline of the coordinator's bucket lookup (it holds the coordinator's lock)
FALLBACK_DEADLINE = _env("TIERFS_GCS_FALLBACK_DEADLINE", 30.0)
#: retry deadline of reading restore.version and choosing a backup at restore time
RESTORE_LOOKUP_DEADLINE = _env("TIERFS_GCS_LOOKUP_DEADLINE", 20.0)


@dataclass
class _Upload:
    """An upload of this node's part of a round (trio thread owns it)."""

    round: str
    step: int
    total: int
    cancel: threading.Event
    started: float
    done: int = 0

    def add(self, n: int) -> None:  # any thread; a lost increment only skews the status
        self.done += n


class GcsTier:
    """The GCS tier of one node (see the module docstring).

    Args:
        agent: the node agent.
        spec: the bucket, or None (the tier is off and says so).
        settings: transfer tuning (default :meth:`GcsSettings.from_env`).
    """

    name = "gcs"

    def __init__(self, agent: NodeAgent, spec: L.BucketSpec | None,
                 settings: GcsSettings | None = None) -> None:
        self.agent = agent
        self.spec = spec
        self.settings = settings or GcsSettings.from_env()
        self.backend: GcsBackend | None = None
        self.incarnation = uuid.uuid4().hex
        self.state = S.ScheduleState(started_at=time.time())
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=10)
        self.backed_up: dict[int, str] = {}
        self.last_error: str | None = None
        self.retrying: str | None = None
        self.note: str | None = None
        #: (job, round, restored step, when): a restore through restore.version
        self.forced: tuple[str, str, int, float] | None = None
        self._uploads: dict[ShardKey, _Upload] = {}
        self._job_id: tuple[str, int, int] | None = None
        self._order_seen: str | None = None
        self._seeded = False
        self._restored_here = False
        self._epoch = 0.0
        self._order_checked = 0.0
        self._statuses_checked = 0.0
        self._pending_status: list[tuple[str, str, int, bytes]] = []
        self._fallback_tried: dict[int, set[str]] = {}
        self._poke = trio.Event()
        self._control = trio.CapacityLimiter(2)
        self._upload_limiter = trio.CapacityLimiter(1)
        self._nursery: trio.Nursery | None = None
        self._backend_lock = threading.Lock()
        self._bounded: dict[float, GcsBackend] = {}

    # ------------------------------------------------------------------ helpers

    @property
    def enabled(self) -> bool:
        return self.spec is not None

    def _peer(self) -> Any:
        return next((t for t in self.agent.tiers if getattr(t, "name", "") == "peer"), None)

    def _on_retry(self, exc: Exception) -> None:
        self.retrying = f"{describe_error(exc)} (retrying, at {time.strftime('%H:%M:%S')})"

    def get_backend(self) -> GcsBackend:
        """The backend, created on first use (blocking: credential discovery)."""
        with self._backend_lock:
            if self.backend is None:
                assert self.spec is not None
                self.backend = GcsBackend(self.spec, settings=self.settings,
                                          on_retry=self._on_retry)
            return self.backend

    def bounded(self, deadline: float) -> GcsBackend:
        """The backend with requests that give up after ``deadline`` seconds (cached)."""
        backend = self.get_backend()
        with self._backend_lock:
            b = self._bounded.get(deadline)
            if b is None:
                b = self._bounded[deadline] = backend.bounded(deadline)
            return b

    async def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a blocking backend call in a worker thread (control limiter)."""
        async with self._control:
            return await trio.to_thread.run_sync(functools.partial(fn, *args, **kwargs),
                                                 abandon_on_cancel=True)

    def _ok(self) -> None:
        self.retrying = None

    def _fail(self, message: str) -> None:
        self.last_error = f"{time.strftime('%H:%M:%S')} {message}"
        self.agent.report_error(message)

    def multi(self, job: JobSpec) -> bool:
        """A multi-node job coordinated by the peer plane."""
        peer = self._peer()
        return job.nodes > 1 and peer is not None and peer.active_job() is not None

    def synced_step(self, job: JobSpec) -> int | None:
        """The newest step every node sealed and replicated (one node: sealed)."""
        if job.nodes <= 1:
            own = self.agent.own_shards(job)
            return own[0].key.step if own else None
        peer = self._peer()
        if peer is None:
            return None
        step = peer.sync.get("step")
        return int(step) if step is not None and step >= 0 else None

    def decider(self, job: JobSpec) -> bool:
        return job.node_rank == 0

    # ------------------------------------------------------------------ Tier

    async def run(self, agent: NodeAgent,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Install the restore hooks, then decide and follow rounds until cancelled."""
        if not self.enabled:
            task_status.started()
            return
        self._install_coordinator_fallback()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._loop)
                task_status.started()
        finally:
            for up in self._uploads.values():
                up.cancel.set()

    def _install_coordinator_fallback(self) -> None:
        peer = self._peer()
        servicer = getattr(peer, "coordinator", None) if peer is not None else None
        coord = getattr(servicer, "coordinator", None)
        if coord is not None and hasattr(coord, "fallback"):
            coord.fallback = self.coordinator_fallback
            log.info("GCS tier: the coordinator falls back to %s", self.spec)

    def on_sealed(self, shard: Shard) -> None:
        """A step of this node was sealed: decide soon (trio thread)."""
        self._poke.set()

    def on_withdrawn(self, key: ShardKey) -> None:
        """A shard left the catalog: stop uploading it (its bytes changed)."""
        up = self._uploads.get(key)
        if up is not None:
            up.cancel.set()

    def pinned(self) -> set[ShardKey]:
        """Shards being uploaded, and (multi-node) the synced step a round may order next."""
        keep = set(self._uploads)
        job = self.agent.job
        if self.enabled and job is not None and job.nodes > 1:
            step = self.synced_step(job)
            if step is not None:
                key = ShardKey(job.name, job.node_rank, step)
                if key in self.agent.catalog and (self.state.last_step or -1) < step:
                    keep.add(key)
        return keep

    def status(self) -> dict[str, Any]:
        """Bucket, role, uploads in flight, the last rounds and errors."""
        if not self.enabled:
            return {"summary": "off (no --bucket)", "enabled": False, "steps": []}
        job = self.agent.job
        uploads = [{"round": u.round, "step": u.step, "bytes_done": u.done,
                    "bytes_total": u.total, "seconds": round(time.time() - u.started, 1)}
                   for u in self._uploads.values()]
        last = self.history[-1] if self.history else None
        parts = [str(self.spec)]
        if uploads:
            u = uploads[0]
            pct = 100 * u["bytes_done"] / u["bytes_total"] if u["bytes_total"] else 100
            parts.append(f"uploading step {u['step']} to {u['round']} ({pct:.0f}%)")
        if last is not None:
            parts.append(f"last round {last['round']} step {last['step']}: {last['state']}")
        if self.retrying:
            parts.append(f"bucket problem: {self.retrying}")
        elif self.last_error:
            parts.append(f"last error: {self.last_error}")
        if self.note:
            parts.append(self.note)
        role = None
        if job is not None:
            role = ("decides rounds" if self.decider(job)
                    else "follows node-rank 0's rounds")
        minutes, steps = (S.intervals(job.backup_interval_minutes, job.backup_interval_steps)
                          if job else (None, None))
        return {
            "summary": "; ".join(parts), "enabled": True, "bucket": str(self.spec),
            "role": role, "interval_minutes": minutes, "interval_steps": steps,
            "active_round": self.state.active, "last_round": self.state.last_round,
            "last_step": self.state.last_step, "uploads": uploads,
            "rounds": list(self.history), "last_error": self.last_error,
            "retrying": self.retrying, "note": self.note,
            "restore_version_pending": list(self.forced) if self.forced else None,
            "steps": [{"step": s, "where": [f"gcs:{r}"]} for s, r in
                      sorted(self.backed_up.items(), reverse=True)],
        }

    # ------------------------------------------------------------------ loop

    async def _loop(self) -> None:
        while True:
            try:
                await self._tick()
            except Exception:
                log.exception("GCS tier: tick failed")
            with trio.move_on_after(TICK):
                await self._poke.wait()
            self._poke = trio.Event()

    def _restoring(self) -> bool:
        return self.agent.restore_state.get("state") in ("cleanup", "planning", "barrier")

    async def _tick(self) -> None:
        job = self.agent.job
        if job is None or self.agent.mode == "none":
            return
        ident = (job.name, job.nodes, job.node_rank)
        if ident != self._job_id:
            self._job_id = ident
            self.state = S.ScheduleState(started_at=time.time())
            self._order_seen = None
            self._seeded = False
            self.backed_up.clear()
        if self._restoring():
            return
        try:
            await self.call(self.get_backend)
        except Exception as exc:
            self.note = f"cannot create the GCS client: {describe_error(exc)}"
            return
        await self._flush_statuses()
        if job.nodes > 1 and not self.multi(job):
            self.note = ("no backup rounds: a multi-node job needs the peer plane "
                         "(--listen/--coordinator) to agree on them")
            return
        self.note = None
        if self.decider(job):
            await self._decide(job)
            await self._maybe_delete_restore_version(job)
        else:
            await self._follow(job)

    # ------------------------------------------------------------------ deciding (rank 0)

    async def _decide(self, job: JobSpec) -> None:
        multi = job.nodes > 1
        if self.state.active is not None and multi:
            await self._track(job)
        step = self.synced_step(job)
        shard = self.agent.catalog.get(ShardKey(job.name, job.node_rank, step)) \
            if step is not None else None
        if shard is None or shard.manifest.created < self._epoch:
            step = None  # not held here, or sealed before this job's restore
        minutes, steps = S.intervals(job.backup_interval_minutes, job.backup_interval_steps)
        now = time.time()
        decision = S.decide_round(self.state, now=now, step=step,
                                  backup_requested=bool(shard and
                                                        shard.manifest.backup_requested),
                                  interval_minutes=minutes, interval_steps=steps)
        if decision.action == S.SKIP:
            if decision.report:
                self._fail(decision.reason)
            S.skipped(self.state, decision)
            return
        if decision.action != S.START:
            return
        backend = self.get_backend()
        if not self._seeded:
            # a restarted daemon: never redo a step the bucket already holds, never
            # reuse a round name, count the period from the newest round
            try:
                await self._seed(job, backend)
            except Exception as exc:
                self._fail(f"backup of step {decision.step} not started: "
                           f"{describe_error(exc)}")
                return
            decision = S.decide_round(self.state, now=now, step=step,
                                      backup_requested=bool(shard and
                                                            shard.manifest.backup_requested),
                                      interval_minutes=minutes, interval_steps=steps)
            if decision.action != S.START:
                return
        assert decision.round is not None and decision.step is not None
        if multi:
            order = L.RoundOrder(decision.round, decision.step, job.nodes, now,
                                 self.incarnation)
            try:
                await self.call(backend.write_order, job.name, order)
            except Exception as exc:
                self._fail(f"backup round {decision.round} (step {decision.step}) not "
                           f"started: {describe_error(exc)}")
                return
            self._statuses_checked = 0.0
        S.started(self.state, decision, now)
        log.info("backup round %s: step %d (%s)", decision.round, decision.step,
                 decision.reason)
        self.history.append({"round": decision.round, "step": decision.step,
                             "state": "running", "started": now, "reason": decision.reason})
        self._spawn_upload(job, decision.round, decision.step)

    async def _seed(self, job: JobSpec, backend: GcsBackend) -> None:
        """First decision: new round names sort after every round in the bucket; and
        unless this daemon restored the job itself (a restarted daemon under a running
        job), the newest complete round's step is not backed up again and the period
        counts from that round."""
        names = await self.call(backend.list_round_names, job.name)
        order = await self.call(backend.read_order, job.name) if job.nodes > 1 else None
        known = [n for n in [*names[:1], order.round if order else None] if n]
        if known:
            self.state.last_round = max([*known, self.state.last_round or ""])
        if not self._restored_here:
            for name in names[:3]:
                info = await self.call(backend.inspect_round, job.name, name, job.nodes)
                if info.complete_step is not None:
                    at = min(L.round_time(name).timestamp(), time.time())
                    S.restored(self.state, name, info.complete_step, at)
                    break
        self._seeded = True

    async def _track(self, job: JobSpec) -> None:
        """Node-rank 0: is the active round over (every node reported, or timed out)?"""
        rnd = self.state.active
        assert rnd is not None
        if time.monotonic() - self._statuses_checked < ORDER_POLL:
            return
        self._statuses_checked = time.monotonic()
        try:
            statuses = await self.call(self.get_backend().round_statuses, job.name, rnd)
        except Exception as exc:
            log.info("backup round %s: cannot read outcomes: %s", rnd, describe_error(exc))
            return
        self._ok()
        started = self.state.last_round_at or time.time()
        missing = [r for r in range(job.nodes) if r not in statuses]
        if missing and time.time() - started < ROUND_TIMEOUT:
            return
        failed = {r: s for r, s in statuses.items() if s.get("state") != "done"}
        entry = self._history(rnd)
        if missing:
            self._fail(f"backup round {rnd} given up after {ROUND_TIMEOUT:.0f} s: node-rank(s) "
                       f"{missing} never finished; the round is incomplete")
            state = "incomplete"
        elif failed:
            first = next(iter(failed.items()))
            self._fail(f"backup round {rnd} is incomplete: node-rank(s) {sorted(failed)} "
                       f"failed (node-rank {first[0]}: {first[1].get('error', '?')})")
            state = "incomplete"
        else:
            state = "complete"
            log.info("backup round %s complete on all %d nodes", rnd, job.nodes)
        if entry is not None:
            entry["state"] = state
        S.finished(self.state, rnd)

    def _history(self, rnd: str) -> dict[str, Any] | None:
        return next((h for h in reversed(self.history) if h["round"] == rnd), None)

    # ------------------------------------------------------------------ following

    async def _follow(self, job: JobSpec) -> None:
        if time.monotonic() - self._order_checked < ORDER_POLL:
            return
        self._order_checked = time.monotonic()
        backend = self.get_backend()
        try:
            order = await self.call(backend.read_order, job.name)
        except Exception as exc:
            log.info("reading the round order: %s", describe_error(exc))
            return
        self._ok()
        if order is None or order.round == self._order_seen:
            return
        first = self._order_seen is None
        self._order_seen = order.round
        if order.nodes != job.nodes or time.time() - order.issued > ROUND_TIMEOUT:
            return
        if first:
            # just started: an order this node already answered is not redone
            try:
                done = await self.call(backend.read_round_status, job.name, order.round,
                                       job.node_rank)
            except Exception:
                done = None
            if done is not None:
                return
        self.state.last_round = order.round
        self.history.append({"round": order.round, "step": order.step, "state": "running",
                             "started": time.time(), "reason": "ordered by node-rank 0"})
        self._spawn_upload(job, order.round, order.step)

    # ------------------------------------------------------------------ uploading

    def _spawn_upload(self, job: JobSpec, rnd: str, step: int) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(self._upload, job, rnd, step)

    async def _upload(self, job: JobSpec, rnd: str, step: int) -> None:
        key = ShardKey(job.name, job.node_rank, step)
        shard = self.agent.catalog.get(key)
        entry = self._history(rnd)
        t0 = time.time()
        if shard is None:
            msg = f"backup round {rnd}: step {step} is no longer held on this node"
            self._fail(msg)
            self._finish(job, rnd, step, "failed", msg, 0, 0.0, entry)
            return
        up = _Upload(rnd, step, shard.bytes, threading.Event(), t0)
        self._uploads[key] = up
        backend = self.get_backend()
        try:
            async with self._upload_limiter:
                result = await trio.to_thread.run_sync(functools.partial(
                    backend.upload_shard, shard, rnd, nodes=job.nodes,
                    data_parallelism=job.assume_data_parallelism, cancel=up.cancel,
                    on_bytes=up.add), abandon_on_cancel=True)
        except Cancelled:
            msg = (f"backup of step {step} to round {rnd} stopped: the step was written to "
                   "after it was sealed")
            self._fail(msg)
            self._finish(job, rnd, step, "failed", msg, up.done, time.time() - t0, entry)
        except Exception as exc:
            msg = f"backup of step {step} to round {rnd} failed: {describe_error(exc)}"
            self._fail(msg)
            self._finish(job, rnd, step, "failed", msg, up.done, time.time() - t0, entry)
        else:
            self._ok()
            self.backed_up[step] = rnd
            for old in sorted(self.backed_up)[:-8]:
                del self.backed_up[old]
            log.info("backup round %s: step %d uploaded (%d objects, %d bytes, %d skipped, "
                     "%.1f s)", rnd, step, result.objects, result.bytes, result.skipped,
                     result.seconds)
            self._finish(job, rnd, step, "done", "", result.bytes, result.seconds, entry)
        finally:
            up.cancel.set()
            if self._uploads.get(key) is up:
                del self._uploads[key]
            self._poke.set()

    def _finish(self, job: JobSpec, rnd: str, step: int, state: str, error: str,
                nbytes: int, seconds: float, entry: dict[str, Any] | None) -> None:
        if entry is not None:
            entry.update(node=state, seconds=round(seconds, 1), bytes=nbytes)
            if job.nodes <= 1 or state == "failed":
                entry["state"] = "complete" if state == "done" else "incomplete"
        if job.nodes <= 1:
            S.finished(self.state, rnd)
            return
        record = L.round_status_record(state, step, error=error, nbytes=nbytes,
                                       seconds=seconds)
        self._pending_status.append((job.name, rnd, job.node_rank, record))
        self._poke.set()

    async def _flush_statuses(self) -> None:
        """Report round outcomes to the bucket; kept and retried while it is unreachable."""
        while self._pending_status:
            job, rnd, rank, record = self._pending_status[0]
            try:
                await self.call(self.bounded(10.0).write_round_status, job, rnd,
                                rank, record)
            except Exception as exc:
                log.info("reporting the outcome of round %s: %s", rnd, describe_error(exc))
                return
            self._pending_status.pop(0)

    # ------------------------------------------------------------------ restore

    def note_restored(self, job: JobSpec, plan: RestorePlan, forced: str | None) -> None:
        """Record a finished restore plan (trio thread): rounds count from now; a
        restore through ``restore.version`` is remembered for its deletion."""
        self._job_id = (job.name, job.nodes, job.node_rank)
        self.state = S.ScheduleState(started_at=time.time())
        self._seeded = False
        self._restored_here = True
        # steps sealed before the restore belong to the old timeline (see _decide)
        self._epoch = time.time()
        S.restored(self.state, plan.backup, plan.step, self._epoch)
        if forced is not None:
            self.forced = (job.name, forced, plan.step or 0, time.time())

    async def fetch_backup(self, agent: NodeAgent, job: JobSpec, step: int, backup: str
                           ) -> Shard | None:
        """Bring this node's shard of ``step`` from round ``backup`` (the peer cluster's
        ``fetch_backup`` hook). Returns the committed shard or None (reported)."""
        key = ShardKey(job.name, job.node_rank, step)
        backend = await self.call(self.get_backend)
        try:
            info = await self.call(self.bounded(RESTORE_LOOKUP_DEADLINE).inspect_round,
                                   job.name, backup, job.nodes)
        except Exception as exc:
            self._fail(f"restore: cannot read backup round {backup}: {describe_error(exc)}")
            return None
        part = info.parts.get((job.node_rank, step))
        local = agent.catalog.get(key)
        if (local is not None and part is not None and part.backup is not None
                and part.backup.manifest.digest == local.manifest.digest
                and await agent.verify_shard(local)):
            log.info("restore: step %d of round %s is already here", step, backup)
            return local
        cancel = threading.Event()
        up = _Upload(backup, step, part.bytes if part else 0, cancel, time.time())
        agent.restore_state.update({"phase": f"downloading step {step} from backup round "
                                             f"{backup}", "source": "gcs"})
        try:
            async with self._upload_limiter:
                shard = await trio.to_thread.run_sync(functools.partial(
                    backend.restore_shard, agent.shards, job.name, backup, job.node_rank, step,
                    info=info, framework=job.framework, cancel=cancel, on_bytes=up.add,
                    free_bytes=agent.budget.free()), abandon_on_cancel=True)
        except Exception as exc:
            self._fail(f"restore: step {step} of node-rank {job.node_rank} from backup round "
                       f"{backup} failed: {describe_error(exc)}")
            return None
        finally:
            cancel.set()
        agent.add_shard(shard)
        self._ok()
        log.info("restored step %d of rank %d from backup round %s (%d bytes, verified)",
                 step, job.node_rank, backup, shard.bytes)
        return shard

    def coordinator_fallback(self, job: str, nodes: int) -> Any:
        """The coordinator's bucket fallback (gRPC thread, under its lock; bounded).

        Returns a :class:`tierfs.coordinator.Choice` restoring from the newest
        complete round (``restore.version``'s round if it exists, or nothing
        with the reason when that one is missing or incomplete), or None.
        A round tried in this restore round is skipped on a replan (some node
        could not restore from it).
        """
        from tierfs.coordinator import Choice

        servicer = getattr(self._peer(), "coordinator", None)
        coord = getattr(servicer, "coordinator", None)
        number = coord.round.number if coord is not None and coord.round is not None else 0
        tried = self._fallback_tried.setdefault(number, set())
        for old in [n for n in self._fallback_tried if n < number - 2]:
            del self._fallback_tried[old]
        try:
            backend = self.bounded(FALLBACK_DEADLINE)
            forced = backend.read_restore_version(job)
            if forced is not None:
                choice = backend.choose_restore(job, nodes)
                if choice.round is not None and choice.round in tried:
                    choice = type(choice)(None, None, True,
                                          f"restore.version names round {choice.round}, "
                                          "which could not be restored on every node; nothing "
                                          "restored (no fallback)")
                self.forced = (job, forced, choice.step or 0, time.time())
                if choice.round is None:
                    return Choice(None, reason=choice.reason)
                tried.add(choice.round)
                return Choice(choice.step, reason=choice.reason, backup=choice.round)
            for name in backend.list_round_names(job):
                if name in tried:
                    continue
                info = backend.inspect_round(job, name, nodes)
                if info.complete_step is not None:
                    tried.add(name)
                    return Choice(info.complete_step, backup=name,
                                  reason=f"no step is complete in the cluster; backup round "
                                         f"{name} step {info.complete_step}")
            return None
        except Exception as exc:
            msg = f"restore: the bucket could not be read ({describe_error(exc)}); nothing " \
                  "restored from it"
            log.warning("%s", msg)
            self.last_error = msg
            return None

    # ------------------------------------------------------------------ restore.version

    async def _maybe_delete_restore_version(self, job: JobSpec) -> None:
        if self.forced is None or self.forced[0] != job.name:
            return
        _job, rnd, step, since = self.forced
        synced = self.synced_step(job)
        if synced is None or synced <= step:
            return
        own = self.agent.catalog.get(ShardKey(job.name, job.node_rank, synced))
        if own is None or own.manifest.created < since:
            return  # a sync round from before that restore
        try:
            existed = await self.call(self.get_backend().delete_restore_version, job.name)
        except Exception as exc:
            log.info("deleting restore.version: %s", describe_error(exc))
            return
        self.forced = None
        if existed:
            log.info("restore.version (%s) deleted: every node sealed and replicated step %d "
                     "after restoring step %d", rnd, synced, step)


# ---------------------------------------------------------------------- cluster


class GcsCluster:
    """Wraps the agent's cluster with the bucket (see the module docstring).

    Args:
        inner: the cluster it wraps (:class:`tierfs.agent.LocalCluster` or the
            peer cluster).
        tier: the node's GCS tier.
    """

    def __init__(self, inner: Any, tier: GcsTier) -> None:
        self.inner = inner
        self.tier = tier
        self._used_inner = False

    async def plan_restore(self, agent: NodeAgent, job: JobSpec) -> RestorePlan:
        """``restore.version`` first; else the inner cluster, with the bucket as fallback."""

        tier = self.tier
        self._used_inner = False
        forced = None
        backend = None
        try:
            backend = await tier.call(tier.get_backend)
            forced = await tier.call(tier.bounded(RESTORE_LOOKUP_DEADLINE).read_restore_version,
                                     job.name)
        except Exception as exc:
            tier._fail(f"restore: cannot read restore.version from {tier.spec} "
                       f"({describe_error(exc)}); restoring without the bucket")
        if forced is not None and backend is not None:
            plan = await self._forced(agent, job, backend, forced)
            tier.note_restored(job, plan, forced)
            return plan
        self._used_inner = True
        plan = await self.inner.plan_restore(agent, job)
        if plan.step is None and not tier.multi(job) and backend is not None:
            plan = await self._from_bucket(agent, job, backend, plan)
        if plan.step is None and "restore.version" in str(plan.detail.get("reason", "")):
            tier._fail(f"restore: {plan.detail['reason']}")
        tier.note_restored(job, plan, None)
        return plan

    async def _forced(self, agent: NodeAgent, job: JobSpec, backend: GcsBackend,
                      forced: str) -> RestorePlan:
        from tierfs.agent import RestorePlan

        tier = self.tier
        try:
            choice = await tier.call(tier.bounded(RESTORE_LOOKUP_DEADLINE).choose_restore,
                                     job.name, job.nodes)
        except Exception as exc:
            reason = (f"restore.version names round {forced}, which could not be read "
                      f"({describe_error(exc)}); nothing restored (no fallback)")
            tier._fail(f"restore: {reason}")
            return RestorePlan(None, source="none", detail={"reason": reason})
        if choice.round is None or choice.step is None:
            tier._fail(f"restore: {choice.reason}")
            return RestorePlan(None, source="none", detail={"reason": choice.reason})
        shard = await tier.fetch_backup(agent, job, choice.step, choice.round)
        if shard is None:
            reason = (f"restore.version names round {choice.round}, which could not be "
                      "restored; nothing restored (no fallback)")
            tier._fail(f"restore: {reason}")
            return RestorePlan(None, source="none", detail={"reason": reason})
        return RestorePlan(choice.step, backup=choice.round, shard=shard, source="gcs",
                           detail={"reason": choice.reason})

    async def _from_bucket(self, agent: NodeAgent, job: JobSpec, backend: GcsBackend,
                           plan: RestorePlan) -> RestorePlan:
        from tierfs.agent import RestorePlan

        tier = self.tier
        try:
            choice = await tier.call(tier.bounded(RESTORE_LOOKUP_DEADLINE).choose_restore,
                                     job.name, job.nodes)
        except Exception as exc:
            tier._fail(f"restore: the bucket could not be read ({describe_error(exc)}); "
                       "nothing restored from it")
            return plan
        if choice.round is None or choice.step is None:
            log.info("restore: nothing in the bucket either (%s)", choice.reason)
            return plan
        shard = await tier.fetch_backup(agent, job, choice.step, choice.round)
        if shard is None:
            return plan
        return RestorePlan(choice.step, backup=choice.round, shard=shard, source="gcs",
                           detail={"reason": choice.reason})

    async def restore_done(self, agent: NodeAgent, job: JobSpec, plan: RestorePlan) -> None:
        """The inner cluster's barrier when it planned; nothing after a forced restore."""
        if self._used_inner:
            await self.inner.restore_done(agent, job, plan)


# ---------------------------------------------------------------------- rendezvous


async def rendezvous(backend: GcsBackend, job: str, rank: int, address: str, *,
                     incarnation: str, timeout: float, newer_than: float = 0.0,
                     poll: float = 1.0) -> str:
    """Bucket rendezvous (DESIGN.md "Peer plane"): the coordinator's address for ``job``.

    Node-rank 0 publishes ``address`` (its peer service, ``HOST:PORT``) to
    ``gs://<bucket>/<job>/.tierfs/nodes/0`` and returns it; every other rank
    publishes its own record and waits (polling every ``poll`` seconds, in a
    worker thread) for a rank-0 record written after ``newer_than`` (Unix
    seconds; older records are a previous run's).

    Raises:
        TimeoutError: no such record within ``timeout`` seconds.
        google.api_core exceptions: publishing failed after retries.
    """
    await trio.to_thread.run_sync(functools.partial(
        backend.publish_address, job, rank, address, incarnation=incarnation))
    if rank == 0:
        return address
    cancel = threading.Event()
    try:
        rec = await trio.to_thread.run_sync(functools.partial(
            backend.wait_for_address, job, 0, timeout=timeout, newer_than=newer_than,
            poll=poll, cancel=cancel), abandon_on_cancel=True)
    finally:
        cancel.set()
    return rec.address


# ---------------------------------------------------------------------- wiring


def attach_gcs(agent: NodeAgent) -> GcsTier:
    """Give ``agent`` its GCS tier (off without ``--bucket``) and wrap its cluster.

    Call after the peer tier is attached (the wrapper sits around its cluster).

    Raises:
        ConfigError: an invalid ``--bucket`` value.
    """
    spec = None
    if agent.config.bucket:
        try:
            spec = L.parse_bucket(agent.config.bucket)
        except L.LayoutError as exc:
            raise ConfigError(f"--bucket: {exc}") from None
    tier = GcsTier(agent, spec)
    agent.tiers.append(tier)
    if spec is not None:
        inner = agent.cluster
        if hasattr(inner, "fetch_backup"):
            inner.fetch_backup = tier.fetch_backup
        agent.cluster = GcsCluster(inner, tier)
    return tier
