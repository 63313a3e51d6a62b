"""Moving one shard's bytes: reading a sealed snapshot as chunks, receiving them safely.

Both sides of PushShard and PullShard use these; they block (file I/O and
crc32c), so they run in gRPC server threads or ``trio.to_thread`` workers,
never on the trio/FUSE thread. No gRPC here: tests drive them directly.
Threads that move a replica's bytes lower their priority
(:func:`set_thread_nice`, :data:`REPLICATION_NICE`) so a trainer on the node
keeps its CPU.

Receiving (:class:`ShardReceiver`) writes into ``store/incoming/<id>/data``:

* every chunk's crc32c is checked before it is written (:class:`BadCopy`);
* paths are checked as they arrive (no ``..``, no absolute paths, no empty
  or dot components) and, once the manifest is known, must be files it
  lists (:class:`Refused`);
* files are written in order and opened with ``O_NOFOLLOW | O_EXCL``; no
  symlink exists in the tree until every file is written, and symlinks come
  only from the manifest, whose targets must stay inside the shard
  (:func:`tierfs.store.manifest.check_entries`);
* at the end every file's size and crc32c must equal the manifest's; only
  then may the caller commit (:meth:`tierfs.store.shards.ShardStore.commit`).

The manifest itself must parse (:func:`parse_manifest`) and describe the
shard the stream announced (:func:`check_identity`).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import google_crc32c

from tierfs.core.errors import ClusterError
from tierfs.store.chunks import crc32c_append
from tierfs.store.manifest import FileEntry, Manifest, ManifestError, check_entries, check_path
from tierfs.store.shards import ShardKey, link_tree

CHUNK = 4 << 20

#: nice value of threads that move replicas (a trainer on the node keeps priority)
REPLICATION_NICE = 10


def set_thread_nice(value: int) -> int | None:
    """Set this thread's nice value (Linux: per thread); returns the old one, None if refused."""
    tid = threading.get_native_id()
    try:
        old = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, value)
        return old
    except OSError:
        return None


class TransferError(ClusterError):
    """A transfer could not complete; the message is one line for logs and errors."""


class BadCopy(TransferError):
    """The bytes do not match their checksums (a chunk's or a file's crc32c, a size)."""


class OtherBytes(TransferError):
    """The holder's copy lists the file with another size or crc32c than the caller's
    manifest (not damaged: other bytes, e.g. the step saved again since)."""


class Refused(TransferError):
    """The sender broke the protocol: unsafe or unexpected paths, chunks out of order."""


class Cancelled(TransferError):
    """The transfer was cancelled (the shard was withdrawn, the daemon stops)."""


