"""A group leader's side of the heartbeat tree: members' Syncs in one batch (asyncio loop).

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

from tierfs.replication.groups import RELAY_WINDOW, UPSTREAM
from tierfs.rpc import peer_pb2
from tierfs.rpc import wire as peer_wire
from tierfs.rpc.wire import WireStats

log = logging.getLogger(__name__)

#: seconds the leader's SyncBatch call may take
BATCH_TIMEOUT = 10.0
#: seconds a coordinator's Nudge call may take (a node that does not answer learns
#: of the round in its next heartbeat anyway)
NUDGE_TIMEOUT = 2.0


@dataclass
class _Batch:
    requests: list[Any] = field(default_factory=list)
    waiters: list[asyncio.Future[Any]] = field(default_factory=list)


class SyncRelay:
    """The ``tierfs.peer.v1.SyncRelay`` service (async handlers; see the module docstring).

    Args:
        token: the peer token sent with the SyncBatch call (the job's shared one).
        rank: returns this node's node rank (-1: unknown), sent as the batch's leader.
        window: seconds a batch collects members before it is sent.
        connect: ``connect(address)`` -> a ``grpc.aio.Channel`` (None: insecure,
            with the peer plane's channel options); called on the loop.
        stats: the node's wire counters (``heartbeat_batches_sent``,
            ``heartbeats_batched``), or None.
        on_nudge: ``on_nudge(job)``: a coordinator asks this node to heartbeat now
            (the loop thread; must not block); None: nudges are ignored.

    Attributes:
        batches: SyncBatch calls sent; members: the heartbeats they carried;
        failures: SyncBatch calls that failed.
    """

    def __init__(
        self,
        token: str | None,
        *,
        rank: Callable[[], int] = lambda: -1,
        window: float = RELAY_WINDOW,
        connect: Callable[[str], grpc.aio.Channel] | None = None,
        stats: WireStats | None = None,
        on_nudge: Callable[[str], None] | None = None,
    ) -> None:
        self.stats = stats
        self.on_nudge = on_nudge
        self.md = peer_wire.metadata(token)
        self.rank = rank
        self.window = window
        self._connect = connect or _aio_channel
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._open: dict[str, _Batch] = {}
        self._sending: set[asyncio.Task[None]] = set()
        self.batches = 0
        self.members = 0
        self.failures = 0

    def attach(self, server: grpc.aio.Server, loop: asyncio.AbstractEventLoop) -> None:
        """Register the service on ``server`` (loop thread, before it starts)."""
        from tierfs.rpc import peer_pb2_grpc

        peer_pb2_grpc.add_SyncRelayServicer_to_server(self, server)  # type: ignore[arg-type]

    async def Relay(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        """Wait for the batch holding ``request.sync`` and answer its member's reply;
        UNAVAILABLE (with the coordinator's error) when the batch call failed."""
        coord = request.coordinator
        if not coord:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no coordinator address")
        loop = asyncio.get_running_loop()
        batch = self._open.get(coord)
        if batch is None:
            batch = self._open[coord] = _Batch()
            loop.call_later(self.window, self._start_send, coord)
        waiter: asyncio.Future[Any] = loop.create_future()
        batch.requests.append(request.sync)
        batch.waiters.append(waiter)
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

    def _start_send(self, coord: str) -> None:
        # the loop keeps only weak references to tasks: hold it until it ends
        task = asyncio.get_running_loop().create_task(self._send(coord))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, coord: str) -> None:
        batch = self._open.pop(coord, None)
        if batch is None:
            return
        channel = self._channels.get(coord)
        if channel is None:
            channel = self._channels[coord] = self._connect(coord)
        from tierfs.rpc import peer_pb2_grpc

        stub = peer_pb2_grpc.CoordinatorStub(channel)
        self.batches += 1
        self.members += len(batch.requests)
        if self.stats is not None:
            self.stats.add("heartbeat_batches_sent")
            self.stats.add("heartbeats_batched", len(batch.requests))
        try:
            reply = await stub.SyncBatch(
                peer_pb2.SyncBatchRequest(members=batch.requests, leader=self.rank()),
                metadata=self.md,
                timeout=BATCH_TIMEOUT,
            )
        except grpc.aio.AioRpcError as exc:
            self.failures += 1
            log.warning(
                "heartbeat batch of %d to %s failed: %s", len(batch.requests), coord, exc.code()
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
                log.exception("heartbeat batch to %s failed", coord)
                return
            raise
        replies = list(reply.replies)
        if len(replies) != len(batch.waiters):
            log.warning(
                "coordinator %s answered %d of %d heartbeats",
                coord,
                len(replies),
                len(batch.waiters),
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
