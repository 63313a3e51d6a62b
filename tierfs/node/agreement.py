"""The coordinator's restore round as one node takes part in it (the Agreement port).

PROTOCOL.md section 4, the client side: :class:`CoordinatorAgreement` finds
the coordinator (static address or bucket rendezvous), joins its round,
long-polls the decision and the two barriers ("ready" before the
prerestore file, "done" before the markers), and follows a coordinator that
restarted elsewhere. It talks through the node's
:class:`tierfs.replication.peer.PeerTier` (client, address book, rendezvous),
on the trio thread; every gRPC call runs in a worker thread. What to do with
the decision is :class:`tierfs.node.restorer.Restorer`'s job. In a job of
more than ``--heartbeat-group`` nodes the Decide and Barrier calls go
through the node's group leader when it knows one (the peers its Join reply
and heartbeats described), with the heartbeat's fallback to direct calls
(ARCHITECTURE.md "Batched restore round"); the Join itself goes directly.

A round that cannot finish raises :class:`RestoreFailed` with its
``outcome`` (``missing``: a node never joined; ``timeout``: a barrier or the
coordinator did not answer in time; ``refused``: the coordinator refuses
this node), in every mode: a failure never passes for "nothing to restore".
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import grpc
import trio

from tierfs.core import retry, settings
from tierfs.core.errors import RestoreError
from tierfs.core.ports import Decision, Reporter, RestoreProgress
from tierfs.core.types import CopyId
from tierfs.replication.client import barrier_request, decide_request, rpc_code, rpc_reason
from tierfs.rpc import peer_pb2

if TYPE_CHECKING:
    from tierfs.core.control import JobSpec
    from tierfs.replication.peer import PeerTier
    from tierfs.store.shards import ShardKey

log = logging.getLogger(__name__)

#: the "done" barrier waits at most this long (seconds): every node has its data by then
DONE_TIMEOUT = 60.0


class RestoreFailed(RestoreError):
    """A restore that cannot finish; ``outcome`` says how (``tierfs wait``'s exit code)."""

    outcome = "failed"


class RestoreTimeout(RestoreFailed):
    """The cluster did not reach the next restore phase within ``--join-timeout``."""

    outcome = "timeout"


class NodesMissing(RestoreTimeout):
    """Node ranks did not join the restore round within ``--join-timeout``."""

    outcome = "missing"


class RestoreRefused(RestoreFailed):
    """The coordinator refuses this node (token, job name, node count, rank)."""

    outcome = "refused"


def _refused_for_good(exc: grpc.RpcError) -> bool:
    """A join refusal that retrying cannot cure: a wrong token or a configuration that
    disagrees with the coordinator's. Not "node-rank N is taken" (the previous
    incarnation's heartbeat runs out within seconds). A rank declared gone for good
    (``tierfs nodes gone``, issue #16) is refused until the job's next generation."""
    code = rpc_code(exc)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return True
    detail = rpc_reason(exc)
    return code == grpc.StatusCode.FAILED_PRECONDITION and (
        "mismatch" in detail or "out of range" in detail or "declared gone for good" in detail
    )


def _grace(detail: str, join_timeout: float) -> float:
    """Seconds a refusal for good may last before the restore fails: a node count
    that differs from the coordinator's is a resize in progress (issue #16: the
    coordinator's node, node-rank 0, restarted with the new count starts the new
    generation), given up to the join timeout; else ``$TIERFS_REFUSAL_GRACE``."""
    if "node count mismatch" in detail:
        return max(join_timeout, settings.REFUSAL_GRACE.get())
    return settings.REFUSAL_GRACE.get()


def decision_of(view: Any) -> Decision:
    """A ``DecideReply`` (state DECIDED) as plain data."""
    rounds = tuple(view.backups) or ((view.backup,) if view.backup else ())
    return Decision(
        round=int(view.round),
        version=int(view.version),
        step=None if view.step < 0 else int(view.step),
        reason=view.reason,
        outcome=view.outcome or None,
        problems=tuple(view.problems),
        forced=view.restore_version or None,
        digest=view.digest,
        local=bool(view.local),
        peers=tuple((int(s.holder), s.address) for s in view.sources),
        rounds=rounds,
        writers=int(view.writers),
    )


class CoordinatorAgreement:
    """:class:`tierfs.core.ports.Agreement` through the node's peer tier.

    Args:
        tier: the node's peer tier (client, coordinator address, rendezvous,
            ``join_timeout`` in seconds, retention pins).
        progress: where the phases go (the restore state).
        reporter: ``replicator.errors``.
    """

    def __init__(self, tier: PeerTier, progress: RestoreProgress, reporter: Reporter) -> None:
        self.tier = tier
        self.progress = progress
        self.reporter = reporter

    def _phase(self, text: str, **extra: Any) -> None:
        log.debug("restore phase: %s %s", text, extra)
        self.progress.progress({"phase": text, **extra})

    def pin(self, key: ShardKey, delta: int) -> None:
        """Hold or release ``key`` against retention (the peer tier's pins; trio thread)."""
        self.tier._pin(key, delta)

    async def join(self, job: JobSpec, restore_id: str, strict: bool, notes: Sequence[str]) -> int:
        """Find the coordinator and join its restore round; returns the round number.

        Raises:
            RestoreRefused: the coordinator refused this node for good for
                ``$TIERFS_REFUSAL_GRACE`` seconds (or until the join timeout).
            RestoreTimeout: not joined within ``--join-timeout`` seconds.
        """
        tier = self.tier
        start = trio.current_time()
        backoff = retry.restore_join(tier.join_timeout).backoff(trio.current_time)
        last = ""
        refused_since: float | None = None
        while True:
            coord = await tier.find_coordinator(job)
            if coord is None:
                last = f"the coordinator was not found ({tier.rendezvous_note})"
                self._phase(f"looking for the coordinator: {tier.rendezvous_note}")
                refused_since = None
            else:
                fields = tier.join_fields(job)
                try:
                    reply = await tier.call(
                        functools.partial(
                            tier.client.join,
                            coord,
                            restore_id=restore_id,
                            mode="protocol" if strict else "generic",
                            notes=list(notes),
                            **fields,
                        )
                    )
                    tier.update_peers(reply.peers, reply)
                    self._phase("joined", round=reply.round, coordinator=coord)
                    return int(reply.round)
                except grpc.RpcError as exc:
                    last = rpc_reason(exc)
                    if rpc_code(exc) == grpc.StatusCode.UNAUTHENTICATED:
                        last = "the coordinator refused the peer token"
                    last = f"at {coord}: {last}"
                    tier.coordinator_lost()
                    self._phase(f"joining the coordinator {last}")
                    if _refused_for_good(exc):
                        now = trio.current_time()
                        if refused_since is None:
                            refused_since = now
                            self.reporter.error(
                                f"restore: the coordinator refuses this node {last}"
                            )
                        elif now - refused_since > (grace := _grace(last, tier.join_timeout)):
                            # a configuration error: the job fails now, not after the
                            # join timeout (minutes), unless it is fixed meanwhile
                            raise RestoreRefused(
                                f"the coordinator refused this node for {grace:.0f} s {last}"
                            ) from None
                    else:
                        refused_since = None
            if trio.current_time() - start > tier.join_timeout:
                self.reporter.error(
                    f"restore: could not join the coordinator within "
                    f"{tier.join_timeout:.0f} s: {last}"
                )
                if refused_since is not None or "is taken" in last:
                    # another live node serves this node-rank the whole time: a
                    # configuration error (two nodes with one rank), not a slow
                    # coordinator (regression: exit 6 "timed out", README says 5)
                    raise RestoreRefused(last)
                raise RestoreTimeout(
                    f"could not join the coordinator within {tier.join_timeout:.0f} s: {last}"
                )
            await trio.sleep(backoff.next())

    async def _unreachable(
        self, job: JobSpec, coord: str, exc: grpc.RpcError, start: float, limit: float
    ) -> bool:
        """After a failed Decide/Barrier call to ``coord``: True if the coordinator
        moved (the caller joins it again); else wait 0.5 s for the next try.

        Raises:
            RestoreTimeout: ``coord`` has been unreachable for ``limit`` seconds
                since ``start`` (``trio.current_time()``); one line in
                ``replicator.errors``.
        """
        self._phase(f"coordinator unreachable: {rpc_reason(exc)}")
        if await self._moved(job, coord):
            return True
        if trio.current_time() - start > limit:
            self.reporter.error(f"restore: coordinator {coord} unreachable for {limit:.0f} s")
            raise RestoreTimeout(
                f"coordinator {coord} unreachable for {limit:.0f} s: {rpc_reason(exc)}"
            ) from None
        await trio.sleep(retry.restore_call(limit).wait(1))
        return False

    async def _moved(self, job: JobSpec, address: str) -> bool:
        """After a failed call to ``address``: did the coordinator move (bucket rendezvous)?"""
        tier = self.tier
        tier.coordinator_lost()
        found = await tier.find_coordinator(job)
        return found is not None and found != address

    async def decide(self, job: JobSpec, restore_id: str, round: int) -> Decision | None:
        """The round's decision (long poll); None: join again.

        Raises:
            NodesMissing: node ranks did not join within ``--join-timeout``.
            RestoreTimeout: no decision within ``--join-timeout`` (or the
                coordinator unreachable that long).
        """
        tier = self.tier
        start = trio.current_time()
        pb = peer_pb2.DecideReply
        first = True
        while True:
            coord = tier.coordinator_address or ""
            try:
                # the first call answers at once (the status says what the node waits
                # for), then long polls, never past the join timeout (checked between)
                wait = 0.0 if first else tier.join_timeout - (trio.current_time() - start)
                first = False
                request = decide_request(job.name, job.node_rank, restore_id, max(wait, 0.0))
                view = await tier.call(
                    tier.heartbeat.route.decide, coord, request, tier.heartbeat.leader(job)
                )
            except grpc.RpcError as exc:
                if await self._unreachable(job, coord, exc, start, tier.join_timeout):
                    return None  # the coordinator restarted elsewhere: join it
                continue
            if view.state == pb.REJOIN:
                return None
            if view.state == pb.DECIDED:
                decision = decision_of(view)
                self._phase(
                    "decided",
                    round=view.round,
                    step=decision.step,
                    reason=view.reason,
                    missing=[],
                )
                return decision
            missing = list(view.missing)
            more = view.missing_count - len(missing)
            shown = f"{missing} and {more} more" if more > 0 else f"{missing}"
            what = (
                f"node-rank(s) {shown} to join"
                + (f" ({view.waiting_for})" if view.waiting_for else "")
                if missing
                else view.waiting_for or "the coordinator"
            )
            self._phase(f"waiting for {what}", round=view.round, missing=missing)
            if trio.current_time() - start > tier.join_timeout:
                if missing:
                    msg = (
                        f"node-rank(s) {shown} did not join within "
                        f"{tier.join_timeout:.0f} s (job {job.name}, round {view.round}"
                        + (f"; {view.waiting_for}" if view.waiting_for else "")
                        + "); "
                        "no step can be agreed (a node gone for good: restart the job "
                        f"with --nodes {max(job.nodes - view.missing_count, 1)} on the "
                        "others, README 'Restarting on fewer or more nodes')"
                    )
                    self.reporter.error(f"restore: {msg}")
                    raise NodesMissing(msg)
                msg = f"no decision within {tier.join_timeout:.0f} s (waiting for {what})"
                self.reporter.error(f"restore: {msg}")
                raise RestoreTimeout(msg)

    async def ready(
        self,
        job: JobSpec,
        restore_id: str,
        round: int,
        version: int,
        ok: bool,
        bad: Sequence[CopyId],
        detail: str = "",
    ) -> str:
        """Barrier "ready" within ``--join-timeout`` (see the port)."""
        return await self._barrier(job, restore_id, round, version, "ready", ok, bad, detail=detail)

    async def done(self, job: JobSpec, restore_id: str, round: int, version: int) -> str:
        """Barrier "done" within ``min(--join-timeout, 60 s)`` (see the port)."""
        limit = min(self.tier.join_timeout, DONE_TIMEOUT)
        return await self._barrier(job, restore_id, round, version, "done", True, [], timeout=limit)

    async def _barrier(
        self,
        job: JobSpec,
        restore_id: str,
        round: int,
        version: int,
        phase: str,
        ok: bool,
        bad: Sequence[CopyId],
        timeout: float | None = None,
        detail: str = "",
    ) -> str:
        tier = self.tier
        pb = peer_pb2.BarrierReply
        start = trio.current_time()
        limit = tier.join_timeout if timeout is None else timeout
        first = True
        while True:
            coord = tier.coordinator_address or ""
            # as in decide: the first call answers at once, then long polls
            wait = 0.0 if first else max(limit - (trio.current_time() - start), 0.0)
            first = False
            try:
                request = barrier_request(
                    list(bad),
                    wait,
                    job=job.name,
                    rank=job.node_rank,
                    restore_id=restore_id,
                    round=round,
                    version=version,
                    phase=phase,
                    ok=ok,
                    detail=detail[:2000],
                )
                reply = await tier.call(
                    tier.heartbeat.route.barrier, coord, request, tier.heartbeat.leader(job)
                )
            except grpc.RpcError as exc:
                if await self._unreachable(job, coord, exc, start, limit):
                    return "rejoin"  # the coordinator restarted elsewhere
                continue
            if reply.state == pb.PASSED:
                return "passed"
            if reply.state == pb.REPLAN:
                return "replan"
            if reply.state == pb.REJOIN:
                return "rejoin"
            waiting = list(reply.waiting_for)
            more = reply.waiting_count - len(waiting)
            shown = f"{waiting} and {more} more" if more > 0 else f"{waiting}"
            self._phase(f"barrier {phase}: waiting for node-rank(s) {shown}", waiting_for=waiting)
            if not ok:
                return "replan"
            if trio.current_time() - start > limit:
                self.reporter.error(
                    f"restore: node-rank(s) {shown} did not reach the "
                    f"'{phase}' barrier within {limit:.0f} s"
                )
                raise RestoreTimeout(f"node-rank(s) {shown} did not reach '{phase}'")
