"""What the GCS tier remembers between ticks, and the lines it reports.

Plain state shared by the tier's collaborators (trio thread unless noted):

* :class:`RoundMemory`: the one-node schedule, the rounds of the status, the
  coordinator's last order and this node's outcome, the restore it restarted from;
* :class:`ErrorLines`: ``replicator.errors`` lines, also from other threads;
* :class:`Roles`: who decides the rounds of a job (one node, or the node
  serving the coordinator) and which step is synced.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tierfs.core.ports import Catalog, PeerPlane, Reporter
from tierfs.core.rounds import ScheduleState
from tierfs.core.types import Outcome, RoundView

if TYPE_CHECKING:
    from tierfs.core.control import JobSpec


@dataclass
class RoundMemory:
    """The tier's memory of backup rounds (trio thread).

    Attributes:
        state: the one-node schedule (:mod:`tierfs.core.rounds`).
        history: the last rounds for the status (dicts: round, step, state...).
        backed_up: step -> round of the newest steps this node uploaded.
        cluster_last: (multi-node) the newest round the coordinator ordered,
            with its state, as the last ``Sync`` reply said.
        order: the round the coordinator last ordered this node into.
        ordered: (round, step) orders already taken up (a round that moves is
            ordered again).
        outcome: this node's outcome of the last round it was ordered into.
        untidy: one node: rounds whose upload failed, tidied once a later round is done.
        job: (name, nodes, node rank) of the job this memory is about.
        seeded: the one-node schedule has read the bucket's newest rounds.
        seed_failed: the coordinator's seeding failed (reported once).
        restored_here: a restore ran since the job started (seeding keeps its timeline).
        epoch: Unix time of the last restore: steps sealed before belong to the old
            timeline.
        forced: (job, round, restored step, when) of a restore through
            ``restore.version``, until the file is deleted.
        note: one line for the status (why no rounds are taken, a client problem).
    """

    state: ScheduleState = field(default_factory=lambda: ScheduleState(started_at=time.time()))
    history: collections.deque[dict[str, Any]] = field(
        default_factory=lambda: collections.deque(maxlen=10)
    )
    backed_up: dict[int, str] = field(default_factory=dict)
    cluster_last: RoundView | None = None
    order: tuple[str, int] | None = None
    ordered: collections.deque[tuple[str, int]] = field(
        default_factory=lambda: collections.deque(maxlen=64)
    )
    outcome: Outcome | None = None
    untidy: list[str] = field(default_factory=list)
    job: tuple[str, int, int] | None = None
    seeded: bool = False
    seed_failed: bool = False
    restored_here: bool = False
    epoch: float = 0.0
    forced: tuple[str, str, int, float] | None = None
    note: str | None = None

    def entry(self, rnd: str) -> dict[str, Any] | None:
        """The newest status entry of round ``rnd``, or None."""
        return next((h for h in reversed(self.history) if h["round"] == rnd), None)

    def take_job(self, job: JobSpec) -> bool:
        """Start over for ``job`` if it is another job than the one remembered (a new
        schedule, nothing backed up, no cluster round); returns True if it was."""
        ident = (job.name, job.nodes, job.node_rank)
        if ident == self.job:
            return False
        self.job = ident
        self.state = ScheduleState(started_at=time.time())
        self.backed_up.clear()
        self.cluster_last = None
        return True


class ErrorLines:
    """``replicator.errors`` lines of the GCS tier and the last one for its status.

    Args:
        reporter: the node's reporter (trio thread only).

    Attributes:
        last_error: ``HH:MM:SS message`` of the last line, or None.
        pending: lines from other threads (the coordinator's gRPC threads),
            written by :meth:`flush` on the trio thread.
    """

    def __init__(self, reporter: Reporter) -> None:
        self.reporter = reporter
        self.last_error: str | None = None
        self.pending: collections.deque[str] = collections.deque(maxlen=50)

    def note(self, message: str) -> None:
        """Only the status's last error (the line was written before)."""
        self.last_error = f"{time.strftime('%H:%M:%S')} {message}"

    def fail(self, message: str) -> None:
        """A line in ``replicator.errors`` and the status (trio thread)."""
        self.note(message)
        self.reporter.error(message)

    def fail_later(self, message: str) -> None:
        """:meth:`fail` from another thread: written by the next :meth:`flush`."""
        self.note(message)
        self.pending.append(message)

    def flush(self) -> None:
        """Write the lines other threads queued (trio thread)."""
        while self.pending:
            self.reporter.error(self.pending.popleft())


class Roles:
    """Who decides a job's rounds, and its synced step (trio thread).

    Args:
        catalog: the held shards (one node: the newest sealed step is synced).
        plane: the node's peer plane, or None without one.
    """

    def __init__(self, catalog: Catalog, plane: PeerPlane | None) -> None:
        self.catalog = catalog
        self.plane = plane

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
