"""The RAM store: the directory on tmpfs that holds every byte tierfs keeps.

Layout of ``--ram-dir`` (DESIGN.md principle 1)::

    <ram-dir>/
      view/                 the client-visible tree, served as the mount root
      store/
        shards/<job>/<rank>/<step>/   sealed snapshots and peers' replicas
        incoming/<id>/      transfers in progress (peer receive, GCS download)
        trash/<id>/         hidden client entries and withdrawn snapshots
        state.json          the node agent's small state file
        daemon.pid, daemon.log

Everything lives on one filesystem so that sealing is a hard link and hiding
is a rename. A restarted daemon finds the same tree and re-serves it.

The budget is the amount of RAM tierfs may fill. Two accounting modes:

* ``native``: the budget is what the filesystem under the ram-dir can still
  hold; the filesystem itself returns ENOSPC and the kernel may pass file
  data straight through to it (FUSE passthrough).
* ``managed``: ``--size`` is smaller than that, so tierfs counts the bytes
  itself (filesystem usage minus what others used when tierfs started) and
  refuses growth past the budget with ENOSPC. Writes then go through the
  daemon (no passthrough).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import uuid
from dataclasses import dataclass

log = logging.getLogger(__name__)

TMPFS_MAGIC = 0x01021994


def fs_type(path: str) -> str:
    """The filesystem type of ``path`` as /proc/self/mountinfo names it ("tmpfs", "ext4", ...)."""
    best, best_type = "", "unknown"
    real = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5:
                    continue
                mnt = fields[4].replace("\\040", " ")
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, best_type = mnt, right.split()[0]
    except OSError:
        pass
    return best_type


@dataclass(frozen=True, slots=True)
class StatFs:
    """What ``statfs`` reports through the mount (all counts in ``bsize`` blocks)."""

    bsize: int
    blocks: int
    bfree: int
    bavail: int
    files: int
    ffree: int
    namelen: int = 255


class Budget:
    """The RAM budget of one RAM store.

    Args:
        root: the ram-dir (any path on the store's filesystem).
        size: the budget in bytes, or None for "what the filesystem can hold".
        used_at_start: bytes the store already holds when the daemon starts
            (counted by :meth:`RamStore.usage`).
    """

    def __init__(self, root: str, size: int | None, used_at_start: int) -> None:
        self.root = root
        vfs = os.statvfs(root)
        fs_used = (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize
        fs_avail = vfs.f_bavail * vfs.f_frsize
        #: bytes on the filesystem that are not ours (other tenants of a shared tmpfs)
        self.foreign = max(0, fs_used - used_at_start)
        native_capacity = used_at_start + fs_avail
        if size is None or size >= native_capacity:
            self.mode = "native"
            self.size = native_capacity if size is None else min(size, native_capacity)
        else:
            self.mode = "managed"
            self.size = size

    @property
    def native(self) -> bool:
        """True when the filesystem itself enforces the budget."""
        return self.mode == "native"

    def used(self) -> int:
        """Bytes the store holds now (filesystem usage minus foreign usage)."""
        vfs = os.statvfs(self.root)
        return max(0, (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize - self.foreign)

    def free(self) -> int:
        """Bytes that can still be written before ENOSPC."""
        if self.native:
            vfs = os.statvfs(self.root)
            return vfs.f_bavail * vfs.f_frsize
        return max(0, self.size - self.used())

    def check_growth(self, nbytes: int) -> None:
        """Raise ``OSError(ENOSPC)`` if ``nbytes`` more bytes would pass the budget.

        Only meaningful in managed mode; in native mode the filesystem answers.
        """
        if nbytes > 0 and not self.native and self.used() + nbytes > self.size:
            raise OSError(errno.ENOSPC, "tierfs RAM budget exhausted")

    def statfs(self) -> StatFs:
        """The budget as a statfs answer: total = budget, free = what is left."""
        vfs = os.statvfs(self.root)
        bsize = vfs.f_frsize or 4096
        if self.native:
            total = (self.size + bsize - 1) // bsize
            return StatFs(bsize, total, min(total, vfs.f_bfree), min(total, vfs.f_bavail),
                          vfs.f_files, vfs.f_ffree, vfs.f_namemax)
        free = self.free() // bsize
        return StatFs(bsize, self.size // bsize, free, free, vfs.f_files, vfs.f_ffree,
                      vfs.f_namemax)


class RamStore:
    """Paths and housekeeping of one ram-dir (see the module docstring).

    Args:
        root: the ram-dir; created if missing.

    Raises:
        OSError: the directory cannot be created or is not writable.
    """

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.view = os.path.join(self.root, "view")
        self.store = os.path.join(self.root, "store")
        self.shards = os.path.join(self.store, "shards")
        self.incoming = os.path.join(self.store, "incoming")
        self.trash = os.path.join(self.store, "trash")
        for d in (self.root, self.view, self.store, self.shards, self.incoming, self.trash):
            os.makedirs(d, exist_ok=True)
        os.chmod(self.store, 0o700)

    @property
    def state_file(self) -> str:
        return os.path.join(self.store, "state.json")

    @property
    def pid_file(self) -> str:
        return os.path.join(self.store, "daemon.pid")

    @property
    def log_file(self) -> str:
        return os.path.join(self.store, "daemon.log")

    def on_tmpfs(self) -> bool:
        """True when the ram-dir lives on tmpfs (bytes in RAM, not on a disk)."""
        return fs_type(self.root) in ("tmpfs", "ramfs")

    def usage(self) -> int:
        """Bytes allocated by everything under the ram-dir (hard links counted once)."""
        seen: set[int] = set()
        total = 0
        for dirpath, dirnames, filenames in os.walk(self.root):
            for name in dirnames + filenames:
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except OSError:
                    continue
                if st.st_ino in seen:
                    continue
                seen.add(st.st_ino)
                total += st.st_blocks * 512
        return total

    def new_incoming(self, prefix: str = "in") -> str:
        """Create and return a fresh directory under ``incoming/``."""
        path = os.path.join(self.incoming, f"{prefix}-{uuid.uuid4().hex[:12]}")
        os.makedirs(path)
        return path

    def to_trash(self, path: str) -> str:
        """Move ``path`` (inside the ram-dir) to ``trash/`` with one rename; returns where."""
        dest = os.path.join(self.trash, f"{uuid.uuid4().hex[:12]}-{os.path.basename(path)}")
        os.rename(path, dest)
        return dest

    def empty_trash(self) -> int:
        """Delete everything in ``trash/`` and ``incoming/`` leftovers; returns entries removed.

        Blocking (may free many GiB): call from a worker thread.
        """
        removed = 0
        for name in os.listdir(self.trash):
            p = os.path.join(self.trash, name)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                try:
                    os.unlink(p)
                except OSError:
                    continue
            removed += 1
        return removed

    def clear_incoming(self) -> None:
        """Drop transfers a previous daemon left unfinished (called once at start)."""
        for name in os.listdir(self.incoming):
            os.rename(os.path.join(self.incoming, name), os.path.join(self.trash, f"inc-{name}"))
