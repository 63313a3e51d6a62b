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

:class:`NodeAgent` is the facade the daemon uses; the work is done by its
parts, each in its own module and built by :func:`tierfs.daemon.build_agent`:

* :mod:`tierfs.node.intake`: the FUSE thread's events and their handlers;
* :mod:`tierfs.node.sealer`: seal scheduling and sealing, the restart reconcile;
* :mod:`tierfs.node.keeper`: ``--keep-local`` retention, withdrawn seals, pins;
* :mod:`tierfs.node.jobcontrol`: ``replicator.yaml``, the job and its seal rules;
* :mod:`tierfs.node.restore_driver`: protocol and generic restores, markers;
* :mod:`tierfs.node.status_builder`: the node's status;
* :mod:`tierfs.node.steps`: the shared bookkeeping of steps and ``state.json``;
* :mod:`tierfs.node.tasks`: guarded background tasks.

Concurrency: the ``FsEvents`` callbacks run on the FUSE thread and only touch
dicts and a memory channel. Everything else runs in trio tasks on the same
thread (``replicator.yaml`` is consumed under one lock, seals run one at a
time) or in worker threads through ``trio.to_thread.run_sync`` with a
capacity limiter.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import trio

from tierfs.core import control
from tierfs.core.config import NodeConfig
from tierfs.core.control import JobSpec
from tierfs.core.status import NodeStatus, TierStatus
from tierfs.core.types import RestorePlan
from tierfs.fuse.namespace import Namespace
from tierfs.node.catalog import ShardCatalog
from tierfs.node.intake import AgentEvents, EventIntake
from tierfs.node.jobcontrol import JobControl
from tierfs.node.jobstate import RESTORING_STATES, RESUMABLE_RESTORE_STATES, JobState
from tierfs.node.keeper import ShardKeeper
from tierfs.node.reporter import NodeReporter
from tierfs.node.restore_driver import RestoreDriver
from tierfs.node.restorer import Restorer
from tierfs.node.sealer import Sealer
from tierfs.node.status_builder import StatusBuilder
from tierfs.node.steps import StepBook
from tierfs.node.tasks import TaskSpawner
from tierfs.node.view import ClientView
from tierfs.store.ramstore import TRASH_GRACE, Budget, RamStore
from tierfs.store.shards import ShardKey, ShardStore

__all__ = ["AgentEvents", "NodeAgent", "RestorePlan", "Tier"]

log = logging.getLogger(__name__)

STATUS_FILE = b".tierfs/status.json"
#: opened for writing by ``tierfs wait``: a trainer starts on this node (its content:
#: the daemon's last answer, JSON)
RESTART_FILE = b".tierfs/restart"
CONTROL_DIR = ".tierfs"


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


