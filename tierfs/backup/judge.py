"""Judging backup rounds from a listing: pure, no I/O (issue 19).

The rule: a step of a round is complete only if every rank's data objects
are present and match their checksums. :meth:`tierfs.backup.bucket.GcsBackend.
inspect_round` lists a round once, reads the parts' ``.tierfs.json``
manifests, and hands the result here as a :class:`RoundInfo`;
:func:`judge_round` fills in each part's problems and the newest step complete
for every node. ``tierfs backups list/show/prune``, the restore choice and the
coordinator's bucket fallback all use this one judgement.

Tested as a property against the bytes each rank sealed
(tests/unit/test_gcs_judging.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from tierfs.backup import layout as L
from tierfs.backup.layout import NodeBackup


@dataclass(frozen=True)
class ObjectInfo:
    """An object as listed: name relative to the round dir, bytes, crc32c (None if absent)."""

    name: str
    size: int
    crc32c: int | None
    updated: float = 0.0


@dataclass
class NodeEntry:
    """One node's part of one step in a round.

    Attributes:
        rank, step: whose part.
        metas: worker -> the hash its ``.meta`` holds (None: unreadable pointer).
        backup: tierfs's manifest object, or None (missing, or a round written by MTC).
        missing: human-readable problems (missing/short/corrupt objects...).
        notes: problems found while reading the round (kept by :func:`judge_round`).
        bytes: bytes of the data objects this part names.
        foreign: written without a tierfs manifest (MTC); completeness is then
            judged from the data objects' presence only.
    """

    rank: int
    step: int
    metas: dict[int, str | None] = field(default_factory=dict)
    backup: NodeBackup | None = None
    missing: list[str] = field(default_factory=list)
    bytes: int = 0
    foreign: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """The pointer exists and every data object the part names is there and intact."""
        return bool(self.metas) and not self.missing


@dataclass
class RoundInfo:
    """What one backup round directory holds.

    Attributes:
        name: ``YYYY-MM-DD_HH-MM``.
        nodes: the number of nodes judged against (given, or from the manifests).
        parts: (rank, step) -> :class:`NodeEntry` for every pointer or manifest found.
        objects: every object under the round dir, by relative name.
        total_bytes: sum of all object sizes in the round dir.
        complete_step: the newest step complete for every rank 0..nodes-1, or None.
        error: set when the round could not be read at all.
        recorded_nodes: the largest node count the round's tierfs manifests
            record (0: none, e.g. a round written by MTC).
    """

    name: str
    nodes: int
    parts: dict[tuple[int, int], NodeEntry] = field(default_factory=dict)
    objects: dict[str, ObjectInfo] = field(default_factory=dict)
    total_bytes: int = 0
    complete_step: int | None = None
    error: str | None = None
    recorded_nodes: int = 0

    @property
    def ranks_seen(self) -> int:
        """The highest rank with a pointer or manifest in the round, plus one (0: none)."""
        return max((r for r, _ in self.parts), default=-1) + 1

    @property
    def complete(self) -> bool:
        """Usable for a restore: some step is complete for every node."""
        return self.complete_step is not None

    @property
    def steps(self) -> list[int]:
        """Steps with at least one part, newest first."""
        return sorted({s for _r, s in self.parts}, reverse=True)

    def step_for_display(self) -> int | None:
        """The complete step, else the newest step seen."""
        if self.complete_step is not None:
            return self.complete_step
        steps = self.steps
        return steps[0] if steps else None

    def ranks_present(self, step: int | None = None) -> list[int]:
        """Ranks with a pointer (of ``step``, or of any step)."""
        return sorted(
            {r for (r, s), e in self.parts.items() if e.metas and (step is None or s == step)}
        )

    def ranks_complete(self, step: int) -> list[int]:
        """Ranks whose part of ``step`` is complete."""
        return sorted(r for (r, s), e in self.parts.items() if s == step and e.complete)

    def problems(self, step: int | None = None) -> list[str]:
        """Why the round (or ``step`` in it) is not usable, one line each."""
        if self.error:
            return [self.error]
        step = self.step_for_display() if step is None else step
        if step is None:
            return ["no node pointer (.meta) in this round"]
        out = []
        for r in range(self.nodes):
            e = self.parts.get((r, step))
            if e is None or not e.metas:
                out.append(f"rank {r}: no pointer for step {step}")
            else:
                out.extend(f"rank {r}: {m}" for m in e.missing[:3])
                if len(e.missing) > 3:
                    out.append(f"rank {r}: ... {len(e.missing) - 3} more")
        return out

    def bytes_of(self, step: int) -> int:
        """Bytes of the data objects the parts of ``step`` name (deduplicated)."""
        seen: set[str] = set()
        total = 0
        for (_r, s), e in self.parts.items():
            if s != step or e.backup is None:
                continue
            for name in e.backup.objects.values():
                if name not in seen and name in self.objects:
                    seen.add(name)
                    total += self.objects[name].size
        return total


def meta_crc(digest: str) -> int:
    """The crc32c a ``.meta`` object holding ``digest`` (no newline) is listed with."""
    import google_crc32c

    return int(google_crc32c.value(digest.encode("ascii")))


def check_object(name: str, obj: ObjectInfo | None, size: int, crc: int | None) -> str | None:
    """Why the listed object ``obj`` (None: not listed) does not prove ``size`` bytes
    with crc32c ``crc`` (None: any crc32c), as one line; None when it does."""
    if obj is None:
        return f"{name}: missing"
    if obj.size != size:
        return f"{name}: {obj.size} bytes, manifest {size}"
    if obj.crc32c is None:
        return f"{name}: no crc32c in the listing"
    if crc is not None and obj.crc32c != crc:
        return f"{name}: crc32c {obj.crc32c:08x} differs from the manifest's {crc:08x}"
    return None


def _judge_foreign(part: NodeEntry, objects: dict[str, ObjectInfo], dir_prefixes: set[str]) -> None:
    """A part without a tierfs manifest (MTC): each pointer's data is listed (one
    ``<hash>.data`` object, or objects under ``D<hash>.data/``), each with a crc32c."""
    for _w, h in part.metas.items():
        if h is None:
            continue
        dname = L.data_name(h)
        if dname in objects:
            names = [dname]
        elif dname in dir_prefixes:
            names = [n for n in objects if n.startswith(dname + "/")]
        else:
            part.missing.append(f"{dname}: missing")
            continue
        for n in names:
            o = objects[n]
            if o.crc32c is None:
                part.missing.append(f"{n}: no crc32c in the listing")
            else:
                part.bytes += o.size


def _judge_tierfs(part: NodeEntry, nb: NodeBackup, objects: dict[str, ObjectInfo]) -> None:
    """A part with a tierfs manifest: pointers name the manifest's hashes, and every
    file's object lies under one of those hashes' data names and is listed with the
    manifest's size and crc32c."""
    for w, h in nb.hashes.items():
        got = part.metas.get(w, "absent")
        if got == "absent":
            part.missing.append(f"no .meta for worker {w}")
        elif got is not None and got != h:
            part.missing.append(f".meta for worker {w} names {got}, manifest {h}")
    heads = {L.data_name(h) for h in nb.hashes.values()}
    sizes = {f.path: f for f in nb.manifest.files if f.kind == "file"}
    for path, name in sorted(nb.objects.items()):
        entry = sizes[path]
        if name.split("/", 1)[0] not in heads:
            part.missing.append(f"{name}: not under the data its .meta names")
            continue
        problem = check_object(name, objects.get(name), entry.size, entry.crc32c)
        if problem is not None:
            part.missing.append(problem)
        else:
            part.bytes += entry.size


