"""The coordinator's plain data: members, restore rounds and what a call answers.

:class:`tierfs.cluster.coordinator.Coordinator` keeps one :class:`Member` per
node and one open :class:`Round`; each call answers one node with a view
(:class:`DecideView`, :class:`BarrierView`, :class:`SyncView`) whose size is
O(1) or O(the node's peers), never O(nodes): lists of ranks (missing joins,
nodes the barrier waits for) carry at most :data:`SHOWN_RANKS` entries plus
the full count. :class:`RankSet` is the set of ranks of ``[0, nodes)`` that
reached something (joined, ready, done), with an O(1) count and the first
ranks that did not, so no call walks every rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from tierfs.cluster.restore_choice import Choice
from tierfs.core.errors import ClusterError
from tierfs.core.types import NO_STEP as NO_STEP
from tierfs.core.types import BucketView, CopyId, Holding, RoundView

WAITING, DECIDED, REJOIN, PASSED, REPLAN = "waiting", "decided", "rejoin", "passed", "replan"
PROTOCOL, GENERIC = "protocol", "generic"

#: complete backup rounds a first bucket read looks for (a replan may read deeper)
BUCKET_DEPTH = 1
#: most ranks a reply lists (missing joins, ranks a barrier waits for); the count is exact
SHOWN_RANKS = 32


class Rejected(ClusterError):
    """A join the coordinator refuses; the message is one line for ``replicator.errors``."""


class RankSet:
    """A set of ranks of ``[0, size)``: O(1) add, membership and count.

    :meth:`lacking` gives the smallest ranks *not* in the set (a byte scan in C,
    not a Python loop over every rank). Iterating is O(size): for status only.

    Raises:
        IndexError: a rank outside ``[0, size)``.
    """

    __slots__ = ("_count", "_flags")

    def __init__(self, size: int) -> None:
        self._flags = bytearray(size)
        self._count = 0

    def add(self, rank: int) -> bool:
        """Add ``rank``; True if it was not in the set."""
        if rank < 0:
            raise IndexError(rank)
        if self._flags[rank]:
            return False
        self._flags[rank] = 1
        self._count += 1
        return True

    def clear(self) -> None:
        self._flags = bytearray(len(self._flags))
        self._count = 0

    def __contains__(self, rank: object) -> bool:
        return isinstance(rank, int) and 0 <= rank < len(self._flags) and bool(self._flags[rank])

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[int]:
        flags = self._flags
        i = flags.find(1)
        while i >= 0:
            yield i
            i = flags.find(1, i + 1)

    @property
    def size(self) -> int:
        return len(self._flags)

    @property
    def lacking_count(self) -> int:
        """How many ranks of ``[0, size)`` are not in the set."""
        return len(self._flags) - self._count

    def lacking(self, limit: int = SHOWN_RANKS) -> tuple[int, ...]:
        """The smallest ``limit`` ranks not in the set, ascending."""
        flags, out = self._flags, list[int]()
        i = flags.find(0)
        while i >= 0 and len(out) < limit:
            out.append(i)
            i = flags.find(0, i + 1)
        return tuple(out)


@dataclass
class Member:
    """A node the coordinator knows (from a join or a heartbeat).

    Attributes:
        requested: the own steps of its inventory marked ``_BACKUP_REQUESTED``.
    """

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
    requested: frozenset[int] = frozenset()


@dataclass
class Participant:
    """A node taking part in a restore round.

    Attributes:
        notes: what the node found while checking its copies (discarded ones).
        incarnation: the daemon that joined (a restarted one joins anew).
        heard: clock time of its last call in the round (join, decide, barrier).
    """

    rank: int
    restore_id: str
    inventory: tuple[Holding, ...]
    joined_at: float
    notes: tuple[str, ...] = ()
    incarnation: str = ""
    heard: float = 0.0

    def __post_init__(self) -> None:
        self.heard = self.heard or self.joined_at


@dataclass
class Round:
    """One restore round of a job of ``nodes`` nodes (see the coordinator module).

    Attributes:
        present: the ranks that joined (same keys as ``joined``, with a count).
        ready, done: the ranks past each barrier phase of the current decision.
        bucket: the bucket's answer for this round (None: not read yet).
        bucket_early: clock time of that answer when it came while ranks were still
            missing (the read starts at the round's first join, issue #17), else None.
        bucket_depth: the complete rounds the decision needs the read to look for.
        bad: copies found bad or unusable during this round.
        notes: lines from the nodes (discarded copies, failed fetches).
        waiting_for: what the decision waits for ("" or e.g. "the bucket").
        touched: clock time of the last call of a participant.
    """

    number: int
    strict: bool
    opened_at: float
    nodes: int
    joined: dict[int, Participant] = field(default_factory=dict)
    present: RankSet = field(init=False)
    choice: Choice | None = None
    version: int = 0
    inventories: dict[int, tuple[Holding, ...]] = field(default_factory=dict)
    bad: set[CopyId] = field(default_factory=set)
    ready: RankSet = field(init=False)
    done: RankSet = field(init=False)
    decided_at: float | None = None
    bucket: BucketView | None = None
    bucket_early: float | None = None
    bucket_depth: int = BUCKET_DEPTH
    notes: list[str] = field(default_factory=list)
    waiting_for: str = ""
    touched: float = 0.0
    #: "ready" reports of nodes that could not get their data
    failures: int = 0
    #: ranks declared gone for good (issue #16): the round does not wait for them;
    #: their parts count only where a verified copy exists (peers, bucket)
    gone: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        self.present = RankSet(self.nodes)
        self.ready = RankSet(self.nodes)
        self.done = RankSet(self.nodes)

    def enter(self, p: Participant) -> None:
        """``p`` joins (or replaces its rank's earlier join)."""
        self.joined[p.rank] = p
        self.present.add(p.rank)

    @property
    def missing_count(self) -> int:
        """Ranks that have not joined and are not gone (O(gone ranks))."""
        absent_gone = sum(1 for g in self.gone if g not in self.present and g < self.nodes)
        return self.present.lacking_count - absent_gone

    @property
    def missing(self) -> tuple[int, ...]:
        """The first :data:`SHOWN_RANKS` ranks that have not joined (gone ones left out)."""
        if not self.missing_count:
            return ()
        lacking = self.present.lacking(SHOWN_RANKS + len(self.gone))
        return tuple(r for r in lacking if r not in self.gone)[:SHOWN_RANKS]

    @property
    def ready_passed(self) -> bool:
        # ready holds only participants (ranks of joined), so counts compare the sets
        return self.choice is not None and len(self.ready) >= len(self.joined)

    @property
    def finished(self) -> bool:
        return self.ready_passed and len(self.done) >= len(self.joined)

    @property
    def state(self) -> str:
        if self.choice is None:
            return "waiting"
        if self.finished:
            return "done"
        if self.ready_passed:
            return "ready"
        return "decided"

    def summons(self, rank: int, incarnation: str) -> bool:
        """Whether the live node ``rank`` (daemon ``incarnation``) is asked to join this
        round (generic mode: every node must be able to present the agreed step).

        Undecided: every rank that has not joined. Decided: a participant that has
        not been heard from since the decision while the daemon that joined still
        runs: it gave up waiting (e.g. ``missing`` after its ``--join-timeout``)
        before the last node joined; its new join opens the next round, which the
        others join again. A participant still restoring ignores a summons (a node
        runs one restore at a time); a restarted daemon starts a restore of its own.
        A strict (protocol) round summons nobody: every rank joins when its job
        restarts.
        """
        if self.strict or self.finished:
            return False
        p = self.joined.get(rank)
        if self.choice is None:
            return p is None
        return (
            p is not None
            and p.incarnation == incarnation
            and self.decided_at is not None
            and p.heard < self.decided_at
        )

    def progress(self) -> tuple[int, int, bool, bool, bool]:
        """What a waiting Decide/Barrier call waits for to change: (round, version,
        decided, ready passed, done passed)."""
        return (
            self.number,
            self.version,
            self.choice is not None,
            self.ready_passed,
            self.finished,
        )


@dataclass(frozen=True)
class DecideView:
    """What :meth:`Coordinator.decide` tells one node.

    Attributes:
        missing: the first :data:`SHOWN_RANKS` ranks that have not joined.
        missing_count: how many have not joined.
        writers: the node count that wrote ``step`` (issue #16; 0 unknown): a
            node whose rank is not below it has no part of the step to restore.
    """

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
    missing_count: int = 0
    writers: int = 0


@dataclass(frozen=True)
class BarrierView:
    """What :meth:`Coordinator.barrier` tells one node.

    Attributes:
        waiting_for: the first :data:`SHOWN_RANKS` ranks the phase waits for.
        waiting_count: how many it waits for.
    """

    state: str
    waiting_for: tuple[int, ...] = ()
    waiting_count: int = 0


class SyncView(NamedTuple):
    """What :meth:`Coordinator.sync` tells one node (a named tuple: one is built per
    heartbeat, 10,000 per round at 10,000 nodes, and a frozen dataclass's
    ``__init__`` was a fifth of :meth:`Coordinator.sync`'s own time).

    Attributes:
        steps: every rank's newest replicated step (index = rank), only when
            asked for (``compact`` False: O(nodes)); else empty.
        reported: how many ranks reported a replicated step since the last decision.
        backup_order: (round, step) this node still has to upload, or None.
        backup_last: the newest backup round ordered, with its state.
        backup_dedup: with the order: this node's shard has the same checksums as
            its data-parallel column's uploader's, so it may point at that data
            once the bucket holds it.
        restore_round: the restore round in progress (0: none): nodes keep
            every copy of the job meanwhile.
        summoned: (generic mode) join that round: it waits for this node, or this
            node gave up on it before it was decided.
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
    reported: int = 0


@dataclass(frozen=True)
class PeerView:
    """A member as a node sees it: address, incarnation (a random id per daemon
    start) and whether it was heard from within the coordinator's live period."""

    rank: int
    address: str
    incarnation: str
    live: bool
