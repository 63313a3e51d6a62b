"""Bind mounts of the node's tierfs mount, and what /proc/self/mountinfo says about them.

The CSI node service publishes a volume by bind-mounting the node's single
tierfs FUSE mount at the pod's ``target_path`` (CSI spec, "NodePublishVolume":
"For volumes with an access type of mount, the SP SHALL place the mounted
directory at target_path"). Whether a target is published is read from
/proc/self/mountinfo every time, never from memory, so a restarted driver
still finds and unpublishes the bind mounts an earlier run made ("This RPC
SHALL be called by the CO at least once for each target_path that was
successfully setup").
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from tierfs.core import syscalls
from tierfs.core.mounts import unescape
from tierfs.fuse.session import is_dead_mount

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_NOATIME = 0x400
MS_NODIRATIME = 0x800
MS_BIND = 0x1000
MS_RELATIME = 0x200000

#: per-mount options a bind mount can carry (mountinfo field 6 and ``mount_flags``)
BIND_FLAGS = {
    "ro": MS_RDONLY,
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
}
#: mount flags accepted without effect: every volume is a bind mount, read-write
#: unless something asks for read-only (which wins over ``rw``)
NOOP_FLAGS = frozenset({"rw", "bind"})
#: flags that would lift a restriction of the node mount (its nosuid, nodev, a
#: noexec or noatime it was given) or pick an atime mode it cannot hold: refused
#: rather than ignored, since a bind mount keeps the node mount's flags
LIFTING_FLAGS = frozenset({"suid", "dev", "exec", "atime", "diratime", "strictatime"})

MOUNTINFO = "/proc/self/mountinfo"


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/self/mountinfo (proc(5)).

    Attributes:
        mount_id: unique id of the mount.
        parent_id: id of the parent mount.
        device: ``major:minor`` of the filesystem (equal for a mount and its bind mounts).
        root: the directory of the filesystem mounted here (``/`` for a whole-fs bind).
        mountpoint: where it is mounted, relative to this process's root.
        options: per-mount options (``rw``/``ro``, ``nosuid``, ...).
        fstype: filesystem type (``fuse.tierfs`` for tierfs).
        source: the mount source (tierfs's ``fsname``).
    """

    mount_id: int
    parent_id: int
    device: str
    root: str
    mountpoint: str
    options: frozenset[str]
    fstype: str
    source: str

    @property
    def readonly(self) -> bool:
        """True if this mount (not only its filesystem) is read-only."""
        return "ro" in self.options


def read_mountinfo(path: str = MOUNTINFO) -> list[MountEntry]:
    """Parse /proc/self/mountinfo into entries, in the kernel's order (older mounts first).

    Raises:
        OSError: the file cannot be read.
    """
    entries = []
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            left, sep, right = line.rstrip("\n").partition(" - ")
            fields, rfields = left.split(" "), right.split(" ")
            if not sep or len(fields) < 6 or len(rfields) < 2:
                continue
            entries.append(
                MountEntry(
                    mount_id=int(fields[0]),
                    parent_id=int(fields[1]),
                    device=fields[2],
                    root=unescape(fields[3]),
                    mountpoint=unescape(fields[4]),
                    options=frozenset(fields[5].split(",")),
                    fstype=rfields[0],
                    source=unescape(rfields[1]),
                )
            )
    return entries


def mounts_at(path: str) -> list[MountEntry]:
    """The mounts stacked at ``path`` (absolute, normalised), bottom first; empty if none."""
    real = os.path.normpath(os.path.abspath(path))
    return [e for e in read_mountinfo() if e.mountpoint == real]


def top_mount(path: str) -> MountEntry | None:
    """The mount visible at ``path`` (the last one stacked there), or None."""
    stack = mounts_at(path)
    return stack[-1] if stack else None


def is_within(path: str, root: str) -> bool:
    """True if ``path`` is ``root`` or lies below it (both absolute and normalised)."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def containing_mount(path: str, entries: list[MountEntry] | None = None) -> MountEntry | None:
    """The mount ``path`` lies on, by mountinfo alone (never a stat, so never a FUSE call).

    That is the mount with the longest mountpoint that is ``path`` or one of
    its ancestors; of several stacked at that mountpoint, the last (visible)
    one. ``path`` must be absolute, normalised and free of symlinks
    (``os.path.realpath``), as mountinfo's paths are.
    """
    best: MountEntry | None = None
    for entry in read_mountinfo() if entries is None else entries:
        if is_within(path, entry.mountpoint) and (
            best is None or len(entry.mountpoint) >= len(best.mountpoint)
        ):
            best = entry
    return best


def bind_mounts_of(node: MountEntry) -> list[MountEntry]:
    """Every other mount of the same filesystem as ``node`` (its bind mounts and their copies)."""
    return [e for e in read_mountinfo() if e.device == node.device and e.mount_id != node.mount_id]


def is_dead(path: str) -> bool:
    """True if ``path`` is a FUSE mount whose daemon is gone (statfs fails with ENOTCONN)."""
    return is_dead_mount(path)


def parse_flags(flags: list[str] | tuple[str, ...]) -> int:
    """Turn CSI ``mount_flags`` (each may be comma-separated) into mount(2) flags.

    :data:`BIND_FLAGS` are honoured (set on the bind mount), :data:`NOOP_FLAGS`
    accepted without effect, everything else refused.

    Raises:
        ValueError: a flag a bind mount cannot carry or that would lift a
            restriction of the node mount (:data:`LIFTING_FLAGS`); names it.
    """
    result = 0
    for group in flags:
        for flag in group.split(","):
            flag = flag.strip()
            if not flag or flag in NOOP_FLAGS:
                continue
            if flag in LIFTING_FLAGS:
                raise ValueError(
                    f"mount flag {flag!r} is not supported: a volume keeps the "
                    "node mount's flags (nosuid,nodev by default) and can only add "
                    f"{', '.join(sorted(BIND_FLAGS))}"
                )
            if flag not in BIND_FLAGS:
                raise ValueError(
                    f"mount flag {flag!r} is not supported for a bind mount "
                    f"(supported: {', '.join(sorted(BIND_FLAGS))})"
                )
            result |= BIND_FLAGS[flag]
    return result


def bind_mount(source: str, target: str) -> None:
    """Bind-mount directory ``source`` at ``target`` (mount(2) with MS_BIND, not recursive).

    Raises:
        OSError: from mount(2), e.g. ENOENT for a missing target.
    """
    syscalls.mount(source, target, "", MS_BIND, "")


def remount_bind(target: str, flags: int, current: MountEntry | None = None) -> None:
    """Change the per-mount flags of the bind mount at ``target`` (MS_REMOUNT|MS_BIND).

    The mount's existing nosuid/nodev/noexec/atime flags are kept (a remount
    replaces all of them); ``flags`` adds to them, e.g. ``MS_RDONLY``.

    Raises:
        OSError: from mount(2).
    """
    entry = current or top_mount(target)
    keep = 0
    if entry is not None:
        for name in entry.options:
            if name != "ro" and name in BIND_FLAGS:
                keep |= BIND_FLAGS[name]
    syscalls.mount("none", target, "", MS_REMOUNT | MS_BIND | keep | flags, "")


def unmount(target: str) -> None:
    """Unmount the top mount at ``target``; detach lazily if it is busy.

    A dead FUSE bind mount (daemon gone) unmounts like any other.

    Raises:
        OSError: from umount2(2) (EINVAL if nothing is mounted there).
    """
    try:
        syscalls.umount2(target, 0)
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise
        syscalls.umount2(target, syscalls.MNT_DETACH)
