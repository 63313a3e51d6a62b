"""Pure naming and parsing for the GCS tier: bucket specs, rounds, MTC object names.

Nothing here talks to the network; everything is unit-tested.

The bucket layout is the one of GKE multi-tier checkpointing (MTC, PROTOCOL.md
section 5, docs/CLIENTS.md section 8 item 12), so a bucket written by tierfs
can be read by MTC's replicator and vice versa::

    gs://<bucket>/[<prefix>/]<job>/
        restore.version                        a round name: forces that backup
        .tierfs/nodes/<rank>                   bucket rendezvous (JSON, see below)
        <UTC YYYY-MM-DD_HH-MM>/                one directory per backup round
            <job>-s<step>-n<rank>-w<w>.meta    the data hash, no newline (written last)
            <hash>.data                        one object (``pytorch``: file per GPU)
            D<hash>.data/<path>                a "directory" (orbax, pytorch.distributed)
            <job>-s<step>-n<rank>.tierfs.json  tierfs's manifest of that node's part

``<hash>`` is 64 lowercase hex digits (sha256 here) because MTC's restore
only accepts data names matching ``D?[a-z0-9]{64}\\.data``. The
``.tierfs.json`` object is tierfs's addition: the node's shard manifest
(crc32c and size per file, modes, symlinks, empty directories) plus the map
from manifest paths to object names. MTC ignores it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tierfs.core.rounds import ROUND_FORMAT as ROUND_FORMAT
from tierfs.core.rounds import ROUND_RE as ROUND_RE
from tierfs.core.rounds import DedupPlan as DedupPlan
from tierfs.core.rounds import LayoutError as LayoutError
from tierfs.core.rounds import check_round_name as check_round_name
from tierfs.core.rounds import data_column as data_column
from tierfs.core.rounds import dedup_plan as dedup_plan
from tierfs.core.rounds import is_round_name as is_round_name
from tierfs.core.rounds import next_round_name as next_round_name
from tierfs.core.rounds import round_name as round_name
from tierfs.core.rounds import round_time as round_time
from tierfs.core.rounds import uploader_of as uploader_of
from tierfs.core.rounds import uploads_data as uploads_data
from tierfs.store.manifest import FileEntry, Manifest, ManifestError, check_path

META_RE = re.compile(r"^(?P<job>.+)-s(?P<step>\d+)-n(?P<rank>\d+)-w(?P<worker>\d+)\.meta$")
TIERFS_MANIFEST_RE = re.compile(r"^(?P<job>.+)-s(?P<step>\d+)-n(?P<rank>\d+)\.tierfs\.json$")
#: data object names MTC's restore accepts (the top-level part of the name)
DATA_RE = re.compile(r"^D?[a-z0-9]{64}\.data$")
HASH_RE = re.compile(r"^D?[0-9a-f]{64}$")
SAVE_FILE_RE = re.compile(r"^(?P<job>.+)-s(?P<step>\d+)-n(?P<node>\d+)-w(?P<worker>\d+)\.save$")

RESTORE_VERSION = "restore.version"
TIERFS_DIR = ".tierfs"
BACKUP_FORMAT = "tierfs.gcs-backup/1"
RENDEZVOUS_FORMAT = "tierfs.rendezvous/1"

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")


# ---------------------------------------------------------------------- bucket


@dataclass(frozen=True)
class BucketSpec:
    """Where backups live: a bucket and an optional object-name prefix.

    Attributes:
        bucket: the bucket name (``my-bucket``).
        prefix: object-name prefix without leading/trailing slashes (``""`` for none).
    """

    bucket: str
    prefix: str = ""

    def __str__(self) -> str:
        return f"gs://{self.bucket}/{self.prefix + '/' if self.prefix else ''}"

    def job_dir(self, job: str) -> str:
        """Object-name prefix of one job's directory, ending in ``/``."""
        check_job(job)
        return f"{self.prefix}/{job}/" if self.prefix else f"{job}/"

    def round_dir(self, job: str, round_name: str) -> str:
        """Object-name prefix of one backup round, ending in ``/``.

        Raises:
            LayoutError: ``round_name`` is not ``YYYY-MM-DD_HH-MM``.
        """
        check_round_name(round_name)
        return f"{self.job_dir(job)}{round_name}/"

    def restore_version(self, job: str) -> str:
        """Object name of the job's ``restore.version`` (PROTOCOL.md section 5)."""
        return self.job_dir(job) + RESTORE_VERSION

    def rendezvous(self, job: str, rank: int) -> str:
        """Object name where node ``rank`` publishes its peer address."""
        if rank < 0:
            raise LayoutError(f"rank must be >= 0, got {rank}")
        return f"{self.job_dir(job)}{TIERFS_DIR}/nodes/{rank}"

    def round_status_dir(self, job: str, round_name: str) -> str:
        """Prefix of the per-node outcome records of one round, ending in ``/``.

        Only earlier tierfs versions wrote these (rounds now go through the
        coordinator); ``tierfs backups prune`` still deletes them with their round.
        """
        check_round_name(round_name)
        return f"{self.job_dir(job)}{TIERFS_DIR}/rounds/{round_name}/"


