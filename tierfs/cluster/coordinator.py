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

Rounds. A restore round collects one join per rank. In ``protocol`` mode
(``replicator.yaml``) every rank joins when its job restarts, as MTC's nodes
do. In ``generic`` mode a restarted daemon starts a round and the nodes that
kept running join it when summoned: every node must be able to present the
agreed step, so every node takes part in the decision and the barrier. A
newer join of a rank replaces its older one while the round is open; a join
with a new restore id after the decision opens the next round, and the
participants of the old one are told to join again (``REJOIN``).

The bucket is read outside the coordinator's lock: :meth:`Coordinator.bucket_wanted`
says which read a round waits for, the servicer runs the reader the GCS tier
installed (:meth:`CoordinatorServicer.set_bucket_reader`) in a thread of its
own and hands the answer in with :meth:`Coordinator.bucket_answered`.

This module is pure policy plus one thin gRPC servicer
(:class:`CoordinatorServicer`); :class:`Coordinator` is plain data and is
unit-tested without gRPC (tests/unit/test_coordinator.py). It is not
thread-safe: the servicer serializes every call with one condition
variable, which also wakes long-polling ``Decide``/``Barrier`` calls.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tierfs.cluster.backup_schedule import Outcome, RoundBook, RoundView
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
    needs_deeper_read,
    sources_for,
)
from tierfs.core.errors import ClusterError

log = logging.getLogger(__name__)

#: node-rank that runs the coordinator
COORDINATOR_RANK = 0
#: ``step`` on the wire for "nothing to restore" / "no step yet"
NO_STEP = -1

WAITING, DECIDED, REJOIN, PASSED, REPLAN = "waiting", "decided", "rejoin", "passed", "replan"
PROTOCOL, GENERIC = "protocol", "generic"


#: decisions of one round after which it gives up ("nothing", with the reasons)
MAX_DECISIONS = 64
#: a restore round not heard from for this many seconds no longer pauses retention
ROUND_IDLE = 60.0
#: complete backup rounds a first bucket read looks for (a replan may read deeper)
BUCKET_DEPTH = 1

__all__ = [
    "FRESH",
    "INCOMPLETE",
    "RESTORED",
    "BucketPart",
    "BucketView",
    "Choice",
    "Coordinator",
    "CoordinatorServicer",
    "CopyId",
    "Holder",
    "Holding",
    "Rejected",
    "choose_restore",
    "sources_for",
]


class Rejected(ClusterError):
    """A join the coordinator refuses; the message is one line for ``replicator.errors``."""


# ---------------------------------------------------------------------- state


@dataclass
class Member:
    """A node the coordinator knows (from a join or a heartbeat)."""

    rank: int
    address: str
    incarnation: str
    inventory: tuple[Holding, ...] = ()
    last_seen: float = 0.0
    replicated_step: int = NO_STEP
    mode: str = PROTOCOL
    backup_interval_minutes: float | None = None
    backup_interval_steps: int | None = None
    #: the job's assume-data-parallelism as the node's Sync reports it (None: off)
    data_parallelism: int | None = None


@dataclass
class Participant:
    """A node taking part in a restore round.

    Attributes:
        notes: what the node found while checking its copies (discarded ones).
    """

    rank: int
    restore_id: str
    inventory: tuple[Holding, ...]
    joined_at: float
    notes: tuple[str, ...] = ()


@dataclass
class Round:
    """One restore round (see the module docstring).

    Attributes:
        bucket: the bucket's answer for this round (None: not read yet).
        bucket_depth: the complete rounds the decision needs the read to look for.
        bad: copies found bad or unusable during this round.
        notes: lines from the nodes (discarded copies, failed fetches).
        waiting_for: what the decision waits for ("" or e.g. "the bucket").
        touched: clock time of the last call of a participant.
    """

    number: int
    strict: bool
    opened_at: float
    joined: dict[int, Participant] = field(default_factory=dict)
    choice: Choice | None = None
    version: int = 0
    inventories: dict[int, tuple[Holding, ...]] = field(default_factory=dict)
    bad: set[CopyId] = field(default_factory=set)
    ready: set[int] = field(default_factory=set)
    done: set[int] = field(default_factory=set)
    decided_at: float | None = None
    missing: tuple[int, ...] = ()
    bucket: BucketView | None = None
    bucket_depth: int = BUCKET_DEPTH
    notes: list[str] = field(default_factory=list)
    waiting_for: str = ""
    touched: float = 0.0
    #: "ready" reports of nodes that could not get their data
    failures: int = 0

    @property
    def ready_passed(self) -> bool:
        return self.choice is not None and self.ready >= set(self.joined)

    @property
    def finished(self) -> bool:
        return self.ready_passed and self.done >= set(self.joined)

    @property
    def state(self) -> str:
        if self.choice is None:
            return "waiting"
        if self.finished:
            return "done"
        if self.ready_passed:
            return "ready"
        return "decided"


