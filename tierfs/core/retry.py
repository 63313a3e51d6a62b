"""Every retry policy of tierfs in one table: what is retried, how often, how long.

A :class:`Policy` is plain data (waits in seconds); the functions below build
each one from the ``TIERFS_*`` variables (:mod:`tierfs.core.settings`) when
they are called, so a changed environment counts. docs/RETRIES.md holds
:func:`markdown_table` between ``<!-- retries:start -->`` and
``<!-- retries:end -->`` (a test keeps them equal; ``python -m
tierfs.core.retry`` prints it).

Three layers run a policy, each where it is the right one:

* **stamina** (:meth:`Policy.retry_context`) -- "call this until it works or
  the deadline passes", sync or trio (``for attempt in ...: with attempt:``
  / ``async for``). Exponential backoff with jitter; in tests
  ``stamina.set_testing(True)`` removes the waits and caps the attempts.
* **google-cloud-storage's Retry** -- every single bucket call
  (``retry=`` of the library, with its predicate: 408, 429, 5xx, timeouts,
  connection errors). It retries *inside* the call: a resumable upload
  resumes a chunk from the bytes the server has, which no outer loop can.
  :func:`gcs_request` gives its waits and deadline; ``tierfs.backup.bucket``
  builds the ``Retry``.
* **:class:`Backoff`** -- only the waits, for loops stamina cannot run
  because their wait must end early on an event (the bucket answered, a stop
  or cancel was requested), their deadline moves with progress, or they
  supervise forever and start over after each success. stamina sleeps a
  fixed time per attempt and ends at the first success; these loops need
  both the other way. :class:`Backoff` follows stamina's formula and its
  testing mode (no waits while ``stamina.is_testing()``).

The wait before retry ``n`` (1 = the first retry) is
``min(max_wait, first * 2 ** (n - 1) + uniform(0, jitter))`` (stamina's
formula; ``exp_base`` 1.0 makes it a fixed poll).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import stamina
import stamina.instrumentation

from tierfs.core import settings

log = logging.getLogger(__name__)

__all__ = [
    "Backoff",
    "Policy",
    "all_policies",
    "bounded_waits",
    "csi_mount",
    "gcs_bucket_check",
    "gcs_dedup_wait",
    "gcs_rendezvous_wait",
    "gcs_request",
    "gcs_upload",
    "markdown_table",
    "operator_apply",
    "peer_push",
    "rendezvous_publish",
    "restore_call",
    "restore_join",
    "short_deadline_waits",
]

STAMINA = "stamina"
GCS_RETRY = "google-cloud-storage Retry"
BACKOFF = "Backoff"
KOPF = "kopf"

#: what a stamina policy retries: exception class(es), or a predicate over the exception
#: (True: retry it; a number: retry after that many seconds instead of the backoff)
Retried = type[Exception] | tuple[type[Exception], ...] | Callable[[Exception], bool | float]


@dataclass(frozen=True)
class Policy:
    """One retry policy (a row of docs/RETRIES.md).

    Attributes:
        name: the row's name (``gcs-upload``).
        retries: what is tried again, in words.
        not_retried: what ends it at once, in words.
        first: seconds before the first retry (> 0).
        max_wait: the longest wait between two attempts, seconds (> 0; it caps
            ``first`` too).
        deadline: seconds after the first attempt past which no attempt starts
            (stamina's ``timeout``); None: no time limit (the loop's own end).
        attempts: most attempts in all, the first included; None: no limit.
        jitter: seconds, at most, added at random to each wait (then capped
            at ``max_wait``).
        exp_base: each wait is the previous one times this (1.0: fixed poll).
        layer: which code runs it (``stamina``, ``google-cloud-storage Retry``,
            ``Backoff``, ``kopf``).
        where: the code that uses it (module:function).
        knobs: the ``TIERFS_*`` variables (or flags) that set its numbers.
        jitter_note: the jitter in words when the layer draws its own.
    """

    name: str
    retries: str
    not_retried: str
    first: float
    max_wait: float
    deadline: float | None
    layer: str
    where: str
    attempts: int | None = None
    jitter: float = 0.0
    exp_base: float = 2.0
    knobs: str = ""
    jitter_note: str = ""

    def wait(self, retry: int, rand: Callable[[float, float], float] = random.uniform) -> float:
        """Seconds to wait before retry number ``retry`` (1 = the first retry).

        ``rand(0, jitter)`` draws the jitter (``random.uniform``; a test passes
        a fixed one).
        """
        n = max(1, retry)
        base = self.first * self.exp_base ** (n - 1)
        extra = rand(0.0, self.jitter) if self.jitter > 0 else 0.0
        return min(self.max_wait, base + extra)

    def retry_context(self, on: Retried) -> Any:
        """stamina's ``retry_context`` with this policy's numbers: iterate it (``for`` in
        sync code, ``async for`` under trio) and run each attempt in ``with attempt:``.

        Args:
            on: the exception class(es) retried, or a predicate over the exception
                (True: retry it).

        Raises (from the iteration): the last attempt's exception once the
        attempts or the deadline are used up; an exception ``on`` does not
        retry at once.
        """
        return stamina.retry_context(
            # stamina 26.2 widened its type of ``on`` (BaseException, timedelta);
            # ``Retried`` fits every release since 25.1
            on=cast(Any, on),
            attempts=self.attempts,
            timeout=self.deadline,
            wait_initial=self.first,
            wait_max=self.max_wait,
            wait_jitter=self.jitter,
            wait_exp_base=self.exp_base,
        )

    def backoff(self, clock: Callable[[], float] = time.monotonic) -> Backoff:
        """A fresh :class:`Backoff` over this policy (its deadline starts now)."""
        return Backoff(self, clock)


class Backoff:
    """The waits of one :class:`Policy` for a loop that waits on its own terms.

    ``next()`` gives the wait before the next retry (first, doubling, capped;
    0.0 in stamina's testing mode), ``reset()`` starts over after a success,
    ``expired()`` tells whether the policy's deadline (from the creation or
    the last reset) has passed. Not thread-safe; one loop owns it.

    Args:
        policy: the numbers.
        clock: seconds, monotonic (``time.monotonic``; trio code passes
            ``trio.current_time``).
    """

    def __init__(self, policy: Policy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._clock = clock
        self.retries = 0
        self.started = clock()

    def next(self) -> float:
        """The wait before the next retry, in seconds (counts the retry)."""
        self.retries += 1
        if stamina.is_testing():
            return 0.0
        return self.policy.wait(self.retries)

    def progress(self) -> None:
        """Progress without success: the deadline counts from now again; the waits
        go on growing."""
        self.started = self._clock()

    def reset(self) -> None:
        """After a success: the next wait is ``first`` again and the deadline restarts."""
        self.retries = 0
        self.started = self._clock()

    def left(self) -> float | None:
        """Seconds until the deadline (<= 0: passed), None without one."""
        if self.policy.deadline is None:
            return None
        return self.started + self.policy.deadline - self._clock()

    def expired(self) -> bool:
        """True once the policy's deadline has passed (never without one)."""
        left = self.left()
        return left is not None and left <= 0


