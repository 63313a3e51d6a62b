"""Uploading a node's part of a backup round (:meth:`Uploader.upload_shard`).

What a node does in a backup round:

1. its data objects, streamed from the sealed snapshot's hard links, several
   in parallel (a bounded thread pool), resumable uploads in
   ``chunk_size`` pieces for files above 8 MiB; each carries the crc32c from
   the shard manifest, so GCS refuses bytes that differ from what was sealed,
   and the crc32c GCS reports back is compared with the manifest again;
2. ``<job>-s<step>-n<rank>.tierfs.json``: the shard manifest and object map;
3. last, the MTC pointer(s) ``<job>-s<step>-n<rank>-w<w>.meta``.

Blocking (HTTP, file reads); every request goes through
:class:`tierfs.backup.bucket.ObjectStore`.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tierfs.backup import layout as L
from tierfs.backup.client import MULTIPART_MAX, crc_b64, crc_from_b64
from tierfs.backup.errors import Cancelled, ChecksumMismatch
from tierfs.backup.judge import check_object
from tierfs.backup.layout import NodeBackup
from tierfs.backup.streams import Abort, Stream, run_parallel
from tierfs.core import retry, settings
from tierfs.store.shards import Shard

if TYPE_CHECKING:
    from tierfs.backup.bucket import ObjectStore


@dataclass
class UploadResult:
    """What :meth:`GcsBackend.upload_shard` did (sizes in bytes, times in seconds)."""

    round: str
    rank: int
    step: int
    objects: int = 0
    bytes: int = 0
    skipped: int = 0
    data_uploaded: bool = True
    seconds: float = 0.0
    hashes: dict[int, str] = field(default_factory=dict)
    note: str = ""


class Uploader:
    """Uploads of node parts into rounds of one bucket spec (thread-safe).

    Args:
        objects: the bucket's objects (the only way to the bucket).
    """

    def __init__(self, objects: ObjectStore) -> None:
        self.objects = objects
        self.spec = objects.spec

    def upload_file(
        self,
        name: str,
        path: str,
        size: int,
        crc: int,
        cancel: Abort | None,
        on_bytes: Callable[[int], None] | None,
    ) -> None:
        resumable = size > MULTIPART_MAX
        blob = self.objects.bucket.blob(
            name, chunk_size=self.objects.settings.chunk_size if resumable else None
        )
        want = crc_b64(crc)
        blob.crc32c = want  # GCS verifies the bytes it receives against this
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_size != size:
                raise ChecksumMismatch(
                    f"{path}: {st.st_size} bytes, manifest {size} (changed since it was sealed)"
                )
            kwargs: dict[str, Any] = {}
            if resumable:
                kwargs["crc32c_checksum_value"] = want
            window = self.objects.settings.retry_deadline if resumable else None
            with self.objects.request() as kw:
                blob.upload_from_file(
                    Stream(f, cancel, on_bytes, self.objects.monitor, window),
                    size=size,
                    checksum=None,
                    content_type="application/octet-stream",
                    **kw,
                    **kwargs,
                )
        got = crc_from_b64(blob.crc32c)
        if (got is not None and got != crc) or (blob.size is not None and blob.size != size):
            # an emulator may not enforce the crc32c we sent: check what it stored
            self.objects.delete(name)
            raise ChecksumMismatch(
                f"{name}: GCS stored crc32c {got and f'{got:08x}'} for "
                f"{blob.size} bytes, manifest {crc:08x} for {size}"
            )

    def unproven(self, prefix: str, uploads: Iterable[L.Upload]) -> list[str]:
        """Which of ``uploads`` the bucket does not hold under ``prefix`` with their size
        and crc32c, one line each (empty: every one is there). One listing per
        top-level data name.

        Raises:
            google.api_core exceptions after retries.
        """
        todo = list(uploads)
        have = self.objects.existing(prefix, (u.name for u in todo))
        return [
            p
            for p in (check_object(u.name, have.get(u.name), u.size, u.crc32c) for u in todo)
            if p is not None
        ]

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
        """Upload one sealed shard as its node's part of backup round ``round_name``.

        Data objects first (in parallel; skipped if ``resume`` and an object of
        the same size and crc32c is already there), then the node's
        ``.tierfs.json`` manifest, then its ``.meta`` pointer(s) last.

        Data parallelism (``assume-data-parallelism`` D) only saves uploads when
        the bytes prove it: with ``dedup`` (the coordinator found this rank's
        digest equal to its column's uploader's, :func:`tierfs.backup.layout.
        dedup_plan`) a rank that is not its column's uploader
        (:func:`tierfs.backup.layout.uploader_of`) uploads no data if the
        bucket holds every object its own layout names, with its sizes and
        crc32c -- the layout hash covers the column and every file's size and
        crc32c, so equal names mean equal checksums. It waits up to
        ``dedup_wait`` seconds after the last progress for the uploader
        (:func:`await_objects`), then uploads its own data. Without ``dedup``
        every rank uploads its own data. A pointer is never written before
        every object it names is proven in the bucket (by this upload's
        answers or by the listing).

        Args:
            shard: a committed shard (its files are read from ``shard.data``).
            round_name: ``YYYY-MM-DD_HH-MM`` (the coordinator decides it).
            nodes: the job's node count (recorded; needed for data parallelism).
            data_parallelism: the job's ``assume-data-parallelism`` or None.
            dedup: may point at the column's uploader's data (see above).
            dedup_wait: seconds (default ``$TIERFS_GCS_DEDUP_WAIT``, 60).
            cancel: set it to stop between and inside object uploads.
            on_bytes: called with each increment of data bytes sent (any thread).

        Returns:
            an :class:`UploadResult` (``data_uploaded`` False: the pointer names
            the uploader's objects; ``note``: why a dedup did not happen).

        Raises:
            ChecksumMismatch: a file no longer matches its manifest (it changed
                after the seal) or GCS stored other bytes.
            Cancelled: ``cancel`` was set.
            OSError: a snapshot file vanished.
            google.api_core / requests exceptions once retries are exhausted.
        """
        t0 = time.monotonic()
        m = shard.manifest
        rank = m.rank
        col = L.data_column(rank, nodes, data_parallelism)
        layout = L.node_layout(m, column=col)
        prefix = self.spec.round_dir(m.job, round_name)
        uploader = L.uploader_of(rank, nodes, data_parallelism)
        result = UploadResult(round_name, rank, m.step, hashes=dict(layout.hashes))
        own = uploader == rank or not dedup or not layout.uploads
        if not own:
            wait = settings.GCS_DEDUP_WAIT.get() if dedup_wait is None else dedup_wait
            missing = await_objects(self.unproven, prefix, layout.uploads, wait=wait, cancel=cancel)
            if missing:
                own = True
                result.note = (
                    f"node-rank {uploader}'s data for step {m.step} was not in "
                    f"round {round_name} within {wait:.0f} s ({missing[0]}); "
                    "uploaded this node's own"
                )
        result.data_uploaded = own
        if own and layout.uploads:
            todo = list(layout.uploads)
            if resume:
                have = self.objects.existing(prefix, (u.name for u in todo))
                keep = []
                for u in todo:
                    if check_object(u.name, have.get(u.name), u.size, u.crc32c) is None:
                        result.skipped += 1
                    else:
                        keep.append(u)
                todo = keep
            # big files first: the pool stays busy until the end
            todo.sort(key=lambda u: u.size, reverse=True)
            abort = Abort(cancel)
            run_parallel(
                self.objects.settings.threads,
                [
                    functools.partial(
                        self.upload_file,
                        prefix + u.name,
                        os.path.join(shard.data, u.path),
                        u.size,
                        u.crc32c,
                        abort,
                        on_bytes,
                    )
                    for u in todo
                ],
                abort,
            )
            result.objects += len(todo)
            result.bytes += sum(u.size for u in todo)
        if cancel is not None and cancel.is_set():
            raise Cancelled("upload cancelled")
        nb = NodeBackup(
            manifest=m,
            round=round_name,
            nodes=nodes,
            uploader=rank if own else uploader,
            data_parallelism=data_parallelism,
            hashes=dict(layout.hashes),
            objects=dict(layout.objects),
            created=time.time(),
        )
        self.objects.put_bytes(
            prefix + L.tierfs_manifest_name(m.job, m.step, rank), nb.to_json(), "application/json"
        )
        for worker, digest in sorted(layout.hashes.items()):
            if cancel is not None and cancel.is_set():
                raise Cancelled("upload cancelled")
            self.objects.put_bytes(
                prefix + L.meta_name(m.job, m.step, rank, worker),
                digest.encode("ascii"),
                "text/plain",
            )
        result.objects += 1 + len(layout.hashes)
        result.seconds = time.monotonic() - t0
        return result


def await_objects(
    unproven: Callable[[str, list[L.Upload]], list[str]],
    prefix: str,
    uploads: Iterable[L.Upload],
    *,
    wait: float,
    cancel: threading.Event | None = None,
    poll: float = 0.5,
) -> list[str]:
    """Poll ``unproven(prefix, uploads)`` (:meth:`Uploader.unproven`) until every one
    of ``uploads`` is there with its size and crc32c (another node uploads them), for
    at most ``wait`` seconds after the last progress (an object appearing). Polls
    back off from ``poll`` to 5 s (the ``gcs-dedup-wait`` policy of :mod:`tierfs.core.retry`; a
    :class:`~tierfs.core.retry.Backoff`, as the deadline moves with progress
    and ``cancel`` ends a wait early).

    Returns:
        what is still missing (empty: all there).

    Raises:
        Cancelled: ``cancel`` was set. google.api_core exceptions after retries.
    """
    todo = list(uploads)
    backoff = retry.gcs_dedup_wait(wait, poll).backoff()
    best = -1
    while True:
        if cancel is not None and cancel.is_set():
            raise Cancelled("upload cancelled")
        missing = unproven(prefix, todo)
        if not missing:
            return []
        if len(todo) - len(missing) > best:
            best = len(todo) - len(missing)
            if best > 0:
                backoff.progress()
        left = backoff.left() or 0.0
        if left <= 0:
            return missing
        pause = min(backoff.next(), left)
        if cancel is not None:
            if cancel.wait(pause):
                raise Cancelled("upload cancelled")
        else:
            time.sleep(pause)