@dataclass(frozen=True)
class DecideView:
    """What :meth:`Coordinator.decide` tells one node."""

    state: str
    round: int = 0
    version: int = 0
    step: int | None = None
    missing: tuple[int, ...] = ()
    local: bool = False
    digest: str = ""
    sources: tuple[tuple[int, str], ...] = ()
    reason: str = ""
    backup: str | None = None
    forced: str | None = None
    #: backup rounds holding this node's chosen copy, newest first
    backups: tuple[str, ...] = ()
    outcome: str = ""
    problems: tuple[str, ...] = ()
    #: while waiting: what for, besides the missing ranks
    waiting_for: str = ""


@dataclass(frozen=True)
class BarrierView:
    """What :meth:`Coordinator.barrier` tells one node."""

    state: str
    waiting_for: tuple[int, ...] = ()


@dataclass(frozen=True)
class SyncView:
    """What :meth:`Coordinator.sync` tells one node.

    Attributes:
        backup_order: (round, step) this node still has to upload, or None.
        backup_last: the newest backup round ordered, with its state.
        backup_dedup: with the order: this node's shard has the same checksums as
            its data-parallel column's uploader's, so it may point at that data
            once the bucket holds it.
        restore_round: the restore round in progress (0: none): nodes keep
            every copy of the job meanwhile.
        summoned: (generic mode) join that round: it waits for this node.
    """

    known: bool
    synced_step: int = NO_STEP
    synced_at: float = 0.0
    steps: tuple[int, ...] = ()
    backup_order: tuple[str, int] | None = None
    backup_last: RoundView | None = None
    backup_dedup: bool = False
    restore_round: int = 0
    summoned: bool = False


