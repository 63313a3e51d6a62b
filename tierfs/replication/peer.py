"""The peer tier: replicate sealed steps to peer nodes and keep the coordinator informed.

DESIGN.md "Peer plane", PROTOCOL.md sections 2, 4 and 6. One gRPC server per
node daemon (``--listen``) serves ``tierfs.peer.v1.Peer`` (Inventory,
PushShard, PullShard) and ``tierfs.peer.v1.Coordinator``
(:mod:`tierfs.cluster.coordinator`), the latter answered only while this node is the
coordinator: the node at ``--coordinator``, or without it node-rank 0 of the
running job.

Rendezvous (how a node finds the coordinator), resolved when the job starts
and again whenever the coordinator stops answering:

* static: ``--coordinator HOST:PORT`` (VMs, tests);
* bucket: without ``--coordinator`` but with ``--bucket``, the daemon hands
  the tier the bucket's :class:`tierfs.core.ports.Rendezvous`. Every node
  publishes its own address to ``gs://<bucket>/<job>/.tierfs/nodes/<rank>``
  with its incarnation (a random id per daemon start); node-rank 0 is the
  coordinator itself, the others read rank 0's record and *probe* it (an
  ``Inventory`` call must answer node-rank 0 of the job with the record's
  incarnation) before using it, so
  a record left by a previous daemon -- dead, restarted, or now another
  rank -- is never used.

Pieces, one module each:

* :mod:`tierfs.replication.service`: :class:`~tierfs.replication.service.PeerServicer`
  (gRPC threads) answers inventories, receives pushed replicas into
  ``store/incoming`` (:class:`tierfs.replication.transfer.ShardReceiver`),
  streams sealed snapshots to pullers. It reaches the agent only through a
  :class:`~tierfs.replication.service.PeerHost`, whose calls hop onto the
  trio thread with ``trio.from_thread.run_sync`` (cheap dictionary work only).
* :mod:`tierfs.replication.client`: :class:`~tierfs.replication.client.PeerClient`,
  blocking calls to peers and the coordinator, run in ``trio.to_thread``
  workers with capacity limiters.
* this module: :class:`PeerTier` (the agent's tier and the servicer's
  host, trio thread): finds the coordinator
  (:meth:`PeerTier.find_coordinator`); after each seal, pushes
  the snapshot to the peers from :func:`tierfs.replication.placement.peer_ranks` with
  bounded concurrency; a shard being sent is pinned against retention, a
  withdrawn shard's transfers are cancelled; if the peer already holds a
  shard with the same manifest digest (data parallelism: identical bytes)
  only the manifest is sent and the peer hard-links its copy. A heartbeat
  (``Sync``) keeps the coordinator's view of this node (address, inventory,
  newest replicated step) fresh and brings back the peers' addresses; it
  also carries backup rounds between the coordinator and the node's GCS
  tier (a :class:`tierfs.core.ports.BackupOrders`): the node's outcome of its
  last round up, the round it is ordered into down.
* :mod:`tierfs.node.peer_restore`: :class:`~tierfs.node.peer_restore.PeerCluster`
  (the agent's :class:`tierfs.node.agent.Cluster`): the restore rounds: verify
  what this node holds, join, get the decision, pull the own shard from a
  holder if it is not local (verifying every crc32c; a corrupt copy is
  reported and the next one used, or the coordinator chooses again without
  it), then the two barrier phases.
* shared by both sides: :mod:`tierfs.rpc.wire` (token auth, channel
  settings, wire counters) and :mod:`tierfs.replication.transfer`
  (reading a snapshot as chunks, receiving them safely).

Threads: nothing here blocks the trio thread. gRPC handlers run in the
server's pool; client calls and file work run in ``trio.to_thread`` with
limiters (:attr:`PeerTier.transfer_limiter` for data, a separate one for
control calls so heartbeats are never queued behind a large transfer).
"""

from __future__ import annotations

import collections
import errno
import functools
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import trio

