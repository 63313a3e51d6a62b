"""``tierfs wait --nodes N`` (issue #16): a worker of a job resized to N nodes waits for
the daemon of the N-node job, never takes the previous daemon's restore result, and
waits through the remount (a mountpoint that does not answer yet)."""

from __future__ import annotations

import pathlib

from click.testing import CliRunner

from tierfs.cli import main as cli_main
from tierfs.core.config import NodeConfig
from tierfs.core.control import JobSpec
from tierfs.daemon import build_node
from tierfs.store.ramstore import Budget, RamStore


def status_of(tmp_path: pathlib.Path, nodes: int, step: int) -> bytes:
    """The status.json of a daemon of a ``nodes``-node job that restored ``step``."""
    config = NodeConfig(mountpoint=str(tmp_path / "m"), ram_dir=str(tmp_path / "r"))
    store = RamStore(config.ram_dir)
    parts = build_node(config, store, Budget(store.root, 1 << 30, 0))
    parts.state.job, parts.state.mode = JobSpec("j", "generic", 0, nodes), "generic"
    parts.state.restore_state = {
        "state": "done",
        "step": step,
        "source": "local",
        "outcome": "restored",
        "writers": 3,
    }
    return parts.agent.status_json()


def mount_with(tmp_path: pathlib.Path, status: bytes) -> pathlib.Path:
    mnt = tmp_path / "mnt"
    (mnt / ".tierfs").mkdir(parents=True)
    (mnt / ".tierfs" / "status.json").write_bytes(status)
    return mnt


def wait(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli_main.main, ["wait", *args])
    return result.exit_code, result.output


def test_wait_for_another_node_count_keeps_waiting_on_the_previous_daemon(tmp_path):
    mnt = mount_with(tmp_path, status_of(tmp_path, 3, 30))
    code, out = wait(str(mnt), "--nodes", "2", "--timeout", "0.5")
    assert code == 7, out
    assert f"{mnt} serves a job of 3 nodes, not 2" in out
    assert "restored step 30" not in out


def test_wait_for_the_node_count_served_reports_its_restore(tmp_path):
    mnt = mount_with(tmp_path, status_of(tmp_path, 2, 30))
    code, out = wait(str(mnt), "--nodes", "2", "--timeout", "5")
    assert (code, out.strip()) == (
        0,
        "restored step 30 from local (written by 3 nodes; this job has 2)",
    )


def test_wait_with_nodes_waits_through_a_mountpoint_not_answering_yet(tmp_path):
    code, out = wait(str(tmp_path / "not-yet"), "--nodes", "2", "--timeout", "0.5")
    assert code == 7 and "no tierfs daemon" in out, out
    code, out = wait(str(tmp_path / "not-yet"), "--timeout", "0.5")  # without: an error
    assert code == 1 and "is not a tierfs mount" in out, out
