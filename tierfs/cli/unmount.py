"""``tierfs unmount``: unmount a tierfs mount and stop its daemon, also a stuck one.

The daemon's pid comes from its status, read with a bound
(:func:`tierfs.cli.status_file.read_status_file`): a daemon that does not answer
(stopped, stuck) has its FUSE connection aborted (root), which is the cure. The
RAM store is kept for the next mount.
"""

from __future__ import annotations

import errno
import os
import time

import click

from tierfs.cli.checks import dead_mount, pid_running
from tierfs.cli.console import fail
from tierfs.cli.status_file import STATUS_PATH, DaemonNotAnswering, read_status_file
from tierfs.core import syscalls

__all__ = ["unmount"]


@click.command()
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
        fail(f"{mountpoint} is not mounted")
    if not entry["fstype"].startswith("fuse"):
        fail(f"{mountpoint} is not a tierfs mount ({entry['fstype']})")
    if (
        entry["fstype"] != "fuse.tierfs"
        and not dead_mount(mountpoint)
        and not os.path.exists(os.path.join(mountpoint, STATUS_PATH))
    ):
        fail(f"{mountpoint} is not a tierfs mount ({entry['fstype']})")
    try:
        # bounded: the daemon may be stopped or stuck, and unmounting is the cure (a
        # dead mount answers ENOTCONN at once)
        pid = (read_status_file(mountpoint, timeout) or {}).get("pid")
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
    except (OSError, ValueError):
        pid = None
    try:
        unmount_path(mountpoint, lazy=lazy)
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            fail(f"{mountpoint} is busy (files are open); close them or use --lazy")
        fail(f"cannot unmount {mountpoint}: {exc.strerror or exc}")
    if pid:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not pid_running(pid):
                return
            time.sleep(0.02)
        fail(f"daemon pid {pid} did not exit within {timeout:.0f}s")
