"""The GCS tier's storage operations: backup rounds in the MTC bucket layout.

Every function and method here blocks (HTTP, file I/O): the node agent calls
them from worker threads (``trio.to_thread.run_sync`` with a limiter), the
CLI and the benchmark call them directly. Google Cloud Storage is reached
only through ``google-cloud-storage``; credentials are found the library's
usual way (Application Default Credentials), and ``STORAGE_EMULATOR_HOST``
(``http://host:port``) selects an emulator such as fake-gcs-server, for which
the library uses anonymous credentials by itself.

What a node does in a backup round (:meth:`GcsBackend.upload_shard`):

1. its data objects, streamed from the sealed snapshot's hard links, several
   in parallel (a bounded thread pool), resumable uploads in
   ``chunk_size`` pieces for files above 8 MiB; each carries the crc32c from
   the shard manifest, so GCS refuses bytes that differ from what was sealed,
   and the crc32c GCS reports back is compared with the manifest again;
2. ``<job>-s<step>-n<rank>.tierfs.json``: the shard manifest and object map;
3. last, the MTC pointer(s) ``<job>-s<step>-n<rank>-w<w>.meta``.

A round is usable for a node only when its pointer exists and every data
object its manifest names exists with the manifest's size and crc32c
(:meth:`GcsBackend.inspect_round`, judged by :mod:`tierfs.backup.judge`);
rounds cut off half-way are never chosen.
Restores download straight into ``store/incoming/<id>/data`` of the RAM
store, check every file's crc32c and size against the manifest while
writing, and commit with :meth:`tierfs.store.shards.ShardStore.commit`.

Failures: every request is retried with exponential backoff on 429, 408,
5xx, timeouts and connection errors (``google.cloud.storage.retry``'s
predicate) until ``GcsSettings.retry_deadline`` seconds have passed; then
the exception propagates (see :func:`describe_error`).

Deadlines: each library call gets ``timeout=`` (connect, read) no longer than
its retry deadline and ``retry=`` with that deadline, and every HTTP attempt
the client sends inside the call (retries, each resumable chunk) has its
timeout capped at the time left (:class:`BucketMonitor` wraps the client's
session). A bucket that stops answering (connections accepted, nothing read)
therefore costs a :meth:`GcsBackend.bounded` caller its deadline, not the
120 s read timeout. The same monitor records requests in flight and the last
answer, for "slow or stalled" reports (:meth:`BucketMonitor.stalled_for`).
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import contextlib
import logging
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tierfs.backup import layout as L
from tierfs.backup.judge import (
    NodeEntry,
    ObjectInfo,
    RoundInfo,
    apply_job_nodes,
    check_object,
    infer_job_nodes,
    judge_round,
    meta_crc,
)
from tierfs.backup.layout import BucketSpec, LayoutError, NodeBackup
from tierfs.core import retry, settings
from tierfs.core.errors import BackupError
from tierfs.store.manifest import FileEntry, Manifest, check_entries
from tierfs.store.ramstore import RamStore
from tierfs.store.shards import Shard, ShardStore

log = logging.getLogger(__name__)

MiB = 1 << 20
#: google-cloud-storage uses one multipart request up to this size, resumable above
MULTIPART_MAX = 8 * MiB


class GcsError(BackupError):
    """A backup or restore could not be done; the message is one line for humans."""


class ChecksumMismatch(GcsError):
    """Bytes in the bucket (or read for upload) differ from the shard manifest."""


class IncompleteRound(GcsError):
    """A round lacks a node's pointer, manifest or data objects."""


class Cancelled(GcsError):
    """The operation was cancelled through its ``cancel`` event."""


class BucketTimeout(GcsError):
    """The caller's deadline passed before the bucket answered (a hanging bucket)."""


class _NotYet(GcsError):
    """A polled object is not there yet (retried by a poll policy, never raised out)."""


# ---------------------------------------------------------------------- settings


#: objects in flight per node by default (the CPU count, between 2 and 8)
default_threads = settings.default_threads


@dataclass(frozen=True)
class GcsSettings:
    """Tuning of the GCS tier.

    Attributes:
        threads: objects transferred in parallel per node (>= 1); default
            :func:`default_threads`.
        chunk_size: bytes per request of a resumable upload (multiple of 256 KiB);
            each in-flight large upload buffers one chunk.
        retry_deadline: seconds a request keeps being retried (429/5xx/timeouts/
            connection errors) before the error propagates.
        retry_initial, retry_max: first and largest backoff delay in seconds.
        connect_timeout, read_timeout: per HTTP request, seconds.
    """

    threads: int = field(default_factory=lambda: default_threads())
    chunk_size: int = 64 * MiB
    retry_deadline: float = 300.0
    retry_initial: float = 1.0
    retry_max: float = 30.0
    connect_timeout: float = 10.0
    read_timeout: float = 120.0

    @classmethod
    def from_env(cls, **overrides: Any) -> GcsSettings:
        """Defaults, then ``TIERFS_GCS_THREADS``, ``TIERFS_GCS_CHUNK_MIB``,
        ``TIERFS_GCS_RETRY_DEADLINE`` (seconds), ``TIERFS_GCS_TIMEOUT``
        (read timeout, seconds) as they are now (:mod:`tierfs.core.settings`), then
        ``overrides``.

        Raises:
            tierfs.core.settings.SettingError: one of those variables is malformed.
        """
        d = cls()
        chunk_mib = settings.GCS_CHUNK_MIB.get()
        values: dict[str, Any] = {
            "threads": settings.GCS_THREADS.get(),
            "chunk_size": max(1, int(chunk_mib * 4)) * (MiB // 4),
            "retry_deadline": settings.GCS_RETRY_DEADLINE.get(),
            "read_timeout": settings.GCS_TIMEOUT.get(),
        }
        values.update(overrides)
        first, most = retry.short_deadline_waits(
            d.retry_initial, d.retry_max, values["retry_deadline"]
        )
        values.setdefault("retry_initial", first)
        values.setdefault("retry_max", most)
        return cls(**values)

    def policy(self) -> retry.Policy:
        """The ``gcs-request`` policy of these settings (:func:`tierfs.core.retry.gcs_request`)."""
        return retry.gcs_request(self.retry_deadline, self.retry_initial, self.retry_max)


def make_client(project: str | None = None) -> Any:
    """A ``google.cloud.storage.Client`` the library's usual way.

    With ``STORAGE_EMULATOR_HOST`` set, google-cloud-storage 3.x points the
    client at the emulator and uses anonymous credentials by itself; the
    project then defaults to ``$GOOGLE_CLOUD_PROJECT`` or none. Blocking
    (credential discovery may probe the metadata server).
    """
    from google.cloud import storage

    if project is None:
        project = os.environ.get("GOOGLE_CLOUD_PROJECT") or None
    if project is None and os.environ.get("STORAGE_EMULATOR_HOST"):
        return storage.Client(project=None)
    return storage.Client(project=project) if project else storage.Client()


def _widen_pool(client: Any, size: int) -> None:
    """Let ``size`` threads share the client's HTTP session without pool warnings."""
    try:
        import requests.adapters

        session = client._http
        adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=size + 4)
        session.mount("https://", adapter)
        session.mount("http://", adapter)
    except Exception:  # a private attribute of google-cloud-core; best effort
        log.debug("could not widen the HTTP connection pool", exc_info=True)


