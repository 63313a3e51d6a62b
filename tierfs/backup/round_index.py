"""The round index: one object per backup round naming every part's manifest
(issue #17), so a restoring node reads its part in two GETs instead of listing
the round and reading every manifest.

``<round>/<job>.tierfs-index.json`` (neither MTC's reader nor tierfs's judge
looks at it: to both it is an object no part names)::

    {"format": "tierfs.round-index/1", "job": ..., "round": ..., "written": <unix s>,
     "parts": [{"rank": r, "step": s, "manifest": "<name>", "size": <bytes>,
                "crc32c": <int>, "pointers": {"<worker>": <crc32c>}}, ...]}

It only points: a reader checks the manifest it names against the recorded
size and crc32c (the bytes it read, not the listing), and the pointers' crc32c
against the hashes that manifest names; the download then checks every data
byte against the manifest. Whatever does not verify -- no index (rounds from
before it, a writer that crashed, MTC's rounds), an unreadable one, a part it
does not name, a manifest that changed -- falls back to judging the round from
its listing (:meth:`tierfs.backup.listing.RoundListing.inspect_round`).

Written by node-rank 0 (one node: the node) once the round is complete: one
listing of the round's top level (delimiter ``/``: manifests, pointers, data
names, not the data objects) and one write.

Blocking (HTTP); every request goes through :class:`tierfs.backup.bucket.ObjectStore`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierfs.backup import layout as L
from tierfs.backup.client import crc_from_b64
from tierfs.backup.judge import NodeEntry, RoundInfo, meta_crc
from tierfs.backup.layout import LayoutError, NodeBackup

if TYPE_CHECKING:
    from tierfs.backup.bucket import ObjectStore

INDEX_FORMAT = "tierfs.round-index/1"


def index_name(job: str) -> str:
    """The index object's name relative to the round directory."""
    L.check_job(job)
    return f"{job}.tierfs-index.json"


