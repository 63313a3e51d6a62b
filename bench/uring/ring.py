"""A minimal io_uring for FUSE-over-io_uring commands, from Python through ctypes and mmap.

No liburing (it is not on the machine): ``io_uring_setup(2)`` and
``io_uring_enter(2)`` are called through libc's ``syscall``, the rings are
mapped with :mod:`mmap` and the 128-byte submission entries
(``IORING_SETUP_SQE128``, which FUSE's ``IORING_OP_URING_CMD`` requires for its
80-byte command area) are packed with :mod:`struct`. x86-64 only: the ring
indices are published with plain stores, which the kernel's acquire loads
order correctly under x86's total store order.

Layouts follow ``include/uapi/linux/io_uring.h`` (``struct io_uring_params``,
``io_sqring_offsets``, ``io_cqring_offsets``, ``io_uring_sqe``, ``io_uring_cqe``).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct

SYS_IO_URING_SETUP = 425
SYS_IO_URING_ENTER = 426

IORING_SETUP_COOP_TASKRUN = 1 << 8
IORING_SETUP_SQE128 = 1 << 10
IORING_SETUP_SINGLE_ISSUER = 1 << 12
IORING_SETUP_DEFER_TASKRUN = 1 << 13
IORING_ENTER_GETEVENTS = 1 << 0
IORING_OP_URING_CMD = 46

IORING_OFF_SQ_RING = 0
IORING_OFF_CQ_RING = 0x8000000
IORING_OFF_SQES = 0x10000000

SQE_SIZE = 128
CQE = struct.Struct("<QiI")  # user_data res flags
# opcode flags ioprio fd | cmd_op pad | addr | len rw_flags | user_data
# | buf_index personality file_index
_SQE_HEAD = struct.Struct("<BBHiIIQIIQHHi")
SQE_CMD_OFFSET = 48  # the command area (80 bytes with SQE128) starts at addr3


class _SqOff(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_uint32)
        for n in ("head", "tail", "ring_mask", "ring_entries", "flags", "dropped", "array", "resv1")
    ] + [("user_addr", ctypes.c_uint64)]


class _CqOff(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_uint32)
        for n in ("head", "tail", "ring_mask", "ring_entries", "overflow", "cqes", "flags", "resv1")
    ] + [("user_addr", ctypes.c_uint64)]


class _Params(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_uint32)
        for n in (
            "sq_entries",
            "cq_entries",
            "flags",
            "sq_thread_cpu",
            "sq_thread_idle",
            "features",
            "wq_fd",
        )
    ] + [
        ("resv", ctypes.c_uint32 * 3),
        ("sq_off", _SqOff),
        ("cq_off", _CqOff),
    ]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


_U32 = struct.Struct("<I")


class Ring:
    """One io_uring with 128-byte SQEs; single-threaded use only.

    Args:
        entries: submission queue size (a power of two).
        flags: extra ``IORING_SETUP_*`` flags (SQE128 is always set).

    Raises:
        OSError: ``io_uring_setup`` failed (ENOSYS without io_uring, EPERM when
            ``kernel.io_uring_disabled`` forbids it, EINVAL for unknown flags).
    """

    def __init__(self, entries: int, flags: int = 0) -> None:
        params = _Params()
        params.flags = IORING_SETUP_SQE128 | flags
        self.fd = _check(
            _syscall(SYS_IO_URING_SETUP, ctypes.c_uint(entries), ctypes.byref(params)),
            "io_uring_setup",
        )
        self.flags = params.flags
        sq, cq = params.sq_off, params.cq_off
        sq_size = sq.array + params.sq_entries * 4
        cq_size = cq.cqes + params.cq_entries * CQE.size
        self._sq = mmap.mmap(
            self.fd, sq_size, mmap.MAP_SHARED | mmap.MAP_POPULATE, offset=IORING_OFF_SQ_RING
        )
        self._cq = mmap.mmap(
            self.fd, cq_size, mmap.MAP_SHARED | mmap.MAP_POPULATE, offset=IORING_OFF_CQ_RING
        )
        self._sqes = mmap.mmap(
            self.fd,
            params.sq_entries * SQE_SIZE,
            mmap.MAP_SHARED | mmap.MAP_POPULATE,
            offset=IORING_OFF_SQES,
        )
        self._sq_tail_off, self._sq_mask = sq.tail, params.sq_entries - 1
        self._cq_head_off, self._cq_tail_off, self._cq_mask, self._cqes = (
            cq.head,
            cq.tail,
            params.cq_entries - 1,
            cq.cqes,
        )
        for i in range(params.sq_entries):  # SQ array slot i always names SQE i
            _U32.pack_into(self._sq, sq.array + 4 * i, i)
        self._tail = _U32.unpack_from(self._sq, sq.tail)[0]
        self._pending = 0

    def push_uring_cmd(
        self, fd: int, cmd_op: int, cmd: bytes, user_data: int, addr: int = 0, length: int = 0
    ) -> None:
        """Queue one ``IORING_OP_URING_CMD`` on ``fd`` (not submitted until :meth:`enter`)."""
        off = (self._tail & self._sq_mask) * SQE_SIZE
        self._sqes[off : off + SQE_SIZE] = bytes(SQE_SIZE)
        _SQE_HEAD.pack_into(
            self._sqes,
            off,
            IORING_OP_URING_CMD,
            0,
            0,
            fd,
            cmd_op,
            0,
            addr,
            length,
            0,
            user_data,
            0,
            0,
            0,
        )
        self._sqes[off + SQE_CMD_OFFSET : off + SQE_CMD_OFFSET + len(cmd)] = cmd
        self._tail = (self._tail + 1) & 0xFFFFFFFF
        _U32.pack_into(self._sq, self._sq_tail_off, self._tail)
        self._pending += 1

    def enter(self, min_complete: int) -> int:
        """Submit the queued SQEs and wait for ``min_complete`` completions; returns SQEs consumed.

        The GIL is released during the call (ctypes). EINTR is retried.
        """
        while True:
            ret = _syscall(
                SYS_IO_URING_ENTER,
                self.fd,
                self._pending,
                min_complete,
                IORING_ENTER_GETEVENTS if min_complete else 0,
                None,
                0,
            )
            if ret >= 0:
                self._pending -= ret
                return ret
            if ctypes.get_errno() != 4:
                _check(ret, "io_uring_enter")

    def completions(self) -> list[tuple[int, int]]:
        """Reap every available CQE as ``(user_data, res)`` pairs (res: >= 0 or -errno)."""
        head = _U32.unpack_from(self._cq, self._cq_head_off)[0]
        tail = _U32.unpack_from(self._cq, self._cq_tail_off)[0]
        out = []
        while head != tail:
            user_data, res, _ = CQE.unpack_from(
                self._cq, self._cqes + (head & self._cq_mask) * CQE.size
            )
            out.append((user_data, res))
            head = (head + 1) & 0xFFFFFFFF
        _U32.pack_into(self._cq, self._cq_head_off, head)
        return out

    def close(self) -> None:
        """Unmap the rings and close the ring's descriptor."""
        for m in (self._sqes, self._cq, self._sq):
            m.close()
        os.close(self.fd)


def buffer_address(buf: mmap.mmap) -> int:
    """The address of an anonymous mapping's first byte (for iovecs handed to the kernel)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))
