"""The GCS tier's storage operations: backup rounds in the MTC bucket layout.

Every function and method here blocks (HTTP, file I/O): the node agent calls
them from worker threads (``trio.to_thread.run_sync`` with a limiter), the
CLI and the benchmark call them directly.

Two classes:

* :class:`ObjectStore`, the google-cloud-storage adapter of one bucket: the
  library's bucket and client, and the one request wrapper
  (:meth:`ObjectStore.request`: ``retry=`` and ``timeout=`` for one library
  call, with every HTTP request inside capped at the retry deadline,
  :mod:`tierfs.backup.monitor`), and the small-object calls every other module
  uses (get, put with crc32c, delete, list).
* :class:`GcsBackend`, the facade the rest of tierfs uses: ``restore.version``,
  the rendezvous records, and the round operations of its collaborators, each
  built on the same :class:`ObjectStore`:

  - :class:`tierfs.backup.listing.RoundListing`: listing and judging rounds,
    choosing the round to restore;
  - :class:`tierfs.backup.upload.Uploader`: a node's part of a round (what a
    node does in a backup round is described there);
  - :class:`tierfs.backup.download.Downloader`: a node's part back into the RAM
    store, verified;
  - :class:`tierfs.backup.tidy.RoundCleaner`: deleting rounds and what failed
    rounds left behind.

A round is usable for a node only when its pointer exists and every data
object its manifest names exists with the manifest's size and crc32c
(:meth:`GcsBackend.inspect_round`, judged by :mod:`tierfs.backup.judge`);
rounds cut off half-way are never chosen.

Settings, the client, retries and what a failure means are
:mod:`tierfs.backup.client`; deadlines and the bucket monitor
:mod:`tierfs.backup.monitor`. Their names are re-exported here.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from tierfs.backup import layout as L
from tierfs.backup.client import MULTIPART_MAX as MULTIPART_MAX
from tierfs.backup.client import GcsSettings as GcsSettings
from tierfs.backup.client import MiB as MiB
from tierfs.backup.client import crc_b64 as crc_b64
from tierfs.backup.client import crc_from_b64 as crc_from_b64
from tierfs.backup.client import default_threads as default_threads
from tierfs.backup.client import describe_error as describe_error
from tierfs.backup.client import is_transient as is_transient
from tierfs.backup.client import make_client as make_client
from tierfs.backup.client import make_retry as make_retry
from tierfs.backup.client import widen_pool as _widen_pool
from tierfs.backup.download import Downloader
from tierfs.backup.download import synthesize_manifest as synthesize_manifest
from tierfs.backup.errors import BucketTimeout as BucketTimeout
from tierfs.backup.errors import Cancelled as Cancelled
from tierfs.backup.errors import ChecksumMismatch as ChecksumMismatch
from tierfs.backup.errors import GcsError as GcsError
from tierfs.backup.errors import IncompleteRound as IncompleteRound
from tierfs.backup.judge import NodeEntry as NodeEntry
from tierfs.backup.judge import ObjectInfo
from tierfs.backup.judge import RoundInfo as RoundInfo
from tierfs.backup.judge import apply_job_nodes as apply_job_nodes
from tierfs.backup.judge import infer_job_nodes as infer_job_nodes
from tierfs.backup.judge import judge_round as judge_round
from tierfs.backup.layout import BucketSpec, LayoutError
from tierfs.backup.listing import RestoreChoice as RestoreChoice
from tierfs.backup.listing import RoundListing
from tierfs.backup.monitor import BucketMonitor as BucketMonitor
from tierfs.backup.monitor import deadline_scope
from tierfs.backup.monitor import monitor_of as monitor_of
from tierfs.backup.rendezvous import wait_for_address
from tierfs.backup.round_index import RoundIndex, RoundIndexes
from tierfs.backup.tidy import RoundCleaner
from tierfs.backup.upload import Uploader, await_objects
from tierfs.backup.upload import UploadResult as UploadResult
from tierfs.core import retry
from tierfs.store.manifest import Manifest
from tierfs.store.shards import Shard, ShardStore

log = logging.getLogger(__name__)

#: the old private name (tests of the retry table use it)
_make_retry = make_retry


class ObjectStore:
    """One bucket's objects through google-cloud-storage, every call bounded.

    Args:
        spec: bucket and prefix.
        client: a ``google.cloud.storage.Client``.
        settings: tuning (threads, retry deadline, timeouts).
        on_retry: called (any thread) with each retryable failure before its retry.

    Attributes:
        bucket: the library's bucket object (``blob(name)`` for transfers).
        monitor: the client's :class:`BucketMonitor` (shared by every store on
            the same client), or None if the client's session could not be wrapped.

    Every request, its retries included, ends within ``settings.retry_deadline``
    seconds: each HTTP attempt's timeout is capped at the time left (a
    resumable upload gets that much per chunk). Thread-safe.
    """

    def __init__(
        self,
        spec: BucketSpec,
        client: Any,
        settings: GcsSettings,
        on_retry: Callable[[Exception], None] | None = None,
    ) -> None:
        self.spec = spec
        self.settings = settings
        self.client = client
        self.monitor = monitor_of(client)
        if self.monitor is not None:
            self.monitor.gate.configure(settings.retry_initial, settings.retry_max)
        self.bucket = client.bucket(spec.bucket)
        self.on_retry = on_retry
        self.retry = make_retry(settings.policy(), self._retrying)
        self.timeout = (
            min(settings.connect_timeout, settings.retry_deadline),
            min(settings.read_timeout, settings.retry_deadline),
        )

    def _retrying(self, exc: Exception) -> None:
        log.info("GCS request failed, retrying: %s", describe_error(exc))
        if self.on_retry is not None:
            try:
                self.on_retry(exc)
            except Exception:  # a status hook must never break a transfer
                log.debug("on_retry hook failed", exc_info=True)

    @contextlib.contextmanager
    def request(self) -> Iterator[dict[str, Any]]:
        """``retry=`` and ``timeout=`` for one library call; inside the block every HTTP
        request of this thread is capped at ``settings.retry_deadline`` from now
        (:class:`BucketMonitor`; a resumable upload's stream moves that deadline
        at each chunk).
        """
        with deadline_scope(time.monotonic() + self.settings.retry_deadline):
            yield {"retry": self.retry, "timeout": self.timeout}

    def exists(self) -> bool:
        """True if the bucket exists.

        Raises:
            google.api_core exceptions after retries; BucketTimeout.
        """
        with self.request() as kw:
            return bool(self.bucket.exists(**kw))

    def get_bytes(self, name: str) -> bytes | None:
        """The contents of object ``name`` (None: not found)."""
        from google.api_core import exceptions as gexc

        try:
            with self.request() as kw:
                data: bytes = self.bucket.blob(name).download_as_bytes(**kw)
                return data
        except gexc.NotFound:
            return None

    def put_bytes(self, name: str, data: bytes, content_type: str) -> None:
        """Write a small object with its crc32c (GCS refuses other bytes).

        Raises:
            ChecksumMismatch: GCS reports another crc32c than the one sent.
        """
        import google_crc32c

        blob = self.bucket.blob(name)
        crc = google_crc32c.value(data)
        blob.crc32c = crc_b64(crc)
        with self.request() as kw:
            blob.upload_from_string(data, content_type=content_type, checksum=None, **kw)
        if blob.crc32c is not None and crc_from_b64(blob.crc32c) != crc:
            raise ChecksumMismatch(f"{name}: GCS stored a different crc32c")

    def delete(self, name: str) -> bool:
        """Delete object ``name``; True if it existed."""
        from google.api_core import exceptions as gexc

        try:
            with self.request() as kw:
                self.bucket.blob(name).delete(**kw)
        except gexc.NotFound:
            return False
        return True

    def listing(self, prefix: str, delimiter: str | None = None) -> tuple[list[Any], set[str]]:
        """The blobs under ``prefix`` and (with ``delimiter``) the sub-prefixes."""
        with self.request() as kw:
            it = self.client.list_blobs(self.bucket, prefix=prefix, delimiter=delimiter, **kw)
            blobs = list(it)
        return blobs, set(it.prefixes)

    def get_many(self, prefix: str, names: list[str]) -> dict[str, bytes | None]:
        """The contents of small objects ``prefix + name`` (None: not found), read in
        parallel."""
        if not names:
            return {}
        with cf.ThreadPoolExecutor(min(self.settings.threads, len(names))) as pool:
            return dict(
                zip(names, pool.map(lambda n: self.get_bytes(prefix + n), names), strict=True)
            )

    def existing(self, prefix: str, names: Iterable[str]) -> dict[str, ObjectInfo]:
        """Size and crc32c of the objects under ``prefix`` that share a top-level name
        with ``names`` (one listing per top-level name)."""
        heads = {n.split("/", 1)[0] for n in names}
        found: dict[str, ObjectInfo] = {}
        for head in heads:
            blobs, _ = self.listing(prefix + head)
            for b in blobs:
                rel = b.name[len(prefix) :]
                found[rel] = ObjectInfo(rel, int(b.size or 0), crc_from_b64(b.crc32c))
        return found


class GcsBackend:
    """Backups of one bucket spec (``--bucket NAME[/PREFIX]``).

    Args:
        spec: bucket and prefix (see :func:`tierfs.backup.layout.parse_bucket`).
        client: a ``google.cloud.storage.Client``; made with :func:`make_client` if None.
        settings: tuning (defaults from :meth:`GcsSettings.from_env`).
        on_retry: called (any thread) with each retryable failure before its retry.
        widen_pool: size the client's HTTP connection pool for ``settings.threads``.

    Attributes:
        objects: the :class:`ObjectStore` every operation goes through.
        bucket: the library's bucket object (``objects.bucket``).
        monitor: the client's :class:`BucketMonitor` (shared by every backend on
            the same client), or None if the client's session could not be wrapped.
        rounds, uploads, downloads, cleaner: the collaborators (module docstring).

    Every request, its retries included, ends within ``settings.retry_deadline``
    seconds. Thread-safe: one backend may be used by several threads at once.
    """

    def __init__(
        self,
        spec: BucketSpec | str,
        client: Any = None,
        settings: GcsSettings | None = None,
        on_retry: Callable[[Exception], None] | None = None,
        widen_pool: bool = True,
    ) -> None:
        self.spec = L.parse_bucket(spec) if isinstance(spec, str) else spec
        self.settings = settings or GcsSettings.from_env()
        self.client = client if client is not None else make_client()
        if widen_pool:
            _widen_pool(self.client, self.settings.threads)
        self.objects = ObjectStore(self.spec, self.client, self.settings, on_retry)
        self.bucket = self.objects.bucket
        self.monitor = self.objects.monitor
        self.rounds = RoundListing(self.objects)
        self.uploads = Uploader(self.objects)
        self.downloads = Downloader(self.objects, self.rounds)
        self.cleaner = RoundCleaner(self.objects, self.rounds)
        self.indexes = RoundIndexes(self.objects)

    def bounded(self, deadline: float) -> GcsBackend:
        """A backend on the same client whose every request, retries and waiting for
        an answer included, ends within ``deadline`` seconds (or the settings'
        retry deadline if shorter). A bucket that does not answer (connections
        accepted, nothing read) then makes the first request of a call raise
        ``RetryError`` or :class:`BucketTimeout` after ``deadline`` seconds, so a
        lookup that stops at its first failure is bounded by it, not by the
        read timeout. Non-blocking (the client is shared).
        """
        d = max(0.1, min(deadline, self.settings.retry_deadline))
        first, most = retry.bounded_waits(self.settings.retry_initial, self.settings.retry_max, d)
        s = dataclasses.replace(
            self.settings, retry_deadline=d, retry_initial=first, retry_max=most
        )
        return GcsBackend(
            self.spec,
            client=self.client,
            settings=s,
            on_retry=self.objects.on_retry,
            widen_pool=False,
        )

    def bucket_exists(self) -> bool:
        """True if the bucket exists (blocking; retried like every request).

        Raises:
            google.api_core exceptions after retries (bucket unreachable,
            permission denied); BucketTimeout (a bounded backend's deadline).
        """
        return self.objects.exists()

    # ------------------------------------------------------------------ restore.version

    def read_restore_version(self, job: str) -> str | None:
        """See :meth:`tierfs.backup.listing.RoundListing.read_restore_version`."""
        return self.rounds.read_restore_version(job)

    def write_restore_version(self, job: str, round_name: str) -> None:
        """Write ``restore.version`` naming ``round_name`` (an operator's action).

        Raises:
            LayoutError: not a round name.
        """
        L.check_round_name(round_name)
        self.objects.put_bytes(self.spec.restore_version(job), round_name.encode(), "text/plain")

    def delete_restore_version(self, job: str) -> bool:
        """Delete ``restore.version``; True if it existed."""
        return self.objects.delete(self.spec.restore_version(job))

    # ------------------------------------------------------------------ rendezvous

    def publish_address(self, job: str, rank: int, address: str, *, incarnation: str) -> None:
        """Write ``.tierfs/nodes/<rank>`` = this node's peer address (JSON record)."""
        self.objects.put_bytes(
            self.spec.rendezvous(job, rank),
            L.rendezvous_record(address, rank, incarnation=incarnation, written=time.time()),
            "application/json",
        )

    def read_address(self, job: str, rank: int = 0) -> L.RendezvousRecord | None:
        """Read node ``rank``'s rendezvous record (None if absent or malformed)."""
        data = self.objects.get_bytes(self.spec.rendezvous(job, rank))
        if data is None:
            return None
        try:
            return L.parse_rendezvous(data)
        except LayoutError as exc:
            log.warning("rendezvous record of rank %d: %s", rank, exc)
            return None

    def wait_for_address(
        self,
        job: str,
        rank: int = 0,
        *,
        timeout: float,
        newer_than: float = 0.0,
        poll: float = 1.0,
        cancel: threading.Event | None = None,
    ) -> L.RendezvousRecord:
        """Poll :meth:`read_address` until rank ``rank`` has published an address written
        after ``newer_than`` (:func:`tierfs.backup.rendezvous.wait_for_address`)."""
        return wait_for_address(
            self.read_address,
            f"{self.spec}{job}/.tierfs/nodes/",
            job,
            rank,
            timeout=timeout,
            newer_than=newer_than,
            poll=poll,
            cancel=cancel,
        )

    # ------------------------------------------------------------------ rounds (RoundListing)

    def list_round_names(self, job: str) -> list[str]:
        """Round directory names of ``job``, newest first."""
        return self.rounds.list_round_names(job)

    def inspect_round(
        self,
        job: str,
        round_name: str,
        nodes: int | None = None,
        *,
        fallback: int | None = None,
    ) -> RoundInfo:
        """See :meth:`tierfs.backup.listing.RoundListing.inspect_round`."""
        return self.rounds.inspect_round(job, round_name, nodes, fallback=fallback)

    def list_rounds(
        self,
        job: str,
        nodes: int | None = None,
        *,
        on_round: Callable[[RoundInfo], None] | None = None,
        on_names: Callable[[list[str]], None] | None = None,
    ) -> list[RoundInfo]:
        """See :meth:`tierfs.backup.listing.RoundListing.list_rounds`."""
        return self.rounds.list_rounds(job, nodes, on_round=on_round, on_names=on_names)

    def job_nodes(self, job: str) -> int | None:
        """See :meth:`tierfs.backup.listing.RoundListing.job_nodes`."""
        return self.rounds.job_nodes(job)

    def inspect_round_of_job(
        self, job: str, round_name: str, nodes: int | None = None
    ) -> RoundInfo:
        """See :meth:`tierfs.backup.listing.RoundListing.inspect_round_of_job`."""
        return self.rounds.inspect_round_of_job(job, round_name, nodes)

    def choose_restore(self, job: str, nodes: int) -> RestoreChoice:
        """See :meth:`tierfs.backup.listing.RoundListing.choose_restore`."""
        return self.rounds.choose_restore(job, nodes)

    # ------------------------------------------------------------------ round index

    def write_round_index(self, job: str, round_name: str) -> RoundIndex:
        """See :meth:`tierfs.backup.round_index.RoundIndexes.write`."""
        return self.indexes.write(job, round_name)

    def ensure_round_index(self, job: str, round_name: str) -> RoundIndex | None:
        """See :meth:`tierfs.backup.round_index.RoundIndexes.ensure`."""
        return self.indexes.ensure(job, round_name)

    def inspect_part(
        self, job: str, round_name: str, rank: int, step: int, *, fallback: int
    ) -> RoundInfo:
        """Node ``rank``'s part of ``step`` in a round, for that node's restore: through
        the round index when it verifies the part (two GETs,
        :meth:`tierfs.backup.round_index.RoundIndexes.read_part`), else the whole
        round judged from its listing (:meth:`inspect_round`, ``fallback`` nodes
        for a round that records none).

        Raises:
            google.api_core exceptions after retries; BucketTimeout.
        """
        info = self.indexes.read_part(job, round_name, rank, step, fallback)
        if info is not None:
            log.info("round %s: rank %d's part read through the round index", round_name, rank)
            return info
        log.info(
            "round %s: no round index verifies rank %d's part; judging the round", round_name, rank
        )
        return self.rounds.inspect_round(job, round_name, fallback=fallback)

    # ------------------------------------------------------------------ upload (Uploader)

    def unproven(self, prefix: str, uploads: Iterable[L.Upload]) -> list[str]:
        """See :meth:`tierfs.backup.upload.Uploader.unproven`."""
        return self.uploads.unproven(prefix, uploads)

    def await_objects(
        self,
        prefix: str,
        uploads: Iterable[L.Upload],
        *,
        wait: float,
        cancel: threading.Event | None = None,
        poll: float = 0.5,
    ) -> list[str]:
        """Poll :meth:`unproven` until every one of ``uploads`` is there
        (:func:`tierfs.backup.upload.await_objects`); returns what is still missing."""
        return await_objects(self.unproven, prefix, uploads, wait=wait, cancel=cancel, poll=poll)

    def upload_shard(
        self,
        shard: Shard,
        round_name: str,
        *,
        nodes: int,
        data_parallelism: int | None = None,
        dedup: bool = False,
        dedup_wait: float | None = None,
        cancel: threading.Event | None = None,
        on_bytes: Callable[[int], None] | None = None,
        resume: bool = True,
    ) -> UploadResult:
        """See :meth:`tierfs.backup.upload.Uploader.upload_shard`."""
        return self.uploads.upload_shard(
            shard,
            round_name,
            nodes=nodes,
            data_parallelism=data_parallelism,
            dedup=dedup,
            dedup_wait=dedup_wait,
            cancel=cancel,
            on_bytes=on_bytes,
            resume=resume,
        )

    # ------------------------------------------------------------------ download (Downloader)

    def download_part(
        self, job: str, round_name: str, rank: int, step: int, dest: str, **kw: Any
    ) -> Manifest:
        """See :meth:`tierfs.backup.download.Downloader.download_part`."""
        return self.downloads.download_part(job, round_name, rank, step, dest, **kw)

    def restore_shard(
        self, shards: ShardStore, job: str, round_name: str, rank: int, step: int, **kw: Any
    ) -> Shard:
        """See :meth:`tierfs.backup.download.Downloader.restore_shard`."""
        return self.downloads.restore_shard(shards, job, round_name, rank, step, **kw)

    # ------------------------------------------------------------------ delete (RoundCleaner)

    def delete_round(
        self,
        job: str,
        round_name: str,
        *,
        on_object: Callable[[str], None] | None = None,
        on_listed: Callable[[int], None] | None = None,
    ) -> int:
        """See :meth:`tierfs.backup.tidy.RoundCleaner.delete_round`."""
        return self.cleaner.delete_round(job, round_name, on_object=on_object, on_listed=on_listed)

    def tidy_round(self, job: str, round_name: str, nodes: int) -> int:
        """See :meth:`tierfs.backup.tidy.RoundCleaner.tidy_round`."""
        return self.cleaner.tidy_round(job, round_name, nodes)
