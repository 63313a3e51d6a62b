"""The node's tierfs mount, kept up for the CSI driver by running ``tierfs mount``.

``tierfs csi`` owns one tierfs mount per node (DESIGN.md "Kubernetes");
every published volume is a bind mount of it. The mount is started through
the ordinary CLI (``tierfs mount MOUNTPOINT --ram-dir ...``), so the daemon
runs exactly as on a VM, in its own session: it outlives a driver restart,
and a restarted driver adopts the running mount instead of starting another
(warning when the daemon's configuration differs from its flags:
:meth:`SupervisedMount.check_adopted`).
A daemon that died (the mount answers ENOTCONN) is mounted again; ``tierfs
mount`` clears the dead mount first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import json
import logging
import os
import secrets
import subprocess
import threading
from typing import Any

from tierfs import command
from tierfs.cli.status_file import read_status_file
from tierfs.core import retry
from tierfs.core.status import NodeStatus
from tierfs.csi import mounts

log = logging.getLogger("tierfs.csi")

MOUNT_TIMEOUT = 150.0
PR_SET_CHILD_SUBREAPER = 36


def read_status(mountpoint: str) -> NodeStatus | None:
    """The daemon's ``.tierfs/status.json`` read through the mount, or None
    (:func:`tierfs.cli.status_file.read_status_file`, with no time limit).

    None when nothing answers at ``mountpoint`` (not mounted, a dead mount,
    not tierfs) or the file does not hold a status (a JSON object).
    """
    try:
        data = read_status_file(mountpoint)
        return None if data is None else NodeStatus.from_json(data)
    except (OSError, ValueError):  # StatusFormatError is a ValueError
        return None


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
        record_path: a file (in the driver's state directory) where each mount
            this supervisor makes is described, so that a restarted driver can
            tell whether the daemon it adopts runs with its options; see
            :meth:`check_adopted`. None: no record, only the ram-dir is compared.
    """

    def __init__(
        self,
        mountpoint: str,
        mount_args: list[str],
        check_interval: float = 5.0,
        max_backoff: float = 60.0,
        env: dict[str, str] | None = None,
        ram_dir: str | None = None,
        record_path: str | None = None,
    ) -> None:
        self.mountpoint = os.path.abspath(mountpoint)
        self.record_path = record_path
        #: pid of the daemon this driver mounted (record written) or adopted (compared)
        self._settled_pid: int | None = None
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

    def _answering(self) -> NodeStatus | None:
        """The status of the tierfs daemon answering at the mountpoint, or None.

        None unless a FUSE filesystem is mounted there and its
        ``.tierfs/status.json`` is a JSON object naming the daemon's pid.
        """
        entry = mounts.top_mount(self.mountpoint)
        if entry is None or not entry.fstype.startswith("fuse"):
            return None
        status = read_status(self.mountpoint)
        if status is None or not isinstance(status.pid, int):
            return None
        self._daemon_pid = status.pid
        if isinstance(status.ram_dir, str):
            self._status_ram_dir = status.ram_dir
        return status

    def ready(self) -> bool:
        """True once a tierfs daemon answers at the mountpoint *and* this driver settled on it.

        Settled: the driver mounted it and wrote its record (:attr:`record_path`,
        written only after ``tierfs mount`` returned), or it found the daemon
        running and compared it with its own flags (:meth:`check_adopted`). A
        mount that already answers but is not settled yet is not ready: a
        kubelet (or a test) acting on "ready" must find the record there.
        A daemon with another pid than the settled one (it died and something
        else mounted again) is not ready until it is settled in turn.
        """
        status = self._answering()
        return status is not None and status.pid == self._settled_pid

    def ram_dirs(self) -> list[str]:
        """The ram-dirs behind the mount: the configured one and the one the daemon reports.

        They differ when an adopted daemon was started with another
        ``--ram-dir``; no volume may be published in either.
        """
        status = read_status(self.mountpoint)
        if status is not None and isinstance(status.ram_dir, str):
            self._status_ram_dir = status.ram_dir
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
            log.warning(
                "the tierfs daemon (pid %d) exited with status %d",
                pid,
                os.waitstatus_to_exitcode(status),
            )
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
        backoff = retry.csi_mount(self.max_backoff).backoff()  # policy csi-mount
        while not self._stop.is_set():
            status = self._answering()
            if status is not None:
                if status.pid != self._settled_pid:  # up, but not mounted by this driver
                    self.check_adopted()
                    self._settled_pid = status.pid
                self._error = None
                backoff.reset()
                self._stop.wait(self.check_interval)
                continue
            self.reap()
            err = self.mount_once()
            if err is None:
                backoff.reset()
                continue
            self._error = err
            delay = backoff.next()
            log.error(
                "mounting tierfs at %s failed (retrying in %.0fs): %s",
                self.mountpoint,
                delay,
                err,
            )
            self._stop.wait(delay)

    def mount_once(self) -> str | None:
        """Run ``tierfs mount`` once; returns None on success, else its error line."""
        try:
            os.makedirs(self.mountpoint, exist_ok=True)
        except FileExistsError:
            pass  # a dead FUSE mount (ENOTCONN on stat): `tierfs mount` clears it
        except OSError as exc:
            return f"cannot create {self.mountpoint}: {exc.strerror}"
        argv = command("mount", self.mountpoint, *self.mount_args)
        log.info(
            "starting the node's tierfs mount: tierfs mount %s %s",
            self.mountpoint,
            " ".join(_redact_argv(self.mount_args)),
        )
        try:
            proc = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                timeout=MOUNT_TIMEOUT,
                stdin=subprocess.DEVNULL,
                check=False,
                env={**os.environ, **self.env},
            )
        except subprocess.TimeoutExpired:
            return f"tierfs mount did not return within {MOUNT_TIMEOUT:.0f}s"
        if proc.returncode == 0:
            log.info("node mount is up at %s", self.mountpoint)
            # settled (ready) only once the record exists: mounted here, nothing to adopt
            self._settled_pid = self._write_record()
            return None
        lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        return lines[-1].removeprefix("Error: ") if lines else f"exit status {proc.returncode}"

    # ------------------------------------------------------------------ adoption

    def _fingerprint(self, salt: str) -> str:
        """A salted digest of everything the mount was asked for: the arguments, the
        environment (the peer token) and the ``--config`` file's contents."""
        path = None
        args = iter(self.mount_args)
        for arg in args:
            if arg == "--config":
                path = next(args, None)
            elif arg.startswith("--config="):
                path = arg.split("=", 1)[1]
        config = b""
        if path:
            try:
                with open(path, "rb") as f:
                    config = f.read()
            except OSError:
                config = b"<unreadable>"
        h = hashlib.sha256(salt.encode())
        h.update(json.dumps({"argv": self.mount_args, "env": self.env}, sort_keys=True).encode())
        h.update(hashlib.sha256(config).digest())
        return h.hexdigest()

    def _write_record(self) -> int | None:
        """Describe the mount just made (daemon pid, ram-dir, redacted arguments, and a
        salted digest of all of it, token included) in :attr:`record_path`.

        Returns:
            the pid of the daemon described (None if its status could not be read).
        """
        status = read_status(self.mountpoint) or NodeStatus()
        pid = status.pid if isinstance(status.pid, int) else None
        if self.record_path is None:
            return pid
        salt = secrets.token_hex(16)
        record = {
            "pid": status.pid,
            "ram_dir": status.ram_dir,
            "argv": _redact_argv(self.mount_args),
            "salt": salt,
            "digest": self._fingerprint(salt),
        }
        tmp = f"{self.record_path}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(self.record_path), mode=0o700, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(record, f)
            os.replace(tmp, self.record_path)
        except OSError as exc:
            log.warning(
                "cannot record the node mount's options in %s: %s",
                self.record_path,
                exc.strerror or exc,
            )
        return pid

    def _read_record(self) -> dict[str, Any] | None:
        if self.record_path is None:
            return None
        try:
            with open(self.record_path, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def check_adopted(self) -> list[str]:
        """Compare the running daemon this driver adopts with the driver's own options.

        The daemon keeps running with the configuration it was started with
        (it serves the pods' mounts); a difference is logged as a warning,
        never acted on. Compared: the ram-dir the daemon reports against the
        driver's; and, if the record of the mount (:attr:`record_path`) is
        about this very daemon (same pid), every argument, the peer token and
        the ``--config`` file's contents. Without such a record (state
        directory lost, daemon mounted by hand) only the ram-dir is compared,
        and a warning says so.

        Returns:
            the differences found, one phrase each (empty if none or if nothing answers).
        """
        status = read_status(self.mountpoint)
        if status is None:
            return []
        pid = status.pid
        diffs = []
        theirs = status.ram_dir
        if self.ram_dir and isinstance(theirs, str) and os.path.realpath(theirs) != self.ram_dir:
            diffs.append(f"ram-dir {theirs} (this driver's: {self.ram_dir})")
        record = self._read_record()
        if record is None or record.get("pid") != pid:
            log.warning(
                "adopting the running tierfs daemon (pid %s) at %s without a record of "
                "the options it was started with (lost state directory, or mounted by "
                "hand): only its ram-dir is compared with this driver's flags",
                pid,
                self.mountpoint,
            )
        elif record.get("argv") != _redact_argv(self.mount_args):
            diffs.append(
                f"options {' '.join(map(str, record.get('argv') or []))!r} "
                f"(this driver's: {' '.join(_redact_argv(self.mount_args))!r})"
            )
        elif record.get("digest") != self._fingerprint(str(record.get("salt"))):
            diffs.append("peer token or --config file contents")
        if diffs:
            log.warning(
                "the adopted tierfs daemon (pid %s) at %s was started with a configuration "
                "that differs from this driver's flags: %s. It keeps running with its own "
                "until the node mount is mounted again (delete the node pod between jobs)",
                pid,
                self.mountpoint,
                "; ".join(diffs),
            )
        else:
            log.info("adopted the running tierfs daemon (pid %s) at %s", pid, self.mountpoint)
        return diffs

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
            log.info(
                "leaving the node mount up: %d volume(s) published (%s)",
                len(busy),
                ", ".join(busy[:5]),
            )
            return False
        proc = subprocess.run(
            command("unmount", self.mountpoint, "--lazy", "--timeout", str(timeout)),
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout + 10,
        )
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
