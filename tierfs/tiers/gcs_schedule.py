"""When a backup round starts: the pure schedule the deciding node (node-rank 0) follows.

PROTOCOL.md section 5 and docs/CLIENTS.md section 5 "Backups": a round is
taken every ``backup-interval-minutes`` (MTC: counted from the last round, or
from the coordinator's start), or every ``backup-interval-steps`` steps, or
at once for a step carrying ``_BACKUP_REQUESTED``; never while the previous
round is still running (that step is skipped with a line in
``replicator.errors``). The step backed up is the newest step every node has
sealed and replicated (the cluster's sync round; on one node: the newest
sealed step).

No I/O and no clock reads here: :func:`decide_round` is a function of a
:class:`ScheduleState` and the caller's inputs (unit-tested).
"""

from __future__ import annotations

from dataclasses import dataclass

from tierfs.tiers.gcs_layout import next_round_name

#: Orbax's default when a job names no interval (minutes)
DEFAULT_INTERVAL_MINUTES = 30.0

START, SKIP, WAIT = "start", "skip", "wait"


@dataclass
class ScheduleState:
    """What the decider remembers between decisions (times are Unix seconds).

    Attributes:
        started_at: when scheduling began (job start, or the end of a restore).
        last_round: name of the newest round started (or restored from), if any.
        last_round_at: when it started.
        last_step: the step it holds (or the restored step); newer steps only.
        active: the round still running, or None.
        skipped_step: the last step a skip was reported for (one line per step).
    """

    started_at: float
    last_round: str | None = None
    last_round_at: float | None = None
    last_step: int | None = None
    active: str | None = None
    skipped_step: int | None = None


@dataclass(frozen=True)
class Decision:
    """What to do now.

    Attributes:
        action: ``start`` (a round ``round`` for ``step``), ``skip`` (due, but
            ``active`` still runs: report once), or ``wait``.
        step: the step concerned.
        round: the new round's name (``start`` only).
        reason: one human line.
        report: for ``skip``, True the first time this step is skipped.
    """

    action: str
    step: int | None = None
    round: str | None = None
    reason: str = ""
    report: bool = False


def intervals(minutes: float | None, steps: int | None) -> tuple[float | None, int | None]:
    """The effective (minutes, steps) of a job: Orbax's 30 minutes if it names neither."""
    if not minutes and not steps:
        return DEFAULT_INTERVAL_MINUTES, None
    return (minutes or None), (steps or None)


def decide_round(state: ScheduleState, *, now: float, step: int | None,
                 backup_requested: bool = False, interval_minutes: float | None = None,
                 interval_steps: int | None = None, previous_name: str | None = None
                 ) -> Decision:
    """Decide whether a backup round starts now (pure; see the module docstring).

    Args:
        state: the decider's memory (not modified).
        now: Unix time in seconds.
        step: the newest step every node sealed and replicated, or None.
        backup_requested: that step carries ``_BACKUP_REQUESTED``.
        interval_minutes, interval_steps: the job's period (see :func:`intervals`).
        previous_name: the newest round name known in the bucket (names never repeat).

    Returns:
        a :class:`Decision`; the caller updates ``state`` with :func:`started`
        or :func:`skipped`.
    """
    if step is None or step <= 0 or (state.last_step is not None and step <= state.last_step):
        return Decision(WAIT, step, reason="no new step to back up")
    due = ""
    if backup_requested:
        due = f"step {step} carries _BACKUP_REQUESTED"
    elif interval_steps and step - (state.last_step or 0) >= interval_steps:
        due = f"{step - (state.last_step or 0)} step(s) since the last round " \
              f"(backup-interval-steps {interval_steps})"
    elif interval_minutes:
        since = state.last_round_at if state.last_round_at is not None else state.started_at
        if now - since >= interval_minutes * 60:
            due = f"{(now - since) / 60:.1f} min since the last round " \
                  f"(backup-interval-minutes {interval_minutes:g})"
    if not due:
        return Decision(WAIT, step, reason="not due")
    if state.active is not None:
        return Decision(SKIP, step, reason=f"backup of step {step} skipped: round "
                        f"{state.active} is still running ({due})",
                        report=state.skipped_step != step)
    prev = max((n for n in (previous_name, state.last_round) if n), default=None)
    return Decision(START, step, next_round_name(now, prev), reason=due)


def started(state: ScheduleState, decision: Decision, now: float) -> None:
    """Record that ``decision``'s round started."""
    state.last_round = decision.round
    state.last_round_at = now
    state.last_step = decision.step
    state.active = decision.round


def skipped(state: ScheduleState, decision: Decision) -> None:
    """Record that ``decision``'s step was skipped (reported once)."""
    state.skipped_step = decision.step


def finished(state: ScheduleState, round_name: str) -> None:
    """The round ``round_name`` is over (complete or not)."""
    if state.active == round_name:
        state.active = None


def restored(state: ScheduleState, round_name: str | None, step: int | None,
             now: float) -> None:
    """A restore happened: periods count from now; only newer steps are backed up."""
    state.started_at = now
    if round_name is not None:
        state.last_round = max(round_name, state.last_round or "")
        state.last_round_at = now
    if step is not None:
        state.last_step = max(step, state.last_step or 0)
