"""A group leader's side of the tree: members' Syncs, Decides, Barriers in batches (asyncio).

ARCHITECTURE.md "Heartbeat groups" (issue #17 item 2). Every node with a gRPC
server serves ``tierfs.peer.v1.SyncRelay`` (any node may be chosen leader of
its group, :func:`tierfs.replication.groups.leader`). A ``Relay`` call
carries one member's SyncRequest and the coordinator address the member
found. The first call for a coordinator opens a batch; :attr:`SyncRelay.window`
seconds later the batch is sent in ONE ``SyncBatch`` call and each waiting
``Relay`` call is answered with its member's own SyncReply. Members
heartbeat once per period with spread phases, so a window of one period
makes one coordinator call per group and period. If the coordinator call
fails, every member of the batch gets UNAVAILABLE with the reason and syncs
directly (:class:`tierfs.replication.heartbeat.Heartbeat`).

The restore round's long polls go the same way (ARCHITECTURE.md "Batched
restore round"): ``RelayDecide``/``RelayBarrier`` calls gather for
:attr:`SyncRelay.round_window` seconds in a batch per (method, coordinator,
immediate or long poll) and go out as ONE ``DecideBatch``/``BarrierBatch``
long poll whose wait is the earliest member's bound: its own ``wait_ms`` and
its call's deadline less :data:`DEADLINE_MARGIN`. One mechanism serves the
three kinds (:class:`_Kind`).

The handlers run on the loop of the node's ``grpc.aio`` server: a waiting
member holds no thread; the coordinator call is an ``grpc.aio`` call on the
same loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio

from tierfs.replication.groups import RELAY_WINDOW, ROUND_WINDOW, UPSTREAM
from tierfs.rpc import peer_pb2
from tierfs.rpc import wire as peer_wire
from tierfs.rpc.wire import WireStats

log = logging.getLogger(__name__)

#: seconds a leader's batch call may take beyond its long poll
BATCH_TIMEOUT = 10.0
#: seconds before a member's own deadline by which its batch must be answered
DEADLINE_MARGIN = 1.0
#: seconds before a member's own deadline by which the coordinator's answer to the
#: batch must be here (the rest is the hop back to the member): past it the batch
#: call is given up and the members told :data:`UPSTREAM` with DEADLINE_EXCEEDED
#: while they still wait, so none of them takes its healthy leader for a failed
#: one (review of #17, B2). 1 s: with 0.5 s, under a load of about 10 on 2 cores (a
#: suite beside a busy loop and a 3-daemon trial) the answers to 100 members took
#: longer, one member's relay call timed out and it went direct
ANSWER_MARGIN = 1.0
#: seconds a batch call is given at least beyond its long poll
MIN_BATCH_TIMEOUT = 0.25
_SYNC_COUNTERS = ("heartbeat_batches_sent", "heartbeats_batched")
_ROUND_COUNTERS = ("round_batches_sent", "round_calls_batched")
#: the reply message of each batch method
_REPLIES: dict[str, Any] = {
    "SyncBatch": peer_pb2.SyncBatchReply,
    "DecideBatch": peer_pb2.DecideBatchReply,
    "BarrierBatch": peer_pb2.BarrierBatchReply,
}
#: seconds a coordinator's Nudge call may take (a node that does not answer learns
#: of the round in its next heartbeat anyway)
NUDGE_TIMEOUT = 2.0


@dataclass
class _Batch:
    requests: list[Any] = field(default_factory=list)
    waiters: list[asyncio.Future[Any]] = field(default_factory=list)
    #: loop time by which the batch's answer must be back (the members' earliest)
    deadline: float = float("inf")
    #: loop time by which the coordinator's answer must be here so that every
    #: member still gets its reply before its own call's deadline
    answer_by: float = float("inf")


@dataclass(frozen=True)
class _Kind:
    """One kind of relayed call: how its batch goes to the coordinator."""

    #: the Coordinator method ("SyncBatch", "DecideBatch", "BarrierBatch")
    method: str
    #: builds the batch request from (members, wait_ms, leader rank)
    request: Callable[[list[Any], int, int], Any]
    #: seconds a batch collects members
    window: float
    #: the stats counters (batches sent, members carried)
    counters: tuple[str, str]


def _sync_batch(members: list[Any], wait_ms: int, leader: int) -> Any:
    return peer_pb2.SyncBatchRequest(members=members, leader=leader)


def _decide_batch(members: list[Any], wait_ms: int, leader: int) -> Any:
    return peer_pb2.DecideBatchRequest(members=members, wait_ms=wait_ms, leader=leader)


def _barrier_batch(members: list[Any], wait_ms: int, leader: int) -> Any:
    return peer_pb2.BarrierBatchRequest(members=members, wait_ms=wait_ms, leader=leader)


class SyncRelay:
    """The ``tierfs.peer.v1.SyncRelay`` service (async handlers; see the module docstring).

    Args:
        token: the peer token sent with the batch calls (the job's shared one).
        rank: returns this node's node rank (-1: unknown), sent as the batch's leader.
        window: seconds a heartbeat batch collects members before it is sent.
        round_window: seconds a restore-round batch (Decide, Barrier) collects
            members (:data:`tierfs.replication.groups.ROUND_WINDOW`).
        connect: ``connect(address)`` -> a ``grpc.aio.Channel`` (None: insecure,
            with the peer plane's channel options); called on the loop.
        stats: the node's wire counters (``heartbeat_batches_sent``,
            ``heartbeats_batched``, ``round_batches_sent``, ``round_calls_batched``),
            or None.
        on_nudge: ``on_nudge(job)``: a coordinator asks this node to heartbeat now
            (the loop thread; must not block); None: nudges are ignored.

    Attributes:
        batches: batch calls sent; members: the members' calls they carried;
        failures: batch calls that failed.
    """

    def __init__(
        self,
        token: str | None,
        *,
        rank: Callable[[], int] = lambda: -1,
        window: float = RELAY_WINDOW,
        round_window: float = ROUND_WINDOW,
        connect: Callable[[str], grpc.aio.Channel] | None = None,
        stats: WireStats | None = None,
        on_nudge: Callable[[str], None] | None = None,
    ) -> None:
        self.stats = stats
        self.on_nudge = on_nudge
        self.md = peer_wire.metadata(token)
        self.rank = rank
        self.window = window
        self.round_window = round_window
        self._connect = connect or _aio_channel
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._open: dict[tuple[str, str, bool], _Batch] = {}
        self._sending: set[asyncio.Task[None]] = set()
        self.batches = 0
        self.members = 0
        self.failures = 0

    def _kind(self, name: str) -> _Kind:
        if name == "sync":
            return _Kind("SyncBatch", _sync_batch, self.window, _SYNC_COUNTERS)
        build = _decide_batch if name == "decide" else _barrier_batch
        return _Kind(name.capitalize() + "Batch", build, self.round_window, _ROUND_COUNTERS)

    def attach(self, server: grpc.aio.Server, loop: asyncio.AbstractEventLoop) -> None:
        """Register the service on ``server`` (loop thread, before it starts)."""
        from tierfs.rpc import peer_pb2_grpc

        peer_pb2_grpc.add_SyncRelayServicer_to_server(self, server)  # type: ignore[arg-type]

    async def Relay(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        """Wait for the batch holding ``request.sync`` and answer its member's reply;
        UNAVAILABLE (with the coordinator's error) when the batch call failed."""
        return await self._relay("sync", request.coordinator, request.sync, 0.0, context)

    async def RelayDecide(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        """A member's Decide through the group's DecideBatch (its own DecideReply);
        the batch long-polls no longer than the member's ``wait_ms`` nor past
        its call's deadline (less :data:`DEADLINE_MARGIN` seconds)."""
        d = request.decide
        return await self._relay("decide", request.coordinator, d, d.wait_ms / 1000.0, context)

    async def RelayBarrier(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        """A member's Barrier through the group's BarrierBatch (see :meth:`RelayDecide`)."""
        b = request.barrier
        return await self._relay("barrier", request.coordinator, b, b.wait_ms / 1000.0, context)

    async def _relay(
        self,
        kind: str,
        coord: str,
        member: Any,
        wait: float,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> Any:
        if not coord:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no coordinator address")
        loop = asyncio.get_running_loop()
        now = loop.time()
        remaining = context.time_remaining()
        # the answer must be back before the member's own deadline
        bound = now + wait
        if remaining is not None:
            bound = min(bound, now + max(remaining - DEADLINE_MARGIN, 0.0))
        # immediate calls (wait 0) and long polls go in separate batches: a long
        # poll must not be cut short by a member's first, immediate call
        key = (kind, coord, wait > 0)
        batch = self._open.get(key)
        if batch is None:
            batch = self._open[key] = _Batch()
            window = self._kind(kind).window
            if kind != "sync" and remaining is not None:
                # gathering never eats a round member's deadline (a heartbeat's
                # window is within its relay timeout by construction)
                window = min(window, max(remaining - DEADLINE_MARGIN, 0.0))
            loop.call_later(window, self._start_send, key)
        waiter: asyncio.Future[Any] = loop.create_future()
        batch.requests.append(member)
        batch.waiters.append(waiter)
        batch.deadline = min(batch.deadline, bound)
        if remaining is not None:
            batch.answer_by = min(batch.answer_by, now + remaining - ANSWER_MARGIN)
        try:
            return await waiter
        except grpc.aio.AioRpcError as exc:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"{UPSTREAM} {coord}: {exc.code().name} {exc.details()}",
            )

    async def Nudge(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        """The coordinator summons this node into a restore round: heartbeat now (the
        Sync reply carries the summons)."""
        if self.on_nudge is not None:
            self.on_nudge(request.job)
        return peer_pb2.NudgeReply()

    async def nudge(self, address: str, job: str, round: int) -> bool:
        """Ask the node at ``address`` to heartbeat now (the coordinator's side, loop
        thread); False, logged, if it did not answer within :data:`NUDGE_TIMEOUT` s."""
        from tierfs.rpc import peer_pb2_grpc

        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self._connect(address)
        try:
            await peer_pb2_grpc.SyncRelayStub(channel).Nudge(
                peer_pb2.NudgeRequest(job=job, round=round),
                metadata=self.md,
                timeout=NUDGE_TIMEOUT,
            )
        except grpc.aio.AioRpcError as exc:
            log.info("nudge of %s into restore round %d: %s", address, round, exc.code().name)
            return False
        return True

    def _start_send(self, key: tuple[str, str, bool]) -> None:
        # the loop keeps only weak references to tasks: hold it until it ends
        task = asyncio.get_running_loop().create_task(self._send(key))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, key: tuple[str, str, bool]) -> None:
        batch = self._open.pop(key, None)
        if batch is None:
            return
        kind, coord, _ = key
        spec = self._kind(kind)
        channel = self._channels.get(coord)
        if channel is None:
            channel = self._channels[coord] = self._connect(coord)
        now = asyncio.get_running_loop().time()
        wait = 0.0
        if kind != "sync":
            wait = max(batch.deadline - now, 0.0)
        # never past the earliest member's own deadline (less the hop back): a slow
        # coordinator is then reported to the members as such, in time (B2)
        timeout = min(wait + BATCH_TIMEOUT, max(batch.answer_by - now, wait + MIN_BATCH_TIMEOUT))
        call = channel.unary_unary(
            f"/tierfs.peer.v1.Coordinator/{spec.method}",
            request_serializer=peer_wire.serialize,
            response_deserializer=_REPLIES[spec.method].FromString,
        )
        self.batches += 1
        self.members += len(batch.requests)
        if self.stats is not None:
            self.stats.add(spec.counters[0])
            self.stats.add(spec.counters[1], len(batch.requests))
        try:
            reply = await call(
                spec.request(batch.requests, int(wait * 1000), self.rank()),
                metadata=self.md,
                timeout=timeout,
            )
        except grpc.aio.AioRpcError as exc:
            self.failures += 1
            log.warning(
                "%s of %d to %s failed: %s", spec.method, len(batch.requests), coord, exc.code()
            )
            for w in batch.waiters:
                if not w.done():
                    w.set_exception(exc)
            return
        except BaseException as exc:
            for w in batch.waiters:
                if not w.done():
                    w.cancel()
            if isinstance(exc, Exception):
                log.exception("%s to %s failed", spec.method, coord)
                return
            raise
        replies = list(reply.replies)
        if len(replies) != len(batch.waiters):
            log.warning(
                "coordinator %s answered %d of %d members of a %s",
                coord,
                len(replies),
                len(batch.waiters),
                spec.method,
            )
        for i, w in enumerate(batch.waiters):
            if w.done():
                continue  # the member gave up (its deadline): the coordinator heard it anyway
            if i < len(replies):
                w.set_result(replies[i])
            else:
                w.cancel()

    async def close(self) -> None:
        """Close the channels to coordinators and nudged nodes (loop thread)."""
        channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            await ch.close()


def _aio_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=list(peer_wire.CHANNEL_OPTIONS))
