"""Manifests: what a sealed shard holds, with a crc32c per file (DESIGN.md principle 6).

A shard is the data one node rank saved for one step: the top-level entries
of the client's view that make up that step (a step directory, a ``.save``
file per worker, a tracker file...). Its manifest lists every directory,
file and symlink under those entries with relative path, size, mode and the
file's crc32c (Castagnoli, the checksum GCS uses). Manifests travel with
every copy (peer replica, GCS backup) and every copy is verified against
them before it is used.

Building and verifying read every byte: call them from worker threads.
"""

from __future__ import annotations

import json
import os
import posixpath
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Required

import google_crc32c
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError, with_config
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

from tierfs.core.errors import StorageError
from tierfs.store.chunks import CHUNK as CHUNK_SIZE
from tierfs.store.chunks import chunk_count, combine_chunks, crc32c_combine

FORMAT = "tierfs.store.manifest/1"
#: bytes per checksummed chunk of a sealed file (recorded as ``chunk_size``)
CHUNK = CHUNK_SIZE


class ManifestError(StorageError, ValueError):
    """A manifest is malformed or names an unsafe path."""


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One object of a shard.

    Attributes:
        path: relative POSIX path inside the shard's data directory.
        kind: ``file``, ``dir`` or ``symlink``.
        size: bytes (files only).
        mode: permission bits (``stat.S_IMODE``).
        crc32c: crc32c of the file's bytes (files only).
        target: the link target (symlinks only), as stored.
        chunks: crc32c of each ``chunk_size``-byte chunk of the file (the
            manifest's :attr:`Manifest.chunk_size`; the last chunk shorter), for
            a file of more than one chunk sealed since per-chunk checksums exist;
            None otherwise (a file of one chunk: its crc32c is the chunk's).
            Not part of :attr:`Manifest.digest`.
    """

    path: str
    kind: str
    size: int = 0
    mode: int = 0o644
    crc32c: int | None = None
    target: str | None = None
    chunks: tuple[int, ...] | None = None


#: verdict states (:attr:`StepVerdict.state`)
COMPLETE = "complete"
INCOMPLETE = "incomplete"
UNKNOWN_LAYOUT = "unknown_layout"
#: problem kinds that no other rank's part can fix (the step never loads)
FATAL_KINDS = frozenset({"damaged", "unfinished"})
#: problem kinds another rank's part may resolve (fatal when the part is the whole step)
OPEN_KINDS = frozenset({"missing", "unreadable"})


@dataclass(frozen=True, slots=True)
class VerdictProblem:
    """One reason a sealed part would not load (a
    :class:`tierfs.store.validators.Problem` as plain data).

    Attributes:
        kind: ``missing``, ``damaged``, ``unreadable`` or ``unfinished``.
        path: the file, relative to the mount root.
        message: what is wrong.
    """

    kind: str
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


@dataclass(frozen=True)
class StepVerdict:
    """Whether the framework could load a sealed part, judged at seal time (issue #15).

    Recorded in the manifest, so it survives restarts and travels with every
    copy (replica, backup round).

    Attributes:
        state: :data:`COMPLETE`, :data:`INCOMPLETE` or :data:`UNKNOWN_LAYOUT`
            (no format recognised: the rename rule decides, the part counts).
        format: the detected formats (``"orbax"``, ``"dcp"``...), ``"unknown"``.
        problems: why it would not load (at most 20 kept).
    """

    state: str
    format: str = "unknown"
    problems: tuple[VerdictProblem, ...] = ()

    def blocking(self, whole: bool) -> tuple[VerdictProblem, ...]:
        """The problems that keep the step from ever loading.

        Args:
            whole: this part is the whole step (a one-node job): then a
                missing or unreadable file is one no other rank will bring.
        """
        kinds = FATAL_KINDS | OPEN_KINDS if whole else FATAL_KINDS
        return tuple(p for p in self.problems if p.kind in kinds)

    def reason(self, whole: bool) -> str:
        """One line why the step is not eligible as last known good, "" if it is."""
        blocking = self.blocking(whole)
        if not blocking:
            return ""
        more = f" (+{len(blocking) - 1} more)" if len(blocking) > 1 else ""
        return f"{blocking[0].kind}: {blocking[0]}{more}"

    def to_doc(self) -> dict[str, Any]:
        """The JSON form (inside a manifest's ``verdict``)."""
        return {
            "state": self.state,
            "format": self.format,
            "problems": [
                {"kind": p.kind, "path": p.path, "message": p.message} for p in self.problems
            ],
        }


@dataclass(frozen=True)
class Manifest:
    """The contents of one shard: (job, rank, step) plus its files.

    Attributes:
        job: job name.
        rank: node rank that saved it.
        step: step number.
        name: the primary top-level entry (e.g. ``"5"``, ``"checkpoint-500"``).
        framework: the framework that saved it (``orbax``, ``generic``...).
        files: every object under the shard's entries, parents before children.
        created: Unix time of the seal (seconds).
        backup_requested: the step carries ``_BACKUP_REQUESTED``.
        verdict: whether its framework could load it (judged at seal; None:
            not judged, e.g. a shard sealed before verdicts existed).
        nodes: the node count of the job that wrote the step (its *writer
            topology*, issue #16): a step written by N nodes is complete with
            the parts of ranks 0..N-1, whatever node count restores it. 0:
            unknown (a shard sealed before this field existed; read as the
            restoring job's node count).
        chunk_size: bytes per chunk of :attr:`FileEntry.chunks` (0: the manifest
            carries no per-chunk checksums, e.g. sealed before they existed).
        replaces: the parts of this step this save replaced, as (node rank,
            manifest digest) pairs: when the node began writing the step again
            (its seal withdrawn by a write), its own former part and the other
            ranks' parts it held then belonged to an earlier save of the step
            (issue #16 F9: a restore must never combine them with this save's
            parts). () for a first save. Not part of :attr:`digest`.
        began: Unix time (seconds, the writer's clock) when the node began the
            save this part is of by writing a sealed file of the step again; 0.0
            for a first save.
        sealed: Unix time (seconds) of this seal (``created`` keeps the first
            seal's time across saves); 0.0 unknown (sealed before it was recorded).
    """

    job: str
    rank: int
    step: int
    name: str
    framework: str
    files: tuple[FileEntry, ...]
    created: float = field(default_factory=time.time)
    backup_requested: bool = False
    verdict: StepVerdict | None = None
    nodes: int = 0
    chunk_size: int = 0
    replaces: tuple[tuple[int, str], ...] = ()
    began: float = 0.0
    sealed: float = 0.0

    def chunks_of(self, entry: FileEntry) -> tuple[int, tuple[int, ...]] | None:
        """(chunk size in bytes, crc32c of each chunk) of file ``entry``, or None when
        this manifest cannot say (no per-chunk checksums for a file of more than one
        chunk). A file of at most one chunk is its own chunk."""
        if entry.kind != "file" or entry.crc32c is None or self.chunk_size <= 0:
            return None
        if entry.chunks is not None:
            return self.chunk_size, entry.chunks
        if entry.size == 0:
            return self.chunk_size, ()
        if entry.size <= self.chunk_size:
            return self.chunk_size, (entry.crc32c,)
        return None

    @property
    def total_bytes(self) -> int:
        """Sum of file sizes in bytes."""
        return sum(f.size for f in self.files if f.kind == "file")

    @property
    def top_level(self) -> list[str]:
        """The top-level entry names the shard holds (its view footprint)."""
        return sorted({f.path.split("/", 1)[0] for f in self.files})

    @property
    def digest(self) -> str:
        """Content identity: crc32c over the sorted (path, kind, size, crc, target) list.

        Two shards with equal digests hold identical bytes under identical
        relative paths (the data-parallel dedup test), regardless of rank,
        step number or entry names' owner.
        """
        h = google_crc32c.Checksum()  # type: ignore[no-untyped-call]
        for f in sorted(self.files, key=lambda e: e.path):
            line = f"{f.path}\0{f.kind}\0{f.size}\0{f.crc32c}\0{f.target}\n".encode()
            h.update(line)  # type: ignore[no-untyped-call]
        digest: bytes = h.digest()  # type: ignore[no-untyped-call]
        return f"{int.from_bytes(digest, 'big'):08x}-{self.total_bytes:x}"

    def to_json(self) -> bytes:
        """Serialize (stable key order)."""
        d: dict[str, Any] = {
            "format": FORMAT,
            "job": self.job,
            "rank": self.rank,
            "step": self.step,
            "name": self.name,
            "framework": self.framework,
            "created": self.created,
            "backup_requested": self.backup_requested,
            "files": [
                {k: v for k, v in asdict(f).items() if v is not None and k != "chunks"}
                for f in self.files
            ],
        }
        if self.verdict is not None:
            d["verdict"] = self.verdict.to_doc()
        if self.nodes > 0:
            d["nodes"] = self.nodes
        if self.chunk_size > 0:
            # top-level keys, which a daemon of before per-chunk checksums ignores
            d["chunk_size"] = self.chunk_size
            chunks = {f.path: f.chunks for f in self.files if f.chunks is not None}
            if chunks:
                d["chunks"] = chunks
        if self.replaces:
            # a top-level key, which a daemon of before F9 ignores
            d["replaces"] = [[r, dg] for r, dg in self.replaces]
        if self.began > 0:
            d["began"] = self.began
        if self.sealed > 0:
            d["sealed"] = self.sealed
        return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> Manifest:
        """Parse and validate a manifest (:class:`ManifestDoc`; paths are checked, see
        :func:`check_entries`). Reads every manifest :meth:`to_json` ever wrote
        (``created`` and ``backup_requested`` may be missing: 0 and False).

        Raises:
            ManifestError: bad JSON, wrong format, a missing or mistyped field, unsafe paths.
        """
        try:
            doc = ManifestDoc.model_validate_json(data)
        except ValidationError as exc:
            raise ManifestError(_manifest_problem(exc)) from None
        return cls._checked(doc)

    @classmethod
    def from_obj(cls, obj: object) -> Manifest:
        """As :meth:`from_json`, from the manifest already parsed from JSON (a dict, e.g.
        nested in a backup manifest object): not serialized and parsed again (at
        10,000 parts of a backup round, that doubled the restore's bucket read).

        Raises:
            ManifestError: as :meth:`from_json`.
        """
        try:
            doc = ManifestDoc.model_validate(obj)
        except ValidationError as exc:
            raise ManifestError(_manifest_problem(exc)) from None
        return cls._checked(doc)

    @classmethod
    def _checked(cls, doc: ManifestDoc) -> Manifest:
        """The manifest ``doc`` describes, its paths and chunk checksums checked."""
        m = doc.manifest()
        check_entries(m.files, m.chunk_size)
        if doc.chunks and len(doc.chunks) != sum(1 for f in m.files if f.chunks is not None):
            raise ManifestError("chunk checksums of a path that is not a file of the manifest")
        return m


@with_config(ConfigDict(extra="forbid"))
class FileEntryDoc(TypedDict, total=False):
    """One element of a manifest's ``files`` (the JSON form of :class:`FileEntry`:
    ``crc32c`` and ``target`` are left out when None). A TypedDict, not a model:
    a manifest may list 10⁵ files, and dicts are validated in pydantic's core."""

    path: Required[StrictStr]
    kind: Required[StrictStr]
    size: StrictInt
    mode: StrictInt
    crc32c: StrictInt | None
    target: StrictStr | None


class VerdictProblemDoc(BaseModel):
    """One problem of a manifest's ``verdict``."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    kind: StrictStr
    path: StrictStr
    message: StrictStr


class VerdictDoc(BaseModel):
    """A manifest's ``verdict`` (:meth:`StepVerdict.to_doc`)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    state: Literal["complete", "incomplete", "unknown_layout"]
    format: StrictStr = "unknown"
    problems: list[VerdictProblemDoc] = []

    def verdict(self) -> StepVerdict:
        """The :class:`StepVerdict`."""
        return StepVerdict(
            self.state,
            self.format,
            tuple(VerdictProblem(p.kind, p.path, p.message) for p in self.problems),
        )


class ManifestDoc(BaseModel):
    """The JSON of a sealed shard's manifest, format :data:`FORMAT` (what
    :meth:`Manifest.to_json` writes: keys sorted, no spaces); unknown keys are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True, defer_build=True)

    format: Literal["tierfs.store.manifest/1"]
    job: StrictStr
    rank: int
    step: int
    name: StrictStr
    framework: StrictStr
    files: list[FileEntryDoc]
    created: float = 0.0
    backup_requested: bool = False
    verdict: VerdictDoc | None = None
    nodes: int = 0
    chunk_size: int = 0
    #: path -> crc32c of each chunk (files of more than one chunk)
    chunks: dict[StrictStr, list[StrictInt]] = {}
    #: [node rank, manifest digest] of the parts of an earlier save this one replaced
    replaces: list[tuple[StrictInt, StrictStr]] = []
    began: float = 0.0
    sealed: float = 0.0

    def manifest(self) -> Manifest:
        """The :class:`Manifest` (not yet path-checked)."""
        return Manifest(
            job=self.job,
            rank=self.rank,
            step=self.step,
            name=self.name,
            framework=self.framework,
            files=tuple(_entry(f, self.chunks) for f in self.files),
            created=self.created,
            backup_requested=self.backup_requested,
            verdict=self.verdict.verdict() if self.verdict is not None else None,
            nodes=max(self.nodes, 0),
            chunk_size=max(self.chunk_size, 0),
            replaces=tuple((int(r), str(d)) for r, d in self.replaces),
            began=max(self.began, 0.0),
            sealed=max(self.sealed, 0.0),
        )


def _entry(doc: FileEntryDoc, chunks: dict[str, list[int]]) -> FileEntry:
    crcs = chunks.get(doc["path"])
    if crcs is None:
        return FileEntry(**doc)
    return FileEntry(**doc, chunks=tuple(crcs))


def _manifest_problem(exc: ValidationError) -> str:
    err = exc.errors()[0]
    if err["type"] == "json_invalid":
        return f"manifest is not JSON: {err['msg']}"
    if err["type"] == "model_type" or err["loc"] in (("format",),):
        return "not a tierfs manifest"
    where = ".".join(str(p) for p in err["loc"])
    return f"malformed manifest: {where}: {err['msg']}"


def check_path(path: str) -> None:
    """Refuse absolute paths, ``..``, empty or dot components, NUL bytes.

    Raises:
        ManifestError: naming the path.
    """
    if not path or path.startswith("/") or "\0" in path or "\\" in path:
        raise ManifestError(f"unsafe path {path!r}")
    for part in path.split("/"):
        if part in ("", ".", ".."):
            raise ManifestError(f"unsafe path {path!r}")


def check_entries(files: Iterable[FileEntry], chunk_size: int = 0) -> None:
    """Validate every entry: safe paths, known kinds, symlinks that stay inside the shard,
    per-chunk checksums (``chunk_size`` bytes each) that are as many as the file's
    chunks and combine to its crc32c.

    Raises:
        ManifestError: on the first unsafe or malformed entry.
    """
    seen: set[str] = set()
    for f in files:
        check_path(f.path)
        if f.path in seen:
            raise ManifestError(f"duplicate path {f.path!r}")
        seen.add(f.path)
        if f.kind not in ("file", "dir", "symlink"):
            raise ManifestError(f"unknown kind {f.kind!r} for {f.path!r}")
        if f.kind == "file" and (f.size < 0 or f.crc32c is None):
            raise ManifestError(f"file {f.path!r} lacks size or crc32c")
        if f.chunks is not None:
            if chunk_size <= 0 or len(f.chunks) != chunk_count(f.size, chunk_size):
                raise ManifestError(f"file {f.path!r}: chunk checksums do not fit its size")
            if combine_chunks(f.chunks, f.size, chunk_size) != f.crc32c:
                raise ManifestError(f"file {f.path!r}: chunk checksums do not make its crc32c")
        if f.kind == "symlink":
            target = f.target or ""
            if not target or target.startswith("/"):
                raise ManifestError(f"symlink {f.path!r} escapes the shard ({target!r})")
            resolved = posixpath.normpath(posixpath.join(posixpath.dirname(f.path), target))
            if resolved == ".." or resolved.startswith("../"):
                raise ManifestError(f"symlink {f.path!r} escapes the shard ({target!r})")


def check_self_contained(files: Iterable[FileEntry]) -> None:
    """Refuse a symlink that resolves outside the shard's own top-level entries.

    :func:`check_entries` keeps links inside the shard's root; at seal time a
    step must also not link into a *sibling* step (``checkpoint-6/x ->
    ../checkpoint-1/y``): wherever the step is restored, that target may be
    missing or hold other bytes.

    Raises:
        ManifestError: naming the first such link.
    """
    files = list(files)
    tops = {f.path.split("/", 1)[0] for f in files}
    for f in files:
        if f.kind != "symlink":
            continue
        target = f.target or ""
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(f.path), target))
        if resolved.split("/", 1)[0] not in tops:
            raise ManifestError(f"symlink {f.path!r} leaves the step ({target!r})")


def crc32c_file(
    path: str | int, buf: bytearray | None = None, cancelled: Callable[[], bool] | None = None
) -> tuple[int, int]:
    """crc32c and size of a file (path or open descriptor), streaming 4 MiB at a time.

    ``buf`` is accepted for API symmetry and ignored.

    Raises:
        OSError: unreadable file. InterruptedError if ``cancelled()`` turns true.
    """
    crc, size, _ = crc32c_chunks(path, cancelled)
    return crc, size


def crc32c_chunks(
    path: str | int, cancelled: Callable[[], bool] | None = None, chunk: int = CHUNK
) -> tuple[int, int, tuple[int, ...]]:
    """(crc32c, size in bytes, crc32c of each ``chunk``-byte chunk) of a file (path or
    open descriptor) in one pass: each chunk's crc is computed once and the file's
    derived from them (:func:`tierfs.store.chunks.crc32c_combine`).

    Raises:
        OSError: unreadable file. InterruptedError if ``cancelled()`` turns true.
    """
    own = isinstance(path, str)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC) if isinstance(path, str) else int(path)
    crc = 0
    size = 0
    crcs: list[int] = []
    try:
        while True:
            data = os.read(fd, chunk)
            if not data:
                break
            c = google_crc32c.value(data)
            while len(data) < chunk:  # a short read inside the file: fill the chunk
                more = os.read(fd, chunk - len(data))
                if not more:
                    break
                c = google_crc32c.extend(c, more)
                data += more
            crcs.append(c)
            crc = crc32c_combine(crc, c, len(data))
            size += len(data)
            if cancelled is not None and cancelled():
                raise InterruptedError("checksum cancelled")
    finally:
        if own:
            os.close(fd)
    return crc, size, tuple(crcs)


#: (ino, size, mtime_ns) -> (crc32c, chunks' crc32c or None for one chunk)
CrcCache = dict[tuple[int, int, int], tuple[int, tuple[int, ...] | None]]

#: entries a :data:`CrcCache` keeps at most (:func:`trim_crc_cache`): about 40 MiB
#: with files of a few chunks; a file forgotten is read again at its next seal
CRC_CACHE_ENTRIES = 200_000


def trim_crc_cache(cache: CrcCache, limit: int = CRC_CACHE_ENTRIES) -> int:
    """Forget the oldest entries of ``cache`` beyond ``limit``; returns how many.

    Without it the cache grew by every file ever sealed for as long as the
    daemon ran (one entry per (inode, size, mtime)). Safe beside a seal in a
    worker thread that reads and adds entries (single dict operations).
    """
    dropped = 0
    while len(cache) > limit:
        try:
            del cache[next(iter(cache))]
        except (KeyError, StopIteration, RuntimeError):
            continue
        dropped += 1
    return dropped


def scan_tree(
    root: str,
    entries: Iterable[str],
    *,
    cache: CrcCache | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> list[FileEntry]:
    """Describe ``root/<entry>`` for each top-level entry, computing crc32c of files
    and, for a file of more than one :data:`CHUNK`, of each chunk (in the same pass;
    the manifest's ``chunk_size`` is then :data:`CHUNK`).

    ``cache`` maps (inode, size, mtime_ns) to a known crc32c so re-seals of
    unchanged files cost a stat, not a read.

    Raises:
        OSError: an entry vanished or is unreadable.
    """
    out: list[FileEntry] = []

    def visit(rel: str) -> None:
        full = os.path.join(root, rel)
        st = os.lstat(full)
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISDIR(st.st_mode):
            out.append(FileEntry(rel, "dir", mode=mode))
            for name in sorted(os.listdir(full)):
                visit(f"{rel}/{name}")
        elif stat.S_ISLNK(st.st_mode):
            out.append(FileEntry(rel, "symlink", mode=0o777, target=os.readlink(full)))
        elif stat.S_ISREG(st.st_mode):
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
            known = cache.get(key) if cache is not None else None
            if known is None:
                crc, size, crcs = crc32c_chunks(full, cancelled)
                if size != st.st_size:
                    raise OSError(f"{rel} changed while it was checksummed")
                known = (crc, crcs if len(crcs) > 1 else None)
                if cache is not None:
                    cache[key] = known
            out.append(
                FileEntry(rel, "file", size=st.st_size, mode=mode, crc32c=known[0], chunks=known[1])
            )
        # sockets, FIFOs and devices are not checkpoint data: skipped

    for entry in entries:
        visit(entry)
    return out


def check_tree(
    root: str, files: Iterable[FileEntry], cancelled: Callable[[], bool] | None = None
) -> list[tuple[str, str]]:
    """Check a copy against its manifest entries; returns (path, problem) pairs, the
    path relative to ``root`` as the manifest names it (empty: verified).

    Every file's size and crc32c, every directory and symlink must match.
    """
    problems: list[tuple[str, str]] = []
    buf = bytearray(CHUNK)
    for f in files:
        full = os.path.join(root, f.path)
        try:
            st = os.lstat(full)
        except OSError:
            problems.append((f.path, "missing"))
            continue
        if f.kind == "dir":
            if not stat.S_ISDIR(st.st_mode):
                problems.append((f.path, "not a directory"))
        elif f.kind == "symlink":
            if not stat.S_ISLNK(st.st_mode) or os.readlink(full) != f.target:
                problems.append((f.path, "symlink differs"))
        else:
            if not stat.S_ISREG(st.st_mode):
                problems.append((f.path, "not a regular file"))
                continue
            if st.st_size != f.size:
                problems.append((f.path, f"size {st.st_size} != {f.size}"))
                continue
            crc, _ = crc32c_file(full, buf, cancelled)
            if crc != f.crc32c:
                problems.append((f.path, f"crc32c {crc:08x} != {f.crc32c:08x}"))
    return problems


def verify_tree(
    root: str, files: Iterable[FileEntry], cancelled: Callable[[], bool] | None = None
) -> list[str]:
    """:func:`check_tree` as lines ``"<path>: <problem>"`` (empty: verified)."""
    return [f"{path}: {why}" for path, why in check_tree(root, files, cancelled)]
