"""``replicator.errors`` and ``replicator.failed`` (:class:`tierfs.core.ports.Reporter`).

PROTOCOL.md section 3: every line names the job and the node rank; the same
recoverable problem is written at most once a minute (a failing retry loop
must not flood the file), the repeats counted in the next line. The last 50
lines also appear in ``tierfs status`` (:attr:`NodeReporter.errors`).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

from tierfs.core import control
from tierfs.core.ports import CurrentJob

log = logging.getLogger(__name__)

#: an identical replicator.errors line is written at most once per this many seconds
ERROR_REPEAT_SECONDS = 60.0


class NodeReporter:
    """Writes problem lines into the client's view.

    Args:
        view_dir: the view directory of the RAM store (where the control files live).
        job: the current job (names the job and rank in each line).
        notify: ``notify(name)`` tells the kernel a view entry changed (the
            client view's; a no-op until the namespace exists).
    """

    def __init__(self, view_dir: str, job: CurrentJob, notify: Callable[[str], None]) -> None:
        self.view_dir = view_dir
        self.job = job
        self.notify = notify
        #: the last lines written, for the status
        self.errors: collections.deque[str] = collections.deque(maxlen=50)
        self._reported: dict[str, tuple[float, int]] = {}

    def forget_repeats(self) -> None:
        """A (re)started job hears about every problem again."""
        self._reported.clear()

    def _line(self, message: str, job_context: bool = True) -> str:
        job = self.job.job if job_context else None
        return control.error_line(
            message, job=job.name if job else None, rank=job.node_rank if job else None
        )

    def error(self, message: str) -> None:
        """Append one line to ``replicator.errors`` (recoverable problem) and log it.

        The same message is written at most once a minute; repeats are counted
        in the next line.
        """
        now = time.monotonic()
        last, repeats = self._reported.get(message, (-1e9, 0))
        if now - last < ERROR_REPEAT_SECONDS:
            self._reported[message] = (last, repeats + 1)
            return
        self._reported[message] = (now, 0)
        if repeats:
            message = f"{message} (and {repeats} more time(s) in the last minute)"
        line = self._line(message)
        log.warning("%s", message)
        self.errors.append(line.strip())
        try:
            control.append_line(self.view_dir, control.REPLICATOR_ERRORS, line)
            self.notify(control.REPLICATOR_ERRORS)
        except OSError as exc:
            log.error("cannot write replicator.errors: %s", exc)

    def failure(self, message: str, *, job_context: bool = True) -> None:
        """Append one line to ``replicator.failed`` (and ``.errors``, as MTC does).

        ``job_context=False`` for a ``replicator.yaml`` that was refused: the line
        must not name the job that was running before it.
        """
        line = self._line(message, job_context)
        log.error("%s", message)
        self.errors.append(line.strip())
        for name in (control.REPLICATOR_FAILED, control.REPLICATOR_ERRORS):
            try:
                control.append_line(self.view_dir, name, line)
                self.notify(name)
            except OSError as exc:
                log.error("cannot write %s: %s", name, exc)
