"""The FUSE session: the /dev/fuse channel, INIT negotiation, the request loop.

tierfs speaks the kernel protocol directly instead of going through libfuse
(pyfuse3): libfuse 3.14, the newest Debian 12 ships, cannot request FUSE
passthrough (Linux 6.9+), and passthrough is what lets file data move
between the trainer and tmpfs at tmpfs speed (FUSE-NOTES: a pyfuse3 data path
reached 0.15-0.26 of tmpfs for writes). Without passthrough (older kernel,
no CAP_SYS_ADMIN, or a managed RAM budget) the daemon serves data itself
with 1 MiB requests.

Concurrency: one trio task reads requests and answers each before reading
the next; handlers only make short tmpfs syscalls. The one exception is an
open of another rank's file whose bytes are not here yet
(:class:`tierfs.fuse.remote.Deferred`): that request is answered by a task of
its own once the fetch ended, while the loop goes on serving others. Kernel cache
invalidations are written from a separate thread, never from a handler
(FUSE-NOTES trap 8: the kernel takes the directory lock for them).
"""

from __future__ import annotations

import collections
import errno
import json
import logging
import os
import queue
import select
import socket
import stat
import subprocess
import threading
from collections.abc import Callable

import trio

from tierfs.core import syscalls
from tierfs.core.mounts import mount_entry
from tierfs.fuse import protocol as P
from tierfs.fuse.namespace import Namespace
from tierfs.fuse.operations import NO_REPLY, Operations
from tierfs.fuse.options import (
    MountOptionError,
    MountOptions,
    fusermount_options,
    mount_data,
)
from tierfs.fuse.remote import Deferred

__all__ = [
    "FuseSession",
    "MountOptionError",
    "MountOptions",
    "is_dead_mount",
    "mount_entry",
    "unmount_path",
]

log = logging.getLogger(__name__)

MAX_WRITE = 1 << 20
MAX_PAGES = MAX_WRITE // 4096
BUFFER_SIZE = MAX_WRITE + 64 * 1024
#: kernel readahead for the mount when the daemon serves reads (KiB)
READAHEAD_KIB = 4096
#: seconds the request loop waits for the next request of a burst before parking in trio
POLL_BEFORE_PARK = 0.0005
#: waits one request answered later may take (each a :class:`Deferred` of the
#: handler run again) before it is answered EIO
DEFERRALS = 8


