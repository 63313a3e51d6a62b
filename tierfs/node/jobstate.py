"""The job this node runs now (the ports CurrentJob, Summons and RestoreProgress of
:mod:`tierfs.core.ports`).

The node agent is the only writer (it consumes ``replicator.yaml``, runs the
restore); the planes read it through the port. The coordinator's summons
into another node's restore round reach the agent through
:meth:`JobState.summoned`, which calls the listener the agent registered in
its ``__init__``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tierfs.core.control import JobSpec

#: restore states a daemon restart resumes (the yaml is consumed, no marker yet)
RESUMABLE_RESTORE_STATES = frozenset({"cleanup", "planning", "barrier"})
#: restore states during which retention drops nothing (a copy may still be needed)
RESTORING_STATES = RESUMABLE_RESTORE_STATES | {"pending"}


class JobState:
    """The running job, its mode, timeline start and restore state.

    Attributes:
        job: the running job (a frozen JobSpec; None before the first).
        mode: ``protocol``, ``generic`` or ``none``.
        timeline_since: Unix time (seconds) the current timeline began (a
            replicator.yaml was consumed): steps sealed before it belong to the
            job's previous run.
        restore_state: the restore's state as plain data (``state`` and details).
    """

    def __init__(self) -> None:
        self.job: JobSpec | None = None
        self.mode = "none"
        self.timeline_since = 0.0
        self.restore_state: dict[str, Any] = {"state": "idle"}
        self._summons: list[Callable[[JobSpec], None]] = []

    def restoring(self) -> bool:
        """A restore runs on this node (``cleanup``, ``planning`` or ``barrier``)."""
        return self.restore_state.get("state") in RESUMABLE_RESTORE_STATES

    def progress(self, fields: Mapping[str, Any]) -> None:
        """Merge ``fields`` (``phase`` and details) into the running restore's state
        (:class:`tierfs.core.ports.RestoreProgress`; trio thread)."""
        self.restore_state.update(fields)

    def summoned(self, job: JobSpec) -> None:
        """The coordinator asks this node to join a restore round of ``job`` (trio thread)."""
        for listener in self._summons:
            listener(job)

    def on_summoned(self, listener: Callable[[JobSpec], None]) -> None:
        """Call ``listener(job)`` on :meth:`summoned` (the agent; must not block)."""
        self._summons.append(listener)
