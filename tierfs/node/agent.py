"""The node agent: the job state machine of one node (DESIGN.md "One picture").

It receives namespace events from the FUSE thread, decides with the pure
policy modules (:mod:`tierfs.core.control`, :mod:`tierfs.node.sealing`,
:mod:`tierfs.store.shards`) and does the blocking work in worker threads:

* ``replicator.yaml`` arrives (renamed into place or closed after writing):
  parse it, hide the old client-visible entries, report problems through
  ``replicator.failed``/``replicator.errors``, delete it, then restore
  (PROTOCOL.md sections 2 and 4) through the :class:`tierfs.node.restorer.Restorer`.
* A seal event (rename into a step name, a closed marker or worker file):
  hard-link snapshot, manifest with crc32c, retention; tiers are told.
* A write into a sealed file (reported *before* the handle opens) withdraws
  that seal at once; the step is sealed again when its writers close.
* The client renames a restore marker: the step is presented as a real
  directory afterwards (Orbax's rmtree-based GC cannot delete a symlink).

What the client sees is changed through a :class:`tierfs.node.view.ClientView`:
hiding entries, control files, restore markers and their sibling entries.

Concurrency: the ``FsEvents`` callbacks run on the FUSE thread and only touch
dicts and a memory channel. Everything else runs in trio tasks on the same
thread (serialized by ``_control_lock`` where it matters) or in worker
threads through ``trio.to_thread.run_sync`` with a capacity limiter.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import json
import logging
import math
import os
import stat
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from tierfs.core import control
from tierfs.core.config import NodeConfig
from tierfs.core.control import ControlError, JobSpec
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
from tierfs.core.types import RestorePlan
from tierfs.fuse.namespace import Namespace
from tierfs.node import statefile
from tierfs.node.catalog import ShardCatalog
from tierfs.node.jobstate import RESUMABLE_RESTORE_STATES, JobState
from tierfs.node.reporter import NodeReporter
from tierfs.node.restorer import Restorer
from tierfs.node.sealing import SealCandidate, SealRules
from tierfs.node.view import SIBLING_GRACE, ClientView, Published
from tierfs.store.manifest import CrcCache, ManifestError
from tierfs.store.ramstore import TRASH_GRACE, Budget, RamStore
from tierfs.store.shards import SealBusy, Shard, ShardKey, ShardStore, retention

__all__ = ["NodeAgent", "RestorePlan", "Tier"]

log = logging.getLogger(__name__)

#: restore states during which retention drops nothing (a copy may still be needed)
RESTORING_STATES = RESUMABLE_RESTORE_STATES | {"pending"}

#: how a restore ended (``restore_state["outcome"]``, ``tierfs wait``'s exit code):
#: a step restored, nothing exists anywhere, something exists but no step is
#: complete -- and the failures: a node never joined, a phase timed out, the
#: coordinator refused this node, anything else
RESTORED, FRESH, INCOMPLETE = "restored", "fresh", "incomplete"
MISSING, TIMEOUT, REFUSED, FAILED = "missing", "timeout", "refused", "failed"

STATUS_FILE = b".tierfs/status.json"
CONTROL_DIR = ".tierfs"
DEFAULT_JOB = "default"
#: seconds an expired step stays visible before retention hides it (protocol mode)
VIEW_RETENTION_GRACE = 10.0


# ---------------------------------------------------------------------- events


@dataclass(frozen=True)
class Renamed:
    old: str
    new: str
    mode: int


@dataclass(frozen=True)
class Released:
    path: str | None
    ino: int


@dataclass(frozen=True)
class Changed:
    path: str


Event = Renamed | Released | Changed


def _filesystem_status(path: str) -> FilesystemStatus | None:
    """Size and free space (bytes) of the filesystem holding ``path`` (statvfs), which
    other programs may share: not tierfs's usage (that is the status's ``usage``)."""
    try:
        vfs = os.statvfs(path)
    except OSError:
        return None
    return FilesystemStatus(
        total_bytes=vfs.f_blocks * vfs.f_frsize,
        free_bytes=vfs.f_bavail * vfs.f_frsize,
        used_bytes=(vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize,
    )


def _top(path: str) -> str:
    return path.split("/", 1)[0]


class AgentEvents:
    """The agent's :class:`~tierfs.fuse.namespace.FsEvents`; runs on the FUSE thread.

    Only dictionary updates and a non-blocking channel send happen here.
    """

    def __init__(self, agent: NodeAgent) -> None:
        self.agent = agent

    def opening_for_write(self, ino: int) -> None:
        self.agent.write_opening(ino)

    def changed(self, relpath: bytes) -> None:
        path = os.fsdecode(relpath)
        self.agent.bump(_top(path))
        self.agent.post(Changed(path))

    def renamed(self, old: bytes, new: bytes, mode: int) -> None:
        o, n = os.fsdecode(old), os.fsdecode(new)
        self.agent.bump(_top(o))
        self.agent.bump(_top(n))
        self.agent.post(Renamed(o, n, mode))

    def released(self, relpath: bytes | None, ino: int) -> None:
        path = os.fsdecode(relpath) if relpath is not None else None
        if path is not None:
            self.agent.bump(_top(path))
        self.agent.post(Released(path, ino))


# ---------------------------------------------------------------------- tiers


class Tier(Protocol):
    """A tier that follows sealed steps (peer replication, GCS backups).

    It hears of sealed and withdrawn shards through the catalog's listeners
    (registered in its ``__init__``); the agent starts it, asks it which shards
    it still needs and shows its status.
    """

    name: str

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None: ...

    def pinned(self) -> set[ShardKey]: ...

    def status(self) -> TierStatus: ...


# ---------------------------------------------------------------------- agent


class NodeAgent:
    """Job state machine of one node.

    Args:
        config: the node configuration.
        store: the RAM store.
        budget: the RAM budget.
        shards: the store of committed shards (snapshots, manifests).
        catalog: the held shards (shared with the tiers).
        state: the current job, written only by the agent (the tiers read it).
        reporter: ``replicator.errors``/``failed``.
        view: the client's view of the mount.
        restorer: decides and fetches what a restore brings back.
        tiers: the tiers following sealed steps, started in this order.
        io_limiter: the node's limiter of file work in worker threads (the budget
            count; shared with the verifier).
    """

    def __init__(
        self,
        config: NodeConfig,
        store: RamStore,
        budget: Budget,
        *,
        shards: ShardStore,
        catalog: ShardCatalog,
        state: JobState,
        reporter: NodeReporter,
        view: ClientView,
        restorer: Restorer,
        tiers: list[Tier],
        io_limiter: trio.CapacityLimiter,
    ) -> None:
        self.config = config
        self.store = store
        self.budget = budget
        self.shards = shards
        self.view = view
        self.ns: Namespace | None = None
        self.started = time.time()
        self.catalog = catalog
        self.state = state
        self.reporter = reporter
        #: inode -> sealed shard (the catalog's map; the FUSE thread reads it)
        self.sealed_inos: dict[int, ShardKey] = catalog.sealed_inos
        self.sealing_inos: dict[int, str] = {}
        self.dirty_inos: set[int] = set()
        self.generation: collections.Counter[str] = collections.Counter()
        self.view_steps: dict[str, ShardKey] = {}
        self.pending: dict[str, SealCandidate] = {}
        #: seal candidates the previous daemon had not acted on (state.json)
        self.pending_at_start: list[SealCandidate] = []
        self.withdrawn_names: dict[str, ShardKey] = {}
        #: first seal time of a withdrawn step, kept when it is sealed again
        self.withdrawn_created: dict[ShardKey, float] = {}
        self.crc_cache: CrcCache = {}
        self.rules: SealRules | None = None
        #: the last problem lines (the reporter's, plus internal errors), for the status
        self.errors: collections.deque[str] = reporter.errors
        self.restorer = restorer
        self.tiers = list(tiers)
        self._send, self._recv = trio.open_memory_channel[Event](math.inf)
        self._control_lock = trio.Lock()
        self._seal_limiter = trio.CapacityLimiter(1)
        self._io_limiter = io_limiter
        self._nursery: trio.Nursery | None = None
        self._restore_scope: trio.CancelScope | None = None
        self._generic_running = False
        self._token: trio.lowlevel.TrioToken | None = None
        catalog.on_retention_wanted(lambda: self._spawn(self._apply_retention))
        state.on_summoned(self.summoned)

    # ------------------------------------------------------------------ job state

    @property
    def job(self) -> JobSpec | None:
        """The running job (the :class:`~tierfs.node.jobstate.JobState`'s)."""
        return self.state.job

    @job.setter
    def job(self, job: JobSpec | None) -> None:
        self.state.job = job

    @property
    def mode(self) -> str:
        """``protocol``, ``generic`` or ``none``."""
        return self.state.mode

    @mode.setter
    def mode(self, mode: str) -> None:
        self.state.mode = mode

    @property
    def restore_state(self) -> dict[str, Any]:
        """The restore's state as plain data (``state`` and details)."""
        return self.state.restore_state

    @restore_state.setter
    def restore_state(self, value: dict[str, Any]) -> None:
        self.state.restore_state = value

    @property
    def timeline_since(self) -> float:
        """Unix time the current timeline began (a replicator.yaml was consumed): steps
        sealed before it belong to the job's previous run (see PeerTier's sync reports)."""
        return self.state.timeline_since

    @timeline_since.setter
    def timeline_since(self, value: float) -> None:
        self.state.timeline_since = value

    # ------------------------------------------------------------------ wiring

    @property
    def trio_token(self) -> trio.lowlevel.TrioToken | None:
        """The token of the agent's trio loop once :meth:`run` started (for
        ``trio.from_thread`` calls from gRPC threads), else None."""
        return self._token

    async def apply_retention(self) -> None:
        """Apply ``--keep-local`` retention now (trio thread), e.g. after a replica arrived."""
        await self._apply_retention()

    def fs_events(self) -> AgentEvents:
        """The receiver of namespace events."""
        return AgentEvents(self)

    def virtual_files(self) -> dict[bytes, Callable[[], bytes]]:
        """Daemon-generated files in the mount (relative path -> content generator)."""
        return {STATUS_FILE: self.status_json}

    def attach(self, ns: Namespace) -> None:
        """Bind the namespace and prepare the daemon-managed ``.tierfs/`` directory."""
        self.ns = ns
        self.view.attach(ns)
        control_dir = os.path.join(self.store.view, CONTROL_DIR)
        os.makedirs(control_dir, exist_ok=True)
        os.chmod(control_dir, 0o755)
        path = os.path.join(self.store.view, os.fsdecode(STATUS_FILE))
        if not os.path.exists(path):
            with open(path, "wb") as f:
                f.write(b"{}\n")
            os.chmod(path, 0o444)

    def post(self, event: Event) -> None:
        """Queue an event for the agent loop (FUSE thread; never blocks)."""
        try:
            self._send.send_nowait(event)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    def bump(self, top: str) -> None:
        """Something under the top-level entry ``top`` changed (FUSE thread)."""
        self.generation[top] += 1

    def write_opening(self, ino: int) -> None:
        """A client is about to write inode ``ino`` (FUSE thread, before the open).

        A sealed file withdraws its step's seal at once, so no snapshot, replica
        or backup ever carries bytes that differ from its manifest.
        """
        if ino in self.sealing_inos:
            self.dirty_inos.add(ino)
        key = self.sealed_inos.get(ino)
        if key is not None:
            self.withdraw(key, "a sealed file was opened for writing")

    # ------------------------------------------------------------------ reporting

    def _notify(self, name: str) -> None:
        self.view.notify(name)

    def report_error(self, message: str) -> None:
        """Append one line to ``replicator.errors`` (:meth:`NodeReporter.error`)."""
        self.reporter.error(message)

    def report_failure(self, message: str, *, job_context: bool = True) -> None:
        """Append one line to ``replicator.failed`` and ``.errors``
        (:meth:`NodeReporter.failure`)."""
        self.reporter.failure(message, job_context=job_context)

    # ------------------------------------------------------------------ catalog

    def own_shards(self, job: JobSpec) -> list[Shard]:
        """This node's shards of ``job``, newest step first."""
        return self.catalog.own_shards(job)

    def age(self, key: ShardKey) -> tuple[float, int]:
        """Recency of a shard for retention: (seal time, step); larger is newer."""
        return self.catalog.age(key)

    def retained(self, key: ShardKey) -> bool:
        """True if ``key`` is among the ``--keep-local`` newest shards of its (job, rank)."""
        return self.catalog.retained(key)

    def drop_abandoned(self, job: JobSpec, step: int) -> None:
        """The cluster restored ``step``: this node's shards of later steps are abandoned.

        They are incomplete in the cluster, so no restore can use them, and the
        job now writes new steps with lower numbers; keeping them would make
        retention and the next restore prefer the abandoned history (MTC keeps
        only the restored step after a restore, too). When nothing is restored,
        nothing is dropped: retention by seal time ages the old steps out.
        """
        for key in [k for k in self.catalog if k.job == job.name and k.step > step]:
            self.drop_shard(key, f"abandoned: the job restored step {step}")

    def add_shard(self, shard: Shard) -> None:
        """Register a committed shard (trio thread)."""
        self.catalog.add(shard)

    def drop_shard(self, key: ShardKey, reason: str) -> None:
        """Remove a shard from the catalog and the store (trio thread; one rename)."""
        self.catalog.drop(key, reason)

    def withdraw(self, key: ShardKey, reason: str) -> None:
        """Withdraw a seal: the snapshot no longer matches the client's bytes."""
        names = [n for n, k in self.view_steps.items() if k == key]
        shard = self.catalog.get(key)
        if shard is not None:
            self.withdrawn_created[key] = shard.manifest.created
        self.drop_shard(key, reason)
        for name in names:
            self.withdrawn_names[name] = key

    # ------------------------------------------------------------------ job

    def _set_job(self, job: JobSpec | None, mode: str) -> None:
        self.job = job
        self.mode = mode if job else "none"
        if job is None:
            self.rules = None
            return
        self.rules = SealRules(
            job.framework, job.name, job.node_rank, job.workers_per_node, self.config.seal_patterns
        )

    def _generic_job(self) -> JobSpec:
        c = self.config
        return JobSpec(
            name=c.job or DEFAULT_JOB,
            framework=control.GENERIC,
            node_rank=c.node_rank,
            nodes=c.nodes,
            peer_ranks=tuple(c.peer_ranks) if c.peer_ranks is not None else None,
            peers_per_node=c.peers_per_node,
            assume_data_parallelism=c.assume_data_parallelism,
            backup_interval_minutes=c.backup_interval_minutes,
            backup_interval_steps=c.backup_interval_steps,
        )

    def _save_state(self) -> None:
        statefile.save(
            self.store.store,
            statefile.SavedState(
                mode=self.mode,
                job=self.job,
                view_steps=self.view_steps,
                published=self.view.published,
                restore=self.restore_state,
                pending=list(self.pending.values()),
            ),
        )

    def _load_state(self) -> None:
        saved = statefile.load(self.store.state_file)
        if saved.job is not None:
            self._set_job(saved.job, "protocol")
        self.view_steps = {
            n: k
            for n, k in saved.view_steps.items()
            if os.path.lexists(os.path.join(self.store.view, n))
        }
        self.view.published.update(saved.published)
        self.restore_state = saved.restore
        self.pending_at_start = saved.pending

    # ------------------------------------------------------------------ main loop

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load state, start tiers, then process events until cancelled."""
        self._token = trio.lowlevel.current_trio_token()
        catalog = await trio.to_thread.run_sync(self.shards.load)
        for shard in catalog.values():
            self.add_shard(shard)
        self._load_state()
        if self.job is None:
            self._set_job(self._generic_job(), "generic")
        if self.mode == "generic" and self.restore_state.get("state") in RESTORING_STATES:
            # a generic restore is never resumed: a new one starts below
            self.restore_state = {"state": "idle"}
        await trio.to_thread.run_sync(self._write_jax_init_info)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for tier in self.tiers:
                await nursery.start(tier.run)
            nursery.start_soon(self._housekeeping)
            nursery.start_soon(self._count_budget)
            nursery.start_soon(self._reconcile)
            if os.path.lexists(os.path.join(self.store.view, control.REPLICATOR_YAML)):
                # renamed into place just before the previous daemon died: still unread
                self._start_control()
            elif (
                self.mode == "protocol"
                and self.job is not None
                and self.restore_state.get("state") in RESUMABLE_RESTORE_STATES
            ):
                # the previous daemon died between consuming the yaml and publishing
                # the marker: the client still waits for one
                self._spawn(self._resume_restore, self.job)
            elif self.mode == "generic" and self.job is not None and self.job.nodes > 1:
                # visible at once, so `tierfs wait` right after the mount waits for it
                # (unless the coordinator summoned this node while its tiers started)
                self._start_generic_restore(self.job)
            task_status.started()
            async for event in self._recv:
                try:
                    await self._handle(event)
                except Exception:
                    log.exception("handling %s failed", event)

    async def shutdown(self) -> None:
        """Persist state before the daemon exits."""
        self._send.close()
        self._save_state()

    def _write_jax_init_info(self) -> None:
        c = self.config
        if c.process_id is None or not c.jax_coordinator:
            return
        control.atomic_write(
            self.store.view,
            control.JAX_INIT_INFO,
            control.jax_init_info_text(c.process_id, c.jax_coordinator).encode(),
        )
        self._notify(control.JAX_INIT_INFO)

    async def _count_budget(self) -> None:
        """Count the store in a worker thread.

        Managed budget: every 5 s, or every 0.5 s while the budget is nearly
        used up or a write was just refused, so deletions free budget quickly.
        Native budget: every 5 s too: the count by area is what ``tierfs
        status`` shows as tierfs's own bytes (others' use of a shared tmpfs
        changes the filesystem's numbers, never this count).
        """
        while True:
            if self.budget.native:
                await trio.sleep(5.0)
            else:
                await trio.sleep(0.5 if self.budget.wants_recount else 5.0)
            async with self._io_limiter:
                await trio.to_thread.run_sync(self.budget.recount)

    async def _housekeeping(self) -> None:
        while True:
            await trio.sleep(2.0)
            short = self.budget.free() < 0.1 * self.budget.size
            await trio.to_thread.run_sync(self.store.empty_trash, 0.0 if short else TRASH_GRACE)
            for name in list(self.pending):
                self._schedule_seal(self.pending[name])
            # a step another tier pinned (replicating, uploading) past --keep-local
            # goes once the pin is released
            await self._apply_retention()

    async def _reconcile(self) -> None:
        """Seal complete steps that are in the view but not sealed (daemon restart)."""
        if self.rules is None or self.job is None:
            return
        candidates = await trio.to_thread.run_sync(self.rules.scan, self.view)
        found = {c.name for c in candidates}
        candidates += [
            c
            for c in self.pending_at_start
            if c.name not in found and all(self.view.exists(e) for e in c.entries)
        ]
        self.pending_at_start = []
        job = self.job
        now = time.time()
        fresh: dict[ShardKey, SealCandidate] = {}
        for cand in candidates:
            key = ShardKey(job.name, job.node_rank, cand.step)
            if key in self.catalog and self.catalog[key].manifest.name == cand.name:
                self.view_steps.setdefault(cand.name, key)
                continue
            try:
                mtime = os.lstat(os.path.join(self.store.view, cand.name)).st_mtime
            except OSError:
                continue
            fresh[key] = dataclasses.replace(cand, created=min(now, mtime))
        # A step still visible after retention dropped it (the client's copy, or one
        # whose hide timer died with the previous daemon) is not sealed again: it
        # would only push a newer step out of --keep-local.
        ages = {
            k: self.age(k) for k in self.catalog if (k.job, k.rank) == (job.name, job.node_rank)
        }
        ages.update({k: (c.created or now, k.step) for k, c in fresh.items()})
        too_old = set(retention(ages, self.config.keep_local, set(), age=ages.__getitem__))
        for key, cand in fresh.items():
            if key in too_old and key not in self.catalog:
                log.info(
                    "step %d (%s) found at start is older than the %d kept steps; not sealed",
                    cand.step,
                    cand.name,
                    self.config.keep_local,
                )
                if self.mode == "protocol":
                    self.view_steps[cand.name] = key
                    self._spawn(self._hide_later, cand.name, key)
                continue
            self._schedule_seal(cand)

    async def _handle(self, event: Event) -> None:
        if isinstance(event, Renamed):
            await self._on_renamed(event)
        elif isinstance(event, Released):
            await self._on_released(event)
        elif isinstance(event, Changed):
            await self._on_changed(event)

    async def _on_renamed(self, ev: Renamed) -> None:
        if ev.new == control.REPLICATOR_YAML:
            self._start_control()
            return
        pub = self.view.published.get(ev.old)
        if pub is not None and stat.S_ISLNK(ev.mode) and "/" not in ev.new:
            del self.view.published[ev.old]
            self._spawn(self._materialize, ev.new, pub)
            return
        old_top, new_top = _top(ev.old), _top(ev.new)
        cand = None
        if self.rules is not None:
            cand = self.rules.on_rename(
                ev.old, ev.new, stat.S_ISDIR(ev.mode), stat.S_ISLNK(ev.mode), self.view
            )
        moved = ev.old == old_top and ev.new == new_top and old_top in self.view_steps
        if moved:
            old_key = self.view_steps.pop(old_top)
            if cand is not None and cand.step != old_key.step:
                # NeMo's async finalize: step=<N> (sealed) renamed to <digits>. The same
                # checkpoint now has its final name and step; the old seal is retired.
                shard = self.catalog.get(old_key)
                if shard is not None and shard.manifest.name == old_top:
                    self.drop_shard(old_key, f"renamed to {new_top}")
            else:
                self.view_steps[new_top] = old_key
        if cand is not None:
            self._schedule_seal(cand)
        self._retry_pending(new_top)

    async def _on_released(self, ev: Released) -> None:
        if ev.path is None:
            return
        if ev.path == control.REPLICATOR_YAML:
            self._start_control()
            return
        if self.rules is not None:
            cand = self.rules.on_release(ev.path, self.view)
            if cand is not None:
                self._schedule_seal(cand)
        self._retry_pending(_top(ev.path))

    async def _on_changed(self, ev: Changed) -> None:
        if ev.path == control.REPLICATOR_YAML:
            # a regular file is read when renamed into place or closed; a symlink,
            # FIFO or directory made under that name is refused at once (no client
            # could ever write another yaml while it stays)
            try:
                st = os.lstat(os.path.join(self.store.view, ev.path))
            except OSError:
                return
            if not stat.S_ISREG(st.st_mode):
                self._start_control()
            return
        top = _top(ev.path)
        if ev.path == top and not self.view.exists(top):
            self.view_steps.pop(top, None)
            self.pending.pop(top, None)
            if self.rules is not None:
                cand = self.rules.on_remove(top, self.view)
                if cand is not None:
                    self._schedule_seal(cand)
        elif top in self.view_steps and self.rules is not None and self.view.exists(ev.path):
            # a file added to or changed in a sealed step: seal it again (a
            # removal leaves the snapshot as it is: the client may delete freely)
            key = self.view_steps[top]
            self.pending[top] = SealCandidate(
                key.step, top, self._entries_of(key, top), "changed after seal"
            )

    def _entries_of(self, key: ShardKey, top: str) -> tuple[str, ...]:
        shard = self.catalog.get(key)
        if shard is not None and shard.manifest.name == top:
            return tuple(shard.manifest.top_level)
        return (top,)

    def _retry_pending(self, top: str) -> None:
        for cand in list(self.pending.values()):
            if top in {_top(e) for e in cand.entries}:
                self._schedule_seal(cand)
        if top in self.withdrawn_names and top not in self.pending:
            key = self.withdrawn_names[top]
            self.pending[top] = SealCandidate(key.step, top, (top,), "re-seal after write")
            self._schedule_seal(self.pending[top])

    def _spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` as a task whose failure is logged, never fatal to the daemon."""
        if self._nursery is not None:
            self._nursery.start_soon(self._guarded, fn, args, name=getattr(fn, "__name__", fn))

    async def _guarded(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            await fn(*args)
        except Exception as exc:
            log.exception("%s failed", getattr(fn, "__name__", fn))
            self.errors.append(f"internal error in {getattr(fn, '__name__', fn)}: {exc}")

    # ------------------------------------------------------------------ sealing

    def _schedule_seal(self, cand: SealCandidate) -> None:
        known = self.pending.get(cand.name)
        self.pending[cand.name] = cand
        if known is None or known.step != cand.step:
            self._save_state()
        self._spawn(self._seal, cand)

    async def _seal(self, cand: SealCandidate) -> None:
        job = self.job
        if job is None or self.pending.get(cand.name) is not cand:
            return
        key = ShardKey(job.name, job.node_rank, cand.step)
        tops = {_top(e) for e in cand.entries}
        async with self._seal_limiter:
            if self.pending.get(cand.name) is not cand or self.job is not job:
                return
            if not all(self.view.exists(e) for e in cand.entries):
                del self.pending[cand.name]  # renamed or deleted meanwhile
                return
            gens = {t: self.generation[t] for t in tops}
            ns = self.ns
            writers = ns.writers_of if ns is not None else None
            token = uuid.uuid4().hex

            def work() -> Shard:
                return self.shards.snapshot(
                    self.store.view,
                    key,
                    cand.name,
                    cand.entries,
                    job.framework,
                    cache=self.crc_cache,
                    writers=writers,
                    cancelled=lambda: any(self.generation[t] != gens[t] for t in tops),
                    on_inodes=lambda inos: self._mark_sealing(inos, token),
                    created=self.withdrawn_created.get(key) or cand.created,
                )

            try:
                shard = await trio.to_thread.run_sync(work)
            except SealBusy:
                log.info(
                    "step %d (%s): files still open for writing; sealing when closed",
                    cand.step,
                    cand.name,
                )
                return
            except ManifestError as exc:
                if self.pending.get(cand.name) is cand:
                    del self.pending[cand.name]
                self.report_error(f"step {cand.step} ({cand.name}) not sealed: {exc}")
                return
            except (OSError, InterruptedError) as exc:
                if getattr(exc, "errno", None) == errno.ENOSPC:
                    # visible to the client: the step stays unprotected until there is room
                    self.report_error(
                        f"step {cand.step} ({cand.name}) not sealed yet: the "
                        "RAM tier is full (retried every few seconds)"
                    )
                log.info("step %d (%s): seal retried later: %s", cand.step, cand.name, exc)
                return
            finally:
                self._unmark_sealing(token)
            changed = any(self.generation[t] != gens[t] for t in tops)
            dirty = bool(shard.inodes & self.dirty_inos)
            busy = writers is not None and any(writers(i) for i in shard.inodes)
            self.dirty_inos -= shard.inodes
            if changed or dirty or busy or self.job is not job:
                self.shards.remove(shard)
                log.info(
                    "step %d (%s) changed while sealing (%s); will seal again",
                    cand.step,
                    cand.name,
                    "written"
                    if dirty
                    else "open for writing"
                    if busy
                    else "changed"
                    if changed
                    else "job restarted",
                )
                return
            if self.pending.get(cand.name) is cand:
                del self.pending[cand.name]
            self.withdrawn_names.pop(cand.name, None)
            self.withdrawn_created.pop(key, None)
            self.add_shard(shard)
            self.view_steps[cand.name] = key
            log.info(
                "sealed step %d (%s, %d files, %d bytes): %s",
                key.step,
                cand.name,
                len(shard.manifest.files),
                shard.bytes,
                cand.reason,
            )
            self.catalog.sealed(shard)
            await self._apply_retention()
            self._save_state()

    def _mark_sealing(self, inos: set[int], token: str) -> None:
        for ino in inos:
            self.sealing_inos[ino] = token

    def _unmark_sealing(self, token: str) -> None:
        for ino in [i for i, t in self.sealing_inos.items() if t == token]:
            del self.sealing_inos[ino]

    def pinned(self) -> set[ShardKey]:
        """Shards some tier still needs, plus the ones a published marker points at."""
        keep = {p.key for p in self.view.published.values()}
        for tier in self.tiers:
            keep |= tier.pinned()
        return keep

    async def _apply_retention(self) -> None:
        """Drop snapshots past ``--keep-local``; in protocol mode hide their view entries too.

        MTC clients leave retention to the node side (MaxText passes no
        preservation policy), so without this the RAM fills up. The view entry
        is hidden after a grace period: a client that deletes old steps itself
        (an Orbax preservation policy) does so first and never finds a step
        vanishing under its rmtree.

        A restore pins the step it fetched (the peer tier) from the moment it is
        in the catalog: until the abandoned newer steps are dropped, it is the
        oldest and would go first. While a restore runs on this node nothing is
        dropped at all: any copy may still be chosen (a replan after a bad
        copy, another node's pull); the peer tier pins the job's copies while a
        restore round of the cluster is open.
        """
        if self.restore_state.get("state") in RESTORING_STATES:
            return
        drop = retention(self.catalog, self.config.keep_local, self.pinned(), age=self.age)
        for key in drop:
            if self.mode == "protocol" and self.job and key.rank == self.job.node_rank:
                for name in [n for n, k in self.view_steps.items() if k == key]:
                    self._spawn(self._hide_later, name, key)
            self.drop_shard(key, f"retention (keep {self.config.keep_local})")

    async def _hide_later(self, name: str, key: ShardKey) -> None:
        await trio.sleep(VIEW_RETENTION_GRACE)
        if self.view_steps.get(name) == key and key not in self.catalog:
            del self.view_steps[name]
            await trio.to_thread.run_sync(self.view.hide, name)

    # ------------------------------------------------------------------ control file

    def _start_control(self) -> None:
        if self._restore_scope is not None:
            self._restore_scope.cancel()
        self._spawn(self._consume_control)

    async def _consume_control(self) -> None:
        async with self._control_lock:
            self.reporter.forget_repeats()  # a (re)started job hears about every problem again
            path = os.path.join(self.store.view, control.REPLICATOR_YAML)
            try:
                # read and parse off the FUSE loop: a large file takes seconds
                job = await trio.to_thread.run_sync(control.load_replicator_yaml, path)
            except FileNotFoundError:
                return
            except OSError as exc:
                await trio.to_thread.run_sync(self.view.clear_error_files)
                self.report_failure(
                    f"replicator.yaml could not be read: {exc.strerror or exc}", job_context=False
                )
                await trio.to_thread.run_sync(self.view.delete_control)
                return
            except ControlError as exc:
                await trio.to_thread.run_sync(self.view.clear_error_files)
                self.report_failure(str(exc), job_context=False)
                await trio.to_thread.run_sync(self.view.delete_control)
                return
            if job is None:
                log.info("empty replicator.yaml: reset")
                self._set_job(self._generic_job(), "generic")
                self.restore_state = {"state": "idle"}
                await trio.to_thread.run_sync(self.view.withdraw_restore)
                await trio.to_thread.run_sync(self.view.delete_control)
                self._save_state()
                return
            restarted = self.mode == "protocol"
            log.info(
                "replicator.yaml: job %s rank %d/%d framework %s%s",
                job.name,
                job.node_rank,
                job.nodes,
                job.framework,
                " (job restarted)" if restarted else "",
            )
            self._set_job(job, "protocol")
            self.timeline_since = time.time()
            self.pending.clear()
            self.view.published.clear()
            self.restore_state = {"state": "cleanup", "since": time.time()}
            await trio.to_thread.run_sync(self.view.cleanup, self.view_steps)
            for warning in job.warnings:
                self.report_error(warning)
            self._save_state()
            await trio.to_thread.run_sync(self.view.delete_control)
            self._spawn(self._restore, job)

    # ------------------------------------------------------------------ restore

    async def _resume_restore(self, job: JobSpec) -> None:
        log.info(
            "resuming the restore of job %s (the previous daemon stopped in state %s)",
            job.name,
            self.restore_state.get("state"),
        )
        self.restore_state = {"state": "cleanup", "since": time.time()}
        await trio.to_thread.run_sync(self.view.cleanup, self.view_steps)
        self._save_state()
        await self._restore(job)

    async def _restore(self, job: JobSpec) -> None:
        with trio.CancelScope() as scope:
            self._restore_scope = scope
            try:
                await self._restore_inner(job)
            except Exception as exc:
                log.exception("restore failed")
                self.report_failure(f"restore failed: {exc}")
                self.restore_state = {
                    "state": "failed",
                    "error": str(exc),
                    "outcome": getattr(exc, "outcome", FAILED),
                    "at": time.time(),
                }
            finally:
                if self._restore_scope is scope:
                    self._restore_scope = None
                self._save_state()

    async def _restore_inner(self, job: JobSpec) -> None:
        self.restore_state = {"state": "planning", "since": time.time()}
        plan = await self.restorer.plan(job)
        step = plan.step or None
        if step:
            self.drop_abandoned(job, step)
        await trio.to_thread.run_sync(
            self.view.write_file,
            control.REPLICATOR_PRERESTORE,
            control.prerestore_text(step, plan.backup).encode(),
        )
        self.restore_state = {
            "state": "barrier",
            "step": step,
            "source": plan.source,
            "since": time.time(),
        }
        await self.restorer.finish(job, plan)
        outcome = self._report_plan(plan)
        if step is None or plan.shard is None:
            await trio.to_thread.run_sync(
                self.view.write_file, control.marker_name(job.name, 0, job.node_rank, 0), b""
            )
            self.restore_state = {"state": "done", "step": None, "at": time.time(), **outcome}
            log.info(
                "nothing restored (%s): published the empty s0 marker",
                outcome.get("reason") or outcome["outcome"],
            )
            return
        await trio.to_thread.run_sync(self.view.publish, job, plan.shard)
        self.restore_state = {
            "state": "done",
            "step": step,
            "source": plan.source,
            "backup": plan.backup,
            "at": time.time(),
            **outcome,
        }
        log.info("restore of step %d published (%s)", step, plan.source)

    def _report_plan(self, plan: RestorePlan) -> dict[str, Any]:
        """Say in ``replicator.errors`` why the restore is not the newest step, or
        nothing although something exists; returns the outcome fields of the
        restore state (``outcome``, ``reason``, ``problems``)."""
        d = plan.detail
        outcome = d.get("outcome") or (RESTORED if plan.step else INCOMPLETE)
        reason = str(d.get("reason") or "")
        problems = [str(p) for p in d.get("problems") or []]
        if plan.step is None and outcome == INCOMPLETE:
            self.report_error(f"restore: nothing restored: {reason or 'no step is complete'}")
        elif problems:
            self.report_error(f"restore: step {plan.step} restored: {reason}")
        for line in problems:
            if line not in reason:
                self.report_error(f"restore: {line}")
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
        self._generic_running = True
        self.restore_state = {"state": "planning", "since": time.time(), "summoned": summoned}
        try:
            plan = await self.restorer.plan(job)
            if plan.step and not summoned:
                self.drop_abandoned(job, plan.step)
            await self.restorer.finish(job, plan)
        except Exception as exc:
            log.exception("generic restore failed")
            self.report_error(f"restore failed: {exc}")
            self.restore_state = {
                "state": "failed",
                "error": str(exc),
                "at": time.time(),
                "outcome": getattr(exc, "outcome", FAILED),
                "summoned": summoned,
            }
            return
        finally:
            self._generic_running = False
        outcome = self._report_plan(plan)
        if plan.shard is None:
            self.restore_state = {"state": "done", "step": None, "at": time.time(), **outcome}
            return
        shard = plan.shard
        created = await trio.to_thread.run_sync(self.view.link_missing, shard)
        self.view_steps[shard.manifest.name] = shard.key
        self.restore_state = {
            "state": "done",
            "step": shard.key.step,
            "source": plan.source,
            "backup": plan.backup,
            "at": time.time(),
            "created": created,
            "summoned": summoned,
            **outcome,
        }
        if created:
            log.info(
                "generic restore: step %d back in the view as %s (%s)",
                shard.key.step,
                ", ".join(created),
                plan.source,
            )
        self._save_state()

    def summoned(self, job: JobSpec) -> None:
        """The coordinator asks this node to join a restore round (generic mode; trio
        thread): join it unless a restore already runs here.

        A node whose own restore (after its daemon started) gave up, e.g. a node
        missing past ``--join-timeout``, takes the summons as that restore again:
        like a restarted node it drops its steps newer than the agreed one.
        """
        if self.mode != "generic" or self.job is not job:
            return
        last = self.restore_state
        own = last.get("state") == "failed" and last.get("summoned") is False
        if self._start_generic_restore(job, not own):
            log.info("the coordinator asks this node to join a restore round")

    def _start_generic_restore(self, job: JobSpec, summoned: bool = False) -> bool:
        """Start a generic restore unless one runs (one at a time: two restore ids of one
        rank would take turns superseding each other's round). True if started."""
        if self._generic_running:
            return False
        self._generic_running = True
        self.restore_state = {"state": "pending", "since": time.time(), "summoned": summoned}
        self._spawn(self._generic_restore, job, summoned)
        return True

    async def _materialize(self, name: str, pub: Published) -> None:
        """After the client renamed a marker to ``name``: make ``name`` a real entry
        (:meth:`tierfs.node.view.ClientView.materialize`), then retire the sibling."""
        shard = self.catalog.get(pub.key)
        if await trio.to_thread.run_sync(self.view.materialize, name, pub, shard):
            self.view_steps[name] = pub.key
            log.info("restored step %d presented as %s", pub.key.step, name)
            # the sibling stays a while for readers that resolved the symlink before
            self._spawn(self.view.hide_after, pub.sibling, SIBLING_GRACE)
        self._save_state()

    # ------------------------------------------------------------------ status

    def status(self) -> NodeStatus:
        """The node's status (``tierfs status``, ``.tierfs/status.json``, metrics)."""
        job = self.job
        steps: dict[int, StepStatus] = {}
        names = {k: n for n, k in self.view_steps.items()}
        if job is not None:
            for cand in self.pending.values():
                steps[cand.step] = StepStatus(cand.step, cand.name, "writing")
            for name, key in self.withdrawn_names.items():
                # a write withdrew the seal; the step seals again when the writer closes
                if key.job == job.name and key.rank == job.node_rank:
                    steps.setdefault(key.step, StepStatus(key.step, name, "writing"))
            for shard in self.own_shards(job):
                steps[shard.key.step] = StepStatus(
                    step=shard.key.step,
                    name=names.get(shard.key, shard.manifest.name),
                    state="verified" if shard.verified else "sealed",
                    bytes=shard.bytes,
                    where=("local",),
                    files=sum(1 for f in shard.manifest.files if f.kind == "file"),
                    backup_requested=shard.manifest.backup_requested,
                    visible=shard.key in names,
                )
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
        restore = RestoreStatus(dict(self.restore_state))
        return NodeStatus(
            mountpoint=os.path.abspath(self.config.mountpoint),
            ram_dir=self.store.root,
            pid=os.getpid(),
            uptime_seconds=round(time.time() - self.started, 1),
            budget=BudgetStatus(
                mode=self.budget.mode,
                total_bytes=self.budget.size,
                used_bytes=self.budget.used(),
                free_bytes=self.budget.free(),
                size_bytes=self.config.size,
            ),
            usage=self._usage_status(job),
            filesystem=_filesystem_status(self.store.root),
            passthrough=bool(self.ns and self.ns.passthrough),
            mode=self.mode,
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
        )

    def _usage_status(self, job: JobSpec | None) -> UsageStatus | None:
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

    def status_json(self) -> bytes:
        """``.tierfs/status.json``: the status as JSON (the contract readers rely on)."""
        status = self.status().to_json()
        return (json.dumps(status, indent=2, sort_keys=True, default=str) + "\n").encode()
