"""The peer plane's address book: this node's endpoint and its peers as the coordinator
last described them (trio thread).

DESIGN.md "Peer plane". The coordinator owns the membership; a node asks only
for the ranks it needs (:meth:`AddressBook.wanted`: its replica targets from
:func:`tierfs.replication.placement.peer_ranks` and the coordinator) and
keeps their last known address, incarnation and liveness here. A peer whose
incarnation changed restarted: the book tells its restart listeners
(the replicator sends that peer the newest step again).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tierfs.core.control import JobSpec
from tierfs.core.ranks import rank_ranges
from tierfs.core.types import COORDINATOR_RANK
from tierfs.replication import placement

log = logging.getLogger(__name__)


@dataclass
class Endpoint:
    """This node on the peer plane.

    Attributes:
        listen: ``--listen HOST:PORT`` (this node serves gRPC), or None.
        address: what peers dial (``--advertise``, else ``--listen``; ``HOST:0``
            becomes the bound port once the server runs); "" without a server.
        incarnation: a random id per daemon start (a restarted peer is a new one).
    """

    listen: str | None
    address: str
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class PeerInfo:
    """A node as the coordinator last described it."""

    rank: int
    address: str
    incarnation: str
    live: bool


class AddressBook:
    """The peers this node replicates to and the coordinator's node, by rank.

    Args:
        me: this node's endpoint (its own incarnation is never a "restart").

    Attributes:
        peers: rank -> :class:`PeerInfo` (the dict object is never replaced).
        node_counts: (live, known) nodes as the coordinator last counted them
            (None: not told yet).
    """

    def __init__(self, me: Endpoint) -> None:
        self.me = me
        self._restarted: list[Callable[[int], None]] = []
        self._gone: list[Callable[[list[int]], None]] = []
        self.peers: dict[int, PeerInfo] = {}
        self.node_counts: tuple[int, int] | None = None
        #: node ranks the coordinator declared gone for good (issue #16): the
        #: replica targets get stand-ins for them (:func:`replica_peers`)
        self.gone: frozenset[int] = frozenset()
        #: the coordinator's tag of :attr:`gone` (its SyncReply's ``gone_tag``; "": none)
        self.gone_tag = ""
        #: ranks asked for beyond the replica targets (the whole-step view reads
        #: other ranks' parts from their nodes), per job name
        self.extra: dict[str, set[int]] = {}
        #: (job, rank) -> when :meth:`also_want` first asked for it (monotonic seconds)
        self.wanted_at: dict[tuple[str, int], float] = {}

    def also_want(self, job: str, rank: int) -> bool:
        """Ask the coordinator for node ``rank``'s address from the next heartbeat on
        (for as long as ``job`` runs). Returns True if it was not asked for yet."""
        ranks = self.extra.setdefault(job, set())
        if rank in ranks:
            return False
        ranks.add(rank)
        self.wanted_at[(job, rank)] = time.monotonic()
        return True

    def update(self, peers: Iterable[Any], reply: Any = None) -> None:
        """Take the coordinator's ``PeerAddress`` entries and, from ``reply`` (a
        JoinReply/SyncReply), its counts of live and known nodes."""
        if reply is not None and reply.known_nodes:
            self.node_counts = (int(reply.live_nodes), int(reply.known_nodes))
        if reply is not None and hasattr(reply, "gone"):
            same = bool(getattr(reply, "gone_same", False))
            gone = self.gone if same else frozenset(int(g) for g in reply.gone)
            self.gone_tag = str(getattr(reply, "gone_tag", ""))
            if gone != self.gone:
                new = sorted(gone - self.gone)
                log.warning(
                    "the coordinator declared node-rank(s) %s gone for good", rank_ranges(gone)
                )
                self.gone = gone
                if new:
                    for told in self._gone:
                        told(new)
        for p in peers:
            old = self.peers.get(p.rank)
            self.peers[p.rank] = PeerInfo(p.rank, p.address, p.incarnation, p.live)
            if (
                old is not None
                and old.incarnation != p.incarnation
                and p.incarnation != self.me.incarnation
            ):
                for listener in self._restarted:
                    listener(p.rank)

    def on_restart(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(rank)`` when a known peer answers with a new incarnation
        (trio thread; must not block)."""
        self._restarted.append(listener)

    def on_gone(self, listener: Callable[[list[int]], None]) -> None:
        """Call ``listener(ranks)`` with the ranks newly declared gone for good (trio
        thread; must not block)."""
        self._gone.append(listener)

    def coordinator_down(self) -> None:
        """A coordinator call failed: its node no longer counts as live (the book is the
        coordinator's, so nothing else would say it is gone), and its last counts of
        live and known nodes are dropped (a node the coordinator refuses, e.g. one
        declared gone, showed "5 node(s) live" from its last accepted heartbeat)."""
        self.node_counts = None
        info = self.peers.get(COORDINATOR_RANK)
        if info is not None and info.live:
            info.live = False

    def reachable(self, rank: int) -> PeerInfo | None:
        """The peer at ``rank`` if it is live with a known address, else None."""
        info = self.peers.get(rank)
        if info is None or not info.live or not info.address:
            return None
        return info

    def wanted(self, job: JobSpec) -> list[int]:
        """The ranks whose addresses this node asks the coordinator for: its replica
        targets, the coordinator and the ranks :meth:`also_want` added (O(peers)
        replies, not the whole membership)."""
        extra = self.extra.get(job.name, set())
        return sorted(
            {COORDINATOR_RANK, *replica_peers(job, self.gone), *(r for r in extra if r < job.nodes)}
            - {job.node_rank}
        )


def replica_peers(job: JobSpec, gone: frozenset[int] = frozenset()) -> list[int]:
    """The ranks receiving this node's steps in ``job`` (:func:`.placement.peer_ranks`,
    with stand-ins for the ranks ``gone`` for good: :func:`.placement.with_stand_ins`;
    an impossible placement is logged and gives no peers)."""
    try:
        targets = placement.peer_ranks(
            job.node_rank,
            job.nodes,
            peer_ranks=job.peer_ranks,
            peers_per_node=job.peers_per_node,
            data_parallelism=job.assume_data_parallelism,
        )
    except ValueError as exc:
        log.warning("no peers: %s", exc)
        return []
    return placement.with_stand_ins(targets, job.node_rank, job.nodes, gone)
