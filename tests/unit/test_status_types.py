"""The typed status (tierfs/core/status/, issue #12 item 4): ``to_json`` writes exactly
the JSON the dict-building code wrote (the contract the CLI, CSI, demo and scripts
read), ``from_json`` reads it back, and the readers use it (no mount, no process).

Goldens in tests/unit/data/status/:
- ``daemon-*.json``: ``.tierfs/status.json`` of real daemons (a four-node cluster with
  peers, a coordinator and fake-gcs-server, tests/cluster/test_gcs_cluster.py), taken
  with the code before the typed status; only the mount and ram-dir paths replaced.
- ``built-*.json``: the status of :func:`status_state.build_state`'s node as that
  code wrote it (normalized by :func:`status_state.frozen_status`).
"""

from __future__ import annotations

import json
import pathlib
from types import SimpleNamespace
from typing import Any

import pytest
import status_state

from tierfs.cli.main import wait_outcome
from tierfs.cli.status import format_status
from tierfs.core.status import (
    ActiveBackupStatus,
    BackupBookStatus,
    BackupStatus,
    CoordinatorMemberStatus,
    CoordinatorRoundStatus,
    CoordinatorStatus,
    CoordinatorSyncStatus,
    NodeStatus,
    PeerStatus,
    RestoreStatus,
    StatusFormatError,
    StepStatus,
)
from tierfs.csi.nodemount import read_status

DATA = pathlib.Path(__file__).parent / "data" / "status"
DAEMON = sorted(DATA.glob("daemon-*.json"))