class NodeAgent:
    """Job state machine of one node: the facade over its parts.

    Args:
        config: the node configuration.
        store: the RAM store.
        budget: the RAM budget.
        shards: the store of committed shards (snapshots, manifests).
        catalog: the held shards (shared with the tiers).
        state: the current job, written only by the agent's parts (the tiers read it).
        reporter: ``replicator.errors``/``failed``.
        view: the client's view of the mount.
        restorer: decides and fetches what a restore brings back.
        tiers: the tiers following sealed steps, started in this order.
        io_limiter: the node's limiter of file work in worker threads (the budget
            count; shared with the verifier).
        book: the bookkeeping of steps shared by the parts (``state.json``).
        tasks: the guarded background tasks of the parts.
        keeper: retention, withdrawn seals, pins.
        sealer: seals steps.
        restores: runs restores.
        control: consumes ``replicator.yaml``, sets the job.
        intake: the namespace's events.
        status_builder: builds the status.
        background: more loops to run while the agent runs (the whole-step
            judge, :mod:`tierfs.node.whole_step`).

    Attributes:
        errors: the last problem lines (the reporter's, plus internal errors).
        started: Unix time (seconds) the agent was made (the status's uptime).
        sealed_inos, view_steps, pending, withdrawn_names: the book's maps.
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
        book: StepBook,
        tasks: TaskSpawner,
        keeper: ShardKeeper,
        sealer: Sealer,
        restores: RestoreDriver,
        control: JobControl,
        intake: EventIntake,
        status_builder: StatusBuilder,
        background: Sequence[Callable[[], Awaitable[None]]] = (),
    ) -> None:
        self.config = config
        self.store = store
        self.budget = budget
        self.shards = shards
        self.catalog = catalog
        self.state = state
        self.reporter = reporter
        self.view = view
        self.restorer = restorer
        self.tiers = list(tiers)
        self._io_limiter = io_limiter
        self.book = book
        self.tasks = tasks
        self.keeper = keeper
        self.sealer = sealer
        self.restores = restores
        self.control = control
        self.intake = intake
        self.status_builder = status_builder
        self.background = tuple(background)
        self.started = time.time()
        self.errors: collections.deque[str] = reporter.errors
        #: inode -> sealed shard (the catalog's map; the FUSE thread reads it)
        self.sealed_inos = book.sealed_inos
        self.view_steps = book.view_steps
        self.pending = book.pending
        self.withdrawn_names = book.withdrawn_names

    @property
    def job(self) -> JobSpec | None:
        """The running job (the :class:`~tierfs.node.jobstate.JobState`'s)."""
        return self.state.job

    @property
    def mode(self) -> str:
        """``protocol``, ``generic`` or ``none``."""
        return self.state.mode

    @property
    def restore_state(self) -> dict[str, Any]:
        """The restore's state as plain data (``state`` and details)."""
        return self.state.restore_state

    # ------------------------------------------------------------------ wiring

    async def apply_retention(self) -> None:
        """Apply ``--keep-local`` retention now (trio thread), e.g. after a replica arrived."""
        await self.keeper.apply_retention()

    def fs_events(self) -> AgentEvents:
        """The receiver of namespace events."""
        return AgentEvents(self.intake)

    def virtual_files(self) -> dict[bytes, Callable[[], bytes]]:
        """Daemon-generated files in the mount (relative path -> content generator)."""
        return {STATUS_FILE: self.status_json, RESTART_FILE: self.restart_json}

    def control_files(self) -> dict[bytes, Callable[[], None]]:
        """Daemon-generated files whose open for writing is a request (FUSE thread):
        ``.tierfs/restart``, a trainer starts (:meth:`RestoreDriver.trainer_start`)."""
        return {RESTART_FILE: self.trainer_start}

    def trainer_start(self) -> None:
        """A trainer starts on this node (``.tierfs/restart`` opened for writing)."""
        self.restores.trainer_start()

    def restart_json(self) -> bytes:
        """``.tierfs/restart``: the daemon's answer to the last trainer start, JSON
        (``{}`` before the first): ``at`` (Unix seconds), ``action``, ``why``."""
        return json.dumps(self.restores.last_trainer_start).encode() + b"\n"

    def attach(self, ns: Namespace) -> None:
        """Bind the namespace and prepare the daemon-managed ``.tierfs/`` directory."""
        self.book.ns = ns
        self.view.attach(ns)
        control_dir = os.path.join(self.store.view, CONTROL_DIR)
        os.makedirs(control_dir, exist_ok=True)
        os.chmod(control_dir, 0o755)
        for name, mode in ((STATUS_FILE, 0o444), (RESTART_FILE, 0o666)):
            path = os.path.join(self.store.view, os.fsdecode(name))
            if not os.path.exists(path):
                with open(path, "wb") as f:
                    f.write(b"{}\n")
            # restart: any user of the mount may say its trainer starts, as anyone
            # who can write replicator.yaml starts a restore in protocol mode
            os.chmod(path, mode)

    # ------------------------------------------------------------------ status

    def status(self) -> NodeStatus:
        """The node's status (``tierfs status``, ``.tierfs/status.json``, metrics)."""
        return self.status_builder.status(self.started)

    def status_json(self) -> bytes:
        """``.tierfs/status.json``: the status as JSON (the contract readers rely on)."""
        return self.status_builder.status_json(self.started)

    # ------------------------------------------------------------------ main loop

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load state, start tiers, then process events until cancelled."""
        catalog = await trio.to_thread.run_sync(self.shards.load)
        for shard in catalog.values():
            self.keeper.add_shard(shard)
        saved = self.book.load()
        if saved is not None:
            self.control.set_job(saved, "protocol")
        if self.state.job is None:
            self.control.set_job(self.control.generic_job(), "generic")
        if self.mode == "generic" and self.restore_state.get("state") in RESTORING_STATES:
            # a generic restore is never resumed: a new one starts below
            self.state.restore_state = {"state": "idle"}
        if self._generic_restore_due():
            # the mount answers while the tiers start: `tierfs wait` must see the restore
            # coming, never the "idle" of a node with nothing to restore (regression: it
            # printed "no restore needed", exit 0, and a trainer started from step 0)
            self.state.restore_state = {"state": "pending", "since": time.time(), "summoned": False}
        await trio.to_thread.run_sync(self.control.write_jax_init_info)
        async with trio.open_nursery() as nursery:
            self.tasks.nursery = nursery
            for tier in self.tiers:
                await nursery.start(tier.run)
            nursery.start_soon(self._housekeeping)
            nursery.start_soon(self._count_budget)
            nursery.start_soon(self.sealer.reconcile)
            for loop in self.background:
                nursery.start_soon(loop)
            self._start_work()
            task_status.started()
            await self.intake.process()

    def _start_work(self) -> None:
        """What the previous daemon left unfinished, or the generic restore of a start."""
        job = self.state.job
        if os.path.lexists(os.path.join(self.store.view, control.REPLICATOR_YAML)):
            # renamed into place just before the previous daemon died: still unread
            self.control.start_control()
        elif (
            self.mode == "protocol"
            and job is not None
            and self.restore_state.get("state") in RESUMABLE_RESTORE_STATES
        ):
            # the previous daemon died between consuming the yaml and publishing
            # the marker: the client still waits for one
            self.tasks.spawn(self.restores.resume, job)
        elif job is not None and self._generic_restore_due():
            # visible at once, so `tierfs wait` right after the mount waits for it
            # (unless the coordinator summoned this node while its tiers started);
            # a one-node job with a bucket restores too: after losing its RAM its
            # backup rounds are all it has (never a silent fresh start); and so does a
            # job shrunk to one node: its steps need the lost nodes' parts (issue #16)
            self.restores.start_generic(job)

    def _generic_restore_due(self) -> bool:
        """True if this start runs a generic restore: a multi-node job, a bucket, or
        steps written by more nodes than the job has now."""
        job = self.state.job
        return (
            self.mode == "generic"
            and job is not None
            and not os.path.lexists(os.path.join(self.store.view, control.REPLICATOR_YAML))
            and (
                job.nodes > 1
                or self.restorer.bucket is not None
                or self.restorer.written_by_more(job)
            )
        )

    async def shutdown(self) -> None:
        """Persist state before the daemon exits."""
        self.intake.close()
        self.book.save()

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
            self.sealer.reschedule_pending()
            # a step another tier pinned (replicating, uploading) past --keep-local
            # goes once the pin is released
            await self.keeper.apply_retention()
