"""Finding the coordinator of a job (trio thread): static or through the bucket.

DESIGN.md "Peer plane", PROTOCOL.md section 2. Resolved when the job starts
and again whenever the coordinator stops answering:

* static: ``--coordinator HOST:PORT`` (VMs, tests);
* bucket: without ``--coordinator`` but with ``--bucket``, the daemon hands
  the finder the bucket's :class:`tierfs.core.ports.Rendezvous`. Every node
  publishes its own address to ``gs://<bucket>/<job>/.tierfs/nodes/<rank>``
  with its incarnation (:meth:`CoordinatorFinder.publisher`); node-rank 0 is
  the coordinator itself, the others read rank 0's record and *probe* it (an
  ``Inventory`` call must answer node-rank 0 of the job with the record's
  incarnation) before using it, so a record left by a previous daemon --
  dead, restarted, or now another rank -- is never used.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import trio

from tierfs.core import retry
from tierfs.core.control import JobSpec
from tierfs.core.errors import ClusterError
from tierfs.core.ports import Rendezvous, Reporter
from tierfs.core.types import COORDINATOR_RANK
from tierfs.replication.addresses import Endpoint
from tierfs.replication.client import PeerClient, rpc_reason

log = logging.getLogger(__name__)

#: least seconds between two bucket lookups of the rendezvous (and the publisher's tick)
LOOKUP_INTERVAL = 1.0
#: seconds a probe of a rendezvous address may take
PROBE_TIMEOUT = 5.0

#: runs a blocking control call in a worker thread: ``await call(fn, *args)``
ControlCall = Callable[..., Awaitable[Any]]


class _NotPublished(ClusterError):
    """This node's rendezvous record could not be written (retried by its publisher)."""


class CoordinatorFinder:
    """Where the coordinator of this node's job is (see the module docstring).

    Args:
        me: this node's endpoint (published; its address may change once the
            server bound ``HOST:0``).
        static: ``--coordinator HOST:PORT`` or None.
        rendezvous: the bucket rendezvous, or None.
        reporter: ``replicator.errors`` (node-rank 0's failed publish, once per job).
        client: probes a record's address with ``Inventory``.
        call: runs a blocking control call in a worker thread.
        active_job: the current job if it spans several nodes, else None.

    Attributes:
        coordinator_address: where this node last found the coordinator (the
            static address, its own, or the bucket's), or None.
        rendezvous_note: why the last bucket lookup found nothing, or None.
        publish_note: why this node's record could not be written, or None.
    """

    def __init__(
        self,
        me: Endpoint,
        *,
        static: str | None,
        rendezvous: Rendezvous | None,
        reporter: Reporter,
        client: PeerClient,
        call: ControlCall,
        active_job: Callable[[], JobSpec | None],
    ) -> None:
        self.me = me
        self.static = static
        self.rendezvous = rendezvous
        self.reporter = reporter
        self.client = client
        self.call = call
        self.active_job = active_job
        self.coordinator_address = static
        self.rendezvous_note: str | None = None
        self.publish_note: str | None = None
        self._found: tuple[tuple[str, int, int], str, str] | None = None
        self._published: tuple[tuple[str, int, int], str] | None = None
        self._publish_failed: tuple[str, int, int] | None = None
        self._looked_at = -math.inf
        self._find_lock = trio.Lock()
        self._publish_poke = trio.Event()

    async def find(self, job: JobSpec) -> str | None:
        """The coordinator's address for ``job`` (trio thread), or None if not found yet.

        Static: ``--coordinator``. Bucket: node-rank 0 is the coordinator
        (its record is written by :meth:`publisher`); the others use rank
        0's record once a probe confirmed it (see the module docstring).
        Once found, no I/O; else bucket reads happen at most every
        :data:`LOOKUP_INTERVAL` seconds (each bounded by the rendezvous's
        deadline plus :data:`PROBE_TIMEOUT`), and a failed lookup leaves a
        line in :attr:`rendezvous_note` and returns None: the caller retries.
        """
        if self.static:
            return self.static
        rdv = self.rendezvous
        address = self.me.address
        if rdv is None or not address or not self.me.listen:
            return None
        ident = (job.name, job.nodes, job.node_rank)
        if self._published != (ident, address):
            self._publish_poke.set()
        if job.node_rank == COORDINATOR_RANK:
            self.coordinator_address = address
            return address
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
            found, incarnation = rec
            problem = await self._probe(job, found, incarnation)
            if problem is not None:
                self.rendezvous_note = (
                    f"{where} is stale ({found}: {problem}); waiting "
                    "for node-rank 0 to publish again"
                )
                return None
            if self.coordinator_address != found:
                log.info("bucket rendezvous: the coordinator of job %s is at %s", job.name, found)
            self._found = (ident, found, incarnation)
            self.coordinator_address = found
            self.rendezvous_note = None
            return found

    async def publish_once(self, job: JobSpec) -> bool:
        """Write this node's rendezvous record for ``job`` unless it is there (trio thread).

        Returns True when the record is written. A failure is kept in
        :attr:`publish_note`; node-rank 0 also reports it once per job in
        ``replicator.errors`` (the others cannot find it meanwhile).
        """
        rdv = self.rendezvous
        address = self.me.address
        if rdv is None or self.static or not self.me.listen or not address:
            return True
        ident = (job.name, job.nodes, job.node_rank)
        if self._published == (ident, address):
            return True
        try:
            await rdv.publish(job.name, job.node_rank, address, self.me.incarnation)
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
        self._published = (ident, address)
        self._publish_failed = None
        self.publish_note = None
        log.info(
            "bucket rendezvous: published %s as node-rank %d of job %s",
            address,
            job.node_rank,
            job.name,
        )
        return True

    async def publisher(self) -> None:
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

    def lost(self) -> None:
        """A coordinator call failed: with the bucket rendezvous, look it up again."""
        if self.rendezvous is not None and not self.static:
            self._found = None
