"""What `tierfs wait` says for each restore outcome, and which copies retention keeps
while a restore may need them (pure parts, no mounts; issue #19 cases 5 and 6)."""

from __future__ import annotations

from types import SimpleNamespace

import fake_ports
import pytest

from tierfs.cli.wait import WAIT_EXIT, wait_outcome
from tierfs.core.config import NodeConfig
from tierfs.core.control import JobSpec
from tierfs.replication.client import PeerClient
from tierfs.replication.peer import PeerTier
from tierfs.replication.plane import PlaneState
from tierfs.rpc.wire import WireStats
from tierfs.store.shards import ShardKey


@pytest.mark.parametrize(
    ("restore", "code", "text"),
    [
        (
            {"state": "done", "step": 5, "source": "peer:1", "outcome": "restored"},
            0,
            "restored step 5 from peer:1",
        ),
        (
            {
                "state": "done",
                "step": 5,
                "source": "local",
                "outcome": "older",
                "reason": "step 5 is complete on this node (step 6 is not loadable: ...)",
            },
            2,
            "restored step 5 from local",
        ),
        (
            {"state": "done", "step": 5, "backup": "2026-12-01_10-28", "source": "gcs"},
            0,
            "restored step 5 from GCS round 2026-12-01_10-28",
        ),
        (
            {
                "state": "done",
                "step": None,
                "outcome": "fresh",
                "reason": (
                    "no step of the job exists in RAM, on a peer or in the bucket: a fresh start"
                ),
            },
            0,
            "nothing to restore: no step of the job exists in RAM, on a peer or in the bucket",
        ),
        (
            {
                "state": "done",
                "step": None,
                "outcome": "incomplete",
                "reason": "no step is complete for every rank (backup round X lacks D3bb)",
            },
            3,
            "nothing restored (incomplete): no step is complete for every rank (backup round X",
        ),
        (
            {"state": "failed", "outcome": "missing", "error": "node-rank(s) [2] did not join"},
            4,
            "restore a node did not join: node-rank(s) [2] did not join",
        ),
        (
            {"state": "failed", "outcome": "refused", "error": "node count mismatch"},
            5,
            "restore the coordinator refused this node: node count mismatch",
        ),
        (
            {"state": "failed", "outcome": "timeout", "error": "node-rank(s) [1] did not reach"},
            6,
            "restore timed out: node-rank(s) [1] did not reach",
        ),
        ({"state": "failed", "error": "boom"}, 1, "restore failed: boom"),
        ({"state": "idle"}, 0, "no restore needed"),
        # a status written before outcomes existed
        ({"state": "done", "step": None}, 0, "nothing to restore"),
    ],
)
def test_wait_outcomes(restore, code, text):
    got_code, line = wait_outcome(restore)
    assert got_code == code and line.startswith(text), (got_code, line)
    assert len(set(WAIT_EXIT.values()) - {0}) == len(WAIT_EXIT) - 2  # distinct codes


def _peer_tier(keys, keep_local=2):
    """A peer tier with a static coordinator whose catalog holds ``keys``."""
    node = fake_ports.FakeJob(JobSpec(name="job", framework="generic", node_rank=0, nodes=2))
    config = NodeConfig(
        mountpoint="/m", ram_dir="/r", keep_local=keep_local, coordinator="127.0.0.1:1"
    )
    held = fake_ports.catalog(keep_local)
    for key in keys:
        held.add(SimpleNamespace(key=key, inodes=set()))
    plane = PlaneState(node, coordinator=config.coordinator, listen=None)
    return PeerTier(
        config,
        store=None,
        shards=None,
        catalog=held,
        job=node,
        reporter=node,
        budget=fake_ports.FakeBudget(),
        summons=node,
        plane=plane,
        client=PeerClient(None, WireStats()),
    )


def test_retention_keeps_the_synced_steps_and_everything_during_a_restore_round():
    keys = {ShardKey("job", r, s): object() for r in (0, 1) for s in (2, 3, 4, 5)}
    tier = _peer_tier(keys)
    assert tier.pinned() == set()  # no sync round yet: --keep-local alone decides
    tier.sync["step"] = 3  # the newest step every node sealed and replicated
    # steps 4 and 5, sealed while a peer was down, do not push 2 and 3 out
    assert tier.pinned() == {ShardKey("job", r, s) for r in (0, 1) for s in (2, 3)}
    tier.restore_round = 7  # a restore round is open: every copy may be chosen
    assert tier.pinned() == set(keys)


def test_wait_warns_of_an_older_save_of_the_newest_step_number(monkeypatch):
    """#16 fourth trial: every RAM tier lost, the bucket held step 20 saved by 4 nodes
    (complete) and saved again by 3 nodes (cut off): the 4-node save was restored with
    exit 0 and no word. Now exit 2 and the warning says which save came back."""
    from click.testing import CliRunner

    from tierfs.cli import wait as wait_cli
    from tierfs.cli.wait import wait_cmd as cli

    again = (
        "step 20 was saved again by 3 node(s) after the save restored (written by 4 nodes), "
        "and that newer save is incomplete (step 20 lacks rank(s) [2] (written by 3 nodes; "
        "this job has 2)): the earlier save of step 20 is restored"
    )
    restore = {
        "state": "done",
        "step": 20,
        "source": "gcs",
        "backup": "2026-12-04_22-06",
        "outcome": "older",
        "writers": 4,
        "reason": "step 20 from backup round 2026-12-04_22-06 (written by 4 nodes; this job has 2)",
        "problems": [again, "step 20 lacks rank(s) [2] (written by 3 nodes; this job has 2)"],
    }
    status = {"restore": restore, "job": {"name": "bk", "framework": "generic", "nodes": 2}}
    monkeypatch.setattr(wait_cli, "read_status", lambda mountpoint, timeout: status)
    got = CliRunner().invoke(cli, ["/mnt/x"])
    assert got.exit_code == WAIT_EXIT["older"], got.output
    assert "restored step 20 from GCS round 2026-12-04_22-06" in got.stdout
    assert f"tierfs: warning: {again}" in got.stderr
    assert "is not the newest step written" not in got.stderr
    assert got.stderr.count("was saved again") == 1
