"""replicator.yaml parsing and the protocol's small files (PROTOCOL.md sections 2, 4)."""

from __future__ import annotations

import os

import pytest
import yaml

from tierfs.core import control
from tierfs.core.control import ControlError, JobSpec, parse_replicator_yaml

ORBAX = (
    "job-name: my-run\nframework: orbax\nassume-data-parallelism: 2\nnode-rank: 1\n"
    "nodes: 4\npeer-ranks: [3]\nbackup-interval-minutes: 30"
)
NEMO = (
    "job-name: nemo-job\nframework: pytorch.distributed\nnode-rank: 0\nnodes: 2\n"
    "peers-per-node: 1\nbackup-interval-minutes: 30\npeer-ranks:\n- 1\n"
)


def test_orbax_style_flow_list_no_trailing_newline():
    job = parse_replicator_yaml(ORBAX, env={})
    assert job == JobSpec(
        name="my-run",
        framework="orbax",
        node_rank=1,
        nodes=4,
        peer_ranks=(3,),
        peers_per_node=1,
        assume_data_parallelism=2,
        backup_interval_minutes=30.0,
    )
    assert job.warnings == ()


def test_nemo_style_block_list_and_both_peer_keys():
    job = parse_replicator_yaml(NEMO, env={})
    assert job is not None
    assert job.peer_ranks == (1,)
    assert job.peers_per_node == 1
    assert job.framework == "pytorch.distributed"


def test_single_slice_orbax_sends_empty_peer_ranks():
    text = (
        "job-name: job\nframework: orbax\nassume-data-parallelism: 1\nnode-rank: 0\n"
        "nodes: 1\npeer-ranks: []\nbackup-interval-minutes: 5"
    )
    job = parse_replicator_yaml(text, env={})
    assert job is not None and job.peer_ranks == () and job.peers_per_node == 0


def test_env_expansion_and_integers_as_strings():
    text = "job-name: $JOB\nframework: orbax\nnode-rank: '${RANK}'\nnodes: '4'\n"
    job = parse_replicator_yaml(text, env={"JOB": "run7", "RANK": "3"})
    assert job is not None and (job.name, job.node_rank, job.nodes) == ("run7", 3, 4)


def test_backup_interval_steps_is_accepted():
    text = "job-name: j\nframework: orbax\nnode-rank: 0\nnodes: 1\nbackup-interval-steps: 100"
    job = parse_replicator_yaml(text, env={})
    assert job is not None and job.backup_interval_steps == 100


def test_pytorch_workers_and_master_port():
    text = (
        "job-name: j\nframework: pytorch\nnode-rank: 0\nnodes: 1\nworkers-per-node: 8\n"
        "master-port: 5000"
    )
    job = parse_replicator_yaml(text, env={})
    assert job is not None and job.workers_per_node == 8 and job.master_port == 5000


@pytest.mark.parametrize("text", ["", "   \n", "\n\n", "# only a comment\n"])
def test_empty_means_reset(text):
    assert parse_replicator_yaml(text, env={}) is None


def test_unknown_keys_are_warnings():
    job = parse_replicator_yaml(ORBAX + "\nfancy-option: 1", env={})
    assert job is not None
    assert job.warnings == ("replicator.yaml: unknown key 'fancy-option' ignored",)


@pytest.mark.parametrize(
    "text, message",
    [
        ("job-name: [unclosed\n", "is not valid YAML"),
        ("- a\n- b\n", "must be a mapping"),
        ("framework: orbax\nnode-rank: 0\nnodes: 1\n", "missing required key 'job-name'"),
        ("job-name: j\nnode-rank: 0\nnodes: 1\n", "missing required key 'framework'"),
        ("job-name: j\nframework: orbax\nnodes: 1\n", "missing required key 'node-rank'"),
        ("job-name: j\nframework: orbax\nnode-rank: 0\n", "missing required key 'nodes'"),
        ("job-name: j\nframework: jaxx\nnode-rank: 0\nnodes: 1\n", "unknown framework 'jaxx'"),
        (
            "job-name: j\nframework: orbax\nnode-rank: 4\nnodes: 4\n",
            "node-rank 4 must be < nodes 4",
        ),
        ("job-name: j\nframework: orbax\nnode-rank: -1\nnodes: 4\n", "node-rank must be >= 0"),
        ("job-name: j\nframework: orbax\nnode-rank: 0\nnodes: 0\n", "nodes must be >= 1"),
        (
            "job-name: j\nframework: orbax\nnode-rank: 1.5\nnodes: 4\n",
            "node-rank must be an integer",
        ),
        (
            "job-name: j\nframework: orbax\nnode-rank: abc\nnodes: 4\n",
            "node-rank must be an integer",
        ),
        (
            "job-name: j\nframework: orbax\nnode-rank: 0\nnodes: 2\npeer-ranks: [2]\n",
            "peer rank 2 must be < nodes 2",
        ),
        (
            "job-name: j\nframework: orbax\nnode-rank: 0\nnodes: 2\npeers-per-node: -1\n",
            "peers-per-node must be >= 0",
        ),
        (
            "job-name: j\nframework: orbax\nnode-rank: 0\nnodes: 3\nassume-data-parallelism: 2\n",
            "must divide nodes 3",
        ),
        (
            "job-name: j\nframework: orbax\nnode-rank: 0\nnodes: 1\nbackup-interval-minutes: -5\n",
            "backup-interval-minutes must be > 0",
        ),
        ("job-name: a/b\nframework: orbax\nnode-rank: 0\nnodes: 1\n", "is not a valid name"),
        # regression (issue 13): scalar peer-ranks were split into a list and accepted
        (
            "job-name: j\nframework: orbax\nnode-rank: 0\nnodes: 2\npeer-ranks: 0\n",
            "peer-ranks must be a list of ranks such as [1, 2], got 0",
        ),
        (
            "job-name: j\nframework: orbax\nnode-rank: 0\nnodes: 2\npeer-ranks: '[0]'\n",
            "peer-ranks must be a list of ranks such as [1, 2], got '[0]'",
        ),
        (
            "job-name: j\nframework: orbax\nnode-rank: 0\nnodes: 3\npeer-ranks: 1,2\n",
            "peer-ranks must be a list",
        ),
        (
            "job-name: j\nframework: orbax\nnode-rank: 0\nnodes: 3\npeer-ranks: {1: 2}\n",
            "peer-ranks must be a list",
        ),
        (
            "job-name: j\nframework: orbax\nnode-rank: 0\nnodes: 3\npeer-ranks: [true]\n",
            "peer-ranks must be an integer",
        ),
    ],
)
def test_malformed_files_raise_one_clear_line(text, message):
    with pytest.raises(ControlError) as info:
        parse_replicator_yaml(text, env={})
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_marker_names_round_trip():
    name = control.marker_name("my-job", 5, 2, 0)
    assert name == "my-job-s5-n2-w0.restore"
    assert control.parse_marker(name) == ("my-job", 5, 2, 0)
    assert control.parse_marker("job-s5-n2-w0.restore.tmp") is None