# ---------------------------------------------------------------------- the policies


def bounded_waits(first: float, max_wait: float, deadline: float) -> tuple[float, float]:
    """The waits of a bucket call with a short deadline of its own (a bounded backend):
    the first wait at most 0.25 s, the longest at most a quarter of the deadline
    (>= 0.5 s), so a 5 s lookup still tries several times. Returns (first, max_wait),
    seconds."""
    return min(first, 0.25), min(max_wait, max(0.5, deadline / 4))


def short_deadline_waits(first: float, max_wait: float, deadline: float) -> tuple[float, float]:
    """(first, max_wait) for ``$TIERFS_GCS_RETRY_DEADLINE`` = ``deadline``: below 60 s
    :func:`bounded_waits`, else unchanged."""
    if deadline < 60:
        return bounded_waits(first, max_wait, deadline)
    return first, max_wait


#: the waits of a bucket call with the default deadline (seconds)
GCS_FIRST = 1.0
GCS_MAX = 30.0


def gcs_request(
    deadline: float | None = None, first: float | None = None, max_wait: float | None = None
) -> Policy:
    """Each google-cloud-storage call (``GcsBackend``'s ``retry=``).

    Args:
        deadline: seconds (default ``$TIERFS_GCS_RETRY_DEADLINE``); bounded
            backends pass the lookup, fallback, rendezvous or start deadline.
        first, max_wait: the waits (default: 1 s and 30 s through
            :func:`short_deadline_waits`).
    """
    d = settings.GCS_RETRY_DEADLINE.get() if deadline is None else deadline
    f, m = short_deadline_waits(GCS_FIRST, GCS_MAX, d)
    return Policy(
        name="gcs-request",
        retries="one bucket call: HTTP 408, 429, 500, 502, 503, 504, timeouts, "
        "connection errors (the library's predicate)",
        not_retried="404, 403/401, other 4xx, a crc32c mismatch, a cancel",
        first=f if first is None else first,
        max_wait=m if max_wait is None else max_wait,
        deadline=d,
        layer=GCS_RETRY,
        where="backup/bucket.py:GcsBackend (every call)",
        knobs="TIERFS_GCS_RETRY_DEADLINE (below 60 s: first 0.25 s, max deadline/4); "
        "bounded calls: TIERFS_GCS_LOOKUP_DEADLINE, TIERFS_GCS_FALLBACK_DEADLINE, "
        "TIERFS_GCS_RENDEZVOUS_DEADLINE, TIERFS_GCS_START_DEADLINE",
        jitter_note="full: uniform(0, wait) (the library's)",
    )


