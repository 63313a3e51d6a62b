"""The ``tierfs.peer.v1.Coordinator`` gRPC service over a coordinator's state.

Event-driven, for jobs of thousands of nodes (#17):

* the handlers are ``async def`` and run on the asyncio loop of the node's
  ``grpc.aio`` server (:class:`tierfs.rpc.aio_server.AioServer`): a
  long-polling ``Decide``/``Barrier`` call is a suspended coroutine and holds
  no thread;
* a waiting call is evaluated once, then sleeps on an :class:`asyncio.Event`
  that is set only when :meth:`Coordinator.progress` changes (the round was
  decided or decided again, a barrier phase passed, a new round opened) or
  its own long poll ends: no call wakes the others, so an idle waiting
  round costs no CPU. :attr:`CoordinatorServicer.wakeups` counts the
  wake-ups (tests assert it);
* replies are O(1) or O(peers): a node that asks ``compact`` gets only the
  addresses it names (``want_peers``: its replica targets and the
  coordinator) plus counts, never the whole membership; lists of ranks are
  capped (:data:`tierfs.cluster.rounds.SHOWN_RANKS`) with exact counts.

The coordinator's state is guarded by one :class:`threading.Lock`, held only
for pure, short work: by the loop thread for each call, by the bucket
reader's thread to hand in its answer, and by :meth:`CoordinatorServicer.locked`
callers (the GCS tier's hooks in a trio worker thread). Progress made on
another thread wakes the loop's waiters through ``call_soon_threadsafe``.
The bucket reads a round waits for (:meth:`Coordinator.bucket_wanted`) run
in a thread of their own with the reader from
:meth:`CoordinatorServicer.set_bucket_reader`, never under the lock.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Collection, Coroutine, Iterable, Sequence
from typing import Any

import grpc
import grpc.aio

from tierfs.cluster.backup_schedule import Outcome
from tierfs.cluster.coordinator import Coordinator
from tierfs.cluster.restore_choice import BucketView, CopyId, Holding
from tierfs.cluster.rounds import (
    PASSED,
    PROTOCOL,
    REJOIN,
    REPLAN,
    WAITING,
    BarrierView,
    DecideView,
    Rejected,
)
from tierfs.core.status import CoordinatorStatus
from tierfs.rpc import peer_pb2

log = logging.getLogger(__name__)

#: ``step`` on the wire for "nothing to restore"
_NO_STEP = -1
#: longest a Decide/Barrier long-poll waits before it answers "waiting" (seconds)
MAX_WAIT = 30.0


class CoordinatorServicer:
    """The ``tierfs.peer.v1.Coordinator`` service (async handlers; see the module docstring).

    Every node with a gRPC server registers it, because with the bucket
    rendezvous any node may turn out to be node-rank 0 only when its job
    starts; ``gate`` says whether this node serves the coordinator right now.

    Args:
        coordinator: the state.
        gate: any thread; returns None while this node is the coordinator,
            else one line why not -- every call is then answered UNAVAILABLE
            with that line (a caller holding a stale address looks again).
            None: always serve.

    Attributes:
        waiting: long-polling calls asleep right now.
        wakeups: times a sleeping call was woken by progress (not by its own
            deadline); an idle round adds none.
        evaluations: times a Decide/Barrier call evaluated the state.
        sync_calls: ``Sync`` calls served; batch_calls: ``SyncBatch`` calls;
        batched_members: the heartbeats those batches carried;
        round_batch_calls: ``DecideBatch``/``BarrierBatch`` calls;
        round_batched_members: the members' calls those carried.
    """

    def __init__(
        self, coordinator: Coordinator, gate: Callable[[], str | None] | None = None
    ) -> None:
        self.coordinator = coordinator
        self.gate = gate
        self.lock = threading.Lock()
        self._snapshot: CoordinatorStatus = coordinator.status()
        self._reader: Callable[[str, int, int], BucketView] | None = None
        self._reading: tuple[int, str, int, int] | None = None
        self._progress = coordinator.progress()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        #: longest a long poll waits (seconds; the request's wait_ms is capped by it)
        self.max_wait = MAX_WAIT
        self.waiting = 0
        self.wakeups = 0
        self.evaluations = 0
        #: Sync calls, SyncBatch calls and the members those batches carried
        self.sync_calls = 0
        self.batch_calls = 0
        self.batched_members = 0
        #: DecideBatch/BarrierBatch calls and the members' calls they carried
        self.round_batch_calls = 0
        self.round_batched_members = 0
        #: rank -> (its last SyncRequest, serialized; that request's inventory as Holdings)
        self._inventories: dict[int, tuple[bytes, tuple[Holding, ...]]] = {}
        #: the coordinator's gone set and its ranks sorted (:meth:`_gone_sorted`)
        self._gone: tuple[frozenset[int], list[int]] | None = None
        #: the gone set, (generation, parts epoch) and its gone_tag (:meth:`_gone_tag`)
        self._gone_tags: tuple[frozenset[int], tuple[int, str], str] | None = None
        #: (round, step, state, dedup) -> its BackupRound message (:meth:`_backup_round`)
        self._rounds_pb: dict[tuple[str, int, str, bool], Any] = {}
        #: the fields of a reply every member gets alike -> serialized (:meth:`_common_reply`)
        self._commons: dict[tuple[Any, ...], bytes] = {}
        #: rank -> (the peers it asked for, the serialized SyncReply holding only those
        #: peers), while their rows do not change (:meth:`_peers`)
        self._peer_replies: dict[int, tuple[list[int], bytes]] = {}
        #: peer rank -> the ranks whose kept peers reply names it
        self._named_by: dict[int, set[int]] = {}
        #: the membership's version the kept replies are of
        self._rows_version = -1
        self._nudger: Callable[[str, str, int], Coroutine[Any, Any, bool]] | None = None
        self._nudging: set[asyncio.Task[bool]] = set()
        #: nudges sent (:meth:`tierfs.cluster.coordinator.Coordinator.nudges`)
        self.nudges = 0

    # ------------------------------------------------------------------ any thread

    def attach(self, server: grpc.aio.Server, loop: asyncio.AbstractEventLoop) -> None:
        """Register the service on ``server``, whose handlers run on ``loop`` (loop thread)."""
        from tierfs.rpc import peer_pb2_grpc

        self._loop = loop
        peer_pb2_grpc.add_CoordinatorServicer_to_server(self, server)  # type: ignore[arg-type]

    def set_nudger(self, nudger: Callable[[str, str, int], Coroutine[Any, Any, bool]]) -> None:
        """Install ``nudger(address, job, round)`` (a coroutine function run on the
        loop): asks a node the open restore round summons to heartbeat now (see
        :meth:`tierfs.cluster.coordinator.Coordinator.nudges`). Any thread, before
        the server starts."""
        self._nudger = nudger

    def set_bucket_reader(self, reader: Callable[[str, int, int], BucketView]) -> None:
        """Install the bucket reader: ``reader(job, nodes, depth)`` -> :class:`BucketView`
        (blocking, bounded by its own deadlines; an exception counts as an
        unreadable bucket). Any thread."""
        with self.lock:
            self._reader = reader
            self._after()

    def serving(self) -> bool:
        """True while this node answers coordinator calls (any thread)."""
        return self.gate is None or self.gate() is None

    def locked(self, fn: Callable[[Coordinator], Any]) -> Any:
        """Run ``fn(coordinator)`` under the lock and return its result (any thread but
        the loop's; the lock is held only for short, pure work, so this waits
        at most that long). Progress ``fn`` makes wakes the waiting calls."""
        with self.lock:
            try:
                return fn(self.coordinator)
            finally:
                self._after()

    def own_part_digests(self, job: str, steps: Collection[int]) -> dict[int, dict[int, str]]:
        """Step -> rank -> the digest of that rank's own part, from the members' last
        inventories (:class:`tierfs.core.ports.PartReports`; {} when the job served
        is another). Any thread but the loop's; O(members) per step."""
        with self.lock:
            c = self.coordinator
            if c.job != job:
                return {}
            return {s: {r: d for r, d in c.roster.holders(s).items() if d} for s in steps}

    def status(self) -> CoordinatorStatus:
        """The coordinator's status (any thread; never waits: while a call holds the
        lock, the status taken last time)."""
        if self.lock.acquire(blocking=False):
            try:
                self._snapshot = self.coordinator.status()
            finally:
                self.lock.release()
        return self._snapshot

    # ------------------------------------------------------------------ under the lock

    def _after(self) -> None:
        """After a change: start the bucket read the state waits for and, on progress,
        wake the waiting calls (under the lock, any thread)."""
        self._kick()
        progress = self.coordinator.progress()
        if progress == self._progress:
            return
        self._progress = progress
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if _on_loop(loop):
            self._wake()
        else:
            try:
                loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # the loop closed meanwhile: nobody waits
                pass

    def _kick(self) -> None:
        """Start the bucket read the coordinator waits for, if any."""
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
        with self.lock:
            if self._reading == want:
                self._reading = None
            self.coordinator.bucket_answered(number, view)
            self._after()

    # ------------------------------------------------------------------ loop thread

    def _wake(self) -> None:
        ev, self._changed = self._changed, None
        if ev is not None:
            ev.set()

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    async def _admit(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        if self.gate is None:
            return
        why = self.gate()
        if why is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"not the coordinator: {why}")

    async def _wait(self, request: Any, fn: Callable[[], Any]) -> Any:
        """``fn()`` (under the lock) until it is not ``waiting`` or the long poll ends;
        between evaluations the call sleeps until progress (see the module docstring):
        :meth:`_wait_batch` with one member."""
        return (await self._wait_batch(request.wait_ms, [fn]))[0]

    def _peer_list(self, ranks: Iterable[int] | None) -> list[peer_pb2.PeerAddress]:
        return [
            peer_pb2.PeerAddress(
                rank=p.rank, address=p.address, incarnation=p.incarnation, live=p.live
            )
            for p in self.coordinator.peers(ranks)
        ]

    async def Join(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await self._admit(context)
        c = self.coordinator
        refused = None
        with self.lock:
            try:
                number = c.join(
                    request.job,
                    request.nodes,
                    request.rank,
                    request.address,
                    request.incarnation,
                    _holdings(request.inventory),
                    request.restore_id,
                    request.mode or PROTOCOL,
                    backup_interval_minutes=request.backup_interval_minutes or None,
                    backup_interval_steps=request.backup_interval_steps or None,
                    notes=tuple(request.notes),
                )
            except Rejected as exc:
                refused = str(exc)
            else:
                reply = peer_pb2.JoinReply(
                    round=number,
                    peers=self._peer_list(request.want_peers if request.compact else None),
                    live_nodes=c.live_count(),
                    known_nodes=len(c.members),
                    gone=sorted(c.gone),
                )
                nudges = c.nudges() if self._nudger is not None else []
            finally:
                self._after()
        if refused is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refused)
        self._nudge(nudges, request.job, number)
        return reply

    def _nudge(self, targets: list[tuple[int, str]], job: str, number: int) -> None:
        """Start one nudge per target (loop thread); the call does not wait for them."""
        nudger = self._nudger
        if nudger is None:
            return
        for _rank, address in targets:
            task = asyncio.get_running_loop().create_task(nudger(address, job, number))
            # the loop keeps only weak references to tasks: hold each until it ends
            self._nudging.add(task)
            task.add_done_callback(self._nudging.discard)
            self.nudges += 1

    async def Decide(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await self._admit(context)
        view: DecideView = await self._wait(request, self._decider(request))
        return _decide_reply(view)

    async def Barrier(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await self._admit(context)
        view: BarrierView = await self._wait(request, self._barrier(request))
        return _barrier_reply(view)

    def _decider(self, request: Any) -> Callable[[], DecideView]:
        c = self.coordinator
        return lambda: c.decide(request.job, request.rank, request.restore_id)

    def _barrier(self, request: Any) -> Callable[[], BarrierView]:
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

        return call

    async def _wait_batch(self, wait_ms: int, fns: list[Callable[[], Any]]) -> list[Any]:
        """Every ``fns[i]()`` (under one lock hold per evaluation) until any view is not
        ``waiting`` or ``wait_ms`` (capped by :attr:`max_wait`) has passed; the
        views of the last evaluation. Between evaluations it sleeps until progress
        (see the module docstring)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(max(wait_ms, 0) / 1000.0, self.max_wait)
        while True:
            with self.lock:
                views = [fn() for fn in fns]
                self.evaluations += 1
                self._after()
                changed = self._event()
            remaining = deadline - loop.time()
            if remaining <= 0 or any(v.state != WAITING for v in views):
                return views
            self.waiting += 1
            try:
                await asyncio.wait_for(changed.wait(), remaining)
                self.wakeups += 1
            except TimeoutError:
                pass
            finally:
                self.waiting -= 1

    async def DecideBatch(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        """A group leader's members' Decide calls in one long poll (issue #17): each
        member's view is the one its own ``Decide`` would get at that moment;
        ``replies[i]`` answers ``members[i]``; the call returns when any member's
        state is not ``waiting`` or after ``wait_ms`` (milliseconds)."""
        await self._admit(context)
        self.round_batch_calls += 1
        self.round_batched_members += len(request.members)
        views = await self._wait_batch(request.wait_ms, [self._decider(m) for m in request.members])
        return peer_pb2.DecideBatchReply(replies=[_decide_reply(v) for v in views])

    async def BarrierBatch(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        """A group leader's members' Barrier calls in one long poll (see
        :meth:`DecideBatch`); each member's report is registered as its own
        ``Barrier`` call would register it."""
        await self._admit(context)
        self.round_batch_calls += 1
        self.round_batched_members += len(request.members)
        views = await self._wait_batch(request.wait_ms, [self._barrier(m) for m in request.members])
        return peer_pb2.BarrierBatchReply(replies=[_barrier_reply(v) for v in views])

    async def Sync(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await self._admit(context)
        self.sync_calls += 1
        with self.lock:
            try:
                return self._sync_reply(request)
            finally:
                self._after()

    async def SyncBatch(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        """The heartbeats of a group leader's members in one call (issue #17 item 2):
        each member's SyncRequest is handled exactly as its own ``Sync`` (the same
        fencing by job, incarnation, generation and gone ranks) and
        ``replies[i]`` answers ``members[i]``. One lock hold and one wake-up
        check for the whole batch; the per-call gRPC cost is paid once."""
        await self._admit(context)
        self.batch_calls += 1
        self.batched_members += len(request.members)
        out = peer_pb2.SyncBatchReply()
        add = out.replies.add
        with self.lock:
            try:
                c = self.coordinator
                counts = (c.live_count(), len(c.members))  # once per batch, not per member
                for m in request.members:
                    self._sync_reply(m, add(), counts)  # built in place: no copy per member
            finally:
                self._after()
        return out

    def _inventory(self, request: Any) -> tuple[Holding, ...]:
        """The inventory of SyncRequest ``request`` (HeldShard messages) as Holdings;
        the very tuple of the rank's last call when that call was the same request
        bytes (a heartbeat rarely changes, and converting its inventory is a third of
        a Sync's pure cost at 10,000 nodes; one serialization of the small request
        is cheaper than one of each HeldShard). Another request with the same
        inventory only converts it again."""
        key = request.SerializeToString()
        hit = self._inventories.get(request.rank)
        if hit is not None and hit[0] == key:
            return hit[1]
        held = _holdings(request.inventory)
        self._inventories[request.rank] = (key, held)
        return held

    def _gone_sorted(self, gone: frozenset[int]) -> list[int]:
        """``gone`` sorted, sorted once per set (the coordinator replaces the frozenset
        when it changes; sorting it per heartbeat cost O(G log G) per call, review B3)."""
        hit = self._gone
        if hit is None or hit[0] is not gone:
            hit = self._gone = (gone, sorted(gone))
        return hit[1]

    def _gone_tag(self, gone: frozenset[int], generation: int, epoch: str) -> str:
        """The ``gone_tag`` naming ``gone`` in SyncReplies: this coordinator's parts
        epoch (new at every start and job), the generation and the number of gone
        ranks (a generation's gone set only grows; a new generation starts another).
        Built once per set."""
        hit = self._gone_tags
        if hit is None or hit[0] is not gone or hit[1] != (generation, epoch):
            hit = self._gone_tags = (gone, (generation, epoch), f"{epoch}:{generation}:{len(gone)}")
        return hit[2]

    def _sync_reply(
        self, request: Any, reply: Any = None, counts: tuple[int, int] | None = None
    ) -> Any:
        """The SyncReply to one SyncRequest, filled into ``reply`` (an empty SyncReply;
        None: a new one) and returned (under the lock). ``counts``: (live, known)
        members, counted once for a batch (None: counted here)."""
        backup = None
        if request.HasField("backup") and request.backup.round:
            b = request.backup
            backup = Outcome(b.round, b.step, b.state, b.error, b.bytes, b.seconds, b.digest)
        c = self.coordinator
        view = c.sync(
            request.job,
            request.rank,
            request.incarnation,
            request.step,
            self._inventory(request),
            backup,
            request.data_parallelism,
            compact=request.compact,
        )
        if reply is None:
            reply = peer_pb2.SyncReply()
        live, known = counts if counts is not None else (c.live_count(), len(c.members))
        # the fields every member of a round gets alike, merged from one serialized
        # reply (one call instead of a setattr each: half of a reply's cost)
        common = self._common_reply(
            (
                view.known,
                view.synced_step,
                view.synced_at,
                view.restore_round,
                view.summoned,
                live,
                known,
                view.reported,
                view.backup_last,
            )
        )
        if request.compact:
            # one merge of the common fields and the node's peers, both serialized
            reply.MergeFromString(common + self._peers(request.rank, request.want_peers))
        else:
            reply.MergeFromString(common)
            add = reply.peers.add
            for p in c.peers():
                add(rank=p.rank, address=p.address, incarnation=p.incarnation, live=p.live)
        if view.steps:
            reply.steps.extend(view.steps)
        if c.gone:
            tag = self._gone_tag(c.gone, c.generation, c.roster.parts.epoch)
            reply.gone_tag = tag
            if request.gone_tag == tag:
                reply.gone_same = True  # the node has them: O(1), not O(gone) (review B3)
            else:
                reply.gone.extend(self._gone_sorted(c.gone))
        if view.known and request.view_steps:
            # what changed in the steps the node's whole-step view shows
            parts = c.roster.parts
            asked = [(v.step, v.version) for v in request.view_steps]
            reply.part_changes.extend(
                peer_pb2.PartDigest(step=p.step, rank=p.rank, digest=p.digest)
                for p in parts.changes(request.parts_epoch, asked)
            )
            reply.parts_version, reply.parts_epoch = parts.version, parts.epoch
        if view.known:
            # the step directories the other nodes are saving (a node's lookup of DCP's
            # .metadata waits while the save that writes it goes on, #14 F2)
            now = c.clock()
            savers = c.roster.savers
            savers.report(request.rank, request.saving, now)
            reply.saving.extend(savers.others(request.rank, now))
            reply.saving_known = True
        if view.backup_order is not None:
            order = view.backup_order
            reply.backup_order.CopyFrom(
                self._backup_round(order[0], order[1], "running", view.backup_dedup)
            )
        return reply

    def _peers(self, rank: int, want: Sequence[int]) -> bytes:
        """The serialized SyncReply holding only the peers ``want`` of a compact
        heartbeat of ``rank`` (rank, address, incarnation, live; see
        :meth:`tierfs.cluster.membership.Membership.peer_rows`): the bytes of its last
        heartbeat while the same peers are asked for and none of their rows changed
        (:meth:`~tierfs.cluster.membership.Membership.take_changed_rows`: a peer's
        daemon restarted or moved, went silent or was heard again), else built
        again. A node asks for the same few peers every second; building their rows
        was a quarter of a heartbeat reply's cost at 10,000 nodes (issue #17). Only
        rows that are all live are kept (a silent peer heard again before the next
        count would otherwise stay "not live"); a kept reply is dropped when a peer it
        asked for joins, also one it did not name yet."""
        roster = self.coordinator.roster
        changed = roster.take_changed_rows()
        kept = self._peer_replies
        if roster.version != self._rows_version:
            kept.clear()
            self._named_by.clear()
            self._rows_version = roster.version
        elif changed:
            named_by = self._named_by
            for peer in changed:
                for r in named_by.pop(peer, ()):
                    kept.pop(r, None)
        hit = kept.get(rank)
        if hit is not None and hit[0] == want:
            return hit[1]
        rows = roster.peer_rows(want)
        data = peer_pb2.SyncReply(
            peers=[
                peer_pb2.PeerAddress(rank=r, address=a, incarnation=i, live=live)
                for r, a, i, live in rows
            ]
        ).SerializeToString()
        if all(row[3] for row in rows):
            kept[rank] = (list(want), data)
            for peer in want:  # a rank not known yet too: its join changes the reply
                self._named_by.setdefault(peer, set()).add(rank)
        return data

    def _common_reply(self, key: tuple[Any, ...]) -> bytes:
        """The serialized SyncReply holding only the fields of ``key``: (known, synced
        step, synced at, restore round, summoned, live nodes, known nodes, reported,
        backup_last RoundView or None); built once per distinct key (a handful per
        heartbeat round)."""
        data = self._commons.get(key)
        if data is None:
            known, synced, at, number, summoned, live, members, reported, last = key
            msg = peer_pb2.SyncReply(
                known=known,
                synced_step=synced,
                synced_at=at,
                restore_round=number,
                summoned=summoned,
                live_nodes=live,
                known_nodes=members,
                reported=reported,
            )
            if last is not None:
                msg.backup_last.CopyFrom(self._backup_round(last.round, last.step, last.state))
            if len(self._commons) >= 64:
                self._commons.clear()
            data = self._commons[key] = msg.SerializeToString()
        return data

    def _backup_round(self, name: str, step: int, state: str, dedup: bool = False) -> Any:
        """The BackupRound message of these fields, built once (every member's reply
        carries the same one or two while a backup round runs: building them per
        member was a third of a heartbeat round's handler time at 10,000 nodes)."""
        key = (name, step, state, dedup)
        msg = self._rounds_pb.get(key)
        if msg is None:
            if len(self._rounds_pb) >= 64:
                self._rounds_pb.clear()
            msg = self._rounds_pb[key] = peer_pb2.BackupRound(
                round=name, step=step, state=state, dedup=dedup
            )
        return msg

    async def Gone(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        """Declare node ranks gone for good (``tierfs nodes gone``; see
        :meth:`Coordinator.declare_gone`); FAILED_PRECONDITION with the reason.
        The reply's ``live`` names the newly declared ranks that were still
        heartbeating (within ``live_seconds``)."""
        await self._admit(context)
        c = self.coordinator
        refused = None
        with self.lock:
            # before the declaration: a rank still heartbeating is probably running
            live = sorted({r for r in request.ranks if r not in c.gone and c.live(r)})
            try:
                gone = c.declare_gone(request.job, tuple(request.ranks), request.reason)
            except Rejected as exc:
                refused = str(exc)
            finally:
                self._after()
        if refused is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refused)
        return peer_pb2.GoneReply(
            gone=list(gone), nodes=c.nodes, generation=c.generation, live=live
        )


def _decide_reply(view: DecideView) -> Any:
    pb = peer_pb2.DecideReply
    state = {WAITING: pb.WAITING, "decided": pb.DECIDED, REJOIN: pb.REJOIN}[view.state]
    return pb(
        state=state,
        round=view.round,
        version=view.version,
        step=_NO_STEP if view.step is None else view.step,
        missing=list(view.missing),
        missing_count=view.missing_count,
        writers=view.writers,
        local=view.local,
        digest=view.digest,
        sources=[peer_pb2.Source(holder=h, address=a) for h, a in view.sources],
        reason=view.reason,
        backup=view.backup or "",
        restore_version=view.forced or "",
        backups=list(view.backups),
        outcome=view.outcome,
        problems=list(view.problems),
        waiting_for=view.waiting_for,
    )


def _barrier_reply(view: BarrierView) -> Any:
    pb = peer_pb2.BarrierReply
    state = {WAITING: pb.WAITING, PASSED: pb.PASSED, REPLAN: pb.REPLAN, REJOIN: pb.REJOIN}[
        view.state
    ]
    return pb(state=state, waiting_for=list(view.waiting_for), waiting_count=view.waiting_count)


def _holdings(items: Iterable[Any]) -> tuple[Holding, ...]:
    return tuple(
        Holding(
            h.rank,
            h.step,
            h.verified,
            h.digest,
            h.bytes,
            h.name,
            h.backup_requested,
            h.created,
            h.unloadable,
            h.missing,
            tuple(h.whole_digests),
            h.whole_unloadable,
            h.nodes,
            tuple((p.rank, p.digest) for p in h.replaces),
        )
        for h in items
    )


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
