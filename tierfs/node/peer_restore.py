"""Restoring a multi-node job through its peers: the restore rounds of one node.

PROTOCOL.md section 4. :class:`PeerCluster` is the agent's
:class:`tierfs.node.agent.Cluster` when the node has a peer plane: verify what
this node holds, join the coordinator's round, get the decision, bring the
own shard of the chosen step -- the local copy, else a pull from the peers
holding the same bytes, else a download from the backup rounds holding them
(every crc32c verified; a bad copy is skipped for the next one) -- and, if
every copy failed, report the bad ones so the coordinator chooses again for
every node; then the two barrier phases ("ready" before the prerestore
file, "done" before the markers). It works through the node's
:class:`tierfs.replication.peer.PeerTier` (client, address book, transfers), on
the trio thread; every call runs in a worker thread.

A restore that cannot finish raises :class:`RestoreFailed` with its
``outcome`` (``missing``: a node never joined; ``timeout``: a barrier or the
coordinator did not answer in time; ``refused``: the coordinator refuses
this node), in every mode: a failure never passes for "nothing to restore".
"""

from __future__ import annotations

import functools
import logging
import threading
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import trio

from tierfs.core import control, retry, settings
from tierfs.core.errors import RestoreError
from tierfs.core.ports import BackupFetch
from tierfs.core.types import CopyId, RestorePlan
from tierfs.node.agent import LocalCluster
from tierfs.replication.client import rpc_code, rpc_reason
from tierfs.replication.transfer import BadCopy, Refused, TransferError
from tierfs.rpc import peer_pb2
from tierfs.store.shards import ShardKey

if TYPE_CHECKING:
    from tierfs.core.control import JobSpec
    from tierfs.node.agent import NodeAgent
    from tierfs.replication.peer import PeerTier

log = logging.getLogger(__name__)


def _refused_for_good(exc: grpc.RpcError) -> bool:
    """A join refusal that retrying cannot cure: a wrong token or a configuration that
    disagrees with the coordinator's. Not "node-rank N is taken" (the previous
    incarnation's heartbeat runs out within seconds)."""
    code = rpc_code(exc)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return True
    detail = rpc_reason(exc)
    return code == grpc.StatusCode.FAILED_PRECONDITION and (
        "mismatch" in detail or "out of range" in detail
    )


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


@dataclass
class _Round:
    restore_id: str
    round: int
    version: int


