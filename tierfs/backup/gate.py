"""One backoff for every bucket call of a daemon (issue #17): when the bucket
answers 429 or 503 ("slow down"), every thread pauses, not only the one that was
told.

google-cloud-storage's ``Retry`` backs off each call on its own (the
``gcs-request`` policy, docs/RETRIES.md); with 8 transfer threads and a restore
reading rounds beside them, the other calls keep hitting a bucket that is over
its request rate. :class:`SharedBackoff` sits in front of the client's HTTP
session (installed with the :class:`tierfs.backup.monitor.BucketMonitor`): each
429/503 answer closes the gate for a jittered exponential pause (``first`` ×
2^(n-1) seconds for the n-th refusal in a row, at most ``max_wait``, times a
uniform factor in [0.5, 1)), every request waits at the gate before it goes
out (never past its own deadline), and an answer that is not a refusal opens it
and starts the count again. The per-call ``Retry`` stays as it was.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

#: the answers that close the gate: GCS's "reduce your request rate"
SLOW_DOWN = frozenset({429, 503})


class SharedBackoff:
    """A jittered exponential pause shared by every request of one client (thread-safe).

    Args:
        first: seconds of the pause after the first refusal.
        max_wait: the longest pause, seconds.
        clock: monotonic seconds. sleep: waits (tests give fakes).
        rng: jitter source (uniform factor in [0.5, 1)).

    Attributes:
        refusals: 429/503 answers in a row (0: the gate is open).
        paused: total seconds requests waited at the gate.
    """

    def __init__(
        self,
        first: float = 0.5,
        max_wait: float = 30.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.first = first
        self.max_wait = max_wait
        self.clock = clock
        self.sleep = sleep
        self.rng = rng or random.Random()
        self.refusals = 0
        self.until = 0.0
        self.paused = 0.0
        self.configured = False
        self._lock = threading.Lock()

    def configure(self, first: float, max_wait: float) -> None:
        """Take the waits of the client's first store (its ``gcs-request`` policy's
        first and max wait, seconds); later calls change nothing."""
        with self._lock:
            if not self.configured:
                self.first, self.max_wait, self.configured = first, max_wait, True

    def pause_for(self, n: int) -> float:
        """The un-jittered pause after the n-th refusal in a row, seconds."""
        return min(self.max_wait, self.first * 2.0 ** max(0, n - 1))

    def wait(self, deadline: float | None = None) -> float:
        """Wait until the gate is open (or ``deadline``, ``clock()`` seconds, passes).

        Returns:
            the seconds waited.
        """
        waited = 0.0
        while True:
            with self._lock:
                left = self.until - self.clock()
            if deadline is not None:
                left = min(left, deadline - self.clock())
            if left <= 0:
                break
            self.sleep(left)
            waited += left
        if waited:
            with self._lock:
                self.paused += waited
        return waited

    def answered(self, status: int | None) -> None:
        """Record an HTTP answer: 429/503 closes the gate (longer each time in a row),
        any other status opens it; None (no response) changes nothing."""
        if status is None:
            return
        with self._lock:
            if status in SLOW_DOWN:
                self.refusals += 1
                pause = self.pause_for(self.refusals) * (0.5 + self.rng.random() / 2)
                self.until = max(self.until, self.clock() + pause)
            elif self.refusals:
                self.refusals = 0
                self.until = 0.0
