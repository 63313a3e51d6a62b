"""Which ranks' own parts changed, for the nodes' whole-step views (pure; issue #14).

A rank may save a step number again with other bytes; every node showing
that step with the other ranks' files (:mod:`tierfs.node.remote_view`) must
notice, whether or not it holds a replica of the rank that saved again.
Node-rank 0's coordinator sees every node's own-part digests in the
inventories its heartbeats bring. :class:`PartVersions` keeps the digest
each rank last reported per step and numbers each *change* (a rank reporting
another digest for a step it reported before: one counter per job, the
*version*); the first report of a part is not a change (a view asks for a
part it does not know yet). A node asks "what changed in steps 10 and 20
since version 812?" and the reply names only the parts changed since
(issue #17: it never grows with the whole table). A node that knew a former
coordinator (another *epoch*: this one restarted and may have missed a
change) is sent, once, every digest of the steps it shows.

Only the :data:`KEEP_STEPS` newest steps are kept; a node asking about an
older step whose records were dropped after its version is told that the
changes of that step are lost (it asks every rank of it again).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from tierfs.core.types import Holding

__all__ = ["KEEP_STEPS", "LOST", "PartChange", "PartVersions"]

#: steps whose part digests are kept (the newest; a node shows only a few steps)
KEEP_STEPS = 64
#: the ``rank`` of a :class:`PartChange` saying the changes of its step are lost
LOST = -1


@dataclass(frozen=True, slots=True)
class PartChange:
    """Rank ``rank``'s own part of ``step`` is now ``digest`` (its manifest digest), as
    its node reported it; ``rank`` :data:`LOST`: the changes of ``step`` since the
    asked version are not known any more (``digest`` empty)."""

    step: int
    rank: int
    digest: str


class PartVersions:
    """The own-part digest each rank last reported per step, with its version.

    Attributes:
        epoch: names this table (new at creation and at :meth:`clear`): versions of
            another epoch mean nothing here.
        version: the newest version given (0: none yet).
    """

    def __init__(self, keep_steps: int = KEEP_STEPS) -> None:
        self.keep_steps = keep_steps
        self.epoch = uuid.uuid4().hex[:16]
        self.version = 0
        #: step -> rank -> (version, digest) of the newest digest that rank reported
        self._steps: dict[int, dict[int, tuple[int, str]]] = {}
        #: step -> the newest version of any rank's record of it
        self._newest: dict[int, int] = {}
        #: the newest version among the records dropped (steps older than those kept)
        self._dropped_version = 0

    def clear(self) -> None:
        """Forget everything (another job): a new epoch."""
        self.__init__(self.keep_steps)  # type: ignore[misc]

    def update(self, rank: int, inventory: Iterable[Holding]) -> int:
        """Record the digests of ``rank``'s own parts in its inventory (its replicas of
        other ranks are left out; a part no longer held keeps its last record, so a
        part dropped and saved again is a change too). O(inventory). Returns how
        many changes got a version."""
        new = 0
        for h in inventory:
            if h.rank != rank or not h.digest:
                continue
            records = self._steps.get(h.step)
            if records is None:
                if len(self._steps) >= self.keep_steps and h.step < min(self._steps):
                    continue  # older than every step kept: a node asking is told "lost"
                records = self._steps[h.step] = {}
            old = records.get(rank)
            if old is None:
                records[rank] = (0, h.digest)  # a first report is not a change
                continue
            if old[1] == h.digest:
                continue
            self.version += 1
            records[rank] = (self.version, h.digest)
            self._newest[h.step] = self.version
            new += 1
        while len(self._steps) > self.keep_steps:
            oldest = min(self._steps)
            del self._steps[oldest]
            dropped = self._newest.pop(oldest, 0)
            self._dropped_version = max(self._dropped_version, dropped)
        return new

    def changes(self, epoch: str, asked: Iterable[tuple[int, int]]) -> list[PartChange]:
        """What changed in the steps ``asked`` ((step, version) pairs: the version up to
        which the asking node knows that step's parts, of ``epoch``), by step and rank.

        ``epoch`` "" (a node that has not asked this coordinator yet): the changes
        since version 0. Another epoch (this coordinator restarted and may have
        missed a change while it was down): one :data:`LOST` change per step asked
        that it has records of, and the node asks every rank of that step again
        itself; not every digest, which made the first heartbeat round after a
        coordinator restart O(N²) (a 10,000-node job: 70 MiB per batch reply, over
        gRPC's limit; issue #17 review B1). A step whose records were dropped after
        the asked version gets one :data:`LOST` change too. O(asked steps) when
        nothing changed, plus the records sent."""
        if epoch and epoch != self.epoch:
            return [PartChange(step, LOST, "") for step, _ in asked if step in self._steps]
        if not epoch:
            asked = [(step, 0) for step, _ in asked]
        out: list[PartChange] = []
        for step, since in asked:
            records = self._steps.get(step)
            if records is None:
                dropped = self._dropped_version
                if dropped and step < min(self._steps, default=step) and since < dropped:
                    out.append(PartChange(step, LOST, ""))
                continue
            if self._newest.get(step, 0) <= since:
                continue
            out.extend(
                PartChange(step, rank, digest)
                for rank, (version, digest) in sorted(records.items())
                if version > since
            )
        return out
