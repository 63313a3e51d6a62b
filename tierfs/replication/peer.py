"""The peer tier: replicate sealed steps to peer nodes and keep the coordinator informed.

DESIGN.md "Peer plane", PROTOCOL.md sections 2, 4 and 6. One gRPC server per
node daemon (``--listen``) serves ``tierfs.peer.v1.Peer`` (Inventory,
PushShard, PullShard) and ``tierfs.peer.v1.Coordinator``
(:mod:`tierfs.cluster.servicer`), the latter answered only while this node is the
coordinator: the node at ``--coordinator``, or without it node-rank 0 of the
running job (:meth:`tierfs.replication.plane.PlaneState.coordinator_gate`).

:class:`PeerTier` is the agent's tier and the facade the restore rounds
(:mod:`tierfs.node.agreement`, :mod:`tierfs.node.sources`) use; it builds the plane's parts, one
module each, and wires them with narrow constructor arguments:

* :mod:`tierfs.replication.addresses`: this node's :class:`~.addresses.Endpoint`
  and the :class:`~.addresses.AddressBook` of its peers;
* :mod:`tierfs.replication.rendezvous`: :class:`~.rendezvous.CoordinatorFinder`
  (static ``--coordinator`` or the bucket records, probed before use);
* :mod:`tierfs.replication.holdings`: :class:`~.holdings.Holdings`, the
  inventory, adopted replicas and pins, and the servicer's
  :class:`~tierfs.replication.service.PeerHost`;
* :mod:`tierfs.replication.replicator`: :class:`~.replicator.Replicator`,
  the send side (after each seal, to the peers of
  :func:`tierfs.replication.placement.peer_ranks`);
* :mod:`tierfs.replication.heartbeat`: :class:`~.heartbeat.Heartbeat`, the
  ``Sync`` round (address book, synced step, restore rounds, summons, backup
  round orders for the node's :class:`tierfs.core.ports.BackupOrders`);
* :mod:`tierfs.replication.service` (gRPC threads: inventories, receiving
  pushed replicas, serving pulls), :mod:`tierfs.replication.client` (the
  blocking calls), :mod:`tierfs.replication.transfer` (chunks, checked
  receiving), :mod:`tierfs.replication.lanes` (worker-thread limiters).

The transport is a constructor argument: the daemon passes a
:class:`~tierfs.replication.client.PeerClient` over gRPC channels and the
:class:`tierfs.rpc.aio_server.AioServer`; unit tests pass the in-process
network of ``tests/support/fake_peers.py``.

Threads: nothing here blocks the trio thread. gRPC handlers run in the
server's pool; client calls and file work run in ``trio.to_thread`` with
limiters (:attr:`PeerTier.transfer_limiter` for data, a separate one for
control calls so heartbeats are never queued behind a large transfer, and a
third for the whole-step view's file fetches, readers before the prefetch).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, overload

import grpc
import trio

from tierfs.core.config import NodeConfig
from tierfs.core.ports import (
    PART_SAVING,
    BackupOrders,
    Catalog,
    CurrentJob,
    FileTarget,
    PartWatch,
    PositionalWrite,
    RamBudget,
    Rendezvous,
    Reporter,
    Summons,
)
from tierfs.core.status import PeerMemberStatus, PeerStatus, PeerStepStatus, SyncStatus
from tierfs.replication.addresses import AddressBook, Endpoint, replica_peers
from tierfs.replication.client import PeerClient, rpc_code, rpc_reason
from tierfs.replication.files import PeerFiles, holders_of
from tierfs.replication.heartbeat import Heartbeat
from tierfs.replication.holdings import Holdings, retention_pins
from tierfs.replication.lane import LaneServer, lane_host
from tierfs.replication.lanes import (
    CONTROL_CALLS,
    FILE_FETCHES,
    TRANSFERS,
    Lane,
    PriorityLane,
)
from tierfs.replication.plane import PlaneState
from tierfs.replication.relay import SyncRelay
from tierfs.replication.rendezvous import CoordinatorFinder
from tierfs.replication.replicator import Replicator
from tierfs.replication.replicator import delivered as _done
from tierfs.replication.service import RESAVING, PeerServicer, peer_handlers
from tierfs.replication.transfer import BadCopy, Refused
from tierfs.rpc import wire as peer_wire
from tierfs.rpc.aio_server import AioServer, with_sync_context
from tierfs.store.manifest import Manifest
from tierfs.store.ramstore import RamStore
from tierfs.store.shards import Shard, ShardKey, ShardStore

if TYPE_CHECKING:
    from tierfs.core.control import JobSpec

log = logging.getLogger(__name__)

T = TypeVar("T")


class RpcServer(Protocol):
    """The gRPC server the tier starts (:class:`tierfs.rpc.aio_server.AioServer`)."""

    def start(self, address: str) -> int:
        """Bind ``address`` and serve; returns the port."""
        ...

    def stop(self, grace: float | None = 0) -> None:
        """Stop serving."""
        ...


class ServerFactory(Protocol):
    """Builds the server: ``setup(server, loop)`` adds the handlers before it starts."""

    def __call__(
        self,
        setup: Callable[[Any, asyncio.AbstractEventLoop], None],
        *,
        interceptors: Sequence[Any] = (),
        options: Sequence[tuple[str, Any]] = (),
        name: str = ...,
    ) -> RpcServer: ...


class _Via(Generic[T]):
    """A facade attribute that is a part's: reads and writes ``self.<part>.<name>``."""

    def __init__(self, part: str) -> None:
        self.part = part
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> _Via[T]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> T: ...
    def __get__(self, obj: object | None, owner: type) -> T | _Via[T]:
        if obj is None:
            return self
        return getattr(getattr(obj, self.part), self.name)  # type: ignore[no-any-return]

    def __set__(self, obj: object, value: T) -> None:
        setattr(getattr(obj, self.part), self.name, value)


