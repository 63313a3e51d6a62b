"""The bucket rendezvous: where the nodes of a job publish their peer addresses.

Records live at ``gs://<bucket>/[<prefix>/]<job>/.tierfs/nodes/<rank>``
(:func:`tierfs.backup.layout.rendezvous_record`: address, rank, incarnation,
time written), for :class:`tierfs.replication.peer.PeerTier` when there is no
``--coordinator`` (DESIGN.md "Peer plane"):

* :class:`BucketRendezvous`: the :class:`tierfs.core.ports.Rendezvous` port,
  its I/O in the GCS tier's worker threads;
* :func:`wait_for_address`: poll one rank's record until a current one appears
  (the CLI's and the tests' blocking wait).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from tierfs.backup import layout as L
from tierfs.backup.client import describe_error
from tierfs.backup.errors import Cancelled, NotYet
from tierfs.core import retry, settings

if TYPE_CHECKING:
    from tierfs.backup.tier import GcsTier

log = logging.getLogger(__name__)


def wait_for_address(
    read: Callable[[str, int], L.RendezvousRecord | None],
    where: str,
    job: str,
    rank: int = 0,
    *,
    timeout: float,
    newer_than: float = 0.0,
    poll: float = 1.0,
    cancel: threading.Event | None = None,
) -> L.RendezvousRecord:
    """Poll ``read(job, rank)`` until rank ``rank`` has published an address written
    after ``newer_than``.

    Args:
        timeout: seconds to wait in total.
        newer_than: Unix time; older records (a previous run) are ignored.
        poll: seconds between reads.
        where: the records' place, for the timeout's message.

    Retried by the ``gcs-rendezvous-wait`` policy (:mod:`tierfs.core.retry`):
    every ``poll`` seconds through outages (each read retried by
    ``gcs-request`` first) until ``timeout``.

    Raises:
        TimeoutError: nothing new appeared in time. Cancelled: ``cancel`` was set.
    """

    def again(exc: Exception) -> bool:
        if isinstance(exc, Cancelled):
            return False
        if not isinstance(exc, NotYet):  # keep polling through outages
            log.info("rendezvous read failed: %s", describe_error(exc))
        return True

    try:
        for attempt in retry.gcs_rendezvous_wait(timeout, poll).retry_context(on=again):
            with attempt:
                if cancel is not None and cancel.is_set():
                    raise Cancelled("rendezvous cancelled")
                rec = read(job, rank)
                if rec is None or rec.written < newer_than:
                    raise NotYet(f"no record of rank {rank} written after {newer_than}")
                return rec
    except Cancelled:
        raise
    except Exception:  # the last attempt's: not there yet, or the bucket failed
        pass
    raise TimeoutError(f"no address of rank {rank} under {where} after {timeout:.0f}s")


class BucketRendezvous:
    """The bucket rendezvous of :class:`tierfs.replication.peer.PeerTier` (DESIGN.md "Peer plane").

    Records live at ``gs://<bucket>/[<prefix>/]<job>/.tierfs/nodes/<rank>``
    (:func:`tierfs.backup.layout.rendezvous_record`: address, rank,
    incarnation, time written). Both calls run in the tier's worker threads
    and give up after ``deadline`` seconds of retries; the peer tier polls
    again and decides whether a record is current (it probes the address).

    Args:
        tier: the node's GCS tier (backend, limiter).
        deadline: seconds one read or write keeps retrying.
    """

    def __init__(self, tier: GcsTier, deadline: float | None = None) -> None:
        self.tier = tier
        self.deadline = settings.GCS_RENDEZVOUS_DEADLINE.get() if deadline is None else deadline

    def where(self, job: str, rank: int) -> str:
        """``gs://`` name of node ``rank``'s record (for messages)."""
        spec = self.tier.spec
        assert spec is not None
        return f"gs://{spec.bucket}/{spec.rendezvous(job, rank)}"

    async def publish(self, job: str, rank: int, address: str, incarnation: str) -> None:
        """Write this node's record.

        Raises:
            RuntimeError: one line (bucket unreachable, access denied...).
        """

        def work() -> None:
            self.tier.access.bounded(self.deadline).publish_address(
                job, rank, address, incarnation=incarnation
            )

        try:
            await self.tier.access.call(work)
        except Exception as exc:
            raise RuntimeError(describe_error(exc)) from None

    async def lookup(self, job: str, rank: int) -> tuple[str, str] | None:
        """Node ``rank``'s record as (address, incarnation), None if absent or malformed.

        Raises:
            RuntimeError: one line (bucket unreachable...).
        """
        try:
            rec = await self.tier.access.call(
                lambda: self.tier.access.bounded(self.deadline).read_address(job, rank)
            )
        except Exception as exc:
            raise RuntimeError(describe_error(exc)) from None
        return (rec.address, rec.incarnation) if rec is not None else None
