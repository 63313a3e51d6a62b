"""The GCS tier's way to its bucket: the backend, worker threads, the bucket's health.

:class:`BucketAccess` creates the :class:`tierfs.backup.bucket.GcsBackend` on
first use (credential discovery blocks), runs blocking calls in worker threads
behind a capacity limiter, and knows the bucket's current problem:

* the check at mount is bounded by ``$TIERFS_GCS_START_DEADLINE`` (only "does
  not exist" fails the mount, :meth:`BucketAccess.check_at_mount`);
* a bucket problem is reported while it lasts -- requests waiting without an
  answer for ``$TIERFS_GCS_STALL_SECONDS``, or the last failed request -- and
  cleared by the next answer (:meth:`BucketAccess.bucket_problem`, fed by the
  backend's :class:`tierfs.backup.monitor.BucketMonitor`); meanwhile
  :meth:`BucketAccess.watch` checks the bucket itself in the background.

:func:`preflight_bucket` is the same check for ``tierfs mount`` before the
daemon starts.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

import trio

from tierfs.backup import layout as L
from tierfs.backup.bucket import GcsBackend, GcsSettings
from tierfs.backup.client import describe_error
from tierfs.backup.errors import GcsError
from tierfs.backup.judge import RoundInfo
from tierfs.backup.monitor import BucketMonitor
from tierfs.backup.progress import ErrorLines
from tierfs.core import retry, settings

log = logging.getLogger(__name__)

#: the bucket problem while the bucket has not answered since the mount
START_PROBLEM = "bucket unreachable at start"


class BucketAccess:
    """The backend of one bucket spec and what the tier knows of the bucket's health.

    Args:
        spec: the bucket, or None (the tier is off: nothing here may be called).
        settings: transfer tuning of the backend.
        lines: where a bucket that does not exist is reported.

    Attributes:
        backend: the backend once created (a test may set it: the seam).
        retrying: the current bucket problem (set by a failed request, cleared
            by an answer), or None.
        bucket_checked: False while the bucket check at mount could not get an answer.
    """

    def __init__(self, spec: L.BucketSpec | None, settings: GcsSettings, lines: ErrorLines) -> None:
        self.spec = spec
        self.settings = settings
        self.lines = lines
        self.backend: GcsBackend | None = None
        self.retrying: str | None = None
        self._retrying_at = 0.0
        self.bucket_checked = True
        self._missing_reported = False
        self._stall_logged = False
        self._control = trio.CapacityLimiter(2)
        self._backend_lock = threading.Lock()
        self._bounded: dict[float, GcsBackend] = {}

    # ------------------------------------------------------------------ the backend

    def get_backend(self) -> GcsBackend:
        """The backend, created on first use (blocking: credential discovery)."""
        with self._backend_lock:
            if self.backend is None:
                assert self.spec is not None
                self.backend = GcsBackend(
                    self.spec, settings=self.settings, on_retry=self._on_retry
                )
            return self.backend

    def bounded(self, deadline: float) -> GcsBackend:
        """The backend with requests that give up after ``deadline`` seconds (cached;
        blocking on first use)."""
        backend = self.get_backend()
        with self._backend_lock:
            b = self._bounded.get(deadline)
            if b is None:
                b = self._bounded[deadline] = backend.bounded(deadline)
            return b

    async def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a blocking backend call in a worker thread (control limiter)."""
        async with self._control:
            return await trio.to_thread.run_sync(
                functools.partial(fn, *args, **kwargs), abandon_on_cancel=True
            )

    # ------------------------------------------------------------------ health

    def _on_retry(self, exc: Exception) -> None:
        self.problem(describe_error(exc))

    def problem(self, text: str) -> None:
        """Note a current bucket problem (any thread); an answer clears it.

        Until the bucket has answered once since the mount (``bucket_checked``),
        the problem keeps saying so: a later failure (the background check, a
        rendezvous write) adds its own line to "bucket unreachable at start"
        instead of replacing it."""
        if not self.bucket_checked and not text.startswith(START_PROBLEM):
            text = f"{START_PROBLEM}, still: {text}"
        self._retrying_at = time.monotonic()
        self.retrying = f"{text} (retrying, at {time.strftime('%H:%M:%S')})"

    def ok(self) -> None:
        """The bucket answered: no problem."""
        self.retrying = None
        self.bucket_checked = True

    def _monitor(self) -> BucketMonitor | None:
        backend = self.backend
        return backend.monitor if backend is not None else None

    def answered_since(self, when: float) -> bool:
        """The bucket answered a request after ``time.monotonic()`` time ``when``."""
        mon = self._monitor()
        return mon is not None and mon.last_answer > when

    def stalled(self) -> float:
        """Seconds requests have waited for the bucket without any answer, if at
        least ``$TIERFS_GCS_STALL_SECONDS``; else 0.0."""
        mon = self._monitor()
        waited = mon.stalled_for() if mon is not None else 0.0
        return waited if waited >= settings.GCS_STALL_SECONDS.get() else 0.0

    def bucket_problem(self) -> str | None:
        """The bucket's current problem as one line, or None: requests waiting
        without an answer (slow or stalled), else the last failure not followed
        by an answer (any thread)."""
        if self.retrying is not None and self.answered_since(self._retrying_at):
            self.retrying = None
        waited = self.stalled()
        if waited:
            mon = self._monitor()
            n = mon.in_flight() if mon is not None else 0
            line = f"bucket slow or stalled: no answer for {waited:.0f} s ({n} request(s) waiting)"
            return line if self.bucket_checked else f"{START_PROBLEM}, still: {line}"
        return self.retrying

    def log_stall(self) -> None:
        """Log once when requests start to stall, and once when the bucket answers again."""
        waited = self.stalled()
        if waited and not self._stall_logged:
            self._stall_logged = True
            log.warning("GCS tier: %s", self.bucket_problem())
        elif not waited and self._stall_logged:
            self._stall_logged = False
            log.info("GCS tier: the bucket answers again")

    # ------------------------------------------------------------------ checks

    def _bucket_exists(self, deadline: float) -> bool:
        """Whether the bucket exists, asked within ``deadline`` seconds (blocking)."""
        return self.bounded(deadline).bucket_exists()

    async def check_at_mount(self) -> None:
        """Fail the mount for a bucket that does not exist; a bucket that does not
        answer within ``$TIERFS_GCS_START_DEADLINE`` seconds is reported (status,
        ``replicator.errors``) and checked again in the background.

        Raises:
            GcsError: the bucket does not exist (a typo would otherwise show up
                only as a stream of failed rounds).
        """
        assert self.spec is not None
        exists = None
        problem = "no answer"
        # the thread is abandoned if even the capped request outlives the deadline
        # (name resolution, for one, has no socket timeout)
        deadline = settings.GCS_START_DEADLINE.get()
        with trio.move_on_after(deadline + 1.0):
            try:
                exists = await trio.to_thread.run_sync(
                    lambda: self.bounded(deadline).bucket_exists(), abandon_on_cancel=True
                )
            except Exception as exc:  # unreachable now: training must not wait for it
                problem = describe_error(exc)
        if exists is None:
            self.bucket_checked = False
            self.problem(f"{START_PROBLEM} ({problem})")
            self.lines.fail(
                f"{START_PROBLEM} ({problem}); mounted anyway, checking it again in the background"
            )
            return
        if not exists:
            raise GcsError(f"bucket {self.spec.bucket!r} does not exist")

    async def watch(self) -> None:
        """While the bucket has a problem (or the check at mount got no answer):
        check it again, every ``$TIERFS_GCS_UPLOAD_RETRY_FIRST`` s doubling up to
        ``$TIERFS_GCS_UPLOAD_RETRY_MAX`` s, so the problem clears as soon as it answers even
        when nothing else calls it. A bucket that turns out not to exist is
        reported once. Policy ``gcs-bucket-check`` (:mod:`tierfs.core.retry`)."""
        assert self.spec is not None
        backoff = retry.gcs_bucket_check().backoff()
        delay = backoff.next()
        while True:
            if self.bucket_checked and self.bucket_problem() is None:
                backoff = retry.gcs_bucket_check().backoff()
                delay = backoff.next()
                await trio.sleep(settings.GCS_TICK.get())
                continue
            since = time.monotonic()
            with trio.move_on_after(delay):
                while not self.answered_since(since):
                    await trio.sleep(min(settings.GCS_TICK.get(), 0.5))
            try:
                exists = await self.call(self._bucket_exists, settings.GCS_START_DEADLINE.get())
            except Exception as exc:
                if not self.answered_since(since):
                    self.problem(describe_error(exc))
                delay = backoff.next()
                continue
            if not exists:
                if not self._missing_reported:
                    self._missing_reported = True
                    self.lines.fail(
                        f"bucket {self.spec.bucket!r} does not exist; backups "
                        "fail until it is created"
                    )
                self.problem(f"bucket {self.spec.bucket!r} does not exist")
                delay = backoff.policy.max_wait
                continue
            if not self.bucket_checked or self.retrying is not None:
                log.info("GCS tier: bucket %s answers again", self.spec)
            self._missing_reported = False
            self.ok()
            backoff = retry.gcs_bucket_check().backoff()
            delay = backoff.next()

    async def read_seed(
        self, job: str, nodes: int
    ) -> tuple[str | None, tuple[str, int] | None, dict[int, str]]:
        """The bucket's newest round name, newest complete (round, step) of the last 3,
        and that round's parts of the step (rank -> manifest digest; ranks whose
        part records none are left out): what a schedule starts from (each request
        bounded by ``$TIERFS_GCS_LOOKUP_DEADLINE``).

        Raises:
            google.api_core exceptions, BucketTimeout: the bucket cannot be listed.
        """
        backend = self.bounded(settings.GCS_LOOKUP_DEADLINE.get())
        names = await self.call(backend.list_round_names, job)
        complete = None
        parts: dict[int, str] = {}
        for name in names[:3]:
            info = await self.call(backend.inspect_round, job, name, nodes)
            if info.complete_step is not None:
                complete = (name, info.complete_step)
                parts = seed_parts(info)
                break
        return (names[0] if names else None), complete, parts


