"""The FUSE kernel wire protocol: opcodes, flags and structure layouts.

Source of truth: the Linux UAPI header ``include/uapi/linux/fuse.h`` (protocol
7.40+, Linux 6.9+ for passthrough). Only what tierfs speaks is described here.
All structures are little-endian and padded to 64 bits exactly as the kernel
lays them out on x86_64 and aarch64. This module is pure data: no I/O.
"""

from __future__ import annotations

import functools
import os
import stat
import struct
from typing import NamedTuple

KERNEL_VERSION = 7
#: Highest minor version tierfs speaks. Older kernels negotiate down.
KERNEL_MINOR_VERSION = 40
#: Lowest minor version tierfs accepts (fuse_in_header.total_extlen, init flags2).
MIN_MINOR_VERSION = 36

ROOT_ID = 1


class Op:
    """FUSE opcodes (``enum fuse_opcode``)."""

    LOOKUP = 1
    FORGET = 2
    GETATTR = 3
    SETATTR = 4
    READLINK = 5
    SYMLINK = 6
    MKNOD = 8
    MKDIR = 9
    UNLINK = 10
    RMDIR = 11
    RENAME = 12
    LINK = 13
    OPEN = 14
    READ = 15
    WRITE = 16
    STATFS = 17
    RELEASE = 18
    FSYNC = 20
    SETXATTR = 21
    GETXATTR = 22
    LISTXATTR = 23
    REMOVEXATTR = 24
    FLUSH = 25
    INIT = 26
    OPENDIR = 27
    READDIR = 28
    RELEASEDIR = 29
    FSYNCDIR = 30
    GETLK = 31
    SETLK = 32
    SETLKW = 33
    ACCESS = 34
    CREATE = 35
    INTERRUPT = 36
    BMAP = 37
    DESTROY = 38
    IOCTL = 39
    POLL = 40
    NOTIFY_REPLY = 41
    BATCH_FORGET = 42
    FALLOCATE = 43
    READDIRPLUS = 44
    RENAME2 = 45
    LSEEK = 46
    COPY_FILE_RANGE = 47
    SETUPMAPPING = 48
    REMOVEMAPPING = 49
    SYNCFS = 50
    TMPFILE = 51
    STATX = 52

    @classmethod
    def name(cls, code: int) -> str:
        for key, value in vars(cls).items():
            if value == code and key.isupper():
                return key
        return f"OP{code}"


class Notify:
    """Unsolicited notification codes (``enum fuse_notify_code``)."""

    INVAL_INODE = 2
    INVAL_ENTRY = 3
    DELETE = 6


# INIT flags (fuse_init_in.flags | flags2 << 32)
FUSE_ASYNC_READ = 1 << 0
FUSE_POSIX_LOCKS = 1 << 1
FUSE_ATOMIC_O_TRUNC = 1 << 3
FUSE_EXPORT_SUPPORT = 1 << 4
FUSE_BIG_WRITES = 1 << 5
FUSE_DONT_MASK = 1 << 6
FUSE_FLOCK_LOCKS = 1 << 10
FUSE_AUTO_INVAL_DATA = 1 << 12
FUSE_DO_READDIRPLUS = 1 << 13
FUSE_ASYNC_DIO = 1 << 15
FUSE_WRITEBACK_CACHE = 1 << 16
FUSE_PARALLEL_DIROPS = 1 << 18
FUSE_MAX_PAGES = 1 << 22
#: the daemon clears set-user-ID/set-group-ID on write, truncate and chown (it is told
#: when: FUSE_WRITE_KILL_SUIDGID, FATTR_KILL_SUIDGID, FUSE_OPEN_KILL_SUIDGID); in return
#: the superblock gets SB_NOSEC, so a write(2) no longer costs a GETXATTR round trip
#: ("security.capability") once an inode was found clean
FUSE_HANDLE_KILLPRIV_V2 = 1 << 28
FUSE_CACHE_SYMLINKS = 1 << 23
FUSE_INIT_EXT = 1 << 30
FUSE_DIRECT_IO_ALLOW_MMAP = 1 << 36
FUSE_PASSTHROUGH = 1 << 37

# fuse_open_out.open_flags
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_PASSTHROUGH = 1 << 7

