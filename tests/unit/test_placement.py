"""Peer selection against the formula of PROTOCOL.md section 2 / docs/CLIENTS.md section 5."""

from __future__ import annotations

import pytest

from tierfs.replication.placement import column_of, peer_ranks, row_offsets


def mtc_formula(rank: int, nodes: int, k: int, dp: int | None) -> set[int]:
    """The public replicator's set, written out from the documented formula."""
    if dp:
        cols = nodes // dp
        return {(rank + off * cols) % nodes for off in row_offsets(k)}
    out = {(rank ^ 1) % nodes}
    for i in range(1, k):
        out.add((rank + (nodes // k) * i) % nodes)
    return out


CASES = [
    # rank, nodes, peers-per-node, data parallelism, expected (formula order, no self)
    (0, 4, 1, None, [1]),
    (1, 4, 1, None, [0]),
    (2, 4, 1, None, [3]),
    (3, 4, 1, None, [2]),
    (0, 4, 2, None, [1, 2]),
    (3, 4, 2, None, [2, 1]),
    (0, 8, 3, None, [1, 2, 4]),  # ring distance 8 // 3 = 2
    (5, 8, 4, None, [4, 7, 1, 3]),
    (4, 5, 1, None, [0]),  # odd N: 4 XOR 1 = 5 -> mod 5 = 0
    (0, 1, 1, None, []),  # alone: XOR lands on itself
    (0, 2, 2, None, [1]),  # 0 XOR 1 = 1, ring 0 + 1 = 1: duplicates collapse
    (0, 4, 1, 2, [2]),  # D=2, cols=2: row -1 -> rank 2
    (1, 4, 1, 2, [3]),
    (2, 4, 1, 2, [0]),
    (3, 4, 1, 2, [1]),
    (0, 4, 3, 2, [2]),  # -1, +1 -> 2, 2; -2 -> self: dropped
    (1, 6, 2, 3, [5, 3]),  # cols=2: 1-2=-1 -> 5, 1+2 = 3
    (0, 4, 1, 1, []),  # D=1: one row, every offset is the node itself
    (0, 4, 0, None, []),
    (0, 4, 0, 2, []),
]


@pytest.mark.parametrize(("rank", "nodes", "k", "dp", "expected"), CASES)
def test_table(rank, nodes, k, dp, expected):
    got = peer_ranks(rank, nodes, peers_per_node=k, data_parallelism=dp)
    assert got == expected
    if k:
        assert set(got) == mtc_formula(rank, nodes, k, dp) - {rank}


@pytest.mark.parametrize("nodes", [1, 2, 3, 4, 6, 8, 12, 16])
def test_formula_everywhere(nodes):
    for k in range(1, nodes + 1):
        for dp in [None] + [d for d in range(1, nodes + 1) if nodes % d == 0]:
            for rank in range(nodes):
                got = peer_ranks(rank, nodes, peers_per_node=k, data_parallelism=dp)
                assert rank not in got
                assert len(got) == len(set(got))
                assert set(got) == mtc_formula(rank, nodes, k, dp) - {rank}
                if dp:  # data parallelism: the peers hold identical data (same column)
                    assert set(got) <= set(column_of(rank, nodes, dp))


def test_explicit_ranks_win_and_drop_self_and_duplicates():
    assert peer_ranks(1, 4, peer_ranks=[3, 1, 3, 0], peers_per_node=1, data_parallelism=2) == [3, 0]
    assert peer_ranks(0, 1, peer_ranks=[]) == []


def test_row_offsets():
    assert row_offsets(5) == [-1, 1, -2, 2, -3]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 4, "nodes": 4}, "rank 4"),
        ({"rank": 0, "nodes": 4, "peer_ranks": [4]}, "peer rank 4"),
        ({"rank": 0, "nodes": 4, "peers_per_node": -1}, "peers-per-node"),
        ({"rank": 0, "nodes": 4, "peers_per_node": 1, "data_parallelism": 3}, "divide"),
    ],
)
def test_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        peer_ranks(**kwargs)


def test_column_of():
    assert column_of(1, 6, 3) == [1, 3, 5]
    assert column_of(1, 6, None) == [1]
    assert column_of(1, 6, 1) == [1]
