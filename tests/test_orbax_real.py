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

CLIENT = Path(__file__).parent / "clients" / "orbax_mtc.py"



def run_client(directory: Path, phase: str, expected: Path, *steps: int) -> str:
    proc = subprocess.run([sys.executable, str(CLIENT), str(directory), phase, str(expected),
                           *map(str, steps)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"orbax client failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    return proc.stdout


def sealed_steps(d: Path) -> set[int]:
    status = json.loads((d / ".tierfs" / "status.json").read_text())
    return {s["step"] for s in status["steps"] if s["state"] in ("sealed", "verified")}


@pytest.mark.slow
def test_orbax_replicator_checkpoint_manager_saves_and_restores(make_mount, tmp_path):
    m = make_mount("--process-id", "0", "--jax-coordinator", f"localhost:{free_port()}")
    d = m.path
    expected = tmp_path / "expected.npz"
    out = run_client(d, "save", expected, 1, 2, 3)
    assert "LATEST None" in out
    wait_for(lambda: {1, 2, 3} <= sealed_steps(d) or sealed_steps(d) >= {2, 3}, 30,
             "steps sealed")
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
