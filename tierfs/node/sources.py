"""Where a restoring node's shard comes from (:class:`tierfs.core.ports.RestoreSource`).

Three sources, tried in this order by :class:`tierfs.node.restorer.Restorer`
(PROTOCOL.md section 4, DESIGN.md "Durable plane"):

* :class:`LocalSource` (``local``): the copy already in this node's catalog;
* :class:`PeerSource` (``peer:<rank>``): a pull from a peer holding the same
  bytes (:meth:`tierfs.replication.peer.PeerTier.pull`, every chunk and file
  checked against the manifest);
* :class:`BucketSource` (``gcs:<round>``): a download from a backup round
  (:meth:`tierfs.backup.tier.GcsTier.fetch_backup`, verified).

Each returns the shard in the catalog or raises :class:`CopyFailed` with the
reason (and the ``replicator.errors`` line, if any); the restorer goes on
with the next source. :class:`BucketRestoreSide` is the restorer's view of
the bucket (:class:`tierfs.core.ports.BucketRestore`).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import grpc
import trio

from tierfs.core import settings
from tierfs.core.errors import RestoreError
from tierfs.core.ports import Catalog, RestoreProgress, Verifier
from tierfs.core.types import BucketView, RestorePlan
from tierfs.replication.client import rpc_code, rpc_reason
from tierfs.replication.transfer import BadCopy, Refused, TransferError
from tierfs.store.shards import ShardKey

if TYPE_CHECKING:
    from tierfs.backup.tier import GcsTier
    from tierfs.core.control import JobSpec
    from tierfs.replication.peer import PeerTier
    from tierfs.store.shards import Shard

log = logging.getLogger(__name__)

#: seconds a restore pull that found its holder unreachable waits for a connection
#: before the copy counts as failed (a daemon restarted during the restore listens
#: again within about a second)
RECONNECT_WAIT = 3.0


class CopyFailed(RestoreError):
    """One source's copy cannot be used; the restorer tries the next source.

    Attributes:
        reason: one line why (the coordinator's "no usable copy" detail, the
            one-node decision's notes).
        line: the ``replicator.errors`` line the restorer writes, or None (only
            logged: an unreachable peer, a copy gone meanwhile).
    """

    def __init__(self, reason: str, line: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.line = line


class LocalSource:
    """This node's own copy (``local``), as the catalog holds it.

    The restorer verifies local copies itself (all of them before a
    coordinated round, the chosen one when it decides alone), so this source
    only checks that the copy is still there with the decided bytes.
    """

    name = "local"
    round: str | None = None

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    async def fetch(self, job: JobSpec, step: int, digest: str) -> Shard:
        """The catalog's shard of ``step`` (rank ``job.node_rank``).

        Raises:
            CopyFailed: it is gone or holds other bytes than ``digest``.
        """
        shard = self.catalog.get(ShardKey(job.name, job.node_rank, step))
        if shard is None or (digest and shard.manifest.digest != digest):
            raise CopyFailed("its own copy is gone or holds other bytes")
        return shard


class PeerSource:
    """A pull from node-rank ``holder`` at ``address`` (``peer:<holder>``).

    Args:
        tier: the node's peer tier (:meth:`~tierfs.replication.peer.PeerTier.pull`,
            its wire counters).
        catalog: where the pulled shard is registered.
        progress: the restore's phase.
        holder: the peer's node rank.
        address: its ``HOST:PORT``.
    """

    round: str | None = None

    def __init__(
        self,
        tier: PeerTier,
        catalog: Catalog,
        progress: RestoreProgress,
        holder: int,
        address: str,
    ) -> None:
        self.tier = tier
        self.catalog = catalog
        self.progress = progress
        self.holder = holder
        self.address = address
        self.name = f"peer:{holder}"

    async def fetch(self, job: JobSpec, step: int, digest: str) -> Shard:
        """Pull, verify and catalog this node's shard of ``step`` from the peer.

        Raises:
            CopyFailed: the peer's copy is bad or refused (a line in
                ``replicator.errors``), or the pull failed (unreachable, I/O;
                logged).
        """
        key = ShardKey(job.name, job.node_rank, step)
        self.progress.progress(
            {"phase": f"pulling step {step} from node-rank {self.holder}", "source": self.name}
        )
        cancel = threading.Event()
        try:
            try:
                shard = await self.tier.pull(self.address, key, digest, cancel)
            except grpc.RpcError as exc:
                if rpc_code(exc) != grpc.StatusCode.UNAVAILABLE or not await self.tier.reachable(
                    self.address, RECONNECT_WAIT
                ):
                    raise
                # the holder listens again (a daemon restarted during the restore, whose
                # Join opened this round): the channel's last failure was its backoff's
                # (fault campaign seed 29 #4: step 10 of a lost node's rank refused twice,
                # step 7 restored from the bucket)
                log.info("node-rank %d answers again: pulling %s again", self.holder, key)
                shard = await self.tier.pull(self.address, key, digest, cancel)
        except (BadCopy, Refused) as exc:
            self.tier.stats.add("corrupt_copies")
            raise CopyFailed(
                f"node-rank {self.holder}'s copy is bad ({exc})",
                f"restore: the copy of step {step} of rank {job.node_rank} on node-rank "
                f"{self.holder} is bad ({exc}); trying another copy",
            ) from None
        except (TransferError, grpc.RpcError, OSError) as exc:
            log.warning(
                "pulling %s from node-rank %d failed: %s", key, self.holder, rpc_reason(exc)
            )
            raise CopyFailed(
                f"pulling from node-rank {self.holder} failed ({rpc_reason(exc)})"
            ) from None
        finally:
            cancel.set()
        self.catalog.add(shard)
        log.info(
            "restored step %d of rank %d from node-rank %d (%d bytes, verified)",
            step,
            job.node_rank,
            self.holder,
            shard.bytes,
        )
        return shard


class PeerSources:
    """Makes the :class:`PeerSource` of each holder a decision names
    (:data:`tierfs.core.ports.PeerSources`)."""

    def __init__(self, tier: PeerTier, catalog: Catalog, progress: RestoreProgress) -> None:
        self.tier = tier
        self.catalog = catalog
        self.progress = progress

    def __call__(self, holder: int, address: str) -> PeerSource:
        return PeerSource(self.tier, self.catalog, self.progress, holder, address)


class _RestoreStateView:
    """``restore_state.update(fields)`` for :meth:`GcsTier.fetch_backup`: the progress port."""

    def __init__(self, progress: RestoreProgress) -> None:
        self._progress = progress

    def update(self, fields: Mapping[str, Any]) -> None:
        self._progress.progress(fields)


class _FetchCaller:
    """What :meth:`tierfs.backup.tier.GcsTier.fetch_backup` uses of its ``agent``
    argument -- ``verify_shard`` and ``restore_state.update`` -- and nothing else."""

    def __init__(self, verifier: Verifier, progress: RestoreProgress) -> None:
        self._verifier = verifier
        self.restore_state = _RestoreStateView(progress)

    async def verify_shard(self, shard: Shard) -> bool:
        return await self._verifier.verify(shard)


class BucketSource:
    """A download from backup round ``round`` (``gcs:<round>``).

    Args:
        tier: the node's GCS tier (:meth:`~tierfs.backup.tier.GcsTier.fetch_backup`).
        caller: what ``fetch_backup`` wants of the restoring node.
        round: the backup round name.
    """

    def __init__(self, tier: GcsTier, caller: _FetchCaller, round: str) -> None:
        self.tier = tier
        self.caller = caller
        self.round: str | None = round
        self.name = f"gcs:{round}"

    async def fetch(self, job: JobSpec, step: int, digest: str) -> Shard:
        """This node's shard of ``step`` from the round: its own copy when it holds the
        same bytes and they verify, else a verified download (in the catalog).

        Raises:
            CopyFailed: the round's copy cannot be used (corrupt, incomplete,
                other bytes, unreadable, no room); a line in ``replicator.errors``.
        """
        assert self.round is not None
        try:
            return await self.tier.fetch_backup(self.caller, job, step, self.round, digest)
        except Exception as exc:  # BackupCopyError, or anything else: the next copy
            raise CopyFailed(str(exc), f"restore: {exc}; trying another copy") from None


class BucketRestoreSide:
    """The bucket as the restorer sees it (:class:`tierfs.core.ports.BucketRestore`).

    Args:
        tier: the node's GCS tier (with ``--bucket``).
        verifier: re-checks a copy the node already holds before a round uses it.
        progress: the restore's phase.
    """

    def __init__(self, tier: GcsTier, verifier: Verifier, progress: RestoreProgress) -> None:
        self.tier = tier
        self.caller = _FetchCaller(verifier, progress)

    def source(self, round: str) -> BucketSource:
        """The source of backup round ``round``."""
        return BucketSource(self.tier, self.caller, round)

    async def view(self, job: JobSpec, depth: int) -> BucketView:
        """The bucket's rounds of ``job`` (worker thread, within
        ``$TIERFS_GCS_LOOKUP_DEADLINE``); read problems go to ``replicator.errors``."""
        tier = self.tier
        view = await trio.to_thread.run_sync(
            functools.partial(
                tier.read_bucket,
                job.name,
                job.nodes,
                depth,
                deadline=settings.GCS_LOOKUP_DEADLINE.get(),
                report=tier._fail_later,
            ),
            abandon_on_cancel=True,
        )
        while tier._pending_errors:
            tier.reporter.error(tier._pending_errors.popleft())
        return view

    def note_restored(self, job: JobSpec, plan: RestorePlan, forced: str | None) -> None:
        """The GCS tier's record of the restore (its backup schedule restarts)."""
        self.tier.note_restored(job, plan, forced)
