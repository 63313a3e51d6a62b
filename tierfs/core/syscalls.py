"""Linux system calls the standard library does not expose, through ctypes.

Each wrapper raises ``OSError`` with the kernel's errno, like ``os`` does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import os
import struct

from tierfs.core.mounts import mount_entry

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

AT_FDCWD = -100
AT_SYMLINK_NOFOLLOW = 0x100
AT_EMPTY_PATH = 0x1000
UTIME_NOW = (1 << 30) - 1
UTIME_OMIT = (1 << 30) - 2

MS_NOSUID = 2
MS_NODEV = 4
MNT_FORCE = 1
MNT_DETACH = 2

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2

_libc.renameat2.argtypes = [
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.c_uint,
]
_libc.fchownat.argtypes = [
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.c_uint,
    ctypes.c_uint,
    ctypes.c_int,
]
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_char_p,
]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.linkat.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
_libc.name_to_handle_at.argtypes = [
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_int),
    ctypes.c_int,
]
_libc.open_by_handle_at.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]

MAX_HANDLE_SZ = 128
_FILE_HANDLE_HEAD = struct.Struct("=Ii")  # handle_bytes, handle_type


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc.utimensat.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(_Timespec), ctypes.c_int]


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def renameat2(olddirfd: int, oldname: bytes, newdirfd: int, newname: bytes, flags: int) -> None:
    """renameat2(2): ``flags`` is 0, RENAME_NOREPLACE or RENAME_EXCHANGE."""
    _check(_libc.renameat2(olddirfd, oldname, newdirfd, newname, flags), "renameat2")


def fchown_empty(fd: int, uid: int, gid: int) -> None:
    """Change owner of the object ``fd`` refers to (works on O_PATH fds and symlinks).

    ``-1`` leaves a field unchanged, as chown(2) says.
    """
    _check(_libc.fchownat(fd, b"", uid & 0xFFFFFFFF, gid & 0xFFFFFFFF, AT_EMPTY_PATH), "fchownat")


def utimens_empty(
    fd: int,
    atime_ns: int | None,
    mtime_ns: int | None,
    atime_now: bool = False,
    mtime_now: bool = False,
) -> None:
    """Set access/modification times (nanoseconds) of the object ``fd`` refers to.

    ``None`` leaves a time unchanged; ``*_now`` sets it to the current time.
    """
    ts = (_Timespec * 2)()
    for i, (value, now) in enumerate(((atime_ns, atime_now), (mtime_ns, mtime_now))):
        if now:
            ts[i].tv_sec, ts[i].tv_nsec = 0, UTIME_NOW
        elif value is None:
            ts[i].tv_sec, ts[i].tv_nsec = 0, UTIME_OMIT
        else:
            ts[i].tv_sec, ts[i].tv_nsec = divmod(value, 1_000_000_000)
    _check(_libc.utimensat(fd, b"", ts, AT_EMPTY_PATH), "utimensat")


def link_empty(fd: int, newdirfd: int, newname: bytes) -> None:
    """Create hard link ``newname`` in ``newdirfd`` to the object ``fd`` refers to.

    Uses linkat(AT_EMPTY_PATH), which needs CAP_DAC_READ_SEARCH; falls back
    to the /proc/self/fd magic link otherwise.
    """
    if _libc.linkat(fd, b"", newdirfd, newname, AT_EMPTY_PATH) == 0:
        return
    err = ctypes.get_errno()
    if err not in (1, 2):  # EPERM, ENOENT: no capability
        raise OSError(err, f"linkat: {os.strerror(err)}")
    os.link(f"/proc/self/fd/{fd}", newname, dst_dir_fd=newdirfd, follow_symlinks=True)


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    """fallocate(2) with any mode (os.posix_fallocate only knows mode 0)."""
    _check(_libc.fallocate(fd, mode, offset, length), "fallocate")


def mount(source: str, target: str, fstype: str, flags: int, data: str) -> None:
    """mount(2)."""
    _check(
        _libc.mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode()),
        f"mount {target}",
    )


# new mount API (Linux 5.2; the same numbers on every architecture)
_SYS_FSCONFIG = 431
_SYS_FSPICK = 433
_FSPICK_CLOEXEC = 1
_FSPICK_NO_AUTOMOUNT = 4
_FSCONFIG_SET_STRING = 1
_FSCONFIG_CMD_RECONFIGURE = 7
_libc.syscall.restype = ctypes.c_long


def reconfigure(target: str, params: dict[str, str]) -> None:
    """Change superblock parameters of the filesystem mounted at ``target`` (e.g. tmpfs
    ``size``), leaving the others and the mount's own flags as they are.

    fspick(2) + fsconfig(2) ``FSCONFIG_CMD_RECONFIGURE``; on a kernel without
    them, ``mount(MS_REMOUNT)`` with the mount's current flags.

    Raises:
        OSError: EINVAL if ``target`` is not a mount root or a value is refused
            (tmpfs: a size below what it holds), EPERM without CAP_SYS_ADMIN.
    """
    fd = _libc.syscall(
        _SYS_FSPICK, AT_FDCWD, target.encode(), _FSPICK_CLOEXEC | _FSPICK_NO_AUTOMOUNT
    )
    if fd < 0:
        err = ctypes.get_errno()
        if err != 38:  # ENOSYS
            raise OSError(err, f"fspick {target}: {os.strerror(err)}")
        _remount(target, params)
        return
    try:
        for key, value in params.items():
            _check(
                _libc.syscall(
                    _SYS_FSCONFIG, fd, _FSCONFIG_SET_STRING, key.encode(), value.encode(), 0
                ),
                f"fsconfig {key}",
            )
        _check(
            _libc.syscall(_SYS_FSCONFIG, fd, _FSCONFIG_CMD_RECONFIGURE, None, None, 0),
            f"reconfigure {target}",
        )
    finally:
        os.close(fd)


_MOUNT_FLAGS = {
    "ro": 1,
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": 8,
    "noatime": 1024,
    "nodiratime": 2048,
    "relatime": 1 << 21,
}
MS_REMOUNT = 32


def _remount(target: str, params: dict[str, str]) -> None:
    entry = mount_entry(target)
    if entry is None:
        raise OSError(22, f"{target} is not a mount point")
    flags = MS_REMOUNT
    for opt in entry["options"].split(","):
        flags |= _MOUNT_FLAGS.get(opt, 0)
    mount("", target, "", flags, ",".join(f"{k}={v}" for k, v in params.items()))


def umount2(target: str, flags: int = 0) -> None:
    """umount2(2); ``flags`` may hold MNT_DETACH."""
    _check(_libc.umount2(target.encode(), flags), f"umount {target}")


def ioctl_buf(fd: int, request: int, buf: bytes) -> int:
    """ioctl(2) with an input buffer; returns the ioctl's (non-negative) result.

    Raises:
        OSError: the ioctl's errno.
    """
    return fcntl.ioctl(fd, request, bytearray(buf), True)


def name_to_handle(fd: int) -> bytes:
    """name_to_handle_at(fd, "", AT_EMPTY_PATH): the object's file handle, as opaque bytes.

    Raises:
        OSError: EOPNOTSUPP if the filesystem has no file handles.
    """
    buf = ctypes.create_string_buffer(_FILE_HANDLE_HEAD.size + MAX_HANDLE_SZ)
    _FILE_HANDLE_HEAD.pack_into(buf, 0, MAX_HANDLE_SZ, 0)
    mount_id = ctypes.c_int()
    _check(
        _libc.name_to_handle_at(fd, b"", buf, ctypes.byref(mount_id), AT_EMPTY_PATH),
        "name_to_handle_at",
    )
    size, _type = _FILE_HANDLE_HEAD.unpack_from(buf, 0)
    return buf.raw[: _FILE_HANDLE_HEAD.size + size]


def open_by_handle(mount_fd: int, handle: bytes, flags: int) -> int:
    """open_by_handle_at(2): open the object ``handle`` names; returns a new descriptor.

    ``mount_fd`` is any ordinary (not ``O_PATH``) descriptor on the same
    filesystem. Needs CAP_DAC_READ_SEARCH.

    Raises:
        OSError: ESTALE if the object is gone, EPERM without the capability.
    """
    buf = ctypes.create_string_buffer(handle, len(handle))
    return _check(_libc.open_by_handle_at(mount_fd, buf, flags), "open_by_handle_at")


def identity(path: str) -> bytes | None:
    """What tells the object at ``path`` (not followed if a symlink) from one made
    later under the same name (:func:`identity_of`); None if nothing is there."""
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return identity_of(fd)
    except OSError:
        return None
    finally:
        os.close(fd)


def identity_of(fd: int) -> bytes:
    """What tells the object ``fd`` refers to from one made later under its name: its
    file handle (inode number and generation on tmpfs), else device and inode number
    where the filesystem has no handles.

    Raises:
        OSError: ``fd`` cannot be stat'ed (EBADF).
    """
    try:
        return name_to_handle(fd)
    except OSError:
        st = os.fstat(fd)
        return f"{st.st_dev}:{st.st_ino}".encode()