# fuse_setattr_in.valid
FATTR_MODE = 1 << 0
FATTR_UID = 1 << 1
FATTR_GID = 1 << 2
FATTR_SIZE = 1 << 3
FATTR_ATIME = 1 << 4
FATTR_MTIME = 1 << 5
FATTR_FH = 1 << 6
FATTR_ATIME_NOW = 1 << 7
FATTR_MTIME_NOW = 1 << 8
FATTR_CTIME = 1 << 10
#: (HANDLE_KILLPRIV_V2) a truncate or chown by a caller without CAP_FSETID
FATTR_KILL_SUIDGID = 1 << 11

# fuse_open_in.open_flags / fuse_create_in.open_flags
FUSE_OPEN_KILL_SUIDGID = 1 << 0  # (HANDLE_KILLPRIV_V2) O_TRUNC by a caller without CAP_FSETID

# fuse_write_in.write_flags
FUSE_WRITE_CACHE = 1 << 0  # a page-cache writeback (mmap, writeback cache), not a write(2)
#: the writer lacks CAP_FSETID: clear S_ISUID (and S_ISGID with group exec) as Linux's
#: write(2) does. Set on every direct-I/O write, whatever INIT negotiated.
FUSE_WRITE_KILL_SUIDGID = 1 << 2

FUSE_GETATTR_FH = 1 << 0
FUSE_FSYNC_FDATASYNC = 1 << 0

# renameat2(2) flags
RENAME_NOREPLACE = 1 << 0
RENAME_EXCHANGE = 1 << 1
RENAME_WHITEOUT = 1 << 2

# ioctls on /dev/fuse: _IOW(229, 1, struct fuse_backing_map) and _IOW(229, 2, uint32_t)
FUSE_DEV_IOC_BACKING_OPEN = (1 << 30) | (16 << 16) | (229 << 8) | 1
FUSE_DEV_IOC_BACKING_CLOSE = (1 << 30) | (4 << 16) | (229 << 8) | 2

MIN_READ_BUFFER = 8192

IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid extlen pad
OUT_HEADER = struct.Struct("<IiQ")  # len error unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
ENTRY_OUT_HEAD = struct.Struct("<QQQQII")  # nodeid generation entry_valid attr_valid nsec nsec
ATTR_OUT_HEAD = struct.Struct("<QII")  # attr_valid attr_valid_nsec dummy
INIT_IN = struct.Struct("<IIIII")  # major minor max_readahead flags flags2 (+ unused)
INIT_OUT = struct.Struct("<IIIIHHIIHHIIH22x")
GETATTR_IN = struct.Struct("<IIQ")
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")
OPEN_IN = struct.Struct("<II")
CREATE_IN = struct.Struct("<IIII")
OPEN_OUT = struct.Struct("<QIi")
RELEASE_IN = struct.Struct("<QIIQ")
FLUSH_IN = struct.Struct("<QIIQ")
READ_IN = struct.Struct("<QQIIQII")
WRITE_IN = struct.Struct("<QQIIQII")
WRITE_OUT = struct.Struct("<II")
STATFS_OUT = struct.Struct("<QQQQQIIII24x")
FSYNC_IN = struct.Struct("<QII")
SETXATTR_IN = struct.Struct("<II")
GETXATTR_IN = struct.Struct("<II")
GETXATTR_OUT = struct.Struct("<II")
MKNOD_IN = struct.Struct("<IIII")
MKDIR_IN = struct.Struct("<II")
RENAME_IN = struct.Struct("<Q")
RENAME2_IN = struct.Struct("<QII")
LINK_IN = struct.Struct("<Q")
ACCESS_IN = struct.Struct("<II")
FORGET_IN = struct.Struct("<Q")
BATCH_FORGET_IN = struct.Struct("<II")
FORGET_ONE = struct.Struct("<QQ")
FALLOCATE_IN = struct.Struct("<QQQII")
LSEEK_IN = struct.Struct("<QQII")
LSEEK_OUT = struct.Struct("<Q")
COPY_FILE_RANGE_IN = struct.Struct("<QQQQQQQ")
INTERRUPT_IN = struct.Struct("<Q")
DIRENT_HEAD = struct.Struct("<QQII")  # ino off namelen type
NOTIFY_INVAL_ENTRY = struct.Struct("<QII")  # parent namelen flags
NOTIFY_INVAL_INODE = struct.Struct("<Qqq")  # ino off len
NOTIFY_DELETE = struct.Struct("<QQII")  # parent child namelen padding
BACKING_MAP = struct.Struct("<iIQ")  # fd flags padding

