"""A minimal in-memory FUSE daemon served over /dev/fuse read/write or over FUSE-over-io_uring.

Usage (root): ``python bench/uring/spikefs.py MOUNTPOINT --mode dev|uring
[--files 5000] [--depth 2] [--stats FILE] [--taskrun default|coop|defer]``.

A measurement spike for issue #13 item 2 (docs/BENCHMARKS.md, "FUSE over
io_uring"): the same request handlers behind two transports, so that the
difference in round trips per second is the transport's. It is not tierfs's
mount path and shares nothing with it but the wire structs of
:mod:`tierfs.fuse.protocol`.

The filesystem: a root with ``pre/`` holding ``--files`` empty files
``f000000``..; LOOKUP, GETATTR, SETATTR (size), MKDIR, CREATE, OPEN, WRITE
(data dropped, size kept), FLUSH, RELEASE, UNLINK, RMDIR, OPENDIR,
READDIR (empty), RELEASEDIR, STATFS, ACCESS answer; GETXATTR answers ENODATA
(as a filesystem without xattrs, so the kernel asks once per new inode, like
tierfs); everything else ENOSYS. Entry and attribute timeouts are 10 s, except
the files of ``pre/`` whose attributes time out at once (a stat of one is one
GETATTR round trip: the stat-loop benchmark). Mounted with
``default_permissions,allow_other`` like tierfs.

Transports:

* ``dev``: one thread reads a request from /dev/fuse, answers with write(2);
  with ``--pinned`` one such thread per CPU, pinned to it.
* ``uring``: INIT is answered over /dev/fuse with ``FUSE_OVER_IO_URING``;
  then one Python thread owns one io_uring (SQE128) and registers ``--depth``
  ring entries (a 4 KiB header page and a 128 KiB payload buffer each) for
  every kernel queue (the kernel keeps one queue per possible CPU and serves a
  request on the queue of the CPU the caller runs on; it does not start until
  every queue has an entry). Each answer is one
  ``FUSE_IO_URING_CMD_COMMIT_AND_FETCH``, submitted together with the wait for
  the next request in one ``io_uring_enter``. A second thread drains
  /dev/fuse, where FORGETs still arrive.

The request counts by opcode and transport are written to ``--stats`` as
JSON on SIGUSR1 (a snapshot, replaced atomically) and at exit (after
unmount). Exit status 0 on a clean unmount, 1 on a setup error
(the failing step and errno are printed, e.g. ``io_uring REGISTER: EOPNOTSUPP``
when ``/sys/module/fuse/parameters/enable_uring`` is N).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import errno
import json
import mmap
import os
import signal
import stat
import struct
import sys
import threading
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ring as uring  # a script's sibling module

from tierfs.fuse import protocol as P

FUSE_OVER_IO_URING = 1 << 41
FUSE_IO_URING_CMD_REGISTER = 1
FUSE_IO_URING_CMD_COMMIT_AND_FETCH = 2
URING_HEADER_SIZE = 288  # struct fuse_uring_req_header: in_out[128] op_in[128] ring_ent_in_out[32]
OP_IN_OFFSET = 128
ENT_IN_OUT = struct.Struct("<QQII")  # flags commit_id payload_sz padding (at offset 256)
ENT_IN_OUT_OFFSET = 256
CMD_REQ = struct.Struct("<QQH6x")  # flags commit_id qid
MAX_PAGES = 32
MAX_WRITE = MAX_PAGES * 4096
PAYLOAD_SIZE = MAX_WRITE  # the kernel's max_payload_sz: max(8 KiB, max_write, max_pages * 4 KiB)
TIMEOUT = 10  # seconds, entry and attribute caches
ENODATA = errno.ENODATA

#: size of the per-opcode header (in_args[0]) that precedes names and data on /dev/fuse;
#: over io_uring it is the ``op_in`` area and the rest is the payload buffer
OP_HEADER = {
    P.Op.LOOKUP: 0,
    P.Op.FORGET: 8,
    P.Op.GETATTR: 16,
    P.Op.SETATTR: 88,
    P.Op.MKDIR: 8,
    P.Op.UNLINK: 0,
    P.Op.RMDIR: 0,
    P.Op.OPEN: 8,
    P.Op.WRITE: 40,
    P.Op.STATFS: 0,
    P.Op.RELEASE: 24,
    P.Op.GETXATTR: 8,
    P.Op.FLUSH: 24,
    P.Op.INIT: 64,
    P.Op.OPENDIR: 8,
    P.Op.READDIR: 40,
    P.Op.RELEASEDIR: 24,
    P.Op.ACCESS: 8,
    P.Op.CREATE: 16,
    P.Op.BATCH_FORGET: 8,
    P.Op.READDIRPLUS: 40,
}
NO_REPLY = {P.Op.FORGET, P.Op.BATCH_FORGET}


@dataclass(slots=True)
class Node:
    """One inode: ``mode`` (S_IFMT and permission bits), ``size`` in bytes, children by name."""

    mode: int
    size: int = 0
    attr_timeout: int = TIMEOUT
    children: dict[bytes, int] = field(default_factory=dict)


class SpikeFS:
    """The request handlers: pure in-memory state, one caller at a time."""

    def __init__(self, files: int) -> None:
        self.nodes: dict[int, Node] = {P.ROOT_ID: Node(stat.S_IFDIR | 0o755)}
        self.next_id = P.ROOT_ID + 1
        self.now = int(time.time())
        pre = self._add(P.ROOT_ID, b"pre", Node(stat.S_IFDIR | 0o755))
        for i in range(files):
            self._add(pre, b"f%06d" % i, Node(stat.S_IFREG | 0o644, attr_timeout=0))
        self._counters: list[collections.Counter[str]] = []

    def counter(self) -> collections.Counter[str]:
        """A new request counter for one serving thread (threads never share one)."""
        counts: collections.Counter[str] = collections.Counter()
        self._counters.append(counts)
        return counts

    def totals(self) -> dict[str, int]:
        """The request counts of every serving thread, by ``transport:OPCODE``."""
        total: collections.Counter[str] = collections.Counter()
        for counts in list(self._counters):
            total.update(dict(counts))
        return dict(total)

    def _add(self, parent: int, name: bytes, node: Node) -> int:
        nodeid = self.next_id
        self.next_id += 1
        self.nodes[nodeid] = node
        self.nodes[parent].children[name] = nodeid
        return nodeid

    def _attr(self, nodeid: int, node: Node) -> bytes:
        nlink = 2 if stat.S_ISDIR(node.mode) else 1
        t = self.now
        return P.ATTR.pack(
            nodeid,
            node.size,
            (node.size + 511) // 512,
            t,
            t,
            t,
            0,
            0,
            0,
            node.mode,
            nlink,
            0,
            0,
            0,
            4096,
            0,
        )

    def _entry(self, nodeid: int) -> bytes:
        node = self.nodes[nodeid]
        return P.ENTRY_OUT_HEAD.pack(nodeid, 0, TIMEOUT, node.attr_timeout, 0, 0) + self._attr(
            nodeid, node
        )

    def handle(
        self, opcode: int, nodeid: int, op_in: memoryview, payload: memoryview
    ) -> tuple[int, bytes]:
        """Answer one request: ``(error, reply body)``; error is 0 or a positive errno."""
        node = self.nodes.get(nodeid)
        if node is None:
            return errno.ESTALE, b""
        if opcode == P.Op.GETATTR:
            return 0, P.ATTR_OUT_HEAD.pack(node.attr_timeout, 0, 0) + self._attr(nodeid, node)
        if opcode == P.Op.LOOKUP:
            child = node.children.get(bytes(payload).rstrip(b"\0"))
            return (errno.ENOENT, b"") if child is None else (0, self._entry(child))
        if opcode == P.Op.CREATE:
            _flags, mode, umask, _ = P.CREATE_IN.unpack_from(op_in)
            name = bytes(payload).split(b"\0", 1)[0]
            if name in node.children:
                return errno.EEXIST, b""
            child = self._add(nodeid, name, Node(stat.S_IFREG | (mode & ~umask & 0o7777)))
            return 0, self._entry(child) + P.OPEN_OUT.pack(child, 0, 0)
        if opcode == P.Op.WRITE:
            _fh, offset, size, *_ = P.WRITE_IN.unpack_from(op_in)
            node.size = max(node.size, offset + size)
            return 0, P.WRITE_OUT.pack(size, 0)
        if opcode in (P.Op.FLUSH, P.Op.RELEASE, P.Op.RELEASEDIR, P.Op.ACCESS):
            return 0, b""
        if opcode == P.Op.GETXATTR:
            return ENODATA, b""
        if opcode in (P.Op.OPEN, P.Op.OPENDIR):
            return 0, P.OPEN_OUT.pack(nodeid, 0, 0)
        if opcode == P.Op.MKDIR:
            mode, umask = P.MKDIR_IN.unpack_from(op_in)
            name = bytes(payload).split(b"\0", 1)[0]
            if name in node.children:
                return errno.EEXIST, b""
            return 0, self._entry(
                self._add(nodeid, name, Node(stat.S_IFDIR | (mode & ~umask & 0o7777)))
            )
        if opcode in (P.Op.UNLINK, P.Op.RMDIR):
            name = bytes(payload).split(b"\0", 1)[0]
            child = node.children.get(name)
            if child is None:
                return errno.ENOENT, b""
            if opcode == P.Op.RMDIR and self.nodes[child].children:
                return errno.ENOTEMPTY, b""
            del node.children[name]
            return 0, b""
        if opcode == P.Op.SETATTR:
            valid = P.SETATTR_IN.unpack_from(op_in)[0]
            if valid & P.FATTR_SIZE:
                node.size = P.SETATTR_IN.unpack_from(op_in)[3]
            return 0, P.ATTR_OUT_HEAD.pack(node.attr_timeout, 0, 0) + self._attr(nodeid, node)
        if opcode in (P.Op.READDIR, P.Op.READDIRPLUS):
            return 0, b""
        if opcode == P.Op.STATFS:
            return 0, P.STATFS_OUT.pack(
                1 << 20, 1 << 20, 1 << 20, 1 << 20, 1 << 20, 4096, 255, 4096, 0
            )
        return errno.ENOSYS, b""


def reply_bytes(unique: int, error: int, body: bytes) -> bytes:
    """A /dev/fuse reply: ``fuse_out_header`` + body."""
    return P.OUT_HEADER.pack(P.OUT_HEADER.size + len(body), -error, unique) + body


def read_request(fd: int) -> bytes | None:
    """One request from /dev/fuse; None once the connection is gone (ENODEV)."""
    while True:
        try:
            return os.read(fd, MAX_WRITE + 4096)
        except OSError as exc:
            if exc.errno in (errno.EINTR, errno.ENOENT, errno.EAGAIN):
                continue
            if exc.errno == errno.ENODEV:
                return None
            raise


def answer_init(fd: int, want_uring: bool) -> int:
    """Read the kernel's FUSE_INIT and answer it; returns the granted flags (64 bits)."""
    buf = read_request(fd)
    assert buf is not None
    hdr = P.RequestHeader.decode(buf)
    if hdr.opcode != P.Op.INIT:
        raise RuntimeError(f"first request is opcode {hdr.opcode}, not INIT")
    _major, minor, max_readahead, flags, flags2 = P.INIT_IN.unpack_from(buf, P.IN_HEADER.size)
    offered = flags | (flags2 << 32)
    wanted = (
        P.FUSE_ASYNC_READ
        | P.FUSE_BIG_WRITES
        | P.FUSE_MAX_PAGES
        | P.FUSE_INIT_EXT
        | P.FUSE_PARALLEL_DIROPS
    )
    if want_uring:
        if not offered & FUSE_OVER_IO_URING:
            raise RuntimeError(
                "INIT: the kernel does not offer FUSE_OVER_IO_URING (enable_uring is N)"
            )
        wanted |= FUSE_OVER_IO_URING
    granted = offered & wanted
    out = P.INIT_OUT.pack(
        7,
        min(minor, 42),
        max_readahead,
        granted & 0xFFFFFFFF,
        64,
        48,
        MAX_WRITE,
        1,
        MAX_PAGES,
        0,
        granted >> 32,
        0,
        0,
    )
    os.write(fd, reply_bytes(hdr.unique, 0, out))
    return granted


