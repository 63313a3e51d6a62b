"""Peer selection: which node ranks receive a node's sealed steps (PROTOCOL.md section 2).

Pure policy, unit-tested against the formula of the public MTC replicator
(docs/CLIENTS.md section 5, "Peers"):

* explicit ``peer-ranks`` win;
* otherwise, with k = ``peers-per-node``, N = ``nodes`` and r = own rank:

  - without data parallelism: ``(r XOR 1) mod N`` (the closest neighbour),
    then ``(r + (N // k)·i) mod N`` for i = 1..k-1 (the farthest points of
    a ring);
  - with ``assume-data-parallelism`` D (ranks form a D x (N/D) grid,
    rank = row·cols + col, a column holds identical data): the same column
    in the neighbouring rows, row offsets -1, +1, -2, +2, ... for
    i = 0..k-1, i.e. ``(r + offset·(N // D)) mod N``.

MTC builds these as sets, so duplicates collapse and the node itself can
appear (N = 1; D = 1; D = 2 with k >= 3). tierfs drops self and duplicates
explicitly and keeps the formula's order (the first peer is the preferred
one). Like MTC, any D (even 1) selects the data-parallel formula; with
D = 1 every row offset lands on the node itself, so there are no peers by
count (Orbax always sends explicit ``peer-ranks`` instead).
"""

from __future__ import annotations

from collections.abc import Iterable


def row_offsets(k: int) -> list[int]:
    """The data-parallel row offsets for ``k`` peers: -1, +1, -2, +2, ..."""
    out = []
    for i in range(k):
        step = i // 2 + 1
        out.append(-step if i % 2 == 0 else step)
    return out


def peer_ranks(
    rank: int,
    nodes: int,
    *,
    peer_ranks: Iterable[int] | None = None,
    peers_per_node: int = 0,
    data_parallelism: int | None = None,
) -> list[int]:
    """The ranks that receive node ``rank``'s sealed steps, in preference order.

    Args:
        rank: this node's rank, 0 <= rank < nodes.
        nodes: number of nodes N >= 1.
        peer_ranks: explicit receivers (``peer-ranks``); win over the count.
        peers_per_node: k >= 0 (``peers-per-node``); 0 means no peers.
        data_parallelism: D (``assume-data-parallelism``), dividing N, or None.

    Returns:
        Distinct ranks in [0, N), never ``rank`` itself.

    Raises:
        ValueError: rank or an explicit peer outside [0, N), k < 0, D not
            dividing N.
    """
    if nodes < 1 or not 0 <= rank < nodes:
        raise ValueError(f"rank {rank} must be in [0, {nodes})")
    if peer_ranks is not None:
        chosen = list(peer_ranks)
        for p in chosen:
            if not 0 <= p < nodes:
                raise ValueError(f"peer rank {p} must be in [0, {nodes})")
    else:
        if peers_per_node < 0:
            raise ValueError(f"peers-per-node must be >= 0, got {peers_per_node}")
        k = peers_per_node
        if k == 0:
            return []
        if data_parallelism:
            if data_parallelism < 1 or nodes % data_parallelism:
                raise ValueError(
                    f"assume-data-parallelism {data_parallelism} must divide nodes {nodes}"
                )
            cols = nodes // data_parallelism
            chosen = [(rank + off * cols) % nodes for off in row_offsets(k)]
        else:
            chosen = [(rank ^ 1) % nodes]
            dist = nodes // k
            chosen += [(rank + dist * i) % nodes for i in range(1, k)]
    return [p for p in dict.fromkeys(chosen) if p != rank]


def column_of(rank: int, nodes: int, data_parallelism: int | None) -> list[int]:
    """Ranks holding data identical to ``rank``'s under data parallelism D (itself included).

    Without D, or with D = 1 (a single row), that is only ``[rank]``.
    """
    if not data_parallelism or data_parallelism <= 1 or nodes % data_parallelism:
        return [rank]
    cols = nodes // data_parallelism
    return [row * cols + rank % cols for row in range(data_parallelism)]


def with_stand_ins(targets: Iterable[int], rank: int, nodes: int, gone: Iterable[int]) -> list[int]:
    """``targets`` (node ``rank``'s receivers, :func:`peer_ranks`) with each rank declared
    gone for good replaced by a stand-in (issue #16), in the same preference order.

    A gone target's stand-in is the next rank after it on the ring (``+1, +2, ...
    mod nodes``) that is not ``rank``, not gone and not already a receiver, so
    every node's steps keep their copy count while enough live nodes remain
    (fewer receivers only when fewer live nodes than receivers are left).
    Deterministic: every node computes the same stand-ins from the same gone set.

    Args:
        targets: the receivers as placed, distinct ranks in ``[0, nodes)``.
        rank: this node's rank.
        nodes: the job's node count.
        gone: the ranks declared gone.
    """
    dead = frozenset(gone)
    chosen = [t for t in targets if t not in dead]
    if not dead:
        return chosen
    out: list[int] = []
    taken = set(chosen) | {rank}
    for t in targets:
        if t not in dead:
            out.append(t)
            continue
        for i in range(1, nodes):
            c = (t + i) % nodes
            if c not in dead and c not in taken:
                out.append(c)
                taken.add(c)
                break
    return out
