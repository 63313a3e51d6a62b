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

import datetime as dt
import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tierfs.core.errors import BackupError
from tierfs.store.manifest import FileEntry, Manifest, ManifestError, check_path

#: ``YYYY-MM-DD_HH-MM`` in UTC: the name of one backup round directory
ROUND_FORMAT = "%Y-%m-%d_%H-%M"
ROUND_RE = re.compile(r"^\d{4}-\d{2}-\d{2}_\d{2}-\d{2}$")
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


class LayoutError(BackupError, ValueError):
    """A bucket spec, object name or backup manifest is malformed."""


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
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise LayoutError(
            f"invalid bucket name in {text!r} (want NAME[/PREFIX], "
            "lowercase letters, digits, '-', '_', '.')"
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


# ---------------------------------------------------------------------- rounds


def round_name(when: float | dt.datetime) -> str:
    """The round directory name for a time: UTC, minute resolution.

    Args:
        when: Unix time in seconds, or an aware datetime (naive ones are taken as UTC).
    """
    if isinstance(when, dt.datetime):
        t = when if when.tzinfo else when.replace(tzinfo=dt.UTC)
    else:
        t = dt.datetime.fromtimestamp(when, dt.UTC)
    return t.astimezone(dt.UTC).strftime(ROUND_FORMAT)


def round_time(name: str) -> dt.datetime:
    """The UTC start minute a round name stands for.

    Raises:
        LayoutError: not ``YYYY-MM-DD_HH-MM``.
    """
    check_round_name(name)
    try:
        return dt.datetime.strptime(name, ROUND_FORMAT).replace(tzinfo=dt.UTC)
    except ValueError as exc:
        raise LayoutError(f"bad round name {name!r}: {exc}") from None


def check_round_name(name: str) -> None:
    """Raises LayoutError unless ``name`` is ``YYYY-MM-DD_HH-MM``."""
    if not ROUND_RE.match(name or ""):
        raise LayoutError(f"bad round name {name!r} (want UTC YYYY-MM-DD_HH-MM)")


def is_round_name(name: str) -> bool:
    """True for a valid ``YYYY-MM-DD_HH-MM`` name."""
    try:
        round_time(name)
    except LayoutError:
        return False
    return True


def next_round_name(when: float, previous: str | None) -> str:
    """A round name for ``when`` that sorts after ``previous`` (the same minute is bumped).

    Two rounds started in the same minute would share a directory; the
    coordinator uses this to give the second one the next minute's name.
    """
    name = round_name(when)
    if previous is not None and name <= previous:
        name = round_name(round_time(previous) + dt.timedelta(minutes=1))
    return name


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


# ---------------------------------------------------------------------- data parallelism


def uploads_data(rank: int, nodes: int, data_parallelism: int | None) -> bool:
    """Does ``rank`` upload data objects (else only its ``.meta`` and manifest)?

    With ``assume-data-parallelism`` D the ranks form a D x (nodes/D) grid
    whose columns hold identical data; as in MTC only the last row
    (``rank >= nodes - nodes // D``) uploads data. Without it every rank does.
    """
    if not data_parallelism or data_parallelism <= 1 or nodes % data_parallelism:
        return True
    return rank >= nodes - nodes // data_parallelism


def data_column(rank: int, nodes: int, data_parallelism: int | None) -> int:
    """The data-parallel column of ``rank`` (= ``rank`` without data parallelism)."""
    if not data_parallelism or data_parallelism <= 1 or nodes % data_parallelism:
        return rank
    return rank % (nodes // data_parallelism)


def uploader_of(rank: int, nodes: int, data_parallelism: int | None) -> int:
    """The rank whose data objects ``rank``'s ``.meta`` points at."""
    if uploads_data(rank, nodes, data_parallelism):
        return rank
    cols = nodes // data_parallelism  # type: ignore[operator]
    return nodes - cols + rank % cols


@dataclass(frozen=True)
class DedupPlan:
    """Which ranks of a data-parallel job may point at their uploader's data for one step.

    Attributes:
        dedup: ranks (never an uploader) whose shard digest equals their
            column's uploader's: they upload no data once the bucket proves
            the objects are there (:meth:`tierfs.backup.bucket.GcsBackend.upload_shard`).
        differing: ``(uploader, ranks)`` for every column where some rank's
            digest differs from the uploader's (``ranks`` sorted, the uploader
            included): ``assume-data-parallelism`` did not hold there, every
            rank of it uploads its own data.
    """

    dedup: frozenset[int] = frozenset()
    differing: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def describe(self, step: int, data_parallelism: int | None) -> str:
        """One line for ``replicator.errors`` (empty when nothing differs)."""
        if not self.differing:
            return ""
        groups = "; ".join(
            f"node-ranks {list(ranks)} (uploader {u})" for u, ranks in self.differing
        )
        return (
            f"assume-data-parallelism {data_parallelism} did not hold for step {step}: "
            f"the shards of {groups} differ (their manifests' checksums), so each of "
            "these nodes uploads its own data"
        )


def dedup_plan(
    digests: dict[int, str | None], nodes: int, data_parallelism: int | None
) -> DedupPlan:
    """Who may skip uploading data for one step (pure): checksums, not the claim.

    Args:
        digests: rank -> the manifest digest of its own shard of the step
            (:attr:`tierfs.store.manifest.Manifest.digest`), None or absent when the
            rank does not hold it.
        nodes: the job's node count.
        data_parallelism: the job's ``assume-data-parallelism`` (None/1: no dedup).

    A rank dedups only when its digest and its uploader's are both known and
    equal. A rank or uploader without the step is no sign of differing data
    (it cannot upload anyway) and is not reported.
    """
    dedup: set[int] = set()
    groups: dict[int, set[int]] = {}
    for r in range(nodes):
        u = uploader_of(r, nodes, data_parallelism)
        if u == r:
            continue
        mine, theirs = digests.get(r), digests.get(u)
        if mine is None or theirs is None:
            continue
        if mine == theirs:
            dedup.add(r)
        else:
            groups.setdefault(u, {u}).add(r)
    differing = tuple((u, tuple(sorted(rs))) for u, rs in sorted(groups.items()))
    return DedupPlan(frozenset(dedup), differing)


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
            manifest = Manifest.from_json(json.dumps(d["manifest"]))
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
