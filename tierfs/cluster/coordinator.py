"""The coordinator of one job's nodes, run by node-rank 0 (PROTOCOL.md sections 4 and 6).

Every node joins with its inventory (which ranks' shards of which steps it
holds, verified or not, with their manifest digests). The coordinator

* waits until every rank has joined the restore round and, when node-rank 0
  has a bucket, until the bucket has answered (or its deadline passed: the
  decision then says so): no decision is made on part of the picture;
* picks the restore step with :func:`tierfs.cluster.restore_choice.choose_restore`:
  the newest step with a good copy of every rank's shard in some node's RAM
  or in a backup round, or ``restore.version``'s round (PROTOCOL.md
  sections 4 and 5); a "nothing" says whether it is a fresh start or why no
  step is complete;
* tells each node its plan: its own copy is local, or the holders to pull
  it from (nearest on the ring first), then the backup rounds holding the
  same bytes;
* runs the restore barrier in two phases: ``ready`` (every node has its
  data; a node that could not get any copy reports the copies it found bad
  and the step is chosen again without them for *every* node: *replan*)
  and ``done`` (prerestore written; markers are published after it). Every
  replan excludes at least one more copy, so the loop ends: at worst with
  "nothing" and the reasons;
* after each sealed step, runs a sync round: every node reports the newest
  own step it has replicated to all its peers; when every rank has reported
  a step, that step is the cluster's synced step; the reply also says which
  restore round is open (nodes pause retention meanwhile) and, in generic
  mode, asks a live node that has not joined it to join (*summons*);
* with a :class:`tierfs.cluster.backup_schedule.RoundBook` (node-rank 0's GCS
  tier installs it), decides backup rounds in the sync round: each ``Sync``
  carries the node's outcome of the last round it was ordered into, and its
  reply the round the node still has to upload (PROTOCOL.md section 6: the
  sync round "also decides when a backup round starts").

Rounds. The restore rounds (joins, decisions, replans, the barrier, who is
summoned) are :class:`tierfs.cluster.restore_rounds.RestoreRounds`, which the
coordinator owns: the coordinator checks the job and the membership (the
rank, its address and incarnation) and runs the sync round and the backup
book; the rounds decide the restore.

Scale. Every call costs O(1) or O(the calling node's inventory and peers),
never a walk over every rank (a job may have 10,000 nodes): the joined,
ready and done ranks are :class:`tierfs.cluster.rounds.RankSet` counts, the
synced step comes from a count of ranks per reported step, the backup
requests from a count per step, and replies list at most
:data:`tierfs.cluster.rounds.SHOWN_RANKS` ranks plus the exact count. The
backup book (whose tick does walk the ranks) is ticked on every call for
up to :data:`BOOK_TICKS_PER_ROUND` nodes, else that many times per
heartbeat round (above :data:`BOOK_TICK_NODES` nodes at most once per
:data:`BOOK_TICK_SECONDS`), and at once when the synced step moves. A round is
decided as soon as its last rank joined (or the bucket answered), not at
the next ``Decide``.

The bucket is read outside the coordinator's lock, from the round's first join
on (its answer does not depend on who joined; an answer older than
:data:`tierfs.cluster.restore_rounds.BUCKET_EARLY_FRESH` when the last rank
joins is read again): :meth:`Coordinator.bucket_wanted` says which read a
round waits for, the servicer runs the reader the GCS tier installed
(:meth:`tierfs.cluster.servicer.CoordinatorServicer.set_bucket_reader`) in a
thread of its own and hands the answer in with :meth:`Coordinator.bucket_answered`.

:class:`Coordinator` is pure policy over plain data (:mod:`tierfs.cluster.rounds`),
unit-tested without gRPC (tests/unit/test_coordinator.py). It is not
thread-safe: :class:`tierfs.cluster.servicer.CoordinatorServicer` serves it
over gRPC, serializing every call with one lock, and wakes long-polling
``Decide``/``Barrier`` calls only when :meth:`Coordinator.progress` changes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from tierfs.cluster.backup_schedule import Outcome, RoundBook
from tierfs.cluster.copies import copy_counts
from tierfs.cluster.membership import Membership
from tierfs.cluster.restore_choice import (
    FRESH,
    INCOMPLETE,
    RESTORED,
    BucketPart,
    BucketView,
    Choice,
    CopyId,
    Holder,
    Holding,
    choose_restore,
    sources_for,
)
from tierfs.cluster.restore_rounds import MAX_DECISIONS, ROUND_IDLE, RestoreRounds
from tierfs.cluster.rounds import (
    BUCKET_DEPTH,
    DECIDED,
    GENERIC,
    PASSED,
    PROTOCOL,
    REJOIN,
    REPLAN,
    SHOWN_RANKS,
    WAITING,
    BarrierView,
    DecideView,
    Member,
    Participant,
    PeerView,
    Rejected,
    Round,
    SyncView,
)
from tierfs.core.ranks import rank_ranges
from tierfs.core.status import (
    CoordinatorMemberStatus,
    CoordinatorRoundStatus,
    CoordinatorStatus,
    CoordinatorSyncStatus,
)
from tierfs.core.types import COORDINATOR_RANK as COORDINATOR_RANK
from tierfs.core.types import NO_STEP as NO_STEP

log = logging.getLogger(__name__)

#: the backup book is ticked at least once per this many Sync calls per node
#: (with 64 nodes or fewer on every call); a new synced step ticks it at once
BOOK_TICKS_PER_ROUND = 64
#: above this many nodes the book is ticked at most once per :data:`BOOK_TICK_SECONDS`
#: (each tick walks every member: 64 ticks per heartbeat round tripled the round's
#: coordinator CPU at 10,000 nodes, issue #17 review B0); a new synced step still
#: ticks it at once
BOOK_TICK_NODES = 256
BOOK_TICK_SECONDS = 0.5

__all__ = [
    "BUCKET_DEPTH",
    "COORDINATOR_RANK",
    "DECIDED",
    "FRESH",
    "GENERIC",
    "INCOMPLETE",
    "MAX_DECISIONS",
    "NO_STEP",
    "PASSED",
    "PROTOCOL",
    "REJOIN",
    "REPLAN",
    "RESTORED",
    "ROUND_IDLE",
    "SHOWN_RANKS",
    "WAITING",
    "BarrierView",
    "BucketPart",
    "BucketView",
    "Choice",
    "Coordinator",
    "CopyId",
    "DecideView",
    "Holder",
    "Holding",
    "PeerView",
    "Rejected",
    "SyncView",
    "choose_restore",
    "gone_problem",
    "sources_for",
]


#: seconds between two ``--gone-after`` checks (each walks the members)
GONE_CHECK_PERIOD = 1.0
#: seconds after a generation began before a part sealed by another node count proves
#: that the job ran under another coordinator since (:meth:`Coordinator._ran_elsewhere`;
#: slack for the nodes' clocks)
ELSEWHERE_SLACK = 30.0
#: a round of a job of at most this many nodes nudges the members it summons
#: (:meth:`Coordinator.nudges`); a larger job's members learn of it in their
#: next heartbeat (one call per member would cost the coordinator O(N) calls)
NUDGE_MAX_NODES = 100

#: seconds a join refused for another node count is named to the waiting nodes
REFUSED_SHOWN = 60.0


def gone_problem(
    wanted: frozenset[int], gone: frozenset[int], nodes: int, own_rank: int = COORDINATOR_RANK
) -> str:
    """Why node ranks ``wanted`` cannot be declared gone in a job of ``nodes`` nodes of
    which ``gone`` already are ("" if they can): none named, node-rank ``own_rank``
    (it serves the coordinator), a rank outside ``[0, nodes)``, or no node left."""
    if not wanted:
        return "no node rank named"
    outside = sorted(r for r in wanted if not 0 <= r < nodes)
    if outside:
        return f"node-rank(s) {outside} out of range for {nodes} nodes (must be in [0, {nodes}))"
    if own_rank in wanted:
        return (
            f"node-rank {own_rank} cannot be declared gone: it serves the coordinator "
            "(restart the job on the remaining nodes instead)"
        )
    if len(wanted | gone) >= nodes:
        return f"declaring node-rank(s) {sorted(wanted)} gone would leave no node of {nodes}"
    return ""


class Coordinator:
    """The coordinator's state for the job it serves (pure; see the module docstring).

    Args:
        clock: monotonic seconds (injectable for tests).
        wall: Unix seconds, for the status.
        live_seconds: a member heard from within this many seconds is live.
        own_rank: the rank of the node running the coordinator (0); its join
            with another job name switches the coordinator to that job.
        bucket: node-rank 0 has a bucket: every decision waits for the bucket's
            answer (:meth:`bucket_wanted`, :meth:`bucket_answered`).
        backups: the backup rounds' book (see :meth:`set_backups`).
        generation: (job, nodes, generation, since) the previous coordinator of this
            node recorded (issue #16): a restart with the same job and node count
            continues that generation, another node count starts the next one.
        on_generation: told (job, nodes, generation, since) when a generation starts
            (the daemon keeps it in a file for the next start).
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        live_seconds: float = 5.0,
        own_rank: int = COORDINATOR_RANK,
        bucket: bool = False,
        backups: RoundBook | None = None,
        generation: tuple[str, int, int, float] | None = None,
        on_generation: Callable[[str, int, int, float], None] | None = None,
        gone: Iterable[int] = (),
        on_gone: Callable[[tuple[int, ...]], None] | None = None,
        gone_after: float | None = None,
    ) -> None:
        self._last_generation = generation
        self._on_generation = on_generation
        #: the gone ranks recorded with ``generation``: kept if it is continued
        self._last_gone = frozenset(gone)
        self._on_gone = on_gone
        #: seconds without a heartbeat after which a member is declared gone (None: off)
        self.gone_after = gone_after
        #: node ranks declared gone for good in this generation (issue #16)
        self.gone: frozenset[int] = frozenset()
        self._gone_checked = float("-inf")
        #: lines for replicator.errors of the coordinator's node (taken by the owner)
        self.events: list[str] = []
        self.clock = clock
        self.wall = wall
        self.live_seconds = live_seconds
        self.own_rank = own_rank
        self.backups: RoundBook | None = None
        self.job: str | None = None
        self.nodes = 0
        #: membership generations of the job served (issue #16): 1 for the first node
        #: count, one more each time the job is restarted with another node count (a
        #: member of an older generation is refused); the wall time it began
        self.generation = 0
        self.generation_since = 0.0
        #: rank -> (node count, clock) of its last join refused for another node count
        self.refused_counts: dict[int, tuple[int, float]] = {}
        self.roster = Membership(clock, live_seconds)
        self.restores = RestoreRounds(
            clock=clock, wall=wall, bucket=bucket, on_decision=self._clear_sync
        )
        self.synced_step = NO_STEP
        self.synced_at = 0.0
        self._book_calls = 0
        self._book_synced = NO_STEP
        #: clock time of the last tick of the backup book (:data:`BOOK_TICK_SECONDS`)
        self._book_ticked = float("-inf")
        #: (round, rank) of the summoned members nudged already (:meth:`nudges`)
        self._nudged: set[tuple[int, int]] = set()
        if backups is not None:
            self.set_backups(backups)

    @property
    def members(self) -> dict[int, Member]:
        """Rank -> member (:attr:`roster`'s)."""
        return self.roster.members

    @property
    def sync_steps(self) -> dict[int, int]:
        """Rank -> its newest replicated step since the last restore decision."""
        return self.roster.sync_steps

    @property
    def bucket(self) -> bool:
        """Node-rank 0 has a bucket: decisions wait for its answer (set at construction)."""
        return self.restores.bucket

    @property
    def round(self) -> Round | None:
        """The open (or last) restore round (:attr:`RestoreRounds.round`)."""
        return self.restores.round

    @property
    def history(self) -> list[dict[str, Any]]:
        """The last decisions (:attr:`RestoreRounds.history`)."""
        return self.restores.history

    def set_backups(self, book: RoundBook | None) -> None:
        """Let the sync round drive ``book`` (reset to the current job, if any)."""
        self.backups = book
        if book is not None and self.job is not None:
            book.reset(self.job, self.nodes, self.wall())
            book.set_gone(self.gone)

    # ------------------------------------------------------------------ membership

    def _reset(self, job: str, nodes: int) -> None:
        if self.job is not None:
            log.info(
                "coordinator: switching from job %s (%d nodes) to %s (%d nodes)",
                self.job,
                self.nodes,
                job,
                nodes,
            )
        last = self._last_generation
        keep_gone: frozenset[int] = frozenset()
        if last is not None and last[0] == job and last[1] == nodes and last[2] > 0:
            self.generation, self.generation_since = last[2], last[3]
            keep_gone = frozenset(g for g in self._last_gone if 0 < g < nodes)
        else:
            same_job = last is not None and last[0] == job
            self.generation = last[2] + 1 if same_job and last is not None else 1
            self.generation_since = self.wall()
        self._last_generation = (job, nodes, self.generation, self.generation_since)
        if self._on_generation is not None:
            self._on_generation(*self._last_generation)
        self.job, self.nodes = job, nodes
        self.refused_counts.clear()
        self.roster.clear()
        self.restores.clear()
        self._clear_sync()
        self.synced_at = 0.0
        if self.backups is not None:
            self.backups.reset(job, nodes, self.wall())
        self.gone = frozenset()
        self._last_gone = keep_gone
        self._apply_gone(keep_gone)

    # ------------------------------------------------------------------ gone for good

    def _apply_gone(self, gone: frozenset[int]) -> None:
        """Make ``gone`` the generation's gone ranks everywhere and record it."""
        self.gone = gone
        self.restores.set_gone(gone)
        for g in gone:
            self.roster.forget_step(g)
        if self.backups is not None:
            self.backups.set_gone(gone)
        self._update_synced()
        if self._on_gone is not None:
            self._on_gone(tuple(sorted(gone)))

    def _ran_elsewhere(self, inventory: Iterable[Holding]) -> Holding | None:
        """A part of the job in a joining node's inventory that another node count
        sealed after this generation began (plus :data:`ELSEWHERE_SLACK`): the job ran
        at that count under another coordinator since (a renumbered node-rank 0), so
        this generation and its gone ranks are history. None when there is none."""
        if not self.generation_since:
            return None
        after = self.generation_since + ELSEWHERE_SLACK
        for h in inventory:
            if h.nodes and h.nodes != self.nodes and h.created > after:
                return h
        return None

    def _next_generation(self, rank: int, seen: Holding) -> None:
        """Start the next generation of the job at the same node count: the gone ranks
        of the old one no longer apply (issue #16 fourth trial F8: node-rank 0 took up
        its stored generation 1 with ``gone [3]`` after the job had run at 3 nodes under
        another coordinator, and refused a new empty node 3 for good)."""
        assert self.job is not None
        old, gone = self.generation, sorted(self.gone)
        self.generation = max(self.generation, 0) + 1
        self.generation_since = self.wall()
        self._last_generation = (self.job, self.nodes, self.generation, self.generation_since)
        if self._on_generation is not None:
            self._on_generation(*self._last_generation)
        line = (
            f"generation {self.generation} of job {self.job!r} ({self.nodes} nodes) begins: "
            f"node-rank {rank} holds step {seen.step} of rank {seen.rank}, sealed by a job "
            f"of {seen.nodes} nodes after generation {old} began, so the job ran under "
            "another coordinator since"
            + (f"; node-rank(s) {gone} are no longer declared gone" if gone else "")
        )
        log.warning("coordinator: %s", line)
        self.events.append(line)
        self._last_gone = frozenset()
        if gone:
            self._apply_gone(frozenset())

    def declare_gone(self, job: str, ranks: Iterable[int], reason: str = "") -> tuple[int, ...]:
        """Declare node ranks gone for good for the current generation (issue #16).

        Restore rounds, sync rounds and backup rounds stop waiting for them, the
        nodes' replication picks stand-ins (the gone set goes out in every Join and
        Sync reply), and a gone rank that joins again is refused until the job is
        restarted with another node count (a new generation clears the set).
        Declaring a rank already gone again is accepted (idempotent).

        Returns:
            Every gone rank of the generation, ascending.

        Raises:
            Rejected: no job yet or another job, node-rank 0 (it serves the
                coordinator), a rank outside ``[0, nodes)``, or every node gone.
        """
        wanted = frozenset(ranks)
        if self.job is None:
            raise Rejected("no job yet: no node has joined the coordinator")
        if job != self.job:
            raise Rejected(f"job-name mismatch: the coordinator runs job {self.job!r}, not {job!r}")
        problem = gone_problem(wanted, self.gone, self.nodes, self.own_rank)
        if problem:
            raise Rejected(problem)
        new = wanted - self.gone
        if new:
            why = f" ({reason})" if reason else ""
            line = (
                f"node-rank(s) {rank_ranges(new)} declared gone for good in generation "
                f"{self.generation}{why}: rounds no longer wait for them"
            )
            log.warning("coordinator: %s", line)
            self.events.append(line)
            self._apply_gone(self.gone | new)
        return tuple(sorted(self.gone))

    def expire_gone(self) -> tuple[int, ...]:
        """With ``gone_after``: declare gone every member not heard from for that long
        (never node-rank 0). Checked at most every :data:`GONE_CHECK_PERIOD` seconds
        (O(members)). Returns the ranks it declared."""
        if self.gone_after is None or self.job is None:
            return ()
        now = self.clock()
        if now - self._gone_checked < GONE_CHECK_PERIOD:
            return ()  # a walk over the members: at most once per period, not per call
        self._gone_checked = now
        silent = frozenset(
            m.rank
            for m in self.members.values()
            if m.rank != self.own_rank
            and m.rank not in self.gone
            and now - m.last_seen > self.gone_after
        )
        if not silent or gone_problem(silent, self.gone, self.nodes, self.own_rank):
            return ()
        self.declare_gone(
            self.job, silent, f"no heartbeat for more than {self.gone_after:g} s (--gone-after)"
        )
        return tuple(sorted(silent))

    def take_events(self) -> list[str]:
        """The coordinator's lines for ``replicator.errors`` since the last call."""
        out, self.events = self.events, []
        return out

    def _update_synced(self) -> None:
        synced = self.roster.least_step(self.nodes - len(self.gone))
        if synced is not None and synced > self.synced_step:
            self.synced_step = synced
            self.synced_at = self.wall()
            log.info(
                "coordinator: sync round complete: each of the %d live nodes sealed a "
                "part of step %d (whether the step loads is judged per node)",
                self.nodes - len(self.gone),
                synced,
            )

    def _clear_sync(self, r: Round | None = None) -> None:
        """The sync round starts over: another job, or a decision of round ``r``
        (:class:`RestoreRounds`' ``on_decision``), after which the backup book learns
        which step the job restored."""
        self.roster.clear_steps()
        self.synced_step = NO_STEP
        if r is not None and r.choice is not None and self.backups is not None:
            self.backups.restored(
                r.choice.backup,
                r.choice.step,
                self.wall(),
                new_timeline=r.strict,
                parts=r.choice.digests,
            )

    def live_count(self) -> int:
        """Members heard from recently (:meth:`Membership.live_count`)."""
        return self.roster.live_count()

    def live(self, rank: int) -> bool:
        """True if ``rank`` was heard from within ``live_seconds``."""
        return self.roster.live(rank)

    def _check_job(self, job: str, nodes: int, rank: int, mode: str = "generic") -> None:
        if nodes < 1:
            raise Rejected(f"node-rank {rank} joined with nodes {nodes}; nodes must be >= 1")
        if not 0 <= rank < nodes:
            raise Rejected(f"node-rank {rank} is out of range for {nodes} nodes (must be < nodes)")
        if self.job is None or (job, nodes) == (self.job, self.nodes):
            if self.job is None:
                self._reset(job, nodes)
            return
        others_live = any(self.live(r) for r in self.members if r != rank)
        busy = self.round is not None and not self.round.finished
        if rank == self.own_rank or not (others_live or busy):
            self._reset(job, nodes)
            return
        if job != self.job:
            raise Rejected(
                f"job-name mismatch: the coordinator (node-rank {self.own_rank}) runs "
                f"job {self.job!r} with {self.nodes} nodes; node-rank {rank} joined "
                f"as job {job!r}"
            )
        self.refused_counts[rank] = (nodes, self.clock())
        if mode == PROTOCOL:
            # the client's replicator.yaml carries the count (no --nodes in protocol mode)
            what = (
                f"node-rank {self.own_rank}'s client must restart with nodes: {nodes} in "
                f"its replicator.yaml, as this node's did"
            )
        elif rank < self.nodes:
            what = (
                f"restart node-rank {self.own_rank} with --nodes {nodes}, or remount "
                f"this node with --nodes {self.nodes}"
            )
        else:
            # its rank does not exist in the coordinator's job: only a resize helps
            # (regression, new-user trial: node-rank 3 was told to use --nodes 3)
            what = f"restart node-rank {self.own_rank} with --nodes {nodes}"
        raise Rejected(
            f"node count mismatch: job {job!r} has {self.nodes} nodes at the "
            f"coordinator; node-rank {rank} joined with nodes {nodes} (to resize the "
            f"job, {what})"
        )

    def join(
        self,
        job: str,
        nodes: int,
        rank: int,
        address: str,
        incarnation: str,
        inventory: Iterable[Holding],
        restore_id: str = "",
        mode: str = PROTOCOL,
        *,
        backup_interval_minutes: float | None = None,
        backup_interval_steps: int | None = None,
        notes: Iterable[str] = (),
    ) -> int:
        """Register (or refresh) a node; with ``restore_id``, enter the restore round.

        The backup intervals are the node's job settings; node-rank 0's are
        the ones the backup rounds follow (0 or None: not set). ``notes``:
        one line per copy the node discarded while checking it (reported
        with a decision that is not the newest step).

        Returns:
            The round number the node is in (0 for a plain registration).

        Raises:
            Rejected: rank outside [0, nodes), a job name / node count other
                than the coordinator's while that job is active, or a rank a
                live node at another address still serves (a duplicate rank).
        """
        self._check_job(job, nodes, rank, mode)
        inventory = tuple(inventory)
        elsewhere = self._ran_elsewhere(inventory)
        if elsewhere is not None:
            self._next_generation(rank, elsewhere)
        if rank in self.gone:
            raise Rejected(
                f"node-rank {rank} was declared gone for good in generation "
                f"{self.generation} of job {job!r}: it may not rejoin it (restart the "
                "job with another --nodes to start a new generation)"
            )
        self.refused_counts.pop(rank, None)
        now = self.clock()
        inv = tuple(inventory)
        m, restarted = self.roster.admit(rank, address, incarnation)
        if restarted and self.backups is not None:
            self.backups.member_restarted(rank)
        self.roster.set_inventory(m, inv)
        self.roster.set_address(m, address)
        self.roster.heard(m, now)
        m.mode = mode
        m.backup_interval_minutes = backup_interval_minutes or None
        m.backup_interval_steps = backup_interval_steps or None
        if not restore_id:
            return 0
        joining = Participant(rank, restore_id, inv, now, tuple(notes), incarnation)
        return self.restores.enter(joining, mode, self.nodes)

    # ------------------------------------------------------------------ restore

    def _participant(self, job: str, rank: int, restore_id: str) -> Round | None:
        """The open round if node ``rank`` of ``job`` takes part in it with ``restore_id``
        (it was heard from), else None."""
        if job != self.job:
            return None
        r = self.restores.participant(rank, restore_id)
        m = self.members.get(rank)
        if r is not None and m is not None:
            self.roster.heard(m, self.clock())
        return r

    def bucket_wanted(self) -> tuple[int, str, int, int] | None:
        """``(round, job, nodes, depth)``: the bucket read the open round waits for
        (None: none), to be run outside the lock; ``depth`` is how many complete
        backup rounds it must look for."""
        want = self.restores.bucket_wanted()
        if want is None or self.job is None:
            return None
        return want[0], self.job, self.nodes, want[1]

    def bucket_answered(self, round_no: int, view: BucketView) -> None:
        """The bucket's answer for round ``round_no`` (a stale one is ignored)."""
        self.restores.bucket_answered(round_no, view)

    def decide(self, job: str, rank: int, restore_id: str) -> DecideView:
        """The decision for node ``rank`` once every rank is accounted for.

        Returns:
            ``waiting`` (with the missing ranks, or what else it waits for),
            ``decided`` (step and this node's sources), or ``rejoin``
            (unknown restore: join again).
        """
        r = self._participant(job, rank, restore_id)
        if r is None:
            return DecideView(REJOIN)
        view = self.restores.decide(r, rank, self.members)
        if view.state == WAITING and view.missing and not view.waiting_for:
            # say why a missing rank does not join when it tried with another node count
            now = self.clock()
            other = sorted(
                (m, n)
                for m, (n, at) in self.refused_counts.items()
                if m in view.missing and now - at < REFUSED_SHOWN
            )
            if other:
                said = ", ".join(f"node-rank {m} with --nodes {n}" for m, n in other)
                view = dataclasses.replace(
                    view,
                    waiting_for=f"joined with another node count ({said}; this generation "
                    f"has {self.nodes} nodes)",
                )
        return view

    def barrier(
        self,
        job: str,
        rank: int,
        restore_id: str,
        round_no: int,
        version: int,
        phase: str,
        ok: bool = True,
        bad: Iterable[CopyId] = (),
        detail: str = "",
    ) -> BarrierView:
        """Phase ``ready`` (data in place, or the bad copies) or ``done`` (markers next).

        A failure (``ok`` False) excludes the copies named in ``bad`` -- or, if
        it names none that are new, every copy of this node's plan -- and
        decides again for every participant, so each replan rules out at
        least one copy and the round ends (``detail``: the node's reason).

        Returns:
            ``passed`` once every participant reached the phase; ``waiting``
            with the ranks still missing; ``replan`` when the decision changed
            (call :meth:`decide` again); ``rejoin`` for an unknown restore.

        Raises:
            ValueError: an unknown phase.
        """
        if job == self.job:
            old = self.restores.superseded(rank, restore_id, round_no, phase)
            if old is not None:
                return old
        r = self._participant(job, rank, restore_id)
        if r is None or r.number != round_no:
            return BarrierView(REJOIN)
        return self.restores.barrier(r, rank, version, phase, ok, bad, detail)

    def progress(self) -> tuple[int, int, bool, bool, bool] | None:
        """What waiting ``Decide``/``Barrier`` calls wait for (None: no round):
        a waiting call is re-evaluated only when this changes."""
        return self.restores.progress()

    def restore_open(self) -> int:
        """The restore round in progress (0: none, or idle for :data:`ROUND_IDLE` s)."""
        return self.restores.open_round()

    def nudges(self) -> list[tuple[int, str]]:
        """(node rank, address) of the live members a summons into the open restore
        round waits for and that were not nudged for it yet; each is returned once
        per round. The servicer asks each to heartbeat now (``SyncRelay.Nudge``),
        so a summons reaches it in one call's time, not at its next heartbeat
        (up to :data:`tierfs.replication.heartbeat.HEARTBEAT` s later). Empty for a
        job of more than :data:`NUDGE_MAX_NODES` nodes.
        """
        number = self.restores.open_round()
        if not number or self.nodes > NUDGE_MAX_NODES:
            return []
        out = []
        for rank, m in sorted(self.members.items()):
            if (
                (number, rank) in self._nudged
                or rank in self.gone
                or not m.address
                or not self.live(rank)
                or not self.restores.summons(rank, m.incarnation)
            ):
                continue
            self._nudged.add((number, rank))
            out.append((rank, m.address))
        if len(self._nudged) > 4 * NUDGE_MAX_NODES:
            self._nudged = {k for k in self._nudged if k[0] == number}
        return out

    # ------------------------------------------------------------------ sync

    def sync(
        self,
        job: str,
        rank: int,
        incarnation: str,
        step: int,
        inventory: Iterable[Holding],
        backup: Outcome | None = None,
        data_parallelism: int | None = None,
        *,
        compact: bool = False,
    ) -> SyncView:
        """Heartbeat plus sync report: ``step`` = newest own step replicated to all peers.

        O(the node's inventory): no walk over the ranks (see the module docstring);
        ``compact`` leaves out :attr:`SyncView.steps`, the one O(nodes) field.

        With a backup book (:meth:`set_backups`) this is also where backup
        rounds are decided: ``backup`` is the node's outcome of the last
        round it was ordered into (repeated until a newer one; stale ones are
        ignored), then the book closes a finished round and decides about
        the synced step (:meth:`tierfs.cluster.backup_schedule.RoundBook.tick`).

        Returns:
            ``known=False`` when the node must join first (coordinator
            restarted, or another job); else the synced step and, with a
            book, the round this node still has to upload and the newest
            round's state.
        """
        m = self.members.get(rank)
        if job != self.job or m is None or m.incarnation != incarnation or rank in self.gone:
            return SyncView(False)  # join (again); a gone rank's join is refused
        self.roster.heard(m, self.clock())
        self.roster.set_inventory(m, tuple(inventory))
        m.replicated_step = step
        m.data_parallelism = data_parallelism or None
        self.roster.report_step(rank, step)
        self.expire_gone()
        self._update_synced()
        steps = () if compact else tuple(self.sync_steps.get(r, NO_STEP) for r in range(self.nodes))
        number = self.restore_open()
        summoned = bool(number and self.restores.summons(rank, incarnation, number))
        book = self.backups
        if book is None:
            return SyncView(
                True,
                self.synced_step,
                self.synced_at,
                steps,
                restore_round=number,
                summoned=summoned,
                reported=len(self.sync_steps),
            )
        if backup is not None:
            book.report(rank, backup)
        self._book_calls += 1
        due = self._book_calls >= max(1, self.nodes // BOOK_TICKS_PER_ROUND)
        if due and self.nodes > BOOK_TICK_NODES:
            due = self.clock() - self._book_ticked >= BOOK_TICK_SECONDS
            if not due:
                self._book_calls = 0  # the clock is read once per nodes/64 calls, not per call
        if due or self.synced_step != self._book_synced:
            self._book_calls = 0
            self._book_synced = self.synced_step
            self._book_ticked = self.clock()
            self._backup_tick(book)
        order = book.order_for(rank)
        return SyncView(
            True,
            self.synced_step,
            self.synced_at,
            steps,
            order,
            book.last(),
            order is not None and book.dedup_for(rank),
            restore_round=number,
            summoned=summoned,
            reported=len(self.sync_steps),
        )

    def holders(self, step: int) -> dict[int, str | None]:
        """Rank -> the digest of its own shard of ``step`` (:meth:`Membership.holders`)."""
        return self.roster.holders(step)

    def _backup_tick(self, book: RoundBook) -> None:
        step = self.synced_step if self.synced_step >= 0 else None
        requested = step is not None and self.roster.requested[step] > 0
        own = self.members.get(self.own_rank)
        r = self.round
        book.tick(
            self.wall(),
            step=step,
            backup_requested=requested,
            interval_minutes=own.backup_interval_minutes if own else None,
            interval_steps=own.backup_interval_steps if own else None,
            may_start=r is None or r.finished or not r.strict,
            holders=self.holders,
            data_parallelism=own.data_parallelism if own else None,
        )

    def peers(self, ranks: Iterable[int] | None = None) -> list[PeerView]:
        """The members ``ranks`` (None: all), with address and liveness."""
        return self.roster.peers(ranks)

    def status(self) -> CoordinatorStatus:
        """The coordinator's status (``tierfs status`` of the coordinator's node)."""
        now = self.clock()
        r = self.round
        rnd = None
        if r is not None:
            rnd = CoordinatorRoundStatus(
                number=r.number,
                state=r.state,
                strict=r.strict,
                joined=tuple(sorted(r.joined)),
                missing=tuple(r.missing),
                version=r.version,
                waiting_for=r.waiting_for or None,
                step=r.choice.step if r.choice else None,
                reason=r.choice.reason if r.choice else None,
                outcome=r.choice.outcome if r.choice else None,
                problems=tuple(r.choice.problems) if r.choice else (),
                ready=tuple(sorted(r.ready)),
                done=tuple(sorted(r.done)),
                bad=tuple(sorted(r.bad, key=str)),
                bucket=(
                    None
                    if r.bucket is None
                    else r.bucket.error or f"{len(r.bucket.rounds)} round(s) read"
                ),
                age_seconds=round(now - r.opened_at, 1),
            )
        return CoordinatorStatus(
            job=self.job,
            nodes=self.nodes,
            generation=self.generation,
            generation_since=self.generation_since,
            gone=tuple(sorted(self.gone)),
            round=rnd,
            members=tuple(
                CoordinatorMemberStatus(
                    rank=m.rank,
                    address=m.address,
                    live=self.live(m.rank),
                    seen_seconds_ago=round(now - m.last_seen, 1),
                    replicated_step=m.replicated_step,
                    shards=len(m.inventory),
                )
                for m in sorted(self.members.values(), key=lambda m: m.rank)
            ),
            sync=CoordinatorSyncStatus(
                step=self.synced_step if self.synced_step >= 0 else None,
                at=self.synced_at or None,
                steps=dict(self.sync_steps),
            ),
            decisions=tuple(dict(d) for d in self.history[-5:]),
            backups=self.backups.status() if self.backups is not None else None,
            copies_step=self.synced_step if self.synced_step >= 0 else None,
            copies=(
                copy_counts(
                    {m.rank: m.inventory for m in self.members.values()},
                    self.synced_step,
                    self.live,
                    frozenset(self.gone),
                )
                if self.synced_step >= 0
                else {}
            ),
        )