def gcs_upload() -> Policy:
    """A node's part of a backup round after a bucket outage (``is_transient``)."""
    return Policy(
        name="gcs-upload",
        retries="the whole part (data objects already there are skipped) after a "
        "transient failure: the bucket unreachable, 408/429/5xx after gcs-request gave up",
        not_retried="a definite answer (404, 403, crc32c mismatch), a step written "
        "after its seal, a round that moved or is older than the round timeout",
        first=settings.GCS_UPLOAD_RETRY_FIRST.get(),
        max_wait=settings.GCS_UPLOAD_RETRY_MAX.get(),
        deadline=settings.GCS_ROUND_TIMEOUT.get(),
        layer=BACKOFF,
        where="backup/uploads.py:Uploads._upload",
        knobs="TIERFS_GCS_UPLOAD_RETRY_FIRST, TIERFS_GCS_UPLOAD_RETRY_MAX, "
        "TIERFS_GCS_ROUND_TIMEOUT (the round's age)",
    )


def gcs_bucket_check() -> Policy:
    """The background check of a bucket with a problem (or unanswered at mount)."""
    return Policy(
        name="gcs-bucket-check",
        retries="bucket.exists() while the bucket has a problem, until it answers; "
        "creating the GCS client (credential discovery, ScheduleFollower.tick) after it failed",
        not_retried='nothing ends it; "does not exist" waits the longest pause',
        first=settings.GCS_UPLOAD_RETRY_FIRST.get(),
        max_wait=settings.GCS_UPLOAD_RETRY_MAX.get(),
        deadline=None,
        layer=BACKOFF,
        where="backup/health.py:BucketAccess.watch",
        knobs="TIERFS_GCS_UPLOAD_RETRY_FIRST, TIERFS_GCS_UPLOAD_RETRY_MAX "
        "(each call: TIERFS_GCS_START_DEADLINE)",
    )


def gcs_dedup_wait(wait: float | None = None, poll: float = 0.5) -> Policy:
    """A data-parallel rank polling the listing for its column uploader's objects."""
    return Policy(
        name="gcs-dedup-wait",
        retries="the listing, until every object of the layout is there with its size and crc32c",
        not_retried="a listing error after gcs-request (propagates), a cancel",
        first=poll,
        max_wait=max(poll, 5.0),
        deadline=settings.GCS_DEDUP_WAIT.get() if wait is None else wait,
        layer=BACKOFF,
        where="backup/upload.py:await_objects",
        knobs="TIERFS_GCS_DEDUP_WAIT (counted from the last object that appeared)",
    )


def gcs_rendezvous_wait(timeout: float, poll: float = 1.0) -> Policy:
    """Waiting for a node's rendezvous record in the bucket (fixed poll)."""
    return Policy(
        name="gcs-rendezvous-wait",
        retries="reading the record until one written after newer_than appears; "
        "read failures (outages) too",
        not_retried="a cancel",
        first=poll,
        max_wait=poll,
        deadline=timeout,
        exp_base=1.0,
        layer=STAMINA,
        where="backup/rendezvous.py:wait_for_address",
        knobs="its timeout= and poll= arguments",
    )


#: seconds between two attempts to publish the rendezvous record, first and longest
PUBLISH_FIRST = 1.0
PUBLISH_MAX = 30.0


def rendezvous_publish() -> Policy:
    """Publishing this node's rendezvous record while the bucket fails."""
    return Policy(
        name="rendezvous-publish",
        retries="writing this node's record (each write: TIERFS_GCS_RENDEZVOUS_DEADLINE), "
        "any failure",
        not_retried="nothing; a success ends it until the job or address changes",
        first=PUBLISH_FIRST,
        max_wait=PUBLISH_MAX,
        deadline=None,
        attempts=None,
        jitter=1.0,
        layer=STAMINA,
        where="replication/rendezvous.py:CoordinatorFinder.publisher",
    )


def peer_push() -> Policy:
    """Pushing a sealed step to a peer that is unreachable."""
    return Policy(
        name="peer-push",
        retries="a push answered UNAVAILABLE, DEADLINE_EXCEEDED or CANCELLED",
        not_retried="other gRPC codes (RESOURCE_EXHAUSTED, PERMISSION_DENIED...); "
        "DATA_LOSS is resent once at once; a step superseded or withdrawn",
        first=0.25,
        max_wait=5.0,
        deadline=settings.PEER_PUSH_PATIENCE.get(),
        layer=BACKOFF,
        where="replication/replicator.py:Replicator._replicate",
        knobs=settings.PEER_PUSH_PATIENCE.name,
    )


