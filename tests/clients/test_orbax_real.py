"""The real Orbax MTC client (jax + orbax-checkpoint on CPU), unmodified, on a tierfs mount."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mtc_clients import wait_for

from tierfs.demo.emulator import free_port

CLIENT = Path(__file__).resolve().parents[1] / "support" / "clients" / "orbax_mtc.py"


def run_client(directory: Path, phase: str, expected: Path, *steps: int) -> str:
    proc = subprocess.run(
        [sys.executable, str(CLIENT), str(directory), phase, str(expected), *map(str, steps)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"orbax client failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    return proc.stdout


def sealed_steps(d: Path) -> set[int]:
    status = json.loads((d / ".tierfs" / "status.json").read_text())
    return {s["step"] for s in status["steps"] if s["state"] in ("sealed", "verified")}


@pytest.mark.long
@pytest.mark.slow
def test_orbax_replicator_checkpoint_manager_saves_and_restores(make_mount, tmp_path):
    m = make_mount("--process-id", "0", "--jax-coordinator", f"localhost:{free_port()}")
    d = m.path
    expected = tmp_path / "expected.npz"
    out = run_client(d, "save", expected, 1, 2, 3)
    assert "LATEST None" in out
    wait_for(lambda: {1, 2, 3} <= sealed_steps(d) or sealed_steps(d) >= {2, 3}, 30, "steps sealed")
    # process exit + restart: Orbax restores step 3 through the marker
    out = run_client(d, "restore", expected, 4, 5, 6)
    assert "RESTORED_OK 3" in out
    wait_for(lambda: {5, 6} <= sealed_steps(d), 30, "steps 5 and 6 sealed")
    # Orbax's own LatestN(2) deleted the restored step 3 and step 4 without error
    assert not (d / "3").exists() and not (d / "4").exists()
    # the daemon is killed and mounted again: the newest step comes back
    m.kill9()
    m.mount()
    out = run_client(d, "restore", expected)
    assert "RESTORED_OK 6" in out
    assert os.path.isdir(d / "6")


def run_clients(
    dirs: list[Path],
    phase: str,
    expected: list[Path],
    *steps: int,
    dp: int = 2,
    backup_steps: int = 1,
) -> list[str]:
    """One real Orbax process per node at once (a JAX job of len(dirs) processes)."""
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(CLIENT),
                "--data-parallelism",
                str(dp),
                "--backup-steps",
                str(backup_steps),
                str(d),
                phase,
                str(expected[i]),
                *map(str, steps),
            ],
            env={
                **os.environ,
                "OMPI_COMM_WORLD_SIZE": str(len(dirs)),
                "OMPI_COMM_WORLD_RANK": str(i),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, d in enumerate(dirs)
    ]
    outs = []
    for i, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, f"orbax process {i} failed:\n{out}\n{err[-6000:]}"
        outs.append(out)
    return outs


@pytest.mark.long
@pytest.mark.slow
def test_orbax_two_processes_sharded_with_data_parallelism_restore_from_bucket(
    make_mount, fake_gcs, tmp_path, monkeypatch
):
    """issue 19 cases 1 and 2, the exact input: two nodes, the real Orbax MTC client in
    two JAX processes, ``assume-data-parallelism: 2`` and ``backup-interval-steps: 1``,
    arrays sharded across the processes (the two nodes' step directories differ),
    steps 1-3 saved back to back; both daemons killed, both RAM stores wiped. The
    restart restores step 3 from the bucket with the right bytes on both nodes
    (before: node 0's pointer named a data object never uploaded, and the restart
    published the empty s0 marker)."""
    from gcs_cluster import backed_up, errors
    from peer_cluster import Cluster

    from tierfs.backup.bucket import GcsBackend

    monkeypatch.setenv("TIERFS_GCS_TICK", "0.5")
    jax_port = free_port()
    c = Cluster(
        make_mount,
        2,
        extra=("--bucket", fake_gcs.bucket, "--keep-local", "1"),
        node_args=lambda i: ["--process-id", str(i), "--jax-coordinator", f"127.0.0.1:{jax_port}"],
    )
    dirs = [c.root(i) for i in range(2)]
    expected = [tmp_path / f"expected{i}.npz" for i in range(2)]
    outs = run_clients(dirs, "save", expected, 1, 2, 3)
    assert all("LATEST None" in o for o in outs)
    for i in range(2):
        wait_for(lambda i=i: backed_up(dirs[i], 3), 120, f"node {i}: step 3 backed up")
    g = GcsBackend(fake_gcs.bucket)
    rounds = g.list_rounds("orbaxjob")
    newest = next(r for r in rounds if r.complete)
    assert newest.complete_step == 3, [(r.name, r.complete_step, r.problems()) for r in rounds]
    # the two ranks' bytes differ: each uploaded its own data, and said why
    hashes = {r: e.backup.hashes[0] for (r, s), e in newest.parts.items() if s == 3}
    assert hashes[0] != hashes[1]
    assert "assume-data-parallelism" in errors(dirs[0]) + errors(dirs[1])
    # no round is left half-written (case 2): every round is complete
    assert all(r.complete for r in rounds), [(r.name, r.problems()) for r in rounds]

    for i in range(2):
        c.lose(i)
    for i in range(2):
        c.remount(i)
    outs = run_clients(dirs, "restore", expected)
    for i, o in enumerate(outs):
        assert "RESTORED_OK 3" in o, f"node {i}:\n{o}\n{c.logs()}"