from tierfs.core import retry
from tierfs.core.config import NodeConfig
from tierfs.core.errors import ClusterError
from tierfs.core.ports import (
    BackupOrders,
    Catalog,
    CurrentJob,
    RamBudget,
    Rendezvous,
    Reporter,
    Summons,
)
from tierfs.core.status import PeerMemberStatus, PeerStatus, PeerStepStatus, SyncStatus
from tierfs.core.types import COORDINATOR_RANK, FAILED, NO_STEP, Holding, Outcome, RoundView
from tierfs.replication import placement
from tierfs.replication.client import PeerClient, rpc_code, rpc_reason
from tierfs.replication.plane import PlaneState
from tierfs.replication.service import HostGone, PeerHost, PeerServicer, peer_handlers
from tierfs.replication.transfer import Cancelled
from tierfs.rpc import wire as peer_wire
from tierfs.rpc.aio_server import AioServer, with_sync_context
from tierfs.rpc.wire import WireStats
from tierfs.store.ramstore import RamStore
from tierfs.store.shards import Shard, ShardKey, ShardStore

if TYPE_CHECKING:
    from tierfs.core.control import JobSpec

log = logging.getLogger(__name__)

#: seconds between heartbeats (``Sync``) to the coordinator
HEARTBEAT = 1.0
#: seconds between checks that every retained step reached every live peer
CATCH_UP = 10.0
#: how long a sender waits for a data-parallel peer to seal the same step (seconds)
DP_WAIT = 30.0
#: concurrent shard transfers (sends and pulls) per node
TRANSFERS = 2
#: least seconds between two bucket lookups of the rendezvous (and the publisher's tick)
LOOKUP_INTERVAL = 1.0
#: seconds a probe of a rendezvous address may take
PROBE_TIMEOUT = 5.0


class _NotPublished(ClusterError):
    """This node's rendezvous record could not be written (retried by its publisher)."""


# ---------------------------------------------------------------------- tier


@dataclass
class PeerInfo:
    """A node as the coordinator last described it."""

    rank: int
    address: str
    incarnation: str
    live: bool


@dataclass
class _Send:
    cancel: threading.Event = field(default_factory=threading.Event)
    states: dict[int, str] = field(default_factory=dict)
    #: peer -> {"seconds": transfer time, "bytes": data bytes sent}
    timings: dict[int, dict[str, float]] = field(default_factory=dict)


