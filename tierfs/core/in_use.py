"""Whether a file in the RAM store is open or memory-mapped by anyone else.

The whole-step view drops other ranks' fetched files for room by punching
their bytes out (:mod:`tierfs.node.remote_view`). A FUSE handle on the file is
visible to the daemon, but a memory map is not always: with FUSE passthrough
the kernel maps the store's (backing) file itself into the client
(``fuse_passthrough_mmap`` → ``backing_file_mmap`` → ``vma_set_file``), so a
client that maps the file and closes its descriptor (``safetensors.load_file``,
``numpy.load(mmap_mode='r')``, ``torch.load(mmap=True)``) releases the FUSE
handle while its map still reads the store's pages. Punching the file then
turns the map into zeros with no error (#14 trial 50).

The map keeps its file open (the VMA holds the ``struct file``), so the
question is whether the store's inode is open through any open file
description other than the daemon's own. The kernel answers it for a write
lease: ``fcntl(F_SETLEASE, F_WRLCK)`` is granted only when the caller's
description is the inode's only reader or writer (fs/locks.c,
``check_conflicting_open``: ``i_writecount`` and ``i_readcount``), and
refused with EAGAIN otherwise. The lease is given back at once.

Where leases are off (``/proc/sys/fs/leases-enable`` = 0) the fallback reads
``/proc/<pid>/maps`` of every process this daemon can see (maps only; a
container's daemon sees only its own PID namespace's processes).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import stat

log = logging.getLogger(__name__)

_warned = False


def open_elsewhere(fd: int) -> bool:
    """Whether the regular file ``fd`` refers to is open through another open file
    description: another ``open(2)`` of it by any process, or a memory map whose
    descriptor was closed (including the backing file a FUSE passthrough map holds).

    :func:`lease_refused`, else (leases off) :func:`mapped_by_a_process`, which
    blocks: call this from a worker thread, or call the two apart.

    Raises:
        OSError: EBADF for a closed ``fd``, EINVAL for anything but a regular file.
    """
    refused = lease_refused(fd)
    if refused is not None:
        return refused
    st = os.fstat(fd)
    return mapped_by_a_process(st.st_dev, st.st_ino)


def lease_refused(fd: int) -> bool | None:
    """The lease half of :func:`open_elsewhere`: True if the kernel refuses a write
    lease on ``fd``'s file (another description has it open or mapped), False if
    granted (and given back at once), None where leases are not available (then
    ask :func:`mapped_by_a_process`, in a worker thread).

    ``fd`` must be this caller's only description of the file (read-only or
    read-write). Cost: two ``fcntl(2)`` calls (never blocks). If another process
    opens the file in the microseconds the lease is held, the kernel makes that
    open wait until the lease is given back and sends this process SIGURG
    (ignored by default) instead of the default SIGIO, which would end it.

    Raises:
        OSError: EBADF for a closed ``fd``, EINVAL for anything but a regular file.
    """
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise OSError(errno.EINVAL, "not a regular file")
    try:
        fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EBUSY):
            return True
        if exc.errno not in (errno.EINVAL, errno.ENOLCK, errno.EPERM, errno.EACCES):
            raise
        _warn_once(exc)
        return None
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    return False


def _warn_once(exc: OSError) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning(
            "file leases are not available here (%s): whether another rank's fetched "
            "file is memory-mapped is read from /proc/<pid>/maps, which shows only this "
            "PID namespace's processes",
            exc,
        )


def mapped_by_a_process(dev: int, ino: int, proc: str = "/proc") -> bool:
    """Whether any process listed under ``proc`` maps the file ``dev``/``ino``
    (``st_dev``, ``st_ino``), read from ``/proc/<pid>/maps`` (proc(5): the
    ``dev`` column is ``major:minor`` in hex). Processes that end or cannot be
    read meanwhile are skipped. Blocking; cost grows with the processes' maps."""
    want = f"{os.major(dev):02x}:{os.minor(dev):02x}"
    inode = str(ino)
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        try:
            with open(os.path.join(proc, pid, "maps"), encoding="utf-8", errors="replace") as f:
                for line in f:
                    cols = line.split(None, 5)
                    if len(cols) >= 5 and cols[4] == inode and cols[3] == want:
                        return True
        except OSError:
            continue
    return False
