"""Issue #16: a job shrunk to one node. Two nodes save a sharded state with stock
``torch.distributed.checkpoint`` (one rank per node, each into its own mount); node 1
is lost for good with its RAM; the job restarts on node 0 alone (``--nodes 1``, RAM
kept), which restores the 2-node step, shows rank 1's files in its view (from the
replica it holds) and loads it with world size 1 -- with its peer plane (its own
coordinator's round) and without one (``tierfs mount DIR --nodes 1``, deciding alone)."""

from __future__ import annotations

import pytest
from conftest import tierfs
from mtc_clients import wait_for
from peer_cluster import Cluster, job_args
from test_elastic import JOB, dcp, holds, restart, whole

pytestmark = [pytest.mark.slow]

SHRUNK = "restored step 30 from local (written by 2 nodes; this job has 1)"


def test_a_two_node_step_is_restored_and_loaded_on_one_node(make_mount):
    """Regression: node 0 remounted with ``--nodes 1`` ran no restore (a one-node job
    without a bucket skips it), so ``tierfs wait`` printed the previous daemon's
    outcome, ``nothing to restore: ... a fresh start`` (exit 0), with step 30 in RAM."""
    c = Cluster(make_mount, 2, node_args=job_args(JOB, 2))
    assert dcp(c, "save", 30, [0, 1]) == ["SAVED"] * 2
    for i in range(2):
        wait_for(lambda i=i: whole(c, i, 30, 2), 90, f"the whole step 30 on node {i}")
    wait_for(lambda: holds(c, 0, 1, 30), 90, "rank 1's replica on node 0")
    c.lose(1)
    restart(c, 1, [0])
    w = tierfs("wait", str(c.root(0)), "--timeout", "180", check=False, timeout=240)
    assert (w.returncode, w.stdout.strip()) == (0, SHRUNK), (w.stdout, w.stderr, c.logs())
    wait_for(lambda: whole(c, 0, 30, 2), 60, "rank 1's files in node 0's view")
    assert dcp(c, "load", 30, [0]) == ["LOADED_OK"]
    assert c.errors(0) == "", c.errors(0)

    # the same node as a plain one-node mount: no peer plane, no coordinator
    m = c.mounts[0]
    m.unmount()
    m.args = ["--job", JOB, "--nodes", "1", "--node-rank", "0"]
    c.remount(0)
    w = tierfs("wait", str(c.root(0)), "--timeout", "180", check=False, timeout=240)
    assert (w.returncode, w.stdout.strip()) == (0, SHRUNK), (w.stdout, w.stderr, c.logs())
    wait_for(lambda: whole(c, 0, 30, 2), 60, "rank 1's files in node 0's view, alone")
    assert dcp(c, "load", 30, [0]) == ["LOADED_OK"]
    assert c.errors(0) == "", c.errors(0)
