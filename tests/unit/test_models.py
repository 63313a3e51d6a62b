"""The models of the file formats (#12 item 5): replicator.yaml -> JobSpec, the manifest
of a sealed shard (byte-compatible with every manifest written before the model), and
the CheckpointConfiguration spec."""

from __future__ import annotations

import json
import os

import google_crc32c
import pytest

from tierfs.backup.layout import NodeBackup
from tierfs.core import control
from tierfs.core.control import ControlError, JobSpec, ReplicatorYaml, parse_replicator_yaml
from tierfs.csi import crd
from tierfs.store.manifest import FileEntry, Manifest, ManifestError
from tierfs.store.ramstore import RamStore
from tierfs.store.shards import MANIFEST, ShardStore

# ------------------------------------------------------------------ replicator.yaml


def test_the_known_keys_are_mtcs():
    assert (
        frozenset(
            {
                "job-name",
                "framework",
                "node-rank",
                "nodes",
                "peer-ranks",
                "peers-per-node",
                "assume-data-parallelism",
                "backup-interval-minutes",
                "backup-interval-steps",
                "workers-per-node",
                "master-port",
            }
        )
        == control.KNOWN_KEYS
    )


def test_orbax_and_nemo_files_give_the_same_job():
    orbax = (
        "job-name: llama\nframework: orbax\nassume-data-parallelism: 2\nnode-rank: 1\n"
        "nodes: 4\npeer-ranks: [0, 2]\nbackup-interval-minutes: 30"
    )
    nemo = (
        "job-name: llama\nframework: orbax\nnode-rank: '1'\nnodes: '4'\n"
        "peer-ranks:\n- 0\n- 2\npeers-per-node: 2\nassume-data-parallelism: 2\n"
        "backup-interval-minutes: 30\n"
    )
    a, b = parse_replicator_yaml(orbax, {}), parse_replicator_yaml(nemo, {})
    assert (
        a
        == b
        == JobSpec(
            name="llama",
            framework="orbax",
            node_rank=1,
            nodes=4,
            peer_ranks=(0, 2),
            peers_per_node=2,
            assume_data_parallelism=2,
            backup_interval_minutes=30.0,
        )
    )


def test_job_spec_round_trips_through_its_dict():
    job = parse_replicator_yaml(
        "job-name: j\nframework: pytorch\nnode-rank: 0\nnodes: 2\nworkers-per-node: 8\n"
        "master-port: 29500\nbackup-interval-steps: 100",
        {},
    )
    assert job is not None
    assert JobSpec.from_dict(job.to_dict()) == job
    assert (job.workers_per_node, job.master_port, job.backup_interval_steps) == (8, 29500, 100)


def test_vars_are_expanded_and_unset_ones_warned():
    text = "job-name: ${JOB}\nframework: orbax\nnode-rank: $RANK\nnodes: 2\nx: ${NOPE}"
    job = parse_replicator_yaml(text, {"JOB": "run-7", "RANK": "1"})
    assert job is not None and (job.name, job.node_rank) == ("run-7", 1)
    assert job.warnings == (
        "replicator.yaml: unknown key 'x' ignored",
        "replicator.yaml: $NOPE is not set in the node daemon's environment; used literally",
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("framework: orbax\nnode-rank: 0\nnodes: 1", "missing required key 'job-name'"),
        ("job-name: a/b\nframework: orbax\nnode-rank: 0\nnodes: 1", "is not a valid name"),
        ("job-name: j\nframework: tf\nnode-rank: 0\nnodes: 1", "unknown framework 'tf'"),
        ("job-name: j\nframework: orbax\nnode-rank: 2\nnodes: 2", "node-rank 2 must be < nodes 2"),
        ("job-name: j\nframework: orbax\nnode-rank: 0\nnodes: 0", "nodes must be >= 1, got 0"),
        (
            "job-name: j\nframework: orbax\nnode-rank: x\nnodes: 2",
            "node-rank must be an integer, got 'x'",
        ),
        (
            "job-name: j\nframework: orbax\nnode-rank: 0\nnodes: 2\npeer-ranks: 1",
            "peer-ranks must be a list",
        ),
        (
            "job-name: j\nframework: orbax\nnode-rank: 0\nnodes: 2\npeer-ranks: [5]",
            "peer rank 5 must be < nodes 2",
        ),
        (
            "job-name: j\nframework: orbax\nnode-rank: 0\nnodes: 3\nassume-data-parallelism: 2",
            "assume-data-parallelism 2 must divide nodes 3",
        ),
        (
            "job-name: j\nframework: orbax\nnode-rank: 0\nnodes: 1\nmaster-port: 70000",
            "master-port 70000 is out of range",
        ),
        (
            "job-name: j\nframework: orbax\nnode-rank: 0\nnodes: 1\nbackup-interval-minutes: 0",
            "backup-interval-minutes must be > 0",
        ),
        (
            "job-name: j\nframework: orbax\nnode-rank: 0\nnodes: 1\nbackup-interval-steps: 0",
            "backup-interval-steps must be >= 1",
        ),
        (
            "job-name: j\nframework: orbax\nnode-rank: 0\nnodes: 1\nworkers-per-node: true",
            "workers-per-node must be an integer, got True",
        ),
    ],
)
def test_a_malformed_file_is_one_control_error(text, message):
    with pytest.raises(ControlError) as info:
        parse_replicator_yaml(text, {})
    assert message in str(info.value) and "\n" not in str(info.value)
    assert "validation error" not in str(info.value)  # never pydantic's multi-line text


