"""Checksums at close on a real mount (issue #18 item 1): a big file is read for
its crc32c as its writer closes it, also when its step directory is renamed at
once (:mod:`tierfs.node.crc_ahead`)."""

from __future__ import annotations

import json
import os

from mtc_clients import wait_for


def _sealed(view, step: int) -> bool:
    try:
        st = json.loads((view / ".tierfs" / "status.json").read_text())
    except (OSError, ValueError):
        return False
    return any(s["step"] == step and s["state"] != "writing" for s in st["steps"])


def test_a_file_whose_step_is_renamed_right_after_its_close_is_checksummed_ahead(make_mount):
    """Regression (#18 run R): the read by the path of the close failed (ENOENT) once
    the trainer renamed tmp-checkpoint-N, and the seal read every byte again."""
    m = make_mount("--log-level", "debug")
    data = os.urandom(8 << 20)
    for step in (1, 2, 3):
        tmp = m.path / f"tmp-checkpoint-{step}"
        tmp.mkdir()
        with open(tmp / "part.bin", "wb") as f:
            f.write(data)
        os.rename(tmp, m.path / f"checkpoint-{step}")  # at once, as HF and NeMo do
        wait_for(lambda step=step: _sealed(m.path, step), 60, f"step {step} sealed")
        assert (m.path / f"checkpoint-{step}" / "part.bin").read_bytes() == data
    log = m.log()
    assert "No such file" not in log, log[-4000:]
    for step in (1, 2, 3):
        assert f"checkpoint-{step}/part.bin ahead of the seal ({8 << 20} bytes)" in log, log[-4000:]
