"""How the coordinator follows a multi-node job's backup rounds: pure policy.

:class:`RoundBook` is the coordinator's bookkeeping of a multi-node job's
rounds (PROTOCOL.md section 6: the sync round "also decides when a backup
round starts"). :class:`tierfs.cluster.coordinator.Coordinator` calls it on every
``Sync``: it closes the active round once every rank reported its
:class:`Outcome` (or after a timeout), runs :func:`tierfs.core.rounds.decide_round`
for the cluster's synced step, and tells each rank the round it still has to
upload (:meth:`RoundBook.order_for`). Lines for ``replicator.errors`` (a
skipped step, an incomplete round) queue in :attr:`RoundBook.events`.

When a round starts (the interval rules, :class:`ScheduleState`,
:func:`decide_round` and its updates) is :mod:`tierfs.core.rounds`, shared with
the durable plane's one-node schedule; its names are re-exported here.

No I/O and no clock reads here: every time is an argument (Unix seconds),
everything is unit-tested (tests/unit/test_gcs_rounds.py, tests/unit/test_coordinator.py).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from tierfs.core import settings
from tierfs.core.rounds import DEFAULT_INTERVAL_MINUTES as DEFAULT_INTERVAL_MINUTES
from tierfs.core.rounds import SKIP as SKIP
from tierfs.core.rounds import START as START
from tierfs.core.rounds import WAIT as WAIT
from tierfs.core.rounds import Decision as Decision
from tierfs.core.rounds import ScheduleState as ScheduleState
from tierfs.core.rounds import apply_seed as apply_seed
from tierfs.core.rounds import decide_round as decide_round
from tierfs.core.rounds import dedup_plan, note_settling, took
from tierfs.core.rounds import finished as finished
from tierfs.core.rounds import intervals as intervals
from tierfs.core.rounds import parts_key as parts_key
from tierfs.core.rounds import restart_timeline as restart_timeline
from tierfs.core.rounds import restored as restored
from tierfs.core.rounds import skipped as skipped
from tierfs.core.rounds import started as started
from tierfs.core.rounds import superseded as superseded
from tierfs.core.status import ActiveBackupStatus, BackupBookStatus
from tierfs.core.types import COMPLETE as COMPLETE
from tierfs.core.types import DONE as DONE
from tierfs.core.types import FAILED as FAILED
from tierfs.core.types import INCOMPLETE as INCOMPLETE
from tierfs.core.types import MISSING as MISSING
from tierfs.core.types import RUNNING as RUNNING
from tierfs.core.types import Outcome as Outcome
from tierfs.core.types import RoundView as RoundView

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


def known_parts(parts: Mapping[int, str | None] | None) -> dict[int, str]:
    """``parts`` (rank -> digest, None unknown) without the unknown digests (pure; the
    mapping itself when every digest is known, as at every tick of a healthy job)."""
    if not parts:
        return {}
    if None in parts.values() or "" in parts.values():
        return {r: d for r, d in parts.items() if d}
    return cast(dict[int, str], parts)


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
        #: node ranks declared gone for good (issue #16): rounds neither wait for
        #: nor plan them
        self.gone: frozenset[int] = frozenset()
        self._ranks: tuple[int, frozenset[int], list[int]] | None = None
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

    def set_gone(self, gone: frozenset[int]) -> None:
        """Ranks declared gone for good: rounds stop waiting for them (issue #16)."""
        self.gone = gone

    def ranks(self) -> list[int]:
        """The ranks a backup round waits for: every rank of the job but the gone ones
        (built once per node count and gone set: a tick asks for it; do not modify)."""
        hit = self._ranks
        if hit is None or hit[0] != self.nodes or hit[1] is not self.gone:
            ranks = [r for r in range(self.nodes) if r not in self.gone]
            hit = self._ranks = (self.nodes, self.gone, ranks)
        return hit[2]

    def reset(self, job: str, nodes: int, now: float) -> None:
        """Take up ``job`` of ``nodes`` nodes from scratch (unseeded, no round, none gone)."""
        self.job, self.nodes = job, nodes
        self.gone = frozenset()
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

    def seed(
        self,
        job: str,
        newest: str | None,
        complete: tuple[str, int] | None,
        parts: Mapping[int, str] | None = None,
    ) -> bool:
        """What the bucket holds: its newest round name and newest complete (round, step),
        and that round's parts of the step (rank -> manifest digest; :func:`apply_seed`).

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
        apply_seed(self.state, complete, after_restore=self.restored_seen, parts=parts)
        self.seeded = True
        return True

    def restored(
        self,
        backup: str | None,
        step: int | None,
        now: float,
        *,
        new_timeline: bool = True,
        parts: Mapping[int, str] | None = None,
    ) -> None:
        """A restore was decided (``step`` from ``backup``, or from the cluster; None: nothing).

        Args:
            parts: rank -> the restored copy's manifest digest (the decision's).
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
        self.state = restart_timeline(self.state, backup=backup, step=step, now=now, parts=parts)

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
        if rank not in a.outcomes and outcome.state == DONE:
            took(self.state, a.step, rank, outcome.digest)
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
        now_parts = holders(step) if holders is not None and step is not None else None
        decision = decide_round(
            self.state,
            now=now,
            step=step,
            backup_requested=backup_requested,
            interval_minutes=minutes,
            interval_steps=steps,
            previous_name=self.previous_name,
            parts=known_parts(now_parts),
        )
        note_settling(self.state, decision, now)
        if decision.action == SKIP:
            self.events.extend(skipped(self.state, decision))
        elif decision.action == START:
            assert decision.round is not None and decision.step is not None
            held = holders(decision.step) if holders is not None else None
            lacking = [r for r in self.ranks() if held is not None and r not in held]
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
                self.state.last_parts = parts_key(held)
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
        """Some rank cannot finish ``a`` because it no longer holds its step (set
        operations: a tick of a running round at 10,000 nodes walks no rank in Python)."""
        if a is None:
            return False
        if holders is not None:
            held = holders(a.step)
            ranks = self.ranks()
            if len(held) < len(ranks):
                for r in sorted(set(ranks) - held.keys() - a.outcomes.keys()):
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
            if held is None or all(r in held for r in self.ranks()):
                self.events.extend(superseded(self.state, step))
                a.moved_from.append(a.step)
                a.step = step
                a.outcomes.clear()
                a.lacking.clear()
                self._plan(a, held, data_parallelism)
                self.state.last_step = max(step, self.state.last_step or 0)
                self.state.last_parts = parts_key(held)
                self.last_view = RoundView(a.round, a.step, RUNNING)
                for h in reversed(self.history):
                    if h["round"] == a.round:
                        h["step"] = step
                        h["moved_from"] = list(a.moved_from)
                        break
                return
        missing = [r for r in self.ranks() if r not in a.outcomes]
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

    def status(self) -> BackupBookStatus:
        """The book's part of the coordinator's status."""
        a = self.active
        return BackupBookStatus(
            seeded=self.seeded,
            active=(
                ActiveBackupStatus(
                    round=a.round,
                    step=a.step,
                    reported=tuple(sorted(a.outcomes)),
                    moved_from=tuple(a.moved_from),
                    lacking=dict(a.lacking),
                    dedup=tuple(sorted(a.dedup)),
                )
                if a
                else None
            ),
            last_round=self.state.last_round,
            last_step=self.state.last_step,
            last_decision=self.last_reason,
            rounds=tuple(dict(h) for h in self.history),
        )