def test_prerestore_is_never_empty_and_sorted():
    assert control.prerestore_text(None) == "{}\n"
    assert control.prerestore_text(0) == "{}\n"
    assert yaml.safe_load(control.prerestore_text(5)) == {"restore-step": 5}
    text = control.prerestore_text(5, "2026-11-30_12-00")
    assert text.index("restore-backup") < text.index("restore-step")
    assert yaml.safe_load(text) == {"restore-step": 5, "restore-backup": "2026-11-30_12-00"}


def test_jax_init_info_and_atomic_write(tmp_path):
    path = control.atomic_write(
        str(tmp_path),
        control.JAX_INIT_INFO,
        control.jax_init_info_text(3, "10.0.0.1:8476").encode(),
    )
    assert open(path).read() == "3\n10.0.0.1:8476\n"
    assert os.listdir(tmp_path) == [control.JAX_INIT_INFO]


def test_error_lines_are_single_lines(tmp_path):
    line = control.error_line("bad\nthing  happened", job="j", rank=2)
    assert line.endswith(" job=j node=2: bad thing happened\n")
    control.append_line(str(tmp_path), "replicator.errors", line)
    control.append_line(str(tmp_path), "replicator.errors", line)
    assert open(tmp_path / "replicator.errors").read() == line * 2


def test_unset_variables_and_own_rank_in_peer_ranks_are_warnings():
    """Found by a user: $NOPE_UNSET silently became the literal job name, and
    peer-ranks naming the node itself was silently dropped."""
    text = "job-name: $NOPE_UNSET\nframework: orbax\nnode-rank: 1\nnodes: 3\npeer-ranks: [1, 2]"
    job = parse_replicator_yaml(text, env={})
    assert job is not None and job.name == "$NOPE_UNSET" and job.peer_ranks == (2,)
    assert job.warnings == (
        "replicator.yaml: $NOPE_UNSET is not set in the node daemon's environment; used literally",
        "replicator.yaml: peer-ranks lists this node's own rank 1 or a rank twice; ignored",
    )
    job = parse_replicator_yaml(text.replace("$NOPE_UNSET", "${JOB}"), env={"JOB": "x"})
    assert job is not None and job.name == "x" and len(job.warnings) == 1


def test_unknown_keys_are_reported_ten_at_most():
    """Regression: 100k unknown keys wrote 100k lines to replicator.errors."""
    text = "job-name: j\nframework: orbax\nnode-rank: 0\nnodes: 1\n" + "".join(
        f"k{i}: {i}\n" for i in range(25)
    )
    job = control.parse_replicator_yaml(text, env={})
    assert len(job.warnings) == 11
    assert job.warnings[-1] == "replicator.yaml: 15 more unknown keys ignored"


def test_deep_nesting_and_aliases_are_invalid_yaml():
    base = "job-name: j\nframework: orbax\nnode-rank: 0\nnodes: 1\n"
    with pytest.raises(control.ControlError, match="nested too deeply"):
        control.parse_replicator_yaml(base + "x: " + "[" * 50_000, env={})
    with pytest.raises(control.ControlError, match="aliases"):
        control.parse_replicator_yaml(base + "a: &a [1]\nb: *a\n", env={})


@pytest.mark.parametrize("name", ["a\nb", "a\tb", "x\x7f", "a/b", "..", "run\u202eexe", "a\u2028b"])
def test_job_names_with_control_characters_are_refused(name):
    """Regression: a newline in job-name went into marker names and split error lines."""
    text = yaml.safe_dump({"job-name": name, "framework": "orbax", "node-rank": 0, "nodes": 1})
    with pytest.raises(ControlError, match="is not a valid name"):
        parse_replicator_yaml(text, env={})
