"""FUSE operations: decode a request, call the namespace, encode the reply.

Thin on purpose (DESIGN.md principle 3): every handler unpacks the request
structure, makes one :class:`~tierfs.fuse.namespace.Namespace` call and packs
its answer. Handlers return the reply payload (bytes, or a list of buffers),
or :data:`NO_REPLY` for FORGET-style requests; errors travel as ``OSError``
and the session turns them into ``-errno`` replies.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable

from tierfs.fuse import protocol as P
from tierfs.fuse.handles import Handle
from tierfs.fuse.namespace import Namespace

NO_REPLY = object()
Payload = bytes | list[bytes | memoryview]

XATTR_SECURITY_CAPABILITY = b"security.capability"


class Operations:
    """Opcode handlers over one :class:`Namespace`.

    Args:
        ns: the namespace.
        max_read: the largest READ the kernel may send (bytes); sizes the read buffer.
    """

    def __init__(self, ns: Namespace, max_read: int = 1 << 20) -> None:
        self.ns = ns
        self._read_buf = bytearray(max_read)
        self._read_view = memoryview(self._read_buf)
        self.handlers: dict[int, Callable[[P.RequestHeader, memoryview], object]] = {
            P.Op.LOOKUP: self.lookup,
            P.Op.FORGET: self.forget,
            P.Op.BATCH_FORGET: self.batch_forget,
            P.Op.GETATTR: self.getattr,
            P.Op.SETATTR: self.setattr,
            P.Op.READLINK: self.readlink,
            P.Op.SYMLINK: self.symlink,
            P.Op.MKNOD: self.mknod,
            P.Op.MKDIR: self.mkdir,
            P.Op.UNLINK: self.unlink,
            P.Op.RMDIR: self.rmdir,
            P.Op.RENAME: self.rename,
            P.Op.RENAME2: self.rename2,
            P.Op.LINK: self.link,
            P.Op.OPEN: self.open,
            P.Op.CREATE: self.create,
            P.Op.READ: self.read,
            P.Op.WRITE: self.write,
            P.Op.STATFS: self.statfs,
            P.Op.RELEASE: self.release,
            P.Op.FLUSH: self.flush,
            P.Op.FSYNC: self.fsync,
            P.Op.SETXATTR: self.setxattr,
            P.Op.GETXATTR: self.getxattr,
            P.Op.LISTXATTR: self.listxattr,
            P.Op.REMOVEXATTR: self.removexattr,
            P.Op.OPENDIR: self.opendir,
            P.Op.READDIR: self.readdir,
            P.Op.READDIRPLUS: self.readdirplus,
            P.Op.RELEASEDIR: self.releasedir,
            P.Op.FSYNCDIR: self.fsyncdir,
            P.Op.ACCESS: self.access,
            P.Op.FALLOCATE: self.fallocate,
            P.Op.LSEEK: self.lseek,
            P.Op.COPY_FILE_RANGE: self.copy_file_range,
            P.Op.INTERRUPT: self.interrupt,
            P.Op.IOCTL: self.ioctl,
        }

    # ------------------------------------------------------------------ helpers

    def _entry(self, nodeid: int, st: os.stat_result) -> bytes:
        """A FUSE entry reply for ``st``; the kernel caches the name
        :attr:`Namespace.entry_timeout` seconds, not at all for another rank's file
        whose part its node may replace (:meth:`RemoteFiles.uncached`): each open
        then looks the name up, and the lookup resolves it to the current file."""
        uncached = stat.S_ISREG(st.st_mode) and self.ns.remote.uncached(st.st_ino)
        return P.pack_entry(
            nodeid,
            st,
            0.0 if uncached else self.ns.entry_timeout,
            self.ns.attr_timeout,
            self._mtime(st),
        )

    def _mtime(self, st: os.stat_result) -> int | None:
        """The mtime to show for ``st``: None (its own) but for another rank's file
        being fetched (:meth:`tierfs.fuse.remote.RemoteFiles.shown_mtime`)."""
        shown = self.ns.remote.shown_mtime(st.st_ino, st.st_mtime_ns)
        return None if shown == st.st_mtime_ns else shown

    @staticmethod
    def _open_out(handle: Handle) -> bytes:
        flags = 0
        backing = 0
        if handle.passthrough:
            flags |= P.FOPEN_PASSTHROUGH
            backing = handle.inode.backing_id
        else:
            if handle.direct_io:
                flags |= P.FOPEN_DIRECT_IO
            if handle.keep_cache:
                flags |= P.FOPEN_KEEP_CACHE
        return P.OPEN_OUT.pack(handle.fh, flags, backing)

    @staticmethod
    def _name(body: memoryview, offset: int = 0) -> bytes:
        raw = bytes(body[offset:])
        end = raw.find(b"\0")
        if end < 0:
            raise OSError(errno.EINVAL, "unterminated name")
        return raw[:end]

    # ------------------------------------------------------------------ handlers

    def lookup(self, h: P.RequestHeader, body: memoryview) -> Payload:
        inode, st = self.ns.lookup(h.nodeid, self._name(body))
        return self._entry(inode.nodeid, st)

    def forget(self, h: P.RequestHeader, body: memoryview) -> object:
        (nlookup,) = P.FORGET_IN.unpack_from(body)
        self.ns.forget(h.nodeid, nlookup)
        return NO_REPLY

    def batch_forget(self, h: P.RequestHeader, body: memoryview) -> object:
        count, _ = P.BATCH_FORGET_IN.unpack_from(body)
        off = P.BATCH_FORGET_IN.size
        for _ in range(count):
            nodeid, nlookup = P.FORGET_ONE.unpack_from(body, off)
            off += P.FORGET_ONE.size
            self.ns.forget(nodeid, nlookup)
        return NO_REPLY

    def getattr(self, h: P.RequestHeader, body: memoryview) -> Payload:
        flags, _, fh = P.GETATTR_IN.unpack_from(body)
        inode, st = self.ns.getattr(h.nodeid, fh if flags & P.FUSE_GETATTR_FH else None)
        return P.pack_attr_out(inode.nodeid, st, self.ns.attr_timeout, self._mtime(st))

    def setattr(self, h: P.RequestHeader, body: memoryview) -> Payload:
        (
            valid,
            _,
            fh,
            size,
            _lock,
            atime,
            mtime,
            _ctime,
            atimens,
            mtimens,
            _ctimens,
            mode,
            _u4,
            uid,
            gid,
            _u5,
        ) = P.SETATTR_IN.unpack_from(body)
        st = self.ns.setattr(
            h.nodeid,
            fh if valid & P.FATTR_FH else None,
            mode=mode if valid & P.FATTR_MODE else None,
            uid=uid if valid & P.FATTR_UID else None,
            gid=gid if valid & P.FATTR_GID else None,
            size=size if valid & P.FATTR_SIZE else None,
            atime_ns=atime * 1_000_000_000 + atimens if valid & P.FATTR_ATIME else None,
            mtime_ns=mtime * 1_000_000_000 + mtimens if valid & P.FATTR_MTIME else None,
            atime_now=bool(valid & P.FATTR_ATIME_NOW),
            mtime_now=bool(valid & P.FATTR_MTIME_NOW),
            kill_suidgid=bool(valid & P.FATTR_KILL_SUIDGID),
        )
        return P.pack_attr_out(h.nodeid, st, self.ns.attr_timeout)

    def readlink(self, h: P.RequestHeader, body: memoryview) -> Payload:
        return self.ns.readlink(h.nodeid)

    def symlink(self, h: P.RequestHeader, body: memoryview) -> Payload:
        name, target = P.split_names(body, 2)
        inode, st = self.ns.symlink(h.nodeid, name, target, h.uid, h.gid)
        return self._entry(inode.nodeid, st)

    def mknod(self, h: P.RequestHeader, body: memoryview) -> Payload:
        mode, rdev, _umask, _ = P.MKNOD_IN.unpack_from(body)
        name = self._name(body, P.MKNOD_IN.size)
        inode, st = self.ns.mknod(h.nodeid, name, mode, rdev, h.uid, h.gid)
        return self._entry(inode.nodeid, st)

    def mkdir(self, h: P.RequestHeader, body: memoryview) -> Payload:
        mode, _umask = P.MKDIR_IN.unpack_from(body)
        name = self._name(body, P.MKDIR_IN.size)
        inode, st = self.ns.mkdir(h.nodeid, name, mode, h.uid, h.gid)
        return self._entry(inode.nodeid, st)

    def unlink(self, h: P.RequestHeader, body: memoryview) -> Payload:
        self.ns.unlink(h.nodeid, self._name(body))
        return b""

    def rmdir(self, h: P.RequestHeader, body: memoryview) -> Payload:
        self.ns.rmdir(h.nodeid, self._name(body))
        return b""

    def rename(self, h: P.RequestHeader, body: memoryview) -> Payload:
        (newdir,) = P.RENAME_IN.unpack_from(body)
        old, new = P.split_names(body[P.RENAME_IN.size :], 2)
        self.ns.rename(h.nodeid, old, newdir, new, 0)
        return b""

    def rename2(self, h: P.RequestHeader, body: memoryview) -> Payload:
        newdir, flags, _ = P.RENAME2_IN.unpack_from(body)
        old, new = P.split_names(body[P.RENAME2_IN.size :], 2)
        if flags & ~(P.RENAME_NOREPLACE | P.RENAME_EXCHANGE):
            raise OSError(errno.EINVAL, "unsupported rename flags")
        self.ns.rename(h.nodeid, old, newdir, new, flags)
        return b""

    def link(self, h: P.RequestHeader, body: memoryview) -> Payload:
        (oldnodeid,) = P.LINK_IN.unpack_from(body)
        inode, st = self.ns.link(oldnodeid, h.nodeid, self._name(body, P.LINK_IN.size))
        return self._entry(inode.nodeid, st)

    def open(self, h: P.RequestHeader, body: memoryview) -> Payload:
        flags, open_flags = P.OPEN_IN.unpack_from(body)
        return self._open_out(
            self.ns.open(h.nodeid, flags, kill_suidgid=bool(open_flags & P.FUSE_OPEN_KILL_SUIDGID))
        )

    def create(self, h: P.RequestHeader, body: memoryview) -> Payload:
        flags, mode, _umask, open_flags = P.CREATE_IN.unpack_from(body)
        name = self._name(body, P.CREATE_IN.size)
        inode, st, handle = self.ns.create(
            h.nodeid,
            name,
            flags,
            mode,
            h.uid,
            h.gid,
            kill_suidgid=bool(open_flags & P.FUSE_OPEN_KILL_SUIDGID),
        )
        return self._entry(inode.nodeid, st) + self._open_out(handle)

    def read(self, h: P.RequestHeader, body: memoryview) -> Payload:
        fh, offset, size, *_ = P.READ_IN.unpack_from(body)
        view = (
            self._read_view[:size] if size <= len(self._read_buf) else memoryview(bytearray(size))
        )
        n = self.ns.read_into(fh, offset, view)
        return [view[:n]]

    def write(self, h: P.RequestHeader, body: memoryview) -> Payload:
        fh, offset, size, write_flags, *_ = P.WRITE_IN.unpack_from(body)
        data = body[P.WRITE_IN.size : P.WRITE_IN.size + size]
        if write_flags & P.FUSE_WRITE_KILL_SUIDGID:
            self.ns.kill_suidgid(fh)
        written = self.ns.write(fh, offset, data, cached=bool(write_flags & P.FUSE_WRITE_CACHE))
        return P.WRITE_OUT.pack(written, 0)

    def statfs(self, h: P.RequestHeader, body: memoryview) -> Payload:
        s = self.ns.statfs()
        return P.STATFS_OUT.pack(
            s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, s.namelen, s.bsize, 0
        )

    def release(self, h: P.RequestHeader, body: memoryview) -> Payload:
        fh, *_ = P.RELEASE_IN.unpack_from(body)
        self.ns.release(fh)
        return b""

    def flush(self, h: P.RequestHeader, body: memoryview) -> Payload:
        # Nothing is buffered in the daemon (passthrough writes land in tmpfs,
        # daemon-path writes are written before they are answered), so close()
        # needs no round trip: ENOSYS makes the kernel stop sending FLUSH
        # (fc->no_flush), one request less per close.
        raise OSError(errno.ENOSYS, "flush not needed")

    def fsync(self, h: P.RequestHeader, body: memoryview) -> Payload:
        fh, flags, _ = P.FSYNC_IN.unpack_from(body)
        self.ns.fsync(fh, bool(flags & P.FUSE_FSYNC_FDATASYNC))
        return b""

    def fsyncdir(self, h: P.RequestHeader, body: memoryview) -> Payload:
        fh, _flags, _ = P.FSYNC_IN.unpack_from(body)
        self.ns.fsyncdir(fh)
        return b""

    def setxattr(self, h: P.RequestHeader, body: memoryview) -> Payload:
        size, flags = P.SETXATTR_IN.unpack_from(body)
        rest = bytes(body[P.SETXATTR_IN.size :])
        name, _, value = rest.partition(b"\0")
        self.ns.setxattr(h.nodeid, name, value[:size], flags)
        return b""

    def _xattr_reply(self, data: bytes, size: int) -> Payload:
        if size == 0:
            return P.GETXATTR_OUT.pack(len(data), 0)
        if len(data) > size:
            raise OSError(errno.ERANGE, "buffer too small")
        return data

    def getxattr(self, h: P.RequestHeader, body: memoryview) -> Payload:
        size, _ = P.GETXATTR_IN.unpack_from(body)
        name = self._name(body, P.GETXATTR_IN.size)
        return self._xattr_reply(self.ns.getxattr(h.nodeid, name), size)

    def listxattr(self, h: P.RequestHeader, body: memoryview) -> Payload:
        size, _ = P.GETXATTR_IN.unpack_from(body)
        names = self.ns.listxattr(h.nodeid)
        return self._xattr_reply(b"".join(n + b"\0" for n in names), size)

    def removexattr(self, h: P.RequestHeader, body: memoryview) -> Payload:
        self.ns.removexattr(h.nodeid, self._name(body))
        return b""

    def opendir(self, h: P.RequestHeader, body: memoryview) -> Payload:
        handle = self.ns.opendir(h.nodeid)
        return P.OPEN_OUT.pack(handle.fh, 0, 0)

    def _readdir(self, h: P.RequestHeader, body: memoryview, plus: bool) -> Payload:
        fh, offset, size, *_ = P.READ_IN.unpack_from(body)
        chunks: list[bytes] = []
        used = 0
        head = P.DIRENT_HEAD.size + (P.ENTRY_OUT_SIZE if plus else 0)

        def fits(name: bytes) -> bool:
            need = head + len(name)
            need += -need % 8
            return used + need <= size

        for entry in self.ns.readdir(fh, offset, plus, fits):
            if plus:
                if entry.st is None:
                    prefix = bytes(P.ENTRY_OUT_SIZE)
                else:
                    prefix = self._entry(entry.nodeid, entry.st)
                ino = entry.nodeid or h.nodeid
                raw = prefix + P.pack_dirent(ino, entry.cookie, entry.name, entry.mode)
            else:
                raw = P.pack_dirent(
                    self.ns.nodeid_hint(entry.st) or h.nodeid, entry.cookie, entry.name, entry.mode
                )
            chunks.append(raw)
            used += len(raw)
        return b"".join(chunks)

    def readdir(self, h: P.RequestHeader, body: memoryview) -> Payload:
        return self._readdir(h, body, plus=False)

    def readdirplus(self, h: P.RequestHeader, body: memoryview) -> Payload:
        return self._readdir(h, body, plus=True)

    def releasedir(self, h: P.RequestHeader, body: memoryview) -> Payload:
        fh, *_ = P.RELEASE_IN.unpack_from(body)
        self.ns.releasedir(fh)
        return b""

    def access(self, h: P.RequestHeader, body: memoryview) -> Payload:
        # Permission checks are the kernel's (default_permissions); existence only here.
        self.ns.inode(h.nodeid)
        return b""

    def fallocate(self, h: P.RequestHeader, body: memoryview) -> Payload:
        fh, offset, length, mode, _ = P.FALLOCATE_IN.unpack_from(body)
        if h.uid != 0:
            # Linux clears the bits on fallocate too; under HANDLE_KILLPRIV_V2 the
            # kernel leaves it to the daemon without saying so. A caller other than
            # root is taken as one without CAP_FSETID.
            self.ns.kill_suidgid(fh)
        self.ns.fallocate(fh, mode, offset, length)
        return b""

    def lseek(self, h: P.RequestHeader, body: memoryview) -> Payload:
        fh, offset, whence, _ = P.LSEEK_IN.unpack_from(body)
        return P.LSEEK_OUT.pack(self.ns.lseek(fh, offset, whence))

    def copy_file_range(self, h: P.RequestHeader, body: memoryview) -> Payload:
        fh_in, off_in, _nodeid_out, fh_out, off_out, length, _flags = (
            P.COPY_FILE_RANGE_IN.unpack_from(body)
        )
        if h.uid != 0:
            self.ns.kill_suidgid(fh_out)  # a write to fh_out (see fallocate)
        n = self.ns.copy_file_range(fh_in, off_in, fh_out, off_out, length)
        return P.WRITE_OUT.pack(n, 0)

    def interrupt(self, h: P.RequestHeader, body: memoryview) -> object:
        # Answered on the serving thread at once, so nothing is left to cancel, except a
        # request answered later: the session handles INTERRUPT for those itself.
        return NO_REPLY

    def ioctl(self, h: P.RequestHeader, body: memoryview) -> Payload:
        raise OSError(errno.ENOTTY, "no ioctls")