def serve_dev(fd: int, fs: SpikeFS, only_forgets: bool = False, cpu: int | None = None) -> None:
    """Serve /dev/fuse by read/write until unmount; with ``only_forgets`` answer the rest ENOSYS.

    ``cpu``: pin the calling thread there first (None: leave it).
    """
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    counts = fs.counter()
    while True:
        buf = read_request(fd)
        if buf is None:
            return
        length, opcode, unique, nodeid = struct.unpack_from("<IIQQ", buf)
        counts[f"dev:{P.Op.name(opcode)}"] += 1
        if opcode in NO_REPLY:
            continue
        if opcode == P.Op.DESTROY:
            os.write(fd, reply_bytes(unique, 0, b""))
            continue
        view = memoryview(buf)
        start = P.IN_HEADER.size
        split = start + OP_HEADER.get(opcode, 0)
        if only_forgets:
            error, body = errno.ENOSYS, b""
        else:
            error, body = fs.handle(opcode, nodeid, view[start:split], view[split:length])
        try:
            os.write(fd, reply_bytes(unique, error, body))
        except OSError as exc:  # ENOENT: the request was interrupted meanwhile
            if exc.errno != errno.ENOENT:
                raise


def serve_dev_pinned(fd: int, fs: SpikeFS) -> None:
    """Serve /dev/fuse with one reader thread per possible CPU, each pinned to its CPU.

    The control for the pinned io_uring queues: /dev/fuse wakes whichever
    reader waits first, not the one on the caller's CPU.
    """
    threads = [
        threading.Thread(target=serve_dev, args=(fd, fs, False, q)) for q in range(possible_cpus())
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def possible_cpus() -> int:
    """The kernel's number of FUSE queues: one per possible CPU.

    Read from ``/sys/devices/system/cpu/possible`` (``0-1`` on this VM: 2 queues).
    """
    text = open("/sys/devices/system/cpu/possible").read().strip()
    return int(text.rsplit("-", 1)[-1].split(",")[-1]) + 1


TASKRUN_FLAGS = {
    "default": 0,
    "coop": uring.IORING_SETUP_COOP_TASKRUN,
    "defer": uring.IORING_SETUP_SINGLE_ISSUER | uring.IORING_SETUP_DEFER_TASKRUN,
}


def serve_uring(fd: int, fs: SpikeFS, depth: int, taskrun: str, pinned: bool) -> None:
    """Serve every kernel queue over io_uring until unmount, plus a /dev/fuse drain thread.

    One thread and one ring for all queues, or with ``pinned`` one thread and
    one ring per queue, pinned to that queue's CPU (libfuse's layout; the
    threads share the GIL and ``fs``, which is safe here only because a
    single-threaded client has one request in flight).

    Raises:
        OSError: a setup step failed; the message names the step
            (io_uring_setup, REGISTER) and the errno.
    """
    queues = list(range(possible_cpus()))
    drain = threading.Thread(target=serve_dev, args=(fd, fs, True), daemon=True)
    if not pinned:
        drain.start()
        serve_queues(fd, fs, queues, depth, TASKRUN_FLAGS[taskrun], None)
        return
    errors: list[BaseException] = []

    def run(q: int) -> None:
        try:
            serve_queues(fd, fs, [q], depth, TASKRUN_FLAGS[taskrun], q)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(q,)) for q in queues]
    for t in threads:
        t.start()
    drain.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def serve_queues(
    fd: int, fs: SpikeFS, qids: list[int], depth: int, flags: int, cpu: int | None
) -> None:
    """Register ``depth`` entries for each of ``qids`` on a new ring; serve them until unmount.

    ``cpu``: pin the calling thread there first (None: leave it).
    """
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    entries = len(qids) * depth
    size = 1
    while size < entries:
        size *= 2
    r = uring.Ring(size, flags)
    headers = [mmap.mmap(-1, 4096) for _ in range(entries)]
    payloads = [mmap.mmap(-1, PAYLOAD_SIZE) for _ in range(entries)]
    iovecs = [
        (_Iovec * 2)(
            (uring.buffer_address(h), URING_HEADER_SIZE), (uring.buffer_address(p), PAYLOAD_SIZE)
        )
        for h, p in zip(headers, payloads, strict=True)
    ]
    qid_of = [qids[i // depth] for i in range(entries)]
    for i in range(entries):
        r.push_uring_cmd(
            fd,
            FUSE_IO_URING_CMD_REGISTER,
            CMD_REQ.pack(0, 0, qid_of[i]),
            i,
            ctypes.addressof(iovecs[i]),
            2,
        )
    r.enter(0)
    handle, counts = fs.handle, fs.counter()
    names = {code: f"uring:{P.Op.name(code)}" for code in range(64)}
    registered = [False] * entries
    while True:
        r.enter(1)
        for i, res in r.completions():
            if res < 0:
                if -res in (errno.ENOTCONN, errno.ECANCELED, errno.ECONNABORTED):
                    r.close()
                    return
                step = "COMMIT_AND_FETCH" if registered[i] else "REGISTER"
                raise OSError(
                    -res,
                    f"io_uring {step} of entry {i} (queue {qid_of[i]}): "
                    f"{errno.errorcode.get(-res, -res)}",
                )
            registered[i] = True
            h, p = headers[i], payloads[i]
            _len, opcode, unique, nodeid = struct.unpack_from("<IIQQ", h)
            _flags, commit_id, payload_sz, _ = ENT_IN_OUT.unpack_from(h, ENT_IN_OUT_OFFSET)
            counts[names.get(opcode) or f"uring:OP{opcode}"] += 1
            hv = memoryview(h)
            error, body = handle(
                opcode,
                nodeid,
                hv[OP_IN_OFFSET : OP_IN_OFFSET + OP_HEADER.get(opcode, 0)],
                memoryview(p)[:payload_sz],
            )
            P.OUT_HEADER.pack_into(h, 0, P.OUT_HEADER.size + len(body), -error, unique)
            if body:
                p[: len(body)] = body
            ENT_IN_OUT.pack_into(h, ENT_IN_OUT_OFFSET, 0, commit_id, len(body), 0)
            r.push_uring_cmd(
                fd, FUSE_IO_URING_CMD_COMMIT_AND_FETCH, CMD_REQ.pack(0, commit_id, qid_of[i]), i
            )


_libc = ctypes.CDLL(None, use_errno=True)


def mount(mountpoint: str) -> int:
    """Open /dev/fuse and mount it at ``mountpoint``; returns the /dev/fuse descriptor."""
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    data = f"fd={fd},rootmode=40000,user_id=0,group_id=0,default_permissions,allow_other".encode()
    if (
        _libc.mount(b"uringspike", mountpoint.encode(), b"fuse.uringspike", 0x2 | 0x4, data) != 0
    ):  # MS_NOSUID|MS_NODEV
        err = ctypes.get_errno()
        raise OSError(err, f"mount {mountpoint}: {os.strerror(err)}")
    return fd


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mountpoint")
    ap.add_argument("--mode", choices=("dev", "uring"), default="dev")
    ap.add_argument("--files", type=int, default=5000, help="empty files in pre/")
    ap.add_argument("--depth", type=int, default=2, help="io_uring entries per kernel queue")
    ap.add_argument("--taskrun", choices=("default", "coop", "defer"), default="default")
    ap.add_argument(
        "--pinned",
        action="store_true",
        help="one thread per CPU pinned there (uring: and one ring per queue)",
    )
    ap.add_argument("--stats", help="write request counts here (JSON) at exit")
    args = ap.parse_args()
    fs = SpikeFS(args.files)

    def dump_stats(*_: object) -> None:
        if args.stats:
            with open(args.stats + ".tmp", "w") as f:
                json.dump(fs.totals(), f)
            os.replace(args.stats + ".tmp", args.stats)

    signal.signal(signal.SIGUSR1, dump_stats)
    fd = mount(args.mountpoint)
    status = 0
    try:
        granted = answer_init(fd, args.mode == "uring")
        if args.mode == "uring":
            print(
                f"INIT granted FUSE_OVER_IO_URING: {bool(granted & FUSE_OVER_IO_URING)}", flush=True
            )
            serve_uring(fd, fs, args.depth, args.taskrun, args.pinned)
        elif args.pinned:
            serve_dev_pinned(fd, fs)
        else:
            serve_dev(fd, fs)
    except (OSError, RuntimeError) as exc:
        print(f"spikefs: {exc}", file=sys.stderr, flush=True)
        _libc.umount2(args.mountpoint.encode(), 2)  # MNT_DETACH
        status = 1
    dump_stats()
    return status


if __name__ == "__main__":
    sys.exit(main())