def test_the_model_keeps_the_files_spelling():
    model = ReplicatorYaml.model_validate(
        {"job-name": "j", "framework": "orbax", "node-rank": 0, "nodes": 1, "extra-key": 1}
    )
    assert model.model_dump(by_alias=True, exclude_none=True)["job-name"] == "j"
    assert model.model_extra == {"extra-key": 1}


# ------------------------------------------------------------------------ manifests

#: a manifest as tierfs wrote it before the model (and writes it now): sorted keys,
#: no spaces, crc32c/target left out when None
OLD_MANIFEST = (
    b'{"backup_requested":false,"created":1764547200.25,"files":['
    b'{"kind":"dir","mode":493,"path":"5","size":0},'
    b'{"crc32c":2591144780,"kind":"file","mode":420,"path":"5/a.bin","size":5},'
    b'{"kind":"symlink","mode":511,"path":"5/b","size":0,"target":"a.bin"}],'
    b'"format":"tierfs.store.manifest/1","framework":"orbax","job":"llama","name":"5",'
    b'"rank":0,"step":5}'
)


def test_an_old_manifest_loads_and_is_written_back_byte_for_byte():
    m = Manifest.from_json(OLD_MANIFEST)
    assert (m.job, m.rank, m.step, m.name, m.framework) == ("llama", 0, 5, "5", "orbax")
    assert m.files == (
        FileEntry("5", "dir", mode=0o755),
        FileEntry("5/a.bin", "file", size=5, mode=0o644, crc32c=2591144780),
        FileEntry("5/b", "symlink", mode=0o777, target="a.bin"),
    )
    assert m.created == 1764547200.25 and not m.backup_requested
    assert m.to_json() == OLD_MANIFEST
    assert Manifest.from_json(OLD_MANIFEST.decode()) == m


def test_a_manifest_of_the_first_releases_loads():
    """Before ``created`` and ``backup_requested`` existed: 0 and False."""
    d = json.loads(OLD_MANIFEST)
    del d["created"], d["backup_requested"]
    m = Manifest.from_json(json.dumps(d))
    assert (m.created, m.backup_requested) == (0.0, False)
    assert len(m.files) == 3


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.update(format="tierfs.store.manifest/2"), "not a tierfs manifest"),
        (lambda d: d.pop("format"), "not a tierfs manifest"),
        (lambda d: d.pop("job"), "malformed manifest: job"),
        (lambda d: d.update(rank="zero"), "malformed manifest: rank"),
        (lambda d: d["files"][1].update(size="5"), "malformed manifest: files.1.size"),
        (lambda d: d["files"][1].update(colour="red"), "malformed manifest: files.1.colour"),
        (lambda d: d["files"][1].pop("crc32c"), "lacks size or crc32c"),
        (lambda d: d["files"][0].update(path="../x"), "unsafe path"),
        (lambda d: d["files"][2].update(target="../../etc"), "escapes the shard"),
    ],
)
def test_a_bad_manifest_is_a_manifest_error(change, message):
    d = json.loads(OLD_MANIFEST)
    change(d)
    with pytest.raises(ManifestError, match=message.replace(".", r"\.")):
        Manifest.from_json(json.dumps(d))