def judge_round(info: RoundInfo) -> RoundInfo:
    """Fill in each part's problems and the round's ``complete_step`` (pure).

    The rule: a step is complete only if, for every rank 0..nodes-1, the
    rank's data objects are present and match their checksums. From the
    listing alone (names, sizes, crc32c) and the parts' manifests:

    * A part (rank, step) with a tierfs manifest is complete when it has a
      ``.meta`` for every worker its manifest lists, each holding the
      manifest's hash, and every file the manifest names has its object in
      the listing -- under the data name of one of those hashes (where MTC's
      reader looks) -- with the manifest's size and crc32c. An object the
      listing gives no crc32c for proves nothing.
    * A part without one (an MTC-written round) is complete when its pointer
      is readable and its data is listed -- the ``<hash>.data`` object, or at
      least one object under ``D<hash>.data/`` -- each object with a crc32c
      (which the restore then checks the bytes against). In a round written
      by tierfs (some part has a manifest) a part without one is incomplete:
      tierfs writes the manifest before the pointer, so its data cannot be
      judged.

    Objects no part names (leftovers, another step's data) change nothing.
    """
    objects = info.objects
    dir_prefixes: set[str] = set()
    for name in objects:
        head, sep, _ = name.partition("/")
        if sep:
            dir_prefixes.add(head)
    tierfs_round = any(p.backup is not None for p in info.parts.values())
    for part in info.parts.values():
        part.missing = list(part.notes)
        part.bytes = 0
        part.foreign = part.backup is None
        if not part.metas:
            part.missing.append("no .meta pointer")
        for w, h in part.metas.items():
            if h is None:
                part.missing.append(f"unreadable .meta for worker {w}")
        if part.backup is None and tierfs_round:
            if not part.notes:
                part.missing.append("no .tierfs.json manifest (the round's other parts have one)")
        elif part.backup is None:
            _judge_foreign(part, objects, dir_prefixes)
        else:
            _judge_tierfs(part, part.backup, objects)
    info.complete_step = None
    for step in info.steps:
        if all(
            (r, step) in info.parts and info.parts[(r, step)].complete for r in range(info.nodes)
        ):
            info.complete_step = step
            break
    return info


def infer_job_nodes(rounds: Iterable[RoundInfo]) -> int | None:
    """A job's node count from its rounds (pure; ``rounds`` newest first): the count
    the newest round with a tierfs manifest records, else the most ranks any
    round holds (highest rank + 1); None if no round tells anything.

    A round written by MTC has no manifest, so on its own its node count can
    only be guessed from the ranks present, and a round missing its last
    ranks would look complete; the job's other rounds know better.
    """
    rounds = list(rounds)
    for info in rounds:
        if info.recorded_nodes > 0:
            return info.recorded_nodes
    most = max((info.ranks_seen for info in rounds if not info.error), default=0)
    return most or None


def apply_job_nodes(rounds: Iterable[RoundInfo], nodes: int | None) -> None:
    """Judge every round that records no node count (MTC-written) against ``nodes``
    (at least its own highest rank + 1) instead of the ranks it happens to hold.
    Rounds with tierfs manifests keep the count they record."""
    if not nodes:
        return
    for info in rounds:
        if info.error or info.recorded_nodes:
            continue
        want = max(nodes, info.ranks_seen)
        if want != info.nodes:
            info.nodes = want
            judge_round(info)