def iter_chunks(
    root: str,
    files: tuple[FileEntry, ...] | list[FileEntry],
    chunk: int = CHUNK,
    cancelled: Callable[[], bool] | None = None,
) -> Iterator[tuple[str, int, bytes, int]]:
    """Read the files of a shard as ``(path, offset, data, crc32c)`` chunks, in manifest order.

    Args:
        root: the shard's ``data`` directory (a sealed snapshot).
        files: its manifest entries (only ``kind == "file"`` are read).
        chunk: bytes per chunk (1-4 MiB on the wire).
        cancelled: polled before every chunk.

    Raises:
        OSError: a file vanished (the shard was dropped) or is unreadable.
        Cancelled: ``cancelled()`` turned true.
    """
    for f in files:
        if f.kind != "file":
            continue
        fd = os.open(os.path.join(root, f.path), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            offset = 0
            while True:
                if cancelled is not None and cancelled():
                    raise Cancelled("transfer cancelled")
                data = os.read(fd, chunk)
                if not data:
                    break
                yield f.path, offset, data, google_crc32c.value(data)
                offset += len(data)
        finally:
            os.close(fd)


@dataclass
class _Open:
    fd: int
    size: int = 0
    crc: int = 0


class ShardReceiver:
    """Write one incoming shard into ``incoming/data`` and check it (see the module docstring).

    Args:
        incoming: a fresh directory from :meth:`tierfs.store.ramstore.RamStore.new_incoming`.
        manifest: the manifest when it comes first (PullShard); for PushShard
            it comes last, with :meth:`finish`.

    Not thread-safe; one receiver per stream.
    """

    def __init__(self, incoming: str, manifest: Manifest | None = None) -> None:
        self.incoming = incoming
        self.data = os.path.join(incoming, "data")
        os.makedirs(self.data, exist_ok=True)
        self.manifest = manifest
        self._expect = (
            {f.path: f for f in manifest.files if f.kind == "file"}
            if manifest is not None
            else None
        )
        self._files: dict[str, _Open] = {}
        self._current: str | None = None
        self.bytes_received = 0

    def _close_current(self) -> None:
        if self._current is not None:
            st = self._files[self._current]
            if st.fd >= 0:
                os.close(st.fd)
                st.fd = -1
            self._current = None

    def chunk(self, path: str, offset: int, data: bytes, crc: int) -> None:
        """Check and write one chunk.

        Raises:
            BadCopy: the chunk's crc32c does not match its bytes.
            Refused: unsafe path, a path the manifest does not list as a
                file, or an offset other than the file's current end.
            OSError: writing failed (ENOSPC...).
        """
        try:
            check_path(path)
        except ManifestError as exc:
            raise Refused(str(exc)) from None
        if self._expect is not None and path not in self._expect:
            raise Refused(f"{path!r} is not a file of the manifest")
        got = google_crc32c.value(data)  # the only pass over the bytes here
        if got != crc:
            raise BadCopy(f"{path} at offset {offset}: chunk crc32c mismatch")
        st = self._files.get(path)
        if st is None:
            self._close_current()
            full = os.path.join(self.data, path)
            parent = os.path.dirname(full)
            if parent != self.data:
                os.makedirs(parent, exist_ok=True)
            fd = os.open(
                full, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
            )
            st = self._files[path] = _Open(fd)
            self._current = path
        elif self._current != path:
            raise Refused(f"{path!r}: chunks of one file must be contiguous")
        if offset != st.size:
            raise Refused(f"{path!r}: chunk at offset {offset}, expected {st.size}")
        if self._expect is not None and st.size + len(data) > self._expect[path].size:
            raise BadCopy(f"{path}: more bytes than the manifest's {self._expect[path].size}")
        view = memoryview(data)
        while view:
            n = os.write(st.fd, view)
            view = view[n:]
        st.size += len(data)
        st.crc = crc32c_append(st.crc, data, got)  # no second pass
        self.bytes_received += len(data)

    def finish(self, manifest: Manifest | None = None) -> Manifest:
        """Check every file against the manifest and create its directories and symlinks.

        Args:
            manifest: required if none was given at construction.

        Returns:
            The manifest; ``incoming`` is ready for ``ShardStore.commit``.

        Raises:
            BadCopy: a file is missing, or its size or crc32c differs.
            Refused: unsafe manifest, files the manifest does not list,
                entries that clash.
        """
        self._close_current()
        m = manifest or self.manifest
        if m is None:
            raise Refused("no manifest")
        try:
            check_entries(m.files, m.chunk_size)
        except ManifestError as exc:
            raise Refused(str(exc)) from None
        listed = {f.path: f for f in m.files}
        for path in self._files:
            entry = listed.get(path)
            if entry is None or entry.kind != "file":
                raise Refused(f"{path!r} was sent but is not a file of the manifest")
        dirs: list[FileEntry] = []
        for f in m.files:
            full = os.path.join(self.data, f.path)
            if f.kind == "dir":
                if os.path.lexists(full) and (os.path.islink(full) or not os.path.isdir(full)):
                    raise Refused(f"{f.path!r}: directory clashes with another entry")
                os.makedirs(full, exist_ok=True)
                dirs.append(f)
            elif f.kind == "symlink":
                if os.path.lexists(full):
                    raise Refused(f"{f.path!r}: symlink clashes with another entry")
                os.makedirs(os.path.dirname(full), exist_ok=True)
                os.symlink(f.target or "", full)
            else:
                st = self._files.get(f.path)
                if st is None:
                    if f.size != 0:
                        raise BadCopy(f"{f.path}: missing ({f.size} bytes expected)")
                    os.makedirs(os.path.dirname(full), exist_ok=True)
                    os.close(
                        os.open(
                            full,
                            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                            0o600,
                        )
                    )
                    st = _Open(-1)
                if st.size != f.size:
                    raise BadCopy(f"{f.path}: size {st.size} != {f.size}")
                if st.crc != f.crc32c:
                    raise BadCopy(f"{f.path}: crc32c {st.crc:08x} != {f.crc32c:08x}")
                os.chmod(full, f.mode)
        for f in reversed(dirs):
            os.chmod(os.path.join(self.data, f.path), f.mode)
        self.manifest = m
        return m

    def abort(self) -> None:
        """Close everything and delete the incoming directory."""
        for st in self._files.values():
            if st.fd >= 0:
                try:
                    os.close(st.fd)
                except OSError:
                    pass
                st.fd = -1
        self._current = None
        shutil.rmtree(self.incoming, ignore_errors=True)


def parse_manifest(data: bytes) -> Manifest:
    """The manifest a sender sent, parsed (:class:`Refused` if it does not parse)."""
    try:
        return Manifest.from_json(data)
    except ManifestError as exc:
        raise Refused(f"bad manifest: {exc}") from None


def check_identity(m: Manifest, key: ShardKey, digest: str) -> None:
    """Refuse a manifest of another shard than ``key``; :class:`BadCopy` if its digest is
    not the announced ``digest`` (empty: not checked)."""
    if (m.job, m.rank, m.step) != (key.job, key.rank, key.step):
        raise Refused(f"manifest is for {m.job}/n{m.rank}/s{m.step}, not {key}")
    if digest and m.digest != digest:
        raise BadCopy(f"manifest digest {m.digest} != announced {digest}")


def identical_content(a: Manifest, b: Manifest) -> bool:
    """True when ``a`` and ``b`` list the same paths with the same kind, size, crc32c
    and link target: all the checksums can prove about two shards being
    identical. (Equal :attr:`tierfs.store.manifest.Manifest.digest` values are a
    32-bit summary of the same list; they guide, this decides.)"""

    def key(m: Manifest) -> list[tuple[str, str, int, int | None, str | None]]:
        return sorted((f.path, f.kind, f.size, f.crc32c, f.target) for f in m.files)

    return key(a) == key(b)


def link_copy(src_data: str, incoming: str) -> None:
    """Dedup: hard-link an identical local shard's ``data`` tree into ``incoming/data``.

    Raises:
        OSError: the source vanished meanwhile.
    """
    link_tree(src_data, os.path.join(incoming, "data"))