def _make_retry(policy: retry.Policy, on_error: Callable[[Exception], None]) -> Any:
    """google-cloud-storage's retry object for one call (its predicate: 408/429/5xx,
    timeouts, connection errors) with the waits and deadline of ``policy`` (the
    ``gcs-request`` row of docs/RETRIES.md) and an ``on_error`` hook.

    The library's ``Retry`` is the right layer for a single call: it retries inside
    the call, so a resumable upload resumes the failed chunk from the bytes the
    server holds instead of starting the object again.
    """
    from google.api_core import retry as gretry
    from google.cloud.storage.retry import DEFAULT_RETRY

    predicate = getattr(DEFAULT_RETRY, "_predicate", None)
    if predicate is None:  # a future library without the attribute: its default object
        return DEFAULT_RETRY.with_timeout(policy.deadline).with_delay(
            initial=policy.first, maximum=policy.max_wait, multiplier=policy.exp_base
        )
    return gretry.Retry(
        predicate=predicate,
        initial=policy.first,
        maximum=policy.max_wait,
        multiplier=policy.exp_base,
        timeout=policy.deadline,
        on_error=on_error,
    )


def is_transient(exc: BaseException) -> bool:
    """True for failures that may go away by themselves: the bucket did not answer
    (timeouts, connection errors, retries given up) or answered 408/429/5xx.

    False for definite answers and local problems: not found, access denied,
    a checksum mismatch, a cancel, an ``OSError`` of a local file.
    """
    from google.api_core import exceptions as gexc
    from google.cloud.storage.retry import DEFAULT_RETRY

    if isinstance(exc, gexc.RetryError | BucketTimeout):
        return True
    if isinstance(exc, GcsError):
        return False
    predicate = getattr(DEFAULT_RETRY, "_predicate", None)
    try:
        if predicate is not None and predicate(exc):
            return True
    except Exception:  # a predicate that cannot judge this exception
        return False
    return isinstance(exc, ConnectionError | TimeoutError)


# ---------------------------------------------------------------------- deadlines, monitor

_deadline = threading.local()

#: HTTP statuses that mean "try again" rather than an answer about the bucket
_RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


def _thread_deadline() -> float | None:
    """The calling thread's deadline (``time.monotonic()`` seconds), if any."""
    return getattr(_deadline, "until", None)


@contextlib.contextmanager
def _deadline_scope(until: float) -> Iterator[None]:
    """Cap every HTTP request this thread sends inside the block at ``until``
    (``time.monotonic()`` seconds)."""
    prev = _thread_deadline()
    _deadline.until = until
    try:
        yield
    finally:
        _deadline.until = prev


def _cap_timeout(timeout: Any, left: float) -> Any:
    """``timeout`` (seconds, (connect, read) or None) with no part longer than ``left``."""
    if isinstance(timeout, tuple):
        return tuple(left if t is None else min(float(t), left) for t in timeout)
    if timeout is None:
        return left
    return min(float(timeout), left)


class BucketMonitor:
    """Watches every HTTP request of one storage client (thread-safe).

    Installed on the client's session by :func:`monitor_of`: caps each
    request's timeout at the calling thread's deadline (raising
    :class:`BucketTimeout` if it has already passed) and records requests in
    flight, the last answer and data progress.

    Attributes:
        last_answer: ``time.monotonic()`` of the last response that was an
            answer about the bucket (any status but 408/429/5xx), 0.0 if none.
        last_activity: ``time.monotonic()`` of the last response of any kind
            or the last data bytes moved.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inflight: dict[int, float] = {}
        self._next = 0
        self.last_answer = 0.0
        self.last_activity = time.monotonic()

    def cap(self, timeout: Any) -> Any:
        """The timeout to send with a request from this thread.

        Raises:
            BucketTimeout: the thread's deadline has passed.
        """
        until = _thread_deadline()
        if until is None:
            return timeout
        left = until - time.monotonic()
        if left <= 0:
            raise BucketTimeout("bucket unreachable: no answer within the request's deadline")
        return _cap_timeout(timeout, left)

    def begin(self) -> int:
        """A request goes out; returns its token for :meth:`end`."""
        with self._lock:
            self._next += 1
            self._inflight[self._next] = time.monotonic()
            return self._next

    def end(self, token: int, status: int | None) -> None:
        """The request ``token`` finished with HTTP ``status`` (None: no response)."""
        now = time.monotonic()
        with self._lock:
            self._inflight.pop(token, None)
            if status is not None:
                self.last_activity = now
                if status not in _RETRY_STATUSES:
                    self.last_answer = now

    def progress(self) -> None:
        """Data bytes moved (an upload read the next piece, a download wrote one)."""
        self.last_activity = time.monotonic()

    def in_flight(self) -> int:
        """Requests sent and not answered yet."""
        with self._lock:
            return len(self._inflight)

    def stalled_for(self, now: float | None = None) -> float:
        """Seconds requests have been waiting without any answer or data progress
        (0.0 when nothing is in flight)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if not self._inflight:
                return 0.0
            oldest = min(self._inflight.values())
        return max(0.0, now - max(oldest, self.last_activity))