def bucket_name_ok(name: str) -> bool:
    """Whether ``name`` follows Cloud Storage's bucket naming rules
    (https://cloud.google.com/storage/docs/buckets#naming): 3-63 characters, or up to
    222 when it contains dots with at most 63 between them; lowercase letters, digits,
    ``-``, ``_`` and ``.``; a letter or digit first and last."""
    if not _BUCKET_RE.match(name) or ".." in name:
        return False
    if "." not in name:
        return len(name) <= 63
    return all(len(part) <= 63 for part in name.split("."))


def parse_bucket(text: str) -> BucketSpec:
    """Parse ``--bucket NAME[/PREFIX]`` (``gs://`` accepted, slashes trimmed).

    Raises:
        LayoutError: empty or invalid bucket name, or a prefix with empty,
            ``.`` or ``..`` components.
    """
    s = text.strip()
    if s.startswith("gs://"):
        s = s[5:]
    s = s.strip("/")
    bucket, _, prefix = s.partition("/")
    if not bucket_name_ok(bucket):
        raise LayoutError(
            f"invalid bucket name in {text!r} (want NAME[/PREFIX]; a bucket name has "
            "3-63 characters (up to 222 with dots, 63 between dots): lowercase letters, "
            "digits, '-', '_', '.', starting and ending with a letter or digit)"
        )
    prefix = prefix.strip("/")
    if prefix:
        for part in prefix.split("/"):
            if part in ("", ".", ".."):
                raise LayoutError(f"invalid prefix in {text!r}")
    return BucketSpec(bucket, prefix)


def check_job(job: str) -> None:
    """A job name must be one safe object-name component.

    Raises:
        LayoutError: empty, contains ``/``, or is ``.``/``..``.
    """
    if not job or "/" in job or job in (".", "..") or "\n" in job:
        raise LayoutError(f"job name {job!r} cannot name a bucket directory")


# ---------------------------------------------------------------------- MTC names


def meta_name(job: str, step: int, rank: int, worker: int = 0) -> str:
    """``<job>-s<step>-n<rank>-w<worker>.meta`` (MTC's pointer object)."""
    return f"{job}-s{step}-n{rank}-w{worker}.meta"


def parse_meta_name(name: str) -> tuple[str, int, int, int] | None:
    """(job, step, rank, worker) of a ``.meta`` name, or None."""
    m = META_RE.match(name)
    if not m:
        return None
    return m["job"], int(m["step"]), int(m["rank"]), int(m["worker"])


def tierfs_manifest_name(job: str, step: int, rank: int) -> str:
    """Name of tierfs's per-node manifest object inside a round directory."""
    return f"{job}-s{step}-n{rank}.tierfs.json"


def parse_tierfs_manifest_name(name: str) -> tuple[str, int, int] | None:
    """(job, step, rank) of a ``.tierfs.json`` name, or None."""
    m = TIERFS_MANIFEST_RE.match(name)
    if not m:
        return None
    return m["job"], int(m["step"]), int(m["rank"])


def data_name(digest: str) -> str:
    """``<hash>.data`` (``D<hash>.data`` for directory data).

    Raises:
        LayoutError: ``digest`` is not ``D?`` plus 64 lowercase hex digits.
    """
    if not HASH_RE.match(digest):
        raise LayoutError(f"bad data hash {digest!r}")
    return f"{digest}.data"


def check_meta_content(text: str) -> str:
    """The hash held by a ``.meta`` object (MTC: no newline; surrounding space tolerated).

    Raises:
        LayoutError: not a valid hash.
    """
    h = text.strip()
    if not HASH_RE.match(h):
        raise LayoutError(f".meta does not hold a data hash: {text[:80]!r}")
    return h


# ---------------------------------------------------------------------- object layout