@dataclass(frozen=True)
class PeerView:
    rank: int
    address: str
    incarnation: str
    live: bool


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
    ) -> None:
        self.clock = clock
        self.wall = wall
        self.live_seconds = live_seconds
        self.own_rank = own_rank
        self.bucket = bucket
        self.backups: RoundBook | None = None
        self.job: str | None = None
        self.nodes = 0
        self.members: dict[int, Member] = {}
        self.round: Round | None = None
        self.previous: Round | None = None
        self.rounds = 0
        self.sync_steps: dict[int, int] = {}
        self.synced_step = NO_STEP
        self.synced_at = 0.0
        self.history: list[dict[str, Any]] = []
        #: rank -> (the inventory it was built from, own step -> digest), see holders()
        self._own_steps: dict[int, tuple[tuple[Holding, ...], dict[int, str]]] = {}
        if backups is not None:
            self.set_backups(backups)

    def set_backups(self, book: RoundBook | None) -> None:
        """Let the sync round drive ``book`` (reset to the current job, if any)."""
        self.backups = book
        if book is not None and self.job is not None:
            book.reset(self.job, self.nodes, self.wall())

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
        self.job, self.nodes = job, nodes
        self.members.clear()
        self.round = self.previous = None
        self.sync_steps.clear()
        self.synced_step = NO_STEP
        self.synced_at = 0.0
        if self.backups is not None:
            self.backups.reset(job, nodes, self.wall())

    def live(self, rank: int) -> bool:
        """True if ``rank`` was heard from within ``live_seconds``."""
        m = self.members.get(rank)
        return m is not None and self.clock() - m.last_seen <= self.live_seconds

    def _check_job(self, job: str, nodes: int, rank: int) -> None:
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
        raise Rejected(
            f"node count mismatch: job {job!r} has {self.nodes} nodes at the "
            f"coordinator; node-rank {rank} joined with nodes {nodes}"
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
        self._check_job(job, nodes, rank)
        now = self.clock()
        inv = tuple(inventory)
        m = self.members.get(rank)
        if (
            m is not None
            and m.incarnation != incarnation
            and m.address != address
            and now - m.last_seen <= self.live_seconds
        ):
            # another daemon at another address still answers for this rank
            log.warning(
                "coordinator: node-rank %d joined from %s while %s still serves it",
                rank,
                address,
                m.address,
            )
            raise Rejected(
                f"node-rank {rank} is taken: {m.address} still serves it (heard "
                f"{now - m.last_seen:.1f} s ago); two nodes with one rank? A node "
                f"that restarted elsewhere is accepted once the old one has been "
                f"silent for {self.live_seconds:.0f} s"
            )
        if m is None or m.incarnation != incarnation:
            if m is not None:
                log.info(
                    "coordinator: node-rank %d restarted (incarnation %s -> %s)",
                    rank,
                    m.incarnation[:8],
                    incarnation[:8],
                )
                if self.backups is not None:
                    self.backups.member_restarted(rank)
            m = self.members[rank] = Member(rank, address, incarnation)
        m.address, m.inventory, m.last_seen, m.mode = address, inv, now, mode
        m.backup_interval_minutes = backup_interval_minutes or None
        m.backup_interval_steps = backup_interval_steps or None
        if not restore_id:
            return 0
        joining = Participant(rank, restore_id, inv, now, tuple(notes))
        r = self.round
        if r is not None and r.choice is None and not r.finished:
            r.joined[rank] = joining
            r.strict = r.strict or mode == PROTOCOL
            r.touched = now
            return r.number
        if r is not None and r.choice is not None and not r.finished:
            p = r.joined.get(rank)
            if p is not None and p.restore_id == restore_id:
                return r.number  # a retried join of the same restore
        self.previous = r
        self.rounds += 1
        self.round = Round(self.rounds, mode == PROTOCOL, now, touched=now)
        self.round.joined[rank] = joining
        log.info("coordinator: restore round %d opened by node-rank %d", self.rounds, rank)
        return self.rounds

    # ------------------------------------------------------------------ restore

    def _participant(self, job: str, rank: int, restore_id: str) -> Round | None:
        r = self.round
        if job != self.job or r is None:
            return None
        p = r.joined.get(rank)
        if p is None or p.restore_id != restore_id:
            return None
        now = self.clock()
        r.touched = now
        m = self.members.get(rank)
        if m is not None:
            m.last_seen = now
        return r

    def _try_decide(self, r: Round) -> None:
        """Decide once every rank joined (and, with a bucket, the bucket answered)."""
        if r.choice is not None:
            return
        r.missing = tuple(rank for rank in range(self.nodes) if rank not in r.joined)
        if r.missing:
            r.waiting_for = ""
            return
        r.inventories = {rank: p.inventory for rank, p in r.joined.items()}
        self._decide(r)

    def bucket_wanted(self) -> tuple[int, str, int, int] | None:
        """The bucket read the open round waits for: (round, job, nodes, depth), else None.

        Depth: how many complete backup rounds the read looks for, newest
        first (:data:`BUCKET_DEPTH`, more once bad copies ruled those out).
        """
        r = self.round
        if (
            not self.bucket
            or r is None
            or r.choice is not None
            or r.missing
            or self.job is None
            or not r.joined
        ):
            return None
        if r.bucket is not None and r.bucket.depth >= r.bucket_depth:
            return None
        return r.number, self.job, self.nodes, r.bucket_depth

    def bucket_answered(self, round_no: int, view: BucketView) -> None:
        """The bucket's answer for round ``round_no`` (a stale one is ignored)."""
        r = self.round
        if r is None or r.number != round_no or r.choice is not None:
            return
        if view.error:
            log.warning(
                "coordinator: round %d: the bucket could not be read: %s", round_no, view.error
            )
        r.bucket = view
        self._try_decide(r)

    def _decide(self, r: Round) -> None:
        """Choose (again) for every participant; waits for the bucket if it must."""
        if self.bucket and (r.bucket is None or r.bucket.depth < r.bucket_depth):
            r.choice = None
            r.waiting_for = "the bucket" if r.bucket is None else "older backup rounds"
            return
        notes = [n for p in r.joined.values() for n in p.notes] + r.notes
        if r.version >= MAX_DECISIONS:
            why = (
                f"no step could be restored after {r.version} decisions of round "
                f"{r.number}: " + "; ".join(notes[-3:] or ["every copy failed"])
            )
            choice = Choice(None, reason=why, outcome=INCOMPLETE, problems=(why,))
        else:
            choice = choose_restore(self.nodes, r.inventories, r.bad, r.bucket, notes)
            if needs_deeper_read(choice, r.bucket, self.nodes):
                r.bucket_depth = (r.bucket.depth if r.bucket else BUCKET_DEPTH) + 2
                r.choice = None
                r.waiting_for = "older backup rounds"
                return
        r.choice = choice
        r.waiting_for = ""
        r.version += 1
        r.ready.clear()
        r.decided_at = self.clock()
        self.sync_steps.clear()
        self.synced_step = NO_STEP
        if self.backups is not None:
            self.backups.restored(
                r.choice.backup, r.choice.step, self.wall(), new_timeline=r.strict
            )
        log.info(
            "coordinator: round %d decision %d: step %s (%s)",
            r.number,
            r.version,
            r.choice.step,
            r.choice.reason,
        )
        self.history.append(
            {
                "round": r.number,
                "version": r.version,
                "step": r.choice.step,
                "reason": r.choice.reason,
                "outcome": r.choice.outcome,
                "at": self.wall(),
            }
        )
        del self.history[:-20]

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
        self._try_decide(r)
        if r.choice is None:
            return DecideView(
                WAITING, r.number, r.version, missing=r.missing, waiting_for=r.waiting_for
            )
        c = r.choice
        common = dict(reason=c.reason, forced=c.forced, outcome=c.outcome, problems=c.problems)
        if c.step is None:
            return DecideView(DECIDED, r.number, r.version, None, **common)
        local, holders = sources_for(c, rank, self.nodes)
        sources = tuple((h, self.members[h].address) for h in holders if h in self.members)
        backups = c.rounds.get(rank, ())
        # a forced round is restored from the bucket even when a peer holds the same bytes
        backup = c.forced or (backups[0] if backups and not local and not sources else None)
        return DecideView(
            DECIDED,
            r.number,
            r.version,
            c.step,
            local=local,
            digest=c.digests.get(rank, ""),
            sources=sources,
            backup=backup,
            backups=backups,
            **common,
        )

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
        """
        prev = self.previous
        if (
            prev is not None
            and prev.number == round_no
            and job == self.job
            and rank in prev.joined
            and prev.joined[rank].restore_id == restore_id
        ):
            if (phase == "done" and prev.finished) or (phase == "ready" and prev.ready_passed):
                return BarrierView(PASSED)
            return BarrierView(REJOIN)
        r = self._participant(job, rank, restore_id)
        if r is None or r.number != round_no:
            return BarrierView(REJOIN)
        if r.choice is None or version != r.version:
            return BarrierView(REPLAN)  # decided again (or deciding): call decide
        r.touched = self.clock()
        if phase == "ready":
            if not ok:
                self._failed(r, rank, set(bad), detail)
                return BarrierView(REPLAN)
            r.ready.add(rank)
            waiting = tuple(sorted(set(r.joined) - r.ready))
            return BarrierView(WAITING, waiting) if waiting else BarrierView(PASSED)
        if phase == "done":
            if not r.ready_passed:
                return BarrierView(WAITING, tuple(sorted(set(r.joined) - r.ready)))
            r.done.add(rank)
            waiting = tuple(sorted(set(r.joined) - r.done))
            return BarrierView(WAITING, waiting) if waiting else BarrierView(PASSED)
        raise ValueError(f"unknown barrier phase {phase!r}")

    def _failed(self, r: Round, rank: int, bad: set[CopyId], detail: str) -> None:
        c = r.choice
        assert c is not None
        new = bad - r.bad
        if not new and c.step is not None:
            # nothing named (e.g. no space, every source unreachable): none of this
            # node's copies counts any more, so the next decision differs
            new = {(h, rank, c.step) for h in c.holders.get(rank, ())}
            new |= {(n, rank, c.step) for n in c.rounds.get(rank, ())}
        r.bad |= new
        r.failures += 1
        what = detail or (
            f"could not get its data for step {c.step}" if c.step is not None else "failed"
        )
        r.notes.append(f"node-rank {rank}: {what}")
        del r.notes[:-10]
        log.info(
            "coordinator: node-rank %d could not restore step %s (%s); bad copies %s; "
            "deciding again",
            rank,
            c.step,
            what,
            sorted(map(str, new)),
        )
        self._decide(r)

    def restore_open(self) -> int:
        """The restore round in progress (0: none, or idle for :data:`ROUND_IDLE` s)."""
        r = self.round
        if r is None or r.finished or self.clock() - r.touched > ROUND_IDLE:
            return 0
        return r.number

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
    ) -> SyncView:
        """Heartbeat plus sync report: ``step`` = newest own step replicated to all peers.

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
        if job != self.job or m is None or m.incarnation != incarnation:
            return SyncView(False)
        m.last_seen = self.clock()
        m.inventory = tuple(inventory)
        m.replicated_step = step
        m.data_parallelism = data_parallelism or None
        if step >= 0:
            self.sync_steps[rank] = step
        if len(self.sync_steps) == self.nodes and all(
            r in self.sync_steps for r in range(self.nodes)
        ):
            synced = min(self.sync_steps.values())
            if synced > self.synced_step:
                self.synced_step = synced
                self.synced_at = self.wall()
                log.info(
                    "coordinator: sync round complete: step %d on all %d nodes", synced, self.nodes
                )
        steps = tuple(self.sync_steps.get(r, NO_STEP) for r in range(self.nodes))
        number = self.restore_open()
        rnd = self.round
        summoned = bool(
            number
            and rnd is not None
            and rnd.choice is None
            and not rnd.strict
            and rank not in rnd.joined
        )
        book = self.backups
        if book is None:
            return SyncView(
                True,
                self.synced_step,
                self.synced_at,
                steps,
                restore_round=number,
                summoned=summoned,
            )
        if backup is not None:
            book.report(rank, backup)
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
        )

    def holders(self, step: int) -> dict[int, str | None]:
        """Rank -> the digest of its own shard of ``step``, for every member whose
        latest inventory holds it (the backup book's view of who can upload).
        O(members): each member's index is rebuilt only when its inventory changed."""
        cache = self._own_steps
        out: dict[int, str | None] = {}
        for m in self.members.values():
            hit = cache.get(m.rank)
            if hit is None or hit[0] is not m.inventory:
                hit = cache[m.rank] = (
                    m.inventory,
                    {h.step: h.digest for h in m.inventory if h.rank == m.rank},
                )
            if step in hit[1]:
                out[m.rank] = hit[1][step] or None
        return out

    def _backup_tick(self, book: RoundBook) -> None:
        step = self.synced_step if self.synced_step >= 0 else None
        requested = step is not None and any(
            h.backup_requested
            for m in self.members.values()
            for h in m.inventory
            if h.step == step and h.rank == m.rank
        )
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

    def peers(self) -> list[PeerView]:
        """Every known member with its address and liveness."""
        return [
            PeerView(m.rank, m.address, m.incarnation, self.live(m.rank))
            for m in sorted(self.members.values(), key=lambda m: m.rank)
        ]

    def status(self) -> dict[str, Any]:
        """Plain-data status (``tierfs status`` of the coordinator's node)."""
        now = self.clock()
        r = self.round
        rnd = None
        if r is not None:
            rnd = {
                "number": r.number,
                "state": r.state,
                "strict": r.strict,
                "joined": sorted(r.joined),
                "missing": list(r.missing),
                "version": r.version,
                "waiting_for": r.waiting_for or None,
                "step": r.choice.step if r.choice else None,
                "reason": r.choice.reason if r.choice else None,
                "outcome": r.choice.outcome if r.choice else None,
                "problems": list(r.choice.problems) if r.choice else [],
                "ready": sorted(r.ready),
                "done": sorted(r.done),
                "bad": [list(b) for b in sorted(r.bad, key=str)],
                "bucket": (
                    None
                    if r.bucket is None
                    else r.bucket.error or f"{len(r.bucket.rounds)} round(s) read"
                ),
                "age_seconds": round(now - r.opened_at, 1),
            }
        return {
            "job": self.job,
            "nodes": self.nodes,
            "round": rnd,
            "members": [
                {
                    "rank": m.rank,
                    "address": m.address,
                    "live": self.live(m.rank),
                    "seen_seconds_ago": round(now - m.last_seen, 1),
                    "replicated_step": m.replicated_step,
                    "shards": len(m.inventory),
                }
                for m in sorted(self.members.values(), key=lambda m: m.rank)
            ],
            "sync": {
                "step": self.synced_step if self.synced_step >= 0 else None,
                "at": self.synced_at or None,
                "steps": {str(r): s for r, s in sorted(self.sync_steps.items())},
            },
            "decisions": list(self.history[-5:]),
            "backups": self.backups.status() if self.backups is not None else None,
        }


