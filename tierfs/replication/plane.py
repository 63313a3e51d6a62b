"""What this node knows of its peer plane (:class:`tierfs.core.ports.PeerPlane`).

Built by the composition root before the tiers: the peer tier writes into it
(the last sync round, the steps it reported, whether its server runs), the
backup tier and the coordinator service read it. It also holds the rule
saying which node serves the coordinator (:meth:`PlaneState.coordinator_gate`):

* static rendezvous: the node whose ``--listen``/``--advertise`` is the
  ``--coordinator`` address, whatever its job;
* bucket rendezvous (``--bucket``, ``--listen``, no ``--coordinator``):
  node-rank 0 of a multi-node job (known once the job started).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tierfs.core.control import JobSpec
from tierfs.core.ports import CurrentJob
from tierfs.core.types import COORDINATOR_RANK
from tierfs.rpc import wire as peer_wire


class PlaneState:
    """The peer plane's facts and last known state.

    Args:
        job: the current job.
        coordinator: ``--coordinator HOST:PORT`` (static rendezvous), or None.
        listen: ``--listen`` (this node serves gRPC), or None.
        advertise: ``--advertise``, or None.
        bucket_rendezvous: without ``--coordinator``, the nodes find the
            coordinator through the bucket (``--bucket`` and ``--listen``).

    Attributes:
        sync: the last sync round: ``step`` (int or None), ``at`` (Unix time or
            None), ``steps`` (the synced steps).
        reported: own steps reported replicated in the ``Sync`` in flight and in
            the last one answered.
        server_up: the peer tier's gRPC server runs.
    """

    def __init__(
        self,
        job: CurrentJob,
        *,
        coordinator: str | None,
        listen: str | None,
        advertise: str | None = None,
        bucket_rendezvous: bool = False,
    ) -> None:
        self.current = job
        self.static_coordinator = coordinator
        self.listen = listen
        self.bucket_rendezvous = bucket_rendezvous and not coordinator
        self.static_is_me = bool(coordinator) and (
            peer_wire.same_endpoint(coordinator, listen)
            or peer_wire.same_endpoint(coordinator, advertise)
        )
        self.sync: dict[str, Any] = {"step": None, "at": None, "steps": []}
        self.reported: tuple[int, ...] = ()
        self.server_up = False
        self._heartbeat: list[Callable[[], None]] = []

    def has_plane(self) -> bool:
        """A coordinator can be found: ``--coordinator``, or ``--listen`` with the bucket
        rendezvous."""
        return bool(self.static_coordinator) or (self.bucket_rendezvous and bool(self.listen))

    def active_job(self) -> JobSpec | None:
        """The running job if it spans several nodes and a coordinator can be found."""
        job = self.current.job
        if job is None or job.nodes <= 1 or not self.has_plane():
            return None
        return job

    def coordinator_gate(self) -> str | None:
        """None while this node is the coordinator, else one line why not (any thread)."""
        if self.static_coordinator:
            return None if self.static_is_me else f"the coordinator is at {self.static_coordinator}"
        if not self.bucket_rendezvous:
            return "no --coordinator and no bucket rendezvous on this node"
        job = self.current.job  # one read of a frozen JobSpec: safe from any thread
        if job is None or job.nodes <= 1:
            return "no multi-node job runs on this node"
        if job.node_rank != COORDINATOR_RANK:
            return f"this node is node-rank {job.node_rank} of job {job.name}"
        return None

    @property
    def serving(self) -> bool:
        """This node serves the coordinator of its job right now (any thread)."""
        return self.server_up and self.coordinator_gate() is None

    def synced_step(self) -> int | None:
        """The newest step every node sealed and replicated, from the last sync round."""
        step = self.sync.get("step")
        return int(step) if step is not None and step >= 0 else None

    def reported_steps(self) -> tuple[int, ...]:
        """Own steps the coordinator may order a backup round of (see :attr:`reported`)."""
        return self.reported

    def heartbeat_now(self) -> None:
        """Ask the peer tier to send a heartbeat now (its registered hook)."""
        for hook in self._heartbeat:
            hook()

    def on_heartbeat_wanted(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` on :meth:`heartbeat_now` (the peer tier; must not block)."""
        self._heartbeat.append(hook)
