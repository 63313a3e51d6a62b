"""Backup rounds as both planes see them: names, data-parallel uploaders, the schedule.

Pure functions over plain data (no I/O, no clock reads: every time is an
argument, Unix seconds), shared by the durable plane (:mod:`tierfs.backup`:
the bucket layout, a one-node job's schedule in
:class:`tierfs.backup.tier.GcsTier`) and the cluster
(:class:`tierfs.cluster.backup_schedule.RoundBook`, the coordinator's
bookkeeping of a multi-node job's rounds), so neither plane imports the other.

* the states of a round and of a node's part (:data:`RUNNING`, :data:`COMPLETE`,
  :data:`INCOMPLETE`; :data:`DONE`, :data:`FAILED`, :data:`MISSING`) and the
  :class:`Outcome`/:class:`RoundView` values, re-exported from :mod:`tierfs.core.types`;
* round names: ``YYYY-MM-DD_HH-MM`` in UTC (the MTC bucket layout, PROTOCOL.md
  section 5), :func:`next_round_name` so names never repeat;
* data parallelism (``assume-data-parallelism`` D): which rank uploads a
  column's data (:func:`uploader_of`) and who may point at it for a step
  (:func:`dedup_plan`: checksums, not the claim);
* when a backup round starts (PROTOCOL.md section 5 and docs/CLIENTS.md
  section 5 "Backups"): a round is taken every ``backup-interval-minutes``
  (MTC: counted from the last round, or from the start), or every
  ``backup-interval-steps`` steps, or at once for a step carrying
  ``_BACKUP_REQUESTED``; never while the previous round is still running (a
  step due meanwhile waits for it; it is skipped, with a line in
  ``replicator.errors``, only when a newer step is backed up instead). The
  step backed up is the newest step every node has sealed and replicated (the
  cluster's sync round; on one node: the newest sealed step).
  :func:`decide_round` over a :class:`ScheduleState` is the decision;
  :func:`started`, :func:`skipped`, :func:`finished`, :func:`restart_timeline`,
  :func:`apply_seed` update the state.

Unit-tested in tests/unit/test_gcs_layout.py, tests/unit/test_gcs_rounds.py and
tests/unit/test_coordinator.py.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping
from dataclasses import dataclass

from tierfs.core.errors import BackupError
from tierfs.core.types import COMPLETE as COMPLETE
from tierfs.core.types import DONE as DONE
from tierfs.core.types import FAILED as FAILED
from tierfs.core.types import INCOMPLETE as INCOMPLETE
from tierfs.core.types import MISSING as MISSING
from tierfs.core.types import RUNNING as RUNNING
from tierfs.core.types import Outcome as Outcome
from tierfs.core.types import RoundView as RoundView

#: ``YYYY-MM-DD_HH-MM`` in UTC: the name of one backup round directory
ROUND_FORMAT = "%Y-%m-%d_%H-%M"
ROUND_RE = re.compile(r"^\d{4}-\d{2}-\d{2}_\d{2}-\d{2}$")


class LayoutError(BackupError, ValueError):
    """A bucket spec, object name, round name or backup manifest is malformed."""


# ---------------------------------------------------------------------- round names


def round_name(when: float | dt.datetime) -> str:
    """The round directory name for a time: UTC, minute resolution.

    Args:
        when: Unix time in seconds, or an aware datetime (naive ones are taken as UTC).
    """
    if isinstance(when, dt.datetime):
        t = when if when.tzinfo else when.replace(tzinfo=dt.UTC)
    else:
        t = dt.datetime.fromtimestamp(when, dt.UTC)
    return t.astimezone(dt.UTC).strftime(ROUND_FORMAT)


def round_time(name: str) -> dt.datetime:
    """The UTC start minute a round name stands for.

    Raises:
        LayoutError: not ``YYYY-MM-DD_HH-MM``.
    """
    check_round_name(name)
    try:
        return dt.datetime.strptime(name, ROUND_FORMAT).replace(tzinfo=dt.UTC)
    except ValueError as exc:
        raise LayoutError(f"bad round name {name!r}: {exc}") from None


def check_round_name(name: str) -> None:
    """Raises LayoutError unless ``name`` is ``YYYY-MM-DD_HH-MM``."""
    if not ROUND_RE.match(name or ""):
        raise LayoutError(f"bad round name {name!r} (want UTC YYYY-MM-DD_HH-MM)")


def is_round_name(name: str) -> bool:
    """True for a valid ``YYYY-MM-DD_HH-MM`` name."""
    try:
        round_time(name)
    except LayoutError:
        return False
    return True


def next_round_name(when: float, previous: str | None) -> str:
    """A round name for ``when`` that sorts after ``previous`` (the same minute is bumped).

    Two rounds started in the same minute would share a directory; the
    coordinator uses this to give the second one the next minute's name.
    """
    name = round_name(when)
    if previous is not None and name <= previous:
        name = round_name(round_time(previous) + dt.timedelta(minutes=1))
    return name


# ---------------------------------------------------------------------- data parallelism


def uploads_data(rank: int, nodes: int, data_parallelism: int | None) -> bool:
    """Does ``rank`` upload data objects (else only its ``.meta`` and manifest)?

    With ``assume-data-parallelism`` D the ranks form a D x (nodes/D) grid
    whose columns hold identical data; as in MTC only the last row
    (``rank >= nodes - nodes // D``) uploads data. Without it every rank does.
    """
    if not data_parallelism or data_parallelism <= 1 or nodes % data_parallelism:
        return True
    return rank >= nodes - nodes // data_parallelism


def data_column(rank: int, nodes: int, data_parallelism: int | None) -> int:
    """The data-parallel column of ``rank`` (= ``rank`` without data parallelism)."""
    if not data_parallelism or data_parallelism <= 1 or nodes % data_parallelism:
        return rank
    return rank % (nodes // data_parallelism)


def uploader_of(rank: int, nodes: int, data_parallelism: int | None) -> int:
    """The rank whose data objects ``rank``'s ``.meta`` points at."""
    if uploads_data(rank, nodes, data_parallelism):
        return rank
    cols = nodes // data_parallelism  # type: ignore[operator]
    return nodes - cols + rank % cols


@dataclass(frozen=True)
class DedupPlan:
    """Which ranks of a data-parallel job may point at their uploader's data for one step.

    Attributes:
        dedup: ranks (never an uploader) whose shard digest equals their
            column's uploader's: they upload no data once the bucket proves
            the objects are there (:meth:`tierfs.backup.bucket.GcsBackend.upload_shard`).
        differing: ``(uploader, ranks)`` for every column where some rank's
            digest differs from the uploader's (``ranks`` sorted, the uploader
            included): ``assume-data-parallelism`` did not hold there, every
            rank of it uploads its own data.
    """

    dedup: frozenset[int] = frozenset()
    differing: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def describe(self, step: int, data_parallelism: int | None) -> str:
        """One line for ``replicator.errors`` (empty when nothing differs)."""
        if not self.differing:
            return ""
        groups = "; ".join(
            f"node-ranks {list(ranks)} (uploader {u})" for u, ranks in self.differing
        )
        return (
            f"assume-data-parallelism {data_parallelism} did not hold for step {step}: "
            f"the shards of {groups} differ (their manifests' checksums), so each of "
            "these nodes uploads its own data"
        )


def dedup_plan(
    digests: dict[int, str | None], nodes: int, data_parallelism: int | None
) -> DedupPlan:
    """Who may skip uploading data for one step (pure): checksums, not the claim.

    Args:
        digests: rank -> the manifest digest of its own shard of the step
            (:attr:`tierfs.store.manifest.Manifest.digest`), None or absent when the
            rank does not hold it.
        nodes: the job's node count.
        data_parallelism: the job's ``assume-data-parallelism`` (None/1: no dedup).

    A rank dedups only when its digest and its uploader's are both known and
    equal. A rank or uploader without the step is no sign of differing data
    (it cannot upload anyway) and is not reported.
    """
    dedup: set[int] = set()
    groups: dict[int, set[int]] = {}
    for r in range(nodes):
        u = uploader_of(r, nodes, data_parallelism)
        if u == r:
            continue
        mine, theirs = digests.get(r), digests.get(u)
        if mine is None or theirs is None:
            continue
        if mine == theirs:
            dedup.add(r)
        else:
            groups.setdefault(u, {u}).add(r)
    differing = tuple((u, tuple(sorted(rs))) for u, rs in sorted(groups.items()))
    return DedupPlan(frozenset(dedup), differing)


# ---------------------------------------------------------------------- the schedule

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
        last_parts: (rank, manifest digest) of each part of ``last_step`` when
            its round started (None: not known, e.g. taken from the bucket): the
            same step number with other bytes (saved again) is backed up again.
        again_since: when a re-save of ``last_step`` by some but not all ranks was
            first seen (:func:`note_settling`); None when none waits.
    """

    started_at: float
    last_round: str | None = None
    last_round_at: float | None = None
    last_step: int | None = None
    active: str | None = None
    skipped_step: int | None = None
    waiting: tuple[int, str, str] | None = None
    last_parts: tuple[tuple[int, str], ...] | None = None
    again_since: float | None = None


#: seconds a step saved again by some ranks waits for the others' new parts before
#: its round starts anyway (a collective save seals every rank's part within seconds)
RESAVE_SETTLE = 30.0


def parts_key(
    parts: Mapping[int, str | None] | Mapping[int, str] | None,
) -> tuple[tuple[int, str], ...] | None:
    """``parts`` (rank -> manifest digest) as :attr:`ScheduleState.last_parts`:
    (rank, digest) pairs by rank, unknown ("" or None) digests left out; None when none
    is known (pure)."""
    return tuple(sorted((r, d) for r, d in (parts or {}).items() if d)) or None


def saved_again(last: tuple[tuple[int, str], ...] | None, parts: Mapping[int, str]) -> list[int]:
    """The ranks whose part of the step last backed up now has other bytes (its
    number saved again): ranks in both ``last`` and ``parts`` (rank -> digest)
    whose digests differ, ascending; [] when ``last`` is unknown."""
    if not last:
        return []
    before = dict(last)
    return sorted(r for r, d in parts.items() if d and r in before and before[r] != d)


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
        settling: a ``wait`` because the step was saved again by some ranks and
            the others' new parts may still come (:data:`RESAVE_SETTLE`).
    """

    action: str
    step: int | None = None
    round: str | None = None
    reason: str = ""
    report: bool = False
    due: str = ""
    settling: bool = False


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
    parts: Mapping[int, str] | None = None,
) -> Decision:
    """Decide whether a backup round starts now (pure; see the module docstring).

    Args:
        state: the decider's memory (not modified).
        now: Unix time in seconds.
        step: the newest step every node sealed and replicated, or None.
        backup_requested: that step carries ``_BACKUP_REQUESTED``.
        interval_minutes, interval_steps: the job's period (see :func:`intervals`).
        previous_name: the newest round name known in the bucket (names never repeat).
        parts: rank -> the digest of its own part of ``step`` now (the inventories):
            ``step`` equal to the step last backed up but with other bytes in a
            part (the step number saved again) is due again at once.

    Returns:
        a :class:`Decision`; the caller updates ``state`` with :func:`started`
        or :func:`skipped`.
    """
    again = (
        saved_again(state.last_parts, parts or {})
        if step is not None and step == state.last_step
        else []
    )
    if step is None or step <= 0:
        return Decision(WAIT, step, reason="no new step to back up")
    if not again and state.last_step is not None and step <= state.last_step:
        return Decision(WAIT, step, reason="no new step to back up")
    if again:
        # one round for the whole re-save: a round started at the first rank's new part
        # would mix it with the other ranks' old parts, a step nobody saved
        # (regression: two rounds 0.1 s apart, the first one mixed)
        before = dict(state.last_parts or ())
        others = sorted(r for r in parts or {} if r in before and r not in again)
        since = state.again_since if state.again_since is not None else now
        if others and now - since < RESAVE_SETTLE:
            return Decision(
                WAIT,
                step,
                reason=(
                    f"step {step} was saved again by rank(s) {again}: waiting up to "
                    f"{RESAVE_SETTLE:g} s for the new parts of rank(s) {others}"
                ),
                settling=True,
            )
    due = ""
    if again:
        due = (
            f"step {step} was saved again since round {state.last_round} (other bytes "
            f"in the part(s) of rank(s) {again})"
        )
    elif backup_requested:
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