class FuseSession:
    """One mounted FUSE filesystem served from a :class:`Namespace`.

    Args:
        ns: the namespace to serve.
        mountpoint: an existing directory.
        options: mount options.

    Use :meth:`mount`, then run :meth:`serve` in a trio task; it returns when
    the filesystem is unmounted.
    """

    def __init__(self, ns: Namespace, mountpoint: str, options: MountOptions) -> None:
        self.ns = ns
        self.mountpoint = os.path.abspath(mountpoint)
        self.options = options
        self.ops = Operations(ns, max_read=MAX_WRITE)
        self.fd = -1
        self.minor = 0
        self.passthrough = False
        self.initialized = trio.Event()
        self.requests = 0
        #: requests answered per opcode since the mount (a debug counter: .tierfs/fuse.json)
        self.op_counts: collections.Counter[int] = collections.Counter()
        self._buf = bytearray(BUFFER_SIZE)
        self._view = memoryview(self._buf)
        self._notify_q: queue.SimpleQueue[tuple[bytes, threading.Event | None] | None] = (
            queue.SimpleQueue()
        )
        self._notify_thread: threading.Thread | None = None
        #: the nursery of requests answered later (:meth:`serve` opens it)
        self._later: trio.Nursery | None = None
        #: requests waiting for a fetch right now (a gauge)
        self.deferred = 0
        #: their cancel scopes by ``unique``, for the kernel's INTERRUPT
        self._waiting: dict[int, trio.CancelScope] = {}
        ns.entry_timeout = options.entry_timeout
        ns.attr_timeout = options.attr_timeout
        ns.kernel.inval_entry = self.notify_inval_entry
        ns.kernel.inval_inode = self.notify_inval_inode

    # ------------------------------------------------------------------ mount / unmount

    def mount(self) -> None:
        """Open /dev/fuse and mount it on the mountpoint.

        Root mounts with mount(2); other users go through ``fusermount3``.

        Raises:
            OSError: /dev/fuse missing (ENOENT), permission denied, mount failed.
        """
        rootmode = stat.S_IFMT(os.stat(self.ns.view_dir).st_mode)
        if os.geteuid() == 0:
            fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
            try:
                syscalls.mount(
                    self.options.fsname,
                    self.mountpoint,
                    f"fuse.{self.options.subtype}",
                    self.options.flags,
                    mount_data(fd, self.options, rootmode),
                )
            except OSError:
                os.close(fd)
                raise
        else:
            fd = self._fusermount()
        os.set_blocking(fd, False)
        self.fd = fd
        # The notifier writes through its own descriptor so that closing the
        # channel can never leave it writing to a reused descriptor number.
        # (A dup shares O_NONBLOCK; notify writes never return EAGAIN anyway.)
        notify_fd = os.dup(fd)
        self._notify_thread = threading.Thread(
            target=self._notifier, args=(notify_fd,), name="fuse-notify", daemon=True
        )
        self._notify_thread.start()

    def _fusermount(self) -> int:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with parent, child:
            env = dict(os.environ, _FUSE_COMMFD=str(child.fileno()))
            proc = subprocess.run(
                ["fusermount3", "-o", fusermount_options(self.options), "--", self.mountpoint],
                env=env,
                pass_fds=[child.fileno()],
                capture_output=True,
                text=True,
                check=False,
            )
            if proc.returncode != 0:
                raise OSError(errno.EPERM, f"fusermount3: {proc.stderr.strip()}")
            _msg, fds, _flags, _addr = socket.recv_fds(parent, 1, 1)
            if not fds:
                raise OSError(errno.EIO, "fusermount3 passed no descriptor")
            return fds[0]

    def unmount(self, lazy: bool = True) -> None:
        """Unmount (lazily by default, so open files do not block it)."""
        unmount_path(self.mountpoint, lazy=lazy)

    def close(self) -> None:
        """Close the channel; pending requests fail with ENOTCONN in the kernel.

        Call from the trio thread (it tells trio the descriptor is closing).
        """
        self._notify_q.put(None)
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            try:
                trio.lowlevel.notify_closing(fd)
            except RuntimeError:
                pass  # not inside trio
            os.close(fd)
        thread = self._notify_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2)
            self._notify_thread = None

    def counters_json(self) -> bytes:
        """The session's counters as JSON: requests per opcode name, INIT results.

        Content of ``.tierfs/fuse.json`` (bench/ reads it to count round trips
        per file). Generated on the FUSE thread when the file is opened.
        """
        counts = {P.Op.name(op): n for op, n in sorted(self.op_counts.items())}
        return (
            json.dumps(
                {
                    "requests": counts,
                    "total": self.requests,
                    "protocol": f"7.{self.minor}",
                    "passthrough": self.passthrough,
                },
                indent=2,
                sort_keys=True,
            )
            + "\n"
        ).encode()

    # ------------------------------------------------------------------ passthrough

    def register_backing(self, fd: int) -> int:
        """Register ``fd`` as a passthrough backing file; returns the backing id.

        On failure (no CAP_SYS_ADMIN: EPERM; a ram-dir on overlayfs or on
        another FUSE mount: ELOOP, the kernel's stacking limit) passthrough is
        turned off for the rest of the session and the error is re-raised;
        the namespace then serves the open through the daemon.

        Raises:
            OSError: from the FUSE_DEV_IOC_BACKING_OPEN ioctl.
        """
        try:
            return syscalls.ioctl_buf(
                self.fd, P.FUSE_DEV_IOC_BACKING_OPEN, P.BACKING_MAP.pack(fd, 0, 0)
            )
        except OSError as exc:
            log.warning(
                "FUSE passthrough unavailable (ioctl: %s); serving data through the daemon",
                errno.errorcode.get(exc.errno or 0, exc.strerror),
            )
            self.passthrough = False
            self.ns.kernel.passthrough = False
            self._raise_readahead()
            raise

    def close_backing(self, backing_id: int) -> None:
        """Drop a backing id (open files keep their own reference)."""
        syscalls.ioctl_buf(self.fd, P.FUSE_DEV_IOC_BACKING_CLOSE, backing_id.to_bytes(4, "little"))

    # ------------------------------------------------------------------ notifications

    def notify_inval_entry(self, parent: int, name: bytes, wait: bool = False) -> None:
        """Queue an entry invalidation; thread-safe.

        Returns at once, or with ``wait`` once the kernel has processed it (at
        most 5 s). Never wait on the FUSE thread: the kernel needs the parent
        directory's lock, which a request we have not answered may hold.
        """
        body = P.NOTIFY_INVAL_ENTRY.pack(parent, len(name), 0) + name + b"\0"
        msg = P.OUT_HEADER.pack(P.OUT_HEADER.size + len(body), P.Notify.INVAL_ENTRY, 0) + body
        done = threading.Event() if wait else None
        self._notify_q.put((msg, done))
        if done is not None:
            done.wait(timeout=5)

    def notify_inval_inode(self, nodeid: int) -> None:
        """Queue an invalidation of ``nodeid``'s cached attributes (not its pages); thread-safe.

        Returns at once. Safe to call from a request handler: with a negative
        offset the kernel only marks the attributes stale and takes no lock.
        """
        body = P.NOTIFY_INVAL_INODE.pack(nodeid, -1, 0)
        msg = P.OUT_HEADER.pack(P.OUT_HEADER.size + len(body), P.Notify.INVAL_INODE, 0) + body
        self._notify_q.put((msg, None))

    def _notifier(self, fd: int) -> None:
        try:
            while True:
                item = self._notify_q.get()
                if item is None:
                    return
                msg, done = item
                try:
                    os.write(fd, msg)
                except OSError as exc:
                    if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
                        log.debug("invalidation failed: %s", exc)
                    if exc.errno in (errno.ENODEV, errno.ENOTCONN, errno.EBADF):
                        return
                finally:
                    if done is not None:
                        done.set()
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ request loop

    def _reply(self, unique: int, payload: object) -> None:
        try:
            if isinstance(payload, list):
                size = P.OUT_HEADER.size + sum(len(b) for b in payload)
                os.writev(self.fd, [P.OUT_HEADER.pack(size, 0, unique), *payload])
            else:
                assert isinstance(payload, bytes | bytearray)
                os.write(
                    self.fd,
                    P.OUT_HEADER.pack(P.OUT_HEADER.size + len(payload), 0, unique) + payload,
                )
        except OSError as exc:
            if exc.errno != errno.ENOENT:  # ENOENT: the request was interrupted
                raise

    def _error(self, unique: int, err: int) -> None:
        try:
            os.write(self.fd, P.OUT_HEADER.pack(P.OUT_HEADER.size, -err, unique))
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise

    def _init(self, hdr: P.RequestHeader, body: memoryview) -> None:
        major, minor, max_readahead, flags, flags2 = P.INIT_IN.unpack_from(body)
        kernel_flags = flags | (flags2 << 32 if flags & P.FUSE_INIT_EXT else 0)
        if major != P.KERNEL_VERSION or minor < P.MIN_MINOR_VERSION:
            log.error(
                "kernel FUSE protocol %d.%d is too old (need 7.%d)",
                major,
                minor,
                P.MIN_MINOR_VERSION,
            )
            self._error(hdr.unique, errno.EPROTO)
            raise OSError(errno.EPROTO, f"kernel FUSE protocol {major}.{minor} too old")
        self.minor = min(minor, P.KERNEL_MINOR_VERSION)
        want = (
            P.FUSE_ASYNC_READ
            | P.FUSE_ATOMIC_O_TRUNC
            | P.FUSE_BIG_WRITES
            | P.FUSE_AUTO_INVAL_DATA
            | P.FUSE_DO_READDIRPLUS
            | P.FUSE_PARALLEL_DIROPS
            | P.FUSE_MAX_PAGES
            | P.FUSE_CACHE_SYMLINKS
            | P.FUSE_INIT_EXT
            | P.FUSE_ASYNC_DIO
            | P.FUSE_DIRECT_IO_ALLOW_MMAP
            | P.FUSE_HANDLE_KILLPRIV_V2
        )
        use_passthrough = (
            self.options.passthrough
            and self.ns.budget.native
            and os.geteuid() == 0
            and bool(kernel_flags & P.FUSE_PASSTHROUGH)
        )
        if use_passthrough:
            want |= P.FUSE_PASSTHROUGH
        granted = want & kernel_flags
        self.passthrough = bool(granted & P.FUSE_PASSTHROUGH)
        out = P.INIT_OUT.pack(
            P.KERNEL_VERSION,
            self.minor,
            max_readahead,
            granted & 0xFFFFFFFF,
            64,
            48,
            MAX_WRITE,
            1,
            MAX_PAGES,
            0,
            granted >> 32,
            1 if self.passthrough else 0,
            0,
        )
        self._reply(hdr.unique, out)
        kernel = self.ns.kernel
        kernel.passthrough = self.passthrough
        kernel.register_backing = self.register_backing
        kernel.close_backing = self.close_backing
        log.info(
            "FUSE 7.%d session up on %s (passthrough %s)",
            self.minor,
            self.mountpoint,
            "on" if self.passthrough else "off",
        )
        if not self.passthrough:
            self._raise_readahead()
        self.initialized.set()

    def _raise_readahead(self, kib: int = READAHEAD_KIB) -> None:
        """Let the kernel read ahead ``kib`` KiB (FUSE-NOTES trap 11: INIT cannot).

        Matters only when the daemon serves reads: sequential reads then arrive
        as 1 MiB requests instead of 128 KiB ones. Root only; failures are
        harmless. Reads /proc, never the mount (a stat from this thread would
        wait for itself).
        """
        entry = mount_entry(self.mountpoint)
        if entry is None or os.geteuid() != 0:
            return
        try:
            with open(f"/sys/class/bdi/{entry['device']}/read_ahead_kb", "w") as f:
                f.write(str(kib))
        except OSError as exc:
            log.debug("read_ahead_kb not raised: %s", exc)

    def dispatch(self, n: int) -> None:
        """Handle the request in the first ``n`` bytes of the buffer and answer it."""
        hdr = P.RequestHeader.decode(self._buf)
        body = self._view[P.IN_HEADER.size : n]
        self.requests += 1
        self.op_counts[hdr.opcode] += 1
        if hdr.opcode == P.Op.INIT:
            self._init(hdr, body)
            return
        if hdr.opcode == P.Op.DESTROY:
            self._reply(hdr.unique, b"")
            return
        if hdr.opcode == P.Op.INTERRUPT:
            # fuse.h: the interrupted request's ``unique``; only a request answered
            # later can still be waiting (a reader's ^C while a fetch runs)
            (unique,) = P.INTERRUPT_IN.unpack_from(body)
            scope = self._waiting.get(unique)
            if scope is not None:
                scope.cancel()
            return
        handler = self.ops.handlers.get(hdr.opcode)
        if handler is None:
            self._error(hdr.unique, errno.ENOSYS)
            return
        try:
            payload = handler(hdr, body)
        except OSError as exc:
            err = exc.errno or errno.EIO
            if hdr.opcode in (P.Op.FORGET, P.Op.BATCH_FORGET, P.Op.INTERRUPT):
                return
            self._error(hdr.unique, err)
            return
        except Deferred as later:
            if self._later is None:  # not serving (a direct dispatch in a test)
                self._error(hdr.unique, errno.EAGAIN)
                return
            # the scope exists before the task runs: an INTERRUPT right after finds it
            self._waiting[hdr.unique] = trio.CancelScope()
            self._later.start_soon(self._answer_later, hdr, bytes(body), handler, later)
            return
        except Exception:
            # FUSE-NOTES trap 1: nothing may escape a handler.
            log.exception("%s failed", P.Op.name(hdr.opcode))
            if hdr.opcode not in (P.Op.FORGET, P.Op.BATCH_FORGET, P.Op.INTERRUPT):
                self._error(hdr.unique, errno.EIO)
            return
        if payload is NO_REPLY:
            return
        self._reply(hdr.unique, payload)

    async def _answer_later(
        self,
        hdr: P.RequestHeader,
        body: bytes,
        handler: Callable[[P.RequestHeader, memoryview], object],
        later: Deferred,
    ) -> None:
        """Wait for what ``later`` waits for, then run ``handler`` again and answer.

        An ``OSError`` of the wait is the answer's errno; anything else is EIO
        (logged). A handler that defers again is waited for again,
        :data:`DEFERRALS` times at most (then EIO, logged). A request the kernel
        gave up on (interrupted, the mount gone) is answered into the void,
        harmlessly. The kernel's INTERRUPT
        of the request (the reader got a signal, e.g. ^C) ends the wait with EINTR;
        what it waited for goes on (a fetch serves the next open).
        """
        self.deferred += 1
        scope = self._waiting.setdefault(hdr.unique, trio.CancelScope())
        try:
            with scope:
                await self._wait_and_answer(hdr, body, handler, later)
            if scope.cancelled_caught:
                self._answer(hdr.unique, errno.EINTR)  # the kernel's INTERRUPT
        finally:
            self.deferred -= 1
            self._waiting.pop(hdr.unique, None)

    async def _wait_and_answer(
        self,
        hdr: P.RequestHeader,
        body: bytes,
        handler: Callable[[P.RequestHeader, memoryview], object],
        later: Deferred,
    ) -> None:
        """The loop of :meth:`_answer_later`: wait, run the handler again, answer; EIO,
        said in the log, after :data:`DEFERRALS` waits (trial 63 MEDIUM-1: an open of
        ``.metadata`` got EIO with nothing in the log after three: its lookup and its
        open may each wait for another rank's node, then for a fetch)."""
        for _ in range(DEFERRALS):
            try:
                await later.wait()
                payload = handler(hdr, memoryview(body))
            except Deferred as again:
                later = again
                continue
            except OSError as exc:
                self._answer(hdr.unique, exc.errno or errno.EIO)
                return
            except Exception:
                log.exception("%s answered later failed", P.Op.name(hdr.opcode))
                self._answer(hdr.unique, errno.EIO)
                return
            self._answer(hdr.unique, 0, payload)
            return
        log.warning(
            "%s of node %d: still to wait for after %d waits: answered EIO",
            P.Op.name(hdr.opcode),
            hdr.nodeid,
            DEFERRALS,
        )
        self._answer(hdr.unique, errno.EIO)

    def _answer(self, unique: int, err: int, payload: object = b"") -> None:
        """Reply to a request answered later, unless the channel is closed."""
        if self.fd < 0:
            return
        try:
            if err:
                self._error(unique, err)
            else:
                self._reply(unique, payload)
        except OSError as exc:
            log.debug("late answer to request %d dropped: %s", unique, exc)

    async def serve(self) -> None:
        """Serve requests until the filesystem is unmounted (ENODEV).

        Requests answered later (:class:`tierfs.fuse.remote.Deferred`) run in a
        nursery of this call; they are cancelled when it returns.
        """
        async with trio.open_nursery() as later:
            self._later = later
            try:
                await self._serve()
            finally:
                self._later = None
                later.cancel_scope.cancel()

    async def _serve(self) -> None:
        """Serve requests until the filesystem is unmounted (ENODEV).

        Between requests of a burst (a client creating, stat'ing or removing
        many files) the next request usually arrives within microseconds: the
        loop first waits for it up to :data:`POLL_BEFORE_PARK` seconds with a
        plain epoll_wait of its own, and parks in trio only when none came.
        Parking costs more than the request itself (registering the
        descriptor, a pass of trio's run loop, rescheduling). Other trio tasks
        still run at least every 32 requests and whenever the device is idle.
        """
        since_yield = 0
        # the namespace's trim_fds in one call per request: at once below the budget
        trim_fds, handles_open = self.ns.inodes.trim, self.ns.handles.open
        poller = select.epoll()
        poller.register(self.fd, select.EPOLLIN)
        try:
            while True:
                try:
                    n = os.readv(self.fd, [self._buf])
                except BlockingIOError:
                    if since_yield and POLL_BEFORE_PARK and poller.poll(POLL_BEFORE_PARK):
                        continue  # the next request of the burst: no trio round
                    since_yield = 0
                    try:
                        await trio.lowlevel.wait_readable(self.fd)
                    except trio.ClosedResourceError:
                        # close() from another task (SIGTERM, unmount): the end.
                        log.info("FUSE channel closed")
                        return
                    continue
                except OSError as exc:
                    if exc.errno in (errno.ENOENT, errno.EINTR, errno.EAGAIN):
                        continue
                    if exc.errno in (errno.ENODEV, errno.EBADF):
                        log.info("filesystem unmounted")
                        return
                    raise
                self.dispatch(n)
                trim_fds(len(handles_open))  # between requests: no descriptor is in use
                since_yield += 1
                if since_yield >= 32:
                    since_yield = 0
                    await trio.sleep(0)
        finally:
            poller.close()
            self.close()


def is_dead_mount(path: str) -> bool:
    """True if ``path`` is a FUSE mount whose daemon is gone (ENOTCONN/ECONNABORTED).

    statfs always reaches the daemon; a stat may be answered from the
    kernel's attribute cache even after the daemon died.
    """
    try:
        os.statvfs(path)
    except OSError as exc:
        return exc.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    return False


def unmount_path(path: str, lazy: bool = True) -> None:
    """Unmount ``path``: umount2 as root, ``fusermount3 -u`` otherwise.

    Raises:
        OSError: not mounted (EINVAL), busy (EBUSY when not lazy), no permission.
    """
    if os.geteuid() == 0:
        syscalls.umount2(path, syscalls.MNT_DETACH if lazy else 0)
        return
    args = ["fusermount3", "-u"] + (["-z"] if lazy else []) + [path]
    proc = subprocess.run(args, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise OSError(errno.EINVAL, proc.stderr.strip() or "fusermount3 -u failed")