def monitor_of(client: Any) -> BucketMonitor | None:
    """The :class:`BucketMonitor` of ``client``'s HTTP session, installed on first use
    (None if the session cannot be wrapped; then deadlines rely on the per-call
    ``timeout=`` and ``retry=`` only)."""
    try:
        session = client._http  # google-cloud-core's AuthorizedSession (private attribute)
    except Exception:
        log.debug("no HTTP session to monitor", exc_info=True)
        return None
    mon = getattr(session, "_tierfs_monitor", None)
    if isinstance(mon, BucketMonitor):
        return mon
    original = getattr(session, "request", None)
    if original is None:
        return None
    mon = BucketMonitor()

    def request(method: Any, url: Any, *args: Any, **kwargs: Any) -> Any:
        if "timeout" in kwargs:
            kwargs["timeout"] = mon.cap(kwargs["timeout"])
        else:
            mon.cap(None)  # raises once the deadline has passed
        token = mon.begin()
        status = None
        try:
            resp = original(method, url, *args, **kwargs)
            status = getattr(resp, "status_code", None)
            return resp
        finally:
            mon.end(token, status)

    try:
        session.request = request
        session._tierfs_monitor = mon
    except Exception:
        log.debug("could not wrap the HTTP session", exc_info=True)
        return None
    return mon


def crc_b64(crc: int) -> str:
    """crc32c as GCS spells it: base64 of the big-endian 4 bytes."""
    return base64.b64encode((crc & 0xFFFFFFFF).to_bytes(4, "big")).decode("ascii")


def crc_from_b64(text: str | None) -> int | None:
    """Inverse of :func:`crc_b64`; None for a missing or malformed value."""
    if not text:
        return None
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        return None
    return int.from_bytes(raw, "big") if len(raw) == 4 else None


def describe_error(exc: BaseException) -> str:
    """A one-line description of a GCS failure for status and ``replicator.errors``."""
    from google.api_core import exceptions as gexc

    name = type(exc).__name__
    text = str(exc).splitlines()[0] if str(exc) else ""
    if isinstance(exc, gexc.RetryError):
        cause = exc.cause
        return f"bucket unreachable: gave up retrying ({describe_error(cause) if cause else text})"
    if (
        isinstance(exc, ConnectionError | TimeoutError) or "Connection" in name or "Timeout" in name
    ) and not isinstance(exc, GcsError):
        return f"bucket unreachable ({name}: {text[:160]})"
    if isinstance(exc, gexc.NotFound):
        return f"not found: {text[:200]}"
    if isinstance(exc, gexc.Forbidden | gexc.Unauthorized):
        return f"access denied: {text[:200]}"
    if isinstance(exc, GcsError):
        return text
    return f"{name}: {text[:200]}"


# ---------------------------------------------------------------------- streams


class _Abort:
    """A stop flag for one parallel batch: set by its first failure, or by the caller's
    ``cancel`` event."""

    def __init__(self, outer: threading.Event | None) -> None:
        self.outer = outer
        self.local = threading.Event()

    def is_set(self) -> bool:
        return self.local.is_set() or (self.outer is not None and self.outer.is_set())

    def set(self) -> None:
        self.local.set()


class _Reader:
    """A file proxy for uploads: counts new bytes, stops on cancel, tells the
    monitor each piece read (the bucket took the previous one).

    Args:
        window: for a resumable upload (one request per chunk, each retried
            on its own): at each read, the thread's request deadline becomes
            ``window`` seconds from now, so every chunk gets a full retry
            deadline and no more.
    """

    def __init__(
        self,
        f: Any,
        cancel: _Abort | None,
        on_bytes: Callable[[int], None] | None,
        monitor: BucketMonitor | None = None,
        window: float | None = None,
    ) -> None:
        self._f = f
        self._cancel = cancel
        self._on_bytes = on_bytes
        self._monitor = monitor
        self._window = window
        self._high = 0

    def read(self, n: int = -1) -> bytes:
        if self._cancel is not None and self._cancel.is_set():
            raise Cancelled("upload cancelled")
        data = self._f.read(n)
        pos = self._f.tell()
        if self._window is not None:
            _deadline.until = time.monotonic() + self._window
        if self._monitor is not None:
            self._monitor.progress()
        if pos > self._high:
            if self._on_bytes is not None:
                self._on_bytes(pos - self._high)
            self._high = pos
        return data

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()


class _Writer:
    """A file proxy for downloads: crc32c and size of what was written, stops on cancel."""

    def __init__(
        self,
        f: Any,
        cancel: _Abort | None,
        on_bytes: Callable[[int], None] | None,
        monitor: BucketMonitor | None = None,
    ) -> None:
        import google_crc32c

        self._f = f
        self._cancel = cancel
        self._on_bytes = on_bytes
        self._monitor = monitor
        self._extend = google_crc32c.extend
        self.crc = 0
        self.size = 0

    def write(self, data: bytes) -> int:
        if self._cancel is not None and self._cancel.is_set():
            raise Cancelled("download cancelled")
        n = self._f.write(data)
        self.crc = self._extend(self.crc, bytes(data))
        self.size += len(data)
        if self._monitor is not None:
            self._monitor.progress()
        if self._on_bytes is not None:
            self._on_bytes(len(data))
        return n

    def flush(self) -> None:
        self._f.flush()


# ---------------------------------------------------------------------- results


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


@dataclass(frozen=True)
class RestoreChoice:
    """Which backup to restore for a job (see :meth:`GcsBackend.choose_restore`).

    Attributes:
        round: the round name, or None for "nothing".
        step: the step in it every node restores, or None.
        forced: chosen through ``restore.version``.
        reason: why nothing was chosen or what was chosen (one line).
        info: the inspected round (None when nothing).
    """

    round: str | None
    step: int | None
    forced: bool = False
    reason: str = ""
    info: RoundInfo | None = None


# ---------------------------------------------------------------------- backend


