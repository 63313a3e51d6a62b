"""Request deadlines and the bucket monitor: every HTTP request of a storage client.

Each library call gets ``timeout=`` (connect, read) no longer than its retry
deadline and ``retry=`` with that deadline, and every HTTP attempt the client
sends inside the call (retries, each resumable chunk) has its timeout capped
at the time left (:class:`BucketMonitor` wraps the client's session). A bucket
that stops answering (connections accepted, nothing read) therefore costs a
:meth:`tierfs.backup.bucket.GcsBackend.bounded` caller its deadline, not the
120 s read timeout. The same monitor records requests in flight and the last
answer, for "slow or stalled" reports (:meth:`BucketMonitor.stalled_for`).

The deadline is per thread (:func:`deadline_scope`; a resumable upload's
stream moves it at each chunk with :func:`extend_deadline`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from tierfs.backup.errors import BucketTimeout
from tierfs.backup.gate import SharedBackoff

log = logging.getLogger(__name__)

_deadline = threading.local()

#: HTTP statuses that mean "try again" rather than an answer about the bucket
_RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


def thread_deadline() -> float | None:
    """The calling thread's deadline (``time.monotonic()`` seconds), if any."""
    return getattr(_deadline, "until", None)


@contextlib.contextmanager
def deadline_scope(until: float) -> Iterator[None]:
    """Cap every HTTP request this thread sends inside the block at ``until``
    (``time.monotonic()`` seconds)."""
    prev = thread_deadline()
    _deadline.until = until
    try:
        yield
    finally:
        _deadline.until = prev


def extend_deadline(seconds: float) -> None:
    """Move the calling thread's request deadline to ``seconds`` from now (the next
    chunk of a resumable upload gets a full retry deadline)."""
    _deadline.until = time.monotonic() + seconds


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
        gate: the :class:`SharedBackoff` every request of the client waits at
            (429/503 answers close it for all threads).
    """

    def __init__(self, gate: SharedBackoff | None = None) -> None:
        self.gate = gate if gate is not None else SharedBackoff()
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
        until = thread_deadline()
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
        mon.gate.wait(thread_deadline())
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
            mon.gate.answered(status)

    try:
        session.request = request
        session._tierfs_monitor = mon
    except Exception:
        log.debug("could not wrap the HTTP session", exc_info=True)
        return None
    return mon
