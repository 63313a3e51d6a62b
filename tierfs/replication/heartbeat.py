"""The heartbeat of the peer plane: the ``Sync`` round with the coordinator (trio thread).

DESIGN.md "Peer plane", PROTOCOL.md section 6. Every :data:`HEARTBEAT` seconds
(or at once when poked) :class:`Heartbeat` tells the coordinator this node's
address, inventory and newest replicated step, and brings back the peers'
addresses (the :class:`tierfs.replication.addresses.AddressBook`), the
cluster's synced step (the :class:`tierfs.replication.plane.PlaneState`), the
restore round it has open (retention pauses meanwhile) and a summons into a
restore round. A coordinator that does not know this node (it restarted)
gets a Join. The heartbeat also carries backup rounds between the
coordinator and the node's backup plane (a :class:`tierfs.core.ports.BackupOrders`):
the outcome of the node's last round up, the round it is ordered into down.
It also carries the steps of the node's whole-step view up and the own parts
reported changed in them down (:class:`tierfs.core.ports.PartWatch`): a rank
that saved a step again is noticed by every node within about two heartbeats.
Every :data:`CATCH_UP` seconds the replicator sends what a live peer lacks.

In a job of more than :data:`tierfs.replication.groups.GROUP_SIZE` nodes the
Sync goes through the node's group leader (ARCHITECTURE.md "Heartbeat
groups", :mod:`tierfs.replication.groups`, :mod:`tierfs.replication.relay`),
which sends its group's heartbeats in one call; a leader that does not answer
within :data:`tierfs.replication.groups.RELAY_TIMEOUT` seconds is skipped for
:data:`tierfs.replication.groups.LEADER_BACKOFF` seconds and the Sync goes
directly to the coordinator in the same beat. Heartbeats start every
:data:`HEARTBEAT` seconds (fixed rate: the wait for a leader's batch does not
stretch the period).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpc
import trio

from tierfs.core.control import JobSpec
from tierfs.core.ports import BackupOrders, CurrentJob, PartWatch, Summons
from tierfs.core.types import FAILED, Outcome, RoundView
from tierfs.replication.addresses import AddressBook, Endpoint
from tierfs.replication.client import PeerClient, rpc_code, rpc_reason, sync_request
from tierfs.replication.holdings import Holdings
from tierfs.replication.lanes import Lane
from tierfs.replication.plane import PlaneState
from tierfs.replication.rendezvous import CoordinatorFinder
from tierfs.replication.replicator import Replicator
from tierfs.replication.route import CoordinatorBusy, SyncRoute

log = logging.getLogger(__name__)

#: seconds between heartbeats (``Sync``) to the coordinator
HEARTBEAT = 1.0
#: seconds between checks that every retained step reached every live peer
CATCH_UP = 10.0


class Heartbeat:
    """This node's side of the sync round (see the module docstring).

    Args:
        me: this node's endpoint (address and incarnation in every report).
        job: the current job (read only; ``mode`` for a Join).
        plane: where the last sync round and the reported steps are kept.
        finder: finds the coordinator.
        book: takes the peers' addresses.
        replicator: the newest replicated step; catches peers up.
        holdings: the inventory reported.
        client: Sync and Join calls.
        lane: the control lane (never behind a transfer).
        summons: where a summons into a restore round goes.
        backup: the node's backup plane, or None (an order is then answered
            "failed": the node has no bucket).
        active_job: the current job if it spans several nodes, else None.

    Attributes:
        restore_round: the restore round the coordinator has open (0: none or
            unknown), from the last Sync.
        last_error: the last problem with the coordinator, or None.
        wake: set to send a heartbeat now (replaced after each one).
        parts_watch: the whole-step view told of changed parts, or None (set after
            construction: the view is built after the peer tier).
        route: where the Sync goes (the group leader or the coordinator; its
            ``group_size`` and ``relay_timeout`` may be changed before :meth:`run`).
    """

    def __init__(
        self,
        me: Endpoint,
        *,
        job: CurrentJob,
        plane: PlaneState,
        finder: CoordinatorFinder,
        book: AddressBook,
        replicator: Replicator,
        holdings: Holdings,
        client: PeerClient,
        lane: Lane,
        summons: Summons,
        backup: BackupOrders | None,
        active_job: Callable[[], JobSpec | None],
    ) -> None:
        self.me = me
        self.current = job
        self.plane = plane
        self.finder = finder
        self.book = book
        self.replicator = replicator
        self.holdings = holdings
        self.client = client
        self.lane = lane
        self.summons = summons
        self.backup = backup
        self.active_job = active_job
        self.restore_round = 0
        self.last_error: str | None = None
        self.wake = trio.Event()
        self.parts_watch: PartWatch | None = None
        self._coord_ok: bool | None = None
        self._reported_ok: int | None = None
        self._no_bucket: Outcome | None = None
        self.route = SyncRoute(client)

    def poke(self) -> None:
        """Send a heartbeat now (e.g. a backup outcome to report)."""
        self.wake.set()

    def coordinator_lost(self) -> None:
        """A coordinator call failed: look it up again (bucket rendezvous), and its node
        no longer counts as live."""
        self.finder.lost()
        self.book.coordinator_down()

    async def run(self) -> None:
        """Heartbeat until cancelled; errors are kept in :attr:`last_error` and logged."""
        last_catch_up = trio.current_time()
        while True:
            started = trio.current_time()
            if trio.current_time() - last_catch_up >= CATCH_UP:
                last_catch_up = trio.current_time()
                try:
                    self.replicator.catch_up()
                except Exception:
                    log.exception("catch-up of replicas failed")
            job = self.active_job()
            if job is not None:
                coord = None
                try:
                    coord = await self.finder.find(job)
                    if coord is None:
                        self.last_error = (
                            f"coordinator not found yet: {self.finder.rendezvous_note}"
                        )
                    else:
                        await self.sync_once(job, coord)
                        if self._coord_ok is False:
                            log.info("coordinator %s reachable again", coord)
                        self._coord_ok = True
                except CoordinatorBusy as exc:
                    # the coordinator is slow, not gone: no lookup, no direct Sync now
                    self.last_error = f"coordinator {coord} busy: {exc}"
                except grpc.RpcError as exc:
                    self.restore_round = 0  # unknown now: retention must not stay paused
                    self.last_error = f"coordinator {coord}: {rpc_reason(exc)}"
                    if self._coord_ok is not False:
                        log.warning("%s", self.last_error)
                    self._coord_ok = False
                    self.coordinator_lost()
                except Exception:
                    log.exception("heartbeat failed")
            with trio.move_on_at(started + HEARTBEAT):
                await self.wake.wait()
            self.wake = trio.Event()

    def join_fields(self, job: JobSpec) -> dict[str, Any]:
        """The JoinRequest fields describing this node in ``job``."""
        return dict(
            job=job.name,
            nodes=job.nodes,
            rank=job.node_rank,
            address=self.me.address,
            incarnation=self.me.incarnation,
            backup_interval_minutes=job.backup_interval_minutes or 0.0,
            backup_interval_steps=job.backup_interval_steps or 0,
            inventory=self.holdings.holdings(job.name),
            want_peers=self.wanted(job),
            compact=True,
        )

    def wanted(self, job: JobSpec) -> list[int]:
        """The ranks whose addresses this node asks for: the address book's and the
        candidate leaders of its heartbeat group."""
        lead = self.route.wanted(job.node_rank, job.nodes)
        return sorted(set(self.book.wanted(job)) | set(lead))

    def leader(self, job: JobSpec) -> tuple[int, str] | None:
        """(node rank, address) of the group leader this node's heartbeats and restore
        round calls go through now, or None: directly (trio thread)."""
        return self.route.leader_of(
            job.node_rank, job.nodes, self.me.address, self.book.peers, self.book.gone
        )

    def backup_outcome(self) -> Outcome | None:
        """The outcome of the node's last backup round (reported in the next Sync)."""
        backup = self.backup
        return backup.backup_outcome() if backup is not None else self._no_bucket

    async def sync_once(self, job: JobSpec, coord: str) -> None:
        """One Sync with the coordinator at ``coord`` (a Join if it does not know us).

        Raises:
            grpc.RpcError: the coordinator did not answer.
        """
        inventory = self.holdings.holdings(job.name)
        step = self.replicator.replicated_step(job)
        watch = self.parts_watch
        epoch, watched = watch.watched() if watch is not None else ("", [])
        self.plane.reported = tuple(
            sorted({s for s in (self._reported_ok, step) if s is not None and s >= 0})
        )
        request = sync_request(
            job.name,
            job.node_rank,
            self.me.incarnation,
            step,
            inventory,
            self.backup_outcome(),
            job.assume_data_parallelism,
            self.wanted(job),
            watched,
            epoch,
            self.book.gone_tag,
            watch.saving() if watch is not None else (),
        )
        async with self.lane.limiter:
            via = self.leader(job)
            reply = await trio.to_thread.run_sync(self.route.sync, coord, request, via)
            self._reported_ok = step
            self.plane.reported = (step,) if step >= 0 else ()
            if not reply.known:
                self.restore_round = 0
                fields = self.join_fields(job)
                try:
                    joined = await trio.to_thread.run_sync(
                        lambda: self.client.join(
                            coord, restore_id="", mode=self.current.mode, **fields
                        )
                    )
                except grpc.RpcError as exc:
                    if rpc_code(exc) == grpc.StatusCode.FAILED_PRECONDITION:
                        self.last_error = f"coordinator refused this node: {rpc_reason(exc)}"
                        return
                    raise
                self.book.update(joined.peers, joined)
                return
        self.book.update(reply.peers, reply)
        self.last_error = None
        self.plane.sync = {
            "step": reply.synced_step if reply.synced_step >= 0 else None,
            "at": reply.synced_at or None,
            "steps": list(reply.steps),  # empty from a coordinator answering compact
            "reported": int(reply.reported),
        }
        self.restore_round = int(reply.restore_round)
        if reply.summoned:
            self.summons.summoned(job)
        if watch is not None and watched and reply.parts_epoch:
            # (a coordinator from before the whole-step view's watch answers "")
            watch.parts_reported(
                reply.parts_epoch,
                int(reply.parts_version),
                [s for s, _ in watched],
                [(int(c.step), int(c.rank), c.digest) for c in reply.part_changes],
            )
        if watch is not None and reply.saving_known:
            watch.others_saving(list(reply.saving))
        self._backup_round(job, reply)

    def _backup_round(self, job: JobSpec, reply: Any) -> None:
        """Hand the coordinator's backup round order to the node's backup plane."""
        order = last = None
        dedup = False
        if reply.HasField("backup_order") and reply.backup_order.round:
            order = (reply.backup_order.round, int(reply.backup_order.step))
            dedup = bool(reply.backup_order.dedup)
        if reply.HasField("backup_last") and reply.backup_last.round:
            b = reply.backup_last
            last = RoundView(b.round, int(b.step), b.state)
        if self.backup is not None:
            self.backup.on_backup_round(job, order, last, dedup)
        elif order is not None:
            self._no_bucket = Outcome(
                order[0], order[1], FAILED, f"node-rank {job.node_rank} has no --bucket"
            )