def note_settling(state: ScheduleState, decision: Decision, now: float) -> None:
    """Remember when a re-save first made ``decision`` wait (``settling``), so the
    wait ends :data:`RESAVE_SETTLE` seconds later (:func:`started` forgets it)."""
    if decision.settling and state.again_since is None:
        state.again_since = now


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
    state.again_since = None
    return lines


def took(state: ScheduleState, step: int, rank: int, digest: str) -> None:
    """Rank ``rank`` uploaded its part of ``step`` with manifest digest ``digest``:
    that is the part backed up (:attr:`ScheduleState.last_parts`), whatever the
    round saw when it started. A part sealed again between the round's start and
    its upload (a re-save in place: a data file first, then the commit marker)
    would otherwise read as saved again after the round and be backed up a second
    time. Nothing changes for another step than the last one backed up, or an
    unknown digest."""
    if not digest or state.last_step != step:
        return
    parts = dict(state.last_parts or ())
    parts[rank] = digest
    state.last_parts = parts_key(parts)


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
    state: ScheduleState,
    *,
    backup: str | None,
    step: int | None,
    now: float,
    parts: Mapping[int, str] | None = None,
) -> ScheduleState:
    """The schedule after a restore that restarts the job from ``step`` (every node).

    Round names keep growing (``last_round`` stays) and the period counts from
    the restore. Which step the step interval counts from, and which bytes of
    it count as backed up (:attr:`ScheduleState.last_parts`: the same step
    number saved again with other bytes is backed up again):

    * restored from round ``backup``: ``step`` (that round holds it), with
      ``parts``, the restored parts' digests (rank -> manifest digest);
    * restored from the cluster: the last round's step and parts if that step
      is not newer than ``step`` (it is still part of the job's history), else
      ``step`` with ``parts`` (the last round belongs to the discarded steps
      after it; the bucket's seed, :func:`apply_seed`, corrects both);
    * nothing restored (``step`` None): the job starts over, none.

    Regression (issue #16 trial): the parts were forgotten here, so a step
    restored and then saved again under its number with other bytes was never
    backed up again, and after a cluster-wide loss the bucket's first save of
    it came back with exit 0.
    """
    fresh = ScheduleState(
        started_at=now, last_round=state.last_round, last_round_at=state.last_round_at
    )
    known = parts_key(parts)
    if backup is not None:
        fresh.last_round = max(backup, state.last_round or "")
        fresh.last_round_at = now
        fresh.last_step = step
        fresh.last_parts = known
    elif step is None:
        fresh.last_step = None
    elif state.last_step is not None and state.last_step <= step:
        fresh.last_step = state.last_step
        fresh.last_parts = state.last_parts
    else:
        fresh.last_step = step
        fresh.last_parts = known
    return fresh


def apply_seed(
    state: ScheduleState,
    complete: tuple[str, int] | None,
    *,
    after_restore: bool,
    parts: Mapping[int, str] | None = None,
) -> None:
    """Take the bucket's newest complete (round, step) into a schedule.

    Without a restore since the schedule began (a daemon restarted under a
    running job) that round's step counts as backed up and the period runs
    from its time. After a restore (:func:`restart_timeline`) it only lowers
    the step the interval counts from, when that round's step is part of the
    restored history.

    Args:
        parts: rank -> manifest digest of that round's parts of its step (what
            the bucket holds). When the schedule then counts that step as backed
            up, these are its :attr:`ScheduleState.last_parts`, so a RAM copy of
            the step with other bytes (saved again) is backed up again; None
            (unknown) keeps what the schedule knew.
    """
    if complete is None:
        return
    name, step = complete
    if not after_restore:
        restored(state, name, step, min(round_time(name).timestamp(), state.started_at))
    elif state.last_step is not None and step <= state.last_step:
        state.last_step = step
    known = parts_key(parts)
    if known and state.last_step == step:
        state.last_parts = known
