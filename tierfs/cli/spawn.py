"""Starting the node daemon: in the background for ``tierfs mount``, or in this process.

``tierfs mount`` behaves like gcsfuse: :func:`spawn_daemon` starts the daemon in
a session of its own (``tierfs _daemon``, its configuration as JSON on stdin,
:func:`read_config_stdin`) and returns once the daemon reports ``READY`` on its
ready pipe, saying what was mounted (:func:`mounted_summary`), or fails with the
daemon's own reason: its ``ERROR`` line, its exit status with the last line of
its log, or no report within :data:`READY_TIMEOUT` seconds. :func:`run_daemon`
runs the daemon in the current process (``--foreground`` and ``tierfs _daemon``).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import click

from tierfs.cli.console import fail
from tierfs.cli.status_file import read_status_file
from tierfs.core import config as node_settings
from tierfs.core.config import ConfigError, format_size

if TYPE_CHECKING:
    from tierfs.core.node_config import NodeConfig

#: seconds ``tierfs mount`` waits for the daemon's report
READY_TIMEOUT = 120.0

__all__ = [
    "EXIT_GRACE",
    "READY_TIMEOUT",
    "leaf_messages",
    "mounted_summary",
    "read_config_stdin",
    "run_daemon",
    "spawn_daemon",
]


def run_daemon(config: NodeConfig, foreground: bool, ready_fd: int | None) -> None:
    """Run the daemon in this process until it exits (``--foreground``, or the
    background daemon :func:`spawn_daemon` started): ``READY`` or ``ERROR <why>`` on
    ``ready_fd`` once mounted or failed, then exit with the daemon's status.

    Raises:
        click.ClickException: the mount failed (also reported on ``ready_fd``).
        SystemExit: the daemon's exit status (130 on Ctrl-C).
    """
    from tierfs.daemon import run_foreground, setup_logging

    setup_logging(config, foreground)

    def ready() -> None:
        if ready_fd is not None:
            announce_ready(ready_fd)

    try:
        code = run_foreground(config, on_ready=ready)
    except BaseException as exc:  # report why the mount failed to the waiting parent
        if isinstance(exc, KeyboardInterrupt):
            sys.exit(130)
        msg = "; ".join(leaf_messages(exc))
        if ready_fd is not None:
            try:
                os.write(ready_fd, f"ERROR {msg}\n".encode())
            except OSError:
                pass
        import logging

        logging.getLogger("tierfs").exception("daemon failed")
        fail(f"mount failed: {msg}")
    sys.exit(code)


def announce_ready(fd: int) -> None:
    """Write ``READY`` to the waiting ``tierfs mount`` on pipe ``fd`` and close it. A
    reader that gave up waiting (:data:`READY_TIMEOUT`: it said the daemon keeps
    starting) is not an error: the daemon goes on serving. Regression (a new user's
    trial under load): EPIPE ended the daemon just as it became ready."""
    try:
        os.write(fd, b"READY\n")
    except BrokenPipeError:
        pass
    finally:
        os.close(fd)


def leaf_messages(exc: BaseException) -> list[str]:
    """The messages of the real errors inside (nested) exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        return [m for e in exc.exceptions for m in leaf_messages(e)]
    if isinstance(exc, OSError) and exc.strerror:
        return [f"{exc.strerror}" + (f": {exc.filename}" if exc.filename else "")]
    return [str(exc) or type(exc).__name__]


#: seconds a daemon that closed its ready pipe without a word gets to exit
EXIT_GRACE = 30.0


def spawn_daemon(config: NodeConfig) -> None:
    """Start the background daemon and wait until it mounted (or failed).

    The configuration travels as JSON on the daemon's stdin, never in its
    argv: a command line is readable by every local user (``ps``), and the
    configuration may hold the peer token. The daemon runs as ``python -P -m
    tierfs`` (:func:`tierfs.command`: a ``tierfs`` folder in the current
    directory cannot shadow the installed package) from ``/`` (a daemon
    keeps no directory of the caller busy; every path it gets is absolute).

    Raises:
        click.ClickException: the daemon failed, exited or did not become ready
            within :data:`READY_TIMEOUT` seconds.
    """
    from tierfs import command
    from tierfs.store.ramstore import RamStore

    r, w = os.pipe()
    store = RamStore(config.ram_dir)
    log_path = config.log_file or store.log_file
    with open(log_path, "ab") as logf:
        log_start = logf.tell()
        proc = subprocess.Popen(
            command("_daemon", "--ready-fd", str(w)),
            stdin=subprocess.PIPE,
            stdout=logf,
            stderr=logf,
            pass_fds=(w,),
            start_new_session=True,
            close_fds=True,
            cwd="/",
            env=daemon_env(),
        )
    os.close(w)
    assert proc.stdin is not None
    try:
        proc.stdin.write(json.dumps(config.to_dict()).encode())
        proc.stdin.close()
    except BrokenPipeError:  # the daemon died at once; its exit status says the rest
        pass
    try:
        line, closed = read_ready_line(r, proc, READY_TIMEOUT)
    finally:
        os.close(r)
    if line == "READY":
        report_mounted(config, log_path)
        return
    if line.startswith("ERROR "):
        fail(f"mount failed: {line[6:]} (log: {log_path})")
    if closed or proc.poll() is not None:
        # the pipe closes as the daemon exits, a moment before its exit status exists
        try:
            code = proc.wait(timeout=EXIT_GRACE)
        except subprocess.TimeoutExpired:
            fail(
                f"daemon pid {proc.pid} closed its ready pipe without reporting and is "
                f"still running (log: {log_path})"
            )
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        last = last_log_line(log_path, log_start)
        fail(f"daemon {how} at start" + (f": {last}" if last else "") + f" (log: {log_path})")
    fail(
        f"daemon did not become ready in {READY_TIMEOUT:.0f}s (pid {proc.pid} still "
        f"running; log: {log_path})"
    )


