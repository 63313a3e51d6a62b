"""The ``tierfs`` command line: mount, unmount, status (and the tiers' own commands).

``tierfs mount`` behaves like gcsfuse: it checks its arguments, starts the
node daemon in the background and returns once the mount answers (or stays
in the foreground with ``--foreground``). Errors are one line on stderr and
exit status 1.
"""

from __future__ import annotations

import errno
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import click

from tierfs import __version__
from tierfs.cli.options import SchemaCommand, mount_options
from tierfs.core import config as node_settings
from tierfs.core import settings, syscalls
from tierfs.core.config import ConfigError, format_size
from tierfs.core.errors import ProtocolError
from tierfs.core.status import NodeStatus, RestoreStatus

if TYPE_CHECKING:
    from tierfs.core.node_config import NodeConfig

STATUS_PATH = os.path.join(".tierfs", "status.json")
READY_TIMEOUT = 120.0


def _fail(msg: str) -> None:
    raise click.ClickException(msg)


def _warn(msg: str) -> None:
    click.echo(f"tierfs: warning: {msg}", err=True)


def _dead_mount(path: str) -> bool:
    from tierfs.fuse.session import is_dead_mount

    return is_dead_mount(path)


def pid_running(pid: int) -> bool:
    """True if process ``pid`` exists and is not a zombie.

    A daemon started by ``tierfs mount`` is re-parented to init, which may be
    slow to reap it (seconds in some containers); an exited but unreaped
    daemon must count as gone.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def is_tierfs_daemon(pid: int, ram_dir: str) -> bool:
    """True if the running process ``pid`` is a tierfs daemon that may own ``ram_dir``.

    A pid in ``daemon.pid`` may belong to an unrelated process by now (the
    daemon was killed with SIGKILL and the pid was reused). The process
    counts as a tierfs daemon if its command line runs ``tierfs`` (``tierfs
    _daemon``, ``tierfs mount -f``), or if it holds a descriptor inside
    ``ram_dir`` (a daemon embedded in another program). A command line that
    cannot be read (e.g. /proc mounted with ``hidepid``) counts as a daemon.
    """
    if not pid_running(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True
    runs_tierfs = any(os.path.basename(a) == b"tierfs" or a.startswith(b"tierfs.") for a in args)
    if runs_tierfs and any(a in (b"_daemon", b"mount") for a in args):
        return True
    root = os.fsencode(os.path.realpath(ram_dir)).rstrip(b"/") + b"/"
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}".encode())
        except OSError:
            continue
        if target.startswith(root):
            return True
    return False


def check_mountpoint(path: str, nonempty_ok: bool) -> None:
    """Validate a mountpoint; clears a dead tierfs mount left by a killed daemon.

    Raises:
        click.ClickException: missing, not a directory, already mounted, not empty.
    """
    from tierfs.fuse.session import mount_entry, unmount_path

    entry = mount_entry(path)
    if entry is not None:
        if entry["fstype"].startswith("fuse") and _dead_mount(path):
            _warn(f"{path}: clearing the mount of a daemon that died")
            try:
                unmount_path(path, lazy=True)
            except OSError as exc:
                _fail(f"{path}: cannot clear dead mount: {exc.strerror or exc}")
        else:
            _fail(f"{path} is already mounted ({entry['fstype']})")
    if not os.path.exists(path):
        _fail(f"mountpoint {path} does not exist")
    if not os.path.isdir(path):
        _fail(f"mountpoint {path} is not a directory")
    if not nonempty_ok and os.listdir(path):
        _fail(f"mountpoint {path} is not empty (use -o nonempty to mount over it)")


def _inside(path: str, root: str) -> bool:
    path, root = os.path.realpath(path), os.path.realpath(root)
    return path == root or path.startswith(root.rstrip("/") + "/")


def check_overlap(mountpoint: str, ram_dir: str) -> None:
    """Refuse a ram-dir inside the mountpoint (the daemon would wait on its own
    mount) and a mountpoint inside the ram-dir (it would hide the store)."""
    if _inside(ram_dir, mountpoint):
        _fail(f"--ram-dir {ram_dir} must not be the mountpoint or inside it")
    if _inside(mountpoint, ram_dir):
        _fail(f"mountpoint {mountpoint} must not be inside --ram-dir {ram_dir}")
    other = _enclosing_ram_dir(ram_dir)
    if other is not None:
        _fail(f"--ram-dir {ram_dir} must not be inside the ram-dir {other} of another tierfs mount")


def _enclosing_ram_dir(ram_dir: str) -> str | None:
    """A tierfs ram-dir (``store/daemon.pid`` next to ``view/``) above ``ram_dir``."""
    path = os.path.realpath(ram_dir)
    parent = os.path.dirname(path)
    while parent != path:
        path, parent = parent, os.path.dirname(parent)
        if os.path.isfile(os.path.join(path, "store", "daemon.pid")) and os.path.isdir(
            os.path.join(path, "view")
        ):
            return path
    return None


def check_size(ram_dir: str, size: int | None) -> None:
    """Warn when ``--size`` exceeds what the ram-dir's filesystem can hold at all,
    or is not more than the ram-dir already holds (every write would get ENOSPC).

    Call after :func:`check_ram_dir`: a tmpfs of tierfs's own on the ram-dir is
    measured against the filesystem below it (the one that bounds it).
    """
    if size is None:
        return
    from tierfs.store import ramtmpfs

    vfs = os.statvfs(ram_dir)
    capacity = vfs.f_blocks * vfs.f_frsize
    if ramtmpfs.mounted_kind(ram_dir) == "ours":
        below = os.statvfs(os.path.dirname(ram_dir))
        capacity = max(capacity, below.f_blocks * below.f_frsize)
    if size > capacity:
        _warn(
            f"--size {format_size(size)} is more than the ram-dir's filesystem holds "
            f"({format_size(capacity)}); that limit applies"
        )
        return
    from tierfs.store.ramstore import RamStore

    held = RamStore(ram_dir).usage()
    if held >= size:
        _warn(
            f"--size {format_size(size)} is not more than the {format_size(held)} the "
            f"ram-dir already holds: writes fail with ENOSPC until steps are deleted"
        )


def check_bucket(bucket: str | None) -> None:
    """Refuse an invalid ``--bucket`` or one that does not exist before anything is
    created (a bucket that does not answer in time is the daemon's to report)."""
    if not bucket:
        return
    from tierfs.backup.tier import preflight_bucket

    problem = preflight_bucket(bucket)
    if problem:
        _fail(problem)


def check_ram_dir(path: str, size: int | None = None) -> None:
    """Refuse a ram-dir in use, give it a tmpfs of ``size`` bytes where that works
    (:mod:`tierfs.store.ramtmpfs`), create it if needed, warn if it is not tmpfs."""
    from tierfs.store import ramtmpfs
    from tierfs.store.ramstore import RamStore

    root = os.path.abspath(path)
    try:
        with open(os.path.join(root, "store", "daemon.pid")) as f:
            pid = int(f.readline())
            other = f.readline().strip()
    except (OSError, ValueError):
        pass
    else:
        if pid != os.getpid() and is_tierfs_daemon(pid, root):
            _fail(f"ram-dir {path} is in use by tierfs daemon pid {pid} (mounted at {other})")
    try:
        plan = ramtmpfs.prepare(root, size)
    except OSError as exc:
        _fail(
            f"ram-dir {path}: mounting a tmpfs of the --size budget failed: {exc.strerror or exc}"
        )
        return
    if plan.managed:
        _warn(f"--size: {plan.reason}")
    try:
        store = RamStore(path)
    except OSError as exc:
        _fail(f"ram-dir {path}: {exc.strerror or exc}")
        return
    if not store.on_tmpfs():
        _warn(f"ram-dir {path} is not on tmpfs: checkpoints will be written to disk")


def check_log_file(path: str | None) -> None:
    """Open (create) an explicit ``--log-file`` for appending, as the daemon will.

    Raises:
        click.ClickException: its directory is missing, it is a directory, no permission.
    """
    if not path:
        return
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        _fail(f"--log-file {path}: {exc.strerror or exc}")


def _build_config(opts: dict[str, Any], notes: list[str] | None = None) -> NodeConfig:
    """The NodeConfig of ``tierfs mount``'s options (flags over ``--config`` over
    ``TIERFS_PEER_TOKEN``; :func:`tierfs.core.config.build_config`); a size with a bare
    decimal suffix adds a line to ``notes`` (:func:`tierfs.core.sizes.decimal_note`).

    Raises:
        ConfigError: naming the first bad setting.
    """
    config = node_settings.build_config(opts, opts.get("config"), notes=notes)
    # symlinks resolved: /proc/self/mountinfo, `tierfs unmount` and status all
    # name the real path
    config.mountpoint = os.path.realpath(opts["mountpoint"])
    if not config.ram_dir:
        _fail("--ram-dir is required (or ramDir in --config)")
    config.ram_dir = os.path.realpath(config.ram_dir)
    if config.log_file:
        config.log_file = os.path.abspath(config.log_file)
    return config


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tierfs")
def main() -> None:
    """tierfs: a tiered checkpoint store (RAM, peers, Google Cloud Storage) behind a FUSE mount."""


@main.command(cls=SchemaCommand)
@click.argument("mountpoint", type=click.Path())
@mount_options
@click.option("-f", "--foreground", is_flag=True, help="Stay in the foreground.")
@click.option("--ready-fd", type=int, hidden=True)
def mount(**opts: Any) -> None:
    """Mount tierfs at MOUNTPOINT, keeping every byte in RAM under --ram-dir."""
    notes: list[str] = []
    try:
        config = _build_config(opts, notes)
        settings.check_environment()
    except ConfigError as exc:
        _fail(str(exc))
        return
    if opts.get("ready_fd") is None:
        for note in notes:
            click.echo(f"tierfs: note: {note}", err=True)
    from tierfs.fuse.session import MountOptionError, MountOptions

    try:
        MountOptions.parse(config.mount_options)
    except MountOptionError as exc:
        _fail(str(exc))
    ready_fd = opts.get("ready_fd")
    if ready_fd is None:
        check_log_file(config.log_file)
        check_overlap(config.mountpoint, config.ram_dir)
        nonempty = any("nonempty" in o.split(",") for o in config.mount_options)
        check_mountpoint(config.mountpoint, nonempty)
        check_bucket(config.bucket)
        check_ram_dir(config.ram_dir, config.size)
        check_size(config.ram_dir, config.size)
    if opts["foreground"] or ready_fd is not None:
        _run_daemon(config, opts["foreground"] and ready_fd is None, ready_fd)
    else:
        _spawn_daemon(config)


def _run_daemon(config: NodeConfig, foreground: bool, ready_fd: int | None) -> None:
    from tierfs.daemon import run_foreground, setup_logging

    setup_logging(config, foreground)

    def ready() -> None:
        if ready_fd is not None:
            os.write(ready_fd, b"READY\n")
            os.close(ready_fd)

    try:
        code = run_foreground(config, on_ready=ready)
    except BaseException as exc:  # report why the mount failed to the waiting parent
        if isinstance(exc, KeyboardInterrupt):
            sys.exit(130)
        msg = "; ".join(_leaf_messages(exc))
        if ready_fd is not None:
            try:
                os.write(ready_fd, f"ERROR {msg}\n".encode())
            except OSError:
                pass
        import logging

        logging.getLogger("tierfs").exception("daemon failed")
        _fail(f"mount failed: {msg}")
        return
    sys.exit(code)


def _leaf_messages(exc: BaseException) -> list[str]:
    """The messages of the real errors inside (nested) exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        return [m for e in exc.exceptions for m in _leaf_messages(e)]
    if isinstance(exc, OSError) and exc.strerror:
        return [f"{exc.strerror}" + (f": {exc.filename}" if exc.filename else "")]
    return [str(exc) or type(exc).__name__]


#: seconds a daemon that closed its ready pipe without a word gets to exit
EXIT_GRACE = 30.0


def _spawn_daemon(config: NodeConfig) -> None:
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
            env=_daemon_env(),
        )
    os.close(w)
    assert proc.stdin is not None
    try:
        proc.stdin.write(json.dumps(config.to_dict()).encode())
        proc.stdin.close()
    except BrokenPipeError:  # the daemon died at once; its exit status says the rest
        pass
    try:
        line, closed = _read_ready_line(r, proc, READY_TIMEOUT)
    finally:
        os.close(r)
    if line == "READY":
        _report_mounted(config, log_path)
        return
    if line.startswith("ERROR "):
        _fail(f"mount failed: {line[6:]} (log: {log_path})")
    if closed or proc.poll() is not None:
        # the pipe closes as the daemon exits, a moment before its exit status exists
        try:
            code = proc.wait(timeout=EXIT_GRACE)
        except subprocess.TimeoutExpired:
            _fail(
                f"daemon pid {proc.pid} closed its ready pipe without reporting and is "
                f"still running (log: {log_path})"
            )
            return
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        last = _last_log_line(log_path, log_start)
        _fail(f"daemon {how} at start" + (f": {last}" if last else "") + f" (log: {log_path})")
    _fail(
        f"daemon did not become ready in {READY_TIMEOUT:.0f}s (pid {proc.pid} still "
        f"running; log: {log_path})"
    )


def _daemon_env() -> dict[str, str]:
    """The daemon's environment: ours, with a relative credentials path made absolute
    (the daemon runs from ``/``)."""
    env = dict(os.environ)
    creds = env.get("GOOGLE_APPLICATION_CREDENTIALS")
    if creds and not os.path.isabs(creds):
        env["GOOGLE_APPLICATION_CREDENTIALS"] = os.path.abspath(creds)
    return env


def _read_ready_line(fd: int, proc: subprocess.Popen[bytes], timeout: float) -> tuple[str, bool]:
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


def _last_log_line(path: str, offset: int) -> str:
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


def _report_mounted(config: NodeConfig, log_path: str) -> None:
    """Say on stdout what was mounted: where, the ram-dir, the mode, passthrough on/off."""
    try:
        with open(os.path.join(config.mountpoint, STATUS_PATH), encoding="utf-8") as f:
            status = json.load(f)
    except (OSError, ValueError):
        status = {}
    click.echo(mounted_summary(config, status if isinstance(status, dict) else {}, log_path))


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


def _read_config_stdin() -> NodeConfig:
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
        _fail("the daemon expects its configuration as a JSON object on stdin")
    try:
        return node_settings.NodeConfig.from_dict(data)
    except ConfigError as exc:
        _fail(f"the configuration on stdin is invalid: {exc}")
        raise


@main.command("_daemon", hidden=True)
@click.option("--ready-fd", type=int, required=True)
def _daemon(ready_fd: int) -> None:
    """Run the daemon (started by ``tierfs mount``; the configuration comes on stdin)."""
    _run_daemon(_read_config_stdin(), False, ready_fd)


#: how long `tierfs status` waits for a daemon to answer (seconds)
STATUS_TIMEOUT = 10.0


class DaemonNotAnswering(ProtocolError):
    """The status file did not open within the time given: the daemon is stopped or stuck."""


def _read_json(path: str, timeout: float | None) -> Any:
    """``json.load`` of ``path``, given up after ``timeout`` seconds (None: no limit).

    A read through the mount of a stopped daemon blocks until the daemon answers;
    it runs in a daemon thread that is left behind (the kernel ends the request
    when this process exits).

    Raises:
        DaemonNotAnswering: no answer within ``timeout``.
        OSError, ValueError: as ``open``/``json.load`` raise them.
    """

    def read() -> Any:
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    if timeout is None:
        return read()
    result: list[Any] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(read())
        except BaseException as exc:
            error.append(exc)

    t = threading.Thread(target=run, name="tierfs-status", daemon=True)
    t.start()
    t.join(max(0.0, timeout))
    if t.is_alive():
        raise DaemonNotAnswering(path)
    if error:
        raise error[0]
    return result[0]


def read_status(mountpoint: str, timeout: float | None = None) -> dict[str, Any]:
    """Read ``.tierfs/status.json`` through the mount.

    Args:
        timeout: seconds to wait for the daemon to answer (None: no limit).

    Raises:
        click.ClickException: not a tierfs mount, or its daemon is gone.
        DaemonNotAnswering: no answer within ``timeout`` (a stopped or stuck daemon).
    """
    path = os.path.join(mountpoint, STATUS_PATH)
    try:
        data = _read_json(path, timeout)
        return data if isinstance(data, dict) else {}
    except OSError as exc:
        if exc.errno in (errno.ENOTCONN, errno.ECONNABORTED):
            _fail(
                f"{mountpoint}: the tierfs daemon is not running (transport endpoint "
                "not connected); mount again to recover"
            )
        _fail(f"{mountpoint} is not a tierfs mount ({exc.strerror})")
    except json.JSONDecodeError:
        _fail(f"{mountpoint}: unreadable status file")
    return {}


def _not_answering(mountpoint: str, waited: float) -> str:
    return (
        f"{mountpoint}: the tierfs daemon does not answer (no status within {waited:.0f}s): "
        "it is stopped or stuck; `tierfs unmount` still unmounts it"
    )


@main.command()
@click.argument("mountpoint", type=str)  # not click.Path: its stat waits on a stuck daemon
@click.option("--lazy", "-z", is_flag=True, help="Detach even if files are still open.")
@click.option(
    "--timeout",
    default=30.0,
    show_default=True,
    help="Seconds to wait for the daemon to answer, then to exit (a daemon that does "
    "not answer has its FUSE connection aborted).",
)
def unmount(mountpoint: str, lazy: bool, timeout: float) -> None:
    """Unmount MOUNTPOINT and stop its daemon (the RAM store is kept)."""
    from tierfs.fuse.session import mount_entry, unmount_path

    # as `tierfs mount` recorded it; the mountpoint itself is not resolved (a stat of
    # it waits for the daemon, which may be stopped or stuck)
    absolute = os.path.abspath(mountpoint)
    given = mountpoint
    mountpoint = os.path.join(
        os.path.realpath(os.path.dirname(absolute)), os.path.basename(absolute)
    )
    entry = mount_entry(mountpoint)
    if entry is None:  # MOUNTPOINT is a symlink to the mount (resolving it stats it)
        mountpoint = os.path.realpath(given)
        entry = mount_entry(mountpoint)
    if entry is None:
        _fail(f"{mountpoint} is not mounted")
        return
    if not entry["fstype"].startswith("fuse"):
        _fail(f"{mountpoint} is not a tierfs mount ({entry['fstype']})")
    if (
        entry["fstype"] != "fuse.tierfs"
        and not _dead_mount(mountpoint)
        and not os.path.exists(os.path.join(mountpoint, STATUS_PATH))
    ):
        _fail(f"{mountpoint} is not a tierfs mount ({entry['fstype']})")
    try:
        # bounded: the daemon may be stopped or stuck, and unmounting is the cure (a
        # dead mount answers ENOTCONN at once)
        pid = _read_json(os.path.join(mountpoint, STATUS_PATH), timeout).get("pid")
    except DaemonNotAnswering:
        pid = None
        if os.geteuid() == 0:
            # umount2(MNT_FORCE) aborts a FUSE connection: every waiting request (our
            # own status read included) fails with ENOTCONN, the mount can go
            click.echo(
                f"tierfs: the daemon of {mountpoint} does not answer: aborting its connection",
                err=True,
            )
            flags = syscalls.MNT_FORCE
            for _ in range(40):  # our aborted read lets go of the mount within moments
                try:
                    syscalls.umount2(mountpoint, flags)
                    return  # unmounted (the daemon exits once it runs again)
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        break
                flags = 0
                time.sleep(0.05)
            # still busy (files open): the unmount below says so, or detaches (--lazy)
    except (OSError, ValueError, AttributeError):
        pid = None
    try:
        unmount_path(mountpoint, lazy=lazy)
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            _fail(f"{mountpoint} is busy (files are open); close them or use --lazy")
        _fail(f"cannot unmount {mountpoint}: {exc.strerror or exc}")
    if pid:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not pid_running(pid):
                return
            time.sleep(0.02)
        _fail(f"daemon pid {pid} did not exit within {timeout:.0f}s")


@main.command()
@click.argument("mountpoint", type=str)  # not click.Path: its stat waits on a stuck daemon
@click.option("--json", "as_json", is_flag=True, help="Print the raw status as JSON.")
def status(mountpoint: str, as_json: bool) -> None:
    """Show the job, its steps, the RAM budget and recent errors of a mount."""
    try:
        data = read_status(mountpoint, STATUS_TIMEOUT)
    except DaemonNotAnswering:
        _fail(_not_answering(mountpoint, STATUS_TIMEOUT))
        return
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True))
        return
    from tierfs.cli.status import render_status

    render_status(data)


#: restore states after which a node's view holds what it will resume from
RESTORE_SETTLED = ("done", "failed", "idle")

#: ``tierfs wait`` exit codes by restore outcome (README "tierfs wait")
WAIT_EXIT = {
    "restored": 0,
    "fresh": 0,
    "failed": 1,
    "incomplete": 3,
    "missing": 4,
    "refused": 5,
    "timeout": 6,
}
#: ``tierfs wait``: the restore was still running when --timeout passed
WAIT_STILL_RUNNING = 7


def wait_outcome(restore: RestoreStatus | Mapping[str, Any]) -> tuple[int, str]:
    """What ``tierfs wait`` prints and returns for a settled restore state (pure;
    typed, or the status's ``restore`` object).

    Returns:
        (exit code, one line): 0 for a restored step or a true fresh start
        (nothing of the job exists anywhere), else the code of
        :data:`WAIT_EXIT` with the reason.
    """
    if not isinstance(restore, RestoreStatus):
        restore = RestoreStatus.from_json(restore)
    state = restore.state
    step = restore.step
    outcome = restore.outcome or (
        "failed" if state == "failed" else "restored" if step else "fresh"
    )
    reason = restore.reason or restore.error or ""
    if state == "idle":
        return 0, "no restore needed"
    if state == "failed":
        what = {
            "missing": "a node did not join",
            "refused": "the coordinator refused this node",
            "timeout": "timed out",
        }.get(outcome, "failed")
        return WAIT_EXIT.get(outcome, 1), f"restore {what}: {reason or 'see replicator.errors'}"
    if step:
        source = f"GCS round {restore.backup}" if restore.backup else restore.source or "?"
        return 0, f"restored step {step} from {source}"
    if outcome == "fresh":
        return 0, f"nothing to restore{': ' + reason if reason else ''}"
    return WAIT_EXIT.get(outcome, 1), f"nothing restored ({outcome}): {reason}"


@main.command("wait")
@click.argument("mountpoint", type=str)  # not click.Path: its stat waits on a stuck daemon
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait.")
def wait_cmd(mountpoint: str, timeout: float) -> None:
    """Wait until the node's restore has finished; print what it restored.

    Use it between `tierfs mount` and starting a trainer that lists its own
    checkpoint directory (generic mode): after a node loss the restored step
    appears in the mount only when the cluster has agreed on it. Exit status
    0: a step was restored, or nothing of the job exists anywhere (a fresh
    start); 1: the restore failed; 3: something exists but no step is
    complete (nothing restored); 4: a node did not join in time; 5: the
    coordinator refuses this node; 6: a restore phase timed out; 7: still
    running after --timeout (or the daemon did not answer within it).
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            # never past --timeout, even when the daemon does not answer at all
            left = max(1.0, deadline - time.monotonic())
            restore = NodeStatus.from_json(read_status(mountpoint, left)).restore
        except DaemonNotAnswering:
            click.echo(f"tierfs: error: {_not_answering(mountpoint, timeout)}", err=True)
            sys.exit(WAIT_STILL_RUNNING)
        state = restore.state
        if state in RESTORE_SETTLED:
            break
        if time.monotonic() > deadline:
            click.echo(
                f"tierfs: error: restore still {state} after {timeout:.0f}s "
                f"({restore.phase or 'tierfs status ' + mountpoint})",
                err=True,
            )
            sys.exit(WAIT_STILL_RUNNING)
        time.sleep(0.2)
    code, line = wait_outcome(restore)
    if not code:
        click.echo(line)
    for problem in restore.problems:
        if problem not in line:
            click.echo(f"tierfs: note: {problem}", err=True)
    if code:
        click.echo(f"tierfs: error: {line}", err=True)
        sys.exit(code)


def _register_plugins() -> None:
    """Attach the commands that live with their tier, where that module exists."""
    import importlib
    import importlib.util

    for module, name in (
        ("tierfs.cli.backups", "backups"),
        ("tierfs.csi.cli", "csi"),
        ("tierfs.demo.cli", "demo"),
    ):
        try:
            if importlib.util.find_spec(module) is None:
                continue
        except ModuleNotFoundError:  # the parent package does not exist yet
            continue
        main.add_command(getattr(importlib.import_module(module), name))


_register_plugins()

__all__ = ["format_size", "main", "mount_options"]
