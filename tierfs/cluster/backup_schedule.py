"""When a backup round starts, and how the coordinator follows it: pure policy.

PROTOCOL.md section 5 and docs/CLIENTS.md section 5 "Backups": a round is
taken every ``backup-interval-minutes`` (MTC: counted from the last round, or
from the coordinator's start), or every ``backup-interval-steps`` steps, or
at once for a step carrying ``_BACKUP_REQUESTED``; never while the previous
round is still running (a step due meanwhile waits for it; it is skipped,
with a line in ``replicator.errors``, only when a newer step is backed up
instead). The step backed up is the newest step every node has sealed and
replicated (the cluster's sync round; on one node: the newest sealed step).

Two users:

* :func:`decide_round` over a :class:`ScheduleState`: the decision itself.
  A one-node job (no peer plane) calls it from its GCS tier.
* :class:`RoundBook`: the coordinator's bookkeeping of a multi-node job's
  rounds (PROTOCOL.md section 6: the sync round "also decides when a backup
  round starts"). :class:`tierfs.cluster.coordinator.Coordinator` calls it on every
  ``Sync``: it closes the active round once every rank reported its
  :class:`Outcome` (or after a timeout), runs :func:`decide_round` for the
  cluster's synced step, and tells each rank the round it still has to
  upload (:meth:`RoundBook.order_for`). Lines for ``replicator.errors``
  (a skipped step, an incomplete round) queue in :attr:`RoundBook.events`.

No I/O and no clock reads here: every time is an argument (Unix seconds),
everything is unit-tested (tests/bucket/test_gcs_tier.py, tests/unit/test_coordinator.py).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tierfs.backup.layout import dedup_plan, next_round_name, round_time
from tierfs.core import settings
from tierfs.core.types import COMPLETE as COMPLETE
from tierfs.core.types import DONE as DONE
from tierfs.core.types import FAILED as FAILED
from tierfs.core.types import INCOMPLETE as INCOMPLETE
from tierfs.core.types import MISSING as MISSING
from tierfs.core.types import RUNNING as RUNNING
from tierfs.core.types import Outcome as Outcome
from tierfs.core.types import RoundView as RoundView

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
        last_step: the newest step of the job's current timeline known to be
            in a round (None: none); only newer steps are backed up, and
            ``backup-interval-steps`` counts from it.
        active: the round still running, or None.
        skipped_step: the last step found due while a round ran.
        waiting: (step, running round, why due) of the newest step due while a
            round ran: backed up next, or reported skipped when a newer step
            is backed up instead (:func:`superseded`).
    """

    started_at: float
    last_round: str | None = None
    last_round_at: float | None = None
    last_step: int | None = None
    active: str | None = None
    skipped_step: int | None = None
    waiting: tuple[int, str, str] | None = None


@dataclass(frozen=True)
class Decision:
    """What to do now.

    Attributes:
        action: ``start`` (a round ``round`` for ``step``), ``skip`` (due, but
            ``active`` still runs: report once), or ``wait``.
        step: the step concerned.
        round: the new round's name (``start`` only).
        reason: one human line.
        report: for ``skip``, True the first time this step is found due while
            a round runs.
        due: why the step is due (``start`` and ``skip``).
    """

    action: str
    step: int | None = None
    round: str | None = None
    reason: str = ""
    report: bool = False
    due: str = ""


def intervals(minutes: float | None, steps: int | None) -> tuple[float | None, int | None]:
    """The effective (minutes, steps) of a job: Orbax's 30 minutes if it names neither."""
    if not minutes and not steps:
        return DEFAULT_INTERVAL_MINUTES, None
    return (minutes or None), (steps or None)