@dataclass(frozen=True)
class IndexedPart:
    """One part as the index records it (sizes in bytes, crc32c as integers).

    Attributes:
        rank, step: whose part. manifest: its ``.tierfs.json`` name in the round.
        size, crc32c: of that manifest object. pointers: worker -> the ``.meta``'s crc32c.
    """

    rank: int
    step: int
    manifest: str
    size: int
    crc32c: int
    pointers: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class RoundIndex:
    """A round's index (see the module docstring)."""

    job: str
    round: str
    parts: tuple[IndexedPart, ...]
    written: float = 0.0

    def to_json(self) -> bytes:
        """Serialize (stable key order, UTF-8)."""
        return json.dumps(
            {
                "format": INDEX_FORMAT,
                "job": self.job,
                "round": self.round,
                "written": self.written,
                "parts": [
                    {
                        "rank": p.rank,
                        "step": p.step,
                        "manifest": p.manifest,
                        "size": p.size,
                        "crc32c": p.crc32c,
                        "pointers": {str(w): c for w, c in sorted(p.pointers.items())},
                    }
                    for p in self.parts
                ],
            },
            sort_keys=True,
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> RoundIndex:
        """Parse and validate.

        Raises:
            LayoutError: not JSON, another format, or malformed entries.
        """
        try:
            d = json.loads(data)
            if not isinstance(d, dict) or d.get("format") != INDEX_FORMAT:
                raise LayoutError("not a tierfs round index")
            parts = tuple(
                IndexedPart(
                    int(p["rank"]),
                    int(p["step"]),
                    str(p["manifest"]),
                    int(p["size"]),
                    int(p["crc32c"]),
                    {int(w): int(c) for w, c in p.get("pointers", {}).items()},
                )
                for p in d["parts"]
            )
            return cls(str(d["job"]), str(d["round"]), parts, float(d.get("written", 0)))
        except LayoutError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
            raise LayoutError(f"malformed round index: {exc}") from None

    def part(self, rank: int, step: int) -> IndexedPart | None:
        """The entry of node ``rank``'s part of ``step``, or None."""
        for p in self.parts:
            if (p.rank, p.step) == (rank, step):
                return p
        return None


def index_from_listing(
    job: str, round_name: str, listed: dict[str, tuple[int, int | None]]
) -> RoundIndex:
    """The index of a round from its top-level listing (pure).

    Args:
        listed: object name relative to the round dir -> (size, crc32c or None).

    Every manifest of ``job`` with a crc32c is named, with the crc32c of each of
    its listed pointers.
    """
    metas: dict[tuple[int, int], dict[int, int]] = {}
    for name, (_size, crc) in listed.items():
        m = L.parse_meta_name(name)
        if m is not None and m[0] == job and crc is not None:
            metas.setdefault((m[2], m[1]), {})[m[3]] = crc
    parts = []
    for name, (size, crc) in sorted(listed.items()):
        t = L.parse_tierfs_manifest_name(name)
        if t is None or t[0] != job or crc is None:
            continue
        parts.append(IndexedPart(t[2], t[1], name, size, crc, metas.get((t[2], t[1]), {})))
    return RoundIndex(job, round_name, tuple(parts), time.time())


def part_from_index(
    index: RoundIndex, rank: int, step: int, manifest: bytes | None
) -> NodeEntry | None:
    """Node ``rank``'s part of ``step`` if ``manifest`` (the bytes read from the object
    the index names) verifies, else None (pure).

    Verifies: the bytes' size and crc32c are the index's, they parse as the
    manifest of that part, and every pointer its hashes need is recorded with
    the crc32c of that hash.
    """
    import google_crc32c

    entry = index.part(rank, step)
    if entry is None or manifest is None:
        return None
    if len(manifest) != entry.size or int(google_crc32c.value(manifest)) != entry.crc32c:
        return None
    try:
        nb = NodeBackup.from_json(manifest)
    except LayoutError:
        return None
    m = nb.manifest
    if (m.job, m.rank, m.step) != (index.job, rank, step) or not nb.hashes:
        return None
    for worker, digest in nb.hashes.items():
        if entry.pointers.get(worker) != meta_crc(digest):
            return None
    objects = nb.manifest.files
    part = NodeEntry(rank, step, metas=dict(nb.hashes), backup=nb)
    part.bytes = sum(f.size for f in objects if f.kind == "file")
    return part


class RoundIndexes:
    """Writing and reading round indexes of one bucket spec (thread-safe).

    Args:
        objects: the bucket's objects (the only way to the bucket).
    """

    def __init__(self, objects: ObjectStore) -> None:
        self.objects = objects
        self.spec = objects.spec

    def write(self, job: str, round_name: str) -> RoundIndex:
        """List the round's top level and write its index (one listing, one write).

        Raises:
            google.api_core exceptions after retries; BucketTimeout.
        """
        index = self._listed(job, round_name)
        self._put(job, round_name, index)
        return index

    def _listed(self, job: str, round_name: str) -> RoundIndex:
        """The index of the round from one listing of its top level (not written)."""
        prefix = self.spec.round_dir(job, round_name)
        blobs, _ = self.objects.listing(prefix, delimiter="/")
        listed = {b.name[len(prefix) :]: (int(b.size or 0), crc_from_b64(b.crc32c)) for b in blobs}
        return index_from_listing(job, round_name, listed)

    def _put(self, job: str, round_name: str, index: RoundIndex) -> None:
        prefix = self.spec.round_dir(job, round_name)
        self.objects.put_bytes(prefix + index_name(job), index.to_json(), "application/json")

    def ensure(self, job: str, round_name: str) -> RoundIndex | None:
        """Write the index of a complete round that has none (one GET; without an index
        one listing and one write more); returns the index written, or None when
        one was there or the round holds no tierfs manifest to name (a round MTC
        wrote). For the coordinator's reader, which just judged the round complete:
        a round whose index was never written (node-rank 0 died first, the write
        failed) cost every restoring node a listing of the whole round, N listings
        of N parts (review of #17).

        Raises:
            google.api_core exceptions after retries; BucketTimeout.
        """
        prefix = self.spec.round_dir(job, round_name)
        if self.objects.get_bytes(prefix + index_name(job)) is not None:
            return None
        index = self._listed(job, round_name)
        if not index.parts:
            return None
        self._put(job, round_name, index)
        return index

    def read_part(
        self, job: str, round_name: str, rank: int, step: int, nodes: int
    ) -> RoundInfo | None:
        """A round holding only node ``rank``'s part of ``step``, read through the index
        (two GETs), or None when the index is absent, unreadable, or does not
        verify that part (the caller then judges the round from its listing).

        Raises:
            google.api_core exceptions after retries; BucketTimeout.
        """
        prefix = self.spec.round_dir(job, round_name)
        data = self.objects.get_bytes(prefix + index_name(job))
        if data is None:
            return None
        try:
            index = RoundIndex.from_json(data)
        except LayoutError:
            return None
        if (index.job, index.round) != (job, round_name):
            return None
        entry = index.part(rank, step)
        if entry is None:
            return None
        part = part_from_index(index, rank, step, self.objects.get_bytes(prefix + entry.manifest))
        if part is None or part.backup is None:
            return None
        return RoundInfo(
            round_name,
            part.backup.nodes or nodes,
            {(rank, step): part},
            {},
            part.bytes,
            recorded_nodes=part.backup.nodes,
        )
