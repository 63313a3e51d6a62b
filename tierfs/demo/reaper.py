"""The demo's reaper: stops what ``tierfs demo`` started when the demo dies without cleanup.

A demo ended by SIGKILL (or the OOM killer) runs none of its own cleanup; the
emulator goes through its parent-death signal, but the node daemons are
started by ``tierfs mount`` (they outlive their caller by design) and the
trainers are plain children. So the demo starts this small process first and
tells it, one line at a time on its stdin, what to undo:

* ``mount PATH``: a tierfs mount of the demo (``tierfs unmount --lazy PATH``,
  which also stops its daemon);
* ``pid PID MARK``: a trainer process, killed only while its command line
  still contains ``MARK`` (a reused pid is left alone);
* ``rmtree PATH``: a directory removed last (the demo's RAM under /dev/shm);
* ``done``: the demo cleaned up itself; exit without doing anything.

End of file without ``done`` means the demo is gone (the kernel closes the
pipe when its last writer dies, however it died): the reaper undoes
everything it was told and exits. The demo's children never inherit the pipe
(``subprocess`` closes other descriptors), so only the demo's death ends it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from typing import IO

from tierfs import command

#: how long one ``tierfs unmount`` may take (seconds)
UNMOUNT_TIMEOUT = 60.0


class Orders:
    """What the reaper undoes, in the order it was told (plain data)."""

    def __init__(self) -> None:
        self.mounts: list[str] = []
        self.pids: list[tuple[int, str]] = []
        self.trees: list[str] = []
        self.released = False

    def take(self, line: str) -> None:
        """Record one order line; unknown or malformed lines are ignored."""
        verb, _, rest = line.strip().partition(" ")
        if verb == "mount" and rest:
            self.mounts.append(rest)
        elif verb == "pid":
            pid, _, mark = rest.partition(" ")
            if pid.isdigit() and mark:
                self.pids.append((int(pid), mark))
        elif verb == "rmtree" and rest:
            self.trees.append(rest)
        elif verb == "done":
            self.released = True


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def undo(orders: Orders) -> None:
    """Kill the trainers, unmount the mounts (stopping their daemons), remove the trees."""
    for pid, mark in orders.pids:
        if mark.encode() in _cmdline(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for mount in orders.mounts:
        try:
            subprocess.run(
                command("unmount", mount, "--lazy"),
                capture_output=True,
                timeout=UNMOUNT_TIMEOUT,
                check=False,
            )
        except subprocess.TimeoutExpired:
            subprocess.run(["umount", "-l", mount], capture_output=True, check=False)
    for tree in orders.trees:
        shutil.rmtree(tree, ignore_errors=True)


def serve(stream: IO[str]) -> Orders:
    """Read orders until ``done`` or end of file; undo them at end of file."""
    orders = Orders()
    for line in stream:
        orders.take(line)
        if orders.released:
            return orders
    undo(orders)
    return orders


class Reaper:
    """The demo's handle on its reaper process.

    Every method is a no-op once the reaper could not be started or was
    released; a failed write (the reaper died) is ignored: the demo's own
    cleanup still runs on every way out it can see.
    """

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        """Start the reaper (its own session: a Ctrl-C to the demo's group spares it)."""
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "tierfs.demo.reaper"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )

    def _tell(self, line: str) -> None:
        if self.proc is None or self.proc.stdin is None:
            return
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass

    def mount(self, path: str) -> None:
        """Unmount ``path`` (and stop its daemon) should the demo die."""
        self._tell(f"mount {path}")

    def pid(self, pid: int, mark: str) -> None:
        """Kill ``pid`` should the demo die, if its command line still holds ``mark``."""
        self._tell(f"pid {pid} {mark}")

    def rmtree(self, path: str) -> None:
        """Remove ``path`` should the demo die (after the unmounts)."""
        self._tell(f"rmtree {path}")

    def release(self) -> None:
        """The demo cleaned up: let the reaper exit without undoing anything."""
        if self.proc is None:
            return
        self._tell("done")
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only end of file or "done" ends it
    serve(sys.stdin)
