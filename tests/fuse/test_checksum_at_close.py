"""Checksums at close on a real mount (issue #18 item 1): a big file is read for
its crc32c as its writer closes it, also when its step directory is renamed at
once (:mod:`tierfs.node.crc_ahead`)."""

from __future__ import annotations

import errno
import json
import os
import time

import pytest
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


def _daemon_readers(m, name: str) -> int:
    """Descriptors of the daemon open on ``name`` for reading (not its O_PATH ones)."""
    n = 0
    fds = f"/proc/{m.pid()}/fd"
    for fd in os.listdir(fds):
        try:
            if not os.readlink(f"{fds}/{fd}").startswith(str(m.ram_dir)):
                continue
            if name not in os.readlink(f"{fds}/{fd}"):
                continue
            with open(f"/proc/{m.pid()}/fdinfo/{fd}") as f:
                flags = int(f.read().split("flags:")[1].split()[0], 8)
        except (OSError, ValueError, IndexError):
            continue
        if not flags & 0o10000000:  # O_PATH
            n += 1
    return n


def _fill(path) -> int:
    """Write zeros to ``path`` until ENOSPC; returns the bytes written."""
    written = 0
    with open(path, "wb", buffering=0) as f:
        for size in (1 << 20, 64 << 10, 4 << 10):
            try:
                while True:
                    written += f.write(b"\0" * size) or 0
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    return written


@pytest.mark.parametrize("when", ["at_once", "while_read"])
def test_a_removed_file_s_ram_is_free_when_its_unlink_returns(make_mount, when):
    """Regression (fault campaign seed 19 #6 and #13, 7 December 2026): a trainer filled
    the RAM budget, closed and removed the file and wrote again at once: ENOSPC. The
    checksum at close held the file open (also while waiting for the clock), and the
    inode table's descriptor held it until the kernel forgot the inode, after the
    unlink was answered. Checked with the unlink right after the close and while the
    checksum at close is reading the file."""
    m = make_mount("--size", "256MiB")  # big enough for the read to be caught under way
    for round_ in range(3):
        filler = m.path / "filler.bin"
        written = _fill(filler)
        assert written > 200 << 20
        if when == "while_read":
            deadline = time.monotonic() + 30
            while _daemon_readers(m, "filler.bin") == 0:
                assert time.monotonic() < deadline, "the checksum at close never read the file"
        os.unlink(filler)
        sv = os.statvfs(m.path)
        assert sv.f_bavail * sv.f_frsize >= written - (1 << 20), (round_, sv)
        with open(m.path / "next.bin", "wb") as f:  # the next save finds the room
            f.write(os.urandom(written - (1 << 20)))
        os.unlink(m.path / "next.bin")