class GcsBackend:
    """Backups of one bucket spec (``--bucket NAME[/PREFIX]``).

    Args:
        spec: bucket and prefix (see :func:`tierfs.backup.layout.parse_bucket`).
        client: a ``google.cloud.storage.Client``; made with :func:`make_client` if None.
        settings: tuning (defaults from :meth:`GcsSettings.from_env`).
        on_retry: called (any thread) with each retryable failure before its retry.
        widen_pool: size the client's HTTP connection pool for ``settings.threads``.

    Attributes:
        monitor: the client's :class:`BucketMonitor` (shared by every backend on
            the same client), or None if the client's session could not be wrapped.

    Every request, its retries included, ends within ``settings.retry_deadline``
    seconds: each HTTP attempt's timeout is capped at the time left (a
    resumable upload gets that much per chunk). Thread-safe: one backend may
    be used by several threads at once.
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
        self.monitor = monitor_of(self.client)
        self.bucket = self.client.bucket(self.spec.bucket)
        self.on_retry = on_retry
        self.retry = _make_retry(self.settings.policy(), self._retrying)
        s = self.settings
        self.timeout = (
            min(s.connect_timeout, s.retry_deadline),
            min(s.read_timeout, s.retry_deadline),
        )

    def _retrying(self, exc: Exception) -> None:
        log.info("GCS request failed, retrying: %s", describe_error(exc))
        if self.on_retry is not None:
            try:
                self.on_retry(exc)
            except Exception:  # a status hook must never break a transfer
                log.debug("on_retry hook failed", exc_info=True)

    def bounded(self, deadline: float) -> GcsBackend:
        """A backend on the same client whose every request, retries and waiting for
        an answer included, ends within ``deadline`` seconds (or the settings'
        retry deadline if shorter). A bucket that does not answer (connections
        accepted, nothing read) then makes the first request of a call raise
        ``RetryError`` or :class:`BucketTimeout` after ``deadline`` seconds, so a
        lookup that stops at its first failure is bounded by it, not by the
        read timeout. Non-blocking (the client is shared).
        """
        import dataclasses

        d = max(0.1, min(deadline, self.settings.retry_deadline))
        first, most = retry.bounded_waits(self.settings.retry_initial, self.settings.retry_max, d)
        s = dataclasses.replace(
            self.settings, retry_deadline=d, retry_initial=first, retry_max=most
        )
        return GcsBackend(
            self.spec, client=self.client, settings=s, on_retry=self.on_retry, widen_pool=False
        )

    @contextlib.contextmanager
    def _request(self) -> Iterator[dict[str, Any]]:
        """``retry=`` and ``timeout=`` for one library call; inside the block every HTTP
        request of this thread is capped at ``settings.retry_deadline`` from now
        (:class:`BucketMonitor`; a resumable upload's reader moves that deadline
        at each chunk).
        """
        with _deadline_scope(time.monotonic() + self.settings.retry_deadline):
            yield {"retry": self.retry, "timeout": self.timeout}

    def bucket_exists(self) -> bool:
        """True if the bucket exists (blocking; retried like every request).

        Raises:
            google.api_core exceptions after retries (bucket unreachable,
            permission denied); BucketTimeout (a bounded backend's deadline).
        """
        with self._request() as kw:
            return bool(self.bucket.exists(**kw))

    # ------------------------------------------------------------------ small objects

    def _get_bytes(self, name: str) -> bytes | None:
        from google.api_core import exceptions as gexc

        try:
            with self._request() as kw:
                return self.bucket.blob(name).download_as_bytes(**kw)
        except gexc.NotFound:
            return None

    def _put_bytes(self, name: str, data: bytes, content_type: str) -> None:
        import google_crc32c

        blob = self.bucket.blob(name)
        crc = google_crc32c.value(data)
        blob.crc32c = crc_b64(crc)
        with self._request() as kw:
            blob.upload_from_string(data, content_type=content_type, checksum=None, **kw)
        if blob.crc32c is not None and crc_from_b64(blob.crc32c) != crc:
            raise ChecksumMismatch(f"{name}: GCS stored a different crc32c")

    def _delete(self, name: str) -> bool:
        from google.api_core import exceptions as gexc

        try:
            with self._request() as kw:
                self.bucket.blob(name).delete(**kw)
        except gexc.NotFound:
            return False
        return True

    def _list(self, prefix: str, delimiter: str | None = None) -> tuple[list[Any], set[str]]:
        with self._request() as kw:
            it = self.client.list_blobs(self.bucket, prefix=prefix, delimiter=delimiter, **kw)
            blobs = list(it)
        return blobs, set(it.prefixes)

    def _get_many(self, prefix: str, names: list[str]) -> dict[str, bytes | None]:
        """The contents of small objects ``prefix + name`` (None: not found), read in
        parallel."""
        if not names:
            return {}
        with cf.ThreadPoolExecutor(min(self.settings.threads, len(names))) as pool:
            return dict(
                zip(names, pool.map(lambda n: self._get_bytes(prefix + n), names), strict=True)
            )

    # ------------------------------------------------------------------ restore.version

    def read_restore_version(self, job: str) -> str | None:
        """The round named by ``gs://<bucket>/<job>/restore.version`` (stripped), or None.

        Raises:
            google.api_core exceptions after retries (bucket unreachable...).
        """
        data = self._get_bytes(self.spec.restore_version(job))
        if data is None:
            return None
        return data.decode("utf-8", "replace").strip()

    def write_restore_version(self, job: str, round_name: str) -> None:
        """Write ``restore.version`` naming ``round_name`` (an operator's action).

        Raises:
            LayoutError: not a round name.
        """
        L.check_round_name(round_name)
        self._put_bytes(self.spec.restore_version(job), round_name.encode(), "text/plain")

    def delete_restore_version(self, job: str) -> bool:
        """Delete ``restore.version``; True if it existed."""
        return self._delete(self.spec.restore_version(job))

    # ------------------------------------------------------------------ rendezvous

    def publish_address(self, job: str, rank: int, address: str, *, incarnation: str) -> None:
        """Write ``.tierfs/nodes/<rank>`` = this node's peer address (JSON record)."""
        self._put_bytes(
            self.spec.rendezvous(job, rank),
            L.rendezvous_record(address, rank, incarnation=incarnation, written=time.time()),
            "application/json",
        )

    def read_address(self, job: str, rank: int = 0) -> L.RendezvousRecord | None:
        """Read node ``rank``'s rendezvous record (None if absent or malformed)."""
        data = self._get_bytes(self.spec.rendezvous(job, rank))
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
        """Poll until rank ``rank`` has published an address written after ``newer_than``.

        Args:
            timeout: seconds to wait in total.
            newer_than: Unix time; older records (a previous run) are ignored.
            poll: seconds between reads.

        Retried by the ``gcs-rendezvous-wait`` policy (:mod:`tierfs.core.retry`):
        every ``poll`` seconds through outages (each read retried by
        ``gcs-request`` first) until ``timeout``.

        Raises:
            TimeoutError: nothing new appeared in time. Cancelled: ``cancel`` was set.
        """

        def again(exc: Exception) -> bool:
            if isinstance(exc, Cancelled):
                return False
            if not isinstance(exc, _NotYet):  # keep polling through outages
                log.info("rendezvous read failed: %s", describe_error(exc))
            return True

        try:
            for attempt in retry.gcs_rendezvous_wait(timeout, poll).retry_context(on=again):
                with attempt:
                    if cancel is not None and cancel.is_set():
                        raise Cancelled("rendezvous cancelled")
                    rec = self.read_address(job, rank)
                    if rec is None or rec.written < newer_than:
                        raise _NotYet(f"no record of rank {rank} written after {newer_than}")
                    return rec
        except Cancelled:
            raise
        except Exception:  # the last attempt's: not there yet, or the bucket failed
            pass
        raise TimeoutError(
            f"no address of rank {rank} under {self.spec}{job}/.tierfs/nodes/ after {timeout:.0f}s"
        )

    # ------------------------------------------------------------------ listing

    def list_round_names(self, job: str) -> list[str]:
        """Round directory names of ``job``, newest first."""
        _blobs, prefixes = self._list(self.spec.job_dir(job), delimiter="/")
        base = self.spec.job_dir(job)
        names = [p[len(base) :].rstrip("/") for p in prefixes]
        return sorted((n for n in names if L.is_round_name(n)), reverse=True)

    def inspect_round(self, job: str, round_name: str, nodes: int | None = None) -> RoundInfo:
        """List one round and judge which step (if any) is complete for every node.

        Args:
            job: the job name.
            round_name: ``YYYY-MM-DD_HH-MM``.
            nodes: the job's node count; if None, the largest ``nodes`` found in
                the round's manifests (else the highest rank seen + 1).

        Raises:
            google.api_core exceptions after retries.
        """
        prefix = self.spec.round_dir(job, round_name)
        blobs, _ = self._list(prefix)
        objects: dict[str, ObjectInfo] = {}
        for b in blobs:
            rel = b.name[len(prefix) :]
            updated = b.updated.timestamp() if getattr(b, "updated", None) else 0.0
            objects[rel] = ObjectInfo(rel, int(b.size or 0), crc_from_b64(b.crc32c), updated)
        metas: dict[tuple[int, int, int], str] = {}
        manifests: dict[tuple[int, int], str] = {}
        for rel in objects:
            if "/" in rel:
                continue
            m = L.parse_meta_name(rel)
            if m is not None and m[0] == job:
                metas[(m[2], m[1], m[3])] = rel
                continue
            t = L.parse_tierfs_manifest_name(rel)
            if t is not None and t[0] == job:
                manifests[(t[2], t[1])] = rel
        fetched = self._get_many(prefix, list(manifests.values()))
        parts: dict[tuple[int, int], NodeEntry] = {}
        seen_nodes = 0
        for (rank, step), name in manifests.items():
            # a manifest without pointer: the upload did not finish
            part = parts.setdefault((rank, step), NodeEntry(rank, step))
            data = fetched.get(name)
            if data is None:
                continue
            try:
                nb = NodeBackup.from_json(data)
            except LayoutError as exc:
                part.notes.append(f"unreadable manifest: {exc}")
                continue
            if (nb.manifest.rank, nb.manifest.step) != (rank, step):
                continue
            part.backup = nb
            seen_nodes = max(seen_nodes, nb.nodes)
        # a pointer listed with the size and crc32c of the hash its part's manifest
        # names holds that hash: read only the others (MTC's, or unexpected ones)
        unread: dict[tuple[int, int, int], str] = {}
        for (rank, step, worker), name in metas.items():
            part = parts.setdefault((rank, step), NodeEntry(rank, step))
            want = part.backup.hashes.get(worker) if part.backup is not None else None
            o = objects[name]
            if want is not None and o.size == len(want) and o.crc32c == meta_crc(want):
                part.metas[worker] = want
            else:
                unread[(rank, step, worker)] = name
        fetched = self._get_many(prefix, list(unread.values()))
        for (rank, step, worker), name in unread.items():
            data = fetched.get(name)
            try:
                parts[(rank, step)].metas[worker] = (
                    L.check_meta_content(data.decode("ascii", "replace"))
                    if data is not None
                    else None
                )
            except LayoutError:
                parts[(rank, step)].metas[worker] = None
        if nodes is None:
            nodes = seen_nodes or (max((r for r, _ in parts), default=-1) + 1)
        info = RoundInfo(
            round_name,
            nodes,
            parts,
            objects,
            sum(o.size for o in objects.values()),
            recorded_nodes=seen_nodes,
        )
        return judge_round(info)

    def list_rounds(
        self,
        job: str,
        nodes: int | None = None,
        *,
        on_round: Callable[[RoundInfo], None] | None = None,
        on_names: Callable[[list[str]], None] | None = None,
    ) -> list[RoundInfo]:
        """Inspect every round of ``job``, newest first (see :meth:`inspect_round`).

        Args:
            on_names: told the round names before inspection starts (progress bars).
            on_round: told each inspected round as it finishes (any thread).
        """
        names = self.list_round_names(job)
        if on_names is not None:
            on_names(names)
        out: dict[str, RoundInfo] = {}

        def one(name: str) -> RoundInfo:
            try:
                info = self.inspect_round(job, name, nodes)
            except Exception as exc:
                info = RoundInfo(name, nodes or 0, error=describe_error(exc))
            if on_round is not None:
                on_round(info)
            return info

        workers = max(1, min(4, len(names)))
        with cf.ThreadPoolExecutor(workers) as pool:
            for info in pool.map(one, names):
                out[info.name] = info
        rounds = [out[n] for n in names]
        if nodes is None:
            apply_job_nodes(rounds, infer_job_nodes(rounds))
        return rounds

    def job_nodes(self, job: str) -> int | None:
        """The job's node count as its backups tell it (see :func:`infer_job_nodes`),
        from listings only: the newest round holding a tierfs manifest gives it
        (one manifest read); without one, the most ranks any round holds.
        None when the job has no round with a pointer or manifest.

        Raises:
            google.api_core exceptions after retries.
        """
        most = 0
        for name in self.list_round_names(job):
            prefix = self.spec.round_dir(job, name)
            blobs, _ = self._list(prefix, delimiter="/")
            for b in blobs:
                rel = b.name[len(prefix) :]
                t = L.parse_tierfs_manifest_name(rel)
                if t is not None and t[0] == job:
                    data = self._get_bytes(b.name)
                    try:
                        nb = NodeBackup.from_json(data) if data is not None else None
                    except LayoutError:
                        nb = None
                    if nb is not None and nb.nodes > 0:
                        return nb.nodes
                m = L.parse_meta_name(rel)
                if m is not None and m[0] == job:
                    most = max(most, m[2] + 1)
                elif t is not None and t[0] == job:
                    most = max(most, t[2] + 1)
        return most or None

    def inspect_round_of_job(
        self, job: str, round_name: str, nodes: int | None = None
    ) -> RoundInfo:
        """:meth:`inspect_round` for one round, judged like :meth:`list_rounds` judges
        it: a round without a tierfs manifest (written by MTC) against the job's
        node count (:meth:`job_nodes`) unless ``nodes`` is given."""
        info = self.inspect_round(job, round_name, nodes)
        if nodes is None and not info.recorded_nodes and info.parts:
            apply_job_nodes([info], self.job_nodes(job))
        return info

    def choose_restore(self, job: str, nodes: int) -> RestoreChoice:
        """The backup every node of ``job`` restores when no step is complete in-cluster.

        ``restore.version`` wins (PROTOCOL.md section 5): if it names a round,
        that round's newest step complete for all ``nodes`` is chosen, and if
        the round is missing or incomplete the choice is *nothing* (no
        fallback). Otherwise the newest round complete for all nodes; partial
        rounds are skipped.

        Raises:
            google.api_core exceptions after retries (the caller decides what an
            unreachable bucket means).
        """
        forced = self.read_restore_version(job)
        if forced is not None:
            if not L.is_round_name(forced):
                return RestoreChoice(
                    None, None, True, f"restore.version names {forced[:40]!r}, not a round"
                )
            info = self.inspect_round(job, forced, nodes)
            if not info.objects:
                return RestoreChoice(
                    None,
                    None,
                    True,
                    f"restore.version names round {forced}, which does "
                    "not exist; nothing restored (no fallback)",
                )
            if info.complete_step is None:
                why = "; ".join(info.problems()[:3])
                return RestoreChoice(
                    None,
                    None,
                    True,
                    f"restore.version names round {forced}, which is "
                    f"incomplete ({why}); nothing restored (no fallback)",
                    info,
                )
            return RestoreChoice(
                forced,
                info.complete_step,
                True,
                f"restore.version: round {forced} step {info.complete_step}",
                info,
            )
        for name in self.list_round_names(job):
            info = self.inspect_round(job, name, nodes)
            if info.complete_step is not None:
                return RestoreChoice(
                    name,
                    info.complete_step,
                    False,
                    f"newest complete round {name} step {info.complete_step}",
                    info,
                )
            log.info("backup round %s skipped: %s", name, "; ".join(info.problems()[:2]))
        return RestoreChoice(None, None, False, "no complete backup round")

    # ------------------------------------------------------------------ upload

    def _existing(self, prefix: str, names: Iterable[str]) -> dict[str, ObjectInfo]:
        heads = {n.split("/", 1)[0] for n in names}
        found: dict[str, ObjectInfo] = {}
        for head in heads:
            sub = prefix + head
            blobs, _ = self._list(sub)
            for b in blobs:
                rel = b.name[len(prefix) :]
                found[rel] = ObjectInfo(rel, int(b.size or 0), crc_from_b64(b.crc32c))
        return found

    def _upload_file(
        self,
        name: str,
        path: str,
        size: int,
        crc: int,
        cancel: _Abort | None,
        on_bytes: Callable[[int], None] | None,
    ) -> None:
        resumable = size > MULTIPART_MAX
        blob = self.bucket.blob(name, chunk_size=self.settings.chunk_size if resumable else None)
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
            window = self.settings.retry_deadline if resumable else None
            with self._request() as kw:
                blob.upload_from_file(
                    _Reader(f, cancel, on_bytes, self.monitor, window),
                    size=size,
                    checksum=None,
                    content_type="application/octet-stream",
                    **kw,
                    **kwargs,
                )
        got = crc_from_b64(blob.crc32c)
        if (got is not None and got != crc) or (blob.size is not None and blob.size != size):
            # an emulator may not enforce the crc32c we sent: check what it stored
            self._delete(name)
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
        have = self._existing(prefix, (u.name for u in todo))
        return [
            p
            for p in (check_object(u.name, have.get(u.name), u.size, u.crc32c) for u in todo)
            if p is not None
        ]

    def await_objects(
        self,
        prefix: str,
        uploads: Iterable[L.Upload],
        *,
        wait: float,
        cancel: threading.Event | None = None,
        poll: float = 0.5,
    ) -> list[str]:
        """Poll the listing until every one of ``uploads`` is there with its size and
        crc32c (another node uploads them), for at most ``wait`` seconds after the
        last progress (an object appearing). Polls back off from ``poll`` to 5 s
        (the ``gcs-dedup-wait`` policy of :mod:`tierfs.core.retry`; a
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
            missing = self.unproven(prefix, todo)
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
        (:meth:`await_objects`), then uploads its own data. Without ``dedup``
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
            missing = self.await_objects(prefix, layout.uploads, wait=wait, cancel=cancel)
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
                have = self._existing(prefix, (u.name for u in todo))
                keep = []
                for u in todo:
                    if check_object(u.name, have.get(u.name), u.size, u.crc32c) is None:
                        result.skipped += 1
                    else:
                        keep.append(u)
                todo = keep
            # big files first: the pool stays busy until the end
            todo.sort(key=lambda u: u.size, reverse=True)
            abort = _Abort(cancel)
            self._run_parallel(
                [
                    lambda u=u: self._upload_file(
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
        self._put_bytes(
            prefix + L.tierfs_manifest_name(m.job, m.step, rank), nb.to_json(), "application/json"
        )
        for worker, digest in sorted(layout.hashes.items()):
            if cancel is not None and cancel.is_set():
                raise Cancelled("upload cancelled")
            self._put_bytes(
                prefix + L.meta_name(m.job, m.step, rank, worker),
                digest.encode("ascii"),
                "text/plain",
            )
        result.objects += 1 + len(layout.hashes)
        result.seconds = time.monotonic() - t0
        return result

    def _run_parallel(self, tasks: list[Callable[[], Any]], abort: _Abort | None) -> list[Any]:
        """Run ``tasks`` on the pool; the first failure sets ``abort`` (which the
        tasks' streams watch), cancels what has not started, and is raised."""
        if not tasks:
            return []
        stop = abort if abort is not None else _Abort(None)

        def guarded(fn: Callable[[], Any]) -> Any:
            if stop.is_set():
                raise Cancelled("cancelled")
            return fn()

        results: list[Any] = []
        with cf.ThreadPoolExecutor(min(self.settings.threads, len(tasks))) as pool:
            futures = [pool.submit(guarded, t) for t in tasks]
            try:
                for fut in cf.as_completed(futures):
                    results.append(fut.result())
            except BaseException:
                stop.set()
                for f in futures:
                    f.cancel()
                raise
        return results

    # ------------------------------------------------------------------ download

    def download_part(
        self,
        job: str,
        round_name: str,
        rank: int,
        step: int,
        dest: str,
        *,
        info: RoundInfo | None = None,
        framework: str | None = None,
        cancel: threading.Event | None = None,
        on_bytes: Callable[[int], None] | None = None,
    ) -> Manifest:
        """Download node ``rank``'s part of ``step`` in a round into ``dest/data``.

        Every file is checked against the manifest (size and crc32c computed
        while writing); directories, symlinks and modes are recreated from it.
        ``dest`` must exist; ``dest/data`` must not.

        Args:
            info: the inspected round (inspected here if None).
            framework: for rounds written by MTC (no tierfs manifest): the
                job's framework, used to rebuild a manifest from the listing.

        Returns:
            the shard manifest the data matches.

        Raises:
            IncompleteRound: the part is missing or incomplete.
            ChecksumMismatch: a downloaded object differs from the manifest.
            Cancelled, OSError (e.g. ENOSPC), google.api_core exceptions.
        """
        if info is None:
            info = self.inspect_round(job, round_name)
        part = info.parts.get((rank, step))
        if part is None or not part.complete:
            why = "; ".join(part.missing[:3]) if part else "no pointer"
            raise IncompleteRound(
                f"round {round_name} has no complete part for rank {rank} step {step} ({why})"
            )
        if part.backup is not None:
            manifest = part.backup.manifest
            objects = part.backup.objects
        else:
            manifest, objects = synthesize_manifest(
                job, rank, step, framework or "orbax", part, info
            )
        prefix = self.spec.round_dir(job, round_name)
        data = os.path.join(dest, "data")
        os.mkdir(data, 0o700)
        for f in manifest.files:
            if f.kind == "dir":
                os.makedirs(os.path.join(data, f.path), 0o700, exist_ok=True)
            elif f.kind == "file":
                os.makedirs(os.path.dirname(os.path.join(data, f.path)), 0o700, exist_ok=True)
        files = sorted(
            (f for f in manifest.files if f.kind == "file"), key=lambda f: f.size, reverse=True
        )
        abort = _Abort(cancel)

        def fetch(f: FileEntry) -> None:
            path = os.path.join(data, f.path)
            name = prefix + objects[f.path]
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb", buffering=1 << 20) as out:
                w = _Writer(out, abort, on_bytes, self.monitor)
                with self._request() as kw:
                    self.bucket.blob(name).download_to_file(w, checksum=None, **kw)
            if w.size != f.size or w.crc != f.crc32c:
                raise ChecksumMismatch(
                    f"{objects[f.path]} in round {round_name}: got {w.size} bytes crc32c "
                    f"{w.crc:08x}, manifest {f.size} bytes crc32c {(f.crc32c or 0):08x}"
                )

        self._run_parallel([lambda f=f: fetch(f) for f in files], abort)
        for f in manifest.files:
            if f.kind == "symlink":
                os.symlink(f.target or "", os.path.join(data, f.path))
        for f in reversed(manifest.files):
            if f.kind in ("file", "dir"):
                os.chmod(os.path.join(data, f.path), stat.S_IMODE(f.mode))
        return manifest

    def restore_shard(
        self,
        shards: ShardStore,
        job: str,
        round_name: str,
        rank: int,
        step: int,
        *,
        info: RoundInfo | None = None,
        framework: str | None = None,
        cancel: threading.Event | None = None,
        on_bytes: Callable[[int], None] | None = None,
        free_bytes: int | None = None,
    ) -> Shard:
        """Download a node's part into ``store/incoming/`` and commit it as a verified shard.

        Args:
            free_bytes: if given, refuse (GcsError) a part larger than this
                many bytes before downloading anything (RAM budget).

        Raises:
            like :meth:`download_part`; nothing is left behind on failure.
        """
        if info is None:
            info = self.inspect_round(job, round_name)
        part = info.parts.get((rank, step))
        if free_bytes is not None and part is not None:
            need = part.backup.manifest.total_bytes if part.backup is not None else part.bytes
            if need > free_bytes:
                raise GcsError(
                    f"round {round_name} rank {rank}: {need} bytes do not fit in "
                    f"the {free_bytes} bytes left in the RAM budget"
                )
        inc = shards.ram.new_incoming(f"gcs-{rank}-{step}")
        try:
            manifest = self.download_part(
                job,
                round_name,
                rank,
                step,
                inc,
                info=info,
                framework=framework,
                cancel=cancel,
                on_bytes=on_bytes,
            )
            return shards.commit(inc, manifest, verified=True)
        except BaseException:
            _discard(shards.ram, inc)
            raise

    # ------------------------------------------------------------------ delete

    def delete_round(
        self,
        job: str,
        round_name: str,
        *,
        on_object: Callable[[str], None] | None = None,
        on_listed: Callable[[int], None] | None = None,
    ) -> int:
        """Delete every object of a round (and the nodes' outcome records of it);
        pointers first, so readers see it partial at once.

        Returns the number of objects deleted.
        """
        prefix = self.spec.round_dir(job, round_name)
        blobs, _ = self._list(prefix)
        names = [b.name for b in blobs]
        outcomes, _ = self._list(self.spec.round_status_dir(job, round_name))
        names += [b.name for b in outcomes]
        if on_listed is not None:
            on_listed(len(names))
        metas = [n for n in names if n.endswith(".meta") and "/" not in n[len(prefix) :]]
        rest = [n for n in names if n not in set(metas)]

        def rm(name: str) -> int:
            gone = self._delete(name)
            if on_object is not None:
                on_object(name)
            return int(gone)

        count = sum(self._run_parallel([lambda n=n: rm(n) for n in metas], None))
        count += sum(self._run_parallel([lambda n=n: rm(n) for n in rest], None))
        return count

    def tidy_round(self, job: str, round_name: str, nodes: int) -> int:
        """Remove what a failed or moved backup round left behind; returns the number
        of objects deleted.

        The round is judged first (the listing decides, not the caller's view),
        against the node count its manifests record (else ``nodes``): with no
        step complete for every node the whole round goes (:meth:`delete_round`,
        pointers first); otherwise the parts of the steps that are not complete
        -- their pointers, then their manifests, then data objects under their
        data names. A complete step, and the round ``restore.version`` names,
        are never touched.

        Raises:
            google.api_core exceptions after retries.
        """
        if self.read_restore_version(job) == round_name:
            return 0
        info = self.inspect_round(job, round_name)
        if not info.objects:
            return 0
        if not info.recorded_nodes:
            info.nodes = max(nodes, info.ranks_seen)
            judge_round(info)
        keep = {
            s
            for s in info.steps
            if all((r, s) in info.parts and info.parts[(r, s)].complete for r in range(info.nodes))
        }
        if not keep:
            return self.delete_round(job, round_name)
        prefix = self.spec.round_dir(job, round_name)
        pointers, manifests, heads = [], [], set()
        for name in info.objects:
            m = L.parse_meta_name(name)
            t = L.parse_tierfs_manifest_name(name)
            if m is not None and m[0] == job and m[1] not in keep:
                pointers.append(name)
            elif t is not None and t[0] == job and t[1] not in keep:
                manifests.append(name)

        def data_names(e: NodeEntry) -> set[str]:
            hashes = set(e.backup.hashes.values()) if e.backup is not None else set()
            hashes |= {h for h in e.metas.values() if h is not None}
            return {L.data_name(h) for h in hashes}

        for (_r, step), e in info.parts.items():
            if step not in keep:
                heads |= data_names(e)
        kept = set().union(*(data_names(e) for (_r, step), e in info.parts.items() if step in keep))
        data = [n for n in info.objects if n.split("/", 1)[0] in heads - kept]
        count = 0
        for batch in (pointers, manifests, data):
            count += sum(
                self._run_parallel([lambda n=n: int(self._delete(prefix + n)) for n in batch], None)
            )
        return count


def _discard(ram: RamStore, path: str) -> None:
    try:
        ram.to_trash(path)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)


def synthesize_manifest(
    job: str, rank: int, step: int, framework: str, part: NodeEntry, info: RoundInfo
) -> tuple[Manifest, dict[str, str]]:
    """A shard manifest for a part written by MTC (no tierfs manifest), from the listing.

    The crc32c GCS reports for each object stands in for the seal-time
    checksum. Directory data (``D<hash>.data/...``) becomes the step
    directory ``<step>``; single objects become the ``pytorch`` worker file
    ``<job>-s<step>-n<rank>-w<w>.save``.

    Raises:
        IncompleteRound: an object lacks a crc32c.
    """
    files: list[FileEntry] = []
    objects: dict[str, str] = {}
    dirs: set[str] = set()
    for w, h in sorted(part.metas.items()):
        if h is None:
            continue
        dname = L.data_name(h)
        if dname in info.objects:
            o = info.objects[dname]
            path = f"{job}-s{step}-n{rank}-w{w}.save"
            if o.crc32c is None:
                raise IncompleteRound(f"{dname}: no crc32c in the listing")
            files.append(FileEntry(path, "file", size=o.size, crc32c=o.crc32c))
            objects[path] = dname
            continue
        top = str(step)
        dirs.add(top)
        for name, o in sorted(info.objects.items()):
            if not name.startswith(dname + "/"):
                continue
            rel = name[len(dname) + 1 :]
            if not rel or rel.endswith("/"):
                continue
            if o.crc32c is None:
                raise IncompleteRound(f"{name}: no crc32c in the listing")
            path = f"{top}/{rel}"
            parent = path.rsplit("/", 1)[0]
            while parent and parent not in dirs:
                dirs.add(parent)
                parent = parent.rsplit("/", 1)[0] if "/" in parent else ""
            files.append(FileEntry(path, "file", size=o.size, crc32c=o.crc32c))
            objects[path] = name
    entries = [FileEntry(d, "dir", mode=0o755) for d in sorted(dirs)]
    entries += [FileEntry(f.path, f.kind, f.size, 0o644, f.crc32c) for f in files]
    entries.sort(key=lambda e: e.path)
    check_entries(entries)
    name = str(step) if dirs else (entries[0].path if entries else str(step))
    manifest = Manifest(
        job=job, rank=rank, step=step, name=name, framework=framework, files=tuple(entries)
    )
    return manifest, objects