def restore_join(join_timeout: float) -> Policy:
    """Joining the coordinator's restore round."""
    return Policy(
        name="restore-join",
        retries="finding and joining the coordinator (not found, unreachable, node-rank taken)",
        not_retried="a refusal for good (token, job) after TIERFS_REFUSAL_GRACE, "
        "another node count after --join-timeout: RestoreRefused",
        first=0.2,
        max_wait=2.0,
        deadline=join_timeout,
        layer=BACKOFF,
        where="node/agreement.py:CoordinatorAgreement.join",
        knobs="--join-timeout, TIERFS_REFUSAL_GRACE",
    )


def restore_call(limit: float) -> Policy:
    """A Decide or Barrier call to a coordinator that does not answer."""
    return Policy(
        name="restore-call",
        retries="the restore round's Decide/Barrier call while the coordinator is "
        "unreachable (after a bucket rendezvous check that it did not move)",
        not_retried="a coordinator that moved (the node joins it again)",
        first=0.5,
        max_wait=0.5,
        deadline=limit,
        exp_base=1.0,
        layer=BACKOFF,
        where="node/agreement.py:CoordinatorAgreement._unreachable",
        knobs="--join-timeout",
    )


def csi_mount(max_backoff: float = 60.0) -> Policy:
    """The CSI node driver keeping its tierfs mount up."""
    return Policy(
        name="csi-mount",
        retries="`tierfs mount` of the node mount, any failure, for as long as the driver runs",
        not_retried="nothing; a mount that answers resets it",
        first=min(1.0, max_backoff),
        max_wait=max_backoff,
        deadline=None,
        layer=BACKOFF,
        where="csi/nodemount.py:SupervisedMount._run",
        knobs="SupervisedMount(max_backoff=)",
    )


def operator_apply() -> Policy:
    """The operator's DaemonSet apply (kopf retries the handler)."""
    return Policy(
        name="operator-apply",
        retries="applying a CheckpointConfiguration's DaemonSet: API unreachable or "
        "refusing (kopf TemporaryError)",
        not_retried="an invalid spec (kopf PermanentError: waits for the next change)",
        first=30.0,
        max_wait=30.0,
        deadline=None,
        exp_base=1.0,
        layer=KOPF,
        where="csi/operator.py:apply_configuration",
    )


def all_policies() -> list[Policy]:
    """Every policy with its defaults (the table of docs/RETRIES.md)."""
    return [
        gcs_request(),
        gcs_upload(),
        gcs_bucket_check(),
        gcs_dedup_wait(),
        gcs_rendezvous_wait(timeout=60.0),
        rendezvous_publish(),
        peer_push(),
        restore_join(join_timeout=600.0),
        restore_call(limit=600.0),
        csi_mount(),
        operator_apply(),
    ]


def _seconds(v: float | None) -> str:
    if v is None:
        return "none"
    return f"{v:g} s"


def markdown_table(policies: list[Policy] | None = None) -> str:
    """The policies as a Markdown table (docs/RETRIES.md), one row each."""
    rows = [
        "| policy | retried | not retried | first wait | max wait | deadline | attempts "
        "| jitter | run by | where | knobs |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in all_policies() if policies is None else policies:
        first = _seconds(p.first)
        maxw = "= first (fixed)" if p.exp_base == 1.0 else _seconds(p.max_wait)
        cells = [
            f"`{p.name}`",
            p.retries,
            p.not_retried,
            first,
            maxw,
            _seconds(p.deadline),
            "no limit" if p.attempts is None else str(p.attempts),
            p.jitter_note or (f"+ up to {_seconds(p.jitter)}" if p.jitter else "none"),
            p.layer,
            f"`{p.where}`",
            p.knobs or "-",
        ]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def _log_retry(details: stamina.instrumentation.RetryDetails) -> None:
    """stamina's retry hook: one INFO line per scheduled retry (the loops report
    failures to status and ``replicator.errors`` themselves)."""
    log.info(
        "retry %d in %.1f s after %r",
        details.retry_num,
        details.wait_for,
        details.caused_by,
    )


# tierfs's own line instead of stamina's defaults (a WARNING "stamina.retry_scheduled"
# per retry and a counter in prometheus-client's default registry, which tierfs's
# /metrics does not export)
stamina.instrumentation.set_on_retry_hooks([_log_retry])


if __name__ == "__main__":  # pragma: no cover
    print(markdown_table(), end="")
