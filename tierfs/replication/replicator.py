"""The send side of the peer plane: replicate every sealed step to its peers (trio thread).

DESIGN.md "Peer plane", PROTOCOL.md section 4. After each seal the
:class:`Replicator` pushes the snapshot to the peers from
:func:`tierfs.replication.placement.peer_ranks`, at most
:data:`tierfs.replication.lanes.TRANSFERS` at once. A shard being sent is
pinned against retention; a withdrawn shard's transfers are cancelled; a
step retention would drop anyway is not sent ("superseded"). If the peer
already holds a shard with the same manifest digest (data parallelism:
identical bytes) only the manifest is sent and the peer hard-links its copy.
An unreachable peer is retried by the ``peer-push`` policy
(:mod:`tierfs.core.retry`); a copy the peer found corrupt in transit
(``DATA_LOSS``) is sent once more at once. A peer that restarted (a new
incarnation) gets the newest step again, and :meth:`Replicator.catch_up` sends
what a live peer lacks. The blocking push runs in a worker thread.

Per-peer states of a step (:attr:`Send.states`, shown by ``tierfs status``):
``queued``, ``sending``, ``retrying``, ``present`` (the peer had it),
``replicated``, ``replicated (manifest only)``, ``superseded``, ``cancelled``,
``failed`` (also reported in ``replicator.errors``).
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import trio

from tierfs.core import retry
from tierfs.core.control import JobSpec
from tierfs.core.ports import Catalog, CurrentJob, Reporter
from tierfs.core.types import NO_STEP
from tierfs.replication import placement
from tierfs.replication.addresses import AddressBook, replica_peers
from tierfs.replication.client import PeerClient, rpc_code, rpc_reason
from tierfs.replication.holdings import Holdings
from tierfs.replication.lanes import Lane
from tierfs.replication.transfer import Cancelled
from tierfs.store.saves import sealed_at
from tierfs.store.shards import Shard, ShardKey

log = logging.getLogger(__name__)

#: how long a sender waits for a data-parallel peer to seal the same step (seconds)
DP_WAIT = 30.0


@dataclass
class Send:
    """The transfers of one sealed step to its peers."""

    cancel: threading.Event = field(default_factory=threading.Event)
    #: peer rank -> state (see the module docstring)
    states: dict[int, str] = field(default_factory=dict)
    #: peer -> {"seconds": transfer time, "bytes": data bytes sent}
    timings: dict[int, dict[str, float]] = field(default_factory=dict)


def delivered(state: str | None) -> bool:
    """The peer holds the step: it had it (``present``) or it was replicated."""
    return bool(state) and (state == "present" or state.startswith("replicated"))  # type: ignore[union-attr]


class Replicator:
    """Sends this node's sealed steps to its replica peers (see the module docstring).

    Args:
        catalog: the held shards (what is retained, own steps newest first).
        job: the current job (read only).
        reporter: ``replicator.errors`` (a failed replication).
        client: pushes and inventories.
        book: the peers' addresses.
        holdings: pins a shard while it is sent.
        lane: the data lane (at most its capacity of transfers at once).
        active_job: the current job if it spans several nodes, else None.
        wake: asks for a heartbeat now (a peer's address is wanted, a step
            reached its peer).

    Attributes:
        sends: shard -> :class:`Send` (the dict object is never replaced).
    """

    def __init__(
        self,
        *,
        catalog: Catalog,
        job: CurrentJob,
        reporter: Reporter,
        client: PeerClient,
        book: AddressBook,
        holdings: Holdings,
        lane: Lane,
        active_job: Callable[[], JobSpec | None],
        wake: Callable[[], None],
    ) -> None:
        self.catalog = catalog
        self.current = job
        self.reporter = reporter
        self.client = client
        self.book = book
        self.holdings = holdings
        self.lane = lane
        self.active_job = active_job
        self.wake = wake
        self.sends: dict[ShardKey, Send] = {}
        self._nursery: trio.Nursery | None = None

    def start(self, nursery: trio.Nursery) -> None:
        """Run transfers in ``nursery`` from now on (none start before)."""
        self._nursery = nursery

    def stop(self) -> None:
        """Cancel every transfer (the daemon stops)."""
        for send in self.sends.values():
            send.cancel.set()

    # ------------------------------------------------------------------ catalog listeners

    def on_sealed(self, shard: Shard) -> None:
        """A step of this node was sealed: replicate it to the peers."""
        job = self.active_job()
        if job is None or shard.key.job != job.name or shard.key.rank != job.node_rank:
            return
        peers = replica_peers(job, self.book.gone)
        old = self.sends.pop(shard.key, None)
        if old is not None:
            old.cancel.set()
        send = self.sends[shard.key] = Send()
        if not peers:
            self.wake()
            return
        for p in peers:
            send.states[p] = "queued"
            self._start_send(shard, p, send)

    def on_withdrawn(self, key: ShardKey) -> None:
        """A shard left the catalog: cancel its transfers."""
        send = self.sends.pop(key, None)
        if send is not None:
            send.cancel.set()

    # ------------------------------------------------------------------ what the peers lack

    def replicated_step(self, job: JobSpec) -> int:
        """The newest own step replicated to every peer, sealed since the job (re)started
        (steps of the timeline before a restore are never reported)."""
        peers = replica_peers(job, self.book.gone)
        since = self.current.timeline_since
        for shard in self.catalog.own_shards(job):
            if sealed_at(shard.manifest) < since:
                # this seal's time, not the step's first (``created`` is kept across
                # saves of the step: a step saved again after a restore is of the
                # new timeline)
                break
            if not peers:
                return shard.key.step
            send = self.sends.get(shard.key)
            if send is not None and all(delivered(send.states.get(p)) for p in peers):
                return shard.key.step
        return NO_STEP

    def rereplicate(self, peer: int) -> None:
        """A peer came back (new incarnation): send it our newest step again."""
        job = self.active_job()
        if job is None or peer not in replica_peers(job, self.book.gone):
            return
        own = self.catalog.own_shards(job)
        if not own:
            return
        shard = own[0]
        send = self.sends.setdefault(shard.key, Send())
        if send.states.get(peer) in ("queued", "sending", "retrying"):
            return
        send.states[peer] = "queued"
        log.info("node-rank %d restarted: sending step %d again", peer, shard.key.step)
        self._start_send(shard, peer, send)

    def catch_up(self) -> None:
        """Send again what a live peer lacks: retained steps whose transfer to it
        failed, or that were sealed before the peer was known -- after a restart on
        another node count (issue #16) also the own parts of steps written by the
        old count, to the receivers of the new placement.

        Re-replication of a lost node's parts (issue #16): this node also sends
        its replicas of ranks the job no longer has (a step written by more
        nodes, or a rank declared gone: every retained step of theirs) to
        its own receivers, so a second node loss does not lose them. Other
        nodes find those copies by placement
        (:func:`tierfs.replication.files.holders_of`)."""
        job = self.active_job()
        if job is None:
            return
        peers = replica_peers(job, self.book.gone)
        for shard in [*self.catalog.own_shards(job), *self._orphans(job)]:
            if not self.catalog.retained(shard.key):
                continue
            send = self.sends.setdefault(shard.key, Send())
            for peer in peers:
                if self.book.reachable(peer) is None:
                    continue
                if send.states.get(peer) in (None, "failed"):
                    send.states[peer] = "queued"
                    log.info(
                        "sending step %d of rank %d to node-rank %d (it lacks it)",
                        shard.key.step,
                        shard.key.rank,
                        peer,
                    )
                    self._start_send(shard, peer, send)

    def _orphans(self, job: JobSpec) -> list[Shard]:
        """Every verified part held here of each rank ``job`` no longer has (its node
        count shrank since the step was written, or the rank was declared gone for
        good), newest first; the caller sends only retained ones. Not only the
        newest: a step written after the rank was lost lacks it, so a restore takes
        an older one (regression, new-user trial: only the newest part was copied
        again and the step a restore would use kept a single copy)."""
        orphans = [
            shard
            for shard in self.catalog.shards_of(job.name)
            if (shard.key.rank >= job.nodes or shard.key.rank in self.book.gone) and shard.verified
        ]
        return sorted(orphans, key=lambda s: s.key.step, reverse=True)

    # ------------------------------------------------------------------ one transfer

    def _start_send(self, shard: Shard, peer: int, send: Send) -> None:
        if self._nursery is None:
            return
        self.holdings.pin_now(shard.key, +1)
        self._nursery.start_soon(self._replicate, shard, peer, send)

    async def _replicate(self, shard: Shard, peer: int, send: Send) -> None:
        key = shard.key
        job = self.current.job
        dp = bool(
            job
            and job.assume_data_parallelism
            and key.rank < job.nodes
            and peer in placement.column_of(key.rank, job.nodes, job.assume_data_parallelism)
        )
        # how long a push is retried while its peer is unreachable: policy peer-push
        backoff = retry.peer_push().backoff(trio.current_time)
        data_loss = 0
        try:
            async with self.lane.limiter:
                while not send.cancel.is_set():
                    if not self.catalog.retained(key):
                        send.states[peer] = "superseded"
                        return
                    info = self.book.peers.get(peer)
                    if info is None or not info.address:
                        if backoff.expired():
                            send.states[peer] = "failed"
                            self.reporter.error(
                                f"replication of step {key.step} to node-rank {peer} failed: "
                                "its address is unknown (it never joined the coordinator)"
                            )
                            return
                        self.wake()
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
                        if code == grpc.StatusCode.ALREADY_EXISTS:
                            # the peer holds a later save of this step (a renumbered
                            # node's old part, #16 F8; this node's next save of the
                            # step, pulled first, #14 trial 65): nothing to send
                            send.states[peer] = "superseded"
                            log.info(
                                "node-rank %d keeps its later save of %s: %s",
                                peer,
                                key,
                                rpc_reason(exc),
                            )
                            return
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
                    self.wake()
                    return
                send.states[peer] = "cancelled"
        finally:
            self.holdings.pin_now(key, -1)

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