class PeerTier(PeerHost):
    """The peer tier of one node (see the module docstring).

    Args:
        config: the node configuration: ``listen``, ``advertise``,
            ``coordinator``, ``peer_token``, ``join_timeout`` and ``keep_local``.
        store: the RAM store (pulled shards arrive in its ``incoming``).
        shards: the store of committed shards.
        catalog: the held shards; the tier registers its sealed and withdrawn
            listeners there.
        job: the current job (read only).
        reporter: ``replicator.errors``.
        budget: the RAM budget (a pushed replica must fit).
        summons: where the coordinator's summons into a restore round go.
        plane: the peer plane's shared state (sync round, coordinator gate).
        coordinator: this node's coordinator service, registered on the gRPC
            server (None: no ``--listen``).
        rendezvous: the bucket rendezvous (a bucket and no ``--coordinator``),
            else None.
        backup: the node's backup plane when it takes part in backup rounds,
            else None (an order is then answered "failed").

    Attributes:
        coordinator_address: where this node last found the coordinator
            (the static address, its own, or the bucket's), or None.
    """

    name = "peer"

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
        coordinator: Any = None,
        rendezvous: Rendezvous | None = None,
        backup: BackupOrders | None = None,
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
        self.stats = WireStats()
        self.incarnation = uuid.uuid4().hex
        self.listen = c.listen
        self.address = c.advertise or c.listen or ""
        self.static_coordinator = c.coordinator
        self.coordinator_address = c.coordinator
        self.token = c.peer_token
        self.join_timeout = float(c.join_timeout)
        self.rendezvous = rendezvous
        self.backup = backup
        self.rendezvous_note: str | None = None
        self._found: tuple[tuple[str, int, int], str, str] | None = None
        self._published: tuple[tuple[str, int, int], str] | None = None
        self._publish_failed: tuple[str, int, int] | None = None
        self.publish_note: str | None = None
        self._looked_at = -math.inf
        self._find_lock = trio.Lock()
        self._publish_poke = trio.Event()
        self._no_bucket: Outcome | None = None
        self.client = PeerClient(self.token, self.stats)
        self.coordinator = coordinator
        self._token: trio.lowlevel.TrioToken | None = None
        self.port: int | None = None
        self.transfer_limiter = trio.CapacityLimiter(TRANSFERS)
        self._control_limiter = trio.CapacityLimiter(8)
        self._server: AioServer | None = None
        self._nursery: trio.Nursery | None = None
        self._poke = trio.Event()
        self._sends: dict[ShardKey, _Send] = {}
        self._pins: collections.Counter[ShardKey] = collections.Counter()
        self._trusted: set[ShardKey] = set()
        self._linked: dict[ShardKey, ShardKey] = {}
        self._digests: dict[ShardKey, tuple[int, str]] = {}
        self.peers: dict[int, PeerInfo] = {}
        #: (live, known) nodes as the coordinator last counted them (None: not told)
        self.node_counts: tuple[int, int] | None = None
        self._reported_ok: int | None = None
        #: the restore round the coordinator has open (0: none), from the last Sync
        self.restore_round = 0
        self.last_error: str | None = None
        self._coord_ok: bool | None = None
        self._registered: tuple[str, int] | None = None
        catalog.on_sealed(self.on_sealed)
        catalog.on_withdrawn(self.on_withdrawn)
        plane.on_heartbeat_wanted(self.poke)

    @property
    def sync(self) -> dict[str, Any]:
        """The last sync round (the plane's): ``step``, ``at``, ``steps``."""
        return self.plane.sync

    @sync.setter
    def sync(self, value: dict[str, Any]) -> None:
        self.plane.sync = value

    @property
    def reported(self) -> tuple[int, ...]:
        """Own steps reported as replicated in the Sync in flight and in the last one
        answered: the coordinator may order a backup round of either (the GCS tier
        pins them against retention)."""
        return self.plane.reported

    @reported.setter
    def reported(self, value: tuple[int, ...]) -> None:
        self.plane.reported = value

    # ------------------------------------------------------------------ helpers

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

    # ------------------------------------------------------------------ rendezvous

    def poke(self) -> None:
        """Send a heartbeat now (e.g. a backup outcome to report; trio thread)."""
        self._poke.set()

    async def find_coordinator(self, job: JobSpec) -> str | None:
        """The coordinator's address for ``job`` (trio thread), or None if not found yet.

        Static: ``--coordinator``. Bucket: node-rank 0 is the coordinator
        (its record is written by :meth:`_publisher`); the others use rank
        0's record once a probe confirmed it (see the module docstring).
        Once found, no I/O; else bucket reads happen at most every
        :data:`LOOKUP_INTERVAL` seconds (each bounded by the rendezvous's
        deadline plus :data:`PROBE_TIMEOUT`), and a failed lookup leaves a
        line in :attr:`rendezvous_note` and returns None: the caller retries.
        """
        if self.static_coordinator:
            return self.static_coordinator
        rdv = self.rendezvous
        if rdv is None or not self.address or not self.listen:
            return None
        ident = (job.name, job.nodes, job.node_rank)
        if self._published != (ident, self.address):
            self._publish_poke.set()
        if job.node_rank == COORDINATOR_RANK:
            self.coordinator_address = self.address
            return self.address
        async with self._find_lock:
            if self._found is not None and self._found[0] == ident:
                return self._found[1]
            now = trio.current_time()
            if now - self._looked_at < LOOKUP_INTERVAL:
                return None
            self._looked_at = now
            where = rdv.where(job.name, COORDINATOR_RANK)
            try:
                rec = await rdv.lookup(job.name, COORDINATOR_RANK)
            except Exception as exc:
                self.rendezvous_note = f"cannot read {where}: {exc}"
                return None
            if rec is None:
                self.rendezvous_note = f"waiting for node-rank 0 to publish {where}"
                return None
            address, incarnation = rec
            problem = await self._probe(job, address, incarnation)
            if problem is not None:
                self.rendezvous_note = (
                    f"{where} is stale ({address}: {problem}); waiting "
                    "for node-rank 0 to publish again"
                )
                return None
            if self.coordinator_address != address:
                log.info("bucket rendezvous: the coordinator of job %s is at %s", job.name, address)
            self._found = (ident, address, incarnation)
            self.coordinator_address = address
            self.rendezvous_note = None
            return address

    async def publish_once(self, job: JobSpec) -> bool:
        """Write this node's rendezvous record for ``job`` unless it is there (trio thread).

        Returns True when the record is written. A failure is kept in
        :attr:`publish_note`; node-rank 0 also reports it once per job in
        ``replicator.errors`` (the others cannot find it meanwhile).
        """
        rdv = self.rendezvous
        if rdv is None or self.static_coordinator or not self.listen or not self.address:
            return True
        ident = (job.name, job.nodes, job.node_rank)
        if self._published == (ident, self.address):
            return True
        try:
            await rdv.publish(job.name, job.node_rank, self.address, self.incarnation)
        except Exception as exc:
            where = rdv.where(job.name, job.node_rank)
            self.publish_note = f"cannot publish this node's address to {where}: {exc}"
            if job.node_rank == COORDINATOR_RANK and self._publish_failed != ident:
                self._publish_failed = ident
                self.reporter.error(
                    f"bucket rendezvous: {self.publish_note}; the "
                    "other nodes cannot find the coordinator until it "
                    "is written"
                )
            return False
        self._published = (ident, self.address)
        self._publish_failed = None
        self.publish_note = None
        log.info(
            "bucket rendezvous: published %s as node-rank %d of job %s",
            self.address,
            job.node_rank,
            job.name,
        )
        return True

    async def _publisher(self) -> None:
        """Keep this node's rendezvous record current (a task of its own, so a slow or
        unreachable bucket never delays the heartbeat); failures are retried by the
        ``rendezvous-publish`` policy (:mod:`tierfs.core.retry`; pokes do not hurry
        a failing bucket)."""
        while True:
            # back off; pokes do not hurry a failing bucket
            async for attempt in retry.rendezvous_publish().retry_context(on=_NotPublished):
                with attempt:
                    job = self.active_job()
                    rdv = self.rendezvous
                    if job is not None and rdv is not None and not await self.publish_once(job):
                        raise _NotPublished(self.publish_note or "not published")
            with trio.move_on_after(LOOKUP_INTERVAL):  # a new job is seen within this
                await self._publish_poke.wait()
            self._publish_poke = trio.Event()

    async def _probe(self, job: JobSpec, address: str, incarnation: str) -> str | None:
        """None if ``address`` is node-rank 0 of ``job`` with ``incarnation``, else why not."""
        try:
            reply = await self.call(
                functools.partial(self.client.inventory, address, job.name, timeout=PROBE_TIMEOUT)
            )
        except grpc.RpcError as exc:
            return rpc_reason(exc)
        if reply.incarnation != incarnation:
            return "another daemon answers there (the record is from an earlier start)"
        if reply.node_rank != COORDINATOR_RANK:
            return f"that daemon is not node-rank 0 of job {job.name}" + (
                f" (it is node-rank {reply.node_rank})" if reply.node_rank >= 0 else ""
            )
        return None

    def coordinator_lost(self) -> None:
        """A coordinator call failed: with the bucket rendezvous, look it up again.

        The coordinator's node no longer counts as live in status (the address
        book is the coordinator's, so nothing else would say it is gone).
        """
        if self.rendezvous is not None and not self.static_coordinator:
            self._found = None
        info = self.peers.get(COORDINATOR_RANK)
        if info is not None and info.live:
            info.live = False

    def replica_peers(self, job: JobSpec) -> list[int]:
        """The ranks receiving this node's steps (:func:`.placement.peer_ranks`)."""
        try:
            return placement.peer_ranks(
                job.node_rank,
                job.nodes,
                peer_ranks=job.peer_ranks,
                peers_per_node=job.peers_per_node,
                data_parallelism=job.assume_data_parallelism,
            )
        except ValueError as exc:
            log.warning("no peers: %s", exc)
            return []

    def digest(self, shard: Shard) -> str:
        """The shard's manifest digest (cached per manifest object)."""
        cached = self._digests.get(shard.key)
        if cached is not None and cached[0] == id(shard.manifest):
            return cached[1]
        d = shard.manifest.digest
        self._digests[shard.key] = (id(shard.manifest), d)
        return d

    def holdings(self, job: str) -> list[Holding]:
        """This node's inventory of ``job`` (trio thread)."""
        return [
            Holding(
                s.key.rank,
                s.key.step,
                s.verified or s.key in self._trusted,
                self.digest(s),
                s.bytes,
                s.manifest.name,
                s.manifest.backup_requested,
                s.manifest.created,
            )
            for s in self.catalog.shards_of(job)
        ]

    def _on_trio(self, fn: Callable[..., Any], *args: Any) -> Any:
        token = self._token
        if token is None:
            raise HostGone()
        try:
            return trio.from_thread.run_sync(fn, *args, trio_token=token)
        except trio.RunFinishedError:
            raise HostGone() from None

    # ------------------------------------------------------------------ PeerHost (any thread)

    def own_rank(self, job: str) -> int | None:
        j = self.current.job  # one attribute read of a frozen JobSpec: safe from any thread
        return j.node_rank if j is not None and j.name == job else None

    def inventory(self, job: str) -> list[Holding]:
        return self._on_trio(self.holdings, job)

    def find(self, key: ShardKey) -> Shard | None:
        return self._on_trio(self.catalog.get, key)

    def find_digest(self, job: str, digest: str) -> tuple[Shard, bool] | None:
        def look() -> tuple[Shard, bool] | None:
            cur = self.current.job
            own = cur.node_rank if cur else None
            found = [s for s in self.catalog.shards_of(job) if self.digest(s) == digest]
            # prefer a copy that is not the client's view (no hard links to live files)
            found.sort(key=lambda s: (s.key.rank == own, -s.key.step))
            if not found:
                return None
            return found[0], found[0].key in self._trusted

        return self._on_trio(look)

    def adopt(self, shard: Shard, linked_from: ShardKey | None = None) -> None:
        self._on_trio(self._adopt, shard, linked_from)

    def _adopt(self, shard: Shard, linked_from: ShardKey | None) -> None:
        if linked_from is not None:
            # the files are the source's inodes: leave the inode map to the source,
            # whose withdrawal then drops this replica too (see on_withdrawn)
            shard.inodes = set()
            self._linked[shard.key] = linked_from
        self.catalog.add(shard)
        self.catalog.request_retention()

    def pin(self, key: ShardKey, delta: int) -> None:
        self._on_trio(self._pin, key, delta)

    def _pin(self, key: ShardKey, delta: int) -> None:
        self._pins[key] += delta
        if self._pins[key] <= 0:
            del self._pins[key]

    def check_space(self, nbytes: int) -> None:
        self.budget.check_growth(nbytes)

    # ------------------------------------------------------------------ Tier

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the gRPC server (if ``--listen``), then heartbeat until cancelled.

        Raises:
            RuntimeError: the listen address cannot be bound.
        """
        self._token = trio.lowlevel.current_trio_token()
        self._relink_loaded()
        if self.listen:
            self._start_server()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._heartbeat)
                nursery.start_soon(self._publisher)
                task_status.started()
        finally:
            for send in self._sends.values():
                send.cancel.set()
            if self._server is not None:
                self._server.stop(0)
                self.plane.server_up = False
            self.client.close()

    def _start_server(self) -> None:
        # every node registers the coordinator service: which node serves it
        # may be known only once a job starts (the gate answers the others)
        peer = with_sync_context(peer_handlers(PeerServicer(self)))
        coordinator = self.coordinator

        def setup(server: Any, loop: Any) -> None:
            # one asyncio loop thread: the coordinator's waiting calls hold no thread;
            # the data plane's blocking handlers run in the server's 32 threads
            server.add_generic_rpc_handlers((peer,))
            if coordinator is not None:
                coordinator.attach(server, loop)

        server = AioServer(
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

    def _relink_loaded(self) -> None:
        """After a daemon restart: replicas that are hard links of own shards (dedup)."""
        job = self.current.job
        if job is None:
            return
        own = {
            k: s for k, s in self.catalog.items() if k.job == job.name and k.rank == job.node_rank
        }
        by_ino = {ino: k for k, s in own.items() for ino in s.inodes}
        for k, s in list(self.catalog.items()):
            if k in own or k.job != job.name:
                continue
            shared = s.inodes & by_ino.keys()
            if shared:
                src = by_ino[next(iter(shared))]
                s.inodes = set()
                self._linked[k] = src
                self.catalog.add(own[src])

    def on_sealed(self, shard: Shard) -> None:
        """A step of this node was sealed: replicate it to the peers (trio thread)."""
        self._trusted.add(shard.key)
        job = self.active_job()
        if job is None or shard.key.job != job.name or shard.key.rank != job.node_rank:
            return
        peers = self.replica_peers(job)
        old = self._sends.pop(shard.key, None)
        if old is not None:
            old.cancel.set()
        send = self._sends[shard.key] = _Send()
        if not peers:
            self._poke.set()
            return
        for p in peers:
            send.states[p] = "queued"
            self._start_send(shard, p, send)

    def _start_send(self, shard: Shard, peer: int, send: _Send) -> None:
        if self._nursery is None:
            return
        self._pins[shard.key] += 1
        self._nursery.start_soon(self._replicate, shard, peer, send)

    def on_withdrawn(self, key: ShardKey) -> None:
        """A shard left the catalog: cancel its transfers; drop replicas linked to it."""
        send = self._sends.pop(key, None)
        if send is not None:
            send.cancel.set()
        self._trusted.discard(key)
        self._digests.pop(key, None)
        self._linked.pop(key, None)
        linked = [k for k, src in self._linked.items() if src == key]
        if linked and not self._retention_victim(key):
            for k in linked:
                del self._linked[k]
                self.catalog.drop(k, f"its files are hard links of {key}, which was withdrawn")
        elif linked:
            for k in linked:
                del self._linked[k]

    def _retention_victim(self, key: ShardKey) -> bool:
        steps = sorted(
            (k.step for k in self.catalog if k.job == key.job and k.rank == key.rank),
            reverse=True,
        )
        keep = steps[: self.keep_local]
        return len(keep) >= self.keep_local and key.step < min(keep)

    def pinned(self) -> set[ShardKey]:
        """Shards being sent or served, a restore's chosen shard until it is published,
        and the copies a restore may need: while a restore round is open, every
        copy of the job; else, per rank, the ``--keep-local`` newest steps not
        newer than the cluster's synced step (steps sealed while a peer is down
        can never be complete, so they must not push out the ones that are)."""
        keep = set(self._pins)
        job = self.current.job
        if job is None or self.active_job() is None:
            return keep
        mine = [k for k in self.catalog if k.job == job.name]
        if self.restore_round:
            return keep | set(mine)
        synced = self.sync.get("step")
        if synced is None:
            return keep
        by_rank: dict[int, list[int]] = {}
        for k in mine:
            if k.step <= synced:
                by_rank.setdefault(k.rank, []).append(k.step)
        n = self.keep_local
        for rank, steps in by_rank.items():
            keep |= {ShardKey(job.name, rank, s) for s in sorted(steps, reverse=True)[:n]}
        return keep

    # ------------------------------------------------------------------ replication

    async def _replicate(self, shard: Shard, peer: int, send: _Send) -> None:
        key = shard.key
        job = self.current.job
        dp = bool(
            job
            and job.assume_data_parallelism
            and peer in placement.column_of(key.rank, job.nodes, job.assume_data_parallelism)
        )
        # how long a push is retried while its peer is unreachable: policy peer-push
        backoff = retry.peer_push().backoff(trio.current_time)
        data_loss = 0
        try:
            async with self.transfer_limiter:
                while not send.cancel.is_set():
                    if not self._worth_sending(key):
                        send.states[peer] = "superseded"
                        return
                    info = self.peers.get(peer)
                    if info is None or not info.address:
                        if backoff.expired():
                            send.states[peer] = "failed"
                            self.reporter.error(
                                f"replication of step {key.step} to node-rank {peer} failed: "
                                "its address is unknown (it never joined the coordinator)"
                            )
                            return
                        self._poke.set()
                        await trio.sleep(0.2)
                        continue
                    send.states[peer] = "sending"
                    started = time.monotonic()
                    try:
                        outcome = await trio.to_thread.run_sync(
                            self._push_blocking,
                            info.address,
                            shard,
                            key,
                            dp,
                            send.cancel,
                            abandon_on_cancel=True,
                        )
                    except Cancelled:
                        break
                    except OSError as exc:
                        send.states[peer] = "cancelled"
                        log.info("replication of %s stopped: snapshot gone (%s)", key, exc)
                        return
                    except grpc.RpcError as exc:
                        code = rpc_code(exc)
                        if code == grpc.StatusCode.DATA_LOSS and data_loss == 0:
                            data_loss += 1
                            log.warning(
                                "node-rank %d found %s corrupt in transit; sending again", peer, key
                            )
                            continue
                        again = code in (
                            grpc.StatusCode.UNAVAILABLE,
                            grpc.StatusCode.DEADLINE_EXCEEDED,
                            grpc.StatusCode.CANCELLED,
                        )
                        if again and not backoff.expired():
                            send.states[peer] = "retrying"
                            await trio.sleep(backoff.next())
                            continue
                        send.states[peer] = "failed"
                        self.reporter.error(
                            f"replication of step {key.step} to node-rank {peer} "
                            f"({info.address}) failed: {rpc_reason(exc)}"
                        )
                        return
                    send.states[peer] = outcome
                    seconds = time.monotonic() - started
                    sent = shard.bytes if outcome == "replicated" else 0
                    send.timings[peer] = {"seconds": round(seconds, 4), "bytes": sent}
                    log.info(
                        "step %d %s to node-rank %d (%.2f s, %.0f MB/s)",
                        key.step,
                        outcome,
                        peer,
                        seconds,
                        sent / max(seconds, 1e-9) / 1e6,
                    )
                    self._poke.set()
                    return
                send.states[peer] = "cancelled"
        finally:
            self._pin(key, -1)

    def _worth_sending(self, key: ShardKey) -> bool:
        """False once ``key`` left the catalog or is older than the shards retention keeps."""
        return self.catalog.retained(key)

    def _push_blocking(
        self, address: str, shard: Shard, key: ShardKey, dp: bool, cancel: threading.Event
    ) -> str:
        digest = shard.manifest.digest
        inv = self.client.inventory(
            address,
            key.job,
            want_digest=digest,
            wait_step=key.step if dp else -1,
            wait_s=min(DP_WAIT, 5.0) if dp else 0.0,
        )
        waited = 5.0
        while (
            dp
            and not any(h.digest == digest for h in inv.shards)
            and not any(h.rank == inv.node_rank and h.step == key.step for h in inv.shards)
        ):
            if waited >= DP_WAIT or cancel.is_set():
                break
            inv = self.client.inventory(
                address, key.job, want_digest=digest, wait_step=key.step, wait_s=5.0
            )
            waited += 5.0
        if any(
            h.rank == key.rank and h.step == key.step and h.digest == digest for h in inv.shards
        ):
            return "present"
        dedup = any(h.digest == digest for h in inv.shards)
        cur = self.current.job
        reply = self.client.push(address, shard, cur.node_rank if cur else -1, dedup, cancel)
        if dedup and not reply.committed:
            reply = self.client.push(address, shard, key.rank, False, cancel)
        if not reply.committed:
            if cancel.is_set():
                raise Cancelled("transfer cancelled")
            raise OSError(errno.EIO, reply.detail or "not committed")
        return "replicated" if not reply.deduped else "replicated (manifest only)"

    def _replicated_step(self, job: JobSpec) -> int:
        """The newest own step replicated to every peer, sealed since the job (re)started
        (steps of the timeline before a restore are never reported)."""
        peers = self.replica_peers(job)
        since = self.current.timeline_since
        for shard in self.catalog.own_shards(job):
            if shard.manifest.created < since:
                break
            if not peers:
                return shard.key.step
            send = self._sends.get(shard.key)
            if send is not None and all(_done(send.states.get(p)) for p in peers):
                return shard.key.step
        return NO_STEP

    def _rereplicate(self, peer: int) -> None:
        """A peer came back (new incarnation): send it our newest step again."""
        job = self.active_job()
        if job is None or peer not in self.replica_peers(job):
            return
        own = self.catalog.own_shards(job)
        if not own:
            return
        shard = own[0]
        send = self._sends.setdefault(shard.key, _Send())
        if send.states.get(peer) in ("queued", "sending", "retrying"):
            return
        send.states[peer] = "queued"
        log.info("node-rank %d restarted: sending step %d again", peer, shard.key.step)
        self._start_send(shard, peer, send)

    def _catch_up(self) -> None:
        """Send again what a live peer lacks: retained steps whose transfer to it
        failed, or that were sealed before the peer was known (trio thread)."""
        job = self.active_job()
        if job is None:
            return
        for shard in self.catalog.own_shards(job):
            if not self.catalog.retained(shard.key):
                continue
            send = self._sends.setdefault(shard.key, _Send())
            for peer in self.replica_peers(job):
                info = self.peers.get(peer)
                if info is None or not info.live or not info.address:
                    continue
                if send.states.get(peer) in (None, "failed"):
                    send.states[peer] = "queued"
                    log.info(
                        "sending step %d to node-rank %d again (it lacks it)", shard.key.step, peer
                    )
                    self._start_send(shard, peer, send)

    # ------------------------------------------------------------------ heartbeat

    async def _heartbeat(self) -> None:
        last_catch_up = trio.current_time()
        while True:
            if trio.current_time() - last_catch_up >= CATCH_UP:
                last_catch_up = trio.current_time()
                try:
                    self._catch_up()
                except Exception:
                    log.exception("catch-up of replicas failed")
            job = self.active_job()
            if job is not None:
                coord = None
                try:
                    coord = await self.find_coordinator(job)
                    if coord is None:
                        self.last_error = f"coordinator not found yet: {self.rendezvous_note}"
                    else:
                        await self._sync_once(job, coord)
                        if self._coord_ok is False:
                            log.info("coordinator %s reachable again", coord)
                        self._coord_ok = True
                except grpc.RpcError as exc:
                    self.restore_round = 0  # unknown now: retention must not stay paused
                    self.last_error = f"coordinator {coord}: {rpc_reason(exc)}"
                    if self._coord_ok is not False:
                        log.warning("%s", self.last_error)
                    self._coord_ok = False
                    self.coordinator_lost()
                except Exception:
                    log.exception("heartbeat failed")
            with trio.move_on_after(HEARTBEAT):
                await self._poke.wait()
            self._poke = trio.Event()

    def join_fields(self, job: JobSpec) -> dict[str, Any]:
        """The JoinRequest fields describing this node in ``job`` (trio thread)."""
        return dict(
            job=job.name,
            nodes=job.nodes,
            rank=job.node_rank,
            address=self.address,
            incarnation=self.incarnation,
            backup_interval_minutes=job.backup_interval_minutes or 0.0,
            backup_interval_steps=job.backup_interval_steps or 0,
            inventory=self.holdings(job.name),
            want_peers=self.wanted_peers(job),
            compact=True,
        )

    def wanted_peers(self, job: JobSpec) -> list[int]:
        """The ranks whose addresses this node asks the coordinator for: its replica
        targets and the coordinator (O(peers) replies, not the whole membership)."""
        return sorted({COORDINATOR_RANK, *self.replica_peers(job)} - {job.node_rank})

    def _backup_outcome(self) -> Outcome | None:
        backup = self.backup
        return backup.backup_outcome() if backup is not None else self._no_bucket

    async def _sync_once(self, job: JobSpec, coord: str) -> None:
        inventory = self.holdings(job.name)
        step = self._replicated_step(job)
        self.reported = tuple(
            sorted({s for s in (self._reported_ok, step) if s is not None and s >= 0})
        )
        async with self._control_limiter:
            reply = await trio.to_thread.run_sync(
                self.client.sync,
                coord,
                job.name,
                job.node_rank,
                self.incarnation,
                step,
                inventory,
                self._backup_outcome(),
                job.assume_data_parallelism,
                self.wanted_peers(job),
            )
            self._reported_ok = step
            self.reported = (step,) if step >= 0 else ()
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
                self.update_peers(joined.peers, joined)
                return
        self.update_peers(reply.peers, reply)
        self.last_error = None
        self.sync = {
            "step": reply.synced_step if reply.synced_step >= 0 else None,
            "at": reply.synced_at or None,
            "steps": list(reply.steps),  # empty from a coordinator answering compact
            "reported": int(reply.reported),
        }
        self.restore_round = int(reply.restore_round)
        if reply.summoned:
            self.summons.summoned(job)
        self._backup_round(job, reply)

    def _backup_round(self, job: JobSpec, reply: Any) -> None:
        """Hand the coordinator's backup round order to the node's GCS tier."""
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

    def update_peers(self, peers: Iterable[Any], reply: Any = None) -> None:
        """Take the coordinator's addresses of the peers this node asked for, and from
        ``reply`` (a JoinReply/SyncReply) its counts of live and known nodes (trio thread)."""
        if reply is not None and reply.known_nodes:
            self.node_counts = (int(reply.live_nodes), int(reply.known_nodes))
        for p in peers:
            old = self.peers.get(p.rank)
            self.peers[p.rank] = PeerInfo(p.rank, p.address, p.incarnation, p.live)
            if (
                old is not None
                and old.incarnation != p.incarnation
                and p.incarnation != self.incarnation
            ):
                self._rereplicate(p.rank)

    # ------------------------------------------------------------------ restore support

    async def pull(
        self, address: str, key: ShardKey, digest: str, cancel: threading.Event
    ) -> Shard:
        """Pull, verify and commit ``key`` from a holder (worker thread); not yet cataloged."""
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

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a blocking control call in a worker thread."""
        async with self._control_limiter:
            return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)

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
            where = f"coordinator {self.coordinator_address}{how}"
        elif active is not None:
            where = f"coordinator not found yet ({self.rendezvous_note or 'looking'})"
        else:
            where = f"coordinator: {rendezvous}"
        summary = (
            f"{self.address or 'no server'}; {where}; "
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


def _done(state: str | None) -> bool:
    return bool(state) and (state == "present" or state.startswith("replicated"))  # type: ignore[union-attr]