def decide_round(
    state: ScheduleState,
    *,
    now: float,
    step: int | None,
    backup_requested: bool = False,
    interval_minutes: float | None = None,
    interval_steps: int | None = None,
    previous_name: str | None = None,
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
        due = (
            f"{step - (state.last_step or 0)} step(s) since the last round "
            f"(backup-interval-steps {interval_steps})"
        )
    elif interval_minutes:
        since = state.last_round_at if state.last_round_at is not None else state.started_at
        if now - since >= interval_minutes * 60:
            due = (
                f"{(now - since) / 60:.1f} min since the last round "
                f"(backup-interval-minutes {interval_minutes:g})"
            )
    if not due:
        return Decision(WAIT, step, reason="not due")
    if state.active is not None:
        return Decision(
            SKIP,
            step,
            reason=f"backup of step {step} waits: round {state.active} is still running ({due})",
            report=state.skipped_step != step,
            due=due,
        )
    prev = max((n for n in (previous_name, state.last_round) if n), default=None)
    return Decision(START, step, next_round_name(now, prev), reason=due, due=due)


def superseded(state: ScheduleState, step: int | None) -> list[str]:
    """Step ``step`` is backed up now or waits to be: a step that waited for the
    running round and is older is skipped for good. Returns its line for
    ``replicator.errors`` (one per skipped step; none when nothing waited)."""
    w = state.waiting
    if w is None or step is None or w[0] > step:
        return []
    state.waiting = None
    if w[0] == step:
        return []
    return [
        f"backup of step {w[0]} skipped: round {w[1]} was still running ({w[2]}) "
        f"when the newer step {step} became due"
    ]


def started(state: ScheduleState, decision: Decision, now: float) -> list[str]:
    """Record that ``decision``'s round started; returns the line of an older waiting
    step it supersedes (see :func:`superseded`)."""
    lines = superseded(state, decision.step)
    state.last_round = decision.round
    state.last_round_at = now
    state.last_step = decision.step
    state.active = decision.round
    return lines


def skipped(state: ScheduleState, decision: Decision) -> list[str]:
    """``decision``'s step is due while a round runs: it waits for that round (the
    newest such step is backed up next). Returns the line of an older waiting
    step it supersedes (see :func:`superseded`)."""
    lines = superseded(state, decision.step)
    state.skipped_step = decision.step
    if state.waiting is None and decision.step is not None:
        state.waiting = (decision.step, state.active or "?", decision.due)
    return lines


def finished(state: ScheduleState, round_name: str) -> None:
    """The round ``round_name`` is over (complete or not)."""
    if state.active == round_name:
        state.active = None


def restored(state: ScheduleState, round_name: str | None, step: int | None, now: float) -> None:
    """Step ``step`` of round ``round_name`` is known to be backed up (a restore from
    it, or the bucket's newest complete round): periods count from ``now``; only
    newer steps are backed up."""
    state.started_at = now
    if round_name is not None:
        state.last_round = max(round_name, state.last_round or "")
        state.last_round_at = now
    if step is not None:
        state.last_step = max(step, state.last_step or 0)


def restart_timeline(
    state: ScheduleState, *, backup: str | None, step: int | None, now: float
) -> ScheduleState:
    """The schedule after a restore that restarts the job from ``step`` (every node).

    Round names keep growing (``last_round`` stays) and the period counts from
    the restore. Which step the step interval counts from:

    * restored from round ``backup``: ``step`` (that round holds it);
    * restored from the cluster: the last round's step if it is not newer
      than ``step`` (it is still part of the job's history), else ``step``
      (the last round belongs to the discarded steps after it);
    * nothing restored (``step`` None): the job starts over, none.
    """
    fresh = ScheduleState(
        started_at=now, last_round=state.last_round, last_round_at=state.last_round_at
    )
    if backup is not None:
        fresh.last_round = max(backup, state.last_round or "")
        fresh.last_round_at = now
        fresh.last_step = step
    elif step is None:
        fresh.last_step = None
    elif state.last_step is not None and state.last_step <= step:
        fresh.last_step = state.last_step
    else:
        fresh.last_step = step
    return fresh


def apply_seed(
    state: ScheduleState, complete: tuple[str, int] | None, *, after_restore: bool
) -> None:
    """Take the bucket's newest complete (round, step) into a schedule.

    Without a restore since the schedule began (a daemon restarted under a
    running job) that round's step counts as backed up and the period runs
    from its time. After a restore (:func:`restart_timeline`) it only lowers
    the step the interval counts from, when that round's step is part of the
    restored history.
    """
    if complete is None:
        return
    name, step = complete
    if not after_restore:
        restored(state, name, step, min(round_time(name).timestamp(), state.started_at))
    elif state.last_step is not None and step <= state.last_step:
        state.last_step = step


# ---------------------------------------------------------------------- the coordinator's book

#: a round not finished by every node after this many seconds is given up (default)
ROUND_TIMEOUT = settings.GCS_ROUND_TIMEOUT.default


#: rank -> the manifest digest of that rank's own shard of a step, for the ranks
#: holding it (what the coordinator's inventories say)
Holders = Callable[[int], dict[int, str | None]]


@dataclass
class ActiveRound:
    """The round the coordinator ordered and is waiting on.

    Attributes:
        step: the step it backs up now (a move changes it).
        moved_from: older steps it was ordered for before it moved.
        dedup: ranks that may point at their column's uploader's data.
        lacking: rank -> why it cannot upload ``step`` (it no longer holds it);
            the round waits for a newer step every node holds.
    """

    round: str
    step: int
    started: float
    reason: str = ""
    outcomes: dict[int, Outcome] = field(default_factory=dict)
    moved_from: list[int] = field(default_factory=list)
    dedup: frozenset[int] = frozenset()
    lacking: dict[int, str] = field(default_factory=dict)


class RoundBook:
    """The coordinator's backup rounds of one job (pure; not thread-safe).

    The coordinator serializes every call (its servicer's lock). Life cycle:
    :meth:`reset` when the coordinator takes up a job; :meth:`seed` once the
    owner (node-rank 0's GCS tier) has listed the bucket, since round names
    must sort after every round already there and a restarted coordinator
    must not back up the newest complete round's step again -- no round
    starts before that (:func:`apply_seed`); :meth:`restored` at each
    restore decision;
    :meth:`report`/:meth:`member_restarted`/:meth:`tick` on every ``Sync``.

    Args:
        timeout: seconds after which a round some node never finished is
            given up (reported once as incomplete).
        history: finished rounds kept for the status.

    Attributes:
        events: lines for ``replicator.errors`` of the coordinator's node, in
            order; the owner takes them with :meth:`drain`.
    """

    def __init__(self, *, timeout: float = ROUND_TIMEOUT, history: int = 10) -> None:
        self.timeout = timeout
        #: rounds whose leftovers (a failed round; a moved round's older parts) the
        #: owner may remove once a later round completed (:meth:`take_cleanup`)
        self.untidy: list[str] = []
        self.cleanup: list[str] = []
        self._dp_reported: set[tuple[int, tuple[tuple[int, tuple[int, ...]], ...]]] = set()
        self.job: str | None = None
        self.nodes = 0
        self.state = ScheduleState(started_at=0.0)
        self.seeded = False
        self.previous_name: str | None = None
        self.restored_seen = False
        self.active: ActiveRound | None = None
        self.last_view: RoundView | None = None
        self.last_reason = ""
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=history)
        self.events: list[str] = []

    # ------------------------------------------------------------------ life cycle

    def reset(self, job: str, nodes: int, now: float) -> None:
        """Take up ``job`` of ``nodes`` nodes from scratch (unseeded, no round)."""
        self.job, self.nodes = job, nodes
        self.state = ScheduleState(started_at=now)
        self.seeded = False
        self.previous_name = None
        self.restored_seen = False
        self.active = None
        self.last_view = None
        self.last_reason = ""
        self.history.clear()
        self.untidy.clear()
        self.cleanup.clear()
        self._dp_reported.clear()

    def seed(self, job: str, newest: str | None, complete: tuple[str, int] | None) -> bool:
        """What the bucket holds: its newest round name and newest complete (round, step).

        Round names from now on sort after ``newest``. Unless a restore was
        decided since :meth:`reset` (then the restore sets the timeline),
        ``complete``'s step is taken as backed up and the period counts from
        that round's time. Ignored (returns False) if the book has moved on
        to another job meanwhile.
        """
        if job != self.job:
            return False
        if newest is not None:
            self.previous_name = max(newest, self.previous_name or "")
        apply_seed(self.state, complete, after_restore=self.restored_seen)
        self.seeded = True
        return True

    def restored(
        self, backup: str | None, step: int | None, now: float, *, new_timeline: bool = True
    ) -> None:
        """A restore was decided (``step`` from ``backup``, or from the cluster; None: nothing).

        Args:
            new_timeline: every node restarts from ``step`` (protocol mode): see
                :func:`restart_timeline`; a round still running belongs to
                the old timeline (dropped). False (generic mode: one node came
                back while the others train on): the schedule stays as it is.
        """
        if not new_timeline:
            return
        self.restored_seen = True
        if self.active is not None:
            self._close(self.active, "abandoned (the job restarted)", report=None)
        self.state = restart_timeline(self.state, backup=backup, step=step, now=now)

    # ------------------------------------------------------------------ per Sync

    def report(self, rank: int, outcome: Outcome) -> None:
        """Node ``rank``'s outcome; anything but the active round's current step is
        ignored (stale, or from before the round moved). :data:`MISSING` does not
        end the node's part: the round moves to a newer step (:meth:`tick`)."""
        a = self.active
        if (
            a is None
            or outcome.round != a.round
            or outcome.step != a.step
            or not 0 <= rank < self.nodes
        ):
            return
        if outcome.state == MISSING:
            a.lacking.setdefault(rank, outcome.error or f"step {a.step} is not held")
            return
        if outcome.state not in (DONE, FAILED):
            outcome = Outcome(
                outcome.round, outcome.step, FAILED, f"unknown outcome {outcome.state!r}"
            )
        a.outcomes.setdefault(rank, outcome)

    def member_restarted(self, rank: int) -> None:
        """Node ``rank`` came back as a new daemon: its part of the active round is lost."""
        a = self.active
        if a is not None and 0 <= rank < self.nodes and rank not in a.outcomes:
            a.outcomes[rank] = Outcome(
                a.round, a.step, FAILED, f"node-rank {rank} restarted during the round"
            )

    def tick(
        self,
        now: float,
        *,
        step: int | None,
        backup_requested: bool = False,
        interval_minutes: float | None = None,
        interval_steps: int | None = None,
        may_start: bool = True,
        holders: Holders | None = None,
        data_parallelism: int | None = None,
    ) -> Decision:
        """Close the active round if it is over (or move it), then decide about ``step``.

        Args:
            now: Unix seconds.
            step: the cluster's synced step (None: none yet).
            backup_requested: that step carries ``_BACKUP_REQUESTED`` on some node.
            interval_minutes, interval_steps: the job's settings as given (None/0:
                not set; :func:`intervals` turns them into the period).
            may_start: False while a restore round is open (no new round then).
            holders: which ranks hold their own shard of a step, with its digest
                (the inventories); None: assume every rank holds it, no dedup.
            data_parallelism: the job's ``assume-data-parallelism`` (for dedup).

        A round starts only for a step every rank still holds. A rank that no
        longer holds the active round's step before finishing its part
        (retention dropped it: the cadence outran the backups) makes the round
        move to ``step`` once every rank holds that newer step: each rank then
        uploads the new step into the same round (parts already written for the
        older step are removed once a later round completed).

        Returns:
            the decision (``start``: :attr:`active` is the new round; ``skip``:
            the step waits for the running round -- a step skipped for good is
            reported once through :attr:`events`; ``wait``).
        """
        a = self.active
        if a is not None:
            self._follow(a, now, step, holders, data_parallelism)
        if not may_start:
            return Decision(WAIT, step, reason="a restore round is open")
        if not self.seeded:
            return Decision(WAIT, step, reason="the bucket has not been listed yet")
        minutes, steps = intervals(interval_minutes, interval_steps)
        decision = decide_round(
            self.state,
            now=now,
            step=step,
            backup_requested=backup_requested,
            interval_minutes=minutes,
            interval_steps=steps,
            previous_name=self.previous_name,
        )
        if decision.action == SKIP:
            self.events.extend(skipped(self.state, decision))
        elif decision.action == START:
            assert decision.round is not None and decision.step is not None
            held = holders(decision.step) if holders is not None else None
            lacking = [r for r in range(self.nodes) if held is not None and r not in held]
            if lacking:
                decision = Decision(
                    WAIT,
                    decision.step,
                    reason=(
                        f"step {decision.step} is no longer held by node-rank(s) {lacking}; "
                        "waiting for a step every node holds"
                    ),
                )
            else:
                self.events.extend(started(self.state, decision, now))
                self.active = ActiveRound(decision.round, decision.step, now, decision.reason)
                self._plan(self.active, held, data_parallelism)
                self.last_view = RoundView(decision.round, decision.step, RUNNING)
                self.history.append(
                    {
                        "round": decision.round,
                        "step": decision.step,
                        "state": RUNNING,
                        "started": now,
                        "reason": decision.reason,
                    }
                )
        self.last_reason = decision.reason
        return decision

    def _stuck(self, a: ActiveRound | None, holders: Holders | None) -> bool:
        """Some rank cannot finish ``a`` because it no longer holds its step."""
        if a is None:
            return False
        if holders is not None:
            held = holders(a.step)
            for r in range(self.nodes):
                if r not in held and r not in a.outcomes:
                    a.lacking.setdefault(r, f"step {a.step} is no longer held on node-rank {r}")
        return bool(a.lacking)

    def _follow(
        self,
        a: ActiveRound,
        now: float,
        step: int | None,
        holders: Holders | None,
        data_parallelism: int | None,
    ) -> None:
        """Move a stuck round to ``step``, or close it when every rank reported or it
        timed out."""
        if self._stuck(a, holders) and step is not None and step > a.step:
            held = holders(step) if holders is not None else None
            if held is None or all(r in held for r in range(self.nodes)):
                self.events.extend(superseded(self.state, step))
                a.moved_from.append(a.step)
                a.step = step
                a.outcomes.clear()
                a.lacking.clear()
                self._plan(a, held, data_parallelism)
                self.state.last_step = max(step, self.state.last_step or 0)
                self.last_view = RoundView(a.round, a.step, RUNNING)
                for h in reversed(self.history):
                    if h["round"] == a.round:
                        h["step"] = step
                        h["moved_from"] = list(a.moved_from)
                        break
                return
        missing = [r for r in range(self.nodes) if r not in a.outcomes]
        if not missing:
            failed = sorted(r for r, o in a.outcomes.items() if o.state != DONE)
            if failed:
                first = a.outcomes[failed[0]]
                self._close(
                    a,
                    INCOMPLETE,
                    report=(
                        f"backup round {a.round} (step {a.step}) is incomplete: node-rank(s) "
                        f"{failed} failed (node-rank {failed[0]}: {first.error or '?'})"
                    ),
                )
            else:
                self._close(a, COMPLETE, report=None)
        elif now - a.started >= self.timeout:
            why = ""
            if a.lacking:
                r0 = min(a.lacking)
                why = (
                    f"; node-rank(s) {sorted(a.lacking)} no longer held step {a.step} "
                    f"and no newer step was held by every node (node-rank {r0}: "
                    f"{a.lacking[r0]})"
                )
            self._close(
                a,
                INCOMPLETE,
                report=(
                    f"backup round {a.round} (step {a.step}) given up after "
                    f"{self.timeout:.0f} s: node-rank(s) {missing} never finished{why}; the "
                    "round is incomplete"
                ),
            )

    def _plan(
        self, a: ActiveRound, held: dict[int, str | None] | None, data_parallelism: int | None
    ) -> None:
        """Which ranks of ``a`` may dedup (checksums equal to their uploader's); a
        column whose checksums differ is reported once per job and set of ranks."""
        if held is None or not data_parallelism or data_parallelism <= 1:
            a.dedup = frozenset()
            return
        plan = dedup_plan(held, self.nodes, data_parallelism)
        a.dedup = plan.dedup
        if plan.differing:
            key = (data_parallelism, plan.differing)
            if key not in self._dp_reported:
                self._dp_reported.add(key)
                self.events.append(
                    f"backup round {a.round}: " + plan.describe(a.step, data_parallelism)
                )

    def _close(self, a: ActiveRound, state: str, report: str | None) -> None:
        finished(self.state, a.round)
        self.active = None
        self.last_view = RoundView(a.round, a.step, state)
        for h in reversed(self.history):
            if h["round"] == a.round:
                h["state"] = state
                h["nodes"] = {str(r): o.state for r, o in sorted(a.outcomes.items())}
                break
        if report is not None:
            self.events.append(report)
        if state != COMPLETE or a.moved_from:
            self.untidy.append(a.round)
        if state == COMPLETE:
            # every node finished this round's uploads after those of the rounds
            # before it (one upload at a time per node): their leftovers are final
            self.cleanup.extend(n for n in self.untidy if n not in self.cleanup)
            self.untidy.clear()

    def take_cleanup(self) -> list[str]:
        """Rounds whose leftovers may be removed now (a failed round; a moved round's
        older parts), taken once by the owner (:meth:`tierfs.backup.bucket.GcsBackend.
        tidy_round` judges each again before deleting anything)."""
        out, self.cleanup = self.cleanup, []
        return out

    def order_for(self, rank: int) -> tuple[str, int] | None:
        """The (round, step) node ``rank`` still has to upload, or None (it reported,
        or it no longer holds the step and the round waits to move)."""
        a = self.active
        if a is None or rank in a.outcomes or rank in a.lacking:
            return None
        return a.round, a.step

    def dedup_for(self, rank: int) -> bool:
        """Node ``rank`` may point at its column's uploader's data in the active round
        (its shard's checksums equal the uploader's)."""
        a = self.active
        return a is not None and rank in a.dedup

    def last(self) -> RoundView | None:
        """The newest round ordered, with its state."""
        return self.last_view

    def drain(self) -> list[str]:
        """Take the queued ``replicator.errors`` lines."""
        out, self.events = self.events, []
        return out

    def status(self) -> dict[str, Any]:
        """Plain data for the coordinator's status."""
        a = self.active
        return {
            "seeded": self.seeded,
            "active": (
                {
                    "round": a.round,
                    "step": a.step,
                    "reported": sorted(a.outcomes),
                    "moved_from": list(a.moved_from),
                    "lacking": dict(a.lacking),
                    "dedup": sorted(a.dedup),
                }
                if a
                else None
            ),
            "last_round": self.state.last_round,
            "last_step": self.state.last_step,
            "last_decision": self.last_reason,
            "rounds": list(self.history),
        }