@dataclass(frozen=True)
class Upload:
    """One data object of a node's part of a round.

    Attributes:
        path: the file's path in the shard manifest (relative to the shard's ``data/``).
        name: the object name relative to the round directory.
        size: bytes.
        crc32c: the file's crc32c from the manifest (GCS verifies it).
    """

    path: str
    name: str
    size: int
    crc32c: int


@dataclass(frozen=True)
class NodeLayout:
    """How one node's shard maps onto objects of a round (see the module docstring).

    Attributes:
        hashes: worker index -> data hash (the ``.meta`` contents).
        objects: manifest path of every file -> object name relative to the round dir.
        uploads: the data objects as :class:`Upload` records, manifest order.
    """

    hashes: dict[int, str]
    objects: dict[str, str]
    uploads: tuple[Upload, ...] = field(default=())


def _digest(parts: Iterable[str]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode("utf-8", "surrogateescape"))
        h.update(b"\n")
    return h.hexdigest()


def _describe(files: Iterable[FileEntry], strip: str) -> list[str]:
    out = []
    for f in sorted(files, key=lambda e: e.path):
        rel = f.path[len(strip) :] if strip else f.path
        out.append(f"{rel}\0{f.kind}\0{f.size}\0{f.crc32c}\0{f.target}\0{f.mode:o}")
    return out


def node_layout(manifest: Manifest, *, column: int | None = None) -> NodeLayout:
    """Map a shard manifest onto MTC object names.

    * ``pytorch`` (file per GPU): each ``<job>-s<step>-n<node>-w<w>.save`` file
      becomes one object ``<hash>.data`` with ``w`` as its worker.
    * A single top-level directory (orbax, pytorch.distributed, a generic
      ``checkpoint-<N>/``) becomes ``D<hash>.data/<path inside it>``: MTC's
      ``.data`` *is* the step directory.
    * Anything else (several top-level entries, a top-level file) becomes
      ``D<hash>.data/<full path>``.

    The hash is sha256 over the job, step, data-parallel ``column`` (default:
    the rank) and the canonical file list (paths relative to the data root,
    kind, size, crc32c, link target, mode). Ranks of one data-parallel column
    holding identical data therefore get the same hash and names; different
    columns never collide.
    """
    col = manifest.rank if column is None else column
    head = ["tierfs.data/1", manifest.job, str(manifest.step), str(col)]
    files = list(manifest.files)
    hashes: dict[int, str] = {}
    objects: dict[str, str] = {}
    rest = files
    if manifest.framework == "pytorch":
        rest = []
        workers: dict[str, int] = {}
        for f in files:
            m = SAVE_FILE_RE.match(f.path)
            if f.kind == "file" and m is not None:
                workers[f.path] = int(m["worker"])
        by_path = {f.path: f for f in files}
        for path, worker in sorted(workers.items(), key=lambda kv: kv[1]):
            f = by_path[path]
            digest = _digest([*head, f"w{worker}", *_describe([f], "")])
            hashes[worker] = digest
            objects[path] = data_name(digest)
        rest = [f for f in files if f.path not in workers]
    if rest or not hashes:
        tops = {f.path.split("/", 1)[0] for f in rest}
        top_dirs = {f.path for f in rest if f.kind == "dir" and "/" not in f.path}
        strip = ""
        if len(tops) == 1 and tops == top_dirs:
            strip = next(iter(tops)) + "/"
        digest = "D" + _digest([*head, "dir", f"root={strip}", *_describe(rest, strip)])
        if 0 not in hashes:
            hashes[0] = digest
        base = data_name(digest)
        for f in rest:
            if f.kind != "file":
                continue
            rel = f.path[len(strip) :] if strip else f.path
            objects[f.path] = f"{base}/{rel}"
    uploads = tuple(
        Upload(f.path, objects[f.path], f.size, f.crc32c or 0) for f in files if f.kind == "file"
    )
    return NodeLayout(hashes, objects, uploads)


# ---------------------------------------------------------------------- tierfs manifest object


