"""The coordinator's record of the step directories the nodes are saving
(tierfs/cluster/savers.py; #14 trial 54 F2)."""

from __future__ import annotations

from tierfs.cluster.savers import MAX_NAMES, Savers


def test_a_node_hears_of_the_other_nodes_saves_not_its_own():
    s = Savers(fresh=3.0)
    s.report(0, ["checkpoint-20"], now=100.0)
    s.report(1, ["checkpoint-20", "checkpoint-21"], now=100.5)
    assert s.others(0, 101.0) == ["checkpoint-20", "checkpoint-21"]
    assert s.others(1, 101.0) == ["checkpoint-20"]
    assert s.others(2, 101.0) == ["checkpoint-20", "checkpoint-21"]
    s.report(1, [], now=101.0)  # node 1's save ended
    assert s.others(0, 101.5) == [] and s.others(2, 101.5) == ["checkpoint-20"]


def test_a_silent_node_is_not_saving_and_a_cleared_table_knows_nothing():
    s = Savers(fresh=3.0)
    s.report(0, ["checkpoint-20"], now=100.0)
    assert s.others(1, 103.0) == ["checkpoint-20"]
    assert s.others(1, 103.1) == []  # killed while saving: its last report is stale
    s.report(0, ["checkpoint-30"], now=104.0)
    assert s.others(1, 104.0) == ["checkpoint-30"]  # the old name is gone
    s.clear()
    assert s.others(1, 104.0) == []


def test_a_long_report_is_cut():
    s = Savers()
    s.report(0, [f"step-{i:03d}" for i in range(100)], now=1.0)
    assert len(s.others(1, 1.0)) == MAX_NAMES
