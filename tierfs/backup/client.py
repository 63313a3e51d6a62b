"""The google-cloud-storage adapter's base: settings, the client, its retry object,
and what a failure means (:func:`is_transient`, :func:`describe_error`).

Google Cloud Storage is reached only through ``google-cloud-storage``;
credentials are found the library's usual way (Application Default
Credentials), and ``STORAGE_EMULATOR_HOST`` (``http://host:port``) selects an
emulator such as fake-gcs-server, for which the library uses anonymous
credentials by itself.

Failures: every request is retried with exponential backoff on 429, 408,
5xx, timeouts and connection errors (``google.cloud.storage.retry``'s
predicate) until ``GcsSettings.retry_deadline`` seconds have passed; then
the exception propagates (see :func:`describe_error`).
"""

from __future__ import annotations

import base64
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tierfs.backup.errors import BucketTimeout, GcsError
from tierfs.core import retry, settings

log = logging.getLogger(__name__)

MiB = 1 << 20
#: google-cloud-storage uses one multipart request up to this size, resumable above
MULTIPART_MAX = 8 * MiB


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
    from google.cloud import storage  # type: ignore[import-untyped]

    if project is None:
        project = os.environ.get("GOOGLE_CLOUD_PROJECT") or None
    if project is None and os.environ.get("STORAGE_EMULATOR_HOST"):
        return storage.Client(project=None)
    return storage.Client(project=project) if project else storage.Client()


def widen_pool(client: Any, size: int) -> None:
    """Let ``size`` threads share the client's HTTP session without pool warnings."""
    try:
        import requests.adapters

        session = client._http
        adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=size + 4)
        session.mount("https://", adapter)
        session.mount("http://", adapter)
    except Exception:  # a private attribute of google-cloud-core; best effort
        log.debug("could not widen the HTTP connection pool", exc_info=True)


def make_retry(policy: retry.Policy, on_error: Callable[[Exception], None]) -> Any:
    """google-cloud-storage's retry object for one call (its predicate: 408/429/5xx,
    timeouts, connection errors) with the waits and deadline of ``policy`` (the
    ``gcs-request`` row of docs/RETRIES.md) and an ``on_error`` hook.

    The library's ``Retry`` is the right layer for a single call: it retries inside
    the call, so a resumable upload resumes the failed chunk from the bytes the
    server holds instead of starting the object again.
    """
    from google.api_core import retry as gretry
    from google.cloud.storage.retry import DEFAULT_RETRY  # type: ignore[import-untyped]

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


# ---------------------------------------------------------------------- checksums, errors


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