class PeerCluster:
    """The restore rounds of a multi-node job (:class:`tierfs.node.agent.Cluster`).

    Args:
        tier: the node's peer tier (client, address book, transfers).
        backup: the backup plane's download (:meth:`BackupFetch.fetch_backup`, raises
            with the reason), used for the backup rounds of a plan; None without
            a bucket.
    """

    def __init__(self, tier: PeerTier, backup: BackupFetch | None = None) -> None:
        self.tier = tier
        self.backup = backup
        self._current: _Round | None = None

    def _phase(self, agent: NodeAgent, text: str, **extra: Any) -> None:
        agent.restore_state.update({"phase": text, **extra})

    async def plan_restore(self, agent: NodeAgent, job: JobSpec) -> RestorePlan:
        """Join the cluster's restore round and bring this node's shard of the chosen step.

        Returns once every node has its data for the decided step (barrier
        phase "ready"). Protocol contract: PROTOCOL.md section 4.

        Raises:
            RestoreFailed: nodes did not join or finish in ``--join-timeout``
                seconds, or the coordinator refuses this node; the reason is in
                replicator.errors.
        """
        self._current = None
        if job.nodes <= 1 or not self.tier.has_plane():
            return await LocalCluster().plan_restore(agent, job)
        return await self._plan(agent, job)

    async def _plan(self, agent: NodeAgent, job: JobSpec) -> RestorePlan:
        tier = self.tier
        strict = job.framework != control.GENERIC
        restore_id = uuid.uuid4().hex
        self._phase(agent, "verifying local copies")
        notes = []
        for shard in sorted(agent.shards_of(job.name), key=lambda s: s.key, reverse=True):
            if shard.key in agent.catalog and not await agent.verify_shard(shard):
                notes.append(
                    f"node-rank {job.node_rank} discarded its copy of step "
                    f"{shard.key.step} of rank {shard.key.rank} (checksum mismatch)"
                )
        while True:
            number = await self._join(agent, job, restore_id, strict, notes)
            while True:
                view = await self._decide(agent, job, restore_id, number)
                if view is None:
                    break  # rejoin
                plan, bad, detail = await self._fetch(agent, job, view)
                # pinned from now on: retention must not drop the fetched step while
                # the abandoned newer ones (which it ranks above it) are still held
                held = plan.shard.key if plan is not None and plan.shard is not None else None
                if held is not None:
                    tier._pin(held, +1)
                try:
                    self._phase(
                        agent,
                        "waiting for the other nodes' data",
                        round=number,
                        step=plan.step if plan else None,
                    )
                    state = await self._barrier(
                        agent,
                        job,
                        restore_id,
                        number,
                        view.version,
                        "ready",
                        plan is not None,
                        bad,
                        detail=detail,
                    )
                except BaseException:
                    if held is not None:
                        tier._pin(held, -1)
                    raise
                if state == "passed" and plan is not None:
                    self._current = _Round(restore_id, number, view.version)
                    if held is not None:
                        plan.detail["pinned"] = True
                    plan.detail.update(
                        round=number,
                        reason=view.reason,
                        forced=view.restore_version or None,
                        outcome=view.outcome or None,
                        problems=list(view.problems),
                    )
                    return plan
                if held is not None:
                    tier._pin(held, -1)
                if state == "rejoin":
                    break
                # replan (a copy was bad somewhere): ask again

    async def _join(
        self, agent: NodeAgent, job: JobSpec, restore_id: str, strict: bool, notes: list[str]
    ) -> int:
        tier = self.tier
        start = trio.current_time()
        backoff = retry.restore_join(tier.join_timeout).backoff(trio.current_time)
        last = ""
        refused_since: float | None = None
        while True:
            coord = await tier.find_coordinator(job)
            if coord is None:
                last = f"the coordinator was not found ({tier.rendezvous_note})"
                self._phase(agent, f"looking for the coordinator: {tier.rendezvous_note}")
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
                            notes=notes,
                            **fields,
                        )
                    )
                    tier.update_peers(reply.peers, reply)
                    self._phase(agent, "joined", round=reply.round, coordinator=coord)
                    return int(reply.round)
                except grpc.RpcError as exc:
                    last = rpc_reason(exc)
                    if rpc_code(exc) == grpc.StatusCode.UNAUTHENTICATED:
                        last = "the coordinator refused the peer token"
                    last = f"at {coord}: {last}"
                    tier.coordinator_lost()
                    self._phase(agent, f"joining the coordinator {last}")
                    if _refused_for_good(exc):
                        now = trio.current_time()
                        if refused_since is None:
                            refused_since = now
                            agent.report_error(f"restore: the coordinator refuses this node {last}")
                        elif now - refused_since > (grace := settings.REFUSAL_GRACE.get()):
                            # a configuration error: the job fails now, not after the
                            # join timeout (minutes), unless it is fixed meanwhile
                            raise RestoreRefused(
                                f"the coordinator refused this node for {grace:.0f} s {last}"
                            ) from None
                    else:
                        refused_since = None
            if trio.current_time() - start > tier.join_timeout:
                agent.report_error(
                    f"restore: could not join the coordinator within "
                    f"{tier.join_timeout:.0f} s: {last}"
                )
                if refused_since is not None:
                    raise RestoreRefused(last)
                raise RestoreTimeout(
                    f"could not join the coordinator within {tier.join_timeout:.0f} s: {last}"
                )
            await trio.sleep(backoff.next())

    async def _unreachable(
        self,
        agent: NodeAgent,
        job: JobSpec,
        coord: str,
        exc: grpc.RpcError,
        start: float,
        limit: float,
    ) -> bool:
        """After a failed Decide/Barrier call to ``coord``: True if the coordinator
        moved (the caller joins it again); else wait 0.5 s for the next try.

        Raises:
            RestoreTimeout: ``coord`` has been unreachable for ``limit`` seconds
                since ``start`` (``trio.current_time()``); one line in
                ``replicator.errors``.
        """
        self._phase(agent, f"coordinator unreachable: {rpc_reason(exc)}")
        if await self._moved(job, coord):
            return True
        if trio.current_time() - start > limit:
            agent.report_error(f"restore: coordinator {coord} unreachable for {limit:.0f} s")
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

    async def _decide(self, agent: NodeAgent, job: JobSpec, restore_id: str, number: int) -> Any:
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
                view = await tier.call(
                    tier.client.decide, coord, job.name, job.node_rank, restore_id, max(wait, 0.0)
                )
            except grpc.RpcError as exc:
                if await self._unreachable(agent, job, coord, exc, start, tier.join_timeout):
                    return None  # the coordinator restarted elsewhere: join it
                continue
            if view.state == pb.REJOIN:
                return None
            if view.state == pb.DECIDED:
                step = None if view.step < 0 else int(view.step)
                self._phase(
                    agent, "decided", round=view.round, step=step, reason=view.reason, missing=[]
                )
                return view
            missing = list(view.missing)
            more = view.missing_count - len(missing)
            shown = f"{missing} and {more} more" if more > 0 else f"{missing}"
            what = (
                f"node-rank(s) {shown} to join"
                if missing
                else view.waiting_for or "the coordinator"
            )
            self._phase(agent, f"waiting for {what}", round=view.round, missing=missing)
            if trio.current_time() - start > tier.join_timeout:
                if missing:
                    msg = (
                        f"node-rank(s) {shown} did not join within "
                        f"{tier.join_timeout:.0f} s (job {job.name}, round {view.round}); "
                        "no step can be agreed"
                    )
                    agent.report_error(f"restore: {msg}")
                    raise NodesMissing(msg)
                msg = f"no decision within {tier.join_timeout:.0f} s (waiting for {what})"
                agent.report_error(f"restore: {msg}")
                raise RestoreTimeout(msg)

    async def _fetch(
        self, agent: NodeAgent, job: JobSpec, view: Any
    ) -> tuple[RestorePlan | None, list[CopyId], str]:
        """This node's shard of the decided step: its own copy, else the peers holding the
        same bytes, else the backup rounds holding them.

        Returns:
            (plan, [], "") on success (a "nothing" decision included); else
            (None, the copies found bad or unusable, one line why).
        """
        tier = self.tier
        if view.step < 0:
            return (
                RestorePlan(
                    None,
                    source="none",
                    detail={
                        "reason": view.reason,
                        "outcome": view.outcome or None,
                        "problems": list(view.problems),
                        "forced": view.restore_version or None,
                    },
                ),
                [],
                "",
            )
        step = int(view.step)
        key = ShardKey(job.name, job.node_rank, step)
        bad: list[CopyId] = []
        why: list[str] = []
        forced = view.restore_version or None
        if view.local:
            shard = agent.catalog.get(key)
            if shard is not None and (not view.digest or tier.digest(shard) == view.digest):
                return RestorePlan(step, shard=shard, source="local", backup=forced), [], ""
            bad.append((job.node_rank, job.node_rank, step))
            why.append("its own copy is gone or holds other bytes")
        for src in view.sources:
            self._phase(
                agent,
                f"pulling step {step} from node-rank {src.holder}",
                source=f"peer:{src.holder}",
            )
            cancel = threading.Event()
            try:
                shard = await tier.pull(src.address, key, view.digest, cancel)
            except (BadCopy, Refused) as exc:
                tier.stats.add("corrupt_copies")
                agent.report_error(
                    f"restore: the copy of step {step} of rank {job.node_rank} "
                    f"on node-rank {src.holder} is bad ({exc}); trying another "
                    "copy"
                )
                bad.append((src.holder, job.node_rank, step))
                why.append(f"node-rank {src.holder}'s copy is bad ({exc})")
                continue
            except (TransferError, grpc.RpcError, OSError) as exc:
                log.warning(
                    "pulling %s from node-rank %d failed: %s", key, src.holder, rpc_reason(exc)
                )
                bad.append((src.holder, job.node_rank, step))
                why.append(f"pulling from node-rank {src.holder} failed ({rpc_reason(exc)})")
                continue
            finally:
                cancel.set()
            agent.add_shard(shard)
            log.info(
                "restored step %d of rank %d from node-rank %d (%d bytes, verified)",
                step,
                job.node_rank,
                src.holder,
                shard.bytes,
            )
            return (
                RestorePlan(step, shard=shard, source=f"peer:{src.holder}", backup=forced),
                [],
                "",
            )
        rounds = list(view.backups) or ([view.backup] if view.backup else [])
        for rnd in rounds:
            if self.backup is None:
                why.append(f"backup round {rnd} holds it but this node has no --bucket")
                break
            try:
                shard = await self.backup.fetch_backup(agent, job, step, rnd, view.digest)
            except Exception as exc:
                agent.report_error(f"restore: {exc}; trying another copy")
                bad.append((rnd, job.node_rank, step))
                why.append(str(exc))
                continue
            return RestorePlan(step, backup=rnd, shard=shard, source="gcs"), [], ""
        detail = f"no usable copy of step {step} of rank {job.node_rank}: " + "; ".join(
            why or ["no copy was offered"]
        )
        agent.report_error(f"restore: {detail}; asking the coordinator to decide again")
        return None, bad, detail

    async def _barrier(
        self,
        agent: NodeAgent,
        job: JobSpec,
        restore_id: str,
        number: int,
        version: int,
        phase: str,
        ok: bool,
        bad: list[CopyId],
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
            # as in _decide: the first call answers at once, then long polls
            wait = 0.0 if first else max(limit - (trio.current_time() - start), 0.0)
            first = False
            try:
                reply = await tier.call(
                    functools.partial(
                        tier.client.barrier,
                        coord,
                        bad,
                        wait,
                        job=job.name,
                        rank=job.node_rank,
                        restore_id=restore_id,
                        round=number,
                        version=version,
                        phase=phase,
                        ok=ok,
                        detail=detail[:2000],
                    )
                )
            except grpc.RpcError as exc:
                if await self._unreachable(agent, job, coord, exc, start, limit):
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
            self._phase(
                agent, f"barrier {phase}: waiting for node-rank(s) {shown}", waiting_for=waiting
            )
            if not ok:
                return "replan"
            if trio.current_time() - start > limit:
                agent.report_error(
                    f"restore: node-rank(s) {shown} did not reach the "
                    f"'{phase}' barrier within {limit:.0f} s"
                )
                raise RestoreTimeout(f"node-rank(s) {shown} did not reach '{phase}'")

    async def restore_done(self, agent: NodeAgent, job: JobSpec, plan: RestorePlan) -> None:
        """Barrier phase "done": returns once every node wrote its prerestore.

        Every node already has its data (phase "ready" passed in
        :meth:`plan_restore`), so a coordinator lost at this point only
        costs a warning: markers are published anyway.
        """
        cur, self._current = self._current, None
        try:
            if cur is None:
                return
            try:
                state = await self._barrier(
                    agent,
                    job,
                    cur.restore_id,
                    cur.round,
                    cur.version,
                    "done",
                    True,
                    [],
                    timeout=min(self.tier.join_timeout, 60.0),
                )
            except RestoreFailed as exc:
                log.warning("restore-done barrier: %s; publishing anyway", exc)
                return
            if state != "passed":
                log.warning("restore-done barrier answered %s; publishing anyway", state)
        finally:
            if plan.shard is not None and plan.detail.pop("pinned", False):
                self.tier._pin(plan.shard.key, -1)