@dataclass(frozen=True)
class NodeBackup:
    """tierfs's per-node manifest object (``<job>-s<step>-n<rank>.tierfs.json``).

    Attributes:
        manifest: the shard manifest (crc32c per file).
        round: the round directory name.
        nodes: number of nodes of the job when it was written.
        uploader: the rank that uploaded the data objects (differs with data parallelism).
        data_parallelism: the job's ``assume-data-parallelism`` (None: off).
        hashes: worker -> data hash (equal to the ``.meta`` contents).
        objects: manifest file path -> object name relative to the round dir.
        created: Unix time (seconds) when the object was written.
    """

    manifest: Manifest
    round: str
    nodes: int
    uploader: int
    data_parallelism: int | None
    hashes: dict[int, str]
    objects: dict[str, str]
    created: float = 0.0

    def to_json(self) -> bytes:
        """Serialize (stable key order, UTF-8)."""
        d: dict[str, Any] = {
            "format": BACKUP_FORMAT,
            "round": self.round,
            "nodes": self.nodes,
            "job": self.manifest.job,
            "rank": self.manifest.rank,
            "step": self.manifest.step,
            "uploader": self.uploader,
            "data_parallelism": self.data_parallelism,
            "hashes": {str(k): v for k, v in sorted(self.hashes.items())},
            "objects": self.objects,
            "created": self.created,
            "manifest": json.loads(self.manifest.to_json()),
        }
        return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> NodeBackup:
        """Parse and validate (manifest paths and object names are checked).

        Raises:
            LayoutError: malformed JSON, unknown format, unsafe names, or an
                object map that does not cover every file of the manifest.
        """
        try:
            d = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise LayoutError(f"backup manifest is not JSON: {exc}") from None
        if not isinstance(d, dict) or d.get("format") != BACKUP_FORMAT:
            raise LayoutError("not a tierfs backup manifest")
        try:
            manifest = Manifest.from_obj(d["manifest"])
            hashes = {int(k): check_meta_content(str(v)) for k, v in d["hashes"].items()}
            objects = {str(k): str(v) for k, v in d["objects"].items()}
            nb = cls(
                manifest=manifest,
                round=str(d["round"]),
                nodes=int(d["nodes"]),
                uploader=int(d["uploader"]),
                data_parallelism=(
                    int(d["data_parallelism"]) if d.get("data_parallelism") else None
                ),
                hashes=hashes,
                objects=objects,
                created=float(d.get("created", 0)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, LayoutError):
                raise
            raise LayoutError(f"malformed backup manifest: {exc}") from None
        files = {f.path for f in manifest.files if f.kind == "file"}
        if set(objects) != files:
            raise LayoutError("backup manifest: object map does not match the file list")
        for name in objects.values():
            try:
                check_path(name)
            except ManifestError as exc:
                raise LayoutError(str(exc)) from None
            if not DATA_RE.match(name.split("/", 1)[0]):
                raise LayoutError(f"backup manifest: object {name!r} is not under a data name")
        return nb


# ---------------------------------------------------------------------- rendezvous


def rendezvous_record(address: str, rank: int, *, incarnation: str, written: float) -> bytes:
    """The JSON a node writes to ``.tierfs/nodes/<rank>``.

    Args:
        address: ``HOST:PORT`` where its peer service listens.
        rank: the node rank.
        incarnation: a random id of this daemon start (readers can tell restarts apart).
        written: Unix time in seconds.
    """
    return json.dumps(
        {
            "format": RENDEZVOUS_FORMAT,
            "address": address,
            "rank": rank,
            "incarnation": incarnation,
            "written": written,
        },
        sort_keys=True,
    ).encode()


@dataclass(frozen=True)
class RendezvousRecord:
    """A parsed ``.tierfs/nodes/<rank>`` object."""

    address: str
    rank: int
    incarnation: str
    written: float


def parse_rendezvous(data: bytes | str) -> RendezvousRecord:
    """Parse a rendezvous object (a bare ``HOST:PORT`` text is accepted too).

    Raises:
        LayoutError: neither JSON of the expected format nor ``HOST:PORT``.
    """
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    text = text.strip()
    try:
        d = json.loads(text)
    except ValueError:
        d = None
    if isinstance(d, dict):
        if d.get("format") != RENDEZVOUS_FORMAT or not isinstance(d.get("address"), str):
            raise LayoutError("not a tierfs rendezvous record")
        try:
            return RendezvousRecord(
                d["address"],
                int(d.get("rank", -1)),
                str(d.get("incarnation", "")),
                float(d.get("written", 0)),
            )
        except (TypeError, ValueError) as exc:
            raise LayoutError(f"malformed rendezvous record: {exc}") from None
    host, sep, port = text.rpartition(":")
    if sep and host and port.isdigit():
        return RendezvousRecord(text, -1, "", 0.0)
    raise LayoutError(f"rendezvous object holds no address: {text[:80]!r}")