# ---------------------------------------------------------------------- gRPC


#: longest a Decide/Barrier long-poll holds a server thread (seconds)
MAX_WAIT = 5.0


class CoordinatorServicer:
    """The ``tierfs.peer.v1.Coordinator`` service over a :class:`Coordinator`.

    Every node with a gRPC server registers it, because with the bucket
    rendezvous any node may turn out to be node-rank 0 only when its job
    starts; ``gate`` says whether this node serves the coordinator right now.

    The bucket reads a round waits for (:meth:`Coordinator.bucket_wanted`)
    run in a thread of their own with the reader from
    :meth:`set_bucket_reader`, never under the lock: heartbeats and other
    calls go on while the bucket is slow.

    Args:
        coordinator: the state.
        recheck: seconds between re-evaluations of a waiting long-poll (a
            live member may expire or appear without a call).
        gate: any thread; returns None while this node is the coordinator,
            else one line why not -- every call is then answered UNAVAILABLE
            with that line (a caller holding a stale address looks again).
            None: always serve.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        recheck: float = 0.5,
        gate: Callable[[], str | None] | None = None,
    ) -> None:
        from tierfs.rpc import peer_pb2  # like grpc below: not needed by Coordinator itself

        self.coordinator = coordinator
        self.pb2 = peer_pb2
        self.recheck = recheck
        self.gate = gate
        self.cond = threading.Condition()
        self._snapshot: dict[str, Any] = coordinator.status()
        self._reader: Callable[[str, int, int], BucketView] | None = None
        self._reading: tuple[int, str, int, int] | None = None

    def set_bucket_reader(self, reader: Callable[[str, int, int], BucketView]) -> None:
        """Install the bucket reader: ``reader(job, nodes, depth)`` -> :class:`BucketView`
        (blocking, bounded by its own deadlines; an exception counts as an
        unreadable bucket). Any thread."""
        with self.cond:
            self._reader = reader
            self._kick()
            self.cond.notify_all()

    def _kick(self) -> None:
        """Start the bucket read the coordinator waits for, if any (under the lock)."""
        want = self.coordinator.bucket_wanted()
        if want is None or self._reader is None or self._reading == want:
            return
        self._reading = want
        threading.Thread(
            target=self._read,
            args=(want, self._reader),
            daemon=True,
            name=f"tierfs-bucket-read-{want[0]}",
        ).start()

    def _read(
        self, want: tuple[int, str, int, int], reader: Callable[[str, int, int], BucketView]
    ) -> None:
        number, job, nodes, depth = want
        try:
            view = reader(job, nodes, depth)
        except Exception as exc:  # the reader's own errors: an unreadable bucket
            log.exception("coordinator: bucket read failed")
            view = BucketView(error=f"{type(exc).__name__}: {exc}", depth=depth)
        with self.cond:
            if self._reading == want:
                self._reading = None
            self.coordinator.bucket_answered(number, view)
            self._kick()
            self.cond.notify_all()

    def serving(self) -> bool:
        """True while this node answers coordinator calls (any thread)."""
        return self.gate is None or self.gate() is None

    def _admit(self, context: Any) -> None:
        if self.gate is None:
            return
        why = self.gate()
        if why is not None:
            import grpc

            context.abort(grpc.StatusCode.UNAVAILABLE, f"not the coordinator: {why}")

    def locked(self, fn: Callable[[Coordinator], Any]) -> Any:
        """Run ``fn(coordinator)`` under the servicer's lock and return its result.

        Blocks while a call holds the lock, which a durable-tier hook may do
        for its bucket deadline: call it from a worker thread, never from
        the trio thread.
        """
        with self.cond:
            return fn(self.coordinator)

    def _holdings(self, items: Iterable[Any]) -> tuple[Holding, ...]:
        return tuple(
            Holding(
                h.rank, h.step, h.verified, h.digest, h.bytes, h.name, h.backup_requested, h.created
            )
            for h in items
        )

    def _peers(self) -> list[Any]:
        return [
            self.pb2.PeerAddress(
                rank=p.rank, address=p.address, incarnation=p.incarnation, live=p.live
            )
            for p in self.coordinator.peers()
        ]

    def status(self) -> dict[str, Any]:
        """The coordinator's status (any thread; never waits: while a call holds the
        lock, e.g. a bucket lookup, the status taken last time)."""
        if self.cond.acquire(blocking=False):
            try:
                self._snapshot = self.coordinator.status()
            finally:
                self.cond.release()
        return self._snapshot

    def Join(self, request: Any, context: Any) -> Any:
        import grpc

        self._admit(context)
        with self.cond:
            try:
                number = self.coordinator.join(
                    request.job,
                    request.nodes,
                    request.rank,
                    request.address,
                    request.incarnation,
                    self._holdings(request.inventory),
                    request.restore_id,
                    request.mode or PROTOCOL,
                    backup_interval_minutes=request.backup_interval_minutes or None,
                    backup_interval_steps=request.backup_interval_steps or None,
                    notes=tuple(request.notes),
                )
            except Rejected as exc:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            self._kick()
            self.cond.notify_all()
            return self.pb2.JoinReply(round=number, peers=self._peers())

    def _wait(self, request: Any, context: Any, fn: Callable[[], Any]) -> Any:
        deadline = time.monotonic() + min(max(request.wait_ms, 0) / 1000.0, MAX_WAIT)
        with self.cond:
            while True:
                view = fn()
                self._kick()
                self.cond.notify_all()
                remaining = deadline - time.monotonic()
                if view.state != WAITING or remaining <= 0 or not context.is_active():
                    return view
                self.cond.wait(min(remaining, self.recheck))

    def Decide(self, request: Any, context: Any) -> Any:
        self._admit(context)
        view: DecideView = self._wait(
            request,
            context,
            lambda: self.coordinator.decide(request.job, request.rank, request.restore_id),
        )
        pb = self.pb2.DecideReply
        state = {WAITING: pb.WAITING, DECIDED: pb.DECIDED, REJOIN: pb.REJOIN}[view.state]
        return pb(
            state=state,
            round=view.round,
            version=view.version,
            step=NO_STEP if view.step is None else view.step,
            missing=list(view.missing),
            local=view.local,
            digest=view.digest,
            sources=[self.pb2.Source(holder=h, address=a) for h, a in view.sources],
            reason=view.reason,
            backup=view.backup or "",
            restore_version=view.forced or "",
            backups=list(view.backups),
            outcome=view.outcome,
            problems=list(view.problems),
            waiting_for=view.waiting_for,
        )

    def Barrier(self, request: Any, context: Any) -> Any:
        self._admit(context)
        bad: list[CopyId] = [(b.round or b.holder, b.rank, b.step) for b in request.bad]

        def call() -> BarrierView:
            # a failure report replans at once (not "waiting"); a retried
            # report carries the old version and only gets "replan" again
            return self.coordinator.barrier(
                request.job,
                request.rank,
                request.restore_id,
                request.round,
                request.version,
                request.phase,
                request.ok,
                bad,
                request.detail,
            )

        view: BarrierView = self._wait(request, context, call)
        pb = self.pb2.BarrierReply
        state = {WAITING: pb.WAITING, PASSED: pb.PASSED, REPLAN: pb.REPLAN, REJOIN: pb.REJOIN}[
            view.state
        ]
        return pb(state=state, waiting_for=list(view.waiting_for))

    def Sync(self, request: Any, context: Any) -> Any:
        self._admit(context)
        backup = None
        if request.HasField("backup") and request.backup.round:
            b = request.backup
            backup = Outcome(b.round, b.step, b.state, b.error, b.bytes, b.seconds)
        with self.cond:
            view = self.coordinator.sync(
                request.job,
                request.rank,
                request.incarnation,
                request.step,
                self._holdings(request.inventory),
                backup,
                request.data_parallelism,
            )
            self.cond.notify_all()
            pb2 = self.pb2
            reply = pb2.SyncReply(
                known=view.known,
                synced_step=view.synced_step,
                synced_at=view.synced_at,
                peers=self._peers(),
                steps=list(view.steps),
                restore_round=view.restore_round,
                summoned=view.summoned,
            )
            if view.backup_order is not None:
                reply.backup_order.CopyFrom(
                    pb2.BackupRound(
                        round=view.backup_order[0],
                        step=view.backup_order[1],
                        state="running",
                        dedup=view.backup_dedup,
                    )
                )
            if view.backup_last is not None:
                last = view.backup_last
                reply.backup_last.CopyFrom(
                    pb2.BackupRound(round=last.round, step=last.step, state=last.state)
                )
            return reply
