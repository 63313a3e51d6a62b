"""The node's tierfs mount, kept up for the CSI driver by running ``tierfs mount``.

``tierfs csi`` owns one tierfs mount per node (DESIGN.md "Kubernetes");
every published volume is a bind mount of it. The mount is started through
the ordinary CLI (``tierfs mount MOUNTPOINT --ram-dir ...``), so the daemon
runs exactly as on a VM, in its own session: it outlives a driver restart,
and a restarted driver adopts the running mount instead of starting another.
A daemon that died (the mount answers ENOTCONN) is mounted again; ``tierfs
mount`` clears the dead mount first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import subprocess
import sys
import threading
from typing import Any

from tierfs.csi import mounts

log = logging.getLogger("tierfs.csi")

STATUS_FILE = os.path.join(".tierfs", "status.json")
MOUNT_TIMEOUT = 150.0
PR_SET_CHILD_SUBREAPER = 36


def read_status(mountpoint: str) -> dict[str, Any] | None:
    """The daemon's ``.tierfs/status.json`` read through the mount, or None.

    None when nothing answers at ``mountpoint`` (not mounted, a dead mount,
    not tierfs) or the file does not hold a JSON object.
    """
    try:
        with open(os.path.join(mountpoint, STATUS_FILE), "rb") as f:
            data = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (prctl(2)).

    ``tierfs mount`` starts the daemon in a new session and exits, so the
    daemon is re-parented: to this process once it is a subreaper, exactly
    as it would be to a container's PID 1. Either way this process must reap
    a daemon that died, or its zombie would keep its pid "alive" and block
    the next ``tierfs mount`` ("ram-dir in use"). See :meth:`SupervisedMount.reap`.

    Returns:
        True on success (Linux), False where prctl is unavailable.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class SupervisedMount:
    """Keeps a tierfs mount up at ``mountpoint`` (the CSI servicer's :class:`NodeMount`).

    Args:
        mountpoint: node-level mountpoint (created if missing).
        mount_args: arguments after ``tierfs mount MOUNTPOINT`` (``--ram-dir``, ``-o``, ...).
        check_interval: seconds between health checks once the mount is up.
        max_backoff: longest wait, in seconds, between failed mount attempts
            (the wait doubles from 1 s).
        env: extra environment for ``tierfs mount`` (e.g. ``TIERFS_PEER_TOKEN``, which
            is kept off the command line).
        ram_dir: the ram-dir ``mount_args`` name (``--ram-dir`` or ``ramDir`` of
            ``--config``), if known; see :meth:`ram_dirs`.
    """

    def __init__(self, mountpoint: str, mount_args: list[str], check_interval: float = 5.0,
                 max_backoff: float = 60.0, env: dict[str, str] | None = None,
                 ram_dir: str | None = None) -> None:
        self.mountpoint = os.path.abspath(mountpoint)
        self.mount_args = list(mount_args)
        self.env = dict(env or {})
        self.ram_dir = os.path.realpath(ram_dir) if ram_dir else None
        self._status_ram_dir: str | None = None
        self.check_interval = check_interval
        self.max_backoff = max_backoff
        self._error: str | None = None
        self._daemon_pid: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ NodeMount

    def ready(self) -> bool:
        """True if a tierfs mount answers at the mountpoint (its status file is readable)."""
        entry = mounts.top_mount(self.mountpoint)
        if entry is None or not entry.fstype.startswith("fuse"):
            return False
        try:
            with open(os.path.join(self.mountpoint, STATUS_FILE), "rb") as f:
                data = f.read()
        except OSError:
            return False
        try:
            status = json.loads(data)
        except ValueError:
            status = None
        if isinstance(status, dict):
            if isinstance(status.get("pid"), int):
                self._daemon_pid = status["pid"]
            if isinstance(status.get("ram_dir"), str):
                self._status_ram_dir = status["ram_dir"]
        return True

    def ram_dirs(self) -> list[str]:
        """The ram-dirs behind the mount: the configured one and the one the daemon reports.

        They differ when an adopted daemon was started with another
        ``--ram-dir``; no volume may be published in either.
        """
        status = read_status(self.mountpoint)
        if status is not None and isinstance(status.get("ram_dir"), str):
            self._status_ram_dir = status["ram_dir"]
        return [d for d in dict.fromkeys((self.ram_dir, self._status_ram_dir)) if d]

    def reap(self) -> None:
        """Collect the exit status of the last daemon if it died and is this process's child.

        Only that pid is waited for, never ``-1``: ``subprocess`` keeps the
        exit status of the children it runs.
        """
        pid = self._daemon_pid
        if pid is None:
            return
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not our child, or already collected
            self._daemon_pid = None
            return
        if done:
            log.warning("the tierfs daemon (pid %d) exited with status %d", pid,
                        os.waitstatus_to_exitcode(status))
            self._daemon_pid = None

    def error(self) -> str | None:
        """Why the last mount attempt failed, until one succeeds; None otherwise."""
        return None if self.ready() else self._error

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the supervising thread (returns at once; :meth:`ready` tells when mounted)."""
        self._thread = threading.Thread(target=self._run, name="tierfs-node-mount", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop supervising (the mount itself stays; see :meth:`unmount_if_unused`)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _run(self) -> None:
        backoff = 1.0
        while not self._stop.is_set():
            if self.ready():
                self._error = None
                backoff = 1.0
                self._stop.wait(self.check_interval)
                continue
            self.reap()
            err = self.mount_once()
            if err is None:
                backoff = 1.0
                continue
            self._error = err
            log.error("mounting tierfs at %s failed (retrying in %.0fs): %s", self.mountpoint,
                      backoff, err)
            self._stop.wait(backoff)
            backoff = min(backoff * 2, self.max_backoff)

    def mount_once(self) -> str | None:
        """Run ``tierfs mount`` once; returns None on success, else its error line."""
        try:
            os.makedirs(self.mountpoint, exist_ok=True)
        except FileExistsError:
            pass  # a dead FUSE mount (ENOTCONN on stat): `tierfs mount` clears it
        except OSError as exc:
            return f"cannot create {self.mountpoint}: {exc.strerror}"
        argv = [sys.executable, "-m", "tierfs", "mount", self.mountpoint, *self.mount_args]
        log.info("starting the node's tierfs mount: tierfs mount %s %s", self.mountpoint,
                 " ".join(_redact_argv(self.mount_args)))
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=MOUNT_TIMEOUT,
                                  stdin=subprocess.DEVNULL, check=False,
                                  env={**os.environ, **self.env})
        except subprocess.TimeoutExpired:
            return f"tierfs mount did not return within {MOUNT_TIMEOUT:.0f}s"
        if proc.returncode == 0:
            log.info("node mount is up at %s", self.mountpoint)
            return None
        lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        return lines[-1].removeprefix("Error: ") if lines else f"exit status {proc.returncode}"

    def published(self) -> list[str]:
        """Mountpoints of the bind mounts of the node mount (the published volumes)."""
        node = mounts.top_mount(self.mountpoint)
        if node is None:
            return []
        return [e.mountpoint for e in mounts.bind_mounts_of(node)]

    def unmount_if_unused(self, timeout: float = 30.0) -> bool:
        """Unmount the node mount (``tierfs unmount``) unless volumes are still published.

        With published volumes the daemon is left running, so pods keep
        their checkpoints and the next driver adopts the mount.

        Returns:
            True if it was unmounted (or was not mounted).
        """
        if mounts.top_mount(self.mountpoint) is None:
            return True
        busy = self.published()
        if busy:
            log.info("leaving the node mount up: %d volume(s) published (%s)", len(busy),
                     ", ".join(busy[:5]))
            return False
        proc = subprocess.run([sys.executable, "-m", "tierfs", "unmount", self.mountpoint,
                               "--lazy", "--timeout", str(timeout)],
                              capture_output=True, text=True, check=False, timeout=timeout + 10)
        if proc.returncode != 0:
            log.error("unmounting %s: %s", self.mountpoint, proc.stderr.strip())
            return False
        log.info("node mount at %s unmounted", self.mountpoint)
        return True


def _redact_argv(args: list[str]) -> list[str]:
    """Hide the value of ``--peer-token`` in a logged command line."""
    out, hide = [], False
    for a in args:
        if hide:
            out.append("<redacted>")
            hide = False
        elif a == "--peer-token":
            out.append(a)
            hide = True
        elif a.startswith("--peer-token="):
            out.append("--peer-token=<redacted>")
        else:
            out.append(a)
    return out
