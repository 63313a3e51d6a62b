"""Restores from the bucket, as the GCS tier serves them (trio thread and workers).

* :meth:`BucketRestore.read_bucket` reads what the bucket holds for a restore
  (``restore.version``'s round, else the newest rounds with every complete
  node part and why incomplete rounds are incomplete). With a coordinator,
  node-rank 0 installs it as the coordinator's bucket reader: the coordinator
  decides over every node's RAM and the bucket at once (no decision before
  the reader answered). Without one (one node, or no peer plane),
  :class:`tierfs.node.restorer.Restorer` decides with the same rule on
  the node alone.
* :meth:`BucketRestore.fetch_backup` brings the parts a node needs (the
  :class:`tierfs.core.ports.BackupFetch` port): its own copy when it holds the
  same bytes, else a verified download.
* :meth:`BucketRestore.fetch_file` hands over one file of another rank's part
  (the :class:`tierfs.core.ports.FileSource` port, issue #14), from the
  newest round holding it.
* :meth:`BucketRestore.note_restored` restarts the one-node schedule from a
  finished restore; ``restore.version`` is deleted by the deciding node once
  every node has sealed and replicated a newer step than the one restored
  through it (:meth:`BucketRestore.maybe_delete_restore_version`).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from tierfs.backup.client import describe_error
from tierfs.backup.errors import BackupCopyError
from tierfs.backup.health import BucketAccess
from tierfs.backup.judge import RoundInfo
from tierfs.backup.layout import NodeBackup
from tierfs.backup.progress import Roles, RoundMemory
from tierfs.backup.round_verdict import judge_round_step
from tierfs.backup.uploads import Upload
from tierfs.core import rounds as S
from tierfs.core import settings
from tierfs.core.errors import NO_ROOM_ERRNOS, FetchFailed
from tierfs.core.ports import Catalog, PositionalWrite, RamBudget
from tierfs.core.types import BucketPart, BucketView, RestorePlan
from tierfs.store.manifest import Manifest
from tierfs.store.shards import Shard, ShardKey, ShardStore
from tierfs.store.verdicts import eligibility

if TYPE_CHECKING:
    from tierfs.core.control import JobSpec

log = logging.getLogger(__name__)


def _complete_parts(info: RoundInfo) -> list[BucketPart]:
    """Every complete node part of an inspected round, with its seal-time verdict (pure)."""
    out = []
    for (rank, step), part in sorted(info.parts.items()):
        if not part.complete:
            continue
        if part.backup is None:  # a round written by MTC: no manifest, no verdict
            out.append(BucketPart(info.name, rank, step))
            continue
        manifest = part.backup.manifest
        out.append(
            BucketPart(
                info.name,
                rank,
                step,
                manifest.digest,
                *eligibility(manifest),
                nodes=manifest.nodes or part.backup.nodes,
                replaces=manifest.replaces,
            )
        )
    return out


#: seconds the round names and part manifests a file fetch read are reused
FILE_LOOKUP_TTL = 5.0
#: file downloads at once (:meth:`BucketRestore.fetch_file`; not shared with uploads)
FILE_FETCHES = 4


class _NoRound(BackupCopyError):
    """No backup round holds the part (the lookups may be stale)."""


class FileLookups:
    """What file fetches read of the bucket, reused for :data:`FILE_LOOKUP_TTL` seconds
    (trio thread): a job's round names, a round's manifest of one part (None:
    the round holds none). Concurrent lookups of one key share one request.

    Args:
        access: the bucket (requests bounded by ``$TIERFS_GCS_LOOKUP_DEADLINE``).
        clock: monotonic seconds (tests).
    """

    def __init__(self, access: BucketAccess, clock: Callable[[], float] = time.monotonic) -> None:
        self.access = access
        self.clock = clock
        self._cache: dict[tuple[Any, ...], tuple[float, Any]] = {}
        self._locks: dict[tuple[Any, ...], trio.Lock] = {}

    async def round_names(self, job: str) -> list[str]:
        """The job's round names, newest first.

        Raises:
            google.api_core exceptions, BucketTimeout.
        """
        names: list[str] = await self._get(("names", job), "list_round_names", job)
        return names

    async def part(self, job: str, round_name: str, rank: int, step: int) -> NodeBackup | None:
        """Node ``rank``'s manifest of ``step`` in a round, or None
        (:meth:`tierfs.backup.listing.RoundListing.read_part`).

        Raises:
            LayoutError, google.api_core exceptions, BucketTimeout.
        """
        part: NodeBackup | None = await self._get(
            ("part", job, round_name, rank, step), "read_part", job, round_name, rank, step
        )
        return part

    def forget(self, job: str) -> None:
        """Drop what is kept of ``job`` (a lookup found no round holding a part: a
        round may have completed since, e.g. while a part's manifest was looked for)."""
        for key in [k for k in self._cache if job in k[1:2]]:
            del self._cache[key]

    async def _get(self, key: tuple[Any, ...], method: str, *args: Any) -> Any:
        """The cached value of ``key``, else ``backend.rounds.<method>(*args)`` (a
        control thread), cached; one request at a time per key."""
        lock = self._locks.setdefault(key, trio.Lock())
        try:
            async with lock:
                hit = self._cache.get(key)
                if hit is not None and hit[0] > self.clock():
                    return hit[1]
                backend = await self.access.call(
                    self.access.bounded, settings.GCS_LOOKUP_DEADLINE.get()
                )
                value = await self.access.call(getattr(backend.rounds, method), *args)
                now = self.clock()
                for old in [k for k, (until, _) in self._cache.items() if until <= now]:
                    del self._cache[old]
                self._cache[key] = (now + FILE_LOOKUP_TTL, value)
                return value
        finally:
            if not lock.locked():  # nobody waits for it (a release hands it to a waiter)
                self._locks.pop(key, None)


class BucketRestore:
    """The restore side of the GCS tier (see the module docstring).

    Args:
        catalog: the held shards (a fetched shard is added there).
        shards: the store of committed shards (downloads are committed there).
        budget: the RAM budget (a download must fit).
        access: the bucket.
        memory: the rounds' state (the schedule a restore restarts, ``forced``).
        roles: the synced step (``restore.version``'s deletion).
        limiter: one transfer at a time (shared with uploads).
    """

    def __init__(
        self,
        *,
        catalog: Catalog,
        shards: ShardStore,
        budget: RamBudget,
        access: BucketAccess,
        memory: RoundMemory,
        roles: Roles,
        limiter: trio.CapacityLimiter,
    ) -> None:
        self.catalog = catalog
        self.shards = shards
        self.budget = budget
        self.access = access
        self.spec = access.spec
        self.memory = memory
        self.roles = roles
        self.limiter = limiter
        self._files = FileLookups(access)
        self._file_limiter = trio.CapacityLimiter(FILE_FETCHES)

    def note_restored(self, job: JobSpec, plan: RestorePlan, forced: str | None) -> None:
        """Record a finished restore plan (trio thread): the one-node schedule restarts
        from it (:func:`tierfs.core.rounds.restart_timeline`); a restore
        through ``restore.version`` is remembered for its deletion."""
        self.memory.take_job(job)
        self.memory.seeded = False
        self.memory.restored_here = True
        # steps sealed before the restore belong to the old timeline (see the follower)
        self.memory.epoch = time.time()
        shard = plan.shard
        self.memory.state = S.restart_timeline(
            self.memory.state,
            backup=plan.backup,
            step=plan.step,
            now=self.memory.epoch,
            parts={shard.key.rank: shard.manifest.digest} if shard is not None else None,
        )
        if forced is not None:
            self.memory.forced = (job.name, forced, plan.step or 0, time.time())

    async def fetch_backup(
        self, agent: Any, job: JobSpec, step: int, backup: str, digest: str = ""
    ) -> Shard:
        """Bring this node's shard of ``step`` from round ``backup``
        (:class:`tierfs.core.ports.BackupFetch`): the node's own copy when it holds the
        same bytes, else a verified download. ``digest``: the bytes the decision
        chose ("": any). ``agent``: the restoring node (``verify_shard``,
        ``restore_state``).

        Returns:
            the committed shard (in the catalog).

        Raises:
            BackupCopyError: one line why this round's copy cannot be used (corrupt,
                incomplete, other bytes, unreadable, no room).
        """
        key = ShardKey(job.name, job.node_rank, step)
        try:
            backend = await self.access.call(self.access.get_backend)
            # the round index: two GETs instead of judging the whole round on every node
            info = await self.access.call(
                functools.partial(
                    self.access.bounded(settings.GCS_LOOKUP_DEADLINE.get()).inspect_part,
                    fallback=job.nodes,
                ),
                job.name,
                backup,
                job.node_rank,
                step,
            )
        except Exception as exc:
            raise BackupCopyError(
                f"backup round {backup} cannot be read: {describe_error(exc)}"
            ) from None
        part = info.parts.get((job.node_rank, step))
        if (
            digest
            and part is not None
            and part.backup is not None
            and part.backup.manifest.digest != digest
        ):
            raise BackupCopyError(
                f"backup round {backup} holds other bytes of step {step} for rank {job.node_rank}"
            )
        local = self.catalog.get(key)
        if (
            local is not None
            and part is not None
            and part.backup is not None
            and part.backup.manifest.digest == local.manifest.digest
            and await agent.verify_shard(local)
        ):
            log.info("restore: step %d of round %s is already here", step, backup)
            return local
        cancel = threading.Event()
        up = Upload(backup, step, part.bytes if part else 0, cancel, time.time())
        agent.restore_state.update(
            {"phase": f"downloading step {step} from backup round {backup}", "source": "gcs"}
        )
        try:
            async with self.limiter:
                shard: Shard = await trio.to_thread.run_sync(
                    functools.partial(
                        backend.restore_shard,
                        self.shards,
                        job.name,
                        backup,
                        job.node_rank,
                        step,
                        info=info,
                        framework=job.framework,
                        cancel=cancel,
                        on_bytes=up.add,
                        free_bytes=self.budget.free(),
                    ),
                    abandon_on_cancel=True,
                )
        except Exception as exc:
            raise BackupCopyError(
                f"step {step} of node-rank {job.node_rank} from backup "
                f"round {backup} failed: {describe_error(exc)}"
            ) from None
        finally:
            cancel.set()
        self.catalog.add(shard)
        self.access.ok()
        log.info(
            "restored step %d of rank %d from backup round %s (%d bytes, verified)",
            step,
            job.node_rank,
            backup,
            shard.bytes,
        )
        return shard

    # ------------------------------------------------------------------ one file (FileSource)

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
        write: PositionalWrite | None = None,
    ) -> str:
        """Write file ``path`` of node ``rank``'s part of ``step`` into ``fd`` from a
        backup round (a :class:`tierfs.core.ports.FileSource`; trio thread).

        The rounds of ``job`` holding a tierfs manifest of that part, newest
        first: those whose manifest digest is ``digest`` (any with ""), then the
        others. A part need not be complete: the one object is checked against
        its manifest's size and crc32c while it is written
        (:meth:`tierfs.backup.download.Downloader.download_file`, positional
        writes from offset 0 through a duplicate of ``fd``, or through ``write``:
        see :class:`tierfs.core.ports.FileSource`). Rounds written by
        MTC (no tierfs manifest) are not searched.

        Requests: the round names (one listing) and each round's manifest of
        that part (one GET per round, newest first, until a round serves) are
        cached for :data:`FILE_LOOKUP_TTL` seconds, so a burst of fetches of one
        part costs one listing and one GET per round looked at, then one object
        download (one GET, resumed on retries) per file. Lookups run in the
        control threads, each request bounded by ``$TIERFS_GCS_LOOKUP_DEADLINE``;
        downloads in :data:`FILE_FETCHES` threads of their own (not behind an
        upload), with the bucket's retry deadline.

        Returns:
            the round that served, ``"bucket round <name>"`` (what ``skip`` names).

        Raises:
            tierfs.core.errors.FetchFailed: no round served; the message names every
                round tried and why. A write into ``fd`` that found no room
                (ENOSPC) ends the fetch at once, with the ``OSError`` as its cause.
        """
        what = f"{path} of step {step} of node-rank {rank}"
        for fresh in (False, True):
            try:
                return await self._fetch_file_once(job, rank, step, digest, path, fd, skip, write)
            except _NoRound:
                if fresh:
                    break
                self._files.forget(job)  # the cached lookups may be from before the round
        raise FetchFailed(f"{what} from {self.spec}{job}: no backup round holds it")

    async def _fetch_file_once(
        self,
        job: str,
        rank: int,
        step: int,
        digest: str,
        path: str,
        fd: int,
        skip: frozenset[str],
        write: PositionalWrite | None = None,
    ) -> str:
        """One pass of :meth:`fetch_file` over the (cached) lookups.

        Raises:
            _NoRound: no round holds the part; FetchFailed: as :meth:`fetch_file`.
        """
        what = f"{path} of step {step} of node-rank {rank}"
        try:
            names = await self._files.round_names(job)
        except Exception as exc:
            raise FetchFailed(
                f"{what} from the bucket: its rounds could not be listed ({describe_error(exc)})"
            ) from None
        tried: list[str] = []
        other: list[tuple[str, str, NodeBackup]] = []
        for name in names:
            label = f"bucket round {name}"
            if label in skip:
                tried.append(f"{label}: skipped (it served wrong bytes before)")
                continue
            try:
                part = await self._files.part(job, name, rank, step)
            except Exception as exc:
                tried.append(f"{label}: its manifest cannot be read ({describe_error(exc)})")
                continue
            if part is None:
                continue
            if digest and part.manifest.digest != digest:
                other.append((label, name, part))
                continue
            why = await self._download_file(job, name, part, path, fd, write)
            if why is None:
                return label
            tried.append(f"{label}: {why}")
        for label, name, part in other:
            why = await self._download_file(job, name, part, path, fd, write)
            if why is None:
                return label
            tried.append(f"{label} (other bytes of the step): {why}")
        if not tried and not other:
            raise _NoRound(what)
        raise FetchFailed(f"{what} from {self.spec}{job}: " + "; ".join(tried))

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
        """Node ``rank``'s manifest of its part of ``step`` from a backup round (a
        :class:`tierfs.core.ports.ManifestSource`, for the whole-step view when that
        node cannot say): round ``round_name``'s when given and it holds one (the
        round the restore of ``step`` decided), else the newest round holding one;
        a part written by another node count than ``writers`` (0: any) is another
        save of the step and never taken, and so is a round holding another part
        of rank ``beside[0]`` than digest ``beside[1]`` (the asking node's own
        part: that round is of another save of the step). None when no round
        holds it or the bucket cannot be read. Same cached lookups as
        :meth:`fetch_file`. Never raises.

        Regression (fault campaign seed 29 #14): a step number saved again after a
        restore to an older step (the abandoned history's save of it was in a
        round); node 3 was killed and restarting, and the other nodes' views took
        its part from that round: they showed its ``_BACKUP_REQUESTED``, a file the
        new save of the step does not have.

        Regression (#16 fourth trial): after a restore from round 22-06 (step 20,
        saved by 4 nodes), the view took lost rank 2's part from the newer round
        22-07, another save of step 20 by 3 nodes whose round was cut off; the file
        had the same size and dcp.load returned rank 2's values of the other save."""
        try:
            names = await self._files.round_names(job)
            if round_name in names:
                names = [round_name, *(n for n in names if n != round_name)]
            for name in names:
                part = await self._files.part(job, name, rank, step)
                if part is None:
                    continue
                wrote = part.manifest.nodes or part.nodes
                if writers and wrote and wrote != writers:
                    continue
                if beside is not None and beside[0] != rank:
                    mine = await self._files.part(job, name, beside[0], step)
                    if mine is not None and mine.manifest.digest != beside[1]:
                        log.debug(
                            "round %s holds another part of step %d of rank %d than %s: "
                            "another save; its part of rank %d not taken",
                            name,
                            step,
                            beside[0],
                            beside[1][:12],
                            rank,
                        )
                        continue
                return part.manifest
        except Exception as exc:
            log.debug("manifest of step %d of rank %d from the bucket: %s", step, rank, exc)
        return None

    async def _download_file(
        self,
        job: str,
        round_name: str,
        part: NodeBackup,
        path: str,
        fd: int,
        write: PositionalWrite | None = None,
    ) -> str | None:
        """One round's copy of the file into ``fd`` (a worker thread): None when it
        served, else why not (one line).

        Raises:
            FetchFailed: ``fd`` has no room (ENOSPC, EDQUOT, EFBIG), from the ``OSError``.
        """
        m = part.manifest
        cancel = threading.Event()
        try:
            async with self._file_limiter:
                backend = await self.access.call(self.access.get_backend)
                own = os.dup(fd)

                def download() -> int:
                    try:
                        return int(
                            backend.downloads.download_file(
                                job,
                                round_name,
                                m.rank,
                                m.step,
                                path,
                                own,
                                part=part,
                                cancel=cancel,
                                write=write,
                            )
                        )
                    finally:
                        os.close(own)

                await trio.to_thread.run_sync(download, abandon_on_cancel=True)
        except OSError as exc:
            if exc.errno in NO_ROOM_ERRNOS:
                raise FetchFailed(
                    f"{path} of step {m.step} of node-rank {m.rank}: no room for it "
                    f"here ({exc.strerror or exc})"
                ) from exc
            why = describe_error(exc)
        except Exception as exc:
            why = describe_error(exc)
        else:
            self.access.ok()
            return None
        finally:
            cancel.set()
        log.info("file %s of round %s: %s", path, round_name, why)
        return why

    def read_bucket(
        self,
        job: str,
        nodes: int,
        depth: int = 1,
        *,
        deadline: float | None = None,
        report: Callable[[str], None] | None = None,
    ) -> BucketView:
        """What the bucket holds for a restore of ``job`` with ``nodes`` nodes (blocking;
        the coordinator's reader, or the node's own on one node).

        ``restore.version`` first: if it names a round, only that round (its
        step complete for every node, or why it cannot be restored). Else the
        rounds newest first until ``depth`` complete ones were read, with
        every complete node part found and, for each round without a complete
        step, why. Each request gives up after ``deadline`` seconds (default
        ``$TIERFS_GCS_LOOKUP_DEADLINE``).

        Returns:
            the view; a bucket that cannot be read gives a view with ``error``
            (and ``report(line)`` is called with a line for replicator.errors).
        """
        try:
            backend = self.access.bounded(
                settings.GCS_LOOKUP_DEADLINE.get() if deadline is None else deadline
            )
        except Exception as exc:
            return self._unreadable(
                f"cannot create the GCS client: {describe_error(exc)}", depth, report
            )
        try:
            forced = backend.read_restore_version(job)
        except Exception as exc:
            return self._unreadable(
                f"cannot read restore.version from {self.spec} ({describe_error(exc)})",
                depth,
                report,
            )
        try:
            if forced is not None:
                choice = backend.choose_restore(job, nodes)
                if choice.forced:
                    log.info("restore: %s", choice.reason)
                    info = choice.info
                    parts = _complete_parts(info) if info is not None else []
                    return BucketView(
                        tuple(p for p in parts if p.step == choice.step),
                        rounds=(forced,),
                        forced=forced,
                        forced_step=choice.step,
                        forced_problem=None if choice.step is not None else choice.reason,
                        depth=depth,
                    )
            names = backend.list_round_names(job)
            parts = []
            incomplete = []
            read = []
            judged = []
            complete = 0
            for name in names:
                if complete >= depth:
                    break
                # judged against the node count that wrote the round (issue #16)
                info = backend.inspect_round(job, name, fallback=nodes)
                read.append(name)
                parts.extend(_complete_parts(info))
                if info.complete_step is not None:
                    complete += 1
                    if (found := judge_round_step(backend, job, info)) is not None:
                        judged.append(found)
                    self._ensure_index(backend, job, name)
                elif info.parts:
                    incomplete.append(
                        (name, info.step_for_display(), "; ".join(info.problems()[:3]))
                    )
        except Exception as exc:
            return self._unreadable(
                f"the backup rounds of {self.spec}{job} could not be "
                f"listed ({describe_error(exc)})",
                depth,
                report,
            )
        self.access.ok()
        return BucketView(
            tuple(parts),
            tuple(incomplete),
            tuple(read),
            exhausted=len(read) == len(names),
            depth=depth,
            judged=tuple(judged),
        )

    @staticmethod
    def _ensure_index(backend: Any, job: str, name: str) -> None:
        """Write the index of the complete round ``name`` if it has none, before any
        node restores from it (each then reads its part in two GETs instead of
        listing the round); a failure only costs the nodes those listings."""
        try:
            if backend.ensure_round_index(job, name) is not None:
                log.info("backup round %s had no index: written for the restore", name)
        except Exception as exc:
            log.info("backup round %s: index not written: %s", name, describe_error(exc))

    def _unreadable(
        self, line: str, depth: int, report: Callable[[str], None] | None
    ) -> BucketView:
        log.warning("restore: %s", line)
        if report is not None:
            report(f"restore: {line}; deciding without the bucket")
        return BucketView(error=line, depth=depth)

    # ------------------------------------------------------------------ restore.version

    async def maybe_delete_restore_version(self, job: JobSpec) -> None:
        if self.memory.forced is None or self.memory.forced[0] != job.name:
            return
        _job, rnd, step, since = self.memory.forced
        synced = self.roles.synced_step(job)
        if synced is None or synced <= step:
            return
        own = self.catalog.get(ShardKey(job.name, job.node_rank, synced))
        if own is None or own.manifest.created < since:
            return  # a sync round from before that restore
        try:
            existed = await self.access.call(
                self.access.get_backend().delete_restore_version, job.name
            )
        except Exception as exc:
            log.info("deleting restore.version: %s", describe_error(exc))
            return
        self.memory.forced = None
        if existed:
            log.info(
                "restore.version (%s) deleted: every node sealed and replicated step %d "
                "after restoring step %d",
                rnd,
                synced,
                step,
            )