def seed_parts(info: RoundInfo) -> dict[int, str]:
    """Rank -> manifest digest of ``info``'s parts of its complete step (pure; parts
    without a tierfs manifest, e.g. written by MTC, are left out)."""
    return {
        rank: entry.backup.manifest.digest
        for (rank, step), entry in info.parts.items()
        if step == info.complete_step and entry.backup is not None and entry.backup.manifest.digest
    }


def preflight_bucket(bucket: str, deadline: float | None = None) -> str | None:
    """Check ``--bucket NAME[/PREFIX]`` before a mount creates anything (blocking).

    For ``tierfs mount``, so that a bucket the daemon would refuse fails the
    command before the ram-dir is created. The daemon checks again at start
    (:meth:`BucketAccess.check_at_mount`), with the same rule.

    Args:
        deadline: seconds the check may wait for the bucket (default
            ``$TIERFS_GCS_START_DEADLINE``).

    Returns:
        a one-line error for an invalid name or a bucket that definitely does
        not exist; None if it exists or did not answer in time (an
        unreachable bucket never stops a mount).
    """
    try:
        spec = L.parse_bucket(bucket)
    except L.LayoutError as exc:
        return f"--bucket: {exc}"
    try:
        backend = GcsBackend(spec, widen_pool=False).bounded(
            settings.GCS_START_DEADLINE.get() if deadline is None else deadline
        )
        exists = backend.bucket_exists()
    except Exception as exc:  # unreachable, credentials: the daemon reports it
        log.info("bucket check before mounting: %s", describe_error(exc))
        return None
    return None if exists else f"bucket {spec.bucket!r} does not exist"