def daemon_env() -> dict[str, str]:
    """The daemon's environment: ours, with a relative credentials path made absolute
    (the daemon runs from ``/``)."""
    env = dict(os.environ)
    creds = env.get("GOOGLE_APPLICATION_CREDENTIALS")
    if creds and not os.path.isabs(creds):
        env["GOOGLE_APPLICATION_CREDENTIALS"] = os.path.abspath(creds)
    return env


def read_ready_line(fd: int, proc: subprocess.Popen[bytes], timeout: float) -> tuple[str, bool]:
    """Read the daemon's one-line report (``READY`` or ``ERROR <why>``) from ``fd``.

    Returns:
        ``(line, closed)``: the line read so far (stripped; empty if none) and
        whether the pipe was closed (the daemon exited or closed it) before a
        whole line came. Returns after ``timeout`` seconds at the latest.
    """
    deadline = time.monotonic() + timeout
    buf = b""
    closed = False
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select([fd], [], [], min(0.5, left))
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                closed = True
                break
            buf += chunk
        elif proc.poll() is not None:
            closed = True
            break
    return buf.decode(errors="replace").strip(), closed


def last_log_line(path: str, offset: int) -> str:
    """The last non-empty line the daemon wrote to its log after ``offset`` (at most
    64 KiB back), e.g. the ``ImportError: ...`` line ending a traceback; '' if none."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(offset, size - 65536))
            tail = f.read()
    except OSError:
        return ""
    lines = [ln.strip() for ln in tail.decode(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:500] if lines else ""


def report_mounted(config: NodeConfig, log_path: str) -> None:
    """Say on stdout what was mounted: where, the ram-dir, the mode, passthrough on/off."""
    try:
        status = read_status_file(config.mountpoint)
    except (OSError, ValueError):
        status = None
    click.echo(mounted_summary(config, status or {}, log_path))


def mounted_summary(config: NodeConfig, status: dict[str, Any], log_path: str) -> str:
    """The line ``tierfs mount`` prints once mounted, from the daemon's first status.

    Example: ``mounted /ckpt (ram-dir /dev/shm/tierfs): generic mode, job default
    rank 0/1; passthrough on; RAM 62.9 GiB free; log /dev/shm/tierfs/store/daemon.log``.
    """
    job = status.get("job") or {}
    mode = {"protocol": "MTC protocol mode", "generic": "generic mode"}.get(
        str(status.get("mode")), "no job yet (waiting for replicator.yaml)"
    )
    if job:
        mode += f", job {job.get('name')} rank {job.get('node_rank')}/{job.get('nodes')}"
    passthrough = "on" if status.get("passthrough") else "off"
    budget = status.get("budget") or {}
    ram = (
        f"RAM budget {format_size(budget.get('total_bytes', 0))} (managed)"
        if budget.get("mode") == "managed"
        else f"RAM {format_size(budget.get('free_bytes', 0))} free"
    )
    return (
        f"mounted {config.mountpoint} (ram-dir {config.ram_dir}): {mode}; passthrough "
        f"{passthrough}; {ram}; log {log_path}"
    )


def read_config_stdin() -> NodeConfig:
    """The configuration ``tierfs mount`` writes as JSON to the daemon's stdin.

    stdin is then pointed at /dev/null (a daemon reads nothing else from it).

    Raises:
        click.ClickException: stdin held no valid configuration.
    """
    raw = sys.stdin.buffer.read()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        fail("the daemon expects its configuration as a JSON object on stdin")
    try:
        return node_settings.NodeConfig.from_dict(data)
    except ConfigError as exc:
        fail(f"the configuration on stdin is invalid: {exc}")
