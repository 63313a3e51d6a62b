"""A member's side of the tree: its Sync, Decide, Barrier through the group leader or directly.

ARCHITECTURE.md "Heartbeat groups" (issue #17 item 2). :class:`SyncRoute`
picks the leader (:func:`tierfs.replication.groups.leader` over the peers the
coordinator last described) and sends the SyncRequest through it; a leader
that fails or does not answer within ``relay_timeout`` seconds is skipped for
:data:`tierfs.replication.groups.LEADER_BACKOFF` seconds and the same request
goes directly to the coordinator at once, so a dead leader delays a member's
heartbeat by at most ``relay_timeout`` seconds once, never makes it miss one.
A leader that answers that it could not reach the coordinator
(:data:`tierfs.replication.groups.UPSTREAM`) is not skipped: the member syncs
directly this beat only (a restarted or moved coordinator must not get every
node's direct Sync for the backoff). When the coordinator was only slow (the
leader's batch call ran out of time, DEADLINE_EXCEEDED) the member's heartbeat
is skipped instead (:class:`CoordinatorBusy`), once in a row: a second such
beat syncs directly. A coordinator that stalls for a few seconds at 10,000
nodes so gets each group's next batch, not 10,000 direct Syncs on top of the
work it is behind with (review of #17, B2). The leader gives up its batch call
in time for that (:data:`tierfs.replication.relay.ANSWER_MARGIN`).

The restore round's Decide and Barrier calls (ARCHITECTURE.md "Batched
restore round") follow the same rule through the same leader
(:meth:`SyncRoute.decide`, :meth:`SyncRoute.barrier`): one mechanism.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from tierfs.core.errors import ClusterError
from tierfs.replication.client import PeerClient, rpc_code, rpc_reason
from tierfs.replication.groups import GROUP_SIZE, RELAY_TIMEOUT, UPSTREAM, candidates, leader

log = logging.getLogger(__name__)


class CoordinatorBusy(ClusterError):
    """The leader's batch call to the coordinator ran out of time: this heartbeat is
    skipped (not sent directly; the next one goes through the leader again)."""


class _Peer(Protocol):
    address: str
    live: bool


class SyncRoute:
    """Where a node's heartbeats go (blocking calls: run :meth:`sync` in a worker thread).

    Args:
        client: the node's calls (``relay`` and ``sync_call``).
        group_size: node ranks per heartbeat group (jobs of at most this many
            nodes sync directly).
        relay_timeout: seconds to wait for the leader's answer.
        clock: monotonic seconds (the leaders' failure times).

    Attributes:
        failed: node rank -> clock time a relay through it last failed.
        via: the node rank of the leader the last Sync went through (None: direct).
        relayed, direct, fallbacks: heartbeats sent through a leader, directly,
            and directly after the leader failed (also counted in the client's
            wire stats: ``heartbeats_relayed``, ``heartbeats_direct``,
            ``heartbeat_fallbacks``).
        tally: the same three counts per kind (``"heartbeat"``, ``"restore round"``:
            Decide and Barrier calls; wire stats ``round_calls_relayed``,
            ``round_calls_direct``, ``round_fallbacks``).
    """

    def __init__(
        self,
        client: PeerClient,
        *,
        group_size: int = GROUP_SIZE,
        relay_timeout: float = RELAY_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.group_size = group_size
        self.relay_timeout = relay_timeout
        self.clock = clock
        self.failed: dict[int, float] = {}
        self.via: int | None = None
        #: kind ("heartbeat", "restore round") -> relayed, direct, fallbacks
        self.tally: dict[str, dict[str, int]] = {
            k.name: {"relayed": 0, "direct": 0, "fallbacks": 0} for k in (_HEARTBEAT, _ROUND)
        }
        self._lock = threading.Lock()
        #: the last heartbeat was skipped for a busy coordinator (the next one is not)
        self._skipped = False
        #: heartbeats skipped for a busy coordinator (wire stat ``heartbeats_skipped``)
        self.skipped = 0

    def wanted(self, rank: int, nodes: int) -> list[int]:
        """The candidate leaders of ``rank``'s group other than itself (their addresses
        are asked for in every Sync)."""
        return [r for r in candidates(rank, nodes, self.group_size) if r != rank]

    def leader_of(
        self,
        rank: int,
        nodes: int,
        own_address: str,
        peers: Mapping[int, _Peer],
        gone: Collection[int] = (),
    ) -> tuple[int, str] | None:
        """(node rank, address) of the leader ``rank``'s heartbeat goes through now, or
        None: directly. ``peers``: rank -> the coordinator's last address and live
        flag; ``own_address``: this node's (it leads its group while it is the
        lowest live candidate; "" without a server: never)."""
        if nodes <= self.group_size:
            return None
        live = {r: p.live for r, p in peers.items() if p.address}
        live[rank] = bool(own_address)  # its own liveness is not the coordinator's word
        with self._lock:
            failed = dict(self.failed)
        chosen = leader(
            rank,
            nodes,
            live=live,
            gone=gone,
            failed=failed,
            now=self.clock(),
            group_size=self.group_size,
        )
        if chosen is None:
            return None
        return chosen, own_address if chosen == rank else peers[chosen].address

    def sync(self, coord: str, request: Any, via: tuple[int, str] | None) -> Any:
        """The SyncReply to ``request`` (a SyncRequest): through the leader ``via`` or,
        when it is None or fails, directly from the coordinator at ``coord``.

        Raises:
            grpc.RpcError: the coordinator did not answer the direct Sync.
            CoordinatorBusy: the leader's batch call ran out of time and the last
                heartbeat was not skipped: this one is (module docstring).
        """
        reply, self.via = self._through(
            via,
            lambda leader: self.client.relay(leader, coord, request, self.relay_timeout),
            lambda: self.client.sync_call(coord, request),
            _HEARTBEAT,
        )
        return reply

    def decide(self, coord: str, request: Any, via: tuple[int, str] | None) -> Any:
        """The DecideReply to ``request`` (a DecideRequest): through the leader ``via``
        (its DecideBatch; answered within the request's long poll plus
        ``relay_timeout`` seconds) or, when it is None or fails, directly.

        Raises:
            grpc.RpcError: the coordinator did not answer the direct Decide.
        """
        return self._round_call(
            request,
            via,
            self.client.relay_decide,
            lambda: self.client.decide_call(coord, request),
            coord,
        )

    def barrier(self, coord: str, request: Any, via: tuple[int, str] | None) -> Any:
        """The BarrierReply to ``request`` (a BarrierRequest), as :meth:`decide`.

        Raises:
            grpc.RpcError: the coordinator did not answer the direct Barrier.
        """
        return self._round_call(
            request,
            via,
            self.client.relay_barrier,
            lambda: self.client.barrier_call(coord, request),
            coord,
        )

    def _round_call(
        self,
        request: Any,
        via: tuple[int, str] | None,
        relay: Callable[[str, str, Any, float], Any],
        direct: Callable[[], Any],
        coord: str,
    ) -> Any:
        """A restore-round call (Decide or Barrier) through the leader ``via`` with the
        relay timeout of its long poll, else ``direct()``."""
        timeout = request.wait_ms / 1000 + self.relay_timeout
        reply, _ = self._through(
            via, lambda leader: relay(leader, coord, request, timeout), direct, _ROUND
        )
        return reply

    def _through(
        self,
        via: tuple[int, str] | None,
        relayed: Callable[[str], Any],
        direct: Callable[[], Any],
        kind: _Kind,
    ) -> tuple[Any, int | None]:
        """(``relayed(leader address)``, the leader's rank), or (``direct()``, None) when
        ``via`` is None or the leader fails: the one routing and fallback rule of
        heartbeats and restore-round calls (module docstring)."""
        tally = self.tally[kind.name]
        if via is not None:
            try:
                reply = relayed(via[1])
            except grpc.RpcError as exc:
                details = exc.details() if hasattr(exc, "details") else ""
                upstream = rpc_code(exc) == grpc.StatusCode.UNAVAILABLE and (
                    details or ""
                ).startswith(UPSTREAM)
                busy = upstream and "DEADLINE_EXCEEDED" in (details or "")
                if busy and kind is _HEARTBEAT and not self._skipped:
                    self._skipped = True
                    self.skipped += 1
                    self.client.stats.add("heartbeats_skipped")
                    log.info(
                        "heartbeat skipped: the coordinator did not answer leader node-rank "
                        "%d in time (%s)",
                        via[0],
                        rpc_reason(exc),
                    )
                    raise CoordinatorBusy(rpc_reason(exc)) from exc
                with self._lock:
                    if not upstream:  # a coordinator at fault must not send N nodes direct
                        self.failed[via[0]] = self.clock()
                    tally["fallbacks"] += 1
                self.client.stats.add(kind.fallbacks)
                log.warning(
                    "%s leader node-rank %d (%s) failed: %s; calling the coordinator directly",
                    kind.name,
                    via[0],
                    via[1],
                    rpc_reason(exc),
                )
            else:
                tally["relayed"] += 1
                self.client.stats.add(kind.relayed)
                if kind is _HEARTBEAT:
                    self._skipped = False
                return reply, via[0]
        tally["direct"] += 1
        self.client.stats.add(kind.direct)
        reply = direct()
        if kind is _HEARTBEAT:
            self._skipped = False
        return reply, None

    @property
    def relayed(self) -> int:
        """Heartbeats sent through a leader."""
        return self.tally[_HEARTBEAT.name]["relayed"]

    @property
    def direct(self) -> int:
        """Heartbeats sent directly."""
        return self.tally[_HEARTBEAT.name]["direct"]

    @property
    def fallbacks(self) -> int:
        """Heartbeats sent directly after their leader failed."""
        return self.tally[_HEARTBEAT.name]["fallbacks"]


@dataclass(frozen=True)
class _Kind:
    """A kind of call a member routes (its name in logs and its wire counters)."""

    name: str
    relayed: str
    direct: str
    fallbacks: str


_HEARTBEAT = _Kind("heartbeat", "heartbeats_relayed", "heartbeats_direct", "heartbeat_fallbacks")
_ROUND = _Kind("restore round", "round_calls_relayed", "round_calls_direct", "round_fallbacks")
