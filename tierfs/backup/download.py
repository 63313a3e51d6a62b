"""Downloading a node's part of a backup round into the RAM store, verified.

Restores download straight into ``store/incoming/<id>/data`` of the RAM
store, check every file's crc32c and size against the manifest while
writing, and commit with :meth:`tierfs.store.shards.ShardStore.commit`
(:meth:`Downloader.restore_shard`). A part written by MTC (no tierfs
manifest) gets a manifest rebuilt from the listing (:func:`synthesize_manifest`).
One file of a part goes into a descriptor the caller opened, checked the same
way (:meth:`Downloader.download_file`, issue #14).

Blocking (HTTP, file writes); every request goes through
:class:`tierfs.backup.bucket.ObjectStore`.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import stat
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from tierfs.backup import layout as L
from tierfs.backup.errors import ChecksumMismatch, GcsError, IncompleteRound
from tierfs.backup.judge import NodeEntry, RoundInfo
from tierfs.backup.layout import NodeBackup
from tierfs.backup.streams import Abort, Stream, run_parallel
from tierfs.store.manifest import FileEntry, Manifest, check_entries
from tierfs.store.ramstore import RamStore
from tierfs.store.shards import Shard, ShardStore

if TYPE_CHECKING:
    from tierfs.backup.bucket import ObjectStore
    from tierfs.backup.listing import RoundListing


class Downloader:
    """Downloads of node parts from rounds of one bucket spec (thread-safe).

    Args:
        objects: the bucket's objects (the only way to the bucket).
        rounds: the listing, to inspect a round the caller did not inspect.
    """

    def __init__(self, objects: ObjectStore, rounds: RoundListing) -> None:
        self.objects = objects
        self.rounds = rounds
        self.spec = objects.spec

    def download_part(
        self,
        job: str,
        round_name: str,
        rank: int,
        step: int,
        dest: str,
        *,
        info: RoundInfo | None = None,
        framework: str | None = None,
        cancel: threading.Event | None = None,
        on_bytes: Callable[[int], None] | None = None,
    ) -> Manifest:
        """Download node ``rank``'s part of ``step`` in a round into ``dest/data``.

        Every file is checked against the manifest (size and crc32c computed
        while writing); directories, symlinks and modes are recreated from it.
        ``dest`` must exist; ``dest/data`` must not.

        Args:
            info: the inspected round (inspected here if None).
            framework: for rounds written by MTC (no tierfs manifest): the
                job's framework, used to rebuild a manifest from the listing.

        Returns:
            the shard manifest the data matches.

        Raises:
            IncompleteRound: the part is missing or incomplete.
            ChecksumMismatch: a downloaded object differs from the manifest.
            Cancelled, OSError (e.g. ENOSPC), google.api_core exceptions.
        """
        if info is None:
            info = self.rounds.inspect_round(job, round_name)
        manifest, objects = _part_files(job, round_name, rank, step, info, framework)
        prefix = self.spec.round_dir(job, round_name)
        data = os.path.join(dest, "data")
        os.mkdir(data, 0o700)
        for f in manifest.files:
            if f.kind == "dir":
                os.makedirs(os.path.join(data, f.path), 0o700, exist_ok=True)
            elif f.kind == "file":
                os.makedirs(os.path.dirname(os.path.join(data, f.path)), 0o700, exist_ok=True)
        files = sorted(
            (f for f in manifest.files if f.kind == "file"), key=lambda f: f.size, reverse=True
        )
        abort = Abort(cancel)

        def fetch(f: FileEntry) -> None:
            path = os.path.join(data, f.path)
            name = prefix + objects[f.path]
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb", buffering=1 << 20) as out:
                w = Stream(out, abort, on_bytes, self.objects.monitor)
                with self.objects.request() as kw:
                    self.objects.bucket.blob(name).download_to_file(w, checksum=None, **kw)
            if w.size != f.size or w.crc != f.crc32c:
                raise ChecksumMismatch(
                    f"{objects[f.path]} in round {round_name}: got {w.size} bytes crc32c "
                    f"{w.crc:08x}, manifest {f.size} bytes crc32c {(f.crc32c or 0):08x}"
                )

        run_parallel(
            self.objects.settings.threads, [functools.partial(fetch, f) for f in files], abort
        )
        for f in manifest.files:
            if f.kind == "symlink":
                os.symlink(f.target or "", os.path.join(data, f.path))
        for f in reversed(manifest.files):
            if f.kind in ("file", "dir"):
                os.chmod(os.path.join(data, f.path), stat.S_IMODE(f.mode))
        return manifest

    def download_file(
        self,
        job: str,
        round_name: str,
        rank: int,
        step: int,
        path: str,
        fd: int,
        *,
        info: RoundInfo | None = None,
        part: NodeBackup | None = None,
        framework: str | None = None,
        cancel: threading.Event | None = None,
        on_bytes: Callable[[int], None] | None = None,
        write: Callable[[bytes, int], None] | None = None,
    ) -> int:
        """Download one file of node ``rank``'s part of ``step`` in a round into the open
        descriptor ``fd`` (issue #14: a whole-step view reads a file of another
        rank's part).

        Positional writes from offset 0 (``os.pwrite``: ``fd``'s file offset does
        not move; ``fd`` is not truncated). One object read (its retries resume
        where the bytes stopped); size and crc32c are computed while writing and
        checked against the part's manifest.

        Args:
            path: relative to the part's root, as its manifest lists it.
            info: the inspected round: its complete part is read (inspected here
                if neither ``info`` nor ``part`` is given).
            part: the part's tierfs manifest as read alone
                (:meth:`tierfs.backup.listing.RoundListing.read_part`): no listing;
                the object is read whether or not the part is complete.
            framework: for rounds written by MTC, as for :meth:`download_part`.
            cancel: set -> :class:`Cancelled` at the next piece.
            on_bytes: told each piece's bytes.
            write: ``write(data, offset)`` writes each piece instead of ``os.pwrite``
                into ``fd`` (what it raises ends the download).

        Returns:
            bytes written (the file's size).

        Raises:
            IncompleteRound: the part is missing or incomplete (``info``).
            GcsError: ``path`` is not a file of the part.
            ChecksumMismatch: the object differs from the manifest (bytes may
                have been written).
            Cancelled, OSError (writing to ``fd``: ENOSPC...), google.api_core
                exceptions, BucketTimeout.
        """
        if part is not None:
            manifest, objects = part.manifest, part.objects
        else:
            if info is None:
                info = self.rounds.inspect_round(job, round_name)
            manifest, objects = _part_files(job, round_name, rank, step, info, framework)
        entry = next((f for f in manifest.files if f.path == path), None)
        if entry is None or entry.kind != "file" or path not in objects:
            raise GcsError(
                f"{path!r} is not a file of rank {rank}'s part of step {step} in round {round_name}"
            )
        name = self.spec.round_dir(job, round_name) + objects[path]
        w = Stream(_PositionalFile(fd, write), Abort(cancel), on_bytes, self.objects.monitor)
        with self.objects.request() as kw:
            self.objects.bucket.blob(name).download_to_file(w, checksum=None, **kw)
        if w.size != entry.size or w.crc != entry.crc32c:
            raise ChecksumMismatch(
                f"{objects[path]} in round {round_name}: got {w.size} bytes crc32c "
                f"{w.crc:08x}, manifest {entry.size} bytes crc32c {(entry.crc32c or 0):08x}"
            )
        return w.size

    def restore_shard(
        self,
        shards: ShardStore,
        job: str,
        round_name: str,
        rank: int,
        step: int,
        *,
        info: RoundInfo | None = None,
        framework: str | None = None,
        cancel: threading.Event | None = None,
        on_bytes: Callable[[int], None] | None = None,
        free_bytes: int | None = None,
    ) -> Shard:
        """Download a node's part into ``store/incoming/`` and commit it as a verified shard.

        Args:
            free_bytes: if given, refuse (GcsError) a part larger than this
                many bytes before downloading anything (RAM budget).

        Raises:
            like :meth:`download_part`; nothing is left behind on failure.
        """
        if info is None:
            info = self.rounds.inspect_round(job, round_name)
        part = info.parts.get((rank, step))
        if free_bytes is not None and part is not None:
            need = part.backup.manifest.total_bytes if part.backup is not None else part.bytes
            if need > free_bytes:
                raise GcsError(
                    f"round {round_name} rank {rank}: {need} bytes do not fit in "
                    f"the {free_bytes} bytes left in the RAM budget"
                )
        inc = shards.ram.new_incoming(f"gcs-{rank}-{step}")
        try:
            manifest = self.download_part(
                job,
                round_name,
                rank,
                step,
                inc,
                info=info,
                framework=framework,
                cancel=cancel,
                on_bytes=on_bytes,
            )
            return shards.commit(inc, manifest, verified=True)
        except BaseException:
            _discard(shards.ram, inc)
            raise


def _part_files(
    job: str, round_name: str, rank: int, step: int, info: RoundInfo, framework: str | None
) -> tuple[Manifest, dict[str, str]]:
    """The manifest of node ``rank``'s part of ``step`` in an inspected round and its
    objects (manifest path -> object name under the round's directory); a part
    written by MTC gets one rebuilt from the listing (:func:`synthesize_manifest`).

    Raises:
        IncompleteRound: the part is missing or incomplete.
    """
    part = info.parts.get((rank, step))
    if part is None or not part.complete:
        why = "; ".join(part.missing[:3]) if part else "no pointer"
        raise IncompleteRound(
            f"round {round_name} has no complete part for rank {rank} step {step} ({why})"
        )
    if part.backup is not None:
        return part.backup.manifest, part.backup.objects
    return synthesize_manifest(job, rank, step, framework or "orbax", part, info)


class _PositionalFile:
    """A writable file object over a descriptor that writes with ``os.pwrite`` from
    offset 0: the descriptor's own file offset never moves (or with ``write(data,
    offset)``, when given, instead of ``os.pwrite``)."""

    def __init__(self, fd: int, write: Callable[[bytes, int], None] | None = None) -> None:
        self.fd = fd
        self.pos = 0
        self._write = write

    def write(self, data: bytes) -> int:
        if self._write is not None:
            data = bytes(data)
            self._write(data, self.pos)
            self.pos += len(data)
            return len(data)
        view = memoryview(data)
        while view:
            n = os.pwrite(self.fd, view, self.pos)
            view = view[n:]
            self.pos += n
        return len(data)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence != os.SEEK_SET:
            raise OSError(errno.ESPIPE, "only absolute positions")
        self.pos = offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass


def _discard(ram: RamStore, path: str) -> None:
    try:
        ram.to_trash(path)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)


def synthesize_manifest(
    job: str, rank: int, step: int, framework: str, part: NodeEntry, info: RoundInfo
) -> tuple[Manifest, dict[str, str]]:
    """A shard manifest for a part written by MTC (no tierfs manifest), from the listing.

    The crc32c GCS reports for each object stands in for the seal-time
    checksum. Directory data (``D<hash>.data/...``) becomes the step
    directory ``<step>``; single objects become the ``pytorch`` worker file
    ``<job>-s<step>-n<rank>-w<w>.save``.

    Raises:
        IncompleteRound: an object lacks a crc32c.
    """
    files: list[FileEntry] = []
    objects: dict[str, str] = {}
    dirs: set[str] = set()
    for w, h in sorted(part.metas.items()):
        if h is None:
            continue
        dname = L.data_name(h)
        if dname in info.objects:
            o = info.objects[dname]
            path = f"{job}-s{step}-n{rank}-w{w}.save"
            if o.crc32c is None:
                raise IncompleteRound(f"{dname}: no crc32c in the listing")
            files.append(FileEntry(path, "file", size=o.size, crc32c=o.crc32c))
            objects[path] = dname
            continue
        top = str(step)
        dirs.add(top)
        for name, o in sorted(info.objects.items()):
            if not name.startswith(dname + "/"):
                continue
            rel = name[len(dname) + 1 :]
            if not rel or rel.endswith("/"):
                continue
            if o.crc32c is None:
                raise IncompleteRound(f"{name}: no crc32c in the listing")
            path = f"{top}/{rel}"
            parent = path.rsplit("/", 1)[0]
            while parent and parent not in dirs:
                dirs.add(parent)
                parent = parent.rsplit("/", 1)[0] if "/" in parent else ""
            files.append(FileEntry(path, "file", size=o.size, crc32c=o.crc32c))
            objects[path] = name
    entries = [FileEntry(d, "dir", mode=0o755) for d in sorted(dirs)]
    entries += [FileEntry(f.path, f.kind, f.size, 0o644, f.crc32c) for f in files]
    entries.sort(key=lambda e: e.path)
    check_entries(entries)
    name = str(step) if dirs else (entries[0].path if entries else str(step))
    manifest = Manifest(
        job=job, rank=rank, step=step, name=name, framework=framework, files=tuple(entries)
    )
    return manifest, objects
