"""bench/uring's spike daemon gives the same answers over /dev/fuse and over FUSE-over-io_uring.

The spike (bench/uring/spikefs.py, docs/BENCHMARKS.md "FUSE over io_uring")
is not tierfs's mount path; this keeps its io_uring transport honest: the
requests must really travel over the ring (the daemon's counts say which
transport served each opcode) and answer bytes, sizes and errno values
exactly as over /dev/fuse. ``enable_uring`` is set to Y only until the
mount's INIT is answered (the kernel checks it there; the connection keeps
io_uring afterwards) and then put back.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from gcs_cluster import wait_for

SPIKE = Path(__file__).resolve().parents[2] / "bench" / "uring" / "spikefs.py"
ENABLE = Path("/sys/module/fuse/parameters/enable_uring")
#: serialises the tests that set ENABLE (a global kernel parameter)
LOCK = "/tmp/tierfs-uring-spike.lock"


class Spike:
    """A running spikefs mount: its ``mode`` (dev, uring), ``path``, ``stats`` file, ``proc``."""

    def __init__(self, mode: str, path: Path, stats: Path, proc: subprocess.Popen[bytes]) -> None:
        self.mode, self.path, self.stats, self.proc = mode, path, stats, proc

    def unmount(self) -> dict[str, int]:
        """Unmount, wait for the daemon (exit status 0) and return its request counts."""
        subprocess.run(["umount", str(self.path)], check=True)
        assert self.proc.wait(timeout=30) == 0
        return json.loads(self.stats.read_text())


@pytest.fixture(params=["dev", "dev-pinned", "uring", "uring-pinned"])
def spike(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Spike]:
    mode, _, pinned = request.param.partition("-")
    if mode == "uring" and not ENABLE.exists():
        pytest.skip("kernel without FUSE over io_uring (no enable_uring parameter)")
    mnt, stats = tmp_path / "mnt", tmp_path / "stats.json"
    mnt.mkdir()
    # enable_uring is global: one test at a time sets it, from before its mount until its
    # INIT is answered (xdist workers run these in parallel; a lock file serialises them)
    lock = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    old = ENABLE.read_text().strip() if ENABLE.exists() else None
    if mode == "uring":
        try:
            ENABLE.write_text("Y")
        except OSError as exc:  # e.g. a read-only /sys in a container
            os.close(lock)
            pytest.skip(f"cannot set {ENABLE}: {exc}")
    cmd = [
        sys.executable,
        str(SPIKE),
        str(mnt),
        "--mode",
        mode,
        "--files",
        "5",
        "--stats",
        str(stats),
    ]
    proc = subprocess.Popen(cmd + (["--pinned"] if pinned else []))
    try:
        wait_for(lambda: os.path.ismount(mnt) or proc.poll() is not None, 30, "spikefs mount")
        assert proc.poll() is None, f"spikefs exited {proc.returncode}"
        os.stat(mnt / "pre")  # answered only once INIT is (and, over io_uring, the ring is ready)
    finally:
        try:
            if old is not None and mode == "uring":
                ENABLE.write_text(old)
        finally:
            os.close(lock)  # releases the flock
    spike = Spike(mode, mnt, stats, proc)
    yield spike
    if os.path.ismount(mnt):
        subprocess.run(["umount", "-l", str(mnt)], check=False)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_same_answers_over_either_transport(spike: Spike) -> None:
    st = os.stat(spike.path / "pre" / "f000002")
    assert stat.S_ISREG(st.st_mode) and st.st_size == 0
    assert st.st_ino == 5  # root 1, pre 2, f000000 3: node ids in creation order
    new = spike.path / "new.bin"
    fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
    assert os.write(fd, b"x" * 4096) == 4096
    os.close(fd)
    st = os.stat(new)
    assert (st.st_size, stat.S_IMODE(st.st_mode)) == (4096, 0o640)
    with pytest.raises(FileExistsError):
        os.open(new, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    with pytest.raises(OSError) as exc:
        os.getxattr(new, "user.x")
    assert exc.value.errno == errno.ENODATA
    os.unlink(new)
    with pytest.raises(FileNotFoundError):
        os.stat(new)
    counts = spike.unmount()
    mode = spike.mode
    served = {key.split(":", 1)[0] for key, n in counts.items() if n and "FORGET" not in key}
    assert served == {mode}, counts
    assert counts[f"{mode}:CREATE"] == 1 and counts[f"{mode}:UNLINK"] == 1
    assert counts[f"{mode}:GETATTR"] >= 1 and counts[f"{mode}:LOOKUP"] >= 2
