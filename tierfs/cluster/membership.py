"""The members of the coordinator's job and the counts kept about them (pure).

:class:`Membership` holds one :class:`tierfs.cluster.rounds.Member` per node
rank (address, incarnation, last heartbeat, inventory) and keeps, as the
inventories and sync reports come in, the figures the coordinator needs per
call without walking every member (a job may have 10,000 nodes, #17):

* the steps some member marks ``_BACKUP_REQUESTED`` (a count per step);
* the sync round: each rank's newest replicated step and a count of ranks
  per step, so the synced step (the least one, once every rank reported)
  costs O(distinct steps), a handful;
* the number of live members, counted at most every :data:`LIVE_COUNT_TTL`
  seconds;
* the own-part digest each rank last reported per step, numbered, so a node's
  whole-step view learns only what changed since it last asked
  (:class:`tierfs.cluster.part_versions.PartVersions`).

Only :meth:`Membership.holders` (for the backup book) and the full
:meth:`Membership.peers` list (status, older nodes) walk every member.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable

from tierfs.cluster.part_versions import PartVersions
from tierfs.cluster.restore_choice import Holding
from tierfs.cluster.rounds import Member, PeerView, Rejected
from tierfs.cluster.savers import Savers

log = logging.getLogger("tierfs.cluster.coordinator")

#: seconds a count of live members is reused (counting walks every member)
LIVE_COUNT_TTL = 1.0


class Membership:
    """The members of one job (see the module docstring).

    Args:
        clock: monotonic seconds.
        live_seconds: a member heard from within this many seconds is live.
    """

    def __init__(self, clock: Callable[[], float], live_seconds: float) -> None:
        self.clock = clock
        self.live_seconds = live_seconds
        self.members: dict[int, Member] = {}
        #: own step -> members whose inventory marks it _BACKUP_REQUESTED
        self.requested: collections.Counter[int] = collections.Counter()
        #: rank -> its newest replicated step (since the last restore decision)
        self.sync_steps: dict[int, int] = {}
        #: reported step -> how many ranks reported it
        self.step_counts: collections.Counter[int] = collections.Counter()
        self._live_count: tuple[float, int] | None = None
        #: rank -> own step -> digest, from its latest inventory (see holders())
        self._own_steps: dict[int, dict[int, str]] = {}
        #: own step -> rank -> digest ("" unknown): the index holders() copies
        self._holders: dict[int, dict[int, str]] = {}
        #: the own-part digests reported, numbered (the nodes' whole-step views)
        self.parts = PartVersions()
        #: the step directories each rank reported saving (the nodes' DCP lookups)
        self.savers = Savers()
        #: bumped when every peer row may have changed (another job, or more row
        #: changes than :meth:`take_changed_rows` keeps): rows built before are stale
        self.version = 0
        #: ranks whose peer row (address, incarnation, liveness) changed since the last
        #: :meth:`take_changed_rows`
        self._changed_rows: list[int] = []
        #: ranks found not live by the last count (and not heard from since)
        self._silent: set[int] = set()
        #: (nodes, least_step(nodes)) until the sync reports change
        self._least: tuple[int, int | None] | None = None

    def clear(self) -> None:
        """Forget every member (another job)."""
        self.members.clear()
        self.parts.clear()
        self.savers.clear()
        self.requested.clear()
        self._live_count = None
        self._own_steps.clear()
        self._holders.clear()
        self._silent.clear()
        self._changed_rows.clear()
        self.version += 1
        self.clear_steps()

    def add(self, rank: int, address: str, incarnation: str) -> Member:
        """A new member for ``rank`` (replacing an earlier daemon's entry)."""
        old = self.members.get(rank)
        if old is not None:
            self.set_inventory(old, ())
        m = self.members[rank] = Member(rank, address, incarnation)
        self._row_changed(rank)
        hit = self._live_count
        if hit is not None:
            # counted, not walked again (a walk per join made a join storm O(N²): ~10 s of
            # coordinator CPU for 10,000 joins); the new member is live, a replaced one
            # was counted if it was
            was = old is not None and self.clock() - old.last_seen <= self.live_seconds
            self._live_count = (hit[0], hit[1] + (0 if was else 1))
        return m

    def admit(self, rank: int, address: str, incarnation: str) -> tuple[Member, bool]:
        """The member for a join of ``rank`` by daemon ``incarnation`` at ``address``: the
        known one, or a new one when the rank is new or its daemon restarted.

        Returns:
            (member, True if it replaces an earlier incarnation of the rank).

        Raises:
            Rejected: another daemon at another address still serves the rank (heard
                within ``live_seconds``): two nodes with one rank.
        """
        now = self.clock()
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
        if m is not None and m.incarnation == incarnation:
            return m, False
        if m is not None:
            log.info(
                "coordinator: node-rank %d restarted (incarnation %s -> %s)",
                rank,
                m.incarnation[:8],
                incarnation[:8],
            )
        return self.add(rank, address, incarnation), m is not None

    def heard(self, m: Member, now: float) -> None:
        """``m`` was heard from at ``now`` (clock seconds): it is live again if the last
        count found it silent (its peer row changed)."""
        m.last_seen = now
        silent = self._silent
        if silent and m.rank in silent:
            silent.discard(m.rank)
            self._row_changed(m.rank)

    def set_address(self, m: Member, address: str) -> None:
        """``m``'s daemon now listens at ``address`` (a join of the same incarnation)."""
        if m.address != address:
            m.address = address
            self._row_changed(m.rank)

    def _row_changed(self, rank: int) -> None:
        rows = self._changed_rows
        rows.append(rank)
        if len(rows) > 4 * len(self.members) + 64:
            # nobody takes them (a coordinator without a servicer): say "all" instead
            rows.clear()
            self.version += 1

    def take_changed_rows(self) -> list[int]:
        """The ranks whose peer row (:meth:`peer_rows`: address, incarnation, liveness)
        changed since the last call, in order, repeats possible; every row may have
        changed when :attr:`version` changed since. A row's liveness changes when
        :meth:`heard` finds the member silent, or a count (:meth:`live_count`, at most
        every :data:`LIVE_COUNT_TTL` seconds) finds it silent or heard again: the change
        of a member going silent is seen up to that much late."""
        rows, self._changed_rows = self._changed_rows, []
        return rows

    def set_inventory(self, m: Member, inventory: tuple[Holding, ...]) -> None:
        """``m``'s inventory is ``inventory`` (O(inventory): keeps the request counts).
        Nothing to do when it is the very tuple already held (a heartbeat whose
        inventory did not change: the servicer hands back the tuple of the last call)."""
        if inventory is m.inventory:
            return
        m.inventory = inventory
        self.parts.update(m.rank, inventory)
        self._index_own(m.rank, {h.step: h.digest for h in inventory if h.rank == m.rank})
        requested = frozenset(h.step for h in inventory if h.backup_requested and h.rank == m.rank)
        if requested != m.requested:
            self.requested.subtract(m.requested)
            self.requested.update(requested)
            self.requested += collections.Counter()  # drops counts of zero
            m.requested = requested

    def _index_own(self, rank: int, own: dict[int, str]) -> None:
        """``rank`` now holds its own parts ``own`` (step -> digest): the holders index
        follows (O(steps held), once per inventory change)."""
        old = self._own_steps.get(rank, {})
        if own == old:
            return
        index = self._holders
        for step in old.keys() - own.keys():
            ranks = index.get(step)
            if ranks is not None:
                ranks.pop(rank, None)
                if not ranks:
                    del index[step]
        for step, digest in own.items():
            index.setdefault(step, {})[rank] = digest
        if own:
            self._own_steps[rank] = own
        else:
            self._own_steps.pop(rank, None)

    # ------------------------------------------------------------------ sync round

    def clear_steps(self) -> None:
        """Forget the sync reports (a restore decision starts a new timeline)."""
        self.sync_steps.clear()
        self.step_counts.clear()
        self._least = None

    def report_step(self, rank: int, step: int) -> None:
        """``rank``'s newest replicated step is ``step`` (-1: none; ignored)."""
        old = self.sync_steps.get(rank)
        if step < 0 or old == step:
            return
        self.sync_steps[rank] = step
        self._least = None
        counts = self.step_counts
        counts[step] += 1
        if old is not None:
            counts[old] -= 1
            if not counts[old]:
                del counts[old]

    def forget_step(self, rank: int) -> None:
        """Drop ``rank``'s sync report (the rank was declared gone, issue #16)."""
        old = self.sync_steps.pop(rank, None)
        if old is not None:
            self._least = None
            self.step_counts[old] -= 1
            if not self.step_counts[old]:
                del self.step_counts[old]

    def least_step(self, nodes: int) -> int | None:
        """The least step reported, once all ``nodes`` ranks reported one (ranks are
        ``< nodes``: checked at join), else None. Kept until a report changes (every
        heartbeat asks; most change nothing)."""
        hit = self._least
        if hit is not None and hit[0] == nodes:
            return hit[1]
        least = None
        if len(self.sync_steps) >= nodes and self.step_counts:
            least = min(self.step_counts)
        self._least = (nodes, least)
        return least

    # ------------------------------------------------------------------ liveness, peers

    def live(self, rank: int) -> bool:
        """True if ``rank`` was heard from within ``live_seconds``."""
        m = self.members.get(rank)
        return m is not None and self.clock() - m.last_seen <= self.live_seconds

    def live_count(self) -> int:
        """Members heard from within ``live_seconds`` (counted at most every
        :data:`LIVE_COUNT_TTL` seconds: a count walks every member)."""
        now = self.clock()
        hit = self._live_count
        if hit is None or now - hit[0] >= LIVE_COUNT_TTL:
            limit = self.live_seconds
            silent = {m.rank for m in self.members.values() if now - m.last_seen > limit}
            if silent != self._silent:
                self._changed_rows.extend(silent ^ self._silent)
                self._silent = silent
            hit = self._live_count = (now, len(self.members) - len(silent))
        return hit[1]

    def peers(self, ranks: Iterable[int] | None = None) -> list[PeerView]:
        """The members ``ranks`` (None: every member; O(nodes)) with their address and
        liveness, by rank; ranks not known are left out."""
        if ranks is None:
            chosen = sorted(self.members.values(), key=lambda m: m.rank)
        else:
            chosen = [m for r in sorted(set(ranks)) if (m := self.members.get(r)) is not None]
        return [PeerView(m.rank, m.address, m.incarnation, self.live(m.rank)) for m in chosen]

    def peer_rows(self, ranks: Iterable[int]) -> list[tuple[int, str, str, bool]]:
        """(rank, address, incarnation, live) of the members ``ranks``, by rank; ranks
        not known are left out. The same as :meth:`peers` with plain tuples and one
        clock read: a heartbeat reply names a few peers, and building them is a good
        part of its cost at 10,000 nodes (issue #17)."""
        now = self.clock()
        limit = self.live_seconds
        get = self.members.get
        return [
            (m.rank, m.address, m.incarnation, now - m.last_seen <= limit)
            for r in sorted(set(ranks))
            if (m := get(r)) is not None
        ]

    def holders(self, step: int) -> dict[int, str | None]:
        """Rank -> the digest of its own shard of ``step`` (None: unknown), for every
        member whose latest inventory holds it (the backup book's view of who can
        upload). A copy of an index kept as inventories change (review of #17: a walk
        of every member per backup-book tick was a quarter of a heartbeat round's
        coordinator CPU at 10,000 nodes)."""
        ranks = self._holders.get(step)
        if not ranks:
            return {}
        if "" in ranks.values():
            return {r: d or None for r, d in ranks.items()}
        return dict(ranks)
