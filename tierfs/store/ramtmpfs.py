"""The ram-dir's own tmpfs: a RAM budget (``--size``) that the kernel enforces.

A budget below what the ram-dir's filesystem can hold (``--size 8GiB`` on a
/dev/shm of half the node's memory) used to make tierfs count bytes itself,
which needs every write to go through the daemon: no FUSE passthrough, about
half of tmpfs speed. Instead, tierfs mounts a tmpfs of exactly the budget on
the ram-dir (source ``tierfs-ram`` in /proc/self/mountinfo, mode 0700). The
kernel then answers ENOSPC when the budget is full, ``statfs`` is the budget
exactly, and file data keeps passthrough.

Lifetime: the tmpfs belongs to the ram-dir, not to a daemon. It stays mounted
when the daemon exits, is killed or is unmounted with ``tierfs unmount``, so
the RAM store survives restarts as before; the next ``tierfs mount`` with the
same ram-dir finds it (by its source name) and uses it again, resized if
``--size`` changed. ``rm -rf <ram-dir>`` frees its bytes as before, and
leaves the empty mount point (``rmdir`` of a mount point is EBUSY);
``umount <ram-dir>`` (or :func:`discard`) releases the tmpfs itself.

When a tmpfs of its own cannot be used, tierfs counts bytes itself as before
(the "managed" budget of :mod:`tierfs.store.ramstore`), and :func:`plan` says
why: not root (mounting needs CAP_SYS_ADMIN, as passthrough does), a ram-dir
that is not on tmpfs, one that already holds a store on a shared filesystem
(its bytes would be hidden by a new mount), or one that is itself another
mount point (tierfs never stacks a mount on one it did not make: in a
container such a mount would vanish with the container, taking the RAM store
with it; see :func:`fit_volume` for a volume of tierfs's own).

Policy (:func:`plan`) is a pure function over :class:`RamDirFacts`;
:func:`facts` gathers them and :func:`prepare` acts.
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass

from tierfs.core import syscalls
from tierfs.core.config import format_size
from tierfs.core.mounts import fs_type, mount_entry

log = logging.getLogger(__name__)

#: the mount source that marks a tmpfs as a tierfs ram-dir's own
SOURCE = "tierfs-ram"
RAM_FS_TYPES = ("tmpfs", "ramfs")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True, slots=True)
class RamDirFacts:
    """What decides how a ram-dir gets its budget.

    Attributes:
        mounted: what is mounted exactly at the ram-dir: ``"ours"`` (a
            ``tierfs-ram`` tmpfs), ``"other"`` (any other mount), or None.
        capacity: total bytes of the filesystem holding the ram-dir now.
        below: total bytes of the filesystem the ram-dir's directory sits on
            (its parent's; equals ``capacity`` when nothing is mounted there).
        used: bytes in use on the filesystem holding the ram-dir.
        fs_type: type of the filesystem holding the ram-dir ("tmpfs", "ext4", ...).
        empty: the ram-dir is missing or an empty directory.
        root: the caller is root (may mount).
    """

    mounted: str | None
    capacity: int
    below: int
    used: int
    fs_type: str
    empty: bool
    root: bool


@dataclass(frozen=True, slots=True)
class Plan:
    """What :func:`prepare` does (or did).

    Attributes:
        action: ``"none"`` (the filesystem as it is enforces the budget, or no
            ``--size``), ``"mount"`` (a new tmpfs of ``size`` bytes),
            ``"resize"`` (our tmpfs to ``size`` bytes), ``"reuse"`` (our tmpfs
            as it is) or ``"managed"`` (tierfs counts bytes; ``reason`` says why).
        size: bytes of the tmpfs for ``mount``/``resize``/``reuse``, else None.
        reason: a sentence for the log or a warning.
    """

    action: str
    size: int | None = None
    reason: str = ""

    @property
    def managed(self) -> bool:
        return self.action == "managed"


def plan(f: RamDirFacts, size: int | None) -> Plan:
    """Decide how the ram-dir described by ``f`` gets a budget of ``size`` bytes.

    ``size`` None means "what the filesystem holds": a tmpfs of our own is
    reused at its size, anything else is used as it is. A budget larger than
    the filesystem below is capped to it (as without a tmpfs of our own).
    """
    if size is not None:
        size -= size % PAGE_SIZE  # tmpfs rounds up to pages: never more than the budget
    if f.mounted == "ours":
        if size is None:
            return Plan("reuse", f.capacity, "the ram-dir's own tmpfs, as it is")
        want = min(size, f.below)
        if want == f.capacity:
            return Plan("reuse", want, "the ram-dir's own tmpfs has the size asked for")
        if f.used > want:
            return Plan(
                "managed",
                None,
                f"the ram-dir's tmpfs already holds {format_size(f.used)}, more than "
                f"{format_size(want)}: it keeps its size of {format_size(f.capacity)} "
                "and tierfs counts the budget itself (file data through the daemon); "
                "delete steps and mount again to get passthrough back",
            )
        return Plan("resize", want, f"resizing the ram-dir's tmpfs to {format_size(want)}")
    if size is None or size >= f.capacity:
        return Plan("none")
    hint = "; file data then goes through the daemon (no passthrough)"
    if not f.root:
        return Plan(
            "managed",
            None,
            "only root can mount a tmpfs of the budget's size on "
            "the ram-dir: tierfs counts the budget itself" + hint,
        )
    if f.fs_type not in RAM_FS_TYPES:
        return Plan(
            "managed",
            None,
            f"the ram-dir is on {f.fs_type}, not tmpfs: tierfs counts the budget itself" + hint,
        )
    if f.mounted == "other":
        return Plan(
            "managed",
            None,
            f"the ram-dir is a {f.fs_type} mount point of its own, larger than the "
            "budget: tierfs does not mount over it and counts the budget itself"
            + hint
            + f"; give that mount the budget's size (mount -o remount,size="
            f"{size}) or point --ram-dir at an empty directory",
        )
    if not f.empty:
        return Plan(
            "managed",
            None,
            f"the ram-dir is not empty (a RAM store on a shared {f.fs_type}): "
            "tierfs counts the budget itself" + hint + "; start from an empty or new "
            "ram-dir to have the kernel enforce it",
        )
    return Plan("mount", size, f"mounting a tmpfs of {format_size(size)} on the ram-dir")


def _existing(path: str) -> str:
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _total_used(path: str) -> tuple[int, int]:
    vfs = os.statvfs(path)
    return vfs.f_blocks * vfs.f_frsize, (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize


def mounted_kind(ram_dir: str) -> str | None:
    """``"ours"``, ``"other"`` or None: what is mounted exactly at ``ram_dir``."""
    entry = mount_entry(ram_dir)
    if entry is None:
        return None
    return "ours" if entry["fstype"] == "tmpfs" and entry["source"] == SOURCE else "other"


def facts(ram_dir: str) -> RamDirFacts:
    """Look at ``ram_dir`` (an absolute path, symlinks resolved; it may not exist yet)."""
    ram_dir = os.path.abspath(ram_dir)
    here = _existing(ram_dir)
    mounted = mounted_kind(ram_dir) if here == ram_dir else None
    capacity, used = _total_used(here)
    below = _total_used(os.path.dirname(ram_dir))[0] if mounted else capacity
    if here != ram_dir:
        empty = True
    else:
        try:
            empty = os.path.isdir(ram_dir) and not os.listdir(ram_dir)
        except OSError:
            empty = False
    return RamDirFacts(mounted, capacity, below, used, fs_type(here), empty, os.geteuid() == 0)


def prepare(ram_dir: str, size: int | None) -> Plan:
    """Give ``ram_dir`` a tmpfs of ``size`` bytes where :func:`plan` says so.

    Call before anything is created in the ram-dir, and only once no daemon
    uses it. Creates ``ram_dir`` (mode 0700) for a new tmpfs.

    Returns:
        The plan carried out. A resize the kernel refuses (EINVAL: the tmpfs
        holds more than ``size``; EBUSY) becomes a ``managed`` plan saying so.

    Raises:
        OSError: mounting failed (the error of mount(2)).
    """
    p = plan(facts(ram_dir), size)
    if p.action == "mount":
        assert p.size is not None
        os.makedirs(ram_dir, mode=0o700, exist_ok=True)
        syscalls.mount(
            SOURCE,
            ram_dir,
            "tmpfs",
            syscalls.MS_NOSUID | syscalls.MS_NODEV,
            f"size={p.size},mode=0700",
        )
        log.info("mounted a tmpfs of %s on the ram-dir %s", format_size(p.size), ram_dir)
    elif p.action == "resize":
        assert p.size is not None
        try:
            syscalls.reconfigure(ram_dir, {"size": str(p.size)})
        except OSError as exc:
            return Plan(
                "managed",
                None,
                f"resizing the ram-dir's tmpfs to {format_size(p.size)} failed "
                f"({errno.errorcode.get(exc.errno or 0, exc)}): it keeps its size and "
                "tierfs counts the budget itself (file data through the daemon)",
            )
        log.info("resized the ram-dir's tmpfs %s to %s", ram_dir, format_size(p.size))
    return p


def fit_volume(path: str, size: int) -> str:
    """Shrink the tmpfs mounted at ``path`` (a memory-backed volume of tierfs's own) to ``size``.

    For the CSI driver: Kubernetes may mount a memory-backed emptyDir larger
    than its ``sizeLimit`` (older kubelets: half of the node's memory). The
    DaemonSet gives tierfs that volume alone, so tierfs may resize its tmpfs
    to ``inMemoryVolumeSize``; the kernel then enforces the budget and the
    volume (and every byte in it) stays the kubelet's, surviving container
    restarts. Never call it for a tmpfs others share (/dev/shm).

    Returns:
        What happened, one sentence for the log ("" when nothing was to do).
    """
    entry = mount_entry(path)
    if entry is None or entry["fstype"] != "tmpfs":
        return ""
    size -= size % PAGE_SIZE
    capacity, used = _total_used(path)
    if capacity <= size:
        return ""
    if used > size:
        return (
            f"the RAM volume {path} holds {format_size(used)}, more than the budget "
            f"{format_size(size)}: it keeps its size of {format_size(capacity)} and "
            "tierfs counts the budget itself"
        )
    try:
        syscalls.reconfigure(path, {"size": str(size)})
    except OSError as exc:
        return (
            f"resizing the RAM volume {path} from {format_size(capacity)} to "
            f"{format_size(size)} failed ({errno.errorcode.get(exc.errno or 0, exc)}); "
            "tierfs counts the budget itself"
        )
    return (
        f"resized the RAM volume {path} from {format_size(capacity)} to "
        f"{format_size(size)} (the budget)"
    )


def discard(ram_dir: str) -> bool:
    """Unmount the ram-dir's own tmpfs, freeing every byte in it; True if there was one.

    Raises:
        OSError: umount2(2) failed (EBUSY while a daemon or a reader holds files).
    """
    if mounted_kind(ram_dir) != "ours":
        return False
    syscalls.umount2(ram_dir)
    return True
