"""Heartbeat groups: which node relays a node's heartbeat to the coordinator (pure).

ARCHITECTURE.md "Heartbeat groups" (issue #17 item 2). The node ranks of a
job of more than :data:`GROUP_SIZE` nodes are cut into groups of
:data:`GROUP_SIZE` consecutive ranks (group ``g``: ranks ``g*G .. g*G+G-1``).
Each member sends its heartbeat to its group's leader, which forwards the
group's heartbeats to the coordinator in one ``SyncBatch`` call per period.
The leader is the lowest node rank among the group's first
:data:`CANDIDATES` ranks that is not gone for good, that the coordinator
last reported live and that this node has not seen fail within
:data:`LEADER_BACKOFF` seconds; with none of them, the node syncs directly.
Every member computes the same leader from the same coordinator data; a
member that disagrees for a while (it saw the leader fail) only costs the
coordinator one direct call per period.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

#: node ranks per heartbeat group; jobs of at most this many nodes sync directly
GROUP_SIZE = 100
#: the lowest ranks of a group that may lead it (their addresses are asked for)
CANDIDATES = 3
#: seconds a leader collects its members' heartbeats before the batch goes out (one
#: heartbeat period: one coordinator call per group and period)
RELAY_WINDOW = 1.0
#: seconds a leader collects its members' restore-round calls (Decide, Barrier) before
#: the batch goes out: the members of a group reach a phase within milliseconds of
#: each other (they all wait on the same decision or barrier), so a short window
#: gathers most of them and adds at most this much to a phase
ROUND_WINDOW = 0.05
#: seconds a member waits for its leader's answer before it syncs directly
RELAY_TIMEOUT = RELAY_WINDOW + 2.0
#: how a leader's Relay answer starts when its batch call failed (the coordinator is at
#: fault, not the leader: the member syncs directly this beat but keeps its leader)
UPSTREAM = "leader could not reach the coordinator"
#: seconds a node syncs directly (or with the next candidate) after its leader failed
LEADER_BACKOFF = 30.0


def group_of(rank: int, group_size: int = GROUP_SIZE) -> range:
    """The node ranks of ``rank``'s group (before clipping to the job's node count).

    Raises:
        ValueError: ``group_size`` < 1 or ``rank`` < 0.
    """
    if group_size < 1 or rank < 0:
        raise ValueError(f"no heartbeat group for rank {rank} with group size {group_size}")
    first = rank - rank % group_size
    return range(first, first + group_size)


def candidates(
    rank: int, nodes: int, group_size: int = GROUP_SIZE, count: int = CANDIDATES
) -> list[int]:
    """The ranks that may lead ``rank``'s group in a job of ``nodes`` nodes, lowest
    first ([] when the job is small enough to sync directly: ``nodes <= group_size``)."""
    if nodes <= group_size:
        return []
    group = group_of(rank, group_size)
    return [r for r in group[:count] if r < nodes]


def leader(
    rank: int,
    nodes: int,
    *,
    live: Mapping[int, bool],
    gone: Collection[int] = (),
    failed: Mapping[int, float] | None = None,
    now: float = 0.0,
    group_size: int = GROUP_SIZE,
    count: int = CANDIDATES,
) -> int | None:
    """The node rank ``rank`` sends its heartbeat to, or None: sync directly.

    Args:
        rank: this node's node rank.
        nodes: the job's node count.
        live: rank -> the coordinator's last ``live`` flag for the candidates
            this node knows an address of (a rank missing: not a candidate).
        gone: ranks declared gone for good.
        failed: rank -> the time (seconds, same clock as ``now``) a relay
            through it last failed on this node; skipped for
            :data:`LEADER_BACKOFF` seconds.
        now: the current time (seconds).
        group_size: ranks per group.
        count: candidates per group.

    A leader is also its own member: it returns itself (its own heartbeat
    joins its batch).
    """
    failed = failed or {}
    for r in candidates(rank, nodes, group_size, count):
        if r in gone or not live.get(r, False):
            continue
        at = failed.get(r)
        if at is not None and now - at < LEADER_BACKOFF:
            continue
        return r
    return None
