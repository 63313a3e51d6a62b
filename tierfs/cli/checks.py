"""What ``tierfs mount`` checks before it starts a daemon, each refusal one clear line.

The mountpoint (:func:`check_mountpoint`: exists, a directory, empty, not mounted;
a dead mount of a killed daemon is cleared), the ram-dir (:func:`check_ram_dir`: not
in use by a live daemon (:func:`is_tierfs_daemon`), a tmpfs of ``--size`` where
that works; :func:`check_size`; :func:`check_overlap` with the mountpoint), the
bucket (:func:`check_bucket`) and the log file (:func:`check_log_file`). Each
raises :class:`click.ClickException` (exit status 1) through
:func:`tierfs.cli.console.fail`. Heavy modules are imported where they are used:
``tierfs --help``, ``status`` and ``wait`` need none of them.
"""

from __future__ import annotations

import os
import stat

from tierfs.cli.console import fail, warn
from tierfs.core.config import format_size

__all__ = [
    "check_bucket",
    "check_log_file",
    "check_mountpoint",
    "check_overlap",
    "check_ram_dir",
    "check_size",
    "dead_mount",
    "discard_empty_file",
    "is_tierfs_daemon",
    "pid_running",
]


def dead_mount(path: str) -> bool:
    """True if ``path`` is a FUSE mount whose daemon is gone (it answers ENOTCONN)."""
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
        if entry["fstype"].startswith("fuse") and dead_mount(path):
            warn(f"{path}: clearing the mount of a daemon that died")
            try:
                unmount_path(path, lazy=True)
            except OSError as exc:
                fail(f"{path}: cannot clear dead mount: {exc.strerror or exc}")
        else:
            fail(f"{path} is already mounted ({entry['fstype']})")
    if not os.path.exists(path):
        fail(f"mountpoint {path} does not exist")
    if not os.path.isdir(path):
        fail(f"mountpoint {path} is not a directory")
    if not nonempty_ok and os.listdir(path):
        fail(f"mountpoint {path} is not empty (use -o nonempty to mount over it)")


def _inside(path: str, root: str) -> bool:
    path, root = os.path.realpath(path), os.path.realpath(root)
    return path == root or path.startswith(root.rstrip("/") + "/")


def check_overlap(mountpoint: str, ram_dir: str) -> None:
    """Refuse a ram-dir inside the mountpoint (the daemon would wait on its own
    mount) and a mountpoint inside the ram-dir (it would hide the store)."""
    if _inside(ram_dir, mountpoint):
        fail(f"--ram-dir {ram_dir} must not be the mountpoint or inside it")
    if _inside(mountpoint, ram_dir):
        fail(f"mountpoint {mountpoint} must not be inside --ram-dir {ram_dir}")
    other = _enclosing_ram_dir(ram_dir)
    if other is not None:
        fail(f"--ram-dir {ram_dir} must not be inside the ram-dir {other} of another tierfs mount")


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
        warn(
            f"--size {format_size(size)} is more than the ram-dir's filesystem holds "
            f"({format_size(capacity)}); that limit applies"
        )
        return
    from tierfs.store.ramstore import RamStore

    held = RamStore(ram_dir).usage()
    if held >= size:
        warn(
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
        fail(problem)


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
            fail(f"ram-dir {path} is in use by tierfs daemon pid {pid} (mounted at {other})")
    try:
        plan = ramtmpfs.prepare(root, size)
    except OSError as exc:
        fail(f"ram-dir {path}: mounting a tmpfs of the --size budget failed: {exc.strerror or exc}")
    if plan.managed:
        warn(f"--size: {plan.reason}")
    try:
        store = RamStore(path)
    except OSError as exc:
        fail(f"ram-dir {path}: {exc.strerror or exc}")
    if not store.on_tmpfs():
        warn(f"ram-dir {path} is not on tmpfs: checkpoints will be written to disk")


def check_log_file(path: str | None) -> bool:
    """Open (create) an explicit ``--log-file`` for appending, as the daemon will.

    Returns:
        True if the file was created here: a mount that fails before anything is
        written to it removes it again (:func:`discard_empty_file`).

    Raises:
        click.ClickException: its directory is missing, it is a directory, no permission.
    """
    if not path:
        return False
    existed = os.path.lexists(path)
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        fail(f"--log-file {path}: {exc.strerror or exc}")
    return not existed


def discard_empty_file(path: str) -> None:
    """Remove ``path`` if it is an empty regular file (a log nothing was written to)."""
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_size == 0:
            os.unlink(path)
    except OSError:
        pass
