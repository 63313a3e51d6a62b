"""The README's quick-start `train.py`, run as written against a real mount."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from mtc_clients import wait_for

README = Path(__file__).resolve().parents[2] / "README.md"


def train_py(ckpt: Path) -> str:
    """The README's train.py (the python block that writes /ckpt), aimed at ``ckpt``."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    script = next(b for b in blocks if 'ckpt = "/ckpt"' in b)
    return script.replace('ckpt = "/ckpt"', f"ckpt = {str(ckpt)!r}")


def run(script: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_readme_train_py_bounds_ram_and_survives_a_crashed_save(make_mount, tmp_path):
    """Regression: the README's train.py kept every checkpoint-N/ in RAM forever and
    left tmp-checkpoint-N/ after a crash between makedirs and rename, so the next run
    died with FileExistsError. The failing input: a run that crashed while saving
    step 10 (tmp-checkpoint-10/ holds a partial model.pt)."""
    pytest.importorskip("torch")
    m = make_mount()
    script = tmp_path / "train.py"
    script.write_text(train_py(m.path))
    crashed = m.path / "tmp-checkpoint-10"
    crashed.mkdir()
    (crashed / "model.pt").write_bytes(b"PK\3\4 cut off")

    proc = run(script)
    assert proc.returncode == 0, proc.stderr
    names = sorted(p.name for p in m.path.iterdir() if not p.name.startswith("."))
    assert names == ["checkpoint-100", "checkpoint-90"]  # KEEP = 2, no tmp-* left

    proc = run(script)  # resumes from step 100
    assert proc.returncode == 0, proc.stderr
    names = sorted(p.name for p in m.path.iterdir() if not p.name.startswith("."))
    assert names == ["checkpoint-190", "checkpoint-200"]

    # what tierfs keeps: the snapshots of the two newest steps, nothing older
    from tierfs.cli.main import read_status

    wait_for(
        lambda: {s["step"] for s in read_status(str(m.path))["steps"]} == {190, 200},
        60,
        "retention to drop the older snapshots",
    )
