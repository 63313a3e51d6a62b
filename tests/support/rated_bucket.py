"""A request-counting, rate-limited :class:`fake_bucket.FakeGcs` (issue #17).

GCS starts a bucket at about 1,000 object writes/s and 5,000 object reads/s
(listings count as reads) and answers 429 above that. :class:`RatedGcs` keeps
one token bucket per budget (``writes_per_s``, ``reads_per_s``, bursts of one
second's worth), answers 429 when a request finds its bucket empty, and counts
every request it admitted: object writes (``put``, ``delete``), object reads
(``get``, ``exists``) and list calls, a listing of more than
:data:`tierfs.backup.budget.LIST_PAGE` entries counting one call per page (the
fake answers in one response; GCS pages). :meth:`RatedGcs.scale` multiplies
the rates (GCS's ramp-up, or a benchmark's faster clock).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from fake_bucket import FakeGcs, FakeResponse

from tierfs.backup.budget import BASE_READS_PER_S, BASE_WRITES_PER_S, Requests, pages

WRITE_OPS = ("put", "delete")
READ_OPS = ("get", "exists")


class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` held (thread-safe).

    Args:
        rate: tokens per second. burst: the most tokens held (default ``rate``).
        clock: monotonic seconds (tests).
    """

    def __init__(
        self, rate: float, burst: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = rate
        self.burst = rate if burst is None else burst
        self.clock = clock
        self.tokens = self.burst
        self.at = clock()
        self._lock = threading.Lock()

    def take(self, n: float = 1.0) -> bool:
        """Take ``n`` tokens if there are; False (nothing taken) if not."""
        with self._lock:
            now = self.clock()
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
            self.at = now
            if self.tokens >= n:
                self.tokens -= n
                return True
            return False


class RatedGcs(FakeGcs):
    """:class:`FakeGcs` with GCS's request rates and request counters.

    Args:
        writes_per_s, reads_per_s: the rates (GCS's base rates by default).
        clock: monotonic seconds for the token buckets (tests).
        kw: passed to :class:`FakeGcs`.

    Attributes:
        counts: admitted requests (:class:`tierfs.backup.budget.Requests`).
        refused: requests answered 429 by the rate limit.
    """

    def __init__(
        self,
        writes_per_s: float = BASE_WRITES_PER_S,
        reads_per_s: float = BASE_READS_PER_S,
        clock: Callable[[], float] = time.monotonic,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        self.clock = clock
        self.writes = TokenBucket(writes_per_s, clock=clock)
        self.reads = TokenBucket(reads_per_s, clock=clock)
        self.counts = Requests()
        self.refused = 0
        self._count_lock = threading.Lock()

    def scale(self, factor: float) -> None:
        """Multiply both rates (and bursts) by ``factor`` (GCS doubles them every 20 min)."""
        for b in (self.writes, self.reads):
            b.rate *= factor
            b.burst *= factor

    def reset_counts(self) -> Requests:
        """The counts so far; start again from zero."""
        with self._count_lock:
            out, self.counts, self.refused = self.counts, Requests(), 0
        return out

    def handle(self, op: str, bucket: str, name: str, timeout: Any, work: Callable[[], Any]) -> Any:
        limit = self.writes if op in WRITE_OPS else self.reads
        if not limit.take():
            with self._count_lock:
                self.refused += 1
            self.log.append((op, name, "429"))
            return FakeResponse(429, f"rate limit: {op} {name}"), None
        response, result = super().handle(op, bucket, name, timeout, work)
        if op == "list":
            entries = 0
            if result is not None:
                blobs, prefixes = result
                entries = len(blobs) + len(prefixes)
            n = pages(entries)
            if n > 1:
                limit.take(0.0)  # the extra pages draw on the budget below, unconditionally
                with limit._lock:
                    limit.tokens -= n - 1
            add = Requests(lists=n)
        elif op in WRITE_OPS:
            add = Requests(writes=1)
        else:
            add = Requests(reads=1)
        with self._count_lock:
            self.counts = self.counts + add
        return response, result