# ---------------------------------------------------------------------- tier


class PeerTier:
    """The peer tier of one node (see the module docstring).

    Args:
        config: the node configuration: ``listen``, ``advertise``,
            ``coordinator``, ``peer_token``, ``join_timeout``, ``keep_local`` and
            ``heartbeat_group``.
        store: the RAM store (pulled shards arrive in its ``incoming``).
        shards: the store of committed shards.
        catalog: the held shards; the tier registers its sealed and withdrawn
            listeners there.
        job: the current job (read only).
        reporter: ``replicator.errors``.
        budget: the RAM budget (a pushed replica must fit).
        summons: where the coordinator's summons into a restore round go.
        plane: the peer plane's shared state (sync round, coordinator gate).
        client: the calls to peers and the coordinator (its ``stats`` are the
            tier's wire counters): a :class:`PeerClient` over gRPC channels,
            or over an in-process transport in tests.
        coordinator: this node's coordinator service, registered on the gRPC
            server (None: no ``--listen``).
        rendezvous: the bucket rendezvous (a bucket and no ``--coordinator``),
            else None.
        backup: the node's backup plane when it takes part in backup rounds,
            else None (an order is then answered "failed").
        server: builds the gRPC server started with ``--listen``
            (:class:`AioServer`).

    Attributes:
        coordinator_address: where this node last found the coordinator
            (the static address, its own, or the bucket's), or None.
        holdings, book, finder, replicator, heartbeat: the parts.
    """

    name = "peer"
    #: its fetch_file checks the bytes against ``expect`` as they are written (FileSource)
    checks_written = True
    #: a copy's bytes go through fetch_file's ``write`` when given (FileSource)
    chunk_writes = True

    address = _Via[str]("me")
    coordinator_address = _Via[str | None]("finder")
    rendezvous_note = _Via[str | None]("finder")
    publish_note = _Via[str | None]("finder")
    node_counts = _Via[tuple[int, int] | None]("book")
    last_error = _Via[str | None]("heartbeat")
    #: the restore round the coordinator has open (0: none), from the last Sync
    restore_round = _Via[int]("heartbeat")
    #: the last sync round (the plane's): ``step``, ``at``, ``steps``
    sync = _Via[dict[str, Any]]("plane")
    #: own steps reported as replicated in the Sync in flight and in the last one
    #: answered: the coordinator may order a backup round of either (the GCS tier
    #: pins them against retention)
    reported = _Via[tuple[int, ...]]("plane")

    def __init__(
        self,
        config: NodeConfig,
        *,
        store: RamStore,
        shards: ShardStore,
        catalog: Catalog,
        job: CurrentJob,
        reporter: Reporter,
        budget: RamBudget,
        summons: Summons,
        plane: PlaneState,
        client: PeerClient,
        coordinator: Any = None,
        rendezvous: Rendezvous | None = None,
        backup: BackupOrders | None = None,
        server: ServerFactory = AioServer,
        lane: Callable[[str, int], LaneServer] | None = None,
    ) -> None:
        c = config
        self.ram = store
        self.shards = shards
        self.catalog = catalog
        self.current = job
        self.reporter = reporter
        self.budget = budget
        self.summons = summons
        self.plane = plane
        self.keep_local = c.keep_local
        self.client = client
        self.stats = client.stats
        self.me = Endpoint(c.listen, c.advertise or c.listen or "")
        self.incarnation = self.me.incarnation
        self.listen = c.listen
        self.data_port = c.data_port
        self._lane_factory = lane
        #: the data lane serving pulls (started with the server; None: off)
        self.lane: LaneServer | None = None
        self.static_coordinator = c.coordinator
        self.token = c.peer_token
        self.join_timeout = float(c.join_timeout)
        self.rendezvous = rendezvous
        self.backup = backup
        self.coordinator = coordinator
        self.port: int | None = None
        self._server_factory = server
        self._server: RpcServer | None = None
        transfers, self.control = Lane(TRANSFERS), Lane(CONTROL_CALLS)
        self.transfer_limiter = transfers.limiter
        self.holdings = Holdings(
            store=store,
            shards=shards,
            catalog=catalog,
            job=job,
            budget=budget,
            stats=self.stats,
            me=self.me,
            keep_local=c.keep_local,
        )
        self.book = AddressBook(self.me)
        self.files = PeerFiles(
            self.book, self._address_of, client, PriorityLane(FILE_FETCHES), job, reporter
        )
        self.finder = CoordinatorFinder(
            self.me,
            static=c.coordinator,
            rendezvous=rendezvous,
            reporter=reporter,
            client=client,
            call=self.control.call,
            active_job=plane.active_job,
        )
        self.replicator = Replicator(
            catalog=catalog,
            job=job,
            reporter=reporter,
            client=client,
            book=self.book,
            holdings=self.holdings,
            lane=transfers,
            active_job=plane.active_job,
            wake=self.poke,
        )
        self.heartbeat = Heartbeat(
            self.me,
            job=job,
            plane=plane,
            finder=self.finder,
            book=self.book,
            replicator=self.replicator,
            holdings=self.holdings,
            client=client,
            lane=self.control,
            summons=summons,
            backup=backup,
            active_job=plane.active_job,
        )
        self.heartbeat.route.group_size = c.heartbeat_group
        #: the group leader's side of the heartbeat tree (served by every node)
        self.relay = SyncRelay(
            self.token, rank=self._own_rank, stats=self.stats, on_nudge=self._nudged
        )
        if coordinator is not None:
            coordinator.set_nudger(self.relay.nudge)
        #: shared with the parts (never replaced): what status() shows
        self.peers = self.book.peers
        self._sends = self.replicator.sends
        self._pins = self.holdings.pins
        self.book.on_restart(self.replicator.rereplicate)
        self.book.on_gone(self._gone)
        catalog.on_sealed(self.holdings.on_sealed)
        catalog.on_sealed(self.replicator.on_sealed)
        catalog.on_withdrawn(self.replicator.on_withdrawn)
        catalog.on_withdrawn(self.holdings.on_withdrawn)
        plane.on_heartbeat_wanted(self.poke)

    # ------------------------------------------------------------------ the plane

    def has_plane(self) -> bool:
        """A coordinator can be found: ``--coordinator``, or ``--listen`` with the bucket
        rendezvous."""
        return self.plane.has_plane()

    def active_job(self) -> JobSpec | None:
        """The current job if it spans several nodes and a coordinator can be found."""
        return self.plane.active_job()

    @property
    def is_coordinator(self) -> bool:
        """This node serves the coordinator of its job right now (any thread)."""
        return self._server is not None and self.coordinator_gate() is None

    def coordinator_gate(self) -> str | None:
        """None while this node is the coordinator, else one line why not (any thread);
        see :meth:`tierfs.replication.plane.PlaneState.coordinator_gate`."""
        return self.plane.coordinator_gate()

    def poke(self) -> None:
        """Send a heartbeat now (e.g. a backup outcome to report; trio thread)."""
        self.heartbeat.poke()

    def _nudged(self, job: str) -> None:
        """The coordinator summons this node (``SyncRelay.Nudge``; the server's loop
        thread): heartbeat now if ``job`` is the one running here."""
        token = self.holdings.token
        current = self.current.job
        if token is None or current is None or current.name != job:
            return
        try:
            token.run_sync_soon(self.poke)
        except trio.RunFinishedError:
            pass

    def watch_parts(self, watch: PartWatch) -> None:
        """Tell ``watch`` (the whole-step view) in every heartbeat which own parts of the
        steps it shows were reported changed (:class:`tierfs.core.ports.PartWatch`)."""
        self.heartbeat.parts_watch = watch

    # ------------------------------------------------------------------ restore rounds

    async def find_coordinator(self, job: JobSpec) -> str | None:
        """The coordinator's address for ``job`` (trio thread), or None if not found yet
        (:meth:`tierfs.replication.rendezvous.CoordinatorFinder.find`; the reason is
        then in :attr:`rendezvous_note`)."""
        return await self.finder.find(job)

    def coordinator_lost(self) -> None:
        """A coordinator call failed: with the bucket rendezvous, look it up again.

        The coordinator's node no longer counts as live in status (the address
        book is the coordinator's, so nothing else would say it is gone).
        """
        self.heartbeat.coordinator_lost()

    def join_fields(self, job: JobSpec) -> dict[str, Any]:
        """The JoinRequest fields describing this node in ``job`` (trio thread)."""
        return self.heartbeat.join_fields(job)

    def update_peers(self, peers: Iterable[Any], reply: Any = None) -> None:
        """Take the coordinator's addresses of the peers this node asked for, and from
        ``reply`` (a JoinReply/SyncReply) its counts of live and known nodes (trio thread)."""
        self.book.update(peers, reply)

    def _gone(self, ranks: list[int]) -> None:
        """The coordinator declared ``ranks`` gone for good: say so in
        ``replicator.errors`` and send the stand-ins what they lack at once."""
        job = self.current.job
        targets = self.replica_peers(job) if job is not None else []
        self.reporter.error(
            f"node-rank(s) {ranks} declared gone for good by the coordinator: rounds no "
            f"longer wait for them; this node replicates to {targets}"
        )
        self.replicator.catch_up()

    def replica_peers(self, job: JobSpec) -> list[int]:
        """The ranks receiving this node's steps (:func:`.placement.peer_ranks`, with
        stand-ins for ranks gone for good)."""
        return replica_peers(job, self.book.gone)

    def digest(self, shard: Shard) -> str:
        """The shard's manifest digest (cached per manifest object)."""
        return self.holdings.digest(shard)

    def _pin(self, key: ShardKey, delta: int) -> None:
        """Pin (+1) or unpin (-1) ``key`` against retention (trio thread)."""
        self.holdings.pin_now(key, delta)

    async def reachable(self, address: str, timeout: float) -> bool:
        """Whether the peer at ``address`` accepts a connection within ``timeout``
        seconds (a worker thread waits; asked to connect now, not after the channel's
        reconnect backoff)."""
        return await trio.to_thread.run_sync(
            self.client.wait_ready, address, timeout, abandon_on_cancel=True
        )

    async def pull(
        self, address: str, key: ShardKey, digest: str, cancel: threading.Event
    ) -> Shard:
        """Pull, verify and commit ``key`` from a holder (worker thread); not yet cataloged.

        Raises:
            tierfs.replication.transfer.BadCopy: the copy is corrupt (nothing committed).
            grpc.RpcError: the holder is unreachable or has no such copy.
        """
        job = self.current.job
        async with self.transfer_limiter:
            return await trio.to_thread.run_sync(
                self.client.pull,
                address,
                key,
                digest,
                job.node_rank if job else -1,
                self.ram,
                self.shards,
                cancel,
                abandon_on_cancel=True,
            )

    async def part_manifest(
        self,
        job: str,
        rank: int,
        step: int,
        *,
        writers: int = 0,
        round_name: str = "",
        beside: tuple[int, str] | None = None,
    ) -> Manifest | None:
        """The manifest of node ``rank``'s own part of ``step``, asked of that node
        (no file bytes); None while it is unreachable or holds no such part
        (``round_name`` and ``beside``, for backup sources, are ignored).

        A node whose address is not known here is added to the ranks the next
        heartbeat asks the coordinator for (:meth:`AddressBook.also_want`);
        meanwhile the coordinator's node is asked, which relays the manifests
        it was told (:meth:`Holdings.known_manifest`). Every manifest a node
        sends is kept for relaying. When that node has no answer, the nodes
        holding its replicas (by the placement of ``writers`` nodes, the node
        count that wrote the step; 0: the job's) are asked. A rank the job no
        longer has (a step written by more nodes, issue #16) is not asked itself.

        A :class:`tierfs.core.ports.ManifestSource` (:mod:`tierfs.node.whole_step`,
        :mod:`tierfs.node.remote_view`).
        """
        key = ShardKey(job, rank, step)
        spec = self.current.job
        gone = (
            spec is not None and spec.name == job and (rank >= spec.nodes or rank in self.book.gone)
        )
        address = None if gone else await self._address_of(job, rank)
        relay = False
        if not address:
            address, relay = self.coordinator_address, True
        manifest = await self._manifest_from(address, key)
        if manifest is not None:
            if not relay:
                self.holdings.remember_manifest(manifest)
            return manifest
        # that node is down or lost its part: the nodes holding its replicas
        if spec is None or spec.name != job:
            return None
        for r in holders_of(spec, rank, writers, frozenset(self.book.gone)):
            if r == rank:
                continue  # asked above
            if r != spec.node_rank:
                manifest = await self._manifest_from(await self._address_of(job, r), key)
                if manifest is not None:
                    return manifest
        return None

    async def owner_part(self, job: str, rank: int, step: int) -> str | None:
        """The digest of node ``rank``'s own part of ``step`` as that node holds it now,
        asked of that node only (no relay, no replica holder); :data:`SAVING` while
        its client writes the step again (its seal to come); None when it cannot say
        (unreachable, no such part, an address not known here). Trio thread; never
        raises. (:meth:`tierfs.node.remote_view.RemoteView` confirms a part sealed
        moments before an open: #14 trial 60 M1a.)"""
        spec = self.current.job
        if spec is None or spec.name != job or rank >= spec.nodes or rank in self.book.gone:
            return None
        address = await self._address_of(job, rank)
        if not address or address == self.address:
            return None
        key = ShardKey(job, rank, step)
        try:
            digest: str = await self.call(self.client.part_digest, address, key, 5.0)
        except grpc.RpcError as exc:
            if rpc_code(exc) == grpc.StatusCode.FAILED_PRECONDITION and RESAVING in (
                rpc_reason(exc)
            ):
                return PART_SAVING
            log.debug("the part of step %d of rank %d: %s", step, rank, exc)
            return None
        except (Refused, BadCopy) as exc:
            log.debug("the part of step %d of rank %d: %s", step, rank, exc)
            return None
        return digest

    async def _manifest_from(self, address: str | None, key: ShardKey) -> Manifest | None:
        """The manifest of the copy of ``key`` at ``address`` (None: no answer)."""
        if not address or address == self.address:
            return None
        try:
            manifest: Manifest = await self.call(self.client.manifest, address, key)
        except (grpc.RpcError, Refused, BadCopy) as exc:
            log.debug("manifest of step %d of rank %d: %s", key.step, key.rank, exc)
            return None
        return manifest

    async def _address_of(self, job: str, rank: int) -> str | None:
        """Node ``rank``'s address if known here (the address book; on the node serving
        the coordinator, its members); else None, and the next heartbeat asks for it."""
        peer = self.book.reachable(rank)
        address = peer.address if peer is not None else None
        if address is None and self.coordinator is not None:
            # not a replica partner: the coordinator this node serves knows every member
            address = await self.call(self.coordinator.locked, _member_address(rank))
        if not address and self.book.also_want(job, rank):
            self.poke()
        return address or None

    async def fetch_file(
        self,
        job: str,
        rank: int,
        step: int,
        digest: str,
        path: str,
        fd: int,
        *,
        skip: frozenset[str] = frozenset(),
        writers: int = 0,
        expect: tuple[int, int] | None = None,
        write: PositionalWrite | None = None,
    ) -> str:
        """One file of node ``rank``'s part from a peer's RAM: a
        :class:`tierfs.core.ports.FileSource`, see :meth:`PeerFiles.fetch_file`."""
        return await self.files.fetch_file(
            job,
            rank,
            step,
            digest,
            path,
            fd,
            skip=skip,
            writers=writers,
            expect=expect,
            write=write,
        )

    async def fetch_files(
        self,
        job: str,
        rank: int,
        step: int,
        digest: str,
        files: Sequence[FileTarget],
        landed: Callable[[str, str], None],
        *,
        writers: int = 0,
    ) -> None:
        """Several small files of node ``rank``'s part in one call per copy: a
        :class:`tierfs.core.ports.BatchFileSource`, see :meth:`PeerFiles.fetch_files`."""
        await self.files.fetch_files(job, rank, step, digest, files, landed, writers=writers)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a blocking control call in a worker thread."""
        return await self.control.call(fn, *args)

    # ------------------------------------------------------------------ Tier

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the gRPC server (if ``--listen``), then heartbeat until cancelled.

        Raises:
            RuntimeError: the listen address cannot be bound.
        """
        self.holdings.attach(trio.lowlevel.current_trio_token())
        self.holdings.relink_loaded()
        if self.listen:
            self._start_server()
        try:
            async with trio.open_nursery() as nursery:
                self.replicator.start(nursery)
                nursery.start_soon(self.heartbeat.run)
                nursery.start_soon(self.finder.publisher)
                task_status.started()
        finally:
            self.replicator.stop()
            if self._server is not None:
                self._server.stop(0)
                self.plane.server_up = False
            if self.lane is not None:
                self.lane.stop()
            self.client.close()

    def _start_server(self) -> None:
        # every node registers the coordinator service: which node serves it
        # may be known only once a job starts (the gate answers the others)
        self.lane = self._start_lane()
        # with a lane, receivers pull this node's replicas over it (Replicate), and
        # this node pulls the replicas offered to it
        puller = self.client if self.lane is not None else None
        peer = with_sync_context(peer_handlers(PeerServicer(self.holdings, self.lane, puller)))
        coordinator = self.coordinator
        relay = self.relay

        def setup(server: Any, loop: Any) -> None:
            # one asyncio loop thread: the coordinator's waiting calls and the
            # heartbeat relay's members hold no thread; the data plane's blocking
            # handlers run in the server's 32 threads
            server.add_generic_rpc_handlers((peer,))
            relay.attach(server, loop)
            if coordinator is not None:
                coordinator.attach(server, loop)

        server = self._server_factory(
            setup,
            interceptors=[peer_wire.AioTokenInterceptor(self.token)],
            options=peer_wire.SERVER_OPTIONS,
            name="tierfs-peer",
        )
        assert self.listen is not None
        self.port = server.start(self.listen)
        if self.address.endswith(":0"):
            self.address = f"{self.address[:-2]}:{self.port}"  # --listen HOST:0
        self._server = server
        if self.lane is not None:
            self.client.pull_from = self.address
        self.plane.server_up = True
        if not self.token:
            log.warning("peer plane without --peer-token: any client can call this node")
        log.info(
            "peer server on %s (advertised as %s)%s",
            self.listen,
            self.address,
            "; coordinator of the job"
            if self.is_coordinator
            else ""
            if self.static_coordinator
            else "; the coordinator is found through the bucket (node-rank 0 serves it)",
        )

    def _start_lane(self) -> LaneServer | None:
        """The data lane on ``--listen``'s host and ``--data-port`` (None when -1, or
        when the port cannot be bound: then every byte goes over gRPC; logged)."""
        if self.data_port < 0 or not self.listen or self._lane_factory is None:
            return None
        lane = self._lane_factory(lane_host(self.listen), self.data_port)
        try:
            port = lane.start()
        except OSError as exc:
            # a config problem the user must see (trial 46: only a log line said it)
            self.reporter.error(
                f"data lane on port {self.data_port}: {exc.strerror or exc}; other nodes "
                "pull this node's bytes over gRPC only (slower; see --data-port)"
            )
            return None
        log.info("data lane on port %d", port)
        return lane

    def _own_rank(self) -> int:
        """This node's node rank in the current job (-1: none; any thread)."""
        job = self.current.job
        return job.node_rank if job is not None else -1

    def pinned(self) -> set[ShardKey]:
        """Shards being sent or served, a restore's chosen shard until it is published,
        and the copies a restore may need: while a restore round is open, every
        copy of the job; else, per rank, the ``--keep-local`` newest steps not
        newer than the cluster's synced step (:func:`.holdings.retention_pins`)."""
        job = self.current.job
        return retention_pins(
            self._pins,
            self.catalog,
            job.name if job is not None and self.active_job() is not None else None,
            synced=self.sync.get("step"),
            restore_open=bool(self.restore_round),
            keep_local=self.keep_local,
        )

    # ------------------------------------------------------------------ status

    def status(self) -> PeerStatus:
        """Peers, addresses, replication per step, the last sync round, wire counters."""
        job = self.current.job
        active = self.active_job()
        targets = self.replica_peers(active) if active else []
        steps = []
        if job is not None:
            for shard in self.catalog.own_shards(job):
                send = self._sends.get(shard.key)
                if send is None or not targets:
                    continue
                where = [f"peer:{p}" for p in targets if _done(send.states.get(p))]
                if len(where) == len(targets):
                    state = "replicated"
                elif any(s == "failed" for s in send.states.values()):
                    state = "replication failed"
                else:
                    state = "replicating"
                steps.append(
                    PeerStepStatus(
                        step=shard.key.step,
                        where=tuple(where),
                        state=state,
                        peers={str(p): send.states.get(p) for p in targets},
                        transfers={str(p): dict(t) for p, t in send.timings.items()},
                    )
                )
        peers = tuple(
            PeerMemberStatus(p.rank, p.address, p.live, p.rank in targets)
            for p in sorted(self.peers.values(), key=lambda p: p.rank)
        )
        live = self.node_counts[0] if self.node_counts else sum(1 for p in peers if p.live)
        sync_step = self.sync.get("step")
        serving = self.is_coordinator
        if self.static_coordinator:
            rendezvous = "static (--coordinator)"
        elif self.rendezvous is not None:
            rendezvous = "bucket"
        else:
            rendezvous = "none (no --coordinator, no --bucket)"
        if self.coordinator_address:
            how = (
                " (this node)"
                if serving
                else (" (found through the bucket)" if rendezvous == "bucket" else "")
            )
            found = f"coordinator {self.coordinator_address}{how}"
        elif active is not None:
            found = f"coordinator not found yet ({self.rendezvous_note or 'looking'})"
        else:
            found = f"coordinator: {rendezvous}"
        summary = (
            f"{self.address or 'no server'}; {found}; "
            f"replicates to {targets or 'nobody'}; {live} node(s) live; "
            f"last sync round: {'step ' + str(sync_step) if sync_step is not None else '-'}"
        )
        if self.last_error:
            summary += f"; problem: {self.last_error}"
        if self.publish_note:
            summary += f"; {self.publish_note}"
        return PeerStatus(
            summary=summary,
            address=self.address,
            listen=self.listen,
            port=self.port,
            coordinator=self.coordinator_address,
            rendezvous=rendezvous,
            rendezvous_note=self.rendezvous_note,
            publish_note=self.publish_note,
            is_coordinator=serving,
            incarnation=self.incarnation,
            active=active is not None,
            replicate_to=tuple(targets),
            gone=tuple(sorted(self.book.gone)),
            peers=peers,
            steps=tuple(steps),
            sync=SyncStatus.from_json(self.sync),
            wire=self.stats.snapshot(),
            pinned=tuple(sorted(str(k) for k in self._pins)),
            last_error=self.last_error,
            coordinator_state=(
                self.coordinator.status() if self.coordinator is not None and serving else None
            ),
        )


def _member_address(rank: int) -> Callable[[Any], str | None]:
    """For :meth:`CoordinatorHooks.locked`: the address of live member ``rank`` of the
    coordinator this node serves, None if it has none (or serves no job)."""

    def read(coordinator: Any) -> str | None:
        member = coordinator.members.get(rank)
        if member is None or not coordinator.live(rank):
            return None
        return str(member.address) or None

    return read
