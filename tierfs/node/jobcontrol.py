"""The job this node runs: ``replicator.yaml`` consumed, generic job, JAX init info.

:class:`JobControl` reads the control file the client writes into the mount
(PROTOCOL.md section 2), reports a bad one through ``replicator.failed`` and
``replicator.errors``, deletes it and starts the restore; an empty file resets
the node to the generic job of its configuration. It is the only writer of
the job and mode in :class:`tierfs.node.jobstate.JobState` and of the seal
rules. Consuming runs under one lock, one yaml at a time (trio thread; file
work in worker threads).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Protocol

import trio

from tierfs.core import control
from tierfs.core.config import NodeConfig
from tierfs.core.control import ControlError, JobSpec
from tierfs.node.jobstate import JobState
from tierfs.node.sealing import SealRules
from tierfs.node.steps import StepBook
from tierfs.node.tasks import TaskSpawner
from tierfs.node.view import ClientView
from tierfs.store.ramstore import RamStore

__all__ = ["DEFAULT_JOB", "ControlReporter", "JobControl", "Restores"]

log = logging.getLogger(__name__)

#: the job name of generic mode when the configuration names none
DEFAULT_JOB = "default"


class Restores(Protocol):
    """What consuming a yaml needs of :class:`tierfs.node.restore_driver.RestoreDriver`."""

    def cancel(self) -> None: ...

    async def restore(self, job: JobSpec) -> None: ...


class ControlReporter(Protocol):
    """The node reporter as the control file needs it."""

    def error(self, message: str) -> None: ...

    def failure(self, message: str, *, job_context: bool = True) -> None: ...

    def forget_repeats(self) -> None: ...


class JobControl:
    """Sets the job and consumes ``replicator.yaml`` (trio thread).

    Args:
        config: the node configuration (the generic job, seal patterns, JAX info).
        store: the RAM store (the view directory holding the yaml).
        state: the running job, mode and restore state (written here).
        view: the client view (old entries hidden, error files, the yaml deleted).
        book: the steps in the view (seal rules; cleared candidates; saved).
        reporter: ``replicator.errors``/``failed``.
        restores: restarts the restore for a new job.
        tasks: where consuming and restoring run.
    """

    def __init__(
        self,
        config: NodeConfig,
        store: RamStore,
        state: JobState,
        view: ClientView,
        book: StepBook,
        reporter: ControlReporter,
        restores: Restores,
        tasks: TaskSpawner,
    ) -> None:
        self.config = config
        self.store = store
        self.state = state
        self.view = view
        self.book = book
        self.reporter = reporter
        self.restores = restores
        self.tasks = tasks
        self._lock = trio.Lock()

    def set_job(self, job: JobSpec | None, mode: str) -> None:
        """Make ``job`` the running job in ``mode`` (``none`` without a job) and derive
        its seal rules."""
        self.state.job = job
        self.state.mode = mode if job else "none"
        if job is None:
            self.book.rules = None
            return
        self.book.rules = SealRules(
            job.framework, job.name, job.node_rank, job.workers_per_node, self.config.seal_patterns
        )

    def generic_job(self) -> JobSpec:
        """The generic-mode job of the node configuration (``--job``, ranks, backups)."""
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

    def write_jax_init_info(self) -> None:
        """Write the JAX init info file into the view when ``--process-id`` and the JAX
        coordinator are configured (blocking: a worker thread)."""
        c = self.config
        if c.process_id is None or not c.jax_coordinator:
            return
        control.atomic_write(
            self.store.view,
            control.JAX_INIT_INFO,
            control.jax_init_info_text(c.process_id, c.jax_coordinator).encode(),
        )
        self.view.notify(control.JAX_INIT_INFO)

    def start_control(self) -> None:
        """A ``replicator.yaml`` arrived: cancel a running restore and consume it."""
        self.restores.cancel()
        self.tasks.spawn(self._consume_control)

    async def _consume_control(self) -> None:
        async with self._lock:
            self.reporter.forget_repeats()  # a (re)started job hears about every problem again
            path = os.path.join(self.store.view, control.REPLICATOR_YAML)
            try:
                # read and parse off the FUSE loop: a large file takes seconds
                job = await trio.to_thread.run_sync(control.load_replicator_yaml, path)
            except FileNotFoundError:
                return
            except OSError as exc:
                await trio.to_thread.run_sync(self.view.clear_error_files)
                self.reporter.failure(
                    f"replicator.yaml could not be read: {exc.strerror or exc}", job_context=False
                )
                await trio.to_thread.run_sync(self.view.delete_control)
                return
            except ControlError as exc:
                await trio.to_thread.run_sync(self.view.clear_error_files)
                self.reporter.failure(str(exc), job_context=False)
                await trio.to_thread.run_sync(self.view.delete_control)
                return
            if job is None:
                log.info("empty replicator.yaml: reset")
                self.set_job(self.generic_job(), "generic")
                self.state.restore_state = {"state": "idle"}
                await trio.to_thread.run_sync(self.view.withdraw_restore)
                await trio.to_thread.run_sync(self.view.delete_control)
                self.book.save()
                return
            restarted = self.state.mode == "protocol"
            log.info(
                "replicator.yaml: job %s rank %d/%d framework %s%s",
                job.name,
                job.node_rank,
                job.nodes,
                job.framework,
                " (job restarted)" if restarted else "",
            )
            self.set_job(job, "protocol")
            self.state.timeline_since = time.time()
            self.book.pending.clear()
            self.view.published.clear()
            self.state.restore_state = {"state": "cleanup", "since": time.time()}
            await trio.to_thread.run_sync(self.view.cleanup, self.book.view_steps)
            for warning in job.warnings:
                self.reporter.error(warning)
            self.book.save()
            await trio.to_thread.run_sync(self.view.delete_control)
            self.tasks.spawn(self.restores.restore, job)