@pytest.mark.parametrize("data", [b"", b"{", b"\xff\xfe", b"[]", b"null"])
def test_not_json_or_not_an_object_is_refused(data):
    with pytest.raises(ManifestError):
        Manifest.from_json(data)


def test_a_ram_store_written_before_the_model_loads(tmp_path):
    """An existing ram-dir: store/shards/<job>/<rank>/<step>/{manifest,data/...}."""
    ram = RamStore(str(tmp_path / "ram"))
    shard = os.path.join(ram.shards, "llama", "0", "5")
    os.makedirs(os.path.join(shard, "data", "5"))
    with open(os.path.join(shard, "data", "5", "a.bin"), "wb") as f:
        f.write(b"hello")
    os.symlink("a.bin", os.path.join(shard, "data", "5", "b"))
    os.chmod(os.path.join(shard, "data", "5"), 0o755)
    os.chmod(os.path.join(shard, "data", "5", "a.bin"), 0o644)
    assert google_crc32c.value(b"hello") == 2591144780
    with open(os.path.join(shard, MANIFEST), "wb") as f:
        f.write(OLD_MANIFEST)
    store = ShardStore(ram)
    found = store.load()
    assert list(found) == [next(iter(found))]
    (got,) = found.values()
    assert (got.key.job, got.key.rank, got.key.step) == ("llama", 0, 5)
    assert store.verify(got) == []


def test_a_bucket_rounds_node_manifest_still_loads():
    """The per-node object of a backup round embeds the shard manifest."""
    nb = NodeBackup(
        manifest=Manifest.from_json(OLD_MANIFEST),
        round="r-000005",
        nodes=1,
        uploader=0,
        data_parallelism=None,
        hashes={},
        objects={"5/a.bin": f"{'a' * 64}.data/5/a.bin"},
        created=1.0,
    )
    data = nb.to_json()
    assert json.loads(data)["manifest"] == json.loads(OLD_MANIFEST)
    again = NodeBackup.from_json(data)
    assert again.manifest.to_json() == OLD_MANIFEST


# ------------------------------------------------------------ CheckpointConfiguration


def test_a_spec_round_trips_to_its_flags():
    spec = crd.parse_spec(
        "x",
        {
            "inMemoryVolumeSize": "1.5Ti",
            "mountOptions": ["ro", "attr_timeout=2"],
            "keepLocal": 3,
            "peerPort": 9000,
            "nodeSelector": {"pool": "a"},
            "tolerations": [{"key": "k", "operator": "Exists"}],
            "extraArgs": ["--join-timeout=120"],
            "unknownField": 1,
        },
    )
    assert (spec.size_text, spec.size) == ("1.5Ti", 3 * 2**39)
    assert spec.node_flags() == [
        f"--size={3 * 2**39}",
        "-o",
        "ro",
        "-o",
        "attr_timeout=2",
        "--keep-local=3",
    ]
    assert spec.pod.peer_port == 9000 and spec.pod.node_selector == {"pool": "a"}
    assert spec.pod.extra_args == ["--join-timeout=120"]


@pytest.mark.parametrize(
    "spec, message",
    [
        ({}, "spec.inMemoryVolumeSize is required"),
        ({"inMemoryVolumeSize": "8Gi", "cloudStorageBucketName": "gs://b"}, "without gs://"),
        ({"inMemoryVolumeSize": "8Gi", "mountOptions": ["a b"]}, "spec.mountOptions: bad"),
        ({"inMemoryVolumeSize": "8Gi", "tolerations": ["x"]}, "spec.tolerations[0] must be"),
    ],
)
def test_a_bad_spec_names_the_field(spec, message):
    with pytest.raises(crd.CrdError) as info:
        crd.parse_spec("x", spec)
    assert message in str(info.value)