ENTRY_OUT_SIZE = ENTRY_OUT_HEAD.size + ATTR.size


def split_names(data: bytes | memoryview, count: int) -> list[bytes]:
    """Split ``count`` NUL-terminated names from the start of ``data``."""
    raw = bytes(data)
    parts = raw.split(b"\0", count)
    if len(parts) < count + 1 and not (len(parts) == count and raw.endswith(b"\0")):
        raise ValueError("truncated name list")
    return parts[:count]


def pack_attr(st: os.stat_result, nodeid: int, mtime_ns: int | None = None) -> bytes:
    """Encode ``st`` (an ``os.stat_result`` of the backing object) as ``fuse_attr``.

    The inode number reported is the FUSE ``nodeid`` so that ``stat`` through
    the mount and hard-link identity stay consistent with lookups. ``mtime_ns``
    replaces ``st.st_mtime_ns`` when given (another rank's file being fetched,
    :meth:`tierfs.fuse.remote.RemoteFiles.shown_mtime`).
    """
    mtime = st.st_mtime_ns if mtime_ns is None else mtime_ns
    return ATTR.pack(
        nodeid,
        st.st_size,
        st.st_blocks,
        st.st_atime_ns // 1_000_000_000,
        mtime // 1_000_000_000,
        st.st_ctime_ns // 1_000_000_000,
        st.st_atime_ns % 1_000_000_000,
        mtime % 1_000_000_000,
        st.st_ctime_ns % 1_000_000_000,
        st.st_mode,
        st.st_nlink,
        st.st_uid,
        st.st_gid,
        st.st_rdev & 0xFFFFFFFF,
        4096,
        0,
    )


@functools.lru_cache(maxsize=16)  # a mount has two timeouts; every entry reply splits them
def split_timeout(seconds: float) -> tuple[int, int]:
    """Seconds as a (whole seconds, nanoseconds) pair for ``*_valid`` fields."""
    whole = int(seconds)
    return whole, int((seconds - whole) * 1_000_000_000)


def pack_entry(
    nodeid: int,
    st: os.stat_result,
    entry_timeout: float,
    attr_timeout: float,
    mtime_ns: int | None = None,
) -> bytes:
    """Encode a ``fuse_entry_out`` for ``nodeid`` with the given cache timeouts (seconds)
    (``mtime_ns``: as :func:`pack_attr`)."""
    es, ens = split_timeout(entry_timeout)
    as_, ans = split_timeout(attr_timeout)
    return ENTRY_OUT_HEAD.pack(nodeid, 0, es, as_, ens, ans) + pack_attr(st, nodeid, mtime_ns)


def pack_attr_out(
    nodeid: int, st: os.stat_result, attr_timeout: float, mtime_ns: int | None = None
) -> bytes:
    """Encode a ``fuse_attr_out`` (``mtime_ns``: as :func:`pack_attr`)."""
    s, ns = split_timeout(attr_timeout)
    return ATTR_OUT_HEAD.pack(s, ns, 0) + pack_attr(st, nodeid, mtime_ns)


def dirent_type(mode: int) -> int:
    """The ``DT_*`` value of a mode (``S_IFMT >> 12``), as readdir reports it."""
    return stat.S_IFMT(mode) >> 12


def pack_dirent(ino: int, cookie: int, name: bytes, mode: int) -> bytes:
    """Encode one ``fuse_dirent`` padded to 8 bytes."""
    head = DIRENT_HEAD.pack(ino, cookie, len(name), dirent_type(mode))
    raw = head + name
    return raw + b"\0" * (-len(raw) % 8)


class RequestHeader(NamedTuple):
    """A decoded ``fuse_in_header`` (a tuple: decoded for every request, so it is cheap)."""

    length: int
    opcode: int
    unique: int
    nodeid: int
    uid: int
    gid: int
    pid: int

    @classmethod
    def decode(cls, buf: bytes | bytearray | memoryview) -> RequestHeader:
        return cls._make(_HEADER7.unpack_from(buf))


_HEADER7 = struct.Struct("<IIQQIII")  # IN_HEADER without total_extlen and padding
