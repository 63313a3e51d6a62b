"""The demo's reaper (tierfs/demo/reaper.py): what it undoes, and when it does nothing."""

from __future__ import annotations

import io
import subprocess
import sys
import time

from tierfs.demo.reaper import Orders, serve


def _sleeper() -> subprocess.Popen[bytes]:
    """A process whose command line holds ``time.sleep`` (waited for: right after
    Popen returns, /proc/PID/cmdline can still be empty)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    deadline = time.monotonic() + 30
    while b"time.sleep" not in _cmdline(proc.pid):
        assert time.monotonic() < deadline, "the sleeper never showed its command line"
        time.sleep(0.01)
    return proc


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def _wait_exit(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            return code
        time.sleep(0.05)
    return None


def test_orders_ignore_malformed_lines():
    o = Orders()
    for line in ["mount", "pid x mark", "pid 12", "rmtree", "bogus 1", "pid 12 trainer", ""]:
        o.take(line)
    assert o.mounts == [] and o.trees == [] and o.pids == [(12, "trainer")]
    assert not o.released


def test_end_of_file_undoes_everything(tmp_path):
    tree = tmp_path / "ram"
    (tree / "node0").mkdir(parents=True)
    proc = _sleeper()
    try:
        orders = serve(io.StringIO(f"rmtree {tree}\npid {proc.pid} time.sleep\n"))
        assert orders.pids == [(proc.pid, "time.sleep")]
        assert _wait_exit(proc) == -9
        assert not tree.exists()
    finally:
        proc.kill()
        proc.wait()


def test_done_undoes_nothing(tmp_path):
    tree = tmp_path / "ram"
    tree.mkdir()
    proc = _sleeper()
    try:
        serve(io.StringIO(f"rmtree {tree}\npid {proc.pid} time.sleep\ndone\n"))
        assert proc.poll() is None
        assert tree.exists()
    finally:
        proc.kill()
        proc.wait()


def test_a_reused_pid_is_left_alone():
    """The pid of a trainer that exited may belong to another process by now: only
    a process whose command line still holds the mark is killed."""
    proc = _sleeper()
    try:
        serve(io.StringIO(f"pid {proc.pid} tierfs.demo.trainer\n"))
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
