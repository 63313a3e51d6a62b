"""A real torch.distributed.checkpoint save loop through the PyTorch/NeMo side of the protocol."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mtc_clients import wait_for

CLIENT = Path(__file__).resolve().parents[1] / "support" / "clients" / "dcp_mtc.py"


def run(d: Path, steps: int, expected: Path) -> str:
    proc = subprocess.run(
        [sys.executable, str(CLIENT), str(d), str(steps), str(expected)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"client failed:\n{proc.stdout}\n{proc.stderr[-5000:]}"
    return proc.stdout


def sealed(d: Path) -> set[int]:
    st = json.loads((d / ".tierfs" / "status.json").read_text())
    return {s["step"] for s in st["steps"] if s["state"] in ("sealed", "verified")}


@pytest.mark.long
@pytest.mark.slow
def test_dcp_training_loop_resumes_from_the_newest_step(make_mount, tmp_path):
    m = make_mount()
    d = m.path
    expected = tmp_path / "model.pt"
    out = run(d, 4, expected)
    assert "SAVED 4" in out and "RESTORED_OK" not in out
    wait_for(lambda: {3, 4} <= sealed(d), 30, "steps 3 and 4 sealed")
    out = run(d, 2, expected)  # the trainer restarts: resumes from step 4
    assert "RESTORED_OK 4 4" in out and "SAVED 6" in out
    wait_for(lambda: {5, 6} <= sealed(d), 30, "steps 5 and 6 sealed")
    m.kill9()
    m.mount()
    out = run(d, 1, expected)  # after a daemon crash too
    assert "RESTORED_OK 6 6" in out and "SAVED 7" in out
