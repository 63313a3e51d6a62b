"""Issue #16, JAX on a changed process count: Orbax's standard ``CheckpointManager`` in
two CPU JAX processes (``jax.distributed``), one per tierfs node, each saving into its
own node's mount (node-local storage: ``primary_host=None``, no OCDBT, see
tests/support/clients/orbax_std.py) arrays sharded across the processes. Node 1 is
wiped and replaced: the two processes restore onto another sharding; node 1 is lost
again and the job restarts on node 0 alone: one process over another mesh restores
it. Arrays equal bit for bit every time."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import tierfs
from mtc_clients import wait_for
from peer_cluster import Cluster, job_args, run_ranks
from test_elastic import JOB, holds, restart

pytestmark = [pytest.mark.slow]

CLIENT = str(Path(__file__).resolve().parents[1] / "support" / "clients" / "orbax_std.py")
#: the files of step 5 every node's view must show: both processes' shards
FILES = ("5/default/w/0.0", "5/default/w/1.0", "5/default/b/0", "5/default/b/1")


def orbax(c: Cluster, phase: str, nodes: list[int], env: dict[str, str] | None = None) -> list[str]:
    """One JAX process per node of ``nodes`` (process id = its position there); each
    one's last line of output (all of it, with its exit code, when it failed)."""

    def args(r: int, world: int, port: int) -> list[str]:
        return [str(c.root(nodes[r])), phase, str(r), str(world), str(port), "5"]

    outs = run_ranks(c, CLIENT, args, nodes, env)
    # jax.distributed's gloo prints a line on stdout first: the client's own line is last
    return [o if " (rc " in o else (o.splitlines() or [""])[-1] for o in outs]


def whole(c: Cluster, i: int) -> bool:
    return all((c.root(i) / f).exists() for f in FILES)


def wait_restore(c: Cluster, i: int) -> str:
    w = tierfs("wait", str(c.root(i)), "--timeout", "180", check=False, timeout=240)
    assert w.returncode == 0, (i, w.stdout, w.stderr, c.logs())
    return w.stdout.strip()


def test_orbax_standard_manager_restores_on_another_process_count(make_mount):
    c = Cluster(make_mount, 2, node_args=job_args(JOB, 2))
    assert orbax(c, "save", [0, 1]) == ["SAVED"] * 2
    for i in (0, 1):
        wait_for(lambda i=i: whole(c, i), 90, f"both processes' files of step 5 on node {i}")
    wait_for(lambda: holds(c, 0, 1, 5) and holds(c, 1, 0, 5), 90, "each part replicated")
    # each process finalized its own step: their step metadata differ, not a conflict
    assert c.errors(0) == "" and c.errors(1) == "", (c.errors(0), c.errors(1))

    # node 1 wiped and replaced (same job, 2 nodes): two processes, another sharding
    c.lose(1)
    c.remount(1)
    assert wait_restore(c, 1).startswith("restored step 5 from peer:0")
    wait_for(lambda: whole(c, 1), 60, "step 5 whole on the new node 1")
    assert orbax(c, "load", [0, 1]) == ["LOADED_OK 5"] * 2

    # node 1 lost again; the job restarts on node 0 alone: one process, 2 local devices
    wait_for(lambda: holds(c, 0, 1, 5), 90, "rank 1's replica on node 0")
    c.lose(1)
    restart(c, 1, [0])
    assert wait_restore(c, 0) == "restored step 5 from local (written by 2 nodes; this job has 1)"
    wait_for(lambda: whole(c, 0), 60, "step 5 whole on node 0 alone")
    two_devices = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert orbax(c, "load", [0], two_devices) == ["LOADED_OK 5"]
    assert c.errors(0) == "", c.errors(0)