def load(path: pathlib.Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def as_written(status: NodeStatus) -> dict[str, Any]:
    """The JSON object as the agent writes it (``json.dumps(..., default=str)``)."""
    out: dict[str, Any] = json.loads(json.dumps(status.to_json(), sort_keys=True, default=str))
    return out


def test_the_goldens_are_there():
    assert len(DAEMON) >= 3
    assert {p.name for p in DATA.glob("built-*.json")} == {"built-node.json", "built-one-node.json"}


@pytest.mark.parametrize("path", DAEMON, ids=lambda p: p.stem)
def test_a_real_daemon_status_reads_back_and_writes_exactly_the_same_json(path):
    golden = load(path)
    assert as_written(NodeStatus.from_json(golden)) == golden


@pytest.mark.parametrize(("cluster", "name"), [(True, "built-node"), (False, "built-one-node")])
def test_a_node_status_is_the_json_the_dict_code_wrote(tmp_path, cluster, name):
    # built-node.json differs from the dict code's output in one value only: the
    # coordinator's round book exists from build_node on (it was installed when the
    # GCS tier started), so coordinator_state.backups is its empty status, not null
    parts = status_state.build_state(tmp_path, cluster=cluster)
    got = status_state.frozen_status(parts, lambda st: st.to_json())
    assert got == load(DATA / f"{name}.json")


def test_the_agent_builds_typed_parts(tmp_path):
    parts = status_state.build_state(tmp_path)
    st = parts.agent.status()
    assert isinstance(st, NodeStatus)
    assert isinstance(st.peer, PeerStatus) and isinstance(st.gcs, BackupStatus)
    assert [(s.step, s.state) for s in st.steps] == [
        (30, "writing"),
        (25, "writing"),
        (20, "replication failed"),
        (10, "replicated"),
    ]
    assert st.steps[-1].where == ("gcs:2026-12-01_10-00", "local", "peer:1", "peer:2")
    assert st.steps[2].backup_requested is True and st.steps[2].visible is True
    assert st.steps[0].files is None  # a step being written has no files yet
    assert st.restore.state == "planning" and st.restore.fields["missing"] == [2]
    assert st.job is not None and st.job.state == "planning"
    assert st.usage is not None and st.usage.snapshot_bytes == 4096
    assert st.usage.replica_bytes == 1024 and st.usage.counted_at == round(
        status_state.NOW - 2.34567, 3
    )
    assert [(r.rank, r.step, r.bytes) for r in st.replicas] == [(1, 20, 333)]
    assert st.peer.replicate_to == (1, 2) and st.peer.coordinator_state is not None
    assert [p.live for p in st.peer.peers] == [True, False]
    upload = st.gcs.uploads[0]
    assert (upload.bytes_done, upload.bytes_total, upload.attempt) == (500, 2000, 2)
    assert [r.state for r in st.gcs.rounds] == ["complete", "running"]


def test_the_status_file_is_the_typed_status_as_json(tmp_path):
    parts = status_state.build_state(tmp_path)
    text = parts.agent.status_json()
    data = json.loads(text)
    assert text.endswith(b"}\n") and list(data) == sorted(data)  # sort_keys, as before
    assert NodeStatus.from_json(data).peer is not None
    assert data["tiers"]["peer"]["steps"][0]["peers"] == {"1": "replicated", "2": "failed"}


def test_the_off_gcs_tier_has_three_keys():
    assert BackupStatus.off().to_json() == {
        "summary": "off (no --bucket)",
        "enabled": False,
        "steps": [],
    }
    assert BackupStatus.from_json(BackupStatus.off().to_json()) == BackupStatus.off()


def test_typed_reads_of_a_real_status():
    st = NodeStatus.from_json(load(DATA / "daemon-coordinator-uploading.json"))
    assert st.peer is not None and st.peer.is_coordinator
    coord = st.peer.coordinator_state
    assert coord is not None and coord.backups is not None and coord.backups.rounds
    assert coord.round is not None and coord.round.joined == (0, 1, 2, 3)
    assert coord.sync.steps == {0: 3, 1: 3, 2: 3, 3: 3} and coord.members[3].shards == 5
    assert st.gcs is not None and st.gcs.uploads and st.gcs.role == "decides rounds"
    assert st.budget.mode == "native" and st.filesystem is not None
    forced = NodeStatus.from_json(load(DATA / "daemon-restored-from-gcs-forced.json"))
    assert forced.restore.source == "gcs" and forced.restore.backup
    assert forced.gcs is not None and forced.gcs.restore_version_pending is not None


def test_reading_is_lenient_with_missing_keys():
    st = NodeStatus.from_json({"mountpoint": "/m", "steps": [{"step": 1}], "errors": ["x"]})
    assert st.mountpoint == "/m" and st.errors == ("x",) and st.job is None
    assert st.steps == (StepStatus(1, "", None),)
    assert st.usage is None and st.filesystem is None and st.tiers == {}
    assert st.restore.state is None and st.restore.problems == ()
    # statvfs failed: ``{}`` in the JSON, None typed, ``{}`` again when written
    assert NodeStatus.from_json({"filesystem": {}}).to_json()["filesystem"] == {}


def test_a_daemon_from_before_tiers_had_them_at_the_top():
    st = NodeStatus.from_json({"peer": {"summary": "old peer"}, "gcs": {"summary": "old gcs"}})
    assert st.peer is not None and st.peer.summary == "old peer"
    assert st.gcs is not None and st.gcs.summary == "old gcs"
    assert any(line == "peer       old peer" for line in format_status(st))


@pytest.mark.parametrize(
    "bad", [[], "status", 3, None, {"budget": [1]}, {"tiers": "x"}, {"restore": "done"}]
)
def test_a_status_that_is_not_an_object_is_refused(bad):
    with pytest.raises(StatusFormatError):
        NodeStatus.from_json(bad)


def test_unknown_tiers_are_left_out():
    assert NodeStatus.from_json({"tiers": {"s3": {"summary": "?"}}}).tiers == {}


def test_restore_status_keeps_every_key():
    fields = {"state": "barrier", "step": 7, "source": "peer", "since": 1.5, "round": 3}
    r = RestoreStatus.from_json(fields)
    assert r.to_json() == fields and r.step == 7 and r.source == "peer"
    assert (r.outcome, r.phase, r.backup) == (None, None, None)


def test_text_lines_are_the_same_from_typed_and_from_json():
    data = load(DATA / "daemon-coordinator-uploading.json")
    lines = format_status(NodeStatus.from_json(data))
    assert lines == format_status(data)
    assert lines[0] == "mount      /ckpt/node  (pid {}, ram-dir /dev/shm/tierfs-node)".format(
        data["pid"]
    )
    assert any(line.startswith("peers      1@127.0.0.1:") for line in lines), lines


def test_wait_reads_a_typed_restore():
    restore = NodeStatus.from_json(load(DATA / "daemon-restored-from-gcs-forced.json")).restore
    code, line = wait_outcome(restore)
    assert code == 0 and line == f"restored step {restore.step} from GCS round {restore.backup}"
    assert wait_outcome(restore) == wait_outcome(dict(restore.fields))


def test_the_csi_driver_reads_a_typed_status(tmp_path):
    ctl = tmp_path / ".tierfs"
    ctl.mkdir()
    assert read_status(str(tmp_path)) is None  # nothing there
    (ctl / "status.json").write_text("[1, 2]")
    assert read_status(str(tmp_path)) is None  # not an object
    (ctl / "status.json").write_text("{not json")
    assert read_status(str(tmp_path)) is None
    (ctl / "status.json").write_text(json.dumps({"pid": 42, "ram_dir": "/dev/shm/x"}))
    st = read_status(str(tmp_path))
    assert st is not None and st.pid == 42 and st.ram_dir == "/dev/shm/x"


def test_the_demo_watcher_reads_the_typed_status(tmp_path):
    from tierfs.demo.report import StatusWatcher, Timeline

    timeline = Timeline(tmp_path / "timeline.jsonl")
    demo = SimpleNamespace(config=SimpleNamespace(nodes=1), timeline=timeline, nodes=[])
    watcher = StatusWatcher(demo)  # type: ignore[arg-type]
    st = NodeStatus.from_json(load(DATA / "daemon-restored-from-gcs-forced.json"))
    watcher._observe(0, st)
    watcher._observe(0, st)  # nothing new: no event twice
    kinds = [(e["kind"], e.get("step")) for e in timeline.events]
    restore = st.restore
    assert ("restored", restore.step) in kinds and len(kinds) == len(set(kinds))
    restored = next(e for e in timeline.events if e["kind"] == "restored")
    assert restored["source"] == f"GCS round {restore.backup}"
    assert {k for k, _ in kinds} >= {"sealed", "restored"}


# ---------------------------------------------------------------------- the coordinator


def written_bytes(data: object) -> bytes:
    """JSON as the agent writes the status (sorted keys, ``default=str``)."""
    return json.dumps(data, sort_keys=True, default=str).encode()


COORDINATED = [p for p in sorted(DATA.glob("*.json")) if "coordinator_state" in p.read_text()]


def test_some_goldens_have_a_coordinator():
    assert {p.name for p in COORDINATED} >= {"built-node.json", "daemon-coordinator-uploading.json"}


@pytest.mark.parametrize("path", COORDINATED, ids=lambda p: p.stem)
def test_the_coordinator_status_reads_back_and_writes_the_same_bytes(path):
    golden = load(path)["tiers"]["peer"]["coordinator_state"]
    typed = CoordinatorStatus.from_json(golden)
    assert written_bytes(typed.to_json()) == written_bytes(golden)
    assert CoordinatorStatus.from_json(json.loads(written_bytes(typed.to_json()))) == typed


def test_a_coordinator_status_round_trips_through_its_json():
    status = CoordinatorStatus(
        job="job",
        nodes=12,
        round=CoordinatorRoundStatus(
            number=2,
            state="ready",
            strict=True,
            joined=tuple(range(12)),
            version=3,
            step=40,
            reason="newest step every node holds",
            outcome="restored",
            problems=("node-rank 3: one copy bad",),
            ready=(0, 1, 10),
            bad=((3, 3, 40), ("gcs", 3, 40)),
            bucket="2 round(s) read",
            age_seconds=1.5,
        ),
        members=(CoordinatorMemberStatus(0, "10.0.0.1:7000", True, 0.2, 40, 6),),
        sync=CoordinatorSyncStatus(step=40, at=1796172298.5, steps={2: 40, 10: 40, 0: 30}),
        decisions=({"round": 1, "version": 1, "step": None, "outcome": "fresh", "at": 1.0},),
        backups=BackupBookStatus(
            seeded=True,
            active=ActiveBackupStatus(
                round="2026-12-02_00-46",
                step=40,
                reported=(0, 1),
                moved_from=(30,),
                lacking={10: "step 40 is not held", 2: "gone"},
                dedup=(1,),
            ),
            last_round="2026-12-02_00-46",
            last_step=40,
            last_decision="1 step(s) since the last round",
            rounds=({"round": "2026-12-02_00-46", "step": 40, "state": "running"},),
        ),
    )
    text = written_bytes(status.to_json())
    back = CoordinatorStatus.from_json(json.loads(text))
    assert back == status
    assert written_bytes(back.to_json()) == text
    # rank-keyed objects: the book's int keys in numeric order, the sync's text keys
    assert b'"lacking": {"2": "gone", "10": "step 40 is not held"}' in text
    assert b'"steps": {"0": 30, "10": 40, "2": 40}' in text
    # inside the peer tier and the node status, the same JSON
    peer = PeerStatus(summary="p", coordinator_state=status)
    assert peer.to_json()["coordinator_state"] == status.to_json()
    assert PeerStatus.from_json(json.loads(written_bytes(peer.to_json()))) == peer


def test_no_coordinator_state_off_the_coordinator():
    peer = PeerStatus(summary="p")
    assert "coordinator_state" not in peer.to_json()
    assert PeerStatus.from_json(peer.to_json()).coordinator_state is None
    assert CoordinatorStatus.from_json({}) == CoordinatorStatus()


def test_bytes_beyond_a_stale_count_are_not_all_called_other_programs():
    """#14 trials 49 F5.4 and 51: right after a save, "912.1 MiB used by other
    programs" were tierfs's own files, written after its count 2 s ago."""
    from tierfs.cli.status import others_phrase

    assert others_phrase(100 << 20, 0.4) == "100.0 MiB used by other programs"
    assert others_phrase(912 << 20, 2.0) == (
        "912.0 MiB used by other programs or written since tierfs's count 2 s ago"
    )
    assert others_phrase(0, 3.0) == "0 B used by other programs"
